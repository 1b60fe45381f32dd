"""What a training objective other than the token loss is to the rest of a run (`Objective`), and what the
layout decides for it (`LayoutHooks`).

An objective (the preference objectives' `toolkit.objectives.preference.loss.PreferenceLoss`, or any later one) is built
once, from the config and the layout's hooks, by `toolkit.objectives.head.build_objective`, and given to the
`LossHead` every strategy runs: no strategy knows which objective it trains, and the objective knows no
layout beyond its hooks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch

from toolkit.objectives.preference.functions import document_logps, orpo_labels, sequence_logps, sliced_logps, whole_row_logps

LogpsFn = Callable[..., torch.Tensor]  # (model, batch, reference=False) -> each whole row's log-probability
SumFn = Callable[[torch.Tensor], torch.Tensor]  # a sum over the cp group


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

    def chosen_targets(self, batch: dict) -> tuple[torch.Tensor, bool]:
        """(ORPO's NLL labels for this micro-batch, whether shifted already): a context-parallel slice's
        share (`toolkit.parallel.cp`), else the chosen sequences' whole."""
        return (batch["orpo_targets"], True) if "targets" in batch else (orpo_labels(batch), False)


class Objective(Protocol):
    """A training objective other than the token loss, as `toolkit.objectives.head.LossHead` runs it and the
    loop steps, evaluates and records it."""
    reference_pass: bool  # the rows need their reference log-probabilities before step 1 (`toolkit.objectives.preference.reference`)
    unit: str  # what its examples are called (pairs)
    metric_width: int  # the length of `take_metrics`' sums

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
