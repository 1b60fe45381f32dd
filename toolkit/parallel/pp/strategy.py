"""The pipeline layout as a strategy: one stage per rank over the mesh's `pp` groups (each stage
TP-split over `tp` and/or FSDP2-sharded over `dp_shard`, data parallel over `dp`), or, in one
process, the naive pipeline with every stage on its own device. The stages are cut by
`toolkit.parallel.parallelize.apply_stages` at `prepare`; they run forward and backward themselves
(`train_step`); the loop sees one strategy like any other."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Callable

import torch

from toolkit.objectives.sft.loss import LogitTransform
from toolkit.parallel.strategy import Parts, Strategy


def pipeline_logps(model, batch: dict, reference: bool = False) -> torch.Tensor:
    """Each whole row's log-probability without gradients (`toolkit.objectives.base.LayoutHooks.forward_logps`)
    through a pipeline's stages, the last stage's sent to every stage (`model`: the prepared pipeline;
    before `prepare` and after its export, the HF model's own forward); `reference`: LoRA's adapters off."""
    from toolkit.parallel.pp import StagePipeline
    from toolkit.objectives.logps import whole_row_logps

    if not isinstance(model, StagePipeline):
        return whole_row_logps(model, batch, reference)
    with model.model.disable_adapter() if reference else nullcontext():
        return model.sequence_logps(batch).float()


class PipelineStrategy(Parts, Strategy):
    """Stages over the mesh's `pp` groups (`parallelism.stages.layout`), or every stage in this process."""

    # cut into pipeline micro-batches
    whole_batches = False
    # the stages and their schedule, from `prepare`; None again once exported
    pipe = None

    @property
    def sharded(self) -> bool:
        return self.parallelism.fsdp is not None

    def prepare(self, model, optimizer_fn: Callable, loader):
        from toolkit.data import longest_row
        from toolkit.parallel.parallelize import apply_stages

        # the stage split may be timed on a real micro-batch's shape; padding as the loader pads
        sample = (loader.batch_size, longest_row(loader.dataset, self.settings.seq_len))
        # a partial of collate, or a stream's StreamCollate
        fn = loader.collate_fn
        pad_id = fn.pad_id if hasattr(fn, "pad_id") else fn.keywords["pad_id"]
        # full logits on the last stage; an objective's dropout off, an MoE model's load counted
        self.loss.choose(model, "full")
        holders = self.experts.holders if self.experts else ()
        self.pipe = apply_stages(model, self.parallelism, sample, pad_id, self.loss.loss_fn, self.accelerator, holders)
        return self.pipe, optimizer_fn(self.pipe), self.data.loader(loader)

    def describe(self) -> str:
        mesh = f"layout: device mesh {self.dims.describe()}\n" if self.mesh is not None else "layout: "
        fsdp = self.parallelism.fsdp
        mesh += self.experts.describe(fsdp.experts_mesh if fsdp else None) if self.experts else ""
        transform = LogitTransform.of(self.pipe.model)
        how = "" if transform.identity else f" ({transform.describe()}, as the model's forward)"
        if self.loss.objective is not None:
            return f"{mesh}{self.pipe.describe()}\nloss: {self.loss.objective.describe()}, on the last stage"
        return f"{mesh}{self.pipe.describe()}\nloss: full logits{how} + cross-entropy on the last stage"

    def loss_check(self, model, batch: dict, full_logits: bool = False):
        """On the rows `check_window` cuts: the pipeline's loss as its last stage computes it against the model's
        own head, transform and loss function on the same final hidden states; None on the other stages."""
        from toolkit.data.labels import check_window
        from toolkit.objectives.head import LossCheck

        got = self.pipe.loss_check(check_window(batch, self.pipe.model.config.get_text_config().vocab_size))
        ours, own = got if got is not None else (None, None)
        return LossCheck(ours, own, "full logits + cross-entropy on the last stage")

    def unwrap(self, model):
        return self.pipe.model if self.pipe is not None else model

    def forward_backward(self, model, micro: list[dict], scale) -> torch.Tensor:
        """An objective is computed on the last stage from each row's log-probability; LoRA's reference
        first, in a forward of the whole pipeline with the adapters disabled."""
        total = torch.zeros((), dtype=torch.float64, device=self.accelerator.device)
        objective = self.loss.objective
        # the stages run forward and backward themselves
        for batch in micro:
            ref = objective.reference_logps(model, batch) if objective is not None else None
            # LoRA's through `pipeline_logps`, adapters off; a precomputed one as it came
            if ref is not None:
                batch = {**batch, "ref_logps": ref}
            total += self.pipe.train_step(batch, scale=scale, objective=objective).to(total.device)
        # tied embedding halves summed; gradients summed over dp (loss_scale: x 1)
        self.pipe.finish_grads()
        # the TP gradient hooks went with the parameters FSDP2 replaced
        if self.sharded:
            self.parallelized.reduce_partial_grads(self.pipe.model)
        return total

    def clip_grad_norm(self, model, max_norm: float):
        # the naive pipeline: every stage in this process
        if self.mesh is None:
            return self.pipe.clip_grad_norm(max_norm)
        ep, _, expert_shard = self.mesh.expert_groups()
        shard = self.mesh.group("dp_shard") if self.sharded else None
        return self.pipe.clip_grad_norm(max_norm, self.parallelized, shard, (expert_shard, ep))

    def eval_device(self, model) -> torch.device:
        return self.accelerator.device if self.pipe is not None else next(model.parameters()).device

    def eval_loss_sum(self, model, batch: dict) -> torch.Tensor:
        # logits exist on the last stage only
        if self.pipe is not None:
            return self.pipe.loss_sum(batch)
        return Strategy.eval_loss_sum(self, model, batch)

    def named_trainable(self, model) -> list:
        """This stage's trainable parameters (`StagePipeline.named_trainable`); every stage's in one process."""
        if self.mesh is None:
            return Strategy.named_trainable(self, model)
        return self.pipe.named_trainable(self.parallelized.cuts)

    def export(self, model, final: bool = True):
        """Every stage's weights back in one HF model on every rank (collective). After training it
        moves to CPU and the pipeline is done; a mid-run save leaves it in place."""
        exported = self.pipe.gather(to_cpu=final)
        if final:
            self.pipe = None
        return exported

    def state_dict(self, model) -> dict:
        return self.parallelized.state_dict(model)
