"""Model FLOPs utilisation: model FLOPs per token x tokens/s over the device's measured peak.

Model FLOPs (not hardware FLOPs: recomputation and padding are not credited), after PaLM
(Chowdhery et al. 2022, appendix B) and nanoGPT's `estimate_mfu`:
    per token = 6 N + 12 L h T
6N: each weight does one multiply-add (2 FLOPs) per token in forward and two in backward; N counts
the weights used in matmuls (the LM head, not a separate input-embedding lookup table).
12 L h T: attention scores and weighted values, forward + backward, over a context of T tokens.
The chunked loss runs the LM head on target tokens only: the head's 6 N_head then counts only for
them (`step_flops`), as the logits of prompt and padding tokens are not model work the loss needs.
The peak is measured, not taken from a datasheet: a matmul probe on the same device and dtype
(fp32 on CPU, bf16 on GPU) at start-up, with every rank probing at once so shared cores are shared.
"""

from __future__ import annotations

import time

import torch


def flops_per_token(matmul_params: int, layers: int, hidden: int, context: float) -> float:
    return 6.0 * matmul_params + 12.0 * layers * hidden * context


def step_flops(tokens: float, head_tokens: float, matmul_params: int, head_params: int, layers: int,
               hidden: int, context: float) -> float:
    """Model FLOPs of `tokens` through the body and `head_tokens` of them through the LM head."""
    body = flops_per_token(matmul_params - head_params, layers, hidden, context)
    return tokens * body + 6.0 * head_params * head_tokens


def head_params(model: torch.nn.Module) -> int:
    """Weights of the LM head of the *unsharded* model, from its config as `matmul_params` counts it."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    try:
        from toolkit.planner.params import count_params

        c = count_params(base.config.to_dict())
        return c.lm_head or c.embedding
    except (KeyError, ValueError, TypeError):
        head = base.get_output_embeddings()
        return 0 if head is None else getattr(head.weight, "ds_numel", head.weight.numel())


def matmul_params_from_config(cfg: dict) -> int:
    """Blocks + final norm + the LM head (the tied embedding when there is no separate head)."""
    from toolkit.planner.params import count_params

    c = count_params(cfg)
    return c.per_block * c.blocks + c.final_norm + (c.lm_head or c.embedding)


def matmul_params(model: torch.nn.Module) -> int:
    """Weights that take part in matmuls, for the *unsharded* model: counted from its config with the
    planner's formulas (exact for the supported architectures; TP/ZeRO-3/FSDP shards do not matter),
    else from the module's own parameters. An input embedding not tied to the LM head is a lookup."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    try:
        return matmul_params_from_config(base.config.to_dict())
    except (KeyError, ValueError, TypeError):
        seen: set[int] = set()
        total = 0
        for p in base.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                total += getattr(p, "ds_numel", p.numel())
        inp, out = base.get_input_embeddings(), base.get_output_embeddings()
        if inp is not None and (out is None or inp.weight is not out.weight):
            total -= getattr(inp.weight, "ds_numel", inp.weight.numel())
        return total


def measure_peak_flops(device: torch.device, dtype: torch.dtype, n: int | None = None, seconds: float = 0.25) -> float:
    """Best FLOP/s of an n x n matmul: `seconds` of warm-up, then the fastest of the calls timed over
    `seconds` more (at least 3).

    Time-bounded rather than a fixed few calls: on the 2-core CPU the first calls after start-up ran
    at 100-150 GFLOP/s against 165-190 later, and a low peak inflates MFU (a LoRA row read 1.3).
    The best call is the estimator because interference only ever slows a call down.
    """
    n = n or (8192 if device.type == "cuda" else 1024)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)

    def timed() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t0

    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        timed()
    best, calls, end = float("inf"), 0, time.perf_counter() + seconds
    while calls < 3 or time.perf_counter() < end:
        best, calls = min(best, timed()), calls + 1
    del a, b
    if device.type == "cuda":
        torch.cuda.empty_cache()  # do not keep the probe's blocks in the allocator's cache
    return 2.0 * n ** 3 / best
