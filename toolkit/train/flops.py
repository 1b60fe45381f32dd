"""Model FLOPs utilisation: model FLOPs per token x tokens/s over the devices' peak.

Model FLOPs (not hardware FLOPs: recomputation and padding are not credited), after PaLM
(Chowdhery et al. 2022, appendix B) and nanoGPT's `estimate_mfu`:
    per token = 6 N + 12 L h T
6N: each weight does one multiply-add (2 FLOPs) per token in forward and two in backward; N counts
the weights used in matmuls (the LM head, not a separate input-embedding lookup table); in an MoE
layer a token runs through its top-k routed experts only, so N counts those (active parameters).
12 L h T: attention scores and weighted values, forward + backward, over a context of T tokens.
The chunked loss runs the LM head on target tokens only: the head's 6 N_head then counts only for
them (`step_flops`), as the logits of prompt and padding tokens are not model work the loss needs.
The peak is the datasheet's dense rate for the run's compute dtype where the device is known
(`toolkit.hardware`, the convention of PaLM, Megatron-LM and torchtitan), and otherwise (CPUs,
unknown GPUs) a matmul probe on the same device and dtype, every rank probing at once so shared cores
are shared. The probe's figure is logged either way (`measured_peak_flops`). It is measured once per
device, dtype, thread count and ranks per node, and kept in the toolkit cache (`peaks.json`; 0.5-0.7 s
of a tiny run's start-up on the 2-core CPU). A cached figure that gives MFU > 1 was measured under
load: the run probes again, once, and the cache keeps the better figure.
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from toolkit.errors import UserError
from toolkit.hardware import PROBE_MATMUL_GPU, datasheet_peak


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
    # a model the planner does not count
    except (KeyError, ValueError, TypeError, UserError):
        head = base.get_output_embeddings()
        return 0 if head is None else getattr(head.weight, "ds_numel", head.weight.numel())


def matmul_params_from_config(cfg: dict) -> int:
    """Blocks + final norm + the LM head (the tied embedding when there is no separate head), with
    each MoE layer's top-k routed experts, not all of them: the weights one token's forward multiplies
    (`toolkit.planner.params.matmul_params`)."""
    from toolkit.planner.params import matmul_params as from_config

    return from_config(cfg, active=True)


def matmul_params(model: torch.nn.Module) -> int:
    """Weights that take part in one token's matmuls, for the *unsharded* model: counted from its
    config with the planner's formulas (exact for the supported architectures, an MoE layer's top-k
    experts only; TP/ZeRO-3/FSDP shards do not matter), else from the module's own parameters. An
    input embedding not tied to the LM head is a lookup."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    try:
        return matmul_params_from_config(base.config.to_dict())
    # a model the planner does not count
    except (KeyError, ValueError, TypeError, UserError):
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
    n = n or (PROBE_MATMUL_GPU if device.type == "cuda" else 1024)
    # its own generator: whether the probe runs (the figure is cached) must not move the run's random
    # streams (dropout), or a resumed run would differ from the uninterrupted one
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=g)

    def timed(a: torch.Tensor, b: torch.Tensor) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t0

    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        timed(a, b)
    best, calls, end = float("inf"), 0, time.perf_counter() + seconds
    while calls < 3 or time.perf_counter() < end:
        best, calls = min(best, timed(a, b)), calls + 1
    del a, b
    if device.type == "cuda":
        # do not keep the probe's blocks in the allocator's cache
        torch.cuda.empty_cache()
    return 2.0 * n ** 3 / best


def device_name(device: torch.device) -> str:
    """What the datasheet table is matched against: the CUDA device's name, else the device type."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def probe_key(device: torch.device, dtype: torch.dtype) -> str:
    """What a probe's figure depends on: the device (the CPU's model), dtype, threads, the ranks sharing
    the node (they probe at once) and torch."""
    where = device_name(device) if device.type == "cuda" else f"cpu {platform.processor() or platform.machine()}"
    return (f"{where}|{dtype}|threads {torch.get_num_threads()}|local ranks {os.environ.get('LOCAL_WORLD_SIZE', '1')}"
            f"|torch {torch.__version__}")


def cached_peak(device: torch.device, dtype: torch.dtype, path: Path, fresh: bool = False) -> tuple[float, bool]:
    """(this device's probe figure, whether it was read from `path`): probed and added there the first
    time, or when `fresh`; the file keeps the best figure seen (interference only ever lowers one). An
    unreadable file is probed over; an unwritable one probes again next run."""
    key = probe_key(device, dtype)
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    known = known if isinstance(known, dict) else {}
    had = float(known[key]) if isinstance(known.get(key), (int, float)) and known[key] > 0 else 0.0
    if had and not fresh:
        return had, True
    measured = max(measure_peak_flops(device, dtype), had)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({**known, key: measured}, indent=1))
        # ranks writing at once: one whole file wins
        os.replace(tmp, path)
    except OSError:
        pass
    return measured, False


@dataclass
class Peak:
    # the MFU denominator, summed over ranks
    flops: float
    # the probes' sum, logged beside it
    measured: float
    # "datasheet: ..." or "measured"
    source: str
    # where a measured figure was read from
    cache: Path | None = None


def run_peak(accelerator, dtype: torch.dtype, cache: Path, fresh: bool = False) -> Peak:
    """Every rank probes its device (or reads its figure from `cache`, unless `fresh`) and looks up its
    datasheet; the datasheet sum is the peak when every rank's device is known, else the probes' sum.
    Collective: every rank calls it."""
    name = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")
    sheet = datasheet_peak(device_name(accelerator.device), name)
    accelerator.wait_for_everyone()
    measured, cached = cached_peak(accelerator.device, dtype, cache, fresh)
    local = torch.tensor([measured, sheet[0] if sheet else 0.0, float(sheet is not None), float(cached)],
                         dtype=torch.float64, device=accelerator.device)
    measured_sum, sheet_sum, known, n_cached = accelerator.reduce(local, "sum").tolist()
    if sheet is not None and round(known) == accelerator.num_processes:
        return Peak(sheet_sum, measured_sum, "datasheet: " + sheet[1])
    return Peak(measured_sum, measured_sum, "measured", cache if n_cached else None)


def mfu_warning(mfu: float, peak: Peak) -> str | None:
    """MFU above 1 is impossible; say why it was logged rather than let it pass for a result."""
    if mfu <= 1.0:
        return None
    if peak.source == "measured":
        return (f"warning: mfu {mfu:.2f} > 1: the peak was measured low ({peak.flops / 1e9:.0f} GFLOP/s; "
                "another job on the device?), so mfu is not meaningful for this run")
    return f"warning: mfu {mfu:.2f} > 1 against the datasheet peak: the model FLOP count over-credits this model"
