"""Run a test function on N gloo ranks in fresh processes (torchtitan/accelerate style)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn, world_size: int, port: int, args: tuple, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1")
    import torch

    torch.set_num_threads(1)
    try:
        queue.put((rank, fn(*args), None))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        import traceback

        queue.put((rank, None, traceback.format_exc()))
        raise


def run_distributed(fn, world_size: int, *args, timeout: float = 300) -> list:
    """Call `fn(*args)` on `world_size` ranks (env:// rendezvous, gloo); return results by rank."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, fn, world_size, port, args, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    try:
        for _ in range(world_size):
            rank, value, err = queue.get(timeout=timeout)
            if err:
                raise AssertionError(f"rank {rank} failed:\n{err}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world_size)]


def launch(args: list[str], nproc: int = 1, env: dict | None = None, timeout: float = 600,
           launcher: str = "torchrun", multi_gpu: bool = True, script: Path = ROOT / "finetune.py",
           launcher_args: list[str] = ()) -> subprocess.CompletedProcess:
    """Run `script` (finetune.py) as a user would: plain python, torchrun, accelerate launch (with
    `--multi_gpu` for several processes unless `multi_gpu=False`, the mistake a user can make) or
    DeepSpeed's launcher; `launcher_args` go to the launcher (e.g. accelerate's --use_deepspeed)."""
    e = {**os.environ, "OMP_NUM_THREADS": "1" if nproc > 1 else os.environ.get("OMP_NUM_THREADS", "2"),
         "PYTHONUNBUFFERED": "1", **(env or {})}
    if launcher == "python":
        cmd = [sys.executable, str(script), *args]
    elif launcher == "torchrun":  # --standalone: the agent binds a free port itself (no race between tests)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
               *launcher_args, str(script), *args]
    elif launcher == "deepspeed":
        cmd = [sys.executable, "-c", "from deepspeed.launcher.runner import main; main()", "--num_gpus", str(nproc),
               "--master_port", str(free_port()), *launcher_args, str(script), *args]
    else:
        config = "--config_file" in launcher_args
        cmd = [sys.executable, "-m", "accelerate.commands.launch",
               *(["--multi_gpu"] if nproc > 1 and multi_gpu and not launcher_args else []), "--num_processes", str(nproc),
               *([] if config else ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]),
               "--main_process_port", str(free_port()), *launcher_args, str(script), *args]
    return subprocess.run(cmd, cwd=ROOT, env=e, capture_output=True, text=True, timeout=timeout)


def launch_layouts(out: Path, common: list[str], runs: dict[str, list[str]], nproc: int = 1,
                   launcher: str = "torchrun", launcher_args: list[str] = (), env: dict | None = None,
                   timeout: float = 900, cuda_path: tuple[str, ...] = (),
                   run_env: dict[str, dict] | None = None) -> dict[str, dict]:
    """Every run in `runs` ({name: flags}) in one launch and one process group (`tests/layouts.py`);
    each writes out/name. Returns {name: {"exit": code, "out": folder}}; the launch's output is kept
    in out/stdout.txt and out/stderr.txt. `run_env`: {name: {variable: value}} for a run of its own."""
    import json

    out.mkdir(parents=True, exist_ok=True)
    spec = out / "spec.json"
    spec.write_text(json.dumps({"common": common, "runs": runs, "out": str(out), "cuda_path": list(cuda_path),
                                "env": run_env or {}}))
    p = launch([str(spec)], nproc=nproc, env=env, timeout=timeout, launcher=launcher, script=ROOT / "tests" / "layouts.py",
               launcher_args=launcher_args)
    (out / "stdout.txt").write_text(p.stdout)
    (out / "stderr.txt").write_text(p.stderr)
    assert (out / "results.json").exists(), f"exit {p.returncode}:\n{p.stderr[-4000:]}"
    results = json.loads((out / "results.json").read_text())
    return {name: {**r, "out": out / name, "stdout": out / f"{name}.stdout.txt", "stderr": out / f"{name}.stderr.txt"}
            for name, r in results.items()}


def common_args(model, data) -> list[str]:
    """parity_args without an output folder (launch_layouts gives each run its own); a run's own
    --method follows them and wins."""
    args = parity_args(model, data, "unused", "full")
    i = args.index("--output-dir")
    return args[:i] + args[i + 2:]


def batched_runs(tmp_path_factory, common: list[str], specs: dict[tuple, tuple[int, list[str]]]):
    """A run cache for a test module: `specs` is {key: (ranks, flags)}; the first use of a key launches
    every run of its rank count together, in one launch and process group (launch_layouts: plain python
    for one rank, torchrun for more), and asserts each succeeded. Returns get(*key) -> output folder."""
    outs: dict[tuple, Path] = {}

    def name(key: tuple) -> str:
        return "_".join(map(str, key))

    def get(*key) -> Path:
        if key not in outs:
            n = specs[key][0]
            group = {name(k): flags for k, (ranks, flags) in specs.items() if ranks == n}
            root = tmp_path_factory.mktemp(f"ranks{n}")
            runs = launch_layouts(root, common, group, nproc=n, launcher="python" if n == 1 else "torchrun")
            for run, r in runs.items():
                assert r["exit"] == 0, f"{run}:\n{(root / 'stderr.txt').read_text()[-4000:]}"
            outs.update({k: root / name(k) for k, (ranks, _) in specs.items() if ranks == n})
        return outs[key]

    return get


def run_stdout(out: Path) -> str:
    """What a run printed: its own stdout.txt (run_once), or the launch's per-run file (launch_layouts)."""
    own = Path(out) / "stdout.txt"
    return own.read_text() if own.exists() else (Path(out).parent / f"{Path(out).name}.stdout.txt").read_text()


def run_once(tmp_path_factory):
    """A run-once cache for a test module: `get(key, argv_for, nproc)` runs finetune.py once per key
    (one process: plain python; several: torchrun), asserts it succeeded, keeps its stdout/stderr
    beside the output and returns the output dir. Several tests then read one multi-rank run."""
    cache: dict = {}

    def get(key: tuple, argv_for, nproc: int = 1, env: dict | None = None) -> Path:
        if key not in cache:
            out = tmp_path_factory.mktemp("_".join(map(str, key)))
            p = launch(argv_for(out), nproc=nproc, env=env, launcher="python" if nproc == 1 else "torchrun")
            assert p.returncode == 0, p.stderr[-4000:]
            (out / "stdout.txt").write_text(p.stdout)
            (out / "stderr.txt").write_text(p.stderr)
            cache[key] = out
        return cache[key]

    return get


def parity_args(model, data, out, method: str) -> list[str]:
    """finetune.py flags shared by the parity tests: tiny model, fp32, 5 logged steps, no dropout."""
    return ["--model", str(model), "--dataset", str(data), "--output-dir", str(out), "--method", method,
            "--seq-len", "64", "--max-steps", "5", "--log-every", "1", "--lr", "1e-3", "--warmup-steps", "0",
            "--lr-schedule", "linear", "--mixed-precision", "no", "--lora-dropout", "0", "--seed", "7"]


def records(out) -> list[dict]:
    """The run's metrics.jsonl records."""
    import json

    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def assert_metric_close(got: list[dict], want: list[dict], key: str, rel: float, abs: float, what=None) -> None:
    """`key` is in the same records of both runs, and close (pytest.approx's rel/abs) where present.

    A record may not carry a metric (an eval-only key in a train record): presence must match, and only
    the values present are compared (pytest >= 9.2's approx refuses None under a relative tolerance)."""
    import pytest

    have, expect = [key in r for r in got], [key in r for r in want]
    assert have == expect, (what, key, "present in records", have, "expected", expect)
    values = [r[key] for r in got if key in r]
    assert values == pytest.approx([r[key] for r in want if key in r], rel=rel, abs=abs), (what, key)
