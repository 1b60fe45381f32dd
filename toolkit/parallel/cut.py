"""How a parameter was cut across ranks, stored once: one record per parameter (`Cut`: its TP or expert
`Slice`, which says the dim or parts, this rank's place and the group), kept in one table keyed by the full
model's parameter names (`dict[str, Cut]`). `toolkit.parallel.parallelize` makes the table; the TP plan
(`toolkit.parallel.tp.plan.apply_tensor_parallel`) and then expert parallel
(`toolkit.parallel.ep.apply_expert_parallel`) write each parameter's cut into it by name as they cut; the
gradient norm (`Parallelized.norm_parts`), the full state dict (`full_state_dict` here), the sharded
checkpoints (`toolkit.train.sharded_state.piece`) and the trainable-parameter listing
(`Strategy.named_trainable`) read it. A parameter not in the table is whole on every rank. The layers keep
only the group their forwards exchange over; FSDP2's placements, inside a slice, are torch's own.

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
class Slice:
    """Slice `rank` of `size` along `split` (a dim of the full tensor; a packed projection's parts, `Packed`;
    expert parallel's stacked experts, dim 0, and LoRA's B by its expert-minor columns, a `Packed` split of
    r parts of E), over `group`: the TP group for a TP slice, the ep group (dp_shard ranks, or under TP the TP
    group itself) for an expert slice."""
    split: int | Packed
    rank: int
    size: int
    group: Any = field(default=None, compare=False, repr=False)

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """The full tensor from this rank's slice (collective over `group`)."""
        return gather(local, self.split, self.group) if self.size > 1 else local


@dataclass(frozen=True)
class Cut:
    """How one parameter was cut: by TP or by expert parallel, never both (under TP the experts stay
    whole and expert parallel splits them over the TP group: `toolkit.layout.dims`). `tp`: its TP slice
    (None: whole over TP); `ep`: its expert slice (None: expert parallel did not cut it). `partial`:
    TP-replicated, but each TP rank's gradient is a partial sum (a column region's LoRA A, Qwen3's q/k
    norms), summed over the TP group after backward."""
    tp: Slice | None = None
    ep: Slice | None = None
    partial: bool = False

    def __post_init__(self):
        if self.tp is not None and self.ep is not None:
            raise ValueError("a parameter is cut by TP or by expert parallel, not both")

    @property
    def slice(self) -> Slice | None:
        """The one slice this parameter is (TP's or expert parallel's), or None: whole."""
        return self.ep or self.tp

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """The full tensor from this rank's `local` (collective over the slice's group)."""
        return self.slice.gather(local) if self.slice is not None else local


def full_state_dict(model, cuts: dict[str, Cut]) -> dict:
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
            v = cut.gather(v)
        out[key] = v.detach()
    return out
