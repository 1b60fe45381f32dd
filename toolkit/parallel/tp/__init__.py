"""Tensor parallelism composed with data parallelism: world = tp x dp.

Ranks are laid out tp-inner (Megatron's order): with tp=2, dp=2 the TP groups are {0,1} and {2,3}
and the data-parallel groups {0,2} and {1,3}. Consecutive ranks share a node, so the per-layer
all-reduces stay inside it; gradients are averaged across TP groups by DDP over the dp group; the
data is sharded by dp rank only (both ranks of a TP group see the same micro-batches).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch
import torch.distributed as dist

from toolkit.parallel.tp.comm import group_size
from toolkit.parallel.tp.plan import apply_tensor_parallel, gather_state_dict, tp_problems

__all__ = ["Layout", "make_layout", "apply_tensor_parallel", "gather_state_dict", "tp_problems",
           "prepare_tensor_parallel", "clip_grad_norm", "data_parallel", "shard_loader"]


@dataclass(frozen=True)
class Layout:
    tp: int
    dp: int
    tp_rank: int
    dp_rank: int
    tp_group: Any
    dp_group: Any

    @property
    def replicas(self) -> int:
        """Ranks that read each data shard: the whole TP group."""
        return self.tp


def make_layout(tp: int) -> Layout:
    """Create the TP and DP process groups (collective: every rank calls it, in the same order)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    dp = world // tp
    tp_groups = [dist.new_group(list(range(k * tp, (k + 1) * tp))) for k in range(dp)]
    dp_groups = [dist.new_group(list(range(i, world, tp))) for i in range(tp)]
    return Layout(tp, dp, rank % tp, rank // tp, tp_groups[rank // tp], dp_groups[rank % tp])


def data_parallel(accelerator) -> tuple[int, int, int]:
    """(data rank, data ranks, replicas): which shard of the data this rank reads, of how many, and
    how many ranks read each shard (the TP degree, or the pipeline depth), for dividing world-wide sums."""
    layout = getattr(accelerator, "tp_layout", None) or getattr(accelerator, "pp_layout", None)
    if layout is None:
        return accelerator.process_index, accelerator.num_processes, 1
    return layout.dp_rank, layout.dp, layout.replicas


def shard_loader(accelerator, loader):
    """The loader sharded by data-parallel rank (TP/PP peers read the same batches)."""
    from accelerate.data_loader import prepare_data_loader

    rank, ranks, _ = data_parallel(accelerator)
    return prepare_data_loader(loader, accelerator.device, num_processes=ranks, process_index=rank,
                               put_on_device=True, even_batches=accelerator.even_batches)


def prepare_tensor_parallel(accelerator, layout: Layout, model, optimizer, loader):
    """What `accelerator.prepare` does, with DDP over the dp group only and the loader sharded by
    dp rank (accelerate's own DDP would average over every rank, TP peers included)."""
    model = model.to(accelerator.device)
    if accelerator.mixed_precision == "bf16":
        forward = model.forward
        model.forward = lambda *a, **k: _autocast(accelerator, forward, *a, **k)
    if layout.dp > 1:
        model = torch.nn.parallel.DistributedDataParallel(
            model, process_group=layout.dp_group,
            device_ids=[accelerator.local_process_index] if accelerator.device.type == "cuda" else None)
    optimizer = accelerator.prepare_optimizer(optimizer)
    return model, optimizer, shard_loader(accelerator, loader)


def _autocast(accelerator, forward, *args, **kwargs):
    with torch.autocast(accelerator.device.type, dtype=torch.bfloat16):
        return forward(*args, **kwargs)


def clip_grad_norm(parameters: Iterable[torch.nn.Parameter], max_norm: float, layout: Layout) -> torch.Tensor:
    """The global gradient norm over the *full* model: squares of sharded gradients are summed over
    the TP group, replicated ones counted once; then every gradient is scaled as torch would."""
    params = [p for p in parameters if p.grad is not None]
    sharded = sum((p.grad.double().pow(2).sum() for p in params if hasattr(p, "tp_split_dim")),
                  torch.zeros((), dtype=torch.float64, device=params[0].grad.device if params else None))
    replicated = sum((p.grad.double().pow(2).sum() for p in params if not hasattr(p, "tp_split_dim")),
                     torch.zeros_like(sharded))
    if group_size(layout.tp_group) > 1:
        dist.all_reduce(sharded, group=layout.tp_group)
    total = (sharded + replicated).sqrt()
    if max_norm and max_norm != float("inf"):
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total.float())
    return total.float()
