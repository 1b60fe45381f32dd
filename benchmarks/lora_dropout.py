"""LoRA dropout 0.05 vs 0: what it costs in memory, what it changes in loss.

Three parts, each arm a fresh process:

- `quickstart`: `python finetune.py --config configs/quickstart.yaml --lora-dropout P` (builtin:dates,
  60 steps of 8): final train loss, exact match on the 64 held-out dates before and after, wall time.
- `alpaca`: `python finetune.py --dataset ../shared/data/gsm8k_train_alpaca.json` on the embedded
  default model, `--seq-len 512` (the longest GSM8K example is 490 tokens under SmolLM2's template),
  `--eval-split` held out with the run's seed, `--eval-every` during `--max-steps`, micro-batch 4,
  the default lr (2e-4) and schedule; per seed both arms see the same held-out set, data order and
  LoRA init, so the arms' difference within a seed is dropout's, and the spread of that difference
  across seeds is its noise. Eval loss at each eval, final eval loss, train loss (the run's last
  record and the token-weighted mean over its last quarter of steps), wall time, and the process's
  peak RSS (`wait4`'s ru_maxrss; it includes the eval's full logits, so it is not the step's peak).
- `memory`: (1) the planner's terms (`toolkit.planner.saved`, CUDA dtypes: a 1-byte mask) per block
  per token for SmolLM2-135M, Llama-3.2-1B and Llama-3-8B LoRA in bf16, and the whole plan from
  `python -m toolkit plan --json` at 2048 tokens x micro-batch 1 on one 80 GB GPU, with and without
  checkpointing; (2) on this CPU, the bytes autograd saves (`saved_tensors_hooks`, distinct storages,
  parameters excluded) in a forward of the embedded SmolLM2-135M-Instruct loaded by
  `toolkit.model.load.load_model` as LoRA, attributed to the decoder block running when each storage is
  first saved, fp32 and bf16 autocast, against the planner's CPU terms (there the dropout keeps a
  noise tensor of the adapter's fp32 input: 4 bytes per element, not CUDA's 1); (3) on this CPU, the
  peak RSS a LoRA training step (fp32, HF loss on full logits, 4 x 512 tokens) adds after a warm-up
  step (`reset_peak_rss`/`peak_rss_mib`), glibc told to map every block over 64 KiB on its own
  (MALLOC_MMAP_THRESHOLD_=65536) so that freed tensors leave the RSS.

Each finetune run's output folder is under `--work` (default /tmp/bench_lora_dropout), with its
stdout/stderr in run.log and its result in bench_result.json, which `--reuse` reads back instead of
running it again. Every run records a digest of finetune.py and toolkit/**/*.py: others edit the tree
while a benchmark runs, and arms compared must have run the same code.

    python -m benchmarks.lora_dropout                        # all parts (~1 h on a quiet 2-core CPU)
    python -m benchmarks.lora_dropout --parts memory --reuse  # one part; finished runs read back
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import (BENCH, ROOT, child_result, cpu_device, md_table, peak_rss_mib, print_result,
                           read_metrics, reset_peak_rss, write_pair)

DROPOUTS = (0.0, 0.05)
ALPACA = ROOT.parent / "shared" / "data" / "gsm8k_train_alpaca.json"
TOKENS = 2048  # the planner's sequence: tokens x micro-batch 1

# Public configs (config.json on the hub), as benchmarks/gpu/gpu_acceptance.py copies them: Llama-3.2-1B is not
# a planner preset, so it is planned from this file
LLAMA_1B = dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True,
                max_position_embeddings=131072)


def tree_digest() -> str:
    """sha256 (first 12 hex) over finetune.py and toolkit/**/*.py, paths and contents."""
    h = hashlib.sha256()
    for p in sorted([ROOT / "finetune.py", *(ROOT / "toolkit").rglob("*.py")]):
        h.update(str(p.relative_to(ROOT)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:12]


# ----------------------------------------------------------------------------- finetune runs


def run_finetune(name: str, args: list[str], work: Path, reuse: bool) -> dict:
    """`python finetune.py ARGS --output-dir WORK/NAME` as a fresh process: wall time, peak RSS,
    load average around it, summary.json and metrics.jsonl."""
    out = work / name
    saved = out / "bench_result.json"
    if reuse and saved.exists():
        got = json.loads(saved.read_text())
        print(f"{name}: reused {saved}", flush=True)
        return got
    out.mkdir(parents=True, exist_ok=True)
    argv = ["finetune.py", *args, "--output-dir", str(out), "--overwrite-output-dir"]
    digest, load0 = tree_digest(), os.getloadavg()
    print(f"{name}: python {' '.join(argv)}", flush=True)
    t0 = time.perf_counter()
    with open(out / "run.log", "w") as log:
        p = subprocess.Popen([sys.executable, *argv], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                             env={**os.environ, "TQDM_DISABLE": "1"})
        _, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    rc = os.waitstatus_to_exitcode(status)
    p.returncode = rc  # reaped by wait4: tell Popen
    got = {"name": name, "command": "python " + " ".join(argv), "rc": rc, "wall_s": round(wall, 1),
           "peak_rss_mib": round(usage.ru_maxrss / 1024), "loadavg_before": [round(x, 2) for x in load0],
           "loadavg_after": [round(x, 2) for x in os.getloadavg()], "tree_digest": digest,
           "tree_digest_after": tree_digest()}
    if rc != 0:
        got["error"] = (out / "run.log").read_text()[-3000:]
        print(f"{name}: FAILED rc {rc}\n{got['error']}", flush=True)
        return got
    summary = json.loads((out / "summary.json").read_text())
    records = read_metrics(out)
    train = [r for r in records if "loss" in r and "eval_loss" not in r]
    got.update(summary=summary, final_loss=summary["final_loss"], train_seconds=summary["train_seconds"],
               train_records=[{k: r[k] for k in ("step", "loss", "tokens", "tokens_per_sec", "elapsed_s")}
                              for r in train],
               evals=[{"step": r["step"], "eval_loss": r["eval_loss"]} for r in records if "eval_loss" in r])
    steps = summary["steps"]
    tail = [r for r in train if r["step"] > steps * 3 // 4]  # token-weighted mean over the last quarter
    weights, last_tokens = [], max([r["tokens"] for r in train if r["step"] <= steps * 3 // 4] or [0])
    for r in tail:
        weights.append(r["tokens"] - last_tokens)
        last_tokens = r["tokens"]
    got["train_loss_last_quarter"] = sum(w * r["loss"] for w, r in zip(weights, tail)) / sum(weights) if tail else None
    saved.write_text(json.dumps(got, indent=2))
    print(f"{name}: rc 0, {wall:.0f} s, final loss {got['final_loss']:.4f}, evals "
          f"{[round(e['eval_loss'], 4) for e in got['evals']]}", flush=True)
    return got


def quickstart(work: Path, reuse: bool) -> list[dict]:
    rows = []
    for p in DROPOUTS:
        r = run_finetune(f"quickstart_p{p}", ["--config", "configs/quickstart.yaml", "--lora-dropout", str(p)],
                         work, reuse)
        rows.append({"dropout": p, **r})
    return rows


def alpaca(work: Path, reuse: bool, seeds: list[int], steps: int, eval_every: int, eval_split: float) -> list[dict]:
    rows = []
    for seed in seeds:
        for p in DROPOUTS:
            args = ["--dataset", str(ALPACA), "--seq-len", "512", "--eval-split", str(eval_split),
                    "--eval-every", str(eval_every), "--micro-batch-size", "4", "--max-steps", str(steps),
                    "--seed", str(seed), "--lora-dropout", str(p)]
            r = run_finetune(f"alpaca_s{seed}_p{p}", args, work, reuse)
            rows.append({"dropout": p, "seed": seed, **r})
    return rows


# ----------------------------------------------------------------------------- memory


def planner_terms(cfg: dict) -> dict:
    """Per block per token under bf16 LoRA on CUDA (1-byte mask): the block's saved bytes with and
    without dropout, and the mask's share."""
    from toolkit.planner import saved
    from toolkit.planner.params import adapted_inputs

    h, i, heads = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * h // heads
    adapted = adapted_inputs(cfg, "all-linear")
    out = {}
    for device in ("cuda", "cpu"):
        d = saved.dtypes("lora", "bf16", device)
        on, off = (saved.block(h, i, kv, heads, d, adapted, 16, p) for p in (0.05, 0.0))
        out[device] = {"block_bytes_per_token_dropout": on, "block_bytes_per_token_no_dropout": off,
                       "mask_bytes_per_token": on - off, "mask_share_of_block": (on - off) / on}
    return out


def plan_json(model_args: list[str], dropout: float, checkpointing: str) -> dict:
    """`python -m toolkit plan ... --json`: the one-GPU plain layout's bytes."""
    argv = ["-m", "toolkit", "plan", *model_args, "--method", "lora", "--mixed-precision", "bf16",
            "--lora-dropout", str(dropout), "--seq-len", str(TOKENS), "--micro-batch-size", "1",
            "--gpus-per-node", "1", "--gpu-memory", "80GB", "--gradient-checkpointing", checkpointing, "--json"]
    p = subprocess.run([sys.executable, *argv], capture_output=True, text=True, cwd=ROOT)
    if p.returncode != 0:
        raise RuntimeError(f"plan failed: {p.stderr[-2000:]}")
    plan = json.loads(p.stdout)
    first = next(s for s in plan["strategies"] if s["name"] == "ddp")
    return {"command": "python " + " ".join(argv),
            **{k: first["bytes"][k] for k in ("activations", "allocated", "total")}}


def planner_part() -> list[dict]:
    from toolkit.planner.presets import PRESETS

    tmp = Path(tempfile.mkdtemp(prefix="bench_lora_dropout_"))
    (tmp / "llama-3.2-1b.json").write_text(json.dumps(LLAMA_1B))
    models = [("SmolLM2-135M", ["--model", "smollm2-135m"], PRESETS["smollm2-135m"]),
              ("Llama-3.2-1B", ["--model-config", str(tmp / "llama-3.2-1b.json")], LLAMA_1B),
              ("Llama-3-8B", ["--model", "llama-3-8b"], PRESETS["llama-3-8b"])]
    rows = []
    for name, args, cfg in models:
        row = {"model": name, "terms": planner_terms(cfg), "plan": {}}
        for ck in ("off", "on"):
            for p in DROPOUTS:
                row["plan"][f"checkpointing_{ck}_p{p}"] = plan_json(args, p, ck)
        rows.append(row)
        print(name, json.dumps(row["terms"]["cuda"]), flush=True)
    return rows


def child_saved(precision: str, dropout: float, seq: int) -> dict:
    """Bytes autograd saves in a forward of the embedded model loaded as LoRA, per decoder block."""
    import torch

    from toolkit.config import parse_config
    from toolkit.model.kernels import decoder_layers
    from toolkit.model.load import ModelShape, load_model
    from toolkit.model.source import resolve_model
    from toolkit.parallel.parallelize import Parallelism, parallelize

    cfg = parse_config(["--method", "lora", "--mixed-precision", precision, "--lora-dropout", str(dropout),
                        "--output-dir", "/nonexistent-bench-dir"])
    torch.manual_seed(0)
    model = parallelize(load_model(cfg, resolve_model(cfg.model.model)), Parallelism(ModelShape.of(cfg)))[0].train()
    base = model.get_base_model()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    layers = decoder_layers(model)
    current: list[int | None] = [None]
    for k, layer in enumerate(layers):
        layer.register_forward_pre_hook(lambda m, a, k=k: current.__setitem__(0, k))
        layer.register_forward_hook(lambda m, a, o: current.__setitem__(0, None))
    seen: dict[int, tuple[int | None, int]] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen.setdefault(st.data_ptr(), (current[0], st.nbytes()))
        return t

    ids = torch.randint(10, 10000, (1, seq), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        base.model(input_ids=ids)
    per_block = [sum(n for k, n in seen.values() if k == b) for b in range(len(layers))]
    return {"per_block": per_block, "outside": sum(n for k, n in seen.values() if k is None),
            "total": sum(n for _, n in seen.values()), "tokens": seq, "layers": len(layers)}


def child_step(dropout: float, batch: int, seq: int) -> dict:
    """Peak RSS a LoRA training step (fp32, HF loss) adds, after one warm-up step (the first step's
    one-time allocations are not the dropout's). Run with MALLOC_MMAP_THRESHOLD_ at 64 KiB, so every
    tensor of more than 64 KiB is its own mapping, returned to the OS when freed: the RSS after the
    warm-up holds no freed activations, and the rise is the step's live memory."""
    import torch

    from toolkit.config import parse_config
    from toolkit.model.load import ModelShape, load_model
    from toolkit.model.source import resolve_model
    from toolkit.parallel.parallelize import Parallelism, parallelize

    cfg = parse_config(["--method", "lora", "--mixed-precision", "no", "--lora-dropout", str(dropout),
                        "--output-dir", "/nonexistent-bench-dir"])
    torch.manual_seed(0)
    model = parallelize(load_model(cfg, resolve_model(cfg.model.model)), Parallelism(ModelShape.of(cfg)))[0].train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    ids = torch.randint(10, 10000, (batch, seq), generator=torch.Generator().manual_seed(0))

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    before = reset_peak_rss()
    step()
    return {"peak_mib": peak_rss_mib(before)}


def measured_part(seq: int, step_batch: int, step_seq: int) -> dict:
    from toolkit.planner import saved
    from toolkit.planner.params import adapted_inputs
    from toolkit.planner.presets import PRESETS

    cfg = PRESETS["smollm2-135m"]
    h, i, heads = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * h // heads
    adapted = adapted_inputs(cfg, "all-linear")
    out: dict = {"saved": {}, "step": {}}
    for precision in ("no", "bf16"):
        d = saved.dtypes("lora", precision, "cpu")
        for p in DROPOUTS:
            got = child_result(["-m", "benchmarks.lora_dropout", "--child-saved", precision, str(p), str(seq)],
                               what=f"saved {precision} p{p}")
            mid = got["per_block"][got["layers"] // 2]
            got["mid_block_bytes_per_token"] = mid / seq
            got["predicted_block_bytes_per_token_cpu"] = saved.block(h, i, kv, heads, d, adapted, 16, p)
            out["saved"][f"{precision}_p{p}"] = got
            print(f"saved {precision} p{p}: mid block {mid / seq:.0f} B/token (planner, CPU dtypes: "
                  f"{got['predicted_block_bytes_per_token_cpu']}), total {got['total'] / 2**20:.1f} MiB", flush=True)
    for p in DROPOUTS:
        got = child_result(["-m", "benchmarks.lora_dropout", "--child-step", str(p), str(step_batch), str(step_seq)],
                           what=f"step p{p}", env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"})
        out["step"][f"p{p}"] = {"batch": step_batch, "seq": step_seq, **got}
        print(f"step p{p}: peak +{got['peak_mib']:.0f} MiB", flush=True)
    return out


# ----------------------------------------------------------------------------- report


def spread(xs: list[float]) -> float | None:
    return max(xs) - min(xs) if len(xs) > 1 else None


def render(res: dict) -> list[str]:
    md = ["# LoRA dropout: 0.05 vs 0, memory and loss (issue 34 item 6)", "",
          f"Machine: {res['machine']}; torch {res['versions']['torch']}, "
          f"transformers {res['versions']['transformers']}, peft {res['versions']['peft']}, "
          f"Python {res['versions']['python']}. {res['date']}. Reproduce: "
          "`python -m benchmarks.lora_dropout` (method in its docstring). Every finetune run is a fresh "
          "`python finetune.py` process; fp32 on this CPU.", ""]
    if "memory" in res:
        m = res["memory"]
        md += ["## Memory: the planner's terms (bf16 LoRA r 16, all linear layers, CUDA: 1-byte mask)", "",
               f"Per block per token (`toolkit.planner.saved.block`), and the whole model from `python -m toolkit "
               f"plan --json` (one 80 GB GPU, {TOKENS} tokens x micro-batch 1, layout `ddp`):", ""]
        rows = []
        for r in m["planner"]:
            t, pl = r["terms"]["cuda"], r["plan"]
            a_on, a_off = pl["checkpointing_off_p0.05"]["activations"], pl["checkpointing_off_p0.0"]["activations"]
            al_on, al_off = pl["checkpointing_off_p0.05"]["allocated"], pl["checkpointing_off_p0.0"]["allocated"]
            c_on, c_off = pl["checkpointing_on_p0.05"]["activations"], pl["checkpointing_on_p0.0"]["activations"]
            rows.append([r["model"], f"{t['block_bytes_per_token_no_dropout']:,}",
                         f"{t['block_bytes_per_token_dropout']:,}",
                         f"{t['mask_share_of_block']:.1%}", f"{a_off / 2**30:.2f} / {a_on / 2**30:.2f}",
                         f"{1 - a_off / a_on:.1%}", f"{al_off / 2**30:.2f} / {al_on / 2**30:.2f}",
                         f"{1 - al_off / al_on:.1%}", f"{c_off / 2**30:.2f} / {c_on / 2**30:.2f}"])
        md += md_table(["model", "block B/token, p 0", "block B/token, p 0.05", "mask share of block",
                        "activations GiB p 0 / 0.05", "saved by p 0", "allocated GiB p 0 / 0.05", "saved by p 0",
                        "activations GiB with checkpointing, p 0 / 0.05"], rows)
        md += ["", "## Memory: measured on this CPU (SmolLM2-135M-Instruct LoRA, `toolkit.model.load.load_model`)", "",
               f"Bytes autograd saves in one forward of {m['measured']['saved']['no_p0.0']['tokens']} tokens "
               "(`saved_tensors_hooks`, distinct storages, parameters excluded), the middle block per token, "
               "against the planner's terms with the CPU's mask width (the dropout's noise tensor of the adapter's "
               "fp32 input: 4 bytes per element):", ""]
        rows = []
        for prec in ("no", "bf16"):
            off, on = m["measured"]["saved"][f"{prec}_p0.0"], m["measured"]["saved"][f"{prec}_p0.05"]
            rows.append(["fp32" if prec == "no" else "bf16 autocast",
                         f"{off['mid_block_bytes_per_token']:,.0f} ({off['predicted_block_bytes_per_token_cpu']:,})",
                         f"{on['mid_block_bytes_per_token']:,.0f} ({on['predicted_block_bytes_per_token_cpu']:,})",
                         f"{1 - off['mid_block_bytes_per_token'] / on['mid_block_bytes_per_token']:.1%}",
                         f"{off['total'] / 2**20:,.1f} / {on['total'] / 2**20:,.1f}",
                         f"{1 - off['total'] / on['total']:.1%}"])
        md += md_table(["precision", "mid block B/token p 0 (planner)", "p 0.05 (planner)", "saved by p 0",
                        "whole forward MiB p 0 / 0.05", "saved by p 0"], rows)
        st = m["measured"]["step"]
        b, s = st["p0.0"]["batch"], st["p0.0"]["seq"]
        md += ["", f"Peak RSS a training step adds (fp32, HF loss on full logits, {b} x {s} tokens, after a warm-up "
               f"step, MALLOC_MMAP_THRESHOLD_=65536): p 0: {st['p0.0']['peak_mib']:,.0f} MiB, p 0.05: "
               f"{st['p0.05']['peak_mib']:,.0f} MiB ({1 - st['p0.0']['peak_mib'] / st['p0.05']['peak_mib']:.1%} less "
               "at p 0).", ""]
    if "quickstart" in res:
        md += ["## Quickstart (`configs/quickstart.yaml`: builtin:dates, 60 steps of 8, lr 1e-3, seed 42)", ""]
        rows = []
        for r in res["quickstart"]:
            if r["rc"] != 0:
                rows.append([r["dropout"], f"failed, rc {r['rc']}", "", "", "", "", ""])
                continue
            s = r["summary"]
            rows.append([r["dropout"], f"{r['final_loss']:.4f}", f"{s['exact_match_before']:.0%}",
                         f"{s['exact_match_after']:.0%} ({round(s['exact_match_after'] * 64)}/64)",
                         f"{r['train_seconds']:.0f}", f"{r['wall_s']:.0f}", f"{r['peak_rss_mib']:,}"])
        md += md_table(["dropout", "final train loss", "exact match before", "after", "train s", "wall s",
                        "peak RSS MiB"], rows)
        md += ["", "Commands: " + "; ".join(f"`{r['command']}`" for r in res["quickstart"]), ""]
    if "alpaca" in res:
        a = res["alpaca_settings"]
        md += [f"## GSM8K alpaca ({a['steps']} steps x micro-batch 4, seq-len 512, eval on {a['eval_split']:.0%} "
               f"held out = {a['n_eval']} examples every {a['eval_every']} steps, lr 2e-4 cosine)", ""]
        ok = [r for r in res["alpaca"] if r["rc"] == 0]
        steps = sorted({e["step"] for r in ok for e in r["evals"]})
        rows = []
        for r in res["alpaca"]:
            if r["rc"] != 0:
                rows.append([r["seed"], r["dropout"], f"failed, rc {r['rc']}"] + [""] * (len(steps) + 3))
                continue
            ev = {e["step"]: e["eval_loss"] for e in r["evals"]}
            rows.append([r["seed"], r["dropout"], *(f"{ev[s]:.4f}" if s in ev else "" for s in steps),
                         f"{r['final_loss']:.4f}", f"{r['train_loss_last_quarter']:.4f}", f"{r['wall_s']:.0f}",
                         f"{r['peak_rss_mib']:,}"])
        md += md_table(["seed", "dropout", *(f"eval loss @{s}" for s in steps), "train loss (last record)",
                        "train loss (last quarter)", "wall s", "peak RSS MiB"], rows)
        d = res["alpaca_differences"]
        if d["per_seed"]:
            md += ["", "Differences, dropout 0.05 minus 0 (same seed: same held-out set, data order and init):", ""]
            md += md_table(["seed", "final eval loss", "train loss (last quarter)"],
                           [[x["seed"], f"{x['eval']:+.4f}", f"{x['train_tail']:+.4f}"] for x in d["per_seed"]])
            if len(d["per_seed"]) > 1:
                md += ["", f"Seed-to-seed spread (max - min over seeds) of the final eval loss: p 0 "
                       f"{d['eval_spread_p0.0']:.4f}, p 0.05 {d['eval_spread_p0.05']:.4f} (the seed also draws the "
                       f"held-out set); of the paired difference: {d['diff_spread']:.4f}."]
        md += ["", "Commands: " + "; ".join(f"`{r['command']}`" for r in res["alpaca"]), ""]
    md += ["## Runs", "", "Load average (1/5/15 min) before and after each finetune run on this shared machine, "
           "and the digest of finetune.py + toolkit/**/*.py before/after it (others edit the tree meanwhile):", ""]
    runs = res.get("quickstart", []) + res.get("alpaca", [])
    md += md_table(["run", "rc", "load before", "load after", "tree before", "tree after"],
                   [[r["name"], r["rc"], "/".join(map(str, r["loadavg_before"])),
                     "/".join(map(str, r["loadavg_after"])), r["tree_digest"], r["tree_digest_after"]] for r in runs])
    return md


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", default="memory,quickstart,alpaca")
    ap.add_argument("--work", default="/tmp/bench_lora_dropout")
    ap.add_argument("--reuse", action="store_true", help="read back finished runs from --work")
    ap.add_argument("--seeds", default="42,43")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--eval-split", type=float, default=0.02)
    ap.add_argument("--saved-seq", type=int, default=512)
    a = ap.parse_args()
    import peft
    import torch
    import transformers

    parts = a.parts.split(",")
    work = Path(a.work)
    stem = BENCH / "lora_dropout"
    res = json.loads(Path(f"{stem}.json").read_text()) if a.reuse and Path(f"{stem}.json").exists() else {}
    res.update(machine=f"{cpu_device()}, {platform.processor() or platform.machine()}",
               versions={"torch": torch.__version__, "transformers": transformers.__version__,
                         "peft": peft.__version__, "python": platform.python_version()},
               date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    if "memory" in parts:
        res["memory"] = {"planner": planner_part(), "measured": measured_part(a.saved_seq, 4, 512)}
    if "quickstart" in parts:
        res["quickstart"] = quickstart(work, a.reuse)
    if "alpaca" in parts:
        seeds = [int(s) for s in a.seeds.split(",")]
        n = len(json.loads(ALPACA.read_text()))
        res["alpaca_settings"] = {"dataset": str(ALPACA), "records": n, "steps": a.steps, "eval_every": a.eval_every,
                                  "eval_split": a.eval_split, "n_eval": max(1, round(n * a.eval_split)), "seeds": seeds}
        rows = alpaca(work, a.reuse, seeds, a.steps, a.eval_every, a.eval_split)
        res["alpaca"] = rows
        ok = {(r["seed"], r["dropout"]): r for r in rows if r["rc"] == 0}
        per_seed = [{"seed": s, "eval": ok[s, 0.05]["evals"][-1]["eval_loss"] - ok[s, 0.0]["evals"][-1]["eval_loss"],
                     "train_tail": ok[s, 0.05]["train_loss_last_quarter"] - ok[s, 0.0]["train_loss_last_quarter"]}
                    for s in seeds if (s, 0.0) in ok and (s, 0.05) in ok]
        diffs = {"per_seed": per_seed, "diff_spread": spread([x["eval"] for x in per_seed])}
        for p in DROPOUTS:
            diffs[f"eval_spread_p{p}"] = spread([ok[s, p]["evals"][-1]["eval_loss"] for s in seeds if (s, p) in ok])
        res["alpaca_differences"] = diffs
    write_pair(stem, res, render(res))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child-saved":
        print_result(child_saved(sys.argv[2], float(sys.argv[3]), int(sys.argv[4])))
    elif len(sys.argv) > 1 and sys.argv[1] == "--child-step":
        print_result(child_step(float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])))
    else:
        main()
