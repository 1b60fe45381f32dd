"""FSDP2, applied in one place for every layout that shards parameters: 1-D `--fsdp`, `--dp-shard`, HSDP,
TP x FSDP and pipeline stages (torchtitan's `apply_fsdp`, `torchtitan/models/llama3/infra/parallelize.py`).

Mixed precision is FSDP2's `MixedPrecisionPolicy`, not autocast: the fp32 shards are the master weights,
each block's parameters are all-gathered in the compute dtype (2 bytes a parameter under bf16) and freed
after its forward, and gradients are reduce-scattered in fp32. Under autocast the gather was fp32 and
every linear's bf16 cast of its weight was saved for backward, a bf16 copy of the whole model held on
every rank until backward (`toolkit.planner.saved.autocast_copies`). What the policy changes in the
numerics (the residual stream and the norms' outputs in bf16, as in a bf16 model) is measured in
docs/parallelism.md#mixed-precision-under-fsdp2."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import nn


@dataclass(frozen=True)
class FsdpSpec:
    """FSDP2's part of a layout: the mesh the dense parts shard over, whether parameters reshard after each
    block's forward (ZeRO-3-like; False keeps them gathered to backward, ZeRO-2-like), the dtype they are
    gathered in (None: as stored), and the experts' own mesh under expert parallel."""
    mesh: Any
    reshard: bool = True
    compute_dtype: torch.dtype | None = None
    experts_mesh: Any = None


def mixed_precision_policy(compute_dtype: torch.dtype | None, cast_inputs: bool = True):
    """Gather parameters in `compute_dtype` (None: as stored), reduce gradients in fp32; `cast_inputs`
    off leaves a unit's inputs as they come (an experts unit's fp32 routing weights)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32, cast_forward_inputs=cast_inputs)


def apply_fsdp(root: nn.Module, blocks: list[nn.Module], mesh, reshard_after_forward: bool,
               compute_dtype: torch.dtype | None, experts: list[nn.Module] = (), experts_mesh=None) -> nn.Module:
    """`fully_shard` each block, then `root` (what is left: embeddings, final norm, head) over `mesh`,
    with the mixed-precision policy. Parameters reshard after each forward where `reshard_after_forward`
    (ZeRO-3-like); False keeps them gathered until backward (ZeRO-2-like). Gradients are summed, not
    averaged, over the shard (and replicate) ranks: the loss is already divided by the global batch's
    target count (`toolkit.parallel.strategy.loss_scale`; torchtitan turns FSDP's division off alike).
    Call after the TP layers, checkpointing and compile (torchtitan's order). `experts` (expert
    parallel: each rank's own experts) are sharded first, over `experts_mesh`, the ranks that hold the
    same experts; their blocks then leave them out (torchtitan's `apply_fsdp` with ep)."""
    from torch.distributed.fsdp import fully_shard

    policy = mixed_precision_policy(compute_dtype)
    # inside a block, whose inputs the policy cast: the router's weights stay as it made them
    for module in experts:
        fully_shard(module, mesh=experts_mesh, mp_policy=mixed_precision_policy(compute_dtype, cast_inputs=False),
                    reshard_after_forward=reshard_after_forward)
        sum_gradients(module)
    for module in [*blocks, root]:
        fully_shard(module, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
        sum_gradients(module)
    return root


def sum_gradients(module) -> None:
    """FSDP2's gradient reductions as plain sums: a divide factor of 1, with sum-type collectives (a
    factor would otherwise be NCCL's PREMUL_SUM, which gloo does not have; with 1 no division runs)."""
    module.set_gradient_divide_factor(1.0)
    module.set_force_sum_reduction_for_comms(True)


def half_dtype(mixed_precision: str) -> torch.dtype | None:
    """The dtype the policy gathers parameters in for accelerate's `mixed_precision` ('bf16' or 'no':
    fp16 is refused on the mesh, which has no loss scaling)."""
    return torch.bfloat16 if mixed_precision == "bf16" else None


@contextmanager
def unsharded(model: nn.Module, reshard: bool) -> Iterator[nn.Module]:
    """`model` with every FSDP2 unit's parameters all-gathered once (`FSDPModule.unshard`) for a block of
    forwards without gradients (generation), not once per forward: resharding after forward is off
    meanwhile, so each unit's pre-forward hook finds its parameters unsharded and gathers nothing, and its
    post-forward hook keeps them. After it every unit reshards and resumes what `apply_fsdp` gave it:
    `reshard` (--fsdp-sharding), the root's included (given explicitly, FSDP2 does not turn the root's off)."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
        unit.unshard()
    try:
        yield model
    finally:
        for unit in units:
            unit.reshard()
            unit.set_reshard_after_forward(reshard, recurse=False)
