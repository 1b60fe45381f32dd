"""Tensor-parallel communication as autograd functions, in conjugate pairs (Megatron-LM's
`tensor_parallel/mappings.py`). With t ranks in `group` and X a tensor:

    copy_to_tp(X)      forward  X                       backward  dX -> sum_i dX_i   (all-reduce)
    reduce_from_tp(X)  forward  sum_i X_i (all-reduce)  backward  dX -> dX
    split_to_tp(X)     forward  X -> X_r, my 1/t slice of the last dim
                       backward dX_r -> [dX_1 ... dX_t] (all-gather along the last dim)
    gather_from_tp(X)  forward  X_r -> [X_1 ... X_t]    backward  dX -> dX_r

Each is the identity when the group has one rank. The bytes each all-reduce carries (forward and
backward apart) are counted while a benchmark asks (`toolkit.parallel.traffic.counting("tp")`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from toolkit.parallel import traffic


def group_size(group) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def _all_reduce(x: torch.Tensor, group, phase: str) -> torch.Tensor:
    # never reduce into a tensor autograd may still need
    x = x.contiguous().clone()
    dist.all_reduce(x, group=group)
    if traffic.wanted("tp"):
        traffic.add("tp", phase, x.numel() * x.element_size())
    return x


def _split_last(x: torch.Tensor, group) -> torch.Tensor:
    t, r = group_size(group), dist.get_rank(group)
    if x.size(-1) % t:
        raise ValueError(f"last dimension {x.size(-1)} is not divisible by the tensor-parallel size {t}")
    return x.chunk(t, dim=-1)[r].contiguous()


def _gather_last(x: torch.Tensor, group) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(group_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group, "backward"), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group, "forward")

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _SplitToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last(grad, ctx.group), None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_last(grad, ctx.group), None


def copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    return x if group_size(group) == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    return x if group_size(group) == 1 else _ReduceFromTP.apply(x, group)


def split_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    return x if group_size(group) == 1 else _SplitToTP.apply(x, group)


def gather_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    return x if group_size(group) == 1 else _GatherFromTP.apply(x, group)


def all_reduce_grad(group):
    """A tensor hook for a replicated parameter used inside the TP region: each rank's gradient
    covers only its own heads/features, so the full gradient is their sum."""
    def hook(grad: torch.Tensor) -> torch.Tensor:
        return _all_reduce(grad, group, "backward_param")
    return hook
