"""Where ZeRO-3's slow early step goes: each step's time, and inside it DeepSpeed's
parameter fetches (all-gathers, prefetch), releases, gradient reduce-scatters and optimizer step.

The toolkit's own loop, as a user runs it: `torchrun --nproc_per_node 2 finetune.py` (gloo, fp32 CPU,
OMP_NUM_THREADS=1 per rank), SmolLM2-135M-Instruct (the embedded default model), LoRA (`--method`), the builtin
dates records written to a jsonl (so no exact-match generation runs before training), seq-len and
micro-batch from the flags, `--max-steps` steps, a metrics record per step. Each rank runs
`finetune.main` under timers wrapped around DeepSpeed 0.19's functions (wall seconds per step,
nested: `fetch` is inside `forward` and `backward`); a step's own time is the toolkit's
`train.loop.one_step`. Cases: ZeRO-3 as the toolkit writes its JSON, ZeRO-3 with a DeepSpeed setting
changed (`--case NAME=JSON`, a --deepspeed file), and FSDP2 for comparison (step times only).

    python -m benchmarks.zero3_first_steps            # writes benchmarks/zero3_first_steps.{json,md}
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from benchmarks.common import BENCH, ROOT, cpu_device, md_table, read_metrics, write_pair

# DeepSpeed function -> the name its time is reported under (module, class, attribute)
TIMED = {
    "forward": ("deepspeed.runtime.engine", "DeepSpeedEngine", "forward"),
    "backward": ("deepspeed.runtime.engine", "DeepSpeedEngine", "backward"),
    "optimizer": ("deepspeed.runtime.engine", "DeepSpeedEngine", "step"),
    "fetch": ("deepspeed.runtime.zero.partitioned_param_coordinator", "PartitionedParameterCoordinator",
              "fetch_sub_module"),
    "all_gather": ("deepspeed.runtime.zero.partitioned_param_coordinator", "PartitionedParameterCoordinator",
                   "_PartitionedParameterCoordinator__all_gather_params"),
    "release": ("deepspeed.runtime.zero.partitioned_param_coordinator", "PartitionedParameterCoordinator",
                "release_sub_module"),
    "reduce_grads": ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3",
                     "_DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads"),
    "trace_reset": ("deepspeed.runtime.zero.partitioned_param_coordinator", "PartitionedParameterCoordinator",
                    "reset_step"),
}


def install_timers(per_step: dict) -> None:
    """Wrap each TIMED function and the toolkit's one_step: seconds and calls, keyed by step (0 =
    before the first step: loading, zero.Init, engine set-up)."""
    import importlib

    import toolkit.train.loop as loop

    step = {"i": 0}

    def timed(name, fn, opens_step=False):
        def wrapper(*args, **kwargs):
            if opens_step:
                step["i"] += 1
            t0, c0 = time.perf_counter(), time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                cell = per_step[step["i"]].setdefault(name, [0.0, 0])
                cell[0] += time.perf_counter() - t0
                cell[1] += 1
                if opens_step:  # this process's CPU seconds: less sensitive to a shared machine than wall time
                    per_step[step["i"]]["step_cpu"] = [time.process_time() - c0, 1]
        return wrapper

    for name, (module, cls, attr) in TIMED.items():
        klass = getattr(importlib.import_module(module), cls)
        setattr(klass, attr, timed(name, getattr(klass, attr)))
    loop.one_step = timed("step", loop.one_step, opens_step=True)
    coordinator = importlib.import_module("deepspeed.runtime.zero.partitioned_param_coordinator")
    klass = coordinator.PartitionedParameterCoordinator
    klass._invalidate_trace = timed("trace_invalidated", klass._invalidate_trace)


def rank_main(out: Path, argv: list[str]) -> None:
    """One rank of a case: finetune.main under the timers, then this rank's figures as JSON."""
    per_step: dict = defaultdict(dict)
    install_timers(per_step)
    import finetune

    finetune.main(argv)
    rank = int(os.environ.get("RANK", "0"))
    (out / f"timers_rank{rank}.json").write_text(json.dumps({str(k): v for k, v in sorted(per_step.items())}))
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)  # as finetune.py


def run_case(name: str, flags: list[str], common: list[str], work: Path) -> dict:
    out = work / name
    out.mkdir(parents=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        "-m", "benchmarks.zero3_first_steps", "--rank-run", str(out), "--", *common, "--output-dir",
                        str(out / "run"), *flags],
                       cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{p.stderr[-3000:]}")
    records = [r for r in read_metrics(out / "run") if "elapsed_s" in r]
    elapsed = [r["elapsed_s"] for r in records]
    step_s = [b - a for a, b in zip([0.0, *elapsed], elapsed)]
    timers = json.loads((out / "timers_rank0.json").read_text())
    return {"flags": flags, "launch_wall_s": round(wall, 1), "step_s": [round(s, 2) for s in step_s],
            "rank0_timers": {k: {n: [round(v[0], 2), v[1]] for n, v in t.items()} for k, t in timers.items()}}


def render(results: dict, args) -> list[str]:
    lines = [f"# ZeRO-3's first steps on CPU ({cpu_device()}, 2 gloo ranks, 1 thread each)", "",
             f"SmolLM2-135M-Instruct, {args.method}, fp32, seq-len {args.seq_len}, micro-batch {args.micro_batch}, "
             f"{args.steps} steps; `{args.command}`. Seconds per step from the run's "
             "metrics.jsonl (`elapsed_s`); inside a step, rank 0's seconds in DeepSpeed's functions "
             "(nested: fetch and release are inside forward and backward; step_cpu: rank 0's CPU seconds). The machine "
             "was shared with other work: compare within a row, and rows of one run.", ""]
    steps = range(1, args.steps + 1)
    lines += md_table(["case", *[f"step {i}" for i in steps]],
                      [[name, *[f"{s:.1f}" for s in r["step_s"]]] for name, r in results.items()])
    lines += ["", "Rank 0's CPU seconds per step (what the shared machine disturbs least): step 2, the median of "
              "steps 3 on, and step 2's seconds in `release_sub_module`:", ""]
    rows = []
    for name, r in results.items():
        t = r["rank0_timers"]
        cpu = [t[str(i)]["step_cpu"][0] for i in steps if "step_cpu" in t.get(str(i), {})]
        if len(cpu) == len(steps):
            rows.append([name, f"{cpu[1]:.1f}", f"{statistics.median(cpu[2:]):.1f}",
                         f"{t['2'].get('release', [0.0])[0]:.1f}" if "release" in t["2"] else "-"])
    lines += md_table(["case", "step 2 CPU s", "steps 3+ CPU s (median)", "step 2 release s"], rows)
    for name, r in results.items():
        if not any("fetch" in t for t in r["rank0_timers"].values()):
            continue
        lines += ["", f"## {name}: rank 0, seconds (calls) per step", ""]
        names = ["step", "step_cpu", "forward", "backward", "fetch", "all_gather", "release", "reduce_grads",
                 "optimizer", "trace_reset", "trace_invalidated"]
        rows = []
        for n in names:
            cells = []
            for i in ["0", *map(str, steps)]:
                v = r["rank0_timers"].get(i, {}).get(n)
                cells.append("" if v is None else f"{v[0]:.2f} ({v[1]})")
            rows.append([n, *cells])
        lines += md_table(["timer", "set-up", *[f"step {i}" for i in steps]], rows)
    return lines


def main() -> None:
    if "--rank-run" in sys.argv:
        i = sys.argv.index("--rank-run")
        rank_main(Path(sys.argv[i + 1]), sys.argv[sys.argv.index("--") + 1:])
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--method", default="lora", choices=("lora", "full"))
    ap.add_argument("--case", action="append", default=[],
                    help="NAME=JSON: ZeRO-3 with these zero_optimization settings (a --deepspeed file)")
    ap.add_argument("--no-fsdp", action="store_true")
    ap.add_argument("--repeat", type=int, default=1, help="run the cases this many times, interleaved")
    ap.add_argument("--out", default=str(BENCH / "zero3_first_steps"))
    args = ap.parse_args()
    args.command = "python -m benchmarks.zero3_first_steps " + " ".join(
        a if a.replace("-", "").replace("_", "").isalnum() else f"'{a}'" for a in sys.argv[1:])
    from toolkit.data.builtin import builtin_records
    from toolkit.layout.deepspeed import deepspeed_config

    work = Path(tempfile.mkdtemp(prefix="bench_zero3_"))
    data = work / "dates.jsonl"
    data.write_text("".join(json.dumps({"messages": r["messages"]}) + "\n" for r in builtin_records("dates")))
    common = ["--dataset", str(data), "--max-steps", str(args.steps), "--log-every", "1", "--seq-len",
              str(args.seq_len), "--micro-batch-size", str(args.micro_batch), "--mixed-precision", "no",
              "--method", args.method, "--seed", "0"]
    cases: dict[str, list[str]] = {"zero3": ["--zero-stage", "3"]}
    for spec in args.case:
        name, _, settings = spec.partition("=")
        ds = deepspeed_config(3, overlap_comm=False)
        ds["zero_optimization"].update(json.loads(settings))
        path = work / f"{name}.json"
        path.write_text(json.dumps(ds))
        cases[name] = ["--deepspeed", str(path)]
    if not args.no_fsdp:
        cases["fsdp"] = ["--fsdp"]
    results = {}
    for r in range(1, args.repeat + 1):
        for name, flags in cases.items():
            key = name if args.repeat == 1 else f"{name} #{r}"
            results[key] = run_case(key.replace(" #", "_"), flags, common, work)
            print(key, results[key]["step_s"], flush=True)
    write_pair(args.out, {"device": cpu_device(), "args": vars(args), "cases": results}, render(results, args))


if __name__ == "__main__":
    main()
