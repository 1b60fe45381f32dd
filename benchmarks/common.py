"""What the benchmarks (`benchmarks/<name>.py`) share: where results go, how a peak is measured, how
gloo ranks and fresh child processes are started, how a step is timed.

Each benchmark states its own method in its docstring; the pieces here are the ones whose method
must be the same in every benchmark that uses it, so a figure means the same thing in every table.
A benchmark runs as `python -m benchmarks.<name>` from the checkout's root, which puts the root first
on `sys.path`: it measures this tree's toolkit, not an installed copy. Its child processes start the
same way (`-m`, from the root). Gloo ranks start through the tests' harness (`tests.distributed`).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"

RESULT = "RESULT "  # the prefix of the one stdout line a child process answers with


# ----------------------------------------------------------------------------- results


def write_pair(stem: Path | str, data: Any, markdown: str | list[str], *, indent: int = 2, echo: bool = True) -> None:
    """Write STEM.json (every figure, for tools and later re-rendering) and STEM.md (the table people
    read) from the same run, so the two never disagree; print the markdown unless `echo` is off.
    `markdown` as a list is its lines."""
    text = markdown if isinstance(markdown, str) else "\n".join(markdown) + "\n"
    Path(stem).parent.mkdir(parents=True, exist_ok=True)
    Path(f"{stem}.json").write_text(json.dumps(data, indent=indent) + "\n")
    Path(f"{stem}.md").write_text(text)
    if echo:
        print(text.rstrip("\n"))


def md_table(columns: list[str], rows: Iterable[Iterable[object]]) -> list[str]:
    """A markdown table's lines: header, rule, one line per row. Cells are written as given (format
    the numbers first: each table states its own precision); an empty cell is `| |`."""

    def line(cells: Iterable[object]) -> str:
        return "|" + "|".join(f" {c} " if str(c) else " " for c in cells) + "|"

    return [line(columns), "|" + "---|" * len(columns)] + [line(r) for r in rows]


def read_metrics(out: Path | str) -> list[dict]:
    """The records a toolkit run wrote to OUT/metrics.jsonl, in order: a benchmark of the toolkit's own
    loop reads the step times and token counts the run logged, as a user would."""
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def cpu_device() -> str:
    """The device a CPU benchmark names in its results: its timings depend on the core count."""
    return f"CPU, {os.cpu_count()} cores"


# ----------------------------------------------------------------------------- memory


def status_kib(field: str) -> int:
    """A `/proc/self/status` figure in KiB (VmRSS, VmHWM, RssAnon): the kernel's own count of this
    process's memory, which sees every allocator (torch's, glibc's, a library's) alike."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def reset_peak_rss() -> int:
    """Start a peak measurement now: the kernel's high-water mark (VmHWM) is reset to the current RSS
    (`echo 5 > /proc/self/clear_refs`, Linux >= 4.0), so what was allocated before (weights, inputs)
    is not in the peak. Returns the current RSS in KiB, for `peak_rss_mib`."""
    before = status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    return before


def peak_rss_mib(before_kib: int) -> float:
    """MiB the process's peak RSS rose above `before_kib` (from `reset_peak_rss`). A freed block goes back
    to the OS at once only if glibc mapped it (at or above its mmap threshold, which rises as blocks are
    freed): a toolkit run fixes the threshold at 1 MiB (`map_large_allocations`), so its RSS follows
    the live tensors; elsewhere the heap may keep freed memory."""
    return (status_kib("VmHWM") - before_kib) / 1024


class PeakSampler:
    """The largest value `read()` returns while the block runs, sampled from a thread every `every`
    seconds: for figures the kernel keeps no high-water mark of (anonymous RSS; RSS of a process
    whose mark another measurement resets). `start` is the value on entry."""

    def __init__(self, read: Callable[[], int], every: float):
        self.read, self.every = read, every

    def __enter__(self) -> PeakSampler:
        self.start = self.peak = self.read()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.read())
            self._stop.wait(self.every)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.read())


# ----------------------------------------------------------------------------- time


def sync() -> None:
    """Wait for queued GPU work, so that a clock read after it counts it (nothing on a CPU)."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def median_seconds(step: Callable[[], object], repeats: int, warmup: int = 0) -> float:
    """Median wall seconds of `repeats` calls of `step`, after `warmup` untimed ones (first-call
    allocation, lazy state). The median, because on a shared machine a hiccup lands on single calls."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ----------------------------------------------------------------------------- models


def llama(seed: int = 0, **config: Any):
    """A config-built Llama with seeded random weights: the same model in every run, rank and arm
    (what is measured is time, memory or traffic, which do not depend on trained values)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**config))


def save_llama(path: Path | str, tokenizer: Any = None, **config: Any) -> Path:
    """`llama(**config)` saved as a standard HF folder (with `tokenizer`, when given), so the runs
    load it through `from_pretrained` as a user's model is loaded."""
    llama(**config).save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return Path(path)


# ----------------------------------------------------------------------------- processes


def print_result(result: Any) -> None:
    """A child's answer to `child_result`: one stdout line, whatever else the libraries print."""
    print(RESULT + json.dumps(result), flush=True)


def child_result(args: list[str], *, env: dict[str, str] | None = None, what: str = "child") -> Any:
    """Run `python ARGS...` from the checkout root and return what it passed to `print_result`. A
    fresh process per case: its peak memory, imports and caches are its own. A benchmark runs its
    own child as `["-m", "benchmarks.<name>", "--child", ...]`. Raises RuntimeError with the end of
    its stderr when no answer came."""
    p = subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT, env=env)
    line = next((x for x in p.stdout.splitlines() if x.startswith(RESULT)), None)
    if line is None:
        raise RuntimeError(f"{what} failed:\n{p.stderr[-3000:]}")
    return json.loads(line[len(RESULT):])


def _in_group(fn: Callable[..., Any], *args: Any) -> Any:
    """One rank of `spawn_ranks`: `fn(rank, world, *args)` inside the gloo group of the launched ranks."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    result = fn(dist.get_rank(), dist.get_world_size(), *args)
    dist.destroy_process_group()
    return result


def spawn_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 1800) -> dict[int, Any]:
    """`fn(rank, world, *args)` on `world` spawned processes joined in one gloo group (env://, a free
    local port): {rank: what fn returned}. `fn` must be a module-level function (spawn pickles it by
    name). Spawned, not forked: each rank starts clean, as a launched rank does. The ranks are the
    tests' (`tests.distributed.run_distributed`: rank 0, which holds the rendezvous store, stays up
    until every rank has returned; the ranks are stopped however the wait ends); a rank that raises
    stops them all, with its traceback in the error."""
    from tests.distributed import run_distributed

    return dict(enumerate(run_distributed(_in_group, world, fn, *args, timeout=timeout, spawn=True)))
