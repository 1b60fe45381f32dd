"""The naive pipeline: one process, the model's stages on a list of devices (GPipe, torchgpipe-style).

A batch is split into m micro-batches. Forward runs on a clock: at tick t stage s works on
micro-batch t - s, so after p - 1 ticks every stage is busy (on GPUs kernels launch
asynchronously, so the devices overlap); the micro-batch losses are summed and one backward runs
through every stage (autograd keeps one worker per device). Gradients accumulate over the
micro-batches. Of the m + p - 1 ticks each stage idles p - 1: the bubble (p-1)/(m+p-1) of GPipe
(Huang et al. 2019, https://arxiv.org/abs/1811.06965, section 2.2).
"""

from __future__ import annotations

import torch
from torch import nn

from toolkit.parallel.grad_norm import clip_grad_norm
from toolkit.parallel.pp.split import DecoderStage, autocast, decoder_parts, own_loss, param_costs, time_costs
from toolkit.planner.stages import balance, stage_bounds
from toolkit.data.labels import count_targets
from toolkit.objectives.sft.loss import token_loss_sum


def bubble_fraction(stages: int, microbatches: int) -> float:
    """Idle share of each stage in a GPipe step: (p - 1) / (m + p - 1) (GPipe, section 2.2)."""
    return (stages - 1) / (microbatches + stages - 1)


def split_microbatches(batch: dict[str, torch.Tensor], m: int) -> list[dict[str, torch.Tensor]]:
    """m equal slices along the batch dimension (the caller checked that m divides it)."""
    n = batch["input_ids"].shape[0]
    if n % m:
        raise ValueError(f"{m} pipeline micro-batches do not divide a batch of {n}")
    size = n // m
    return [{k: v[i * size:(i + 1) * size] for k, v in batch.items()} for i in range(m)]


def stage_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What every stage is given besides the activations: the padding mask, or the packed positions."""
    # packed: per-example positions make the block-diagonal mask
    if "position_ids" in batch:
        return {"position_ids": batch["position_ids"]}
    return {"attention_mask": batch["attention_mask"]}


def split_sizes(parts, stages: int, by: str, sample_shape: tuple[int, int] | None, device) -> list[int]:
    if by == "time":
        blocks, first, last = time_costs(parts, *(sample_shape or (1, 128)), device=device)
    else:
        blocks, first, last = param_costs(parts)
    return balance(blocks, stages, first, last)


class NaivePipeline(nn.Module):
    """The model's stages on `devices` in one process; `train_step` runs a GPipe step."""

    def __init__(self, model: nn.Module, devices: list[torch.device], microbatches: int, by: str = "params",
                 sample_shape: tuple[int, int] | None = None, autocast_dtype: torch.dtype | None = None,
                 loss_fn=token_loss_sum):
        super().__init__()
        # (logits, labels) -> summed loss
        self.loss_fn = loss_fn
        parts = decoder_parts(model)
        # not a submodule: parameters() are the stages' (shared) ones
        self.__dict__["model"] = model
        self.devices, self.microbatches = devices, microbatches
        self.sizes = split_sizes(parts, len(devices), by, sample_shape, devices[0])
        bounds = stage_bounds(self.sizes)
        self.stages = nn.ModuleList(
            DecoderStage(parts, a, b, first=i == 0, last=i == len(devices) - 1, autocast_dtype=autocast_dtype)
            for i, (a, b) in enumerate(bounds))
        tied = parts.head.weight is parts.embed.weight
        for stage, device in zip(self.stages, devices):
            for name, child in stage.named_children():
                # a tied head stays with the embeddings on stage 0
                if not (tied and name == "head"):
                    child.to(device)
        if parts.rotary is not None:
            parts.rotary.to(devices[0])
        self.autocast_dtype = autocast_dtype

    def describe(self) -> str:
        bounds = stage_bounds(self.sizes)
        parts = ", ".join(f"{d}: blocks {a}-{b - 1}" for d, (a, b) in zip(self.devices, bounds))
        p, m = len(self.devices), self.microbatches
        return (f"naive pipeline: {p} stages ({parts}); {m} micro-batch{'es' if m > 1 else ''}, "
                f"expected bubble (p-1)/(m+p-1) = {bubble_fraction(p, m):.1%}")

    def forward_microbatches(self, batch: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """Logits of each micro-batch, run on the GPipe clock."""
        mbs = split_microbatches(batch, self.microbatches)
        acts = [mb["input_ids"] for mb in mbs]
        p, m = len(self.stages), len(mbs)
        for tick in range(m + p - 1):
            for s in range(p):
                i = tick - s
                if 0 <= i < m:
                    acts[i] = self.stages[s](acts[i], **stage_inputs(mbs[i]))
        return acts

    def train_step(self, batch: dict[str, torch.Tensor], scale: float | torch.Tensor, objective=None) -> torch.Tensor:
        """Forward and backward of one batch; gradients accumulate. Returns the summed token loss (a
        preference `objective` is refused before this pipeline is built: `make_strategy`)."""
        mbs = split_microbatches(batch, self.microbatches)
        logits = self.forward_microbatches(batch)
        total = sum(self.loss_fn(lg, mb["labels"].to(lg.device)) for lg, mb in zip(logits, mbs))
        (total * (scale.to(total.device) if torch.is_tensor(scale) else scale)).backward()
        return total.detach().double()

    @torch.no_grad()
    def loss_sum(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = self.stages_forward(batch)
        return self.loss_fn(logits, batch["labels"].to(logits.device)).double()

    @torch.no_grad()
    def loss_check(self, batch: dict[str, torch.Tensor]) -> tuple[float, float]:
        """(the loss per target token as the last stage computes it, the model's own loss on the same
        final hidden states: `split.own_loss`) on `batch`."""
        last = self.stages[-1]
        last.keep_hidden = True
        try:
            ours = self.loss_sum(batch) / count_targets(batch["labels"]).clamp(min=1)
        finally:
            last.keep_hidden = False
        hidden, last.kept = last.kept, None
        with autocast(hidden.device, self.autocast_dtype):
            own = own_loss(self.model, hidden, batch["input_ids"], batch["labels"])
        return ours.item(), own.item()

    def stages_forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        x = batch["input_ids"]
        for stage in self.stages:
            x = stage(x, **stage_inputs(batch))
        return x

    def finish_grads(self) -> None:
        """Nothing to synchronise in one process (DDP over naive pipelines is not offered)."""

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        params = list(self.parameters())
        return clip_grad_norm(params, max_norm, [(params, ())])

    def gather(self, to_cpu: bool = True) -> nn.Module:
        """The HF model (its parameters are the stages'), moved back to CPU after training so plain
        HF code (generation, the integrity reload) can run it; left in place for a mid-run save."""
        return self.model.to("cpu") if to_cpu else self.model
