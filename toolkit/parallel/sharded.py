"""Every layout on the device mesh but the pipeline, in one class (`MeshStrategy`), built in
torchtitan's order: the project's TP layers where tp > 1 (and Ulysses attention where cp > 1) when the
model is loaded, then FSDP2 over the mesh's data-parallel dimensions where they shard (`--fsdp` on any
number of ranks, `--dp-shard`, HSDP: `toolkit.parallel.fsdp.apply_fsdp`), else DDP over `dp` (x `cp`).
TP inside FSDP2 is torchtitan's 2-D layout: each TP rank's FSDP group holds the ranks of the same TP
coordinate, so it shards that rank's TP slices."""

from __future__ import annotations

from typing import Callable

import torch

from toolkit.layout.dims import ParallelDims
from toolkit.loss import token_loss_sum
from toolkit.parallel.mesh import Mesh, grad_dim
from toolkit.parallel.parallelize import Parallelized, FsdpSpec, parallelize
from toolkit.loss_head import LossFn, LossHead
from toolkit.parallel.strategy import ContextSlices, DataShard, Settings, Strategy, accumulate
from toolkit.parallel.tp import Layout, TPShards, make_layout


class MeshStrategy(Strategy):
    """TP layers over the mesh's `tp` groups (tp > 1); FSDP2 over `dp_shard` (x `cp`; HSDP: x
    `dp_replicate`, replicated across it) where `sharded`, else DDP over `dp` (x `cp`); the loader sharded
    by dp rank. Gradients reduce-scatter over the shard group (all-reduce over `dp_replicate`), or
    all-reduce over dp under DDP."""

    def __init__(self, accelerator, dims: ParallelDims, mesh: Mesh, settings: Settings = Settings(),
                 loss_fn: LossFn = token_loss_sum, sharded: bool = True):
        from toolkit.parallel.fsdp import half_dtype

        self.accelerator, self.dims, self.settings, self.sharded = accelerator, dims, settings, sharded
        self.layout = make_layout(dims.tp, mesh, grad_dim(dims)) if dims.tp > 1 else None
        self.parallelized = Parallelized(TPShards(self.layout.tp_group if self.layout else None))  # until `shard_model`
        self.shard_group = mesh.group(grad_dim(dims, sharded=True)) if sharded else None
        self.data = DataShard(accelerator, dims, mesh.local_rank("dp"))
        self.context = ContextSlices(mesh, dims)
        self.loss = LossHead(loss_fn, accelerator.device.type, accelerator.mixed_precision)
        self.whole_batches = dims.cp == 1
        # expert parallel (`toolkit.parallel.ep`): the ep group exchanges tokens; the experts shard over
        # the ranks holding the same ones (`shard_group` for their gradient norm, replicas apart)
        self.ep_group, self.expert_mesh, self.expert_shard_group = mesh.expert_groups()
        self.fsdp = FsdpSpec(mesh.fsdp(), settings.reshard, half_dtype(accelerator.mixed_precision),
                          self.expert_mesh) if sharded else None

    def shard_model(self, model):
        """Every rank loads the full weights and keeps its slices (LoRA adapters are created first, so
        TP=1 and TP=t start from the same adapter init): `toolkit.parallel.parallelize`, FSDP2 last."""
        model, self.parallelized = parallelize(model, self.settings.parallelism(
            tp_group=self.tp.group, ep_group=self.ep_group, context=self.context, fsdp=self.fsdp,
            device=self.accelerator.device))
        return model

    def prepare(self, model, optimizer_fn: Callable, loader):
        a = self.accelerator
        if self.sharded:  # FSDP2 applied by `shard_model`
            optimizer = a.prepare_optimizer(optimizer_fn(model))  # over this rank's shards
        else:
            model, optimizer = prepare_tensor_parallel(a, self.layout, model, optimizer_fn(model))
        self.loss.choose(self.unwrap(model), self.settings.loss)
        return model, optimizer, self.data.loader(loader)

    def describe(self) -> str:
        experts = self.experts.describe(self.expert_mesh if self.sharded else None) if self.experts else ""
        tail = self.tp.describe() + experts
        tail += self.context.describe() + self.loss.describe()
        if not self.sharded:
            over = "dp x cp" if self.dims.cp > 1 else "dp"
            return f"layout: device mesh {self.dims.describe()} (TP layers, DDP over {over})\n" + tail
        bf16 = "; gathered in bf16, gradients reduced in fp32" if self.accelerator.mixed_precision == "bf16" else ""
        if self.dims.world_size == 1:
            return f"layout: FSDP2 on one process (nothing to shard; each block's parameters gathered for its " \
                f"forward and backward{bf16 or ' in fp32'}, without autocast's weight copies)\n" + tail
        inside = ", TP layers inside" if self.dims.tp > 1 else ""
        how = ("parameters resharded after each block's forward (ZeRO-3-like)" if self.settings.reshard
               else "parameters kept gathered from forward to backward (ZeRO-2-like)")
        return f"layout: device mesh {self.dims.describe()} (FSDP2 over {self.fsdp.mesh.mesh_dim_names}{inside}: " \
            f"parameters, gradients and optimizer state sharded; {how}{bf16})\n" + tail

    def forward_backward(self, model, micro: list[dict], scale):
        """FSDP2 sums the shards' gradients (its division is off); DDP averages over dp (x cp)."""
        averaged_over = 1 if self.sharded else self.dims.dp * self.dims.cp
        total = accumulate(self.accelerator, model, micro, scale, self.loss, self.context, averaged_over)
        if self.sharded:  # FSDP2 replaced the parameters, and with them the TP plan's gradient hooks
            self.tp.reduce_partial_grads(self.unwrap(model))
        return total

    def clip_grad_norm(self, model, max_norm: float):
        """The full model's norm: TP slices' squares summed over the TP group, FSDP2 shards' over the
        shard group, the experts' over theirs (`Parallelized.norm_parts`)."""
        from toolkit.parallel.grad_norm import clip_grad_norm

        named = dict(self.unwrap(model).named_parameters())
        shard = (self.shard_group,) if self.shard_group is not None else ()
        parts = self.parallelized.norm_parts(named, shard, expert_groups=(self.expert_shard_group, self.ep_group))
        return clip_grad_norm(list(named.values()), max_norm, parts)

    def state_dict(self, model) -> dict:
        """The TP shards and expert-parallel slices gathered back into the full tensors a one-process
        run would save."""
        return self.parallelized.state_dict(self.unwrap(model))

    def named_trainable(self, model) -> list:
        """`Strategy.named_trainable`, each slice placed by its cut (`Parallelized.cuts`: TP, EP)."""
        cuts = self.parallelized.cuts
        return [(n, p, cuts.get(n)) for n, p in self.unwrap(model).named_parameters() if p.requires_grad]


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
