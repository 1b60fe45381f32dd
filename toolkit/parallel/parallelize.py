"""One place where a loaded model is cut for a layout, in torchtitan's order (`parallelize_llama`):
context parallel's attention, the project's TP layers, expert parallel's experts; FSDP2 follows at
`prepare` over what this leaves (`toolkit.parallel.fsdp.apply_fsdp`), for a mesh strategy on the whole
model and for a pipeline on each stage. A mesh strategy and a pipeline strategy both call `parallelize`.

What the rest of the run needs of the cut is one object, `Parallelized`: the TP shards (their group,
the dim or packing each slice was cut along, the replicated parameters whose gradients are partial
sums), the expert shards, and from them the table of every cut parameter by name, the gradient norm's
parts (which squares sum over which groups) and the full state dict. The table is read right after the
cut: FSDP2 replaces the parameters later, and with them the attributes the TP plan set on them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from toolkit.parallel.tp import TPShards, apply_tensor_parallel, full_state_dict


@dataclass
class Parallelized:
    """How a model was cut: `tp` (TPShards) and `experts` (expert parallel's ExpertShards, or None)."""
    tp: TPShards
    experts: Any = None

    @property
    def cuts(self) -> dict[str, Any]:
        """Every cut parameter's split by name: a TP slice's dim (or `Packed`), an expert slice's `ExpertSplit`."""
        return {**self.tp.split, **(self.experts.split if self.experts else {})}

    def norm_parts(self, named: dict[str, nn.Parameter], shard: tuple = (), outer: tuple = (),
                   expert_groups: tuple = ()) -> list[tuple[list, tuple]]:
        """`toolkit.parallel.grad_norm.clip_grad_norm`'s parts: each parameter's squares summed over the
        groups that hold the rest of it. TP slices over the TP group and `shard` (FSDP2's shard group),
        the experts over `expert_groups` (their shards, the ep group; and TP where it cut them), the rest
        over `shard`; all of them over `outer` (a pipeline's stages)."""
        tp = (self.tp.group,) if self.tp.group is not None else ()
        experts = self.experts.split if self.experts else {}
        split = [p for n, p in named.items() if n in self.tp.split and n not in experts]
        rest = [p for n, p in named.items() if n not in self.tp.split and n not in experts]
        mine = self.experts.norm_parts(named, tp, (*outer, *expert_groups)) if self.experts else []
        return [(split, (*outer, *tp, *shard)), *mine, (rest, (*outer, *shard))]

    def state_dict(self, model: nn.Module) -> dict:
        """The full tensors a one-process run would save (collective): FSDP2, TP and EP slices gathered."""
        return full_state_dict(model, self.cuts, self.tp.group)


def parallelize(model: nn.Module, tp_group=None, ep_group=None, context=None) -> tuple[nn.Module, Parallelized]:
    """Context parallel's attention (`context.attach`, where it splits sequences), TP over `tp_group`,
    EP over `ep_group`, in that order; every rank calls it with the same full weights (and LoRA init),
    so TP=1 and TP=t start alike. Returns the model and how it was cut."""
    if context is not None:
        model = context.attach(model)
    if tp_group is not None:
        model = apply_tensor_parallel(model, tp_group)
    experts = None
    if ep_group is not None:
        from toolkit.parallel.ep import apply_expert_parallel

        experts = apply_expert_parallel(model, ep_group)
    tp = TPShards(tp_group)
    tp.read(model)
    return model, Parallelized(tp, experts)
