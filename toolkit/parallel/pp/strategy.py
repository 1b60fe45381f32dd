"""The pipeline layout as a strategy: one stage per rank over the mesh's `pp` groups (each stage
TP-split over `tp` and/or FSDP2-sharded over `dp_shard`, data parallel over `dp`), or, in one
process, the naive pipeline with every stage on its own device. The stages run forward and backward
themselves (`train_step`); the loop sees one strategy like any other."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Callable

import torch

from toolkit.layout.dims import ParallelDims
from toolkit.layout.flags import ParallelConfig
from toolkit.loss import LogitTransform, token_loss_sum
from toolkit.parallel.parallelize import Parallelized, FsdpSpec, parallelize
from toolkit.loss_head import LossFn, LossHead
from toolkit.parallel.strategy import DataShard, Settings, Strategy
from toolkit.parallel.tp import TPShards


class PipelineStrategy(Strategy):
    """Stages over the mesh's `pp` groups (`layout`), or every stage in this process (no mesh)."""

    whole_batches = False  # cut into pipeline micro-batches

    def __init__(self, accelerator, dims: ParallelDims, mesh, par: ParallelConfig, settings: Settings = Settings(),
                 loss_fn: LossFn = token_loss_sum):
        from toolkit.parallel.pp import make_pipeline_layout, pipeline_devices

        self.accelerator, self.dims, self.par, self.settings = accelerator, dims, par, settings
        self.layout = make_pipeline_layout(dims.pp, mesh) if mesh is not None else None
        if self.layout is None:
            pipeline_devices(par)  # a missing GPU fails now, before any weights are read
        self.tp_layout = None
        if dims.tp > 1:  # pp x tp: every stage holds TP layers over the mesh's tp groups
            from toolkit.parallel.tp import make_layout

            self.tp_layout = make_layout(dims.tp, mesh)
        self.parallelized = Parallelized(TPShards(self.tp_layout.tp_group if self.tp_layout else None))  # until `shard_model`
        self.shard_group = self.fsdp = None
        self.ep_group = self.expert_mesh = self.expert_shard_group = None
        if mesh is not None:  # pp x ep: each stage's experts split over its ep group (`toolkit.parallel.ep`),
            # as MeshStrategy's (dp_shard ranks, or under tp the TP group, with or without dp_shard)
            self.ep_group, self.expert_mesh, self.expert_shard_group = mesh.expert_groups()
        if dims.dp_shard > 1:  # pp x dp_shard: each stage FSDP2-sharded over its dp group
            from toolkit.parallel.fsdp import half_dtype

            self.shard_group = mesh.group("dp_shard")
            self.fsdp = FsdpSpec(mesh.fsdp(), settings.reshard, half_dtype(accelerator.mixed_precision),
                              self.expert_mesh)
        self.data = DataShard(accelerator, dims, self.layout.dp_rank if self.layout else 0)
        self.loss = LossHead(loss_fn, accelerator.device.type, accelerator.mixed_precision)  # full logits on the last stage: never a fused head
        self.pipe = None  # built in prepare(); None again once exported

    def shard_model(self, model):
        """TP, EP and checkpointing on the whole model before the stages are cut from it, FSDP2 on each
        stage as `prepare` cuts it (`toolkit.parallel.parallelize`; no context parallel or compile under --pp)."""
        model, self.parallelized = parallelize(model, self.settings.parallelism(
            tp_group=self.tp.group, ep_group=self.ep_group, fsdp=self.fsdp, stages=True))
        return model

    def prepare(self, model, optimizer_fn: Callable, loader):
        from toolkit.data import longest_row
        from toolkit.parallel.pp import build_pipeline

        # the stage split may be timed on a real micro-batch's shape; padding as the loader pads
        sample = (loader.batch_size, longest_row(loader.dataset, self.settings.seq_len))
        fn = loader.collate_fn  # a partial of collate, or a stream's StreamCollate
        pad_id = fn.pad_id if hasattr(fn, "pad_id") else fn.keywords["pad_id"]
        # full logits on the last stage; a preference objective's dropout off, an MoE model's load counted
        self.loss.choose(model, "full")
        self.pipe = build_pipeline(self.par, self.accelerator, self.layout, model, sample, pad_id, self.loss.loss_fn,
                                   self.fsdp, self.experts.holders if self.experts else ())
        return self.pipe, optimizer_fn(self.pipe), self.data.loader(loader)

    def describe(self) -> str:
        mesh = f"layout: device mesh {self.dims.describe()}\n" if self.layout is not None else "layout: "
        mesh += self.experts.describe(self.expert_mesh if self.fsdp is not None else None) if self.experts else ""
        transform = LogitTransform.of(self.pipe.model)
        how = "" if transform.identity else f" ({transform.describe()}, as the model's forward)"
        if self.loss.objective is not None:
            return f"{mesh}{self.pipe.describe()}\nloss: {self.loss.objective.describe()}, on the last stage"
        return f"{mesh}{self.pipe.describe()}\nloss: full logits{how} + cross-entropy on the last stage"

    def loss_check(self, model, batch: dict) -> tuple[float, float] | None:
        """On the rows `check_window` cuts: the pipeline's loss as its last stage computes it against the model's
        own head, transform and loss function on the same final hidden states; None on the other stages."""
        from toolkit.data.labels import check_window

        return self.pipe.loss_check(check_window(batch, self.pipe.model.config.get_text_config().vocab_size))

    def unwrap(self, model):
        return self.pipe.model if self.pipe is not None else model

    def forward_backward(self, model, micro: list[dict], scale) -> torch.Tensor:
        """A preference objective is computed on the last stage from each row's log-probability; LoRA's
        reference first, in a forward of the whole pipeline with the adapters disabled."""
        total = torch.zeros((), dtype=torch.float64, device=self.accelerator.device)
        objective = self.loss.objective
        for batch in micro:  # the stages run forward and backward themselves
            ref = objective.reference_logps(model, batch) if objective is not None else None
            if ref is not None:  # LoRA's through `sequence_logps`, adapters off; a precomputed one as it came
                batch = {**batch, "ref_logps": ref}
            total += self.pipe.train_step(batch, scale=scale, objective=objective).to(total.device)
        self.pipe.finish_grads()  # tied embedding halves summed; gradients summed over dp (loss_scale: x 1)
        if self.fsdp is not None:  # the TP gradient hooks went with the parameters FSDP2 replaced
            self.tp.reduce_partial_grads(self.pipe.model)
        return total

    def sequence_logps(self, model, batch: dict, reference: bool = False) -> torch.Tensor:
        """Through the stages (their last one's, sent to every stage); `reference`: LoRA's adapters off."""
        if self.pipe is None or self.layout is None:
            return Strategy.sequence_logps(self, model, batch, reference)
        with self.pipe.model.disable_adapter() if reference else nullcontext():
            return self.pipe.sequence_logps(batch).float()

    def clip_grad_norm(self, model, max_norm: float):
        if self.layout is None:  # the naive pipeline: every stage in this process
            return self.pipe.clip_grad_norm(max_norm)
        return self.pipe.clip_grad_norm(max_norm, self.parallelized, self.shard_group, (self.expert_shard_group, self.ep_group))

    def eval_device(self, model) -> torch.device:
        return self.accelerator.device if self.pipe is not None else next(model.parameters()).device

    def eval_loss_sum(self, model, batch: dict) -> torch.Tensor:
        if self.pipe is not None:  # logits exist on the last stage only
            return self.pipe.loss_sum(batch)
        return Strategy.eval_loss_sum(self, model, batch)

    def named_trainable(self, model) -> list:
        """This stage's trainable parameters under the full model's names, each with its cut
        (`Parallelized.cuts`); a tied LM head is saved under its embedding's name, as a model without
        stages names it."""
        if self.layout is None:  # the naive pipeline: every stage in this process
            return Strategy.named_trainable(self, model)
        embed = self.pipe.model.get_input_embeddings().weight
        embed_name = next((n for n, p in self.pipe.model.named_parameters() if p is embed), None)
        cuts = self.parallelized.cuts
        out = []
        for n, p in self.pipe.names.items():
            if p.requires_grad:
                name = embed_name if self.pipe.tied is not None and p is self.pipe.tied and embed_name else n
                out.append((name, p, cuts.get(n, cuts.get(name))))
        return out

    def export(self, model, final: bool = True):
        """Every stage's weights back in one HF model on every rank (collective). After training it
        moves to CPU and the pipeline is done; a mid-run save leaves it in place."""
        exported = self.pipe.gather(to_cpu=final)
        if final:
            self.pipe = None
        return exported

    def state_dict(self, model) -> dict:
        return self.parallelized.state_dict(model)
