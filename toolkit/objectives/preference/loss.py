"""Preference tuning (`--objective dpo|orpo|simpo|kto`): pairs of completions to one prompt, the chosen
one trained up against the rejected one; or, for KTO, single completions labelled desirable or not.

A pair is two sequences, prompt + chosen and prompt + rejected, with labels on the completion only
(the last assistant turn). They sit next to each other in one micro-batch, chosen at even rows and
rejected at odd ones, so any even split of the rows keeps pairs whole. Each sequence's log-probability
is the sum of its completion tokens' (`sequence_logps`); the objectives are pure functions of those
(`toolkit.objectives.preference.functions`),
written as TRL writes them (trl 1.16: `DPOTrainer._compute_loss` "sigmoid", the experimental
`ORPOTrainer.odds_ratio_loss`, `CPOTrainer.cpo_loss` "simpo", `KTOTrainer._compute_loss` "kto"), and
tested against TRL's trainers.

KTO's example is one sequence (its micro-batch's rows are examples, the normaliser their count). Its
reference point z0, the KL divergence of the policy from the reference, is estimated from mismatched
sequences (an example's prompt with another's completion, `toolkit.data.pairs.kl_sequences`) without
gradients, as TRL does; here over the whole global batch before its first forward (`begin_step`: one
all-reduce), where TRL averages each micro-batch's estimate over the ranks, so the update does not
depend on how the batch is split (and equals TRL's for one micro-batch).

The loss of a micro-batch is a sum over its pairs, and the loop divides by the pairs of the global
batch (the collate's `pairs`), as SFT divides by its target tokens: the update does not depend on how the
batch is split over ranks and accumulation steps.

DPO's reference model is never a second model: LoRA's is the base with the adapters disabled, run
without gradients before each policy forward; a full finetune's log-probabilities are computed in one
pass before step 1 (`toolkit.objectives.preference.reference`), so the first step's DPO loss is ln 2 exactly. So are
those of a LoRA that trains on the SFT adapter `--model` names (`toolkit.model.source.sft_adapter`): its
reference is the SFT policy, the adapter on, which disabling the adapter would not give.
The pairs' data side is `toolkit.data.pairs`; the flag's choices and defaults `toolkit.config.objectives`.

The loss in parts: `ObjectiveSpec`, the settings, read from the config once; one `Objective` per
objective (`DPO`, `ORPO`, `SimPO`, `KTO`: its loss and metrics, from `OBJECTIVE_TYPES`); `StepState`,
what a step sets and gathers; `toolkit.objectives.base.LayoutHooks`, what the layout decides (the
context-parallel slices, a pipeline's forwards), given by `make_strategy` when it builds the objective
(`toolkit.objectives.preference.objective.Preference.make_loss`). `PreferenceLoss` puts them together, and its
`reference_logps` is
the one place that decides which reference a forward is compared against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from toolkit.objectives.base import LayoutHooks
from toolkit.config.objectives import DEFAULT_BETA, DEFAULT_SIMPO_GAMMA, KTO_METRICS, METRICS
from toolkit.objectives.logps import no_grad_logps
from toolkit.objectives.preference.functions import (dpo_loss, kl_batch, kto_loss, orpo_labels, orpo_nll,
                                                     orpo_nll_tokens, orpo_odds_loss, simpo_loss)


# Said once, in the objective's line: a `kl` of 0.0 is the clamp (TRL's), not a missing term. The estimate,
# the mean policy-minus-reference log-probability of mismatched completions, is exactly 0 while the policy is
# the reference (step 1; step 2 too under warmup, which starts the learning rate at 0) and often negative
# early on, the more often the fewer sequences a global batch holds.
KL_CLAMP = "clamped at 0 as TRL's (kl 0.0: the policy is the reference, or scores those completions below it)"


# --- the objective's settings, read from the config once; each reference as the objective's line names it
REFERENCES = {"adapters": "the base model, adapters disabled",
              "precomputed": "log-probabilities computed before step 1"}


@dataclass(frozen=True)
class ObjectiveSpec:
    """What `--objective` trains, fixed for the run. `reference`: "adapters" (LoRA: the base, adapters
    disabled, no gradients), "precomputed" (the batch's `ref_logps`, `toolkit.objectives.preference.reference`) or None
    (ORPO, SimPO); `PreferenceLoss.reference_logps` is the one place that reads it to get them."""
    name: str
    beta: float
    simpo_gamma: float = DEFAULT_SIMPO_GAMMA
    label_smoothing: float = 0.0
    reference: str | None = None
    # KTO's weights
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0

    @classmethod
    def from_config(cls, cfg) -> "ObjectiveSpec | None":
        """None for SFT."""
        t = cfg.train
        kind = OBJECTIVE_TYPES.get(t.objective)
        if kind is None:
            return None
        from toolkit.model.source import sft_adapter

        # a LoRA that trains an SFT adapter on: its reference is that adapter as loaded (the policy at
        # step 0), not the base that disabling it would give; its log-probabilities computed before step 1
        reference = None if not kind.referenced else \
            "precomputed" if cfg.model.method == "full" or sft_adapter(cfg.model) else "adapters"
        return cls(t.objective, t.beta if t.beta is not None else DEFAULT_BETA[t.objective], t.simpo_gamma,
                   t.label_smoothing, reference, t.desirable_weight, t.undesirable_weight)

    @property
    def reference_pass(self) -> bool:
        """Whether the rows need their reference log-probabilities computed before step 1."""
        return self.reference == "precomputed"


@dataclass
class StepState:
    """What a step sets and gathers, apart from the settings: ORPO's NLL scale and KTO's z0, set before
    the global batch's first forward (`PreferenceLoss.begin_step`), and the metrics' sums since they
    were last taken."""
    # ORPO: the global pairs / the global NLL tokens
    nll_scale: torch.Tensor | float = 1.0
    # KTO: z0, the step's KL estimate
    kl: torch.Tensor | float = 0.0
    sums: torch.Tensor | None = None

    def add(self, sums: torch.Tensor) -> None:
        self.sums = sums if self.sums is None else self.sums + sums

    def take(self) -> torch.Tensor | None:
        taken, self.sums = self.sums, None
        return taken


# --- one object per objective: its summed loss from per-sequence log-probabilities, and its metrics
@dataclass(frozen=True)
class Objective:
    """A preference objective on a micro-batch's per-sequence log-probabilities (and target counts, the
    reference's, KTO's labels): its summed loss, its metrics' sums kept in `state`."""
    spec: ObjectiveSpec
    # trained against a reference (`ObjectiveSpec.reference`)
    referenced: ClassVar[bool] = False
    # ORPO: + the chosen sequences' NLL (`orpo_nll`)
    nll: ClassVar[bool] = False
    # KTO: z0 estimated before each step (`PreferenceLoss.kl_estimate`)
    estimates_kl: ClassVar[bool] = False
    # the length of its metrics' sums
    width: ClassVar[int] = len(METRICS)
    # what its examples are called
    unit: ClassVar[str] = "pairs"

    def loss(self, logps: torch.Tensor, counts: torch.Tensor, ref: torch.Tensor | None,
             desirable: torch.Tensor | None, state: StepState) -> torch.Tensor:
        raise NotImplementedError

    def metric_values(self, sums: torch.Tensor, examples: float | torch.Tensor) -> dict[str, float]:
        """The metrics (TRL's names) from the sums over `examples`: means over pairs."""
        return {name: float(v) / float(examples) for name, v in zip(METRICS, sums)}

    def settings(self) -> str:
        """Its settings after beta, for the objective's line."""
        raise NotImplementedError


class PairObjective(Objective):
    """Interleaved (chosen, rejected) sequences."""
    # on mean token log-probabilities, which TRL's logps/* then report too
    means: ClassVar[bool] = True

    def loss(self, logps: torch.Tensor, counts: torch.Tensor, ref: torch.Tensor | None,
             desirable: torch.Tensor | None, state: StepState) -> torch.Tensor:
        chosen, rejected = logps[0::2], logps[1::2]
        if self.means:
            chosen, rejected = chosen / counts[0::2].clamp(min=1), rejected / counts[1::2].clamp(min=1)
        loss, r_chosen, r_rejected = self.pair_loss(chosen, rejected, ref)
        state.add(torch.stack([r_chosen.sum(), r_rejected.sum(), (r_chosen > r_rejected).float().sum(),
                               (r_chosen - r_rejected).sum(), chosen.detach().sum(), rejected.detach().sum()]).double())
        return loss.sum()

    def pair_loss(self, chosen: torch.Tensor, rejected: torch.Tensor,
                  ref: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(per-pair loss, chosen reward, rejected reward)."""
        raise NotImplementedError


class DPO(PairObjective):
    """`dpo_loss`: on the sequences' summed log-probabilities, against the reference's."""
    referenced, means = True, False

    def pair_loss(self, chosen, rejected, ref):
        return dpo_loss(chosen, rejected, ref[0::2], ref[1::2], self.spec.beta, self.spec.label_smoothing)

    def settings(self) -> str:
        return f", label smoothing {self.spec.label_smoothing:g}; reference: {REFERENCES[self.spec.reference]}"


class SimPO(PairObjective):
    """`simpo_loss`: on mean token log-probabilities, with no reference."""

    def pair_loss(self, chosen, rejected, ref):
        return simpo_loss(chosen, rejected, self.spec.beta, self.spec.simpo_gamma, self.spec.label_smoothing)

    def settings(self) -> str:
        return f", gamma {self.spec.simpo_gamma:g}, label smoothing {self.spec.label_smoothing:g}"


class ORPO(PairObjective):
    """`orpo_odds_loss` on mean token log-probabilities, plus the chosen sequences' NLL (`orpo_nll`)."""
    nll = True

    def pair_loss(self, chosen, rejected, ref):
        return orpo_odds_loss(chosen, rejected, self.spec.beta)

    def settings(self) -> str:
        return " + the chosen sequences' NLL"


class KTO(Objective):
    """Single completions labelled desirable or not; its metrics over the desirable and the undesirable
    ones apart (TRL's)."""
    referenced, estimates_kl, width, unit = True, True, 7, "examples"

    def loss(self, logps: torch.Tensor, counts: torch.Tensor, ref: torch.Tensor | None,
             desirable: torch.Tensor | None, state: StepState) -> torch.Tensor:
        desirable = desirable.to(logps.device).bool()
        s = self.spec
        loss, rewards = kto_loss(logps, ref, desirable, state.kl, s.beta, s.desirable_weight, s.undesirable_weight)
        good, bad = desirable.double(), (~desirable).double()
        kl = torch.as_tensor(state.kl, dtype=torch.float64, device=logps.device)
        state.add(torch.stack([(rewards * good).sum(), (rewards * bad).sum(), good.sum(), bad.sum(),
                               (logps.detach() * good).sum(), (logps.detach() * bad).sum(), kl * len(logps)]).double())
        return loss.sum()

    def metric_values(self, sums: torch.Tensor, examples: float | torch.Tensor) -> dict[str, float]:
        """Means over the desirable and the undesirable examples apart (each where there were some), and
        the KL estimate's mean."""
        r_good, r_bad, n_good, n_bad, l_good, l_bad, kl = [float(v) for v in sums]
        out = {}
        if n_good:
            out.update({"rewards/chosen": r_good / n_good, "logps/chosen": l_good / n_good})
        if n_bad:
            out.update({"rewards/rejected": r_bad / n_bad, "logps/rejected": l_bad / n_bad})
        if n_good and n_bad:
            out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
        out["kl"] = kl / max(float(examples), 1.0)
        return {name: out[name] for name in KTO_METRICS if name in out}

    def settings(self) -> str:
        s = self.spec
        return (f", weights desirable {s.desirable_weight:g} undesirable {s.undesirable_weight:g}; reference: "
                f"{REFERENCES[s.reference]}; KL estimate from mismatched completions, over the global batch, "
                f"{KL_CLAMP}")


OBJECTIVE_TYPES: dict[str, type[Objective]] = {"dpo": DPO, "orpo": ORPO, "simpo": SimPO, "kto": KTO}


class PreferenceLoss:
    """One micro-batch's summed loss under a preference objective: `kind` (its loss and metrics, from
    `spec`) on the per-sequence log-probabilities this layout computes (`hooks`); what a step sets and
    gathers kept apart (`state`), its metrics' sums for the step's record (`take_metrics`)."""

    def __init__(self, spec: ObjectiveSpec | str, beta: float | None = None, *, hooks: LayoutHooks = LayoutHooks(),
                 **settings: Any) -> None:
        """`spec`, or its fields: `PreferenceLoss("dpo", 0.1, reference="adapters")`."""
        self.spec = spec if isinstance(spec, ObjectiveSpec) else ObjectiveSpec(spec, beta, **settings)
        self.kind: Objective = OBJECTIVE_TYPES[self.spec.name](self.spec)
        self.hooks, self.state, self.dropouts_off = hooks, StepState(), 0

    @classmethod
    def from_config(cls, cfg, hooks: LayoutHooks = LayoutHooks()) -> "PreferenceLoss | None":
        """--objective's, under the layout's `hooks` (`Preference.make_loss`); None for SFT."""
        spec = ObjectiveSpec.from_config(cfg)
        return cls(spec, hooks=hooks) if spec is not None else None

    @property
    def reference_pass(self) -> bool:
        """Whether the rows need their reference log-probabilities computed before step 1."""
        return self.spec.reference_pass

    @property
    def unit(self) -> str:
        """What its examples are called: pairs, or KTO's examples."""
        return self.kind.unit

    # the step state's values under their earlier names (the TRL parity tests set and read them)
    @property
    def nll_scale(self) -> torch.Tensor | float:
        return self.state.nll_scale

    @nll_scale.setter
    def nll_scale(self, value: torch.Tensor | float) -> None:
        self.state.nll_scale = value

    @property
    def kl(self) -> torch.Tensor | float:
        return self.state.kl

    def prepare(self, model: torch.nn.Module) -> None:
        """Dropout off, as TRL does (`disable_dropout`): with it on, the policy's forward would not be the
        reference's (LoRA's adapter-disabled forward; the full finetune's pass runs in eval mode) and step
        1 of DPO would not be ln 2. Dropout modules (LoRA's too) and attention dropout attributes."""
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout) and module.p > 0:
                module.p, self.dropouts_off = 0.0, self.dropouts_off + 1
            if isinstance(getattr(module, "attention_dropout", None), float) and module.attention_dropout > 0:
                module.attention_dropout, self.dropouts_off = 0.0, self.dropouts_off + 1

    def describe(self) -> str:
        off = f"; dropout off in {self.dropouts_off} places (as TRL)" if self.dropouts_off else ""
        return (f"objective: {self.spec.name}, beta {self.spec.beta:g}{self.kind.settings()}; full logits, "
                f"per-sequence log-probabilities{off}")

    def begin_step(self, model, micro: list[dict], reduce, replicas: int, pairs: torch.Tensor) -> None:
        """What the global batch sets before its first forward (`reduce`: the sum over ranks, each
        data shard counted `replicas` times): ORPO's NLL scale, global pairs / global NLL tokens; KTO's
        KL estimate."""
        if self.kind.nll:
            tokens = reduce(sum(orpo_nll_tokens(b) for b in micro).double().reshape(1)) / replicas
            self.state.nll_scale = pairs / tokens.clamp(min=1)[0]
        if self.kind.estimates_kl:
            self.state.kl = self.kl_estimate(model, micro, reduce, replicas)

    @torch.no_grad()
    def kl_estimate(self, model, micro: list[dict], reduce, replicas: int) -> torch.Tensor:
        """KTO's z0: the mean over `micro`'s KL sequences (and every rank's, through `reduce`) of their
        policy minus reference log-probabilities, clamped at 0 (TRL's `kl`: z0 is a KL divergence, which
        is never negative, though its estimate from a few mismatched sequences can be; `KL_CLAMP`), without
        gradients. Every rank runs the same forwards (whole sequences, as evaluation does under each layout)."""
        total = None
        for b in micro:
            kl = kl_batch(b)
            policy = self.hooks.forward_logps(model, kl)
            ref = self.reference_logps(model, kl)
            part = torch.stack([(policy - ref.to(policy.device)).sum().double(),
                                torch.tensor(float(len(policy)), dtype=torch.float64, device=policy.device)])
            total = part if total is None else total + part
        total = reduce(total) / replicas
        return (total[0] / total[1].clamp(min=1)).clamp(min=0).float()

    def reference_logps(self, model, batch: dict, inputs: dict | None = None) -> torch.Tensor | None:
        """The reference's per-sequence log-probabilities, or None (ORPO, SimPO): where "which reference"
        is decided, for the loss, a pipeline, evaluation and KTO's KL. "precomputed": the batch's;
        "adapters": LoRA's base without gradients, through `inputs` as the training forward lays them out
        (packed rows, a context-parallel slice), or else whole rows through the layout's `forward_logps`."""
        if self.spec.reference == "precomputed":
            ref = batch["ref_logps"]
            # NaN: a row the reference pass did not score (`toolkit.data.loader.rows_read` and the loader disagree on
            # the rows the run reads); checked on the device, without a read-back
            torch._assert_async(~torch.isnan(ref).any(), "a pair without reference log-probabilities reached the "
                                "loss: the reference pass did not score the rows this step reads")
            return ref
        if self.spec.reference is None:
            return None
        if inputs is None:
            return self.hooks.forward_logps(model, batch, reference=True)
        return no_grad_logps(model, inputs, lambda logits: self.hooks.logps(logits, batch)[0], reference=True)

    def __call__(self, model, batch: dict, inputs: dict) -> tuple[torch.Tensor, Any]:
        """(the summed pair loss of `batch` (plus ORPO's scaled NLL), the model's output)."""
        ref = self.reference_logps(model, batch, inputs)
        out = model(**inputs)
        return self.logits_loss(out.logits, batch, ref), out

    def logits_loss(self, logits: torch.Tensor, batch: dict, ref: torch.Tensor | None) -> torch.Tensor:
        """The summed pair loss of `batch` (plus ORPO's scaled NLL) from its logits, per sequence as the
        layout lays the rows out (`LayoutHooks.logps`; a pipeline's last stage calls this itself)."""
        logps, counts = self.hooks.logps(logits, batch)
        total = self.hooks.whole(self.loss_of(logps, counts, ref, batch.get("desirable")), batch)
        # ORPO's NLL; under cp this slice's share (the slices' shares add up)
        if self.kind.nll:
            labels, shifted = chosen_targets(batch)
            total = total + orpo_nll(logits, labels, shifted=shifted) * self.state.nll_scale
        return total

    def loss_of(self, logps: torch.Tensor, counts: torch.Tensor, ref: torch.Tensor | None,
                desirable: torch.Tensor | None) -> torch.Tensor:
        """The summed objective of a micro-batch's sequences from their log-probabilities (and target
        counts, the reference's, KTO's labels); the metrics' sums kept."""
        ref = ref.to(logps.device) if ref is not None else None
        return self.kind.loss(logps, counts, ref, desirable, self.state)

    @property
    def metric_width(self) -> int:
        """The length of `take_metrics`' sums."""
        return self.kind.width

    def metric_values(self, sums: torch.Tensor, examples: float | torch.Tensor) -> dict[str, float]:
        """The metrics (TRL's names) from `take_metrics`' sums over `examples` (pairs, or KTO's)."""
        return self.kind.metric_values(sums, examples)

    def take_metrics(self) -> torch.Tensor | None:
        """The metrics' sums since the last call."""
        return self.state.take()


def chosen_targets(batch: dict) -> tuple[torch.Tensor, bool]:
    """(ORPO's NLL labels for this micro-batch, whether shifted already): a context-parallel slice's share
    (`toolkit.parallel.cp`), else the chosen sequences' whole."""
    return (batch["orpo_targets"], True) if "targets" in batch else (orpo_labels(batch), False)
