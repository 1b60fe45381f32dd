"""Run a test function, or finetune.py through tests/layouts.py, on N gloo ranks in processes of their
own (torchtitan/accelerate style).

On 2 cores a rank's start is what a parity test pays for: a fresh interpreter imports torch,
transformers, accelerate, peft and DeepSpeed (~6 s each, twice that under a second pytest worker), and
torchrun's agent imports torch once more. Ranks are therefore forked from a forkserver that imported them
once (`PRELOAD`); it has run no torch op, so its children start without a thread pool to inherit. The
launchers themselves (python, torchrun, accelerate launch, DeepSpeed's) are what tests/test_launchers.py
runs, every form for real; the parity tests use `launcher="fork"` (torchrun's rank environment, no agent).
The benchmarks start their gloo ranks through `run_distributed` too (`benchmarks.common.spawn_ranks`), as
`tests.distributed`: nothing here needs pytest, except `assert_metric_close`, which imports it when called.
"""

from __future__ import annotations

import functools
import os
import socket
import subprocess
import sys
import time
import uuid
from multiprocessing.connection import wait
from pathlib import Path

import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn, world_size: int, port: int, args: tuple, queue, finished) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1")
    import torch

    torch.set_num_threads(1)
    try:
        queue.put((rank, fn(*args), None))
    except BaseException:  # noqa: BLE001 - reported to the parent
        import traceback

        queue.put((rank, None, traceback.format_exc()))
        raise
    # Rank 0's process holds the rendezvous store: it stays up until every rank's `fn` has returned (one
    # that returned first and exited reset the others' connections while they still built groups).
    finished.wait(600)


# What every rank imports, imported once in the forkserver (a process that has run no torch op, so its
# children fork with no thread pool): a rank starts in well under a second instead of re-importing
# torch and transformers (~5 s on 2 cores), as spawn would.
PRELOAD = ["torch", "torch.distributed", "transformers", "transformers.models.llama.modeling_llama", "accelerate",
           "peft", "deepspeed", "datasets", "safetensors.torch"]


# Variables the preloaded libraries read when imported (huggingface_hub's endpoint and cache, DeepSpeed's
# accelerator, inductor's settings): a launch that sets one gets fresh processes, as a forked rank would not see it.
READ_AT_IMPORT = ("HF_", "HUGGINGFACE_", "TRANSFORMERS_", "DS_", "TORCHINDUCTOR_", "TORCH_", "PYTORCH_", "CUDA_")


@functools.lru_cache(maxsize=1)
def _forkable() -> bool:
    """Forked ranks only where no CUDA device is visible: the preloads (bitsandbytes, DeepSpeed) ask CUDA,
    and a CUDA process cannot be forked; a GPU machine's tests start fresh processes, as before."""
    import torch

    return not torch.cuda.is_available()


def _context(spawn: bool = False):
    if spawn or not _forkable():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def run_distributed(fn, world_size: int, *args, timeout: float = 300, spawn: bool = False) -> list:
    """Call `fn(*args)` on `world_size` ranks (env:// rendezvous, gloo); return results by rank.
    `spawn`: fresh interpreters instead of forks of the preloaded forkserver, so a rank's memory and
    imports are its own, as a launched rank's are (the benchmarks measure them)."""
    ctx = _context(spawn)
    queue, finished = ctx.Queue(), ctx.Event()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, fn, world_size, port, args, queue, finished))
             for r in range(world_size)]
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
        finished.set()
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world_size)]


def launch(args: list[str], nproc: int = 1, env: dict | None = None, timeout: float = 600,
           launcher: str = "fork", multi_gpu: bool = True, script: Path = ROOT / "finetune.py",
           launcher_args: list[str] = ()) -> subprocess.CompletedProcess:
    """Run `script` (finetune.py) as a user would: plain python, torchrun, accelerate launch (with
    `--multi_gpu` for several processes unless `multi_gpu=False`, the mistake a user can make) or
    DeepSpeed's launcher; `launcher_args` go to the launcher (e.g. accelerate's --use_deepspeed). "fork":
    plain python or torchrun's environment, the ranks forked from the forkserver (`fork_launch`)."""
    e = {**os.environ, "OMP_NUM_THREADS": "1" if nproc > 1 else os.environ.get("OMP_NUM_THREADS", "2"),
         "PYTHONUNBUFFERED": "1", **(env or {})}
    if launcher == "fork" and _forkable() and not [k for k in env or {} if k.startswith(READ_AT_IMPORT)]:
        return fork_launch(script, list(args), nproc, e, timeout)
    if launcher == "fork":
        launcher = "python" if nproc == 1 else "torchrun"
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
               *(["--multi_gpu"] if nproc > 1 and multi_gpu and not launcher_args else []),
               "--num_processes", str(nproc),
               *([] if config else ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]),
               "--main_process_port", str(free_port()), *launcher_args, str(script), *args]
    return subprocess.run(cmd, cwd=ROOT, env=e, capture_output=True, text=True, timeout=timeout)


def _forked_rank(script: str, argv: list[str], env: dict[str, str], log: str) -> None:
    """One rank of a fork launch: the launch's environment, its output in files of its own, then `script`
    as `python script argv` runs it (its exit code is the process's)."""
    import runpy
    import traceback

    import torch

    os.environ.clear()
    os.environ.update(env)
    os.chdir(ROOT)
    sys.stdout.flush(), sys.stderr.flush()
    for fd, suffix in ((1, "out"), (2, "err")):
        f = os.open(f"{log}.{suffix}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    sys.stdout.reconfigure(write_through=True)  # PYTHONUNBUFFERED came too late: a killed rank keeps its lines
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", os.cpu_count() or 1)))  # libgomp read it at import
    sys.argv = [script, *argv]
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - what python would print, and its exit code
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush(), sys.stderr.flush()
    os._exit(code)


def fork_launch(script: Path, argv: list[str], nproc: int, env: dict[str, str],
                timeout: float) -> subprocess.CompletedProcess:
    """`python script argv` (one rank) or `torchrun --standalone --nproc_per_node N script argv`, with each rank
    forked from the forkserver. As torchrun: every rank gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
    MASTER_ADDR/PORT of the store this process holds, and a run id; when a rank fails the others are stopped
    and the launch exits 1; stdout and stderr are the ranks' own, in rank order."""
    import tempfile

    from torch.distributed import TCPStore

    ctx = _context()
    store = None  # as torchrun's agent, this process holds the rendezvous store: a rank that ends first takes none down
    if nproc > 1:
        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        env = {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "WORLD_SIZE": str(nproc),
               "LOCAL_WORLD_SIZE": str(nproc), "TORCHELASTIC_RUN_ID": uuid.uuid4().hex,
               "TORCHELASTIC_USE_AGENT_STORE": "True"}
    with tempfile.TemporaryDirectory(prefix="fork_launch_") as logs:
        procs = [ctx.Process(target=_forked_rank,
                             args=(str(script), argv,
                                   {**env, **({"RANK": str(r), "LOCAL_RANK": str(r)} if nproc > 1 else {})},
                                   f"{logs}/{r}")) for r in range(nproc)]
        read = lambda suffix: "".join(Path(f"{logs}/{r}.{suffix}").read_text(errors="replace")  # noqa: E731
                                      for r in range(nproc) if Path(f"{logs}/{r}.{suffix}").exists())
        try:
            for p in procs:
                p.start()
            deadline = time.monotonic() + timeout
            running = list(procs)
            while running:
                wait([p.sentinel for p in running], timeout=max(0.0, deadline - time.monotonic()))
                running = [p for p in running if p.exitcode is None]
                failed = any(p.exitcode not in (None, 0) for p in procs)
                if running and not failed and time.monotonic() >= deadline:
                    raise subprocess.TimeoutExpired(["fork", str(script), *argv], timeout, read("out"), read("err"))
                if failed:
                    break
        finally:
            _stop([p for p in procs if p.pid is not None and p.exitcode is None])
        del store
        codes = [p.exitcode for p in procs]
        code = codes[0] if nproc == 1 else int(any(codes))
        return subprocess.CompletedProcess(["fork", str(nproc), str(script), *argv], code, read("out"), read("err"))


def _stop(procs: list) -> None:
    """As torchrun stops its ranks when one fails: SIGTERM (a rank saves and exits), SIGKILL after 30 s in all."""
    for p in procs:
        p.terminate()
    grace = time.monotonic() + 30
    for p in procs:
        p.join(max(0.0, grace - time.monotonic()))
        if p.exitcode is None:
            p.kill()
            p.join()


def launch_layouts(out: Path, common: list[str], runs: dict[str, list[str]], nproc: int = 1,
                   launcher: str = "fork", launcher_args: list[str] = (), env: dict | None = None,
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
    p = launch([str(spec)], nproc=nproc, env=env, timeout=timeout, launcher=launcher,
               script=ROOT / "tests" / "layouts.py", launcher_args=launcher_args)
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
    every run of its rank count together, in one launch and process group (launch_layouts, forked
    ranks), and asserts each succeeded. Returns get(*key) -> output folder."""
    outs: dict[tuple, Path] = {}

    def name(key: tuple) -> str:
        return "_".join(map(str, key))

    def get(*key) -> Path:
        if key not in outs:
            n = specs[key][0]
            group = {name(k): flags for k, (ranks, flags) in specs.items() if ranks == n}
            root = tmp_path_factory.mktemp(f"ranks{n}")
            runs = launch_layouts(root, common, group, nproc=n)
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
    (forked ranks: `fork_launch`), asserts it succeeded, keeps its stdout/stderr
    beside the output and returns the output dir. Several tests then read one multi-rank run."""
    cache: dict = {}

    def get(key: tuple, argv_for, nproc: int = 1, env: dict | None = None) -> Path:
        if key not in cache:
            out = tmp_path_factory.mktemp("_".join(map(str, key)))
            p = launch(argv_for(out), nproc=nproc, env=env, launcher="fork")
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


def assert_metric_close(got: list[dict], want: list[dict], key: str, rel: float, abs: float, what=None) -> None:
    """`key` is in the same records of both runs, and close (pytest.approx's rel/abs) where present.

    A record may not carry a metric (an eval-only key in a train record): presence must match, and only
    the values present are compared (pytest >= 9.2's approx refuses None under a relative tolerance)."""
    import pytest

    have, expect = [key in r for r in got], [key in r for r in want]
    assert have == expect, (what, key, "present in records", have, "expected", expect)
    values = [r[key] for r in got if key in r]
    assert values == pytest.approx([r[key] for r in want if key in r], rel=rel, abs=abs), (what, key)
