"""What a strategy's step computes as its loss: one micro-batch's summed token loss through full logits
or a fused head (`toolkit.objectives.sft.loss`), an objective's (`toolkit.objectives.base`: the preference objectives of
`toolkit.objectives.preference.loss`), and the router load-balancing loss the model adds (`toolkit.model.router_load`
counts its
experts' tokens). Every strategy composes one `LossHead`, given at construction with the objective's loss
(`toolkit.objectives.base.Objective.make_loss`); the layout only decides how the batch reaches it. The loop reads what
it
gathered once a step (`take_metrics`), never its parts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from toolkit.objectives.sft.loss import target_loss_sum, token_loss_sum
from toolkit.objectives.base import Loss

# (logits, labels) -> summed loss
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class LossMetrics:
    """What the loss gathered over the micro-batches since the last read, on the device (nothing is read
    back): `LossHead.take_metrics`, the one read of a step's loss besides its value."""
    # the router load-balancing loss x target tokens
    aux: torch.Tensor | None = None
    # the objective's metrics' sums
    objective: torch.Tensor | None = None
    # tokens per expert, (MoE layers, experts)
    load: torch.Tensor | None = None
    # the head computed the logits of the target tokens only (the MFU's LM-head FLOPs)
    fused: bool = False
    # the MoE layers, the rows of `load`
    layers: tuple[str, ...] = ()


@dataclass(frozen=True)
class LossCheck:
    """The loss this layout trains against the model's own on a few rows (`Strategy.loss_check`)."""
    # per target token; None where this rank computes no loss (a pipeline's earlier stages)
    ours: float | None
    own: float | None
    # what computed `ours`: the loss line's words
    head: str
    # a fused head computed it: full logits remain to fall back on (--loss auto)
    fused: bool = False


class LossHead:
    """One micro-batch's summed token loss: full logits and `loss_fn`, or the LM head replaced by a
    fused loss head (`toolkit.objectives.sft.loss.loss_head_for`) that returns the sum itself, so (B, T, V) logits
    never exist. Context parallel batches carry labels already shifted (`targets`)."""

    def __init__(self, loss_fn: LossFn = token_loss_sum, device_type: str = "cpu", precision: str = "no",
                 objective: Loss | None = None):
        self.loss_fn, self.device_type, self.head, self.rows_given = loss_fn, device_type, None, False
        # the run's mixed precision: the dtype a fused kernel must take
        self.precision = precision
        self.aux_coef, self.aux_sum = 0.0, None
        # an objective's loss other than the token loss (`Objective.make_loss`): full logits
        self.objective = objective
        # an MoE model's tokens per expert (`toolkit.model.router_load.RouterLoad`)
        self.router_load = None

    def choose(self, model, choice: str) -> None:
        """`--loss` on the unwrapped model: a fused head where `choice`, the device and the model allow
        one (only for the standard token loss, which it computes exactly); and the model's router
        load-balancing loss, which its forward returns where its config sets `output_router_logits`.
        An objective keeps full logits and turns the model's dropout off (`prepare`)."""
        from toolkit.objectives.sft.loss import loss_head_for

        if self.objective is not None:
            self.objective.prepare(model)
        if self.loss_fn is token_loss_sum and self.objective is None:
            self.head = loss_head_for(model, choice, self.device_type, precision=self.precision)
        self.aux_coef = router_aux_coef(model.config)
        if self.router_load is None:
            from toolkit.model.router_load import RouterLoad

            # tokens per expert, for the metrics
            self.router_load = RouterLoad.attach(model)

    def full_logits(self) -> None:
        """Back to full logits (`--loss auto` after a failed loss check): the LM head restored."""
        if self.head is not None:
            self.head.restore()
            self.head = None

    def take_metrics(self, device: torch.device) -> LossMetrics:
        """What the micro-batches since the last call gathered: the aux loss, the objective's sums, the
        tokens per expert (zeros on a rank whose forwards reached no MoE layer)."""
        load = self.router_load.take(device) if self.router_load is not None else None
        return LossMetrics(self.take_aux(), self.objective.take_metrics() if self.objective is not None else None,
                           load, self.fused, tuple(self.router_load.layers) if self.router_load is not None else ())

    @property
    def fused(self) -> bool:
        """The head computes the loss on target tokens only (fewer LM-head FLOPs: the MFU count): on a CPU it
        finds them itself, on a GPU it is handed them (`target_rows`, whole batches only)."""
        return self.head is not None and (self.device_type != "cuda" or self.rows_given)

    def __call__(self, model, batch: dict) -> torch.Tensor:
        if self.objective is None:
            return self.token_sum(model, batch)
        from toolkit.data.packing import model_inputs

        from toolkit.objectives.preference.functions import pairs_in

        # a context-parallel slice's
        inputs = batch["inputs"] if "targets" in batch else model_inputs(batch)
        total, out = self.objective(model, batch, inputs)
        # what the loop divides the sum by
        count = batch["units"] if "units" in batch else pairs_in(batch)
        return total + self.aux(out, batch.get("labels"), False, count=count)

    def token_sum(self, model, batch: dict) -> torch.Tensor:
        """The summed token loss of `batch` (and the router's, x its target tokens)."""
        from toolkit.data.packing import model_inputs

        # context parallel: this rank's slice, labels shifted before the split
        if "targets" in batch:
            inputs, labels, shifted = batch["inputs"], batch["targets"], True
        else:
            inputs, labels, shifted = model_inputs(batch), batch["labels"], False
        # the head returns the loss sum in place of logits
        if self.head is not None:
            # found by the collate on the CPU: no read-back to skip the others
            rows = batch.get("target_rows")
            self.rows_given = rows is not None
            with self.head.labels(labels, shifted, rows=rows):
                out = model(**inputs)
            total = out.logits
        else:
            out = model(**inputs)
            total = (target_loss_sum if shifted else self.loss_fn)(out.logits, labels)
        return total + self.aux(out, labels, shifted)

    def aux(self, out, labels: torch.Tensor, shifted: bool, count: int | None = None) -> torch.Tensor | float:
        """coef x the router load-balancing loss x this micro-batch's target tokens: what the model adds to
        its mean loss when given labels, as a sum, so the global-token normalisation gives the model's
        own loss on one micro-batch (and over several, their aux losses weighted by target tokens). Its
        sum is kept for the metrics (`take_aux`)."""
        value = out.get("aux_loss") if self.aux_coef else None
        if value is None:
            return 0.0
        from toolkit.data.labels import count_targets

        n = count if count is not None else (labels != -100).sum() if shifted else count_targets(labels)
        weighted = value.float() * n
        self.aux_sum = weighted.detach().double() + (self.aux_sum if self.aux_sum is not None else 0.0)
        return self.aux_coef * weighted

    def take_aux(self) -> torch.Tensor | None:
        """The summed aux loss x target tokens of the micro-batches since the last call (None: no aux loss)."""
        taken, self.aux_sum = self.aux_sum, None
        return taken

    @torch.no_grad()
    def check(self, model, few: dict, context=None) -> tuple[float, float]:
        """(this head's loss per target token, the model's own loss) on `few` rows (`check_window`):
        under context parallel the slices' losses summed over the cp group, against the model's own
        forward on the whole rows (outside a slice the Ulysses wrapper is the model's own attention)."""
        from toolkit.data.labels import count_targets
        from toolkit.data.packing import model_inputs

        if context is not None and context.context is not None:
            with context.slice(few) as part:
                ours = context.total(self.token_sum(model, part).double().reshape(1)).squeeze(0)
        else:
            ours = self.token_sum(model, few)
        ours = ours / count_targets(few["labels"]).clamp(min=1)
        self.take_aux()
        own = model(**model_inputs(few), labels=few["labels"]).loss
        return ours.item(), own.item()

    def describe(self) -> str:
        aux = f"; the router load-balancing loss x {self.aux_coef:g} added (aux_loss)" if self.aux_coef else ""
        if self.objective is not None:
            return f"loss: {self.objective.describe()}{aux}"
        return "loss: " + (self.head.describe() if self.head else "full logits + cross-entropy") + aux


def router_aux_coef(config) -> float:
    """The coefficient of the router load-balancing loss the model adds to its loss when given labels:
    `router_aux_loss_coef` where the config asks for router logits (`output_router_logits`), else 0."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if not getattr(text, "output_router_logits", False):
        return 0.0
    return float(getattr(text, "router_aux_loss_coef", 0.0) or 0.0)
