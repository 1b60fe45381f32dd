"""`--objective grpo` as a loss: one micro-batch of sampled completions (prompt + completion rows, each with its
group advantage, and where they are needed its old and reference log-probabilities, `toolkit.objectives.grpo.rollout`)
-> the summed clipped policy loss of `toolkit.objectives.grpo.functions`, which the loop divides by the global batch's
count of the loss type's units (completions, or their tokens) as it divides SFT's summed loss by its tokens.

Each token's log-probability is of the logits / the sampling temperature, as TRL's GRPOTrainer computes the
policy's, the old policy's and the reference's. The loss has `toolkit.objectives.base.Loss`'s shape for the
loss head it is given to (`toolkit.objectives.grpo.objective.GRPO.make_loss`): `prepare`, `describe`,
`begin_step`, the call on a micro-batch, and its metrics' sums (`take_metrics`, `metric_values`); the layout's
hooks change nothing in it (sampling is the rollout's, through `Strategy.generating`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from toolkit.data.images import MEDIA
from toolkit.objectives.grpo.functions import (LOSS_TYPES, loss_sum, policy_loss_terms, policy_metrics,
                                                selective_logps)

# (sum, count) pairs: TRL's names, means over the window's tokens (sequences for GSPO's ratio)
METRICS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "kl", "entropy")


@dataclass(frozen=True)
class GRPOSpec:
    """What --objective grpo trains, fixed for the run (`toolkit.config.RLConfig`, TRL's GRPOConfig names).
    `reference`: "adapters" (LoRA/QLoRA: the base, adapters disabled), "copy" (a full finetune: a frozen copy
    of the model as loaded), or None (beta 0: no reference forward)."""
    loss_type: str = "dapo"
    importance_sampling: str = "token"
    epsilon: float = 0.2
    epsilon_high: float | None = None
    beta: float = 0.0
    temperature: float = 1.0
    max_completion_length: int = 512
    num_generations: int = 8
    scale_rewards: str = "group"
    mask_truncated: bool = False
    steps_per_generation: int = 1
    num_iterations: int = 1
    reference: str | None = None
    name: str = "grpo"

    @classmethod
    def from_config(cls, cfg) -> "GRPOSpec":
        rl, t = cfg.rl, cfg.train
        beta = t.beta if t.beta is not None else 0.0
        reference = None if beta == 0 else "copy" if cfg.model.method == "full" else "adapters"
        return cls(rl.loss_type, rl.importance_sampling, rl.epsilon, rl.epsilon_high, beta, rl.temperature,
                   rl.max_completion_length, rl.num_generations, rl.scale_rewards, rl.mask_truncated_completions,
                   rl.steps_per_generation, rl.num_iterations, reference)

    @property
    def needs_old(self) -> bool:
        """Whether the ratio's old log-probabilities must be computed after generation: the policy moves
        between sampling and a later use (more steps per round, or more iterations); else they are the
        current ones, detached (ratio 1, as TRL)."""
        return self.steps_per_generation * self.num_iterations > 1

    def units(self, completion_mask: torch.Tensor) -> torch.Tensor:
        """What a micro-batch adds to the global count its summed loss is divided by (`loss_normaliser`):
        completions (grpo), their loss tokens (dapo, bnpo), completions x max length (dr_grpo)."""
        rows = torch.tensor(float(completion_mask.shape[0]), device=completion_mask.device)
        if self.loss_type == "grpo":
            return rows
        if self.loss_type == "dr_grpo":
            return rows * self.max_completion_length
        return completion_mask.sum().float()


def completion_logps(model, batch: dict, temperature: float, entropy: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """((B, C) each completion token's log-probability of logits / `temperature`, (B, C) the entropies or
    None) of `batch`'s rows (left-padded prompts, then right-padded completions of width C): only the
    completion positions' logits are formed (`logits_to_keep`), and their log-softmax only a chunk of
    positions at a time (`selective_logps`)."""
    completion = batch["completion_ids"]
    width = completion.shape[1]
    # an image-text model's image inputs of the rows' prompts (`toolkit.data.images.MEDIA` keys)
    media = {k[len(MEDIA):]: v.to(batch["input_ids"].device) for k, v in batch.items() if k.startswith(MEDIA)}
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                position_ids=batch["positions"], logits_to_keep=width + 1, use_cache=False, **media)
    # position t predicts completion token t; the last position predicts none (a target 0, dropped): the
    # logits are taken whole, as the model returned them, not copied into a (B, C, V) slice
    targets = torch.nn.functional.pad(completion, (0, 1))
    logps, ent = selective_logps(out.logits, targets, temperature, entropy)
    return logps[:, :-1], ent[:, :-1] if ent is not None else None


class GRPOLoss:
    """One micro-batch's summed GRPO loss; the metrics' sums of the step kept for its record; the reward
    functions its rounds score with (`rewards`)."""

    unit = "completions"
    reference_pass = False  # no pass over the data before step 1: its reference runs in each round

    def __init__(self, spec: GRPOSpec, rewards: list = ()):
        self.spec, self.rewards, self.sums, self.dropouts_off = spec, list(rewards), None, 0

    def prepare(self, model: torch.nn.Module) -> None:
        """Dropout off (TRL's disable_dropout): the ratio of a forward to the one that sampled must be 1 when
        the weights have not moved."""
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout) and module.p > 0:
                module.p, self.dropouts_off = 0.0, self.dropouts_off + 1

    def describe(self) -> str:
        s = self.spec
        high = s.epsilon if s.epsilon_high is None else s.epsilon_high
        ref = {"adapters": "the base, adapters disabled", "copy": "a frozen copy of the model as loaded",
               None: "none (beta 0)"}[s.reference]
        off = f"; dropout off in {self.dropouts_off} places (as TRL)" if self.dropouts_off else ""
        return (f"objective: grpo, loss type {s.loss_type} (divided by the global batch's {LOSS_TYPES[s.loss_type]}), "
                f"{s.importance_sampling}-level importance ratio clipped to [{1 - s.epsilon:g}, {1 + high:g}], "
                f"beta {s.beta:g}; reference: {ref}; log-probabilities of logits / {s.temperature:g}{off}")

    def begin_step(self, *_, **__) -> None:
        """Nothing to set before the global batch's first forward: its advantages came with it."""

    def __call__(self, model, batch: dict, inputs: dict | None = None) -> tuple[torch.Tensor, Any]:
        """(the micro-batch's summed loss, None): its rows' clipped surrogate (+ beta x KL), summed as the
        loss type sums it."""
        s = self.spec
        logps, entropies = completion_logps(model, batch, s.temperature, entropy=True)
        mask = batch["completion_mask"].to(logps.dtype)
        old = batch.get("old_logps")
        old = logps.detach() if old is None else old
        terms = policy_loss_terms(logps, old, batch["advantages"], mask, s.epsilon, s.epsilon_high,
                                  s.importance_sampling, s.beta, batch.get("ref_logps"))
        metrics = policy_metrics(terms, batch["advantages"], mask, s.epsilon, s.epsilon_high, entropies)
        zero = torch.zeros(2, device=logps.device)
        sums = torch.cat([metrics.sums.get(name, zero).to(logps.device) for name in METRICS]).double()
        self.sums = sums if self.sums is None else self.sums + sums
        return loss_sum(terms.loss, mask, s.loss_type), None

    @torch.no_grad()
    def reference_logps(self, model, batch: dict, reference_model=None) -> torch.Tensor:
        """(B, C) the reference's log-probabilities: LoRA's base (adapters disabled) or the frozen copy."""
        if self.spec.reference == "adapters":
            from accelerate.utils import extract_model_from_parallel

            with extract_model_from_parallel(model).disable_adapter():
                return completion_logps(model, batch, self.spec.temperature)[0]
        return completion_logps(reference_model, batch, self.spec.temperature)[0]

    @torch.no_grad()
    def old_logps(self, model, batch: dict) -> torch.Tensor:
        """(B, C) the policy's log-probabilities as it sampled (the ratio's denominator)."""
        return completion_logps(model, batch, self.spec.temperature)[0]

    metric_width = 2 * len(METRICS)

    def metric_values(self, sums, _examples=None) -> dict[str, float]:
        """The metrics (TRL's names): each a mean over its tokens (sequences at sequence level); the KL only
        where beta > 0."""
        out = {}
        for i, name in enumerate(METRICS):
            total, count = float(sums[2 * i]), float(sums[2 * i + 1])
            if name == "kl" and self.spec.beta == 0:
                continue
            out[name] = total / count if count else 0.0
        return out

    def take_metrics(self) -> torch.Tensor | None:
        taken, self.sums = self.sums, None
        return taken
