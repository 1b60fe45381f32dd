"""Data at scale: time to the first training step and peak RSS, the prepared-data path (tokenized once
into the cache by `Dataset.map`, memory-mapped after) against today's per-example path.

GSM8K's alpaca rows (`../shared/data/gsm8k_train_alpaca.json`) repeated and shuffled to N examples,
as JSONL; SmolLM2's tokenizer (the embedded default's) on a config-built 2-block Llama (hidden 64),
so the model is small and the data is what is measured; `finetune.py --max-steps 1 --seq-len 256
--method full`, launched as one process or `torchrun --nproc_per_node 2`. For each N and rank count:

- cold: the toolkit's data cache and datasets' own cache emptied first (`--data-workers` default:
  the node's cores, one process builds while the other rank waits);
- warm: the same run again;
- today: `finetune.py` of `--baseline-ref` (the commit before the prepared-data path) from a git
  worktree, with datasets' JSON cache warm (left by the cold run): its best case.

Time to first step: from launch to the moment the run's step-1 record appears in metrics.jsonl
(polled every 50 ms; the final save after it is not counted). Peak RSS: the largest of any process
of the launch (ranks, torchrun, tokenizing workers), `getrusage(RUSAGE_CHILDREN)` read by a fresh
wrapper process per run; "beyond the model" subtracts a warm run on 200 examples at the same rank
count. Runs are sequential; timings are as noisy as the machine (state it with the results).

    python -m benchmarks.data                       # writes benchmarks/data.{json,md}
    python -m benchmarks.data --sizes 10000 --ranks 1 --out /tmp/bench_data   # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import BENCH, ROOT, child_result, save_llama, write_pair

GSM8K = ROOT.parent / "shared" / "data" / "gsm8k_train_alpaca.json"
BASELINE_REF = "84353c7"  # main before the tokenized table (a21ce99): records -> Python lists, every run

# Run in a fresh interpreter so getrusage(RUSAGE_CHILDREN) sees this launch only.
WRAPPER = r"""
import json, os, resource, subprocess, sys, time
cmd, metrics, log = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
t0 = time.perf_counter()
with open(log, "w") as out:
    p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    first = None
    while p.poll() is None:
        if first is None and os.path.exists(metrics) and '"step": 1' in open(metrics).read():
            first = time.perf_counter() - t0
        time.sleep(0.05)
print("RESULT " + json.dumps({"rc": p.returncode, "first_step_s": first, "wall_s": time.perf_counter() - t0,
                              "peak_rss_mib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}))
"""


def write_data(n: int, path: Path, source: Path = GSM8K) -> Path:
    rows = json.loads(source.read_text())
    rng = random.Random(0)
    with path.open("w") as f:
        for _ in range(n):
            f.write(json.dumps(rng.choice(rows)) + "\n")
    return path


def build_model(path: Path) -> Path:
    """A 2-block Llama (hidden 64) with SmolLM2's tokenizer: real tokens, a model that costs nothing."""
    from toolkit.model.load import load_tokenizer
    from toolkit.model.source import resolve_model

    tok = load_tokenizer(resolve_model("smollm2-135m-instruct"), False)
    return save_llama(path, tok, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=512,
                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)


def run(code: Path, ranks: int, model: Path, data: Path, work: Path, env: dict) -> dict:
    out = work / "out"
    shutil.rmtree(out, ignore_errors=True)
    script = str(code / "finetune.py")
    launcher = [sys.executable, script] if ranks == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks), script]
    cmd = launcher + ["--model", str(model), "--dataset", str(data), "--max-steps", "1", "--seq-len", "256",
                      "--method", "full", "--micro-batch-size", "4", "--output-dir", str(out),
                      "--overwrite-output-dir"]
    log = work / "run.log"
    result = child_result(["-c", WRAPPER, json.dumps(cmd), str(out / "metrics.jsonl"), str(log)],
                          env={**os.environ, **env, "PYTHONPATH": str(code)}, what="the launch wrapper")
    if result["rc"] != 0 or result["first_step_s"] is None:
        raise SystemExit(f"run failed ({code}, {ranks} ranks, {data.name}):\n" + log.read_text()[-3000:])
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="10000,100000,1000000")
    ap.add_argument("--ranks", default="1,2")
    ap.add_argument("--baseline-ref", default=BASELINE_REF)
    ap.add_argument("--baseline-max", type=int, default=1_000_000,
                    help="largest N today's path runs at (its RSS grows ~13 KB per example per rank)")
    ap.add_argument("--baseline-max-2ranks", type=int, default=100_000,
                    help="largest N today's path runs at with 2 ranks (two copies of its lists must fit in RAM)")
    ap.add_argument("--gsm8k", type=Path, default=GSM8K, help="GSM8K as alpaca JSON (shared/data)")
    ap.add_argument("--out", default=str(BENCH))
    a = ap.parse_args()
    sizes, rank_counts = [int(x) for x in a.sizes.split(",")], [int(x) for x in a.ranks.split(",")]
    if not a.gsm8k.is_file():
        raise SystemExit(f"{a.gsm8k} is missing: the benchmark repeats GSM8K's rows (pass --gsm8k)")
    work = Path(tempfile.mkdtemp(prefix="bench_data_"))
    baseline = work / "baseline"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(baseline), a.baseline_ref], check=True,
                   capture_output=True)
    try:
        model = build_model(work / "model")
        env = {"TOOLKIT_CACHE": str(work / "cache"), "HF_DATASETS_CACHE": str(work / "hf"), "HF_HUB_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false"}
        rows = []
        small = write_data(200, work / "data_200.jsonl", a.gsm8k)
        floor = {}
        for ranks in rank_counts:
            run(ROOT, ranks, model, small, work, env)
            floor[ranks] = run(ROOT, ranks, model, small, work, env)["peak_rss_mib"]
        for n in sizes:
            data = write_data(n, work / f"data_{n}.jsonl", a.gsm8k)
            for ranks in rank_counts:
                for path in ("cold", "warm", "today"):
                    if path == "cold":
                        for d in ("cache", "hf"):
                            shutil.rmtree(work / d, ignore_errors=True)
                    if path == "today" and n > (a.baseline_max if ranks == 1 else a.baseline_max_2ranks):
                        rows.append({"examples": n, "ranks": ranks, "path": path, "skipped": True})
                        continue
                    r = run(baseline if path == "today" else ROOT, ranks, model, data, work, env)
                    r.update(examples=n, ranks=ranks, path=path, rss_beyond_model_mib=r["peak_rss_mib"] - floor[ranks])
                    rows.append(r)
                    print(json.dumps(r), flush=True)
            data.unlink()
        write_results(Path(a.out), rows, floor, a.baseline_ref)
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(baseline)], capture_output=True)
        shutil.rmtree(work, ignore_errors=True)


def write_results(out: Path, rows: list[dict], floor: dict, ref: str) -> None:
    by = {(r["examples"], r["ranks"], r["path"]): r for r in rows}
    lines = ["# Data at scale: time to the first step and peak RSS", "",
             f"`python -m benchmarks.data`; today's path is `finetune.py` at {ref}. GSM8K alpaca rows repeated "
             "and shuffled, SmolLM2 tokenizer, seq-len 256, a 2-block hidden-64 Llama, 2-core CPU. RSS beyond the "
             "model: minus a warm 200-example run at the same rank count "
             f"({', '.join(f'{k} rank(s): {v:.0f} MiB' for k, v in floor.items())}).",
             "",
             "| examples | ranks | path | first step (s) | speed-up vs today | peak RSS (MiB) | beyond model (MiB) |",
             "|---:|---:|---|---:|---:|---:|---:|"]
    for (n, ranks, path), r in by.items():
        if r.get("skipped"):
            lines.append(f"| {n:,} | {ranks} | {path} | not run (--baseline-max-2ranks): each rank would hold "
                         "the 1-rank row's lists, for as long | | | |")
            continue
        today = by.get((n, ranks, "today"), {})
        ratio = f"{today['first_step_s'] / r['first_step_s']:.1f}x" if today.get("first_step_s") and \
            path != "today" else ""
        lines.append(f"| {n:,} | {ranks} | {path} | {r['first_step_s']:.1f} | {ratio} | {r['peak_rss_mib']:.0f} | "
                     f"{r['rss_beyond_model_mib']:.0f} |")
    write_pair(out / "data", {"baseline_ref": ref, "model_floor_rss_mib": floor, "runs": rows}, lines, indent=1,
               echo=False)


if __name__ == "__main__":
    main()
