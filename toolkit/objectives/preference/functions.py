"""The preference objectives' pure functions (`toolkit.objectives.preference.loss` puts them together): each sequence's
log-probability of its completion, whole or sliced (context parallel) or per packed document, and the
objectives as functions of those, written as TRL writes them (trl 1.16: `DPOTrainer._compute_loss`
"sigmoid", the experimental `ORPOTrainer.odds_ratio_loss`, `CPOTrainer.cpo_loss` "simpo",
`KTOTrainer._compute_loss` "kto"); the rows ORPO's NLL and KTO's KL are computed on."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from toolkit.data.images import MEDIA
from toolkit.data.tokenize import IGNORE_INDEX
from toolkit.objectives.logps import sequence_logps


def smoothed_sigmoid_loss(z: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    """-log sigmoid(z), with conservative label smoothing (cDPO, Mitchell 2023; TRL's CPO form):
    the preference is taken as flipped with probability `label_smoothing`."""
    return -(1 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)


def dpo_loss(chosen: torch.Tensor, rejected: torch.Tensor, ref_chosen: torch.Tensor, ref_rejected: torch.Tensor,
             beta: float, label_smoothing: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-pair loss, chosen reward, rejected reward): DPO (Rafailov et al. 2023, eq. 7),
    -log sigmoid(beta x ((chosen - ref chosen) - (rejected - ref rejected))), rewards beta x the log ratios."""
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    loss = smoothed_sigmoid_loss(beta * (chosen_ratio - rejected_ratio), label_smoothing)
    return loss, beta * chosen_ratio.detach(), beta * rejected_ratio.detach()


def simpo_loss(chosen_mean: torch.Tensor, rejected_mean: torch.Tensor, beta: float, gamma: float,
               label_smoothing: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SimPO (Meng et al. 2024, eq. 6): -log sigmoid(beta x (mean log p chosen - mean log p rejected) - gamma),
    no reference; rewards beta x the mean log-probabilities."""
    loss = smoothed_sigmoid_loss(beta * (chosen_mean - rejected_mean) - gamma, label_smoothing)
    return loss, beta * chosen_mean.detach(), beta * rejected_mean.detach()


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, stable at both ends (Maechler 2012)."""
    return torch.where(x > -math.log(2), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def orpo_odds_loss(chosen_mean: torch.Tensor, rejected_mean: torch.Tensor,
                   beta: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ORPO's odds-ratio term (Hong et al. 2024, eqs. 4 and 7): -beta x log sigmoid(log odds(chosen) -
    log odds(rejected)) on mean token log-probabilities; rewards beta x those. The NLL term is added by
    `PreferenceLoss` (its normaliser is the global batch's chosen tokens)."""
    log_odds = (chosen_mean - rejected_mean) - (log1mexp(chosen_mean) - log1mexp(rejected_mean))
    return -beta * F.logsigmoid(log_odds), beta * chosen_mean.detach(), beta * rejected_mean.detach()


def kto_loss(logps: torch.Tensor, ref: torch.Tensor, desirable: torch.Tensor, kl: torch.Tensor, beta: float,
             desirable_weight: float = 1.0, undesirable_weight: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-example loss, reward): KTO (Ethayarajh et al. 2024, eq. 8, the value function's sigmoid): a
    desirable completion's loss is w_d x (1 - sigmoid(beta x (log ratio - z0))), an undesirable one's
    w_u x (1 - sigmoid(beta x (z0 - log ratio))); z0 is the KL estimate (`kl`, no gradient); rewards
    beta x the log ratios (policy - reference log-probabilities)."""
    ratio = logps - ref
    z = beta * (ratio - kl)
    loss = torch.where(desirable.to(z.device), desirable_weight * (1 - torch.sigmoid(z)),
                       undesirable_weight * (1 - torch.sigmoid(-z)))
    return loss, beta * ratio.detach()


def pairs_in(batch: dict) -> int | torch.Tensor:
    """A preference objective's examples in a collated micro-batch: pairs (two rows each, or as the
    packing counted them); KTO's single completions (the collate's `pairs` counts them)."""
    return batch["pairs"] if "pairs" in batch else batch["input_ids"].shape[0] // 2


def orpo_labels(batch: dict) -> torch.Tensor:
    """ORPO's NLL labels, TRL's: the chosen sequences' (even rows') input ids where attended. Rows that lay
    the sequences end to end (packed or padding-free: documents chosen, rejected, chosen, ...) get labels
    for every row: the chosen documents' ids, each document's first token unset (nothing before it in its
    document predicts it, as nothing does at a padded row's position 0)."""
    # image pairs: their text tokens, the image tokens left out (`toolkit.data.image_rows.encode_pair`)
    if "orpo_labels" in batch:
        return batch["orpo_labels"]
    ids, mask = batch["input_ids"], batch["attention_mask"]
    if "position_ids" not in batch:
        return ids[0::2].masked_fill(mask[0::2] == 0, IGNORE_INDEX)
    starts = (batch["position_ids"] == 0) & (mask == 1)
    # over the rows laid end to end: whole pairs each
    document = starts.reshape(-1).cumsum(0).view(starts.shape) - 1
    return ids.masked_fill(~((document % 2 == 0) & (mask == 1) & ~starts), IGNORE_INDEX)


def orpo_nll_tokens(batch: dict) -> torch.Tensor:
    """The tokens ORPO's NLL averages over: every real token of the chosen sequences but the first (TRL's
    ORPO trains the chosen sequence's prompt too)."""
    if "position_ids" in batch:
        return (orpo_labels(batch) != IGNORE_INDEX).sum()
    if "orpo_labels" in batch:
        return (batch["orpo_labels"][:, 1:] != IGNORE_INDEX).sum()
    return batch["attention_mask"][0::2, 1:].sum()


def orpo_rows(batch: dict) -> dict:
    """The rows ORPO's NLL scores as a batch of their own (evaluation's whole-row forward, which a
    pipeline gives no logits for): the chosen sequences, on `orpo_labels`. Image pairs: every row with its images
    (the processor's inputs are not split by row), the rejected rows' labels unset."""
    media = {k: v for k, v in batch.items() if k.startswith(MEDIA)}
    if media:
        labels = torch.full_like(batch["labels"], IGNORE_INDEX)
        labels[0::2] = orpo_labels(batch)
        return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "labels": labels, **media}
    return {"input_ids": batch["input_ids"][0::2], "attention_mask": batch["attention_mask"][0::2],
            "labels": orpo_labels(batch)}


def orpo_nll(logits: torch.Tensor, labels: torch.Tensor, shifted: bool = False) -> torch.Tensor:
    """ORPO's summed NLL of the chosen sequences (the even rows of `logits`, or, where `labels` has a row for
    every row of `logits`, the chosen documents of rows laid end to end) on `orpo_labels` (`shifted`:
    a context-parallel slice's targets, `orpo_targets`, whose shares over the slices add up to the whole);
    the loop scales it by the global pairs / `orpo_nll_tokens` (`begin_step`)."""
    chosen = logits if labels.shape[0] == logits.shape[0] else logits[0::2]
    return -sequence_logps(chosen, labels, shifted)[0].sum()


def kl_batch(batch: dict) -> dict:
    """KTO's KL sequences (mismatched completions, `toolkit.data.pairs.kl_sequences`) as a batch of their own,
    with their precomputed reference where the rows carry one (`ref_kl_logps`)."""
    kl = {"input_ids": batch["kl_input_ids"], "attention_mask": batch["kl_attention_mask"],
          "labels": batch["kl_labels"]}
    # laid end to end (padding-free)
    for key in ("position_ids", "documents", "cu_seq_lens", "max_length"):
        if f"kl_{key}" in batch:
            kl[key] = batch[f"kl_{key}"]
    if "ref_kl_logps" in batch:
        kl["ref_logps"] = batch["ref_kl_logps"]
    # image examples: each KL sequence holds its own example's prompt, so the batch's images, in order; a value per
    # token, the KL rows' own (`toolkit.data.image_rows.MediaCollate`)
    kl.update({k: batch.get("kl_" + k, v) for k, v in batch.items() if k.startswith(MEDIA)})
    return kl
