"""Who started this process, and the rank environment DeepSpeed and FSDP need: set the same way on a
GPU and on a CPU.

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
from pathlib import Path
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


def pop_local_rank(argv: list[str]) -> tuple[list[str], int | None, str | None]:
    """(argv without `--local_rank`/`--local-rank`, its value, a problem): DeepSpeed's launcher
    appends `--local_rank=K` to every rank's arguments (torch.distributed.launch did too)."""
    out, value, problem = [], None, None
    it = iter(argv)
    for arg in it:
        name, eq, rest = arg.partition("=")
        if name not in ("--local_rank", "--local-rank"):
            out.append(arg)
            continue
        raw = rest if eq else next(it, "")
        try:
            value = int(raw)
        except ValueError:
            problem = f"{name} must be an integer (got {raw!r})"
    return out, value, problem


def local_rank_problem(value: int | None, env: Mapping[str, str]) -> str | None:
    """`--local_rank K` must come from a launcher that also set LOCAL_RANK to K."""
    if value is None:
        return None
    if "LOCAL_RANK" not in env or "WORLD_SIZE" not in env:
        return (f"--local_rank {value} was given, but no launcher set LOCAL_RANK and WORLD_SIZE; launch with "
                "deepspeed, torchrun or accelerate launch, or drop --local_rank")
    if int(env["LOCAL_RANK"]) != value:
        return f"--local_rank {value} disagrees with the launcher's LOCAL_RANK={env['LOCAL_RANK']}; drop --local_rank"
    return None


def accelerate_config_file(env: Mapping[str, str], parent_cmdline: list[str] | None = None) -> str | None:
    """The accelerate config a launch read: `--config_file X` on the launching process's command line
    (accelerate's launcher is this process's parent), else accelerate's default config if it exists."""
    if not any(k.startswith("ACCELERATE_") for k in env):
        return None
    if parent_cmdline is None:
        parent_cmdline = _parent_cmdline()
    for i, arg in enumerate(parent_cmdline):
        name, eq, rest = arg.partition("=")
        if name in ("--config_file", "--config-file"):
            return rest if eq else (parent_cmdline[i + 1] if i + 1 < len(parent_cmdline) else None)
    from toolkit.parallel.launch_config import accelerate_default_config

    default = accelerate_default_config(env)
    return str(default) if default.is_file() else None


def launch_source(env: Mapping[str, str], parent_cmdline: list[str] | None = None) -> str:
    """Where an accelerate launch's DeepSpeed or FSDP setting came from, for messages:
    "accelerate launch --use_deepspeed --zero_stage 3" when the flags said it, else "accelerate config PATH"."""
    if parent_cmdline is None:
        parent_cmdline = _parent_cmdline()
    flags = [a for a in parent_cmdline if a.split("=")[0] in ("--use_deepspeed", "--use_fsdp", "--use-deepspeed",
                                                                "--use-fsdp")]
    if flags:
        stage = None
        for i, arg in enumerate(parent_cmdline):
            name, eq, rest = arg.partition("=")
            if name in ("--zero_stage", "--zero-stage"):
                stage = rest if eq else (parent_cmdline[i + 1] if i + 1 < len(parent_cmdline) else None)
        return "accelerate launch " + " ".join(flags) + (f" --zero_stage {stage}" if stage else "")
    path = accelerate_config_file(env, parent_cmdline)
    return f"accelerate config {path}" if path else "accelerate launch"


def _parent_cmdline() -> list[str]:
    """The launching process's own arguments (those before the script it runs)."""
    try:
        args = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []
    script = next((i for i, a in enumerate(args) if a.endswith(".py") and i > 0), len(args))
    return args[:script]
