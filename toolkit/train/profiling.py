"""--profile: torch.profiler over a few steps after the first (its checks and the allocator's growth), so
what a step spends that is not the model's arithmetic (host syncs, Python per module, small kernels, mask
building) has names and times. Written beside the metrics: `profile.txt` (the top entries by self time,
torch's own table) and `profile.json` (the same entries as numbers, for scripts: the GPU user part puts
them in its report), and a chrome trace `profile_trace.json`. The profiled steps' records are marked
`profiled` (their tokens/s carry the profiler's own overhead).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

# steps FIRST .. FIRST + STEPS - 1 (of the run's own), the table's rows
FIRST, STEPS, TOP = 4, 3, 25


def activities(device_type: str) -> list:
    out = [torch.profiler.ProfilerActivity.CPU]
    if device_type == "cuda":
        out.append(torch.profiler.ProfilerActivity.CUDA)
    return out


def top_entries(profile, device_type: str, n: int = TOP) -> list[dict]:
    """The `n` ops with the most self time (the device's, on a GPU), per profiled step: name, calls, self
    and total milliseconds."""
    device = device_type == "cuda"
    rows = []
    for e in profile.key_averages():
        self_us = e.self_device_time_total if device else e.self_cpu_time_total
        rows.append({"name": e.key, "calls": e.count, "self_ms": self_us / 1e3,
                     "cpu_self_ms": e.self_cpu_time_total / 1e3, "cpu_total_ms": e.cpu_time_total / 1e3})
    rows.sort(key=lambda r: r["self_ms"], reverse=True)
    return rows[:n]


class StepProfiler:
    """Starts before step FIRST (of this run: a resumed one counts from its own first) and stops after STEPS
    steps, writing what it saw to `out_dir` (main process; every rank profiles its own steps)."""

    def __init__(self, out_dir: Path, device_type: str, first_step: int, total_steps: int, main: bool, say):
        self.out_dir, self.device_type, self.main, self.say = out_dir, device_type, main, say
        self.start = first_step + FIRST - 1
        self.stop = min(self.start + STEPS - 1, total_steps)
        self.profile = None

    def active(self, step: int) -> bool:
        return self.start <= step <= self.stop

    def before(self, step: int) -> None:
        if step == self.start:
            self.profile = torch.profiler.profile(activities=activities(self.device_type))
            self.profile.__enter__()

    def after(self, step: int) -> None:
        if self.profile is None or step != self.stop:
            return
        if self.device_type == "cuda":
            torch.cuda.synchronize()
        self.profile.__exit__(None, None, None)
        steps = self.stop - self.start + 1
        if self.main:
            entries = top_entries(self.profile, self.device_type)
            for e in entries:
                for k in ("self_ms", "cpu_self_ms", "cpu_total_ms"):
                    # per step
                    e[k] = round(e[k] / steps, 3)
            sort = "self_cuda_time_total" if self.device_type == "cuda" else "self_cpu_time_total"
            table = self.profile.key_averages().table(sort_by=sort, row_limit=TOP)
            (self.out_dir / "profile.txt").write_text(f"steps {self.start}-{self.stop} (totals over {steps})\n"
                                                      f"{table}\n")
            (self.out_dir / "profile.json").write_text(json.dumps({"steps": [self.start, self.stop],
                                                                   "per_step_top": entries}, indent=1))
            self.profile.export_chrome_trace(str(self.out_dir / "profile_trace.json"))
            head = ", ".join(f"{e['name']} {e['self_ms']:.1f} ms" for e in entries[:3])
            self.say(f"profile: steps {self.start}-{self.stop} in {self.out_dir / 'profile.txt'}; the most self "
                     f"time a step: {head}")
        self.profile = None
