"""One place where a loaded model is made ready for a layout, in torchtitan's order (`parallelize_llama`,
`torchtitan/models/llama3/infra/parallelize.py`): context parallel's attention, the project's TP layers,
expert parallel's experts, activation checkpointing, compile, then FSDP2 (`toolkit.parallel.fsdp.apply_fsdp`).
`toolkit.models.load_model` only loads the weights and adds LoRA; every strategy kind calls `parallelize`
once (`Strategy.shard_model`), with what its layout applies (`Parallelism`). A pipeline cuts its stages
after, at `prepare`, from the whole TP/EP-cut model (so the stage split and the parameter names stay the
full model's); each stage is FSDP2-sharded as it is cut, by `shard_stage` here, the same step in the
same order.

What the rest of the run needs of the cut is one object, `Parallelized`: the TP shards (their group,
the dim or packing each slice was cut along, the replicated parameters whose gradients are partial
sums), the expert shards, and from them the table of every cut parameter by name, the gradient norm's
parts (which squares sum over which groups) and the full state dict. The table is read right after the
cut, before FSDP2 replaces the parameters.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from toolkit.parallel.cut import Cut
from toolkit.parallel.tp import TPShards, apply_tensor_parallel, full_state_dict


@dataclass
class Parallelized:
    """How a model was cut: `tp` (TPShards: the TP group, the plan's line, and the run's table of cuts)
    and `experts` (expert parallel's ExpertShards, or None)."""
    tp: TPShards
    experts: Any = None

    @property
    def cuts(self) -> dict[str, Cut]:
        """The one table of how each cut parameter was cut, by name (`toolkit.parallel.cut.Cut`: its TP
        slice, its expert slice, or a TP-partial gradient), as the TP plan and then expert parallel
        recorded it; a parameter not in it is whole. What checkpoints, the gradient norm, the full state
        dict and the trainable-parameter listing read."""
        return self.tp.cuts

    def norm_parts(self, named: dict[str, nn.Parameter], shard: tuple = (), outer: tuple = (),
                   expert_groups: tuple = ()) -> list[tuple[list, tuple]]:
        """`toolkit.parallel.grad_norm.clip_grad_norm`'s parts: each parameter's squares summed over the
        groups that hold the rest of it. TP slices over the TP group and `shard` (FSDP2's shard group),
        the experts over `expert_groups` (their shards, the ep group: under TP the TP group itself), the
        rest over `shard`; all of them over `outer` (a pipeline's stages). A parameter is cut by TP or by
        EP, never both (`Cut`)."""
        tp = (self.tp.group,) if self.tp.group is not None else ()
        whole = Cut()
        cut = {n: self.cuts.get(n, whole) for n in named}

        def members(kind: str) -> list[nn.Parameter]:
            return [p for n, p in named.items()
                    if kind == ("ep" if cut[n].ep is not None else "tp" if cut[n].tp is not None else "whole")]

        parts = [(members("tp"), (*outer, *tp, *shard))]
        if self.experts:  # the expert part, empty or not: every rank reduces the same parts
            parts.append((members("ep"), (*outer, *expert_groups)))
        return [*parts, (members("whole"), (*outer, *shard))]

    def state_dict(self, model: nn.Module) -> dict:
        """The full tensors a one-process run would save (collective): FSDP2, TP and EP slices gathered."""
        return full_state_dict(model, self.cuts, self.tp.group)


@dataclass(frozen=True)
class FsdpSpec:
    """FSDP2's part of a layout: the mesh the dense parts shard over, whether parameters reshard after each
    block's forward (ZeRO-3-like; False keeps them gathered to backward, ZeRO-2-like), the dtype they are
    gathered in (None: as stored), and the experts' own mesh under expert parallel."""
    mesh: Any
    reshard: bool = True
    compute_dtype: torch.dtype | None = None
    experts_mesh: Any = None


@dataclass(frozen=True)
class Parallelism:
    """What `parallelize` applies, decided once by the strategy from the flags and the mesh."""
    tp_group: Any = None
    ep_group: Any = None
    context: Any = None  # `toolkit.parallel.strategy.ContextSlices`: Ulysses attention where cp > 1
    checkpointing: bool = False  # --gradient-checkpointing
    compile: bool = False  # --compile (auto compiles later, from the loop, once steps are timed)
    fsdp: FsdpSpec | None = None
    device: Any = None  # where the model goes before FSDP2 shards it
    stages: bool = False  # a pipeline: FSDP2 waits for the stages (`shard_stage`)


def parallelize(model: nn.Module, p: Parallelism) -> tuple[nn.Module, Parallelized]:
    """In order: context parallel's attention, TP over `p.tp_group`, EP over `p.ep_group`, activation
    checkpointing, compile, FSDP2 over `p.fsdp` (the whole model; a pipeline's stages later). With both
    TP and EP the ep group is the TP group (`toolkit.layout.dims`): TP leaves the routed experts whole,
    and EP splits them over it, each TP rank dispatching its 1/tp of the tokens. Every rank calls it with
    the same full weights (and LoRA init), so TP=1 and TP=t start alike. Returns the model and how it
    was cut."""
    from toolkit.models import compile_blocks, enable_checkpointing

    if p.context is not None:
        model = p.context.attach(model)
    cuts: dict[str, Cut] = {}  # how each parameter is cut, by name (`toolkit.parallel.cut`): TP's, then EP's
    if p.tp_group is not None:
        model = apply_tensor_parallel(model, p.tp_group, cuts, skip_experts=p.ep_group is not None)
    experts = None
    if p.ep_group is not None:
        from toolkit.parallel.ep import apply_expert_parallel

        experts = apply_expert_parallel(model, p.ep_group, cuts, tp_group=p.tp_group)
    tp = TPShards(p.tp_group, cuts, getattr(model, "toolkit_tp", ""))
    if p.checkpointing:  # transformers also makes the embeddings' output require grad (LoRA's frozen ones)
        enable_checkpointing(model)
    if p.compile:
        compile_blocks(model)
    if p.fsdp is not None and not p.stages:
        from toolkit.parallel.tp.plan import decoder_blocks

        model = model.to(p.device)
        _fully_shard(model, decoder_blocks(model), p.fsdp, experts.holders if experts else ())
    return model, Parallelized(tp, experts)


def shard_stage(stage: nn.Module, blocks: list[nn.Module], shard: FsdpSpec, experts=()) -> None:
    """FSDP2 on a pipeline stage as it is cut: its blocks, then the stage; `experts`: this stage's expert
    holders, sharded first over the experts' mesh."""
    _fully_shard(stage, blocks, shard, experts)


def _fully_shard(root: nn.Module, blocks: list[nn.Module], shard: FsdpSpec, experts) -> None:
    from toolkit.parallel.fsdp import apply_fsdp

    apply_fsdp(root, blocks, shard.mesh, shard.reshard, shard.compute_dtype, experts, shard.experts_mesh)
