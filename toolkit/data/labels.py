"""Which positions of a batch train: labels are the input ids with the prompt and the padding set to
-100 (`tokenize.IGNORE_INDEX`); position t is trained to predict label t + 1. Shared by the loop's
token counts, the collate (target rows found on the CPU) and the losses (`toolkit.objectives.sft.loss`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from toolkit.data.images import MEDIA
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


# what the loss check's logits may take: `check_window`
CHECK_BYTES = 256 * 2**20


def check_window(batch: dict, vocab_size: int, rows: int = 2, budget: int = CHECK_BYTES) -> dict:
    """The loss check's inputs (`toolkit.train.loss_check`): up to `rows` rows of `batch`, those with
    targets first, each cut to one window of the same length that starts just before its first target.
    The length keeps the model's own loss on them (its logits, their fp32 copy and log-softmax: ~10 bytes
    a token per vocabulary entry) within `budget`: the check runs before step 1 with whole logits, so on
    whole rows it set the run's memory peak where a fused head trains (one H200, a 128,256 vocabulary at
    2 x 4,096 tokens: 12.9 GB, all four fused heads alike, against the planner's 9.5 GB for the step).
    Tensors of the labels' shape are cut; other (B, *) ones keep the rows."""
    labels = batch["labels"]
    b, s = labels.shape
    has = labels[:, 1:] != IGNORE_INDEX
    order = torch.argsort((~has.any(1)).to(torch.int8), stable=True)[:rows]
    length = min(s, max(64, budget // (10 * vocab_size * len(order))))
    # token j predicts label j + 1
    start = has[order].to(torch.int8).argmax(1).clamp(max=s - length)
    index = start[:, None] + torch.arange(length, device=labels.device)
    # an image batch's inputs are left out: a window cuts its image tokens from their features, and the check is of
    # the loss head, which both sides then run on the same text-only rows
    return {k: v[order].gather(1, index.to(v.device)) if v.shape == labels.shape else v[order.to(v.device)]
            for k, v in batch.items() if torch.is_tensor(v) and v.dim() == 2 and not k.startswith(MEDIA)}
