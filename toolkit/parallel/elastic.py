"""Joining the process group again after a torchrun restart (`--max-restarts`).

Why this exists: torchrun's agent serves every attempt of a worker group from one TCPStore (its
static rendezvous creates it once; workers reach it through `TORCHELASTIC_USE_AGENT_STORE`), and
`init_process_group` names its keys the same way on every attempt. A restarted worker can then
read an address the dead attempt published, and gloo's full-mesh connect fails ("connection
refused") or waits for a peer that no longer exists. Measured here: with `--master_port` a
restarted 2-rank group hung or failed to connect in most runs.

The fix: on a restart, create the group ourselves on a per-attempt `PrefixStore` over the agent's
store, before `Accelerator` (which then finds the group initialised and uses it).
"""

from __future__ import annotations

import os
from datetime import timedelta


def join_restarted_group() -> bool:
    """Initialise the default group for restart attempt N > 0 under torchrun; True if it did."""
    import torch
    import torch.distributed as dist

    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or dist.is_initialized():
        return False
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=timedelta(minutes=10))
    backend = "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        # what accelerate picks for FSDP full state dicts; fine for DDP/DeepSpeed
        backend = "cuda:nccl,cpu:gloo"
    dist.init_process_group(backend, store=dist.PrefixStore(f"toolkit/attempt_{attempt}", store),
                            rank=rank, world_size=world)
    return True
