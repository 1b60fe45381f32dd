"""Tensor parallelism's runtime pieces: the TP and data-parallel groups of the mesh (`make_layout`),
what the plan cut (`TPShards`), the full state dict gathered back (`full_state_dict`), and DDP over
the data-parallel group for TP without FSDP2 (`prepare_tensor_parallel`).

tp is the mesh's innermost dimension (Megatron's order: with tp=2 and 2 data-parallel ranks the TP
groups are {0,1} and {2,3}), so the per-layer all-reduces stay inside a node; TP peers read the same
micro-batches. The layers are `layers.py`, their conjugate collectives `comm.py`, the plan read from
the model's `base_model_tp_plan` `plan.py` (`toolkit.layout.tp_regions` is its torch-free reading of the
config, for the rules and the planner).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from toolkit.parallel import grad_norm
from toolkit.parallel.cut import Cut
from toolkit.parallel.tp.plan import apply_tensor_parallel

__all__ = ["Layout", "make_layout", "apply_tensor_parallel", "TPShards", "full_state_dict",
           "prepare_tensor_parallel"]


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


def prepare_tensor_parallel(accelerator, layout: Layout, model, optimizer):
    """What `accelerator.prepare` does for the model, with DDP over the dp group only
    (accelerate's own DDP would average over every rank, TP peers included)."""
    model = model.to(accelerator.device)
    if accelerator.mixed_precision == "bf16":
        autocast_forward(accelerator, model)
    if layout.dp > 1:
        model = torch.nn.parallel.DistributedDataParallel(
            model, process_group=layout.dp_group,
            device_ids=[accelerator.local_process_index] if accelerator.device.type == "cuda" else None)
    return model, accelerator.prepare_optimizer(optimizer)


def autocast_forward(accelerator, model) -> None:
    """`accelerator.autocast()` around `model.forward` (fp32 weights, bf16 compute): what accelerate's
    own `prepare` adds, for models it does not prepare."""
    forward = model.forward

    def autocast(*args, **kwargs):
        with accelerator.autocast():
            return forward(*args, **kwargs)

    model.forward = autocast


class TPShards:
    """TP's part of a layout: its group, the run's table of cuts (`toolkit.parallel.cut`: how the TP plan,
    then expert parallel, cut each parameter, by name) and the plan's describe line. The table is by name:
    FSDP2 replaces the parameters, and with them the gradient hooks the plan put on the replicated ones
    whose gradients are partial sums (`reduce_partial_grads` does their work again)."""

    def __init__(self, group=None, cuts: dict[str, Cut] | None = None, plan: str = ""):
        self.group = group
        self.cuts: dict[str, Cut] = cuts if cuts is not None else {}
        self.plan = plan  # what the plan split and what it kept whole

    @property
    def partial(self) -> list[str]:
        """TP-replicated parameters whose gradient is a per-rank partial sum, by name."""
        return [n for n, cut in self.cuts.items() if cut.partial]

    def describe(self) -> str:
        """What TP split, per block, and what every rank keeps whole (a line of the strategy's describe)."""
        return self.plan + "\n" if self.plan else ""

    def coordinates(self) -> tuple[int, int]:
        """(this rank's TP rank, TP degree): where its slices sit in the full tensors."""
        import torch.distributed as dist

        return (dist.get_rank(self.group), dist.get_world_size(self.group)) if self.group is not None else (0, 1)

    def reduce_partial_grads(self, model) -> None:
        """What the TP plan's gradient hooks do, on FSDP2's reduced shards: the sum over the TP group
        commutes with the mean over data-parallel ranks, and TP peers hold the same shard of these."""
        partial = self.partial
        if not partial or self.group is None:
            return
        import torch.distributed as dist

        params = dict(model.named_parameters())
        for name in partial:
            if name in params and params[name].grad is not None:
                dist.all_reduce(grad_norm.local(params[name].grad), group=self.group)

    def state_dict(self, model) -> dict:
        return full_state_dict(model, self.cuts, self.group)


def full_state_dict(model, cuts: dict[str, Cut], tp_group) -> dict:
    """The full state dict on every rank (collective): FSDP2 shards all-gathered, then each cut
    parameter put back by its `Cut` (`cuts`, by name): TP slices concatenated along the dim each was
    cut, a packed projection's part by part (the one TP gather path: plain TP, TP under FSDP2, stages),
    then expert-parallel slices gathered over their ep group."""
    out = {}
    for key, v in model.state_dict().items():
        v = grad_norm.full(v)
        cut = cuts.get(key)
        if cut is not None:
            v = cut.gather(v, tp_group)
        out[key] = v.detach()
    return out
