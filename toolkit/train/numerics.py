"""How closely two computations of the same values agree, by the dtype that computed them.

A check that compares two computations (the start-up loss and packing checks, the saved folder's
reload, the bf16 parity tests) must tell rounding from a real difference. In fp32 two kernels that
order their sums differently agree to ~1e-6; in bf16 one rounding is 2^-8 of a value, so two correct
kernels differ by about bf16's epsilon (2^-7) of the largest value, and an fp32 bound refuses them.
"""

from __future__ import annotations

import torch

# fp32's bound, relative: 100x what two fp32 kernels ordering sums differently differ by
FP32_RTOL = 1e-4

# --mixed-precision -> compute dtype
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "no": torch.float32}


def agreement(dtype: torch.dtype) -> float:
    """The relative gap (to the largest value) within which two correct computations of the same
    values in `dtype` agree: FP32_RTOL, or two units of the dtype's rounding where that is more
    (bf16: 2 x 2^-7 = 1.6e-2; fp16: 2e-3). transformers' padding-free tests allow bf16's epsilon (7.8e-3),
    its eager-vs-sdpa tests 1e-2; one H100 measured Llama's packed varlen logits against unpacked sdpa's
    at 4.9e-3 (LoRA) and 6.5e-3 (full) in bf16."""
    return max(FP32_RTOL, 2 * torch.finfo(dtype).eps)


def mean_agreement(dtype: torch.dtype) -> float:
    """The same for a mean over many tokens (a loss) whose two sides run the same computation up to its
    last matmul (the loss check: the same blocks, two LM heads), relative to it: FP32_RTOL, or 1/32 of a
    unit of the dtype's rounding (bf16: 2.4e-4). Each side rounds its logits once; the mean over the
    tokens averages that down: one H100 measured 1.5e-5 in bf16 (Gemma-2 through cce), 16x
    under the bound, while a head that trains another objective moves the mean by more (a router loss
    left out at Qwen3-MoE's coefficient 0.001: ~1e-3)."""
    return max(FP32_RTOL, torch.finfo(dtype).eps / 32)
