"""Tensor parallelism's runtime pieces: the TP and data-parallel groups of the mesh (`make_layout`),
what the plan cut (`TPShards`), the full state dict gathered back (`full_state_dict`), and DDP over
the data-parallel group for TP without FSDP2 (`prepare_tensor_parallel`).

tp is the mesh's innermost dimension (Megatron's order: with tp=2 and 2 data-parallel ranks the TP
groups are {0,1} and {2,3}), so the per-layer all-reduces stay inside a node; TP peers read the same
micro-batches. The layers are `layers.py`, their conjugate collectives `comm.py`, the plan read from
the model's `base_model_tp_plan` `plan.py` (`toolkit.layout.tp_plan` is its torch-free reading of the
config, for the rules and the planner).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from toolkit.parallel import grad_norm
from toolkit.parallel.tp.layers import Packed, gather
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
    dp = mesh.get_group(grads)  # by name: a flattened dimension is not sliced (torch deprecates that)
    return Layout(mesh["tp"].size(), dist.get_world_size(dp), mesh.get_local_rank("tp"), mesh.get_local_rank("dp"),
                  mesh.get_group("tp"), dp)


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
    """Which parameters the TP plan split (and along which dim) and which TP-replicated ones get a
    per-rank partial gradient, by name: FSDP2 replaces the parameters, and with them the attributes
    and gradient hooks the plan put on them, so the names are read once, right after the split."""

    def __init__(self, group=None):
        self.group = group
        # parameter name -> the dim its TP slice was cut along, or how a packed projection's was (`Packed`)
        self.split: dict[str, int | Packed] = {}
        self.partial: list[str] = []  # TP-replicated parameters whose gradient is a per-rank partial sum
        self.plan = ""  # what the plan split and what it kept whole

    def read(self, model) -> None:
        self.split = {n: getattr(p, "tp_packed", p.tp_split_dim) for n, p in model.named_parameters()
                      if hasattr(p, "tp_split_dim")}
        self.partial = [n for n, p in model.named_parameters() if getattr(p, "tp_partial_grad", False)]
        self.plan = getattr(model, "toolkit_tp", "")

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
        if not self.partial or self.group is None:
            return
        import torch.distributed as dist

        params = dict(model.named_parameters())
        for name in self.partial:
            if name in params and params[name].grad is not None:
                dist.all_reduce(grad_norm.local(params[name].grad), group=self.group)

    def state_dict(self, model) -> dict:
        return full_state_dict(model, self.split, self.group)


def full_state_dict(model, tp_split: dict, tp_group) -> dict:
    """The full state dict on every rank (collective): FSDP2 shards all-gathered, then TP slices
    concatenated along the dim each was cut, a packed projection's part by part (the one TP gather
    path: plain TP, TP under FSDP2, stages), and expert-parallel slices gathered over their ep group."""
    import torch.distributed as dist

    tp = dist.get_world_size(tp_group) if tp_group is not None else 1
    out = {}
    for key, v in model.state_dict().items():
        v = grad_norm.full(v)
        split = tp_split.get(key)
        experts = split if hasattr(split, "gather") else None  # an expert-parallel slice (`ExpertSplit`)
        split = experts.tp if experts is not None else split
        if split is not None and tp > 1:
            v = gather(v, split, tp_group)
        if experts is not None:
            v = experts.gather(v)
        out[key] = v.detach()
    return out
