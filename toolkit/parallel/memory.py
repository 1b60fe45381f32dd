"""Bytes a rank actually holds in parameters, gradients and optimizer states.

Summed over tensor storages, each storage counted once (tied weights, views into flat buffers).
Sharded tensors count their local shard: FSDP2 DTensors via `to_local()`, DeepSpeed ZeRO-3
parameters via their `ds_tensor` partition. `optim` is the base optimizer's state (Adam moments);
DeepSpeed's fp32 master partitions are reported apart as `master` since DDP has none. Gradients
are measured after the last backward of the step; under DeepSpeed the engine steps (and frees
them) inside backward, so they are not observable there and are reported as null.
"""

from __future__ import annotations

from typing import Iterable

import torch


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def storage_bytes(tensors: Iterable[torch.Tensor], seen: set[int] | None = None) -> int:
    seen = set() if seen is None else seen
    total = 0
    for t in tensors:
        if t is None:
            continue
        t = _local(t)
        if t.numel() == 0:
            continue
        st = t.untyped_storage()
        if st.data_ptr() in seen:
            continue
        seen.add(st.data_ptr())
        total += st.nbytes()
    return total


def base_optimizer(opt):
    """Unwrap accelerate / DeepSpeed optimizer wrappers down to the torch optimizer."""
    while not isinstance(opt, torch.optim.Optimizer) or type(opt).__module__.startswith("accelerate"):
        opt = opt.optimizer
    return opt


def param_tensors(model) -> list[torch.Tensor]:
    return [getattr(p, "ds_tensor", p) for p in model.parameters()]


def grad_bytes(model) -> int:
    return storage_bytes(p.grad for p in model.parameters())


def held_bytes(model, optimizer) -> dict[str, int]:
    seen: set[int] = set()
    params = storage_bytes(param_tensors(model), seen)
    base = base_optimizer(optimizer)
    optim = storage_bytes((v for s in base.state.values() for v in s.values() if torch.is_tensor(v)), seen)
    master = 0
    zero = getattr(optimizer, "optimizer", None)
    # ZeRO-1/2, ZeRO-3
    for attr in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"):
        master += storage_bytes(getattr(zero, attr, None) or [], seen)
    return {"param_bytes": params, "optim_bytes": optim, "master_bytes": master}
