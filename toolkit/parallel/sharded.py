"""Every layout on the device mesh but the pipeline, in one class (`MeshStrategy`): FSDP2 over the mesh's
data-parallel dimensions where they shard (`--fsdp` on any number of ranks, `--dp-shard`, HSDP), else DDP
over `loss` (dp, x cp); the project's TP layers, expert parallel and Ulysses attention inside, all applied
by `toolkit.parallel.parallelize`. TP inside FSDP2 is torchtitan's 2-D layout: each TP rank's FSDP group
holds the ranks of the same TP coordinate, so it shards that rank's TP slices."""

from __future__ import annotations

from typing import Callable

from toolkit.parallel.strategy import Parts, Strategy, accumulate


class MeshStrategy(Parts, Strategy):
    """FSDP2 where `parallelism.fsdp` is set, else DDP (`parallelism.ddp`); the loader sharded by dp rank.
    Gradients reduce-scatter over the shard group (all-reduce over `dp_replicate`), or all-reduce over dp
    (x cp) under DDP."""

    @property
    def whole_batches(self) -> bool:
        return self.dims.cp == 1

    @property
    def sharded(self) -> bool:
        return self.parallelism.fsdp is not None

    def prepare(self, model, optimizer_fn: Callable, loader):
        """The optimizer over this rank's parameters (FSDP2's shards; DDP's whole ones), both applied by
        `shard_model`."""
        optimizer = self.accelerator.prepare_optimizer(optimizer_fn(model))
        self.loss.choose(self.unwrap(model), self.settings.loss)
        return model, optimizer, self.data.loader(loader)

    def describe(self) -> str:
        fsdp = self.parallelism.fsdp
        experts = self.experts.describe(fsdp.experts_mesh if fsdp else None) if self.experts else ""
        return mesh_layout(self.dims, fsdp, self.accelerator.mixed_precision) + "\n" + self.parallelized.describe() \
            + experts + self.context.describe() + self.loss.describe()

    def forward_backward(self, model, micro: list[dict], scale):
        """FSDP2 sums the shards' gradients (its division is off); DDP averages over dp (x cp)."""
        averaged_over = 1 if self.sharded else self.dims.dp * self.dims.cp
        total = accumulate(self.accelerator, model, micro, scale, self.loss, self.context, averaged_over)
        # FSDP2 replaced the parameters, and with them the TP plan's gradient hooks
        if self.sharded:
            self.parallelized.reduce_partial_grads(self.unwrap(model))
        return total

    def clip_grad_norm(self, model, max_norm: float):
        """The full model's norm: TP slices' squares summed over the TP group, FSDP2 shards' over the
        shard group, the experts' over theirs (`Parallelized.norm_parts`)."""
        from toolkit.parallel.grad_norm import clip_grad_norm

        named = dict(self.unwrap(model).named_parameters())
        shard = (self.mesh.group("fsdp"),) if self.sharded else ()
        ep, _, expert_shard = self.mesh.expert_groups()
        parts = self.parallelized.norm_parts(named, shard, expert_groups=(expert_shard, ep))
        return clip_grad_norm(list(named.values()), max_norm, parts)

    def gathered(self, model):
        """FSDP2: every unit's parameters gathered once for the block (`toolkit.parallel.fsdp.unsharded`);
        DDP over the TP layers: the model as it is (its TP forwards exchange inside)."""
        if not self.sharded:
            return Strategy.gathered(self, model)
        from toolkit.parallel.fsdp import unsharded

        return unsharded(self.unwrap(model), self.parallelism.fsdp.reshard)

    def state_dict(self, model) -> dict:
        """The TP shards and expert-parallel slices gathered back into the full tensors a one-process
        run would save."""
        return self.parallelized.state_dict(self.unwrap(model))


def mesh_layout(dims, fsdp, mixed_precision: str) -> str:
    """'layout: device mesh ... (FSDP2 over ...: ...)': how the mesh runs, FSDP2 as `fsdp` says or DDP."""
    if fsdp is None:
        return f"layout: device mesh {dims.describe()} (TP layers, DDP over {'dp x cp' if dims.cp > 1 else 'dp'})"
    bf16 = "; gathered in bf16, gradients reduced in fp32" if mixed_precision == "bf16" else ""
    if dims.world_size == 1:
        return (f"layout: FSDP2 on one process (nothing to shard; each block's parameters gathered for its forward "
                f"and backward{bf16 or ' in fp32'}, without autocast's weight copies)")
    inside = ", TP layers inside" if dims.tp > 1 else ""
    how = ("parameters resharded after each block's forward (ZeRO-3-like)" if fsdp.reshard
           else "parameters kept gathered from forward to backward (ZeRO-2-like)")
    return (f"layout: device mesh {dims.describe()} (FSDP2 over {fsdp.mesh.mesh_dim_names}{inside}: parameters, "
            f"gradients and optimizer state sharded; {how}{bf16})")
