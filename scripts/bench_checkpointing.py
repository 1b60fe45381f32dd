"""Gradient checkpointing's trade-off: peak memory of a training step vs its time, with and without.

SmolLM2-135M-Instruct, fp32 CPU, random tokens (memory and time do not depend on their values),
micro-batch x seq from the flags. Each case runs in a fresh process: one warm-up step (allocates
optimizer states), then the kernel's peak-RSS mark is reset (`echo 5 > /proc/self/clear_refs`) and
`--steps` steps run; peak = VmHWM - VmRSS before them (activations, gradients, temporaries), time =
median step. Checkpointing is transformers' `gradient_checkpointing_enable` (non-reentrant), as
`--gradient-checkpointing` sets it.

    python scripts/bench_checkpointing.py     # writes benchmarks/checkpointing.{json,md}
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def child(method: str, gc: bool, batch: int, seq: int, steps: int) -> dict:
    import torch

    from toolkit.config import parse_config
    from toolkit.models import load_model, resolve_model
    from toolkit.train.loss import token_loss_sum

    argv = ["--method", method, "--mixed-precision", "no", "--output-dir", "/nonexistent-bench-dir"]
    cfg = parse_config(argv + (["--gradient-checkpointing"] if gc else []))
    torch.manual_seed(0)
    model = load_model(cfg, resolve_model(cfg.model.model)).train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq))

    def step() -> float:
        t0 = time.perf_counter()
        token_loss_sum(model(input_ids=ids).logits, ids).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    step()
    before = _kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    times = [step() for _ in range(steps)]
    return {"peak_mib": (_kib("VmHWM") - before) / 1024, "step_s": statistics.median(times)}


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
            p = subprocess.run([sys.executable, __file__, "--child", method, str(int(gc)), str(a.batch), str(a.seq),
                                str(a.steps)], capture_output=True, text=True, cwd=ROOT)
            line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                raise SystemExit(p.stderr[-3000:])
            got = json.loads(line[7:])
            row["gc" if gc else "no_gc"] = got
            print(method, "gc" if gc else "no gc", got, flush=True)
        row["memory_saved"] = 1 - row["gc"]["peak_mib"] / row["no_gc"]["peak_mib"]
        row["time_cost"] = row["gc"]["step_s"] / row["no_gc"]["step_s"] - 1
        rows.append(row)
    out = ROOT / "benchmarks"
    out.mkdir(exist_ok=True)
    (out / "checkpointing.json").write_text(json.dumps({"model": "SmolLM2-135M-Instruct", "dtype": "float32", "rows": rows}, indent=2))
    md = ["# Gradient checkpointing: step peak memory vs step time (SmolLM2-135M-Instruct, fp32, CPU)", "",
          "Reproduce: `python scripts/bench_checkpointing.py` (method in its docstring).", "",
          "| method | batch x seq | peak MiB no gc | peak MiB gc | memory saved | step s no gc | step s gc | time added |",
          "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['method']} | {r['batch']} x {r['seq']} | {r['no_gc']['peak_mib']:.0f} | {r['gc']['peak_mib']:.0f} | "
                  f"{r['memory_saved']:.0%} | {r['no_gc']['step_s']:.2f} | {r['gc']['step_s']:.2f} | {r['time_cost']:+.0%} |")
    (out / "checkpointing.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        m, g, b, s, n = sys.argv[2:7]
        print("RESULT " + json.dumps(child(m, bool(int(g)), int(b), int(s), int(n))))
    else:
        main()
