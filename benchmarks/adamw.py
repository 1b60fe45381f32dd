"""One AdamW step over SmolLM2-135M-shaped fp32 parameters: torch's default per-tensor loop
(`foreach=False`, its CPU default), the multi-tensor loop (`foreach=True`) and the fused kernel
(`fused=True`, what the toolkit's make_optimizer picks where torch has it).

Same parameters and gradients for all three; each optimizer takes 2 warm-up steps, then the median
of 7 timed steps. The shapes are SmolLM2-135M's: tied 49,152 x 576 embedding, 30 layers of
q/k/v/o and MLP projections, RMSNorm weights.

    python -m benchmarks.adamw
Writes benchmarks/adamw.json and benchmarks/adamw.md.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import BENCH, cpu_device, md_table, median_seconds, write_pair

H, FF, KV, L, V = 576, 1536, 192, 30, 49152
SHAPES = [(V, H)] + [(H, H), (KV, H), (KV, H), (H, H), (FF, H), (FF, H), (H, FF), (H,), (H,)] * L + [(H,)]
KINDS = {"per-tensor loop (torch CPU default)": {"foreach": False}, "multi-tensor (foreach)": {"foreach": True},
         "fused": {"fused": True}}


def step_seconds(kwargs: dict, steps: int = 7) -> float:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s) * 0.02) for s in SHAPES]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    opt = torch.optim.AdamW(params, lr=1e-4, **kwargs)
    return median_seconds(opt.step, steps, warmup=2)


def main() -> None:
    # no options: --help says what it measures
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    n = sum(torch.Size(s).numel() for s in SHAPES)
    seconds = {name: step_seconds(kw) for name, kw in KINDS.items()}
    base = seconds["per-tensor loop (torch CPU default)"]
    out = {"params": n, "device": f"{cpu_device()}, {torch.get_num_threads()} threads", "dtype": "float32",
           "torch": torch.__version__, "step_seconds": seconds,
           "speedup_over_default": {k: base / v for k, v in seconds.items()}}
    lines = [f"# One AdamW step, {n / 1e6:.1f}M fp32 parameters (SmolLM2-135M shapes)", "",
             "Reproduce: `python -m benchmarks.adamw` (method in its docstring).", ""]
    lines += md_table(["implementation", "step seconds (median of 7)", "speed-up over the default"],
                      [[k, f"{v:.3f}", f"{base / v:.2f}x"] for k, v in seconds.items()])
    lines += ["", f"Device: {out['device']}, torch {out['torch']}."]
    write_pair(BENCH / "adamw", out, lines)


if __name__ == "__main__":
    main()
