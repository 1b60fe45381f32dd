"""The layouts that split the model over the device mesh themselves: the project's TP layers with DDP
over the data-parallel ranks (`TensorParallelStrategy`), and FSDP2 over the mesh's `dp_shard` with the
TP layers inside when tp > 1 (`MeshShardedStrategy`, torchtitan's 2-D layout). Both may hold context
parallel slices too (`toolkit.parallel.cp`)."""

from __future__ import annotations

from typing import Callable

from toolkit.config import Config
from toolkit.layout.dims import ParallelDims
from toolkit.loss import token_loss_sum
from toolkit.parallel.mesh import fsdp_mesh, grad_dim
from toolkit.parallel.strategy import ContextSlices, DataShard, LossFn, LossHead, Strategy, accumulate
from toolkit.parallel.tp import TPShards, apply_tensor_parallel, make_layout


class TensorParallelStrategy(Strategy):
    """TP layers over the mesh's `tp` groups; DDP over `dp` (x `cp`); the loader sharded by dp rank."""

    def __init__(self, accelerator, dims: ParallelDims, mesh, cfg: Config | None = None,
                 loss_fn: LossFn = token_loss_sum):
        self.accelerator, self.dims, self.cfg = accelerator, dims, cfg
        self.layout = make_layout(dims.tp, mesh, grad_dim(dims))
        self.tp = TPShards(self.layout.tp_group)
        self.data = DataShard(accelerator, dims, mesh["dp"].get_local_rank())
        self.context = ContextSlices(mesh, dims)
        self.loss = LossHead(loss_fn, accelerator.device.type)
        self.whole_batches = dims.cp == 1

    def shard_model(self, model):
        """Every rank loads the full weights and keeps its slice (LoRA adapters are created first, so
        TP=1 and TP=t start from the same adapter init)."""
        model = apply_tensor_parallel(self.context.attach(model), self.layout.tp_group)
        self.tp.read(model)
        return model

    def prepare(self, model, optimizer_fn: Callable, loader):
        from toolkit.parallel.tp import prepare_tensor_parallel

        model, optimizer = prepare_tensor_parallel(self.accelerator, self.layout, model, optimizer_fn(model))
        self.loss.choose(self.unwrap(model), self.cfg.train.loss if self.cfg else "auto")
        return model, optimizer, self.data.loader(loader)

    def describe(self) -> str:
        over = "dp x cp" if self.dims.cp > 1 else "dp"
        return f"layout: device mesh {self.dims.describe()} (TP layers, DDP over {over})\n" + self.tp.describe() \
            + self.context.describe() + self.loss.describe()

    def forward_backward(self, model, micro: list[dict], scale):
        return accumulate(self.accelerator, model, micro, scale, self.loss, len(micro), self.context)

    def clip_grad_norm(self, model, max_norm: float):
        from toolkit.parallel.tp import clip_grad_norm

        return clip_grad_norm(model.parameters(), max_norm, self.layout)

    def state_dict(self, model) -> dict:
        """The TP shards gathered back into the full tensors a non-TP run would save."""
        return self.tp.state_dict(self.unwrap(model))


class MeshShardedStrategy(Strategy):
    """FSDP2 `fully_shard` over the mesh's data-parallel dimensions (`dp_shard`; HSDP: `dp_replicate`
    x `dp_shard`, replicated across the outer and sharded within), with the TP layers inside when
    tp > 1. Each TP rank's FSDP group holds the ranks of the same TP coordinate, so it shards that
    rank's TP slices; gradients reduce-scatter over `dp_shard` and all-reduce over `dp_replicate`."""

    def __init__(self, accelerator, dims: ParallelDims, mesh, cfg: Config, loss_fn: LossFn = token_loss_sum):
        self.accelerator, self.dims, self.cfg = accelerator, dims, cfg
        self.layout = make_layout(dims.tp, mesh, grad_dim(dims)) if dims.tp > 1 else None
        self.tp = TPShards(self.layout.tp_group if self.layout else None)
        self.shard_mesh, self.shard_group = fsdp_mesh(mesh, dims), mesh.get_group(grad_dim(dims, sharded=True))
        self.data = DataShard(accelerator, dims, mesh["dp"].get_local_rank())
        self.context = ContextSlices(mesh, dims)
        self.loss = LossHead(loss_fn, accelerator.device.type)
        self.whole_batches = dims.cp == 1

    def shard_model(self, model):
        model = self.context.attach(model)
        if self.layout is not None:
            model = apply_tensor_parallel(model, self.layout.tp_group)
        self.tp.read(model)
        return model

    def prepare(self, model, optimizer_fn: Callable, loader):
        from torch.distributed.fsdp import fully_shard

        from toolkit.parallel.tp.plan import decoder_blocks

        a = self.accelerator
        model = model.to(a.device)
        reshard = self.cfg.parallel.fsdp_sharding != "grad_op"
        for block in decoder_blocks(model):
            fully_shard(block, mesh=self.shard_mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=self.shard_mesh, reshard_after_forward=reshard)
        if a.mixed_precision == "bf16":  # fp32 weights and reductions, bf16 compute (as the other layouts)
            from toolkit.parallel.tp import autocast_forward

            autocast_forward(a, model)
        optimizer = a.prepare_optimizer(optimizer_fn(model))  # over this rank's shards
        self.loss.choose(self.unwrap(model), self.cfg.train.loss)
        return model, optimizer, self.data.loader(loader)

    def describe(self) -> str:
        inside = ", TP layers inside" if self.dims.tp > 1 else ""
        return f"layout: device mesh {self.dims.describe()} (FSDP2 over {self.shard_mesh.mesh_dim_names}{inside})\n" \
            + self.tp.describe() + self.context.describe() + self.loss.describe()

    def forward_backward(self, model, micro: list[dict], scale):
        total = accumulate(self.accelerator, model, micro, scale, self.loss, len(micro), self.context)
        self.tp.reduce_partial_grads(self.unwrap(model))
        return total

    def clip_grad_norm(self, model, max_norm: float):
        from toolkit.parallel.grad_norm import clip_grad_norm

        named = list(self.unwrap(model).named_parameters())
        split = [p for n, p in named if n in self.tp.split]
        rest = [p for n, p in named if n not in self.tp.split]
        tp = (self.tp.group,) if self.tp.group is not None else ()
        return clip_grad_norm([p for _, p in named], max_norm,
                              [(split, (*tp, self.shard_group)), (rest, (self.shard_group,))])

    def state_dict(self, model) -> dict:
        return self.tp.state_dict(self.unwrap(model))
