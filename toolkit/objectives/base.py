"""What an objective is to the rest of a run.

`Objective` is what the training loop asks: where its batches come from (rows read from the data, or
completions sampled from the policy), how it is evaluated, which metrics it adds to a step's record and what
a checkpoint keeps of its batches. The loop names no objective; `toolkit.objectives.build` is the one place
that chooses one from `--objective`.

`Loss` is what the strategy's loss head runs for an objective other than the plain token loss: built once
under the layout's `LayoutHooks` (`Objective.make_loss`, from `toolkit.parallel.build.make_strategy`), so
no strategy knows which objective it trains and the objective knows no layout beyond its hooks.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterator, Protocol

import torch

from toolkit.objectives.logps import document_logps, sequence_logps, sliced_logps, whole_row_logps

# (model, batch, reference=False) -> each whole row's log-probability
LogpsFn = Callable[..., torch.Tensor]
# a sum over the cp group
SumFn = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class LayoutHooks:
    """What the layout decides for an objective, given by `toolkit.parallel.build.make_strategy`:
    `forward_logps`, whole rows' log-probabilities without gradients (a pipeline's through its stages, sent
    to every stage); under context parallel, `sum_slices` sums a sequence's slices over the cp group of
    `cp` ranks. The objective asks these methods instead of knowing the layout."""
    forward_logps: LogpsFn = whole_row_logps
    sum_slices: SumFn | None = None
    cp: int = 1

    def logps(self, logits: torch.Tensor, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(each sequence's summed target log-probability, its target count): a context-parallel slice's
        summed over the cp group, a packed row's per document, else per row."""
        if "targets" in batch:
            return sliced_logps(logits, batch["targets"], self.sum_slices)
        if "position_ids" in batch:
            return document_logps(logits, batch["labels"], batch["position_ids"], batch["attention_mask"],
                                  batch["documents"])
        return sequence_logps(logits, batch["labels"])

    def whole(self, total: torch.Tensor, batch: dict) -> torch.Tensor:
        """A loss every cp rank computes whole from the summed slices: its value once over the group, its
        gradient whole through each rank's slice."""
        return total - total.detach() * (1 - 1 / self.cp) if "targets" in batch else total


class Loss(Protocol):
    """An objective's loss other than the token loss, as `toolkit.objectives.head.LossHead` runs it."""
    # the rows need their reference log-probabilities before step 1 (`toolkit.objectives.preference.reference`)
    reference_pass: bool
    # what its examples are called (pairs)
    unit: str
    # the length of `take_metrics`' sums
    metric_width: int

    def __call__(self, model, batch: dict, inputs: dict) -> tuple[torch.Tensor, Any]:
        """(the micro-batch's summed loss, the model's output) for `batch`, its forward on `inputs`."""

    def logits_loss(self, logits: torch.Tensor, batch: dict, ref: torch.Tensor | None) -> torch.Tensor:
        """The micro-batch's summed loss from logits already computed (a pipeline's last stage)."""

    def reference_logps(self, model, batch: dict, inputs: dict | None = None) -> torch.Tensor | None:
        """The reference's per-sequence log-probabilities, or None where the objective has no reference."""

    def begin_step(self, model, micro: list[dict], reduce, replicas: int, examples: torch.Tensor) -> None:
        """What the global batch sets before its first forward (`reduce`: the sum over ranks)."""

    def take_metrics(self) -> torch.Tensor | None:
        """The metrics' sums since the last call (on the device)."""

    def metric_values(self, sums, examples) -> dict[str, float]:
        """The record's metrics from `take_metrics`' sums over a window's `examples`."""

    def prepare(self, model) -> None:
        """Applied once to the unwrapped model before training (dropout off)."""

    def describe(self) -> str:
        """The objective's line in the layout's description."""


@dataclass
class Context:
    """What an objective's batches, evaluation and reference pass are given of the run: made by the loop once
    the strategy has prepared the model."""
    # the run's config: an objective reads its own settings
    cfg: Any
    # `toolkit.parallel.strategy.Strategy`: the forwards, the data shard, the collectives
    strategy: Any
    # as the strategy prepared it
    model: torch.nn.Module
    tokenizer: Any
    out_dir: Path
    total_steps: int
    # the metrics records' cadence
    log_every: int
    log: Callable[[str], None] = print
    # a frozen copy of the model as loaded, shaped as the policy is but without adapters or a layout (a full
    # finetune's reference, where the objective keeps one)
    frozen_copy: Callable[[], torch.nn.Module] | None = None
    # whether this rank was asked to stop (a signal): asked between the pieces of a long batch (`Interrupted`)
    stop_requested: Callable[[], bool] = lambda: False
    # the fault-injection hook (`toolkit.train.faults.fault_hook`): (point, step), None when not set
    fault: Callable[[str, int], None] | None = None
    # a warning line while training runs (above the progress bar, once, by the main process)
    warn: Callable[[str], None] = print
    # `with run.abandonable():` work a signal ends at once, to be redone on resume (a reward function's call);
    # afterwards `stop_requested()` says whether it was
    abandonable: Callable[[], ContextManager] = contextlib.nullcontext


class Interrupted(Exception):
    """A stop was asked for (a signal) while an objective produced its batches or evaluated: what it was doing
    is abandoned, every rank alike; the loop saves the last finished step and exits. The batches of a step
    depend only on what that step's checkpoint holds, so the resumed run produces them again, the same."""


class Batches(Protocol):
    """An objective's global batches, one optimizer step's (epoch, this rank's micro-batches) per `next`."""

    def __iter__(self) -> Iterator[tuple[int, list[dict]]]: ...

    def __next__(self) -> tuple[int, list[dict]]: ...

    def take_metrics(self) -> dict[str, float]:
        """What producing the batches measured since the last call, for the step's record."""

    def take_seconds(self) -> float:
        """Seconds spent producing the batches since the last call that were not training (sampling,
        scoring): kept out of the step's tokens/s, as eval's are."""

    def state_dict(self) -> dict | None:
        """What a checkpoint must keep to continue the batches exactly (None: the step alone places them)."""


class Objective(Protocol):
    """What the loop asks of an objective (`toolkit.objectives.build`)."""
    # --objective what its examples are called
    name: str
    unit: str
    # the key of `evaluate`'s record that the run reports: eval_loss, or eval_reward
    eval_metric: str
    # what the loss head runs (None: the head's own token loss); set by `make_loss`
    loss: Loss | None

    def make_loss(self, hooks: LayoutHooks) -> Loss | None:
        """The loss the strategy's head runs, under the layout's `hooks`."""

    def layout_problems(self, kind: str, dims: Any) -> list[str]:
        """What this objective cannot run with on the layout `kind` (`toolkit.layout.rules.runtime`) over the
        world's `dims` (one line each)."""

    def tokenizer_problems(self, tokenizer) -> list[str]:
        """What this objective cannot do with the run's tokenizer (its chat template), before the weights load."""

    def loader(self, rows, tokenizer, log: Callable[[str], None], pin: bool, whole: bool, attn: str | None):
        """The DataLoader the strategy prepares (shards over the data-parallel ranks)."""

    def steps_per_epoch(self, loader, rows, data_ranks: int) -> int:
        """Optimizer steps an epoch makes, from the prepared `loader` of the training `rows`."""

    def batch_words(self, global_batch: int) -> str:
        """What a global batch of `global_batch` holds, in the run's training line."""

    def before_training(self, ctx: Context, loader, rows, eval_rows, steps_per_epoch: int, resuming: bool) -> None:
        """What must be computed before step 1 (a reference pass over the rows)."""

    def batches(self, ctx: Context, loader, rows, first_step: int, steps_per_epoch: int,
                saved: dict | None) -> Batches:
        """The global batches from `first_step` (`saved`: what `Batches.state_dict` kept at the checkpoint)."""

    def begin_step(self, model, micro: list[dict], reduce, replicas: int, examples: torch.Tensor) -> None:
        """What the global batch sets before its first forward (`reduce`: the sum over ranks)."""

    def metric_values(self, sums: torch.Tensor, examples) -> dict[str, float]:
        """The record's metrics from the loss head's sums over a window's `examples`."""

    def extra_forwards(self) -> int:
        """Forwards without gradients per trained sequence beside its own (the MFU's FLOPs)."""

    def evaluate(self, ctx: Context, rows) -> dict[str, float]:
        """The record of an evaluation on the held-out `rows` (keys `eval_*`)."""
