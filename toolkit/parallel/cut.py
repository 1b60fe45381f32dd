"""How a parameter was cut across ranks: one record per parameter (`Cut`), kept in one table keyed by the
full model's parameter names (`dict[str, Cut]`). `toolkit.parallel.parallelize` makes the table; the TP
plan (`toolkit.parallel.tp.plan.apply_tensor_parallel`) and then expert parallel
(`toolkit.parallel.ep.apply_expert_parallel`) fill it in as they cut; the gradient norm
(`Parallelized.norm_parts`), the full state dict (`full_state_dict` here), the sharded
checkpoints (`toolkit.train.sharded_state.piece`) and the trainable-parameter listing
(`Strategy.named_trainable`) read it. A parameter not in the table is whole on every rank.

The table is read by name, not kept on the parameters: FSDP2 and the pipeline's stages replace the
parameter objects, the names stay the full model's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class Packed:
    """A packed projection's TP split: along `dim` the full tensor holds `parts` (sizes: q, k, v heads;
    gate, up), each cut into t equal slices; rank r holds slice r of every part, in order. Its rows
    are not one contiguous slice of the full tensor, so gathering and checkpoints place each run."""
    dim: int
    parts: tuple[int, ...]

    def runs(self, start: int, length: int, rank: int, t: int) -> list[tuple[int, int, int]]:
        """Indices [start, start + length) along `dim` of rank `rank`'s tensor, as (index there,
        index in the full tensor, count) runs, one per part they cross."""
        out, local_at, full_at = [], 0, 0
        for size in self.parts:
            piece = size // t
            lo, hi = max(start, local_at), min(start + length, local_at + piece)
            if lo < hi:
                out.append((lo, full_at + rank * piece + lo - local_at, hi - lo))
            local_at, full_at = local_at + piece, full_at + size
        return out

    def assemble(self, slices: list[torch.Tensor]) -> torch.Tensor:
        """The full tensor from every rank's tensor, in rank order."""
        t = len(slices)
        cut = [s.split([size // t for size in self.parts], self.dim) for s in slices]
        return torch.cat([cut[r][i] for i in range(len(self.parts)) for r in range(t)], self.dim)


def split_of(dim: int, parts: tuple[int, ...] | None = None) -> "int | Packed":
    """How a slice along `dim` was cut: the dim itself (one contiguous slice), or `Packed` where the
    tensor holds more than one part (a slice of each)."""
    return Packed(dim, tuple(parts)) if parts is not None and len(parts) > 1 else dim


def gather(local: torch.Tensor, split: "int | Packed", group) -> torch.Tensor:
    """The full tensor from every rank's slice of it (collective over `group`): all-gathered, then
    concatenated along `split`, or assembled part by part where it is `Packed`."""
    import torch.distributed as dist

    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local.contiguous(), group=group)
    return split.assemble(parts) if isinstance(split, Packed) else torch.cat(parts, dim=split)


@dataclass(frozen=True)
class ExpertSlice:
    """Expert parallel's cut: slice `rank` of `size` (the ep group's) along `split` (dim 0, the stacked
    experts; LoRA's B by its expert-minor columns, a `Packed` split of r parts of E), over `group` (the
    ep group: dp_shard ranks, or under TP the TP group itself)."""
    split: int | Packed
    rank: int
    size: int
    group: Any = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class Cut:
    """How one parameter was cut: by TP or by expert parallel, never both (under TP the experts stay
    whole and expert parallel splits them over the TP group: `toolkit.layout.dims`). `tp`: the dim of the
    full tensor its TP slice was cut along (the TP group's rank r holds slice r of t), or how a packed
    projection's was (`Packed`); None: whole over TP. `ep`: the expert slice it is (`ExpertSlice`), None
    if expert parallel did not cut it. `partial`: TP-replicated, but each TP rank's gradient is a partial
    sum (a column region's LoRA A, Qwen3's q/k norms), summed over the TP group after backward."""
    tp: int | Packed | None = None
    ep: ExpertSlice | None = None
    partial: bool = False

    def __post_init__(self):
        if self.tp is not None and self.ep is not None:
            raise ValueError("a parameter is cut by TP or by expert parallel, not both")

    def gather(self, local: torch.Tensor, tp_group=None) -> torch.Tensor:
        """The full tensor from this rank's `local` (collective): its expert slices over their ep group,
        or its TP slices over `tp_group` (where it has more than one rank)."""
        import torch.distributed as dist

        if self.ep is not None:
            return gather(local, self.ep.split, self.ep.group)
        if self.tp is not None and tp_group is not None and dist.get_world_size(tp_group) > 1:
            return gather(local, self.tp, tp_group)
        return local


def full_state_dict(model, cuts: dict[str, Cut], tp_group) -> dict:
    """The full state dict on every rank (collective): FSDP2 shards all-gathered, then each cut
    parameter put back by its `Cut` (`cuts`, by name): TP slices concatenated along the dim each was
    cut, a packed projection's part by part (the one TP gather path: plain TP, TP under FSDP2, stages),
    expert-parallel slices gathered over their ep group (never both: `Cut`)."""
    from toolkit.parallel import grad_norm

    out = {}
    for key, v in model.state_dict().items():
        v = grad_norm.full(v)
        cut = cuts.get(key)
        if cut is not None:
            v = cut.gather(v, tp_group)
        out[key] = v.detach()
    return out
