"""Causal-LM loss as a *sum* over target tokens, so the caller can normalise by the global count.

Normalising per micro-batch (the mean) weights short batches more than long ones and makes the
update depend on how a global batch is cut into micro-batches and ranks. Summing here and dividing
by the number of target tokens in the whole global batch (all ranks, all accumulation steps) makes
1 process x micro-batch 8 and 2 processes x micro-batch 2 x accumulation 2 the same update.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from toolkit.data.tokenize import IGNORE_INDEX


def count_targets(labels: torch.Tensor) -> torch.Tensor:
    """Tokens that contribute to the loss: label set and not the first position (nothing predicts it)."""
    return (labels[:, 1:] != IGNORE_INDEX).sum()


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropies in fp32. logits (B, T, V), labels (B, T) -> scalar."""
    shift_logits = logits[:, :-1, :].float()  # (B, T-1, V)
    shift_labels = labels[:, 1:]  # (B, T-1)
    return F.cross_entropy(shift_logits.reshape(-1, shift_logits.size(-1)), shift_labels.reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction="sum")
