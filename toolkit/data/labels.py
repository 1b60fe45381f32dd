"""Which positions of a batch train: labels are the input ids with the prompt and the padding set to
-100 (`tokenize.IGNORE_INDEX`); position t is trained to predict label t + 1. Shared by the loop's
token counts, the collate (target rows found on the CPU) and the losses (`toolkit.loss`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from toolkit.data.tokenize import IGNORE_INDEX


def count_targets(labels: torch.Tensor) -> torch.Tensor:
    """Tokens that contribute to the loss: label set and not the first position (nothing predicts it)."""
    return (labels[:, 1:] != IGNORE_INDEX).sum()


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """targets[:, t] = labels[:, t + 1], what position t predicts (the last position predicts nothing).
    Shift the labels, not the logits: slicing (B, T, V) logits and flattening them copies them all."""
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:]


def target_rows(labels: torch.Tensor, shifted: bool = False) -> torch.Tensor:
    """Flat indices into (B x T) of the positions that have a target, for `FusedLossHead.labels(rows=)`.
    Made where the labels are still on the CPU (the collate): their count is then a shape the host
    knows, and the head runs on target rows only without a device-to-host sync (`nonzero` of a CUDA
    tensor waits for the GPU to finish the forward so far, every micro-batch)."""
    targets = labels if shifted else shift_labels(labels)
    return (targets.reshape(-1) != IGNORE_INDEX).nonzero().squeeze(1)
