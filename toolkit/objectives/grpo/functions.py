"""GRPO's pure functions (`--objective grpo`: GRPO, Dr. GRPO, DAPO, GSPO): group advantages from rewards,
the clipped per-token policy loss, its aggregation and its metrics, written as TRL 1.16 writes them
(`GRPOTrainer._generate_and_score_completions`'s "sum_then_normalize" block, `GRPOTrainer._compute_loss`)
and parity-tested against those methods in tests/test_grpo_functions.py.

One difference, on purpose: each loss is (a sum over this micro-batch) / (a normaliser over the whole global
batch: every rank, every accumulation step), as `toolkit.objectives.sft.loss` does for the token loss, so the
update does not depend on how the global batch is split. TRL divides each micro-batch by something local instead, and
then by the accumulation steps; on equal micro-batches that is the same update for grpo, dr_grpo and dapo
(TRL's dapo already counts the generation batch's tokens), not for bnpo, whose normaliser is the local
micro-batch's tokens. Here bnpo is normalised by the global batch's tokens, the one definition that does not
depend on the split, which makes it dapo (`LOSS_TYPES`).

Shapes: B completions of a micro-batch, T completion positions (right-padded), `mask` (B, T) 1 on a token
the loss covers; N completions of a generation batch, G generations per prompt, F reward functions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCALE_REWARDS = ("group", "batch", "none")
IMPORTANCE_SAMPLING = ("token", "sequence")
# loss type -> the global count its summed loss is divided by (`loss_normaliser`); bnpo's is dapo's (module doc)
LOSS_TYPES = {"grpo": "sequences", "bnpo": "tokens", "dr_grpo": "sequences x max_completion_length", "dapo": "tokens"}
STD_EPS = 1e-4  # TRL's: advantages / (std + 1e-4)


# --- advantages: pure functions of the rewards of a whole generation batch (every rank's, gathered)
def nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The standard deviation over the non-NaN values, Bessel-corrected, NaN where fewer than 2: TRL's
    `trl.trainer.utils.nanstd`, so that a completion no reward function scored (NaN) does not count."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    variance = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=True)
    variance = variance * torch.where(count > 1, count / (count - 1), torch.full_like(variance, float("nan")))
    std = variance.sqrt()
    return std.squeeze() if dim is None else std.squeeze(dim)


def weighted_rewards(rewards_per_func: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """(N, F) rewards, NaN where a function returned None, and (F,) weights -> (N,): the weighted sum over the
    functions that scored each completion (TRL's nansum); NaN where none did, an unscorable completion that
    the baseline must not see (TRL's `unscorable_mask`)."""
    rewards = (rewards_per_func * weights.to(rewards_per_func).unsqueeze(0)).nansum(dim=1)
    return rewards.masked_fill(torch.isnan(rewards_per_func).all(dim=1), float("nan"))


def group_advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: str = "group") -> torch.Tensor:
    """(N,) rewards, rows grouped by prompt (G = `num_generations` consecutive rows each) -> (N,) advantages:
    reward - its group's mean (GRPO, Shao et al. 2024, eq. 3), divided by the group's std + 1e-4 ("group"),
    the batch's ("batch", PPO Lite, Liu et al. 2025) or not at all ("none", Dr. GRPO, Liu et al. 2025). NaN
    rewards (unscorable) are left out of the means and stds and get advantage 0. TRL 1.16's
    "sum_then_normalize"; the batch is the whole generation batch, so it does not depend on the layout."""
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards {scale_rewards!r}: one of {', '.join(SCALE_REWARDS)}")
    grouped = rewards.view(-1, num_generations)
    advantages = rewards - torch.nanmean(grouped, dim=1).repeat_interleave(num_generations)
    if scale_rewards == "group":
        std = nanstd(grouped, dim=1).repeat_interleave(num_generations) if num_generations > 1 \
            else torch.zeros_like(rewards)
        advantages = advantages / (std + STD_EPS)
    elif scale_rewards == "batch":
        std = nanstd(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
        advantages = advantages / (std + STD_EPS)
    return torch.nan_to_num(advantages, nan=0.0)


def zero_std_groups(rewards: torch.Tensor, num_generations: int, scale_rewards: str = "group") -> torch.Tensor:
    """(N,) bool: the completions whose rewards' std is 0, TRL 1.16's `is_std_zero` (its `frac_reward_zero_std`
    is their mean): of their group's rewards under scale_rewards group or none (no signal: the advantages are 0),
    of the whole batch's under batch. A std of fewer than 2 scored rewards is NaN: not counted as 0."""
    if scale_rewards == "batch":
        std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    else:
        std = nanstd(rewards.view(-1, num_generations), dim=1).repeat_interleave(num_generations)
    return torch.isclose(std, torch.zeros_like(std))


# --- each completion token's log-probability, a chunk of positions at a time
# fp32 elements of one chunk's buffers: 2**22 (16 MiB) is 85 positions of SmolLM2's 49,152-token vocabulary
LOGP_CHUNK_ELEMENTS = 2 ** 22


def chunk_rows(vocab: int, elements: int = LOGP_CHUNK_ELEMENTS) -> int:
    """Positions per chunk: as many (vocab,) rows as `elements` holds, at least one."""
    return max(1, elements // vocab)


class _SelectiveLogSoftmax(torch.autograd.Function):
    """Each position's log-probability of its target under softmax(logits / temperature), and (without a
    gradient) its entropy, formed a chunk of positions at a time: the (N, V) log-softmax, its exp and their
    product never exist whole (TRL's `selective_log_softmax` and `entropy_from_logits`, chunked). Saved for
    backward: the logits the model returned (alive anyway) and each position's log-sum-exp; backward forms
    each chunk's softmax again and writes its gradient, g x (onehot(target) - softmax) / temperature, into
    one buffer of the logits' shape, the gradient autograd would hand the LM head."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, temperature: float, rows: int, entropy: bool):
        n = logits.shape[0]
        logps = torch.empty(n, dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(logps)
        ent = torch.empty_like(logps) if entropy else None
        for start in range(0, n, rows):
            part = slice(start, min(start + rows, n))
            scaled = logits[part].float() / temperature
            lse[part] = torch.logsumexp(scaled, dim=-1)
            # log_softmax in place: the chunk's log-probabilities
            lp = scaled.sub_(lse[part].unsqueeze(1))
            logps[part] = lp.gather(1, targets[part].unsqueeze(1)).squeeze(1)
            if ent is not None:
                ent[part] = -(lp.exp() * lp).sum(-1)
            del scaled, lp
        ctx.save_for_backward(logits, targets, lse)
        ctx.temperature, ctx.rows = temperature, rows
        if ent is not None:
            ctx.mark_non_differentiable(ent)
        return logps, ent

    @staticmethod
    def backward(ctx, grad: torch.Tensor, _grad_entropy=None):
        logits, targets, lse = ctx.saved_tensors
        t, rows = ctx.temperature, ctx.rows
        out = torch.empty_like(logits)
        grad = grad.float()
        for start in range(0, logits.shape[0], rows):
            part = slice(start, min(start + rows, logits.shape[0]))
            g = grad[part].unsqueeze(1)
            # softmax from the saved log-sum-exp, then d logp_y / d z = onehot(y) - softmax, times g / T
            p = (logits[part].float() / t).sub_(lse[part].unsqueeze(1)).exp_()
            p.mul_(g.neg()).scatter_add_(1, targets[part].unsqueeze(1), g).div_(t)
            out[part] = p
        return out, None, None, None, None


def selective_logps(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, entropy: bool = False,
                    rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """((...,) the log-probability of each of `targets` (...,) under softmax(`logits` (..., V) / temperature),
    in fp32; (...,) the entropies of those distributions, without gradient, or None): TRL's
    `selective_log_softmax` (trl/trainer/utils.py) and `entropy_from_logits`, `rows` positions at a time
    (`chunk_rows`), so that no (..., V) intermediate exists beside the logits themselves, in forward or
    backward."""
    shape, vocab = targets.shape, logits.shape[-1]
    flat = logits.reshape(-1, vocab)
    logps, ent = _SelectiveLogSoftmax.apply(flat, targets.reshape(-1).to(logits.device), float(temperature),
                                            rows or chunk_rows(vocab), entropy)
    return logps.view(shape), ent.view(shape) if ent is not None else None


# --- the policy loss of a micro-batch
def log_importance_weights(logps: torch.Tensor, old_logps: torch.Tensor, mask: torch.Tensor,
                           level: str = "token") -> torch.Tensor:
    """log(pi / pi_old): per token (B, T), or per sequence (B, 1) as GSPO (Zheng et al. 2025, eq. 7): the
    masked mean of the tokens' log-ratios, the log of the length-normalised sequence ratio."""
    log_ratio = logps - old_logps
    if level == "token":
        return log_ratio
    if level == "sequence":
        return ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    raise ValueError(f"importance sampling level {level!r}: one of {', '.join(IMPORTANCE_SAMPLING)}")


def k3_kl(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """(B, T) per-token KL(pi || pi_ref) estimate, Schulman's k3: exp(ref - logp) - (ref - logp) - 1, unbiased
    and >= 0 (GRPO, Shao et al. 2024, eq. 4)."""
    d = ref_logps - logps
    return torch.exp(d) - d - 1


@dataclass(frozen=True)
class PolicyTerms:
    """What `policy_loss_terms` computes: the per-token loss (not yet masked: (B, T), or (B, 1) at sequence
    level without a KL term), the importance ratio (B, T) or (B, 1), the per-token KL (B, T) where beta > 0."""
    loss: torch.Tensor
    ratio: torch.Tensor
    kl: torch.Tensor | None


def policy_loss_terms(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                      epsilon_low: float = 0.2, epsilon_high: float | None = None, level: str = "token",
                      beta: float = 0.0, ref_logps: torch.Tensor | None = None, kl_bias_correction: bool = True,
                      delta: float | None = None) -> PolicyTerms:
    """The clipped surrogate (PPO, Schulman et al. 2017, eq. 7; GRPO eq. 3): -min(r A, clip(r, 1 - eps_low,
    1 + eps_high) A), r the importance ratio (`log_importance_weights`), eps_high apart from eps_low as DAPO's
    clip-higher (Yu et al. 2025); `delta` caps r from above (INTELLECT-2's two-sided clip). Where beta > 0,
    + beta x the k3 KL to the reference, times r where `kl_bias_correction` (TRL's use_bias_correction_kl,
    default on: the unbiased reverse-KL gradient, DeepSeek-V3.2). logps (B, T) with gradient; old_logps and
    ref_logps (B, T) without; advantages (B,). All three log-probabilities of logits / the sampling temperature,
    as TRL's fused LM head computes them. TRL 1.16 `GRPOTrainer._compute_loss`."""
    epsilon_high = epsilon_low if epsilon_high is None else epsilon_high
    advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    ratio = torch.exp(log_importance_weights(logps, old_logps, mask, level))
    kl = None
    if beta != 0.0:
        if ref_logps is None:
            raise ValueError("policy_loss_terms: beta > 0 needs ref_logps")
        kl = k3_kl(logps, ref_logps)
        if kl_bias_correction:
            kl = kl * ratio
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    unclipped = ratio if delta is None else torch.clamp(ratio, max=delta)
    loss = -torch.min(unclipped * advantages, clipped * advantages)
    if kl is not None:
        loss = loss + beta * kl
    return PolicyTerms(loss, ratio, kl)


def loss_sum(per_token_loss: torch.Tensor, mask: torch.Tensor, loss_type: str) -> torch.Tensor:
    """This micro-batch's share of the loss before the global normaliser (`loss_normaliser`): grpo sums each
    sequence's mean token loss (GRPO, eq. 3: 1/|o_i| per sequence); bnpo, dr_grpo and dapo sum every token's
    (Dr. GRPO, DAPO: no per-sequence length, so no length bias)."""
    masked = per_token_loss * mask
    if loss_type == "grpo":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum()
    if loss_type in LOSS_TYPES:
        return masked.sum()
    raise ValueError(f"loss type {loss_type!r}: one of {', '.join(LOSS_TYPES)}")


def completion_counts(mask: torch.Tensor) -> torch.Tensor:
    """(2,) [completions, loss tokens] of a micro-batch: summed over the global batch (every micro-batch of
    every rank) they are what `loss_normaliser` divides by. Rows of a truncated completion the mask has
    emptied (mask_truncated_completions) still count as completions, as TRL's grpo and dr_grpo count them."""
    return torch.stack([torch.tensor(mask.shape[0], dtype=torch.float32, device=mask.device), mask.sum().float()])


def loss_normaliser(loss_type: str, sequences: torch.Tensor | float, tokens: torch.Tensor | float,
                    max_completion_length: int) -> torch.Tensor | float:
    """The global batch's count each micro-batch's `loss_sum` is divided by: its completions (grpo: the mean
    over sequences), its loss tokens (dapo, bnpo: DAPO eq. 8's 1 / sum |o_i|), its completions x
    max_completion_length (dr_grpo: Dr. GRPO's constant, as TRL's). `sequences`, `tokens`: `completion_counts`
    summed over the global batch. At least 1, as TRL clamps."""
    if loss_type == "grpo":
        count = sequences
    elif loss_type in ("bnpo", "dapo"):
        count = tokens
    elif loss_type == "dr_grpo":
        count = sequences * max_completion_length
    else:
        raise ValueError(f"loss type {loss_type!r}: one of {', '.join(LOSS_TYPES)}")
    return count.clamp(min=1.0) if isinstance(count, torch.Tensor) else max(float(count), 1.0)


# --- metrics: sums and counts, so that a sum over micro-batches and ranks gives the global batch's mean
def masked_sum_count(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(2,) [sum, count] of `x` over the mask's tokens, or over sequences where `x` is (B, 1) (sequence
    level), as TRL's `global_masked_mean` (whose sum / count over ranks is the mean)."""
    if x.shape[1] == 1:
        return torch.stack([x.sum().float(), torch.tensor(float(x.shape[0]), device=x.device)])
    return torch.stack([(x * mask).sum().float(), mask.sum().float()])


def masked_sequence_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B,) per-sequence mean over the mask (NaN for an empty row, which TRL's nanmin/nanmax skip)."""
    return x.squeeze(1) if x.shape[1] == 1 else (x * mask).sum(-1) / mask.sum(-1)


@dataclass(frozen=True)
class PolicyMetrics:
    """TRL's `_compute_loss` metrics of one micro-batch: `sums` name -> (2,) [sum, count] (summed over micro-batches
    and ranks, mean = sum / count); `minimum`/`maximum` name -> a scalar, NaN where no sequence had a token
    (reduced with min / max, NaN skipped: TRL's nanmin / nanmax)."""
    sums: dict[str, torch.Tensor]
    minimum: dict[str, torch.Tensor]
    maximum: dict[str, torch.Tensor]


def _nan_extreme(x: torch.Tensor, op) -> torch.Tensor:
    kept = x[~torch.isnan(x)]
    return op(kept) if kept.numel() else torch.tensor(float("nan"), device=x.device)


def policy_metrics(terms: PolicyTerms, advantages: torch.Tensor, mask: torch.Tensor, epsilon_low: float = 0.2,
                   epsilon_high: float | None = None, entropies: torch.Tensor | None = None,
                   delta: float | None = None) -> PolicyMetrics:
    """TRL 1.16 `GRPOTrainer._compute_loss`'s metrics: the share of tokens (at sequence level, of sequences) the
    clip holds, ratio < 1 - eps_low with A < 0 (clip_ratio/low_mean), ratio > 1 + eps_high with A > 0 (high_mean),
    either (region_mean); the least and the greatest per-sequence share (low_min, high_max); the mean KL where
    beta > 0, the mean entropy given the (B, T) per-token entropies. TRL reads the ratio after `delta`'s cap;
    so does this."""
    epsilon_high = epsilon_low if epsilon_high is None else epsilon_high
    advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    with torch.no_grad():
        ratio = terms.ratio if delta is None else torch.clamp(terms.ratio, max=delta)
        low = ((ratio < 1 - epsilon_low) & (advantages < 0)).float()
        high = ((ratio > 1 + epsilon_high) & (advantages > 0)).float()
        region = torch.maximum(low, high)
        sums = {"clip_ratio/low_mean": masked_sum_count(low, mask),
                "clip_ratio/high_mean": masked_sum_count(high, mask),
                "clip_ratio/region_mean": masked_sum_count(region, mask)}
        if terms.kl is not None:
            sums["kl"] = masked_sum_count(terms.kl.detach(), mask)
        if entropies is not None:
            sums["entropy"] = masked_sum_count(entropies.detach(), mask)
        return PolicyMetrics(sums, {"clip_ratio/low_min": _nan_extreme(masked_sequence_mean(low, mask), torch.min)},
                             {"clip_ratio/high_max": _nan_extreme(masked_sequence_mean(high, mask), torch.max)})


def truncated_mask(mask: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
    """`mask` with the rows of truncated completions (no EOS within max_completion_length) emptied: TRL's
    `mask_truncated_completions` (DAPO's overlong filtering, Yu et al. 2025, section 3.4)."""
    return mask * (~truncated.to(torch.bool)).unsqueeze(1).to(mask.dtype)


def overlong_penalty(lengths: list[int], max_length: int, buffer: int, factor: float = 1.0) -> list[float]:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13; verl's `overlong_buffer`): 0 for a completion of at
    most max_length - buffer tokens, then falling linearly to -factor at max_length (and below it past that):
    min(-(length - (max_length - buffer)) / buffer x factor, 0). Added to the other rewards, weight 1."""
    start = max_length - buffer
    return [min(-(n - start) / buffer * factor, 0.0) for n in lengths]


def informative_groups(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """(N / G,) bool: the groups DAPO's dynamic sampling keeps (Yu et al. 2025, "DAPO", eq. 11 and Algorithm 1:
    0 < |{o_i equivalent to the answer}| < G, i.e. rewards that do not all agree): a group's scored rewards
    (NaN: unscored) have a std above 0. A group with fewer than two scored rewards carries no comparison: dropped."""
    grouped = rewards.view(-1, num_generations)
    scored = (~torch.isnan(grouped)).sum(1)
    std = torch.nan_to_num(nanstd(grouped, dim=1), nan=0.0)
    # isclose, as `zero_std_groups`: equal rewards' mean can round, leaving a std of 1e-17
    return (scored >= 2) & ~torch.isclose(std, torch.zeros_like(std))
