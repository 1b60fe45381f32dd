"""Causal-LM loss as a *sum* over target tokens, so the caller can normalise by the global count.

Normalising per micro-batch (the mean) weights short batches more than long ones and makes the
update depend on how a global batch is cut into micro-batches and ranks. Summing here and dividing
by the number of target tokens in the whole global batch (all ranks, all accumulation steps) makes
1 process x micro-batch 8 and 2 processes x micro-batch 2 x accumulation 2 the same update.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

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


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropies in fp32. logits (B, T, V), labels (B, T) -> scalar."""
    return target_loss_sum(logits, shift_labels(labels))


def target_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """`token_loss_sum` on labels already shifted (context parallel shifts before it splits a sequence)."""
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1).to(logits.device),
                           ignore_index=IGNORE_INDEX, reduction="sum")


# Rows of logits alive at once: 256 x 49,152 (SmolLM2's vocab) fp32 = 50 MB instead of 201 MB per
# 1,024 tokens, and still large enough matmuls to keep a GPU busy.
LOSS_CHUNK_TOKENS = 256


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """sum_t CE(h_t W^T + b, y_t) computed `chunk` rows at a time; full logits never exist. Every row
    is a target (the caller drops ignored positions first).

    The gradient is formed in forward, chunk by chunk, while each chunk's logits are alive
    (dlogits = softmax - onehot): dH is kept (N x h, the size of the input) and dW, db summed; backward
    only scales them by the incoming scalar. All the work happens inside the LM head's forward, where
    ZeRO-3/FSDP have the weight gathered; nothing is recomputed later (the fused linear cross-entropy
    of Liger-Kernel and Apple's Cut Cross-Entropy, without their custom kernels)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, chunk):
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        d_hidden = torch.zeros_like(hidden) if need_h else None
        d_weight = torch.zeros_like(weight, dtype=torch.float32) if need_w else None
        d_bias = torch.zeros_like(bias, dtype=torch.float32) if need_b else None
        for start in range(0, hidden.size(0), chunk):
            logits = g = None  # drop the previous chunk's (chunk, V) buffer before the next one is made
            h, y = hidden[start:start + chunk], labels[start:start + chunk]
            logits = F.linear(h, weight, bias).float()  # (chunk, V): the only (chunk, V) buffer alive
            target = logits.gather(1, y.unsqueeze(1)).squeeze(1)
            # log-sum-exp and softmax in place (torch.logsumexp would allocate a second (chunk, V))
            top = logits.amax(1, keepdim=True)
            g = logits.sub_(top).exp_()
            norm = g.sum(1, keepdim=True)
            lse = (top + norm.log()).squeeze(1)
            total += (lse - target).sum()  # = cross_entropy(..., reduction="sum")
            if not (need_h or need_w or need_b):
                continue
            g.div_(norm)  # softmax
            g[torch.arange(len(y), device=y.device), y] -= 1.0
            if need_h:
                d_hidden[start:start + chunk] = (g.to(weight.dtype) @ weight).to(hidden.dtype)
            if need_w:
                d_weight.addmm_(g.t(), h.float())
            if need_b:
                d_bias += g.sum(0)
        # Kept on ctx, not saved for backward: backward scales them in place and hands them over, so
        # no second weight-sized buffer appears (a second backward through this graph is an error).
        ctx.grads = d_hidden, d_weight, d_bias
        ctx.dtypes = hidden.dtype, weight.dtype, bias.dtype if bias is not None else None
        return total

    @staticmethod
    def backward(ctx, grad):
        if ctx.grads is None:
            raise RuntimeError("chunked loss: backward ran twice through the same graph")
        grads, ctx.grads = ctx.grads, None
        return (*(g.mul_(grad).to(dtype) if g is not None else None for g, dtype in zip(grads, ctx.dtypes)),
                None, None)


def chunked_loss_sum(hidden: torch.Tensor, head: torch.nn.Linear, labels: torch.Tensor,
                     chunk: int = LOSS_CHUNK_TOKENS, shifted: bool = False) -> torch.Tensor:
    """`token_loss_sum(head(hidden), labels)` (`target_loss_sum` when `shifted`) without materialising
    (B, T, V) logits. hidden (B, T, h) from the last norm, labels (B, T) -> scalar fp32 sum over targets."""
    if shifted:
        h, y = hidden.reshape(-1, hidden.size(-1)), labels.reshape(-1).to(hidden.device)
    else:
        h, y = hidden[:, :-1].reshape(-1, hidden.size(-1)), labels[:, 1:].reshape(-1).to(hidden.device)
    # Only target rows go through the head: prompt and padding rows add nothing to the loss and get a zero
    # gradient, so the head's matmuls run on the targets alone (17% of the tokens of the built-in data).
    keep = (y != IGNORE_INDEX).nonzero(as_tuple=True)[0]
    return _ChunkedLinearCrossEntropy.apply(h.index_select(0, keep), head.weight, head.bias, y[keep], chunk)


class ChunkedHead:
    """Turns the model's LM head into a chunked loss for the forward passes run inside `labels(...)`.

    The head's `forward` is replaced on the instance (parameters and state-dict keys untouched), so
    the loss is computed inside the model's own forward: DDP, ZeRO and FSDP see an ordinary module
    call with its weight gathered. Outside `labels(...)` the head computes logits as before
    (generation, eval). Inside it the model's `.logits` output is the scalar loss sum."""

    def __init__(self, model: torch.nn.Module, chunk: int = LOSS_CHUNK_TOKENS):
        self.head = model.get_output_embeddings()
        if not isinstance(self.head, torch.nn.Linear):
            from toolkit.errors import UserError

            raise UserError(f"--loss chunked needs a linear LM head; this model has {type(self.head).__name__}")
        self.chunk, self._labels, self._shifted = chunk, None, False
        original = self.head.forward

        def forward(hidden):
            if self._labels is None:
                return original(hidden)
            return chunked_loss_sum(hidden, self.head, self._labels, self.chunk, self._shifted)

        self.head.forward = forward

    @contextmanager
    def labels(self, labels: torch.Tensor, shifted: bool = False) -> Iterator[None]:
        """`shifted`: `labels` are already the targets of each position (`shift_labels`)."""
        self._labels, self._shifted = labels, shifted
        try:
            yield
        finally:
            self._labels = None


def chunked_head_for(model: torch.nn.Module, loss: str) -> ChunkedHead | None:
    """`--loss` resolved: `auto` is chunked wherever the head is a plain linear layer (fewer FLOPs and
    no (B, T, V) buffer for the same loss and gradients), else the full-logits path."""
    if loss == "full" or (loss == "auto" and not isinstance(model.get_output_embeddings(), torch.nn.Linear)):
        return None
    return ChunkedHead(model)
