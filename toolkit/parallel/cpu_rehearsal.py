"""Run DeepSpeed and FSDP configs on CPU (gloo), so a GPU run can be rehearsed on a laptop.

Why this exists: accelerate only turns DeepSpeed/FSDP on for accelerator-backed process groups.
With `cpu=True` it builds a gloo group (MULTI_CPU) but then ignores a DeepSpeed plugin; without it,
`PartialState._prepare_backend` finds no GPU and returns no backend at all. And it enables FSDP only
for GPU-like distributed types. DeepSpeed 0.19 and FSDP2 themselves run fine on CPU with gloo.

The workaround, all of it here:
1. the shared `PartialState` is created first with `cpu=True`, so the group is gloo on CPU;
2. the `Accelerator` is then built with `cpu=False`, which lets its DeepSpeed branch run; for FSDP
   the shared state's type is set to MULTI_GPU so accelerate takes its FSDP branch, which replaces
   it with FSDP (the device stays `cpu`).
When a GPU is present nothing here runs. The rank environment (a one-process run's env:// variables)
is not set here: `toolkit.parallel.launch.ensure_rank_env` sets it on every device, before this.
"""

from __future__ import annotations

import contextlib
from typing import Iterator


def needed(kind: str | None) -> bool:
    from toolkit.parallel import launch

    return kind in ("deepspeed", "fsdp") and not launch.on_cuda()


@contextlib.contextmanager
def cpu_rehearsal(kind: str | None) -> Iterator[bool]:
    """Wrap `Accelerator(..., cpu=False)` creation; yields True when the shim is active."""
    if not needed(kind):
        yield False
        return
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    state = PartialState(cpu=True)
    if kind == "deepspeed":
        join_deepspeed_comm(state.backend)
    if kind == "fsdp":
        state.distributed_type = DistributedType.MULTI_GPU
    yield True
    if kind == "fsdp" and state.distributed_type != DistributedType.FSDP:
        raise RuntimeError(f"CPU rehearsal: accelerate did not enable FSDP ({state.distributed_type})")


def join_deepspeed_comm(backend: str) -> None:
    """DeepSpeed's own comm layer joins the gloo group, as accelerate's GPU branch does
    (`PartialState`: `deepspeed.comm.init_distributed` when ACCELERATE_USE_DEEPSPEED). Without it
    `zero.Init` inside `from_pretrained` builds its DeepSpeedConfig before DeepSpeed knows the group,
    reads a world size of 1 and rejects a train_batch_size filled for the real world."""
    from deepspeed import comm

    if not comm.is_initialized():
        comm.init_distributed(dist_backend=backend, auto_mpi_discovery=False)
