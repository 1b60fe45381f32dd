"""The TP and data-parallel groups of the mesh (`make_layout`). tp is the mesh's innermost dimension
(Megatron's order: with tp=2 and 2 data-parallel ranks the TP groups are {0,1} and {2,3}), so the
per-layer all-reduces stay inside a node; TP peers read the same micro-batches."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Layout:
    tp: int
    dp: int
    tp_rank: int
    dp_rank: int
    tp_group: Any
    dp_group: Any


def make_layout(tp: int, mesh=None, grads: str = "dp") -> Layout:
    """The TP and DP groups of `mesh` (by default one over the whole world with this TP degree; a
    mesh is built collectively: every rank calls this, in the same order). DDP averages over the
    `grads` dimension: `dp`, or `dp_cp` when context-parallel ranks hold other tokens of the same rows."""
    from toolkit.parallel.mesh import local_mesh

    import torch.distributed as dist

    mesh = mesh if mesh is not None else local_mesh(tp=tp)
    dp = mesh.group(grads)
    return Layout(mesh.size("tp"), dist.get_world_size(dp), mesh.local_rank("tp"), mesh.local_rank("dp"),
                  mesh.group("tp"), dp)
