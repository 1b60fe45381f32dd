"""The output folder: its complete checkpoints (`TRAINER_STATE`, `complete_checkpoints`, `checkpoint_step`),
a finished run's step (`finished_step`) and the checkpoints past it (`later_checkpoints`), and what
`--output-dir`, `--resume auto` and `--continue-finished` may do there (`output_dir_problems`,
`finished_problems`). Standard library only: config validation calls these, and the train layer
finds checkpoints with them."""

from __future__ import annotations

import os
from pathlib import Path


# a checkpoint is complete when this is in it (written last)
TRAINER_STATE = "trainer_state.json"


def complete_checkpoints(out_dir: Path) -> list[Path]:
    """checkpoint-N folders (renamed from .tmp once complete) holding a trainer_state.json, oldest first."""
    found = [p for p in Path(out_dir).glob("checkpoint-*")
             if p.is_dir() and p.name.split("-", 1)[1].isdigit() and (p / TRAINER_STATE).is_file()]
    return sorted(found, key=lambda p: int(p.name.split("-", 1)[1]))


def checkpoint_step(path: Path) -> int:
    return int(path.name.split("-", 1)[1])


def finished_step(out_dir: Path) -> int | None:
    """The step a finished run's `final/` was saved at (its summary.json), 0 where final/ exists but
    the step is unknown (the run stopped between the save and the summary); None: no final/."""
    import json

    out = Path(out_dir)
    if not (out / "final").is_dir():
        return None
    try:
        return int(json.loads((out / "summary.json").read_text())["steps"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def later_checkpoints(out_dir: Path) -> list[Path]:
    """The complete checkpoints `--resume auto` may continue from: all of them, or in a finished run's
    folder those past its final/ (written by a run that was continuing it)."""
    done, saved = finished_step(out_dir), complete_checkpoints(out_dir)
    if done is None:
        return saved
    # final/'s step unknown: none is later
    return [c for c in saved if done and checkpoint_step(c) > done]


def finished_problems(output_dir: str, continue_finished: bool, max_steps: int) -> list[str]:
    """`--resume auto` in a finished run's folder: stop, saying so (its final/ is kept), unless
    `--continue-finished` asks to train it on, from its newest checkpoint, past the steps it finished."""
    out = Path(output_dir)
    done = finished_step(out)
    if done is None or later_checkpoints(out):
        return ["--continue-finished: " + output_dir + " holds no finished run (no final/); --resume auto "
                "continues an unfinished one without it"] if continue_finished and done is None else []
    at = f" at step {done}" if done else ""
    saved = complete_checkpoints(out)
    if not continue_finished:
        further = (f"--continue-finished --max-steps N (N > {done or 'its steps'}) trains it further from "
                   f"{saved[-1].name}, " if saved else "")
        return [f"--resume auto: {output_dir} holds a finished run (final/{at}) and no later checkpoint: there is "
                f"nothing to resume. {further}--overwrite-output-dir starts it again, or choose another --output-dir"]
    if not saved:
        return [f"--continue-finished: {output_dir} has no checkpoint to continue from (the run saved none: "
                "--save-every N keeps some); start a new run from its final/ in another --output-dir"]
    if max_steps <= done:
        return [f"--continue-finished: the run finished {done} steps; pass --max-steps beyond them "
                f"(got {max_steps if max_steps > 0 else 'none, so --epochs decides'})"]
    return []


def output_dir_problems(output_dir: str, overwrite: bool, resume: str, continue_finished: bool = False,
                        max_steps: int = -1) -> list[str]:
    """A file in the way, a folder that cannot be written, a run's folder that is not empty, or
    `--resume auto` on a run that is finished. Each refusal offers only what would work there."""
    out = Path(output_dir)
    if out.exists() and not out.is_dir():
        return [f"--output-dir {output_dir} is a file, not a folder"]
    unwritable = _unwritable(out)
    if unwritable:
        return [f"--output-dir {output_dir}: {unwritable}; choose a folder you can write to"]
    if continue_finished and resume != "auto":
        return ["--continue-finished goes with --resume auto (it continues the finished run in --output-dir)"]
    if resume == "auto":
        return finished_problems(output_dir, continue_finished, max_steps)
    if out.is_dir() and any(not f.name.startswith(PROBE) for f in out.iterdir()) and not overwrite and not resume:
        return [_not_empty(output_dir)]
    return []


def _not_empty(output_dir: str) -> str:
    out = Path(output_dir)
    done, saved = finished_step(out), complete_checkpoints(out)
    if done is not None:
        at = f" at step {done}" if done else ""
        further = (f"--resume auto --continue-finished --max-steps N (N > {done or 'its steps'}) trains it further, "
                   if saved else "")
        return (f"--output-dir {output_dir} holds a finished run (final/{at}); {further}--overwrite-output-dir "
                "replaces it, or choose another folder")
    if saved:
        return (f"--output-dir {output_dir} is not empty; pass --resume auto to continue its run (from "
                f"{saved[-1].name}), --overwrite-output-dir to replace it, or choose another folder")
    return (f"--output-dir {output_dir} is not empty and holds no checkpoint to resume; pass --overwrite-output-dir "
            "to replace this toolkit's files in it (others are kept), or choose another folder")


# `_unwritable`'s file: another rank checking the same folder at once may see it
PROBE = ".toolkit-probe-"


def _unwritable(out: Path) -> str | None:
    """Why `out` cannot be created or written (None: it can): a file is made and removed in it, or
    in the nearest folder above it that exists, so root on a read-only mount is caught too."""
    import errno
    import tempfile

    here = out.absolute()
    while not here.exists():
        here = here.parent
    if not here.is_dir():
        return f"{here} is a file, so no folder can be made under it"
    try:
        fd, probe = tempfile.mkstemp(dir=here, prefix=PROBE)
    except OSError as e:
        why = "a read-only file system" if e.errno == errno.EROFS else (e.strerror or str(e)).lower()
        return f"{here} cannot be written ({why})"
    os.close(fd)
    os.unlink(probe)
    return None
