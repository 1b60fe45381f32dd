"""Gradient checkpointing's trade-off: peak memory of a training step vs its time, with and without.

SmolLM2-135M-Instruct, fp32 CPU, random tokens (memory and time do not depend on their values),
micro-batch x seq from the flags. Each case runs in a fresh process: one warm-up step (allocates
optimizer states), then the kernel's peak-RSS mark is reset (`echo 5 > /proc/self/clear_refs`) and
`--steps` steps run; peak = VmHWM - VmRSS before them (activations, gradients, temporaries), time =
median step. Checkpointing is transformers' `gradient_checkpointing_enable` (non-reentrant), as
`--gradient-checkpointing` sets it.

    python -m benchmarks.checkpointing     # writes benchmarks/checkpointing.{json,md}
"""

from __future__ import annotations

import argparse
import sys

from benchmarks.common import (BENCH, child_result, median_seconds, peak_rss_mib, print_result, reset_peak_rss,
                           write_pair)


def child(method: str, gc: bool, batch: int, seq: int, steps: int) -> dict:
    import torch

    from toolkit.config import parse_config
    from toolkit.model.load import ModelShape, load_model
    from toolkit.model.source import resolve_model
    from toolkit.parallel.parallelize import Parallelism, apply_checkpointing, parallelize
    from toolkit.objectives.sft.loss import token_loss_sum

    argv = ["--method", method, "--mixed-precision", "no", "--output-dir", "/nonexistent-bench-dir"]
    cfg = parse_config(argv + (["--gradient-checkpointing"] if gc else []))
    torch.manual_seed(0)
    model = parallelize(load_model(cfg, resolve_model(cfg.model.model)), Parallelism(ModelShape.of(cfg)))[0].train()
    if gc:  # as the run applies it (`toolkit.parallel.parallelize`)
        apply_checkpointing(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq))

    def step() -> None:
        token_loss_sum(model(input_ids=ids).logits, ids).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    before = reset_peak_rss()
    step_s = median_seconds(step, steps)
    return {"peak_mib": peak_rss_mib(before), "step_s": step_s}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=3)
    a = ap.parse_args()
    rows = []
    for method in ("lora", "full"):
        row = {"method": method, "batch": a.batch, "seq": a.seq}
        for gc in (False, True):
            got = child_result(["-m", "benchmarks.checkpointing", "--child", method, str(int(gc)), str(a.batch),
                                str(a.seq), str(a.steps)], what=f"{method}, gc {gc}")
            row["gc" if gc else "no_gc"] = got
            print(method, "gc" if gc else "no gc", got, flush=True)
        row["memory_saved"] = 1 - row["gc"]["peak_mib"] / row["no_gc"]["peak_mib"]
        row["time_cost"] = row["gc"]["step_s"] / row["no_gc"]["step_s"] - 1
        rows.append(row)
    md = ["# Gradient checkpointing: step peak memory vs step time (SmolLM2-135M-Instruct, fp32, CPU)", "",
          "Reproduce: `python -m benchmarks.checkpointing` (method in its docstring).", "",
          "| method | batch x seq | peak MiB no gc | peak MiB gc | memory saved | step s no gc | step s gc | "
          "time added |",
          "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['method']} | {r['batch']} x {r['seq']} | {r['no_gc']['peak_mib']:.0f} | "
                  f"{r['gc']['peak_mib']:.0f} | {r['memory_saved']:.0%} | {r['no_gc']['step_s']:.2f} | "
                  f"{r['gc']['step_s']:.2f} | {r['time_cost']:+.0%} |")
    write_pair(BENCH / "checkpointing", {"model": "SmolLM2-135M-Instruct", "dtype": "float32", "rows": rows}, md)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        m, g, b, s, n = sys.argv[2:7]
        print_result(child(m, bool(int(g)), int(b), int(s), int(n)))
    else:
        main()
