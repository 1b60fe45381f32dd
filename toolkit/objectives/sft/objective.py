"""`--objective sft`: rows read from the data, trained with the token loss the strategy's loss head computes
itself (a fused head where the device and the model allow one, `toolkit.objectives.sft.loss`), evaluated by
the held-out rows' mean token loss. The preference objectives read their rows the same way
(`toolkit.objectives.preference.objective`)."""

from __future__ import annotations

import math
from typing import Callable, Iterator

import torch

from toolkit.config.objectives import EXAMPLES
from toolkit.data.loader import global_batches, training_loader
from toolkit.objectives.base import Context, LayoutHooks, Loss


class ReadBatches:
    """The global batches of an objective that reads its rows (`toolkit.data.loader.global_batches`): nothing
    to measure, no time apart from training, nothing for a checkpoint beyond the step."""

    def __init__(self, batches: Iterator[tuple[int, list[dict]]]):
        self.batches = batches

    def __iter__(self) -> "ReadBatches":
        return self

    def __next__(self) -> tuple[int, list[dict]]:
        return next(self.batches)

    def take_metrics(self) -> dict[str, float]:
        return {}

    def take_seconds(self) -> float:
        return 0.0

    def state_dict(self) -> dict | None:
        return None


class SFT:
    """Supervised finetuning on the assistant's tokens (`toolkit.objectives.base.Objective`)."""

    eval_metric = "eval_loss"
    # the loss head's own token loss
    loss: Loss | None = None

    def __init__(self, cfg):
        self.cfg, self.name = cfg, cfg.train.objective
        example = EXAMPLES[self.name]
        self.sequences, self.unit = example.sequences, example.unit

    def make_loss(self, hooks: LayoutHooks) -> Loss | None:
        return None

    def tokenizer_problems(self, tokenizer) -> list[str]:
        return []

    def layout_problems(self, kind: str, dims) -> list[str]:
        return []

    def loader(self, rows, tokenizer, log: Callable[[str], None], pin: bool, whole: bool, attn: str | None):
        return training_loader(self.cfg, rows, tokenizer, log, pin, whole, attn, self.sequences, self.unit)

    def steps_per_epoch(self, loader, rows, data_ranks: int) -> int:
        t = self.cfg.train
        # a stream has no epochs
        return t.max_steps if self.cfg.data.streaming else math.ceil(len(loader) / t.grad_accum)

    def batch_words(self, global_batch: int) -> str:
        # packed: each row holds several examples (the packing line says how many rows the epoch has); a stream
        # batches records and packs them as they come
        if self.cfg.data.packing and not self.cfg.data.streaming:
            return f"{global_batch} packed rows of <= {self.cfg.data.seq_len} tokens"
        return f"{global_batch} examples"

    def before_training(self, ctx: Context, loader, rows, eval_rows, steps_per_epoch: int, resuming: bool) -> None:
        """Nothing: the token loss needs no pass before step 1."""

    def batches(self, ctx: Context, loader, rows, first_step: int, steps_per_epoch: int,
                saved: dict | None) -> ReadBatches:
        """The loader's global batches from `first_step`: mid-epoch, this rank's micro-batches of the epoch
        before it skipped; a stream skips its records before it is sharded (steps x global batch)."""
        t = self.cfg.train
        epoch, step_in_epoch = divmod(first_step - 1, steps_per_epoch)
        if self.cfg.data.streaming:
            rows.start, step_in_epoch = ((first_step - 1) * t.grad_accum * t.micro_batch_size
                                         * ctx.strategy.data.ranks, 0)
        return ReadBatches(global_batches(loader, t.grad_accum, (epoch, step_in_epoch * t.grad_accum)))

    def begin_step(self, model, micro: list[dict], reduce, replicas: int, examples: torch.Tensor) -> None:
        if self.loss is not None:
            self.loss.begin_step(model, micro, reduce, replicas, examples)

    def metric_values(self, sums: torch.Tensor, examples) -> dict[str, float]:
        return self.loss.metric_values(sums, examples) if self.loss is not None else {}

    def extra_forwards(self) -> int:
        return 0

    def evaluate(self, ctx: Context, rows) -> dict[str, float]:
        from toolkit.objectives.sft.evaluate import eval_loss

        return {"eval_loss": eval_loss(ctx.strategy, ctx.model, rows, self.cfg.train.micro_batch_size,
                                       ctx.tokenizer.pad_token_id)}
