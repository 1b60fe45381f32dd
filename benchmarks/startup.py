"""Start-up cost of a tiny run: `finetune.py --help`, and a 1-step LoRA run of a 156k-parameter Llama on
1,000 rows, wall clock and by phase.

Method. Every figure is a fresh `python` process, as a user runs it, with warm caches (the run's tokenized
data cached by a first run that is not counted; the OS file cache warm). `--help` and the tiny run are each
timed `--repeats` times and the median reported, beside the floor no toolkit change can go under:
a process that only imports what the run needs (torch, the model's transformers class, peft,
accelerate, pyarrow; the packages `toolkit.cli.startup` leaves unimported for the run left out the same
way), timed the same way, interleaved with the runs. The phases come from one more run of `finetune.main` in
a process of its own: the functions `finetune.py` calls are wrapped with a timer (nothing else changes),
and "imports and config" is the time from the process's start to the first of them; `main()` is called
with no argv, as the command line calls it. `-X importtime` of a
further run gives the self time of each top-level package imported.

    python -m benchmarks.startup [--repeats 5]
Writes benchmarks/startup.json and benchmarks/startup.md.
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
from pathlib import Path

from benchmarks.common import BENCH, ROOT, child_result, cpu_device, md_table, write_pair

# (module, function) finetune.main calls, in order; each is wrapped with a timer in the phase run
PHASES = [("toolkit.config", "parse_config"), ("toolkit.model.load", "check_model"),
          ("toolkit.model.load", "load_tokenizer"),
          ("toolkit.data.prepare", "prepare_data"), ("toolkit.parallel.build", "make_accelerator"),
          ("toolkit.parallel.build", "make_strategy"), ("toolkit.model.load", "load_model"),
          ("toolkit.train.loop", "train"), ("toolkit.train.checkpoint", "save_final"),
          ("toolkit.train.integrity", "verify_saved"), ("toolkit.train.output", "summarize")]


def floor_command(argv: list[str]) -> str:
    """What the run imports, with the packages toolkit.cli.startup leaves unimported for this run left out
    the same way."""
    from toolkit.config import parse_config
    from toolkit.cli.startup import unused_packages

    cfg = parse_config(argv)
    unused = unused_packages(cfg.model.method, cfg.parallel, cfg.output.report_to)
    left_out = ", ".join(f"{name}=None" for name in unused)
    return (f"import sys; sys.modules.update({left_out}); "
            "import torch, accelerate, peft, pyarrow; from transformers import LlamaForCausalLM")


PHASE_RUN = """
import importlib, json, sys, time
t0 = time.perf_counter()
sys.path.insert(0, {root!r})
import finetune
timings, starts = {{}}, []
def wrap(owner, name):
    fn = getattr(owner, name)
    def timed(*a, **k):
        s = time.perf_counter()
        starts.append(s)
        try:
            return fn(*a, **k)
        finally:
            timings[name] = timings.get(name, 0.0) + time.perf_counter() - s
    setattr(owner, name, timed)
for mod, name in {phases!r}:  # parse_config is imported into finetune at module level
    wrap(finetune if mod == "toolkit.config" else importlib.import_module(mod), name)
sys.argv = ["finetune.py", *{argv!r}]
finetune.main()  # as the command line calls it (no argv: the process is the run's own)
print("RESULT " + json.dumps({{"phases": timings, "to_first_phase": starts[0] - t0, "total": time.perf_counter() -
t0}}))
"""


def timed(cmd: list[str], env: dict) -> float:
    t = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:3])} ...: exit {p.returncode}\n{p.stderr[-2000:]}")
    return time.perf_counter() - t


def import_self_times(cmd: list[str], env: dict) -> dict[str, float]:
    """Seconds of import self time per top-level package, from `python -X importtime` (its lines read
    'import time: SELF_US | CUMULATIVE_US | NAME'), the 12 largest."""
    p = subprocess.run([cmd[0], "-X", "importtime", *cmd[1:]], cwd=ROOT, env=env, capture_output=True, text=True)
    out: dict[str, float] = {}
    for line in p.stderr.splitlines():
        parts = line.removeprefix("import time:").split("|")
        if not line.startswith("import time:") or len(parts) != 3 or not parts[0].strip().isdigit():
            continue
        top = parts[2].strip().split(".")[0]
        out[top] = out.get(top, 0.0) + int(parts[0]) / 1e6
    return dict(sorted(out.items(), key=lambda kv: -kv[1])[:12])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    from toolkit.model.synthetic import build_model_dir, corpus

    work = Path(tempfile.mkdtemp(prefix="bench_startup_"))
    model = build_model_dir(work / "model")
    texts = corpus(3000, seed=3)
    data = work / "rows.json"
    data.write_text(json.dumps([{"instruction": texts[3 * i], "input": texts[3 * i + 1], "output": texts[3 * i + 2]}
                                for i in range(1000)]))
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TOOLKIT_CACHE": str(work / "cache")}
    argv = ["--model", str(model), "--dataset", str(data), "--seq-len", "64", "--max-steps", "1",
            "--output-dir", str(work / "out"), "--overwrite-output-dir"]
    run = [sys.executable, str(ROOT / "finetune.py"), *argv]
    timed(run, env)  # cold: tokenizes into the cache; not counted
    help_s = [timed([sys.executable, str(ROOT / "finetune.py"), "--help"], env) for _ in range(a.repeats)]
    floor_cmd = floor_command(argv)
    floor = [sys.executable, "-c", floor_cmd]
    run_s, floor_s = [], []
    for _ in range(a.repeats):  # interleaved: the machine's drift falls on both alike
        run_s.append(timed(run, env))
        floor_s.append(timed(floor, env))
    script = PHASE_RUN.format(root=str(ROOT), phases=PHASES, argv=argv)
    phases = child_result(["-c", script], env=env, what="the phase run")
    imports = import_self_times(run, env)
    import torch

    out = {"device": cpu_device(), "torch": torch.__version__, "python": sys.version.split()[0],
           "repeats": a.repeats, "help_seconds": {"median": statistics.median(help_s), "all": help_s},
           "tiny_run_seconds": {"median": statistics.median(run_s), "all": run_s},
           "import_floor_seconds": {"median": statistics.median(floor_s), "all": floor_s, "command": floor_cmd},
           "phase_run": phases, "import_self_seconds_by_package": imports,
           "targets": {"help_seconds": 0.5, "tiny_run_seconds": 6.0}}
    lines = ["# Start-up: `finetune.py --help` and a 1-step tiny run", "",
             "Reproduce: `python -m benchmarks.startup` (method in its docstring). A 156k-parameter Llama, LoRA, "
             "1,000 alpaca rows (tokenized data cached by an uncounted first run), 1 step, fresh process each "
             "time.", ""]
    every = lambda xs: ", ".join(f"{x:.2f}" for x in xs)  # noqa: E731
    lines += md_table(["what", "median seconds", "all", "target"], [
        ["`finetune.py --help`", f"{out['help_seconds']['median']:.2f}", every(help_s), "< 0.5"],
        ["tiny run, wall", f"{out['tiny_run_seconds']['median']:.2f}", every(run_s), "< 6"],
        [f"floor: `python -c \"{floor_cmd}\"`", f"{out['import_floor_seconds']['median']:.2f}", every(floor_s), ""],
        ["tiny run above the floor", f"{statistics.median(run_s) - statistics.median(floor_s):.2f}", "", ""]])
    lines += ["", "One more run, by phase (seconds; `finetune.main`'s calls, each wrapped with a timer):", ""]
    lines += md_table(["phase", "seconds"], [
        ["interpreter start, imports, `finetune.main` up to its first call", f"{phases['to_first_phase']:.2f}"],
        *[[f"`{name}`", f"{phases['phases'].get(name, 0.0):.2f}"] for _, name in PHASES],
        ["total", f"{phases['total']:.2f}"]])
    lines += ["", "Import self time by top-level package (`python -X importtime`, one run):", ""]
    lines += md_table(["package", "seconds"], [[k, f"{v:.2f}"] for k, v in imports.items()])
    lines += ["", f"Device: {out['device']}, torch {out['torch']}, Python {out['python']}."]
    write_pair(BENCH / "startup", out, lines)


if __name__ == "__main__":
    main()
