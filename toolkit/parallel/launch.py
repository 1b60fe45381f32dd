"""The rank environment DeepSpeed and FSDP need, set the same way on a GPU and on a CPU (who started
the process and what its launcher says about the layout: `toolkit.layout.launcher`).

What each launcher leaves in the environment (read off each here: accelerate 1.15, torch 2.13,
deepspeed 0.19; `tests/test_launchers.py` runs every form):

| launch | RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT | marked by |
|---|---|---|
| `python finetune.py` | none | - |
| `accelerate launch`, one process, no DeepSpeed/FSDP | none | ACCELERATE_MIXED_PRECISION |
| `accelerate launch --use_deepspeed/--use_fsdp/--multi_gpu` or a config naming one | all (torch.distributed.run inside) | ACCELERATE_USE_DEEPSPEED/_FSDP |
| `torchrun` | all | TORCHELASTIC_RUN_ID |
| `deepspeed` | all but LOCAL_WORLD_SIZE (it sets LOCAL_SIZE) | `--local_rank=K` in argv, CROSS_RANK |

DeepSpeed and FSDP need a process group even for one process. On one H100 (2026-11-24)
`accelerate launch --num_processes 1 finetune.py --zero-stage 3` died with "Default process group has
not been initialized": the one-process variables were set on the CPU path only, so accelerate chose
DeepSpeed without a group. `rank_env` is now the one place they are set, and it has no device branch.
"""

from __future__ import annotations

import os
import socket
from typing import Callable, Mapping

RANK_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def on_cuda() -> bool:
    """The one question the launch set-up's CUDA-only branches ask (accelerate's device, the CPU
    rehearsal, DeepSpeed's comm overlap). Tests answer True on a CPU to run the GPU branch of a
    one-process launch end to end (`tests/test_launchers.py`): the class of bug that only a GPU
    showed on 2026-11-24 then fails the suite."""
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


