"""Resuming a run from a checkpoint: which one, whether it belongs to this run, and restoring it.

A checkpoint records a fingerprint: a hash of the dataset file and every setting that changes the
trained result. Resuming with a different one is refused with one line naming what changed
(`--resume-ignore-mismatch` overrides); a different world size or parallel layout is refused too,
since optimizer states are saved per rank.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from toolkit.config import Config
from toolkit.errors import UserError
from toolkit.train.checkpoint import TRAINER_STATE, complete_checkpoints

# Settings that change what a run computes (not how fast or where it logs).
RESULT_KEYS = ("model", "method", "lora_r", "lora_alpha", "lora_dropout", "lora_targets", "format", "columns",
               "system_prompt", "seq_len", "train_on_prompt", "eval_split", "packing", "micro_batch_size", "grad_accum", "lr", "lr_schedule",
               "warmup_steps", "weight_decay", "max_grad_norm", "epochs", "max_steps", "seed", "mixed_precision",
               "loss")
LAYOUT_KEYS = ("zero_stage", "offload", "fsdp", "fsdp_sharding", "dp_shard", "dp_replicate", "cp", "tp", "pp",
               "pp_microbatches")

NEWER_LAYOUT_KEYS = {"dp_shard": 0, "dp_replicate": 0, "cp": 1}  # what older checkpoints ran with


@dataclass
class ResumePoint:
    path: Path
    step: int
    state: dict


def dataset_digest(spec: str) -> str:
    """sha256 of the dataset file (or the built-in dataset's name)."""
    path = Path(spec)
    if not path.is_file():
        return "spec:" + spec
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fingerprint(cfg: Config) -> dict:
    flat = cfg.flat()
    return {"dataset": dataset_digest(cfg.data.dataset),
            "settings": {k: flat[k] for k in RESULT_KEYS},
            "layout": {k: flat[k] for k in LAYOUT_KEYS}}


def find_checkpoint(cfg: Config) -> ResumePoint | None:
    """The checkpoint --resume names (None without --resume, or for 'auto' in a folder without one)."""
    spec = cfg.output.resume
    if not spec:
        return None
    if spec == "auto":
        found = complete_checkpoints(Path(cfg.output.output_dir))
        if not found:
            return None  # nothing to resume: start from step 0 (what an elastic restart before the first save needs)
        path = found[-1]
    else:
        path = Path(spec)
        if not path.is_dir():
            raise UserError(f"--resume {spec}: folder not found")
    state_file = path / TRAINER_STATE
    if not state_file.is_file():
        raise UserError(f"--resume {path}: not a complete checkpoint (no {TRAINER_STATE}); "
                        f"use --resume auto to pick the newest complete one")
    try:
        state = json.loads(state_file.read_text())
        step = int(state["step"])
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"--resume {path}: {TRAINER_STATE} is unreadable ({e}); the checkpoint is damaged, "
                        "resume from an earlier one") from None
    return ResumePoint(path, step, state)


def mismatch(point: ResumePoint, cfg: Config, world: int) -> list[str]:
    """What differs between the checkpoint's run and this one."""
    saved, now = point.state.get("fingerprint", {}), fingerprint(cfg)
    problems = []
    if saved.get("dataset") != now["dataset"]:
        problems.append(f"the dataset changed ({cfg.data.dataset} hashes differently)")
    for k, v in now["settings"].items():
        if saved.get("settings", {}).get(k) != v:
            problems.append(f"--{k.replace('_', '-')} was {saved.get('settings', {}).get(k)!r}, now {v!r}")
    return problems


def layout_problems(point: ResumePoint, cfg: Config, world: int) -> list[str]:
    """Optimizer states are per rank: the world size and parallel layout must match (not overridable)."""
    saved, now = point.state.get("fingerprint", {}).get("layout", {}), fingerprint(cfg)["layout"]
    if point.state.get("resumable") is False:
        return ["it holds the model weights only (written by an older version that did not save ZeRO/FSDP "
                "optimizer states); start a new run from it instead"]
    problems = []
    if point.state.get("world_size") != world:
        problems.append(f"it was saved by {point.state.get('world_size')} processes and this run has {world}")
    for k, v in now.items():
        if saved.get(k, NEWER_LAYOUT_KEYS.get(k)) != v:  # a checkpoint from before the key: its old meaning
            problems.append(f"--{k.replace('_', '-')} was {saved.get(k)!r}, now {v!r}")
    missing = [r for r in range(world) if not (point.path / f"rank{r}.pt").is_file()]
    if missing and not problems:
        problems.append(f"rank files {', '.join(f'rank{r}.pt' for r in missing)} are missing")
    return problems


def check_resume(point: ResumePoint | None, cfg: Config, world: int) -> None:
    """One line for everything that stops this checkpoint from resuming this run."""
    if point is None:
        return
    layout = layout_problems(point, cfg, world)
    if layout:
        raise UserError(f"--resume {point.path}: cannot resume: {'; '.join(layout)}. Resume with the same "
                        "launch and parallel flags, or start a new run from its model folder (--model "
                        f"{point.path})")
    changed = mismatch(point, cfg, world)
    if changed and not cfg.output.resume_ignore_mismatch:
        raise UserError(f"--resume {point.path}: this is not the run that wrote it: {'; '.join(changed)}. "
                        "Restore them, or pass --resume-ignore-mismatch to continue anyway")


def resume_point(cfg: Config, world: int) -> ResumePoint | None:
    """The checkpoint to resume from, checked against this run (None: start from step 0)."""
    point = find_checkpoint(cfg)
    check_resume(point, cfg, world)
    return point
