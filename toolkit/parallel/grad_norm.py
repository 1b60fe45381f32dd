"""The one gradient-norm function for layouts that split the model across ranks (TP shards,
pipeline stages): the norm of the *full* model's gradient, as one process would compute it.

Each part is a set of parameters and the groups its squared norm is summed over: a part whose
tensors are partitioned across a group (TP shards over the TP group, stages over the pipeline
group) is summed over it; a part replicated across a group is not. A duplicate (a tied
embedding's second copy on the last stage) belongs to no part. DDP/ZeRO/FSDP runs use
accelerate's `clip_grad_norm_`, which DeepSpeed and FSDP implement for their own shards.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch
import torch.distributed as dist


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: an FSDP2 DTensor's shard, a plain tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: an FSDP2 DTensor gathered (collective over its mesh), a plain tensor itself."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def clip_grad_norm(params: Iterable[torch.nn.Parameter], max_norm: float,
                   parts: Sequence[tuple[Iterable[torch.nn.Parameter], tuple]]) -> torch.Tensor:
    """sqrt(sum over parts of (squared norm of the part's gradients, all-reduced over its groups));
    every one of `params` with a gradient is then scaled by min(1, max_norm / norm) as torch does.
    Every rank of a group must pass the parts in the same order (one all-reduce per part and group).
    FSDP2's DTensor gradients count their local shard: pass the shard group among a part's groups."""
    params = [p for p in params if p.grad is not None]
    device = local(params[0].grad).device if params else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float64, device=device)
    for members, groups in parts:
        sq = torch.zeros((), dtype=torch.float64, device=device)
        for p in members:
            if p.grad is not None:
                sq += local(p.grad).double().pow(2).sum().to(device)
        for group in groups:
            if dist.is_initialized() and dist.get_world_size(group) > 1:
                dist.all_reduce(sq, group=group)
        total += sq
    total = total.sqrt()
    if params and max_norm and max_norm != float("inf"):
        # scale the shards in place, as torch's formula
        if any(hasattr(p.grad, "to_local") for p in params):
            coef = torch.clamp(max_norm / (total.float() + 1e-6), max=1.0)
            for p in params:
                local(p.grad).mul_(coef.to(local(p.grad).device))
        else:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total.float())
    return total.float()
