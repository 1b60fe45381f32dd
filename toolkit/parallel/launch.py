"""The rank environment DeepSpeed and FSDP need, set the same way on a GPU and on a CPU (who started
the process and what its launcher says about the layout: `toolkit.layout.launcher`).

What each launcher leaves in the environment (read off each here: accelerate 1.15, torch 2.13,
deepspeed 0.19; `tests/test_launchers.py` runs every form):

| launch | RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT | marked by |
|---|---|---|
| `python finetune.py` | none | - |
| `accelerate launch`, one process, no DeepSpeed/FSDP | none | ACCELERATE_MIXED_PRECISION |
| `accelerate launch --use_deepspeed/--use_fsdp/--multi_gpu` or a config naming one | all (torch.distributed.run
inside) | ACCELERATE_USE_DEEPSPEED/_FSDP |
| `torchrun` | all | TORCHELASTIC_RUN_ID |
| `deepspeed` | all but LOCAL_WORLD_SIZE (it sets LOCAL_SIZE) | `--local_rank=K` in argv, CROSS_RANK |

DeepSpeed and FSDP need a process group even for one process: with the one-process variables set on the
CPU path only, `accelerate launch --num_processes 1 finetune.py --zero-stage 3` on a GPU dies with "Default
process group has not been initialized". `rank_env` is the one place they are set, with no device branch.
"""

from __future__ import annotations

import os
import socket
from typing import Callable, Mapping

RANK_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def on_cuda() -> bool:
    """The one question the launch set-up's CUDA-only branches ask (accelerate's device, the CPU
    rehearsal, DeepSpeed's comm overlap). Tests answer True on a CPU to run the GPU branch of a
    one-process launch end to end (`tests/test_launchers.py`): a bug of the GPU branch then fails the
    suite on a CPU."""
    import torch

    return torch.cuda.is_available()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(env: Mapping[str, str], needs_group: bool, port: Callable[[], int] = free_port) -> dict[str, str]:
    """The variables to add so that `env` is a complete env:// rendezvous.

    A launched process keeps what its launcher set; DeepSpeed's launcher gets LOCAL_WORLD_SIZE from
    its LOCAL_SIZE. A process no launcher started (plain python, accelerate's one-process launcher)
    gets rank 0 of 1 when its layout needs a process group (DeepSpeed, FSDP); plain DDP on one device
    runs without one (accelerate then wraps nothing)."""
    if "WORLD_SIZE" in env:
        if "LOCAL_WORLD_SIZE" not in env and "LOCAL_SIZE" in env:
            return {"LOCAL_WORLD_SIZE": env["LOCAL_SIZE"]}
        return {}
    if not needs_group:
        return {}
    return {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": env.get("MASTER_ADDR", "127.0.0.1"), "MASTER_PORT": env.get("MASTER_PORT") or str(port())}


def ensure_rank_env(needs_group: bool) -> None:
    os.environ.update(rank_env(os.environ, needs_group))




def started_here(nproc_per_node: int, env: Mapping[str, str] = os.environ) -> bool:
    """Whether this process is to start the ranks itself (`--nproc-per-node N`, N > 1, and no launcher
    started it: a rank it starts sees WORLD_SIZE and trains)."""
    return nproc_per_node > 1 and "WORLD_SIZE" not in env


def run_ranks(nproc: int, script: str, argv: list[str]) -> int:
    """`torchrun --standalone --nproc_per_node N script argv`, run by torch's elastic agent in this process,
    so that what ends the ranks ends it in their words. A signal to this process is passed on to them (each
    saves a checkpoint and says so, `toolkit.train.faults.Preemption`), and it exits with 128 + the signal;
    a rank that stops says why in its one line, and this process exits with its code. torchrun and
    accelerate launch raise the same events as tracebacks of their own (SignalException, ChildFailedError)
    and exit 1, which nothing inside the ranks can change."""
    import logging

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    for name in ("torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launcher"):
        # its lines on the ranks: they say what happened
        logging.getLogger(name).setLevel(logging.CRITICAL)
    # torchrun's default for several ranks (the ranks set their own)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        run(get_args_parser().parse_args(["--standalone", "--nproc_per_node", str(nproc), script, *argv]))
    except SignalException as e:
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        code = e.get_first_failure()[1].exitcode
        # a rank killed by a signal: -signal
        return code if code > 0 else 128 - code
    return 0
