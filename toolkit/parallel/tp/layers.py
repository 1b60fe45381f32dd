"""Megatron-style parallel linear layers, built by slicing a full `nn.Linear` so that TP=1 and
TP=t start from identical weights. Shapes follow `nn.Linear`: weight A is (out, in), Y = X A^T + b.

How each parameter was cut (the dim of the full tensor it is a slice of; a packed projection's, a
fused qkv or gate_up split part by part, `Packed`; this rank's place) is not kept by the layers: the plan
records it once, in the run's table of cuts (`toolkit.parallel.cut`), what the saving code reads to gather
a standard state dict back. A layer keeps only the group its forward exchanges over.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from toolkit.parallel.cut import Packed, gather
from toolkit.parallel.tp.comm import copy_to_tp, gather_from_tp, group_size, reduce_from_tp, split_to_tp

__all__ = ["Packed", "gather", "shard", "ColumnParallelLinear", "RowParallelLinear", "ShardedDropout"]


def shard(full: torch.Tensor, dim: int, group, parts: tuple[int, ...] | None = None) -> nn.Parameter:
    """My contiguous 1/t slice of `full` along `dim`, as a new parameter; with `parts` (sizes along
    `dim` summing to it), my 1/t slice of each part, concatenated (`toolkit.parallel.cut.split_of(dim,
    parts)` says how)."""
    import torch.distributed as dist

    t = group_size(group)
    rank = dist.get_rank(group) if t > 1 else 0
    sizes = parts or (full.size(dim),)
    if sum(sizes) != full.size(dim) or any(size % t for size in sizes):
        raise ValueError(f"dimension {dim} of size {full.size(dim)} (parts {list(sizes)}) is not divisible by "
                         f"tensor-parallel size {t}")
    pieces = [part.chunk(t, dim=dim)[rank] for part in full.detach().split(list(sizes), dim)]
    return nn.Parameter(torch.cat(pieces, dim).clone().contiguous(), requires_grad=full.requires_grad)


def _empty_linear(cls, in_features: int, out_features: int) -> nn.Linear:
    layer = cls.__new__(cls)
    nn.Module.__init__(layer)
    layer.in_features, layer.out_features = in_features, out_features
    return layer


class ColumnParallelLinear(nn.Linear):
    """Output features split over t ranks.

        A = [A_1; A_2; ...; A_t]  (rows, out/t each),  b = [b_1, ..., b_t]
        Y_i = X A_i^T + b_i       (rank i: its slice of the output features)
        gather_output:  Y = [Y_1, ..., Y_t] along the last dim

    X is replicated. `copy_input` applies copy_to_tp so dX is all-reduced in backward; a plan region
    turns it off and copies once at its entry (the attention, the MLP) instead.
    A packed A (`parts`: [Q; K; V] or [G; U]) gives rank i the i-th slice of each part:
    A_i = [Q_i; K_i; V_i], so its output holds whole q, k and v heads (its gate and up features).
    """

    @classmethod
    def from_linear(cls, linear: nn.Linear, group, gather_output: bool = False, copy_input: bool = True,
                    parts: tuple[int, ...] | None = None):
        t = group_size(group)
        layer = _empty_linear(cls, linear.in_features, linear.out_features // t)
        layer.weight = shard(linear.weight, 0, group, parts)
        layer.bias = shard(linear.bias, 0, group, parts) if linear.bias is not None else None
        layer.group, layer.gather_output, layer.copy_input = group, gather_output, copy_input
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.copy_input:
            x = copy_to_tp(x, self.group)
        y = F.linear(x, self.weight, self.bias)
        return gather_from_tp(y, self.group) if self.gather_output else y

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, tp={group_size(self.group)}, gather_output={self.gather_output}"


class RowParallelLinear(nn.Linear):
    """Input features split over t ranks.

        A = [A_1, A_2, ..., A_t]  (columns, in/t each),  X = [X_1, ..., X_t] along the last dim
        Y = sum_i X_i A_i^T + b   (rank i computes X_i A_i^T; an all-reduce sums them;
                                   b is replicated and added once, after the sum)

    `input_is_parallel=False` splits a replicated X first (split_to_tp).
    """

    @classmethod
    def from_linear(cls, linear: nn.Linear, group, input_is_parallel: bool = True):
        t = group_size(group)
        layer = _empty_linear(cls, linear.in_features // t, linear.out_features)
        layer.weight = shard(linear.weight, 1, group)
        layer.bias = None
        # full on every rank; its gradient comes from the reduced output
        if linear.bias is not None:
            layer.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=linear.bias.requires_grad)
        layer.group, layer.input_is_parallel = group, input_is_parallel
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = split_to_tp(x, self.group)
        y = reduce_from_tp(F.linear(x, self.weight), self.group)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, tp={group_size(self.group)}, input_is_parallel={self.input_is_parallel}"


class ShardedDropout(nn.Dropout):
    """Dropout on X_r, my slice of an input split along the last dim, as the slice of the mask the
    unsharded layer would draw: every TP rank draws the full-width mask from the same RNG state
    (what `F.dropout` draws on CPU: bernoulli(1 - p) over the full shape, scaled by 1 / (1 - p)) and
    keeps its columns. Per-slice masks would repeat one pattern across ranks and shift the RNG
    stream, so TP=1 and TP=t would no longer drop the same features."""

    def __init__(self, p: float, group):
        super().__init__(p)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = group_size(self.group)
        if not self.training or self.p == 0 or t == 1:
            return super().forward(x)
        import torch.distributed as dist

        noise = x.new_empty(*x.shape[:-1], x.shape[-1] * t).bernoulli_(1 - self.p).div_(1 - self.p)
        return x * noise.chunk(t, dim=-1)[dist.get_rank(self.group)]
