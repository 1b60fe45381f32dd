"""Each sequence's summed log-probability of its target tokens: of whole rows, of each document of a
padding-free or packed row, of a context-parallel slice summed over its group, and without gradients through a
model (the reference, the KL estimate, evaluation). What the objectives that score whole sequences share, and
what the layout's hooks compute (`toolkit.objectives.base.LayoutHooks`)."""

from __future__ import annotations
from typing import Callable
import torch
import torch.nn.functional as F
from toolkit.data.labels import shift_labels
from toolkit.data.tokenize import IGNORE_INDEX


# --- the objectives: pure functions of per-sequence log-probabilities, (P,) tensors
def token_logps(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(B, T) log-probability of each shifted target (0 where there is none), in fp32, as TRL's
    `selective_log_softmax`: the one cross-entropy every per-sequence sum below is made of."""
    targets = targets.to(logits.device)
    return -F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=IGNORE_INDEX,
                            reduction="none").view(targets.shape)


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor,
                   shifted: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of the target tokens' log-probabilities, their count) per row: logits (B, T, V), labels
    (B, T) (`shifted`: already targets) -> (B,), (B,)."""
    targets = (labels if shifted else shift_labels(labels)).to(logits.device)
    return token_logps(logits, targets).sum(1), (targets != IGNORE_INDEX).sum(1)


@torch.no_grad()
def no_grad_logps(model, inputs: dict, logps: Callable[[torch.Tensor], torch.Tensor],
                  reference: bool = False) -> torch.Tensor:
    """`logps` of `model(**inputs)`'s logits without gradients; `reference`: LoRA's base, the adapters
    disabled. The one place that forward is written: whole rows (`whole_row_logps`) and the training
    forward's own rows (`PreferenceLoss.reference_logps`) both come through here."""
    from contextlib import nullcontext

    from accelerate.utils import extract_model_from_parallel

    with extract_model_from_parallel(model).disable_adapter() if reference else nullcontext():
        return logps(model(**inputs).logits)


def whole_row_logps(model, batch: dict, reference: bool = False) -> torch.Tensor:
    """`sequence_logps` of whole rows through `model` without gradients, or of each document where the rows
    lay sequences end to end (`document_logps`: KTO's padding-free KL sequences); `reference`: LoRA's base,
    the adapters disabled (`toolkit.parallel.strategy.Strategy.sequence_logps`, a pipeline's aside)."""
    from toolkit.data.packing import model_inputs

    def logps(logits: torch.Tensor) -> torch.Tensor:
        if "position_ids" in batch:
            return document_logps(logits, batch["labels"], batch["position_ids"], batch["attention_mask"],
                                  batch["documents"])[0]
        return sequence_logps(logits, batch["labels"])[0]

    return no_grad_logps(model, model_inputs(batch), logps, reference)


def document_logps(logits: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor,
                   attention_mask: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`sequence_logps` of packed rows (`toolkit.data.packing`): per document, the `n` of them in the
    order the rows lay them out. A document starts where a real token's position is 0; a document's
    first label is unset by the packing, so no token is scored against the next document's first."""
    targets = shift_labels(labels).to(logits.device)
    logp = token_logps(logits, targets).reshape(-1)
    starts = ((position_ids == 0) & (attention_mask == 1)).reshape(-1).to(logits.device)
    doc = (starts.cumsum(0) - 1).clamp(min=0)
    scored = (targets.reshape(-1) != IGNORE_INDEX)
    logps = torch.zeros(n, dtype=logp.dtype, device=logp.device).index_add(0, doc, logp)
    counts = torch.zeros(n, dtype=torch.long, device=logp.device).index_add(0, doc, scored.long())
    return logps, counts


def sliced_logps(logits: torch.Tensor, targets: torch.Tensor, sum_slices) -> tuple[torch.Tensor, torch.Tensor]:
    """`sequence_logps` under context parallel: this rank's slice of each row (its targets already
    shifted, `toolkit.parallel.cp`), summed over the cp group by `sum_slices`: an all-reduce whose
    backward is the identity (Megatron's reduce-from region, `toolkit.parallel.tp.comm.reduce_from_tp`),
    since every cp rank computes the same pair loss from the sums and back-propagates it through its own
    slice only, and the slices' gradients add up to the whole."""
    logps, counts = sequence_logps(logits, targets, shifted=True)
    return sum_slices(logps), sum_slices(counts)
