"""GRPO on the CPU, the toolkit's `--objective grpo` beside TRL's GRPOTrainer: peak resident memory, seconds
per step and generation tokens/s on the same model, prompts, reward and settings; and where in a step the
toolkit's peak is (its phases).

    python -m benchmarks.grpo_cpu                                   # both parts, ~30 min on 2 loaded cores
    python -m benchmarks.grpo_cpu --parts compare --pairs 3 --batches 8x1,32x1
    python -m benchmarks.grpo_cpu --parts phases --tree before=/tmp/old-checkout --tree after=.

Writes benchmarks/grpo_cpu.md and .json (a part not run keeps its last figures from the .json).

compare: the embedded SmolLM2-135M-Instruct, LoRA r 16 / alpha 32 on every linear layer, fp32, 8
generations of at most 16 tokens, each of `--batches` (micro-batch x accumulation: 8x1 is 8 completions a
step, one prompt's; 8x4 the quickstart's 32, sampled together, trained 8 at a time), the same learning
rate, linear schedule without warm-up, temperature and seed; beta 0 (no reference model, both
defaults). Prompts: builtin:arithmetic's training questions as one-turn conversations (both trainers
render them with the model's chat template); reward: the TRL-signature `math_answer` of the TRL driver
(benchmarks/gpu/grpo_trainer_user.py), the same file the toolkit is given as `--reward path.py:math_answer`.
Everything else is each trainer's default: TRL's GRPOConfig turns gradient checkpointing on, the
toolkit's config leaves it off. Each run is a fresh process, toolkit and TRL interleaved (toolkit, TRL,
toolkit, TRL, ...), `--steps` steps each, with each library's default torch threads (every core) unless
`--threads`. Figures:
- peak RSS: the process's resident high-water mark (the kernel's VmHWM), start-up included;
- steady peak RSS: the mark reset when the warm-up's last step has ended (`--warmup` steps), read when the
  last step has ended: the peak of the steady steps alone (the toolkit's final save and its integrity check,
  which reloads the saved model beside the trained one, come after);
- s/step: the median over the steady steps of a whole optimizer step (sampling, scoring, forward,
  backward, update), start of one step's batch to the next's (TRL: its callback's step ends);
- generation tokens/s: completion tokens (EOS included) over the seconds of the call that samples them
  (toolkit: `Rollouts.sample`; TRL: `_generate_single_turn`), steady steps;
and the ratios toolkit / TRL of each interleaved pair (median, min-max).

phases: `finetune.py --config configs/grpo_quickstart.yaml --max-steps 3` (32 completions a step, the
held-out eval before training and after), once per `--tree` (a checkout: its toolkit and config), with
the high-water mark read and reset at every phase boundary: each phase's figure is the peak resident
memory while it ran (its own stretches; a nested phase's are its own), the run's peak the largest.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from benchmarks.common import md_table, reset_peak_rss, status_kib, write_pair

ROOT = Path(__file__).resolve().parents[1]
STEM = ROOT / "benchmarks" / "grpo_cpu"
QUICKSTART = Path("configs") / "grpo_quickstart.yaml"


# ----------------------------------------------------------------------------- in the measured process


class PhasePeaks:
    """Each phase's peak resident memory: at every phase boundary the high-water mark is read, credited to
    the phase that ran since the last boundary, and reset. `first`: the phase before any other."""

    def __init__(self, first: str):
        self.stack, self.order = [first], [first]
        self.peak: dict[str, int] = {}  # KiB
        self.entry: dict[str, int] = {}  # KiB resident at the phase's first entry
        self.calls: dict[str, int] = {}

    def mark(self) -> None:
        name = self.stack[-1]
        self.peak[name] = max(self.peak.get(name, 0), status_kib("VmHWM"))
        reset_peak_rss()

    def wrap(self, fn: Callable, name: str) -> Callable:
        @functools.wraps(fn)
        def measured(*args, **kwargs):
            self.mark()
            self.stack.append(name)
            if name not in self.order:
                self.order.append(name)
                self.entry[name] = status_kib("VmRSS")
            self.calls[name] = self.calls.get(name, 0) + 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.mark()
                self.stack.pop()

        return measured

    def rows(self) -> list[dict]:
        self.mark()
        return [{"phase": n, "peak_rss_mib": self.peak.get(n, 0) / 1024, "calls": self.calls.get(n, 1),
                 "rss_at_entry_mib": self.entry[n] / 1024 if n in self.entry else None} for n in self.order]


# (object path, attribute, phase): what the phase profile wraps, in the toolkit's modules
PHASES = (("toolkit.train.loop", "set_up", "set-up (optimizer, MFU probe)"),
          ("toolkit.objectives.grpo.rollout", "eval_rewards", "eval (greedy completions of the held-out prompts)"),
          ("toolkit.objectives.grpo.rollout.Rollouts", "sample", "sampling"),
          ("toolkit.objectives.grpo.rollout.Rollouts", "score", "scoring"),
          ("toolkit.objectives.grpo.rollout.Rollouts", "micro_batches", "micro-batches (old/reference log-probs)"),
          ("toolkit.train.loop", "check_loss", "loss check (before step 1)"),
          ("toolkit.train.loop", "one_step", "step: clip, update (rest of one_step)"),
          ("toolkit.objectives.grpo.loss.GRPOLoss", "__call__", "policy forward (loss)"),
          ("torch.Tensor", "backward", "backward"),
          ("toolkit.train.loop", "finish", "the loop's end"),
          ("toolkit.train.checkpoint", "save_final", "final save"),
          ("toolkit.train.integrity", "verify_saved", "integrity check (reloads the saved model)"))


def resolve(path: str) -> Any:
    """The object at a dotted path: a module, or a class inside one."""
    import importlib

    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(path)


def child(a: argparse.Namespace, argv: list[str]) -> None:
    """One toolkit run in this process (`finetune.py ARGV` of the current directory's checkout), measured:
    its phases (`--phases`), or its steady steps' peak and times (the mark reset at step `--warmup` + 1)."""
    import runpy

    result: dict[str, Any] = {}
    from toolkit.objectives.grpo.rollout import Rollouts
    import toolkit.train.loop as loop

    if a.no_map:  # glibc's own threshold: what the resident memory was without the toolkit's setting
        import toolkit.parallel.build as build

        build.map_large_allocations = lambda *args, **kwargs: False
    if a.phases:
        peaks = PhasePeaks("start-up (imports, data, model load), and between phases")
        for where, attr, name in PHASES:
            owner = resolve(where)
            setattr(owner, attr, peaks.wrap(getattr(owner, attr), name))
    starts: list[float] = []  # each step's start: its batch asked for
    generation: list[tuple[float, int]] = []
    warmup_hwm: list[int] = []
    steps_hwm: list[int] = []
    ends: list[float] = []
    next_batch, sample, finish = Rollouts.__next__, Rollouts.sample, loop.finish

    def timed_next(self):
        starts.append(time.perf_counter())
        if not a.phases and len(starts) == a.warmup + 1:
            warmup_hwm.append(status_kib("VmHWM"))
            reset_peak_rss()
        return next_batch(self)

    def timed_sample(self, *args, **kwargs):
        t0 = time.perf_counter()
        out = sample(self, *args, **kwargs)
        generation.append((time.perf_counter() - t0, int(out.mask.sum())))
        return out

    def timed_finish(*args, **kwargs):
        ends.append(time.perf_counter())
        if warmup_hwm:  # the steady steps' peak: read when the last step has ended, before the final save
            steps_hwm.append(status_kib("VmHWM"))
        return finish(*args, **kwargs)

    Rollouts.__next__, Rollouts.sample, loop.finish = timed_next, timed_sample, timed_finish
    sys.argv = ["finetune.py", *argv]
    code = 0
    try:  # its main, not its `__main__` block: that one ends the process (os._exit) before this one writes
        runpy.run_path("finetune.py", run_name="finetune")["main"](argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    bounds = starts + ends[:1]
    steady = range(a.warmup, len(bounds) - 1)
    result.update(exit_code=code, steps=len(starts), peak_rss_mib=max([status_kib("VmHWM"), *warmup_hwm]) / 1024,
                  step_s_each=[bounds[i + 1] - bounds[i] for i in steady],
                  generation_s_each=[generation[i][0] for i in steady if i < len(generation)],
                  completion_tokens_each=[generation[i][1] for i in steady if i < len(generation)])
    if a.phases:
        result["phases"] = peaks.rows()
        result["peak_rss_mib"] = max(r["peak_rss_mib"] for r in result["phases"])
    elif steps_hwm:
        result["steady_peak_rss_mib"] = steps_hwm[0] / 1024
    Path(a.result).write_text(json.dumps(result))
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(code)  # as finetune.py ends: no interpreter teardown


# ----------------------------------------------------------------------------- the parent


def trl_driver() -> Path:
    """The script that drives TRL's GRPOTrainer on a prompts file (where this checkout keeps it)."""
    return ROOT / "benchmarks" / "gpu" / "grpo_trainer_user.py"


def run_child(cmd: list[str], cwd: Path, pythonpath: Path, threads: int, log: Path) -> dict:
    """`python CMD...` in a fresh process from `cwd`, its toolkit imported from `pythonpath`, with `threads`
    torch threads (0: the library's default); the machine's load average before and after, its wall seconds."""
    env = {**os.environ, "PYTHONPATH": str(pythonpath), "TOKENIZERS_PARALLELISM": "false"}
    if threads:
        env.update(TOOLKIT_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads))
    load, t0 = os.getloadavg()[0], time.perf_counter()
    with open(log, "w") as f:
        p = subprocess.run([sys.executable, *cmd], cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:3])} ... failed ({p.returncode}); its output: {log}\n"
                           + log.read_text()[-3000:])
    return {"wall_s": round(time.perf_counter() - t0, 1), "load_before": load, "load_after": os.getloadavg()[0]}


def prompts_file(path: Path) -> Path:
    """builtin:arithmetic's training questions as TRL's conversational prompts, with their `answer`."""
    from toolkit.data.builtin import builtin_records

    rows = [{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]}
            for r in builtin_records("arithmetic", "train")]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def toolkit_run(a, batch: tuple[int, int], data: Path, work: Path, tag: str) -> dict:
    out = work / f"toolkit-{tag}"
    result = work / f"toolkit-{tag}.json"
    args = ["--model", "smollm2-135m-instruct", "--method", "lora", "--objective", "grpo", "--dataset", str(data),
            "--reward", f"{trl_driver()}:math_answer", "--num-generations", str(a.generations),
            "--max-completion-length", str(a.completion_length), "--micro-batch-size", str(batch[0]),
            "--grad-accum", str(batch[1]),
            "--temperature", str(a.temperature), "--lr", str(a.lr), "--lr-schedule", "linear", "--warmup-steps", "0",
            "--max-steps", str(a.steps), "--seed", str(a.seed), "--log-every", "1", "--report-to", "none",
            "--output-dir", str(out), "--overwrite-output-dir"]
    meta = run_child([str(Path(__file__).resolve()), "child", "--result", str(result), "--warmup", str(a.warmup),
                      "--", *args], ROOT, ROOT, a.threads, work / f"toolkit-{tag}.log")
    got = json.loads(result.read_text())
    return {**meta, **got}


def trl_run(a, batch: tuple[int, int], data: Path, model: Path, work: Path, tag: str) -> dict:
    out = work / f"trl-{tag}"
    meta = run_child([str(trl_driver()), "--model", str(model), "--dataset", str(data), "--output-dir", str(out),
                      "--num-generations", str(a.generations), "--max-completion-length", str(a.completion_length),
                      "--micro-batch-size", str(batch[0]), "--grad-accum", str(batch[1]), "--max-steps", str(a.steps),
                      "--warmup", str(a.warmup), "--temperature", str(a.temperature), "--lr", str(a.lr),
                      "--seed", str(a.seed), "--threads", str(a.threads)], ROOT, ROOT, a.threads,
                     work / f"trl-{tag}.log")
    got = json.loads((out / "grpo_metrics.json").read_text())
    return {**meta, **got}


def per_run(r: dict) -> dict:
    """One run's figures, as both arms report them."""
    gen_s, tokens = sum(r["generation_s_each"]), sum(r["completion_tokens_each"])
    return {"peak_rss_mib": r["peak_rss_mib"], "steady_peak_rss_mib": r.get("steady_peak_rss_mib"),
            "step_s": statistics.median(r["step_s_each"]) if r["step_s_each"] else None,
            "generation_tokens_per_s": tokens / gen_s if gen_s else None,
            "completion_tokens_per_step": tokens / len(r["completion_tokens_each"]) if r["completion_tokens_each"]
            else None, "wall_s": r["wall_s"], "load": [r["load_before"], r["load_after"]]}


def spread(xs: list[float | None]) -> dict | None:
    xs = [x for x in xs if x is not None]
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)} if xs else None


def compare(a, work: Path, done: Callable[[dict], None]) -> None:
    """Each of `a.batches` compared, `a.pairs` interleaved pairs of runs; `done(result)` after each batch."""
    from toolkit.model.source import prepare_default_model

    model = prepare_default_model()
    data = prompts_file(work / "arithmetic_prompts.jsonl")
    for batch in a.batches:
        date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        runs: dict[str, list[dict]] = {"toolkit": [], "trl": []}
        for i in range(a.pairs):
            for arm in ("toolkit", "trl"):
                tag = f"b{batch[0]}x{batch[1]}-{i}"
                print(f"compare: {batch[0]}x{batch[1]}, pair {i + 1}/{a.pairs}, {arm} ...", flush=True)
                raw = toolkit_run(a, batch, data, work, tag) if arm == "toolkit" else trl_run(a, batch, data, model,
                                                                                               work, tag)
                runs[arm].append(per_run(raw))
                print(f"  {json.dumps(runs[arm][-1])}", flush=True)
        keys = ("peak_rss_mib", "steady_peak_rss_mib", "step_s", "generation_tokens_per_s")
        ratios = {k: spread([t[k] / r[k] if t[k] and r[k] else None for t, r in zip(runs["toolkit"], runs["trl"])])
                  for k in keys}
        loads = [x for rs in runs.values() for r in rs for x in r["load"]]
        done({"micro_batch": batch[0], "grad_accum": batch[1], "pairs": a.pairs, "date": date,
              "load": [min(loads), max(loads)], "runs": runs, "ratios_toolkit_over_trl": ratios,
              "summary": {arm: {k: spread([r[k] for r in rs]) for k in (*keys, "completion_tokens_per_step")}
                          for arm, rs in runs.items()}})


def phases(a, work: Path) -> list[dict]:
    out = []
    for label, tree, unmapped in [(*t, False) for t in a.tree] + [(*t, True) for t in a.unmapped]:
        tree = Path(tree).resolve()
        result = work / f"phases-{label}.json"
        meta = run_child([str(Path(__file__).resolve()), "child", "--phases", *(["--no-map"] if unmapped else []),
                          "--result", str(result), "--",
                          "--config", str(QUICKSTART), "--max-steps", str(a.phase_steps),
                          "--output-dir", str(work / f"phases-{label}")], tree, tree, a.threads,
                         work / f"phases-{label}.log")
        got = json.loads(result.read_text())
        commit = subprocess.run(["git", "log", "-1", "--format=%h %s"], cwd=tree, capture_output=True,
                                text=True).stdout.strip()[:100]
        out.append({"label": label, "tree": str(tree), "commit": commit or None, "glibc_threshold": unmapped,
                    **meta, **got})
        print(f"phases {label}: peak {got['peak_rss_mib']:.0f} MiB", flush=True)
    return out


def versions() -> dict:
    import peft
    import torch
    import transformers
    import trl

    return {"torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__,
            "peft": peft.__version__, "python": platform.python_version(), "cpus": os.cpu_count()}


def fmt(s: dict | None, digits: int = 0, unit: str = "") -> str:
    if not s:
        return "-"
    f = f"{{:.{digits}f}}"
    mid = f.format(s["median"]) + unit
    return mid if s["n"] == 1 else f"{mid} ({f.format(s['min'])}-{f.format(s['max'])})"


def markdown(data: dict) -> list[str]:
    lines = ["# GRPO on the CPU: the toolkit beside TRL's GRPOTrainer", "",
             "Written by `python -m benchmarks.grpo_cpu` (method in its docstring). Peak RSS is the process's "
             "resident high-water mark (the kernel's VmHWM, every allocator counted); memory does not depend on "
             "the machine's load, timings do.", ""]
    c = data.get("compare")
    if c:
        s = c["settings"]
        lines += ["## Side by side", "",
                  f"On {c['machine']} ({', '.join(f'{k} {v}' for k, v in c['versions'].items())}); "
                  f"{s['threads'] or 'the default'} torch thread(s) a process. The machine is shared with other "
                  "work: each table gives the 1-minute load average over its runs; above ~2 on these 2 cores the "
                  "timings are noisy (memory is not affected).", "",
                  f"Settings: {s['model']}, LoRA r 16 / alpha 32 on all linear layers, fp32, {s['generations']} "
                  f"generations of at most {s['completion_length']} tokens, lr {s['lr']:g} (linear, no warm-up), "
                  f"temperature {s['temperature']:g}, seed {s['seed']}, beta 0; {s['steps']} steps a run, the first "
                  f"{s['warmup']} left out of the steady figures; toolkit and TRL interleaved. Each trainer's other "
                  "defaults: TRL's GRPOConfig turns gradient checkpointing on, the toolkit leaves it off. Cells: "
                  "median (min-max) over the runs.", ""]
        for b in c["results"]:
            t, r, q = b["summary"]["toolkit"], b["summary"]["trl"], b["ratios_toolkit_over_trl"]
            n = b["micro_batch"] * b["grad_accum"]
            lines += [f"### {n} completions a step ({n // s['generations']} prompt(s) x {s['generations']}), "
                      f"micro-batch {b['micro_batch']} x {b['grad_accum']} accumulation", "",
                      f"{b['pairs']} pair(s) of runs from {b['date']}; load average {b['load'][0]:.1f}-"
                      f"{b['load'][1]:.1f}.", ""]
            lines += md_table(["", "peak RSS (MiB)", "steady-steps peak RSS (MiB)", "s/step (median)",
                               "generation tokens/s", "completion tokens/step"],
                              [["toolkit", fmt(t["peak_rss_mib"]), fmt(t["steady_peak_rss_mib"]), fmt(t["step_s"], 2),
                                fmt(t["generation_tokens_per_s"], 1), fmt(t["completion_tokens_per_step"], 1)],
                               ["TRL 1.16 GRPOTrainer", fmt(r["peak_rss_mib"]), fmt(r["steady_peak_rss_mib"]),
                                fmt(r["step_s"], 2), fmt(r["generation_tokens_per_s"], 1),
                                fmt(r["completion_tokens_per_step"], 1)],
                               ["toolkit / TRL", fmt(q["peak_rss_mib"], 2), fmt(q["steady_peak_rss_mib"], 2),
                                fmt(q["step_s"], 2), fmt(q["generation_tokens_per_s"], 2), ""]])
            lines.append("")
    p = data.get("phases")
    if p:
        labels = [x["label"] for x in p["runs"]]
        names = list(dict.fromkeys(row["phase"] for x in p["runs"] for row in x["phases"]))
        cell = {(x["label"], row["phase"]): row for x in p["runs"] for row in x["phases"]}
        lines += ["## Where the quickstart's peak is", "",
                  f"Ran {p['date']} on {p['machine']}: `finetune.py --config {QUICKSTART} --max-steps "
                  f"{p['steps']}` (32 completions a step, the held-out eval before and after), "
                  f"{p['threads'] or 'the default'} torch thread(s). Each phase: the peak resident memory while it "
                  "ran (MiB).", ""]
        lines += [f"- {x['label']}: `{x['commit']}`" + (", large allocations left to glibc's own mmap threshold "
                  "(`map_large_allocations` off)" if x.get("glibc_threshold") else "") for x in p["runs"]] + [""]
        lines += md_table(["phase", *labels],
                          [[n, *(f"{cell[(lb, n)]['peak_rss_mib']:.0f}" if (lb, n) in cell else "-" for lb in labels)]
                           for n in names] +
                          [["**the run's peak**", *(f"**{x['peak_rss_mib']:.0f}**" for x in p["runs"])]])
        lines.append("")
    for note in data.get("notes", []):
        lines += [note, ""]
    return lines


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["child"]:
        cut = argv.index("--")
        ap = argparse.ArgumentParser(prog="grpo_cpu child")
        ap.add_argument("--result", required=True)
        ap.add_argument("--warmup", type=int, default=2)
        ap.add_argument("--phases", action="store_true")
        ap.add_argument("--no-map", action="store_true")
        child(ap.parse_args(argv[1:cut]), argv[cut + 1:])  # it ends the process
    ap = argparse.ArgumentParser(prog="python -m benchmarks.grpo_cpu", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    ap.add_argument("--parts", default="compare,phases", help="compare, phases or both (comma-separated)")
    ap.add_argument("--batches", default="8x1,8x4", help="micro-batch x accumulation, one comparison each "
                    "(comma-separated): 8x1 is 8 completions a step, 8x4 the quickstart's 32")
    ap.add_argument("--pairs", type=int, default=2, help="toolkit/TRL run pairs per batch, interleaved")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2, help="steps left out of the steady figures")
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--completion-length", type=int, default=16)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--threads", type=int, default=0, help="torch threads per process (0: each library's default, "
                    "every core; the allocator's per-thread arenas make the resident memory depend on it)")
    ap.add_argument("--tree", action="append", default=[], metavar="LABEL=PATH",
                    help="phases: a checkout to profile (repeatable; default this one, as 'this checkout')")
    ap.add_argument("--unmapped", action="append", default=[], metavar="LABEL=PATH",
                    help="phases: a checkout profiled with the toolkit's allocation threshold off (repeatable)")
    ap.add_argument("--phase-steps", type=int, default=3)
    ap.add_argument("--note", action="append", default=[], help="a paragraph for the .md (what else ran, ...)")
    ap.add_argument("--work", default=None, help="where the runs write (default a temporary directory)")
    a = ap.parse_args(argv)
    a.batches = [tuple(int(x) for x in b.split("x")) if "x" in b else (int(b), 1) for b in a.batches.split(",")]
    a.tree = [tuple(t.split("=", 1)) for t in a.tree] or [("this checkout", str(ROOT))]
    a.unmapped = [tuple(t.split("=", 1)) for t in a.unmapped]
    parts = set(a.parts.split(","))
    old = json.loads(Path(f"{STEM}.json").read_text()) if Path(f"{STEM}.json").exists() else {}
    data = {k: old[k] for k in ("compare", "phases") if k in old}
    data["notes"] = a.note or old.get("notes", [])
    machine = f"{platform.machine()} CPU, {os.cpu_count()} cores"
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    with tempfile.TemporaryDirectory(prefix="grpo_cpu-") as tmp:
        work = Path(a.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        if "phases" in parts:
            data["phases"] = {"date": date, "machine": machine, "steps": a.phase_steps, "threads": a.threads,
                              "runs": phases(a, work)}
        if "phases" in parts:
            write(data)
        if "compare" in parts:
            settings = {"model": "SmolLM2-135M-Instruct (embedded)", "generations": a.generations,
                        "completion_length": a.completion_length, "lr": a.lr, "temperature": a.temperature,
                        "seed": a.seed, "steps": a.steps, "warmup": a.warmup, "threads": a.threads}
            kept = data.get("compare", {})
            # another batch's results of the same settings stay (one command per batch size is allowed)
            results = kept.get("results", []) if kept.get("settings") == settings else []
            data["compare"] = {"machine": machine, "versions": versions(), "settings": settings, "results": results}

            def done(result: dict) -> None:
                key = (result["micro_batch"], result["grad_accum"])
                results[:] = [r for r in results if (r["micro_batch"], r["grad_accum"]) != key] + [result]
                write(data)

            compare(a, work, done)
    print("\n".join(markdown(data)))
    return 0


def write(data: dict) -> None:
    """benchmarks/grpo_cpu.json and .md from the same figures."""
    write_pair(STEM, data, markdown(data), echo=False)


if __name__ == "__main__":
    sys.exit(main())
