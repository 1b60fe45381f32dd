"""Process layout and the `Accelerator` that carries it."""

from __future__ import annotations

import os

from toolkit.config import Config
from toolkit.models import resolved_precision


def make_accelerator(cfg: Config):
    """DDP (gloo on CPU, NCCL on GPU) when launched with several processes, else one process."""
    import torch
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    # Without cpu=True accelerate ignores torchrun's WORLD_SIZE on a machine with no accelerator and
    # every rank trains alone; with it, ranks join one gloo group.
    accelerator = Accelerator(mixed_precision=resolved_precision(cfg), cpu=not torch.cuda.is_available())
    if accelerator.num_processes == 1 and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise RuntimeError("launched with WORLD_SIZE > 1 but accelerate started a single process")
    set_seed(cfg.train.seed)
    if accelerator.device.type == "cpu":
        torch.set_num_threads(cpu_threads_per_rank(int(os.environ.get("LOCAL_WORLD_SIZE", accelerator.num_processes))))
    return accelerator


def cpu_threads_per_rank(local_ranks: int) -> int:
    """Cores available to this process split evenly over the ranks of this node.

    Launchers default OMP_NUM_THREADS to 1 (accelerate without --cpu, torchrun with several ranks),
    which leaves cores idle for a single CPU process; `TOOLKIT_NUM_THREADS` overrides.
    """
    if os.environ.get("TOOLKIT_NUM_THREADS"):
        return max(1, int(os.environ["TOOLKIT_NUM_THREADS"]))
    return max(1, len(os.sched_getaffinity(0)) // max(1, local_ranks))
