"""Several finetune.py runs in one launch: one process start and one process group for a list of layouts.

On 2 cores the launch is what a test pays for (imports and rendezvous, ~10 s a process), not the 2-step
run. Each run here is `finetune.main(argv)` as the command line calls it. Between runs the process-wide
state a fresh process would not have is reset (accelerate's singletons, transformers' DeepSpeed config
reference) and the environment is put back as the launcher left it (a DeepSpeed or FSDP plugin writes
ACCELERATE_USE_* into it), so each layout sees what a run of its own would. The process group stays
up until the last run: accelerate and DeepSpeed join the one that exists.

    <launcher> tests/layouts.py SPEC.json
SPEC: {"common": [flags every run takes], "runs": {name: [flags]}, "out": folder, "cuda_path": [names],
"env": {name: {variable: value}} (a run's own environment on top of the launch's, e.g. a TOOLKIT_FAULT)}.
Each run writes OUT/name and its stdout and stderr to OUT/name.stdout.txt and OUT/name.stderr.txt; rank 0 writes
OUT/results.json: {name: {"exit": 0 or the exit code}}. The runs named in "cuda_path" take the launch set-up's GPU
branch on this CPU (`toolkit.parallel.launch.on_cuda` answers True): one process only, where accelerate then runs
DeepSpeed as on one GPU.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


class Tee:
    """This run's stdout into OUT/name.stdout.txt (the main rank's, where the toolkit's lines come from)
    as well as the launch's."""

    def __init__(self, *streams):
        self.streams = streams

    def write(self, text: str) -> int:
        for s in self.streams:
            s.write(text)
        return len(text)

    def flush(self) -> None:
        for s in self.streams:
            s.flush()

    def __getattr__(self, name: str):
        return getattr(self.streams[0], name)


def reset_process_state() -> None:
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()


def main(argv: list[str]) -> None:
    local_rank = [a for a in argv if a.startswith("--local_rank")]  # DeepSpeed's launcher: passed on to each run
    spec = json.loads(Path(next(a for a in argv if not a.startswith("--local_rank"))).read_text())
    out = Path(spec["out"])
    import torch.distributed as dist
    from accelerate import Accelerator

    import finetune
    from toolkit.parallel import launch

    on_cuda = launch.on_cuda

    Accelerator.end_training = lambda self: None  # keep the group for the next run; destroyed below
    launched_env = dict(os.environ)
    results = {}
    for name, flags in spec["runs"].items():
        os.environ.clear()
        os.environ.update(launched_env)
        os.environ.update(spec.get("env", {}).get(name, {}))
        reset_process_state()
        launch.on_cuda = (lambda: True) if name in spec.get("cuda_path", ()) else on_cuda
        group_before = dist.is_initialized()  # a run after the first finds the group up: only the first sets it up
        main_rank = int(os.environ.get("RANK", "0")) == 0
        with open(out / f"{name}.stdout.txt" if main_rank else os.devnull, "w") as log, \
                open(out / f"{name}.stderr.txt" if main_rank else os.devnull, "w") as err, \
                contextlib.redirect_stdout(Tee(sys.stdout, log)), contextlib.redirect_stderr(Tee(sys.stderr, err)):
            try:
                finetune.main([*local_rank, *spec["common"], "--output-dir", str(out / name), *flags])
                results[name] = {"exit": 0, "group_before": group_before}
            except SystemExit as e:  # a UserError, printed by finetune.main's handler
                results[name] = {"exit": e.code if isinstance(e.code, int) else 1, "group_before": group_before}
        print(f"layouts: {name} exit {results[name]['exit']}", file=sys.stderr, flush=True)

    if int(os.environ.get("RANK", "0")) == 0:
        (out / "results.json").write_text(json.dumps(results, indent=2))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)  # as finetune.py: no interpreter teardown with gloo objects alive
