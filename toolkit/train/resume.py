"""Resuming a run from a checkpoint: which one, whether it belongs to this run, and restoring it.

A checkpoint records a fingerprint: a hash of the dataset file and every setting that changes the
trained result, the global batch (examples per optimizer step) among them. Resuming with a
different one is refused with one line naming what changed (`--resume-ignore-mismatch` overrides).

A sharded checkpoint resumes on any world size or layout (`toolkit.train.sharded_state` reshards
it): the data position is global (steps x global batch examples), and the global batch is kept by
re-splitting it into micro-batch x accumulation x data-parallel ranks, said in one line. Per-rank
random streams (dropout) cannot carry over to other ranks and are reseeded to seed + step on each
rank. DeepSpeed's per-rank ZeRO checkpoints resume on the same world size and layout only.

`settings` below is the run's flat key -> value settings (`Config.flat()`): a fingerprint is taken over
keys of every section, by name.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from toolkit.config.datasets import dataset_digest
from toolkit.errors import UserError
from toolkit.layout.flags import ParallelConfig
from toolkit.config.output_dir import (TRAINER_STATE, complete_checkpoints, finished_problems, finished_step,
                                      later_checkpoints)
from toolkit.config.objectives import DEFAULT_SIMPO_GAMMA
from toolkit.train.manifest import damage

# Settings that change what a run computes (not how fast or where it logs).
RESULT_KEYS = ("model", "method", "lora_r", "lora_alpha", "lora_dropout", "lora_targets", "format", "columns",
               "system_prompt", "seq_len", "train_on_prompt", "eval_split", "packing", "lr", "lr_schedule",
               "warmup_steps", "weight_decay", "max_grad_norm", "epochs", "max_steps", "seed", "mixed_precision",
               "loss", "streaming", "router_aux_loss_coef", "objective", "beta", "simpo_gamma", "label_smoothing",
               "desirable_weight", "undesirable_weight", "merge_adapter", "chat_template")
NEWER_RESULT_KEYS = {"streaming": False, "router_aux_loss_coef": None, "objective": "sft", "beta": None,
                     "simpo_gamma": DEFAULT_SIMPO_GAMMA, "label_smoothing": 0.0,
                     "desirable_weight": 1.0, "undesirable_weight": 1.0,
                     # what older checkpoints ran with
                     "merge_adapter": False, "chat_template": ""}
LAYOUT_KEYS = ("zero_stage", "offload", "fsdp", "fsdp_sharding", "dp_shard", "dp_replicate", "cp", "tp", "pp",
               "pp_microbatches")

# what older checkpoints ran with
NEWER_LAYOUT_KEYS = {"dp_shard": 0, "dp_replicate": 0, "cp": 1}


# older checkpoints fingerprinted these in place of the global batch
BATCH_KEYS = ("micro_batch_size", "grad_accum")


@dataclass
class ResumePoint:
    path: Path
    step: int
    state: dict
    # the world size and layout that wrote it: each rank reads its own file
    same_layout: bool = True
    # what resuming changed (the batch re-split), for the log
    notes: tuple[str, ...] = ()
    # (micro-batch, accumulation) that keep the checkpoint's global batch
    split: tuple[int, int] | None = None

    @property
    def sharded(self) -> bool:
        return self.state.get("format") == "sharded"


def global_batch(settings: dict[str, Any], data_ranks: int) -> int:
    return settings["micro_batch_size"] * settings["grad_accum"] * data_ranks


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".index.json")


def model_identity(name: str) -> dict | None:
    """What `--model` holds, beyond its name: config.json's SHA-256 (an adapter folder's:
    adapter_config.json's) and each weight file's size and the SHA-256 of its first and last MiB
    (hashing whole files would read an 8B model at every checkpoint; the ends hold the header and
    tensors at both ends). None: a hub id that is not in the local cache."""
    from toolkit.config.schema import DEFAULT_MODEL
    from toolkit.model.source import default_model_dir, is_adapter_dir

    folder = default_model_dir() if name == DEFAULT_MODEL else Path(name).expanduser()
    adapter = is_adapter_dir(folder) and not (folder / "config.json").is_file()
    config = "adapter_config.json" if adapter else "config.json"
    if not (folder / config).is_file():
        from huggingface_hub import try_to_load_from_cache

        try:
            cached = try_to_load_from_cache(name, "config.json")
        # not a hub id either
        except ValueError:
            return None
        if not isinstance(cached, str):
            return None
        folder = Path(cached).parent
    weights = {f.name: _ends(f) for f in sorted(folder.iterdir()) if f.name.endswith(WEIGHT_SUFFIXES)}
    return {"config": hashlib.sha256((folder / config).read_bytes()).hexdigest(), "weights": weights}


def _ends(path: Path, span: int = 1 << 20) -> str:
    size = path.stat().st_size
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(span))
        f.seek(max(size - span, 0))
        h.update(f.read(span))
    return f"{size} bytes, sha256 of the ends {h.hexdigest()[:16]}"


def model_changes(saved: dict, now: dict | None) -> list[str]:
    """How the model behind `--model` differs from the one the checkpoint was trained from."""
    if now is None:
        return []
    changes = ["its config.json differs"] if saved.get("config") != now["config"] else []
    before, after = saved.get("weights", {}), now["weights"]
    for name in sorted(before.keys() | after.keys()):
        if before.get(name) != after.get(name):
            changes.append(f"{name} was {before.get(name, 'absent')}, now {after.get(name, 'absent')}")
    return changes


def fingerprint(settings: dict[str, Any], data_ranks: int) -> dict:
    return {"dataset": dataset_digest(settings["dataset"]), "model_files": model_identity(settings["model"]),
            "settings": {**{k: settings[k] for k in RESULT_KEYS}, "global_batch": global_batch(settings, data_ranks)},
            "layout": fingerprint_layout(settings)}


def resplit(total: int, micro: int, data_ranks: int) -> tuple[int, int] | None:
    """(micro-batch, accumulation) with micro x accumulation x data_ranks = total: the micro-batch
    kept where it divides the per-rank share, else the largest one below it that does (None: the
    ranks cannot share `total` evenly)."""
    if total % data_ranks:
        return None
    share = total // data_ranks
    micro = max(m for m in range(1, min(micro, share) + 1) if share % m == 0)
    return micro, share // micro


def find_checkpoint(settings: dict[str, Any], damaged: Callable[[Path], str | None] = damage) -> ResumePoint | None:
    """The checkpoint --resume names (None without --resume, or for 'auto' in a folder without one),
    checked against its manifest: `--resume auto` passes over damaged ones to the newest intact one
    (saying which file was damaged), a named damaged one is refused in one line."""
    spec = settings["resume"]
    if not spec:
        return None
    if spec != "auto":
        path = Path(spec)
        if not path.is_dir():
            raise UserError(f"--resume {spec}: folder not found")
        if not (path / TRAINER_STATE).is_file():
            raise UserError(f"--resume {path}: not a complete checkpoint (no {TRAINER_STATE}); "
                            f"use --resume auto to pick the newest complete one")
        problem = damaged(path)
        if problem:
            raise UserError(f"--resume {path}: the checkpoint is damaged: {problem}; resume from an earlier one "
                            "(--resume auto picks the newest intact one)")
        return _read_point(path)
    out = Path(settings["output_dir"])
    refused = finished_problems(str(out), settings["continue_finished"], settings["max_steps"])
    # checked at start-up too; the folder may have changed since
    if refused:
        raise UserError(refused[0])
    found, done, continuing = later_checkpoints(out), finished_step(out), []
    # --continue-finished: from its newest checkpoint, past final/'s step
    if not found and done is not None:
        found = complete_checkpoints(out)
        continuing = [f"--continue-finished: the run finished at step {done}; training on to step "
                      f"{settings['max_steps']}, its learning-rate schedule stretched to that; final/ is replaced at "
                      "the end"]
    skipped = []
    for path in reversed(found):
        problem = damaged(path)
        if problem is None:
            point = _read_point(path)
            notes = tuple(f"--resume auto: skipped {name}, damaged: {why}" for name, why in skipped) + tuple(continuing)
            return ResumePoint(point.path, point.step, point.state, notes=notes)
        skipped.append((path.name, problem))
    if skipped:
        raise UserError(f"--resume auto: every checkpoint in {settings['output_dir']} is damaged "
                        f"({'; '.join(f'{n}: {why}' for n, why in skipped)}); restore one, or start again "
                        "without --resume in another --output-dir")
    # nothing to resume: start from step 0 (what an elastic restart before the first save needs)
    return None


def _read_point(path: Path) -> ResumePoint:
    try:
        state = json.loads((path / TRAINER_STATE).read_text())
        step = int(state["step"])
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"--resume {path}: {TRAINER_STATE} is unreadable ({e}); the checkpoint is damaged, "
                        "resume from an earlier one") from None
    return ResumePoint(path, step, state)


def mismatch(point: ResumePoint, settings: dict[str, Any], data_ranks: int) -> list[str]:
    """What differs between the checkpoint's run and this one (the batch split aside: `keep_global_batch`)."""
    saved, now = point.state.get("fingerprint", {}), fingerprint(settings, data_ranks)
    then = saved.get("settings", {})
    problems = []
    if saved.get("dataset") != now["dataset"]:
        problems.append(f"the dataset changed ({settings['dataset']} hashes differently)")
    changes = model_changes(saved["model_files"], now["model_files"]) if saved.get("model_files") else []
    if changes:
        problems.append(f"the model at {settings['model']} changed since the checkpoint ({', '.join(changes[:4])})")
    # --continue-finished trains past the steps the checkpoint's run was asked for: only their number differs
    beyond = ("max_steps", "epochs") if settings["continue_finished"] else ()
    keys = [k for k in now["settings"] if k != "global_batch" and k not in beyond]
    # an older checkpoint: same layout, so the same split
    if "global_batch" not in then:
        now["settings"].update({k: settings[k] for k in BATCH_KEYS})
        keys += list(BATCH_KEYS)
    for k in keys:
        if then.get(k, NEWER_RESULT_KEYS.get(k)) != now["settings"][k]:
            problems.append(f"--{k.replace('_', '-')} was {then.get(k)!r}, now {now['settings'][k]!r}")
    return problems


def keep_global_batch(point: ResumePoint, settings: dict[str, Any], data_ranks: int,
                      deepspeed: bool) -> tuple[tuple[int, int] | None, list[str]]:
    """((micro-batch, accumulation) that re-split the checkpoint's global batch over this run's
    data-parallel ranks, the line that says how), or (None, []) when this run's flags keep it; raises
    where it cannot be split evenly, or under DeepSpeed, whose engine is configured with the flags'."""
    total = point.state.get("fingerprint", {}).get("settings", {}).get("global_batch")
    if total is None or total == global_batch(settings, data_ranks):
        return None, []
    micro, accumulation = settings["micro_batch_size"], settings["grad_accum"]
    split = resplit(total, micro, data_ranks)
    if split is None:
        raise UserError(f"--resume {point.path}: its global batch of {total} examples cannot be shared evenly by "
                        f"{data_ranks} data-parallel ranks; launch a layout whose data-parallel size divides {total}")
    if deepspeed:
        raise UserError(f"--resume {point.path}: its global batch is {total} examples, this launch asks for "
                        f"{global_batch(settings, data_ranks)}; DeepSpeed resumes with the batch it saved: pass "
                        f"--micro-batch-size {split[0]} --grad-accum {split[1]}")
    asked = f"{micro} x {accumulation} x {data_ranks} = {global_batch(settings, data_ranks)}"
    return split, [f"global batch {total} kept: micro-batch {split[0]} x accumulation {split[1]} x {data_ranks} "
                   f"data-parallel ranks (this launch asked for {asked})"]


def same_layout(point: ResumePoint, settings: dict[str, Any], world: int) -> bool:
    saved, now = point.state.get("fingerprint", {}).get("layout", {}), fingerprint_layout(settings)
    return point.state.get("world_size") == world and all(
        # older checkpoints: the old meaning
        saved.get(k, NEWER_LAYOUT_KEYS.get(k)) == v for k, v in now.items())


def fingerprint_layout(settings: dict[str, Any]) -> dict:
    return {k: settings[k] for k in LAYOUT_KEYS}


def layout_problems(point: ResumePoint, settings: dict[str, Any], world: int, deepspeed: bool) -> list[str]:
    """Whether the checkpoint resumes on this layout (`toolkit.layout.rules.resume_problems`), and
    whether the files that layout reads are there."""
    from toolkit.layout.rules import resume_problems

    if point.state.get("resumable") is False:
        return ["it holds the model weights only (written by an older version that did not save ZeRO/FSDP "
                "optimizer states); start a new run from it instead"]
    saved = point.state.get("fingerprint", {}).get("layout", {})
    # from before a key: its old meaning
    saved = {k: saved.get(k, NEWER_LAYOUT_KEYS.get(k)) for k in LAYOUT_KEYS}
    problems = resume_problems("sharded" if point.sharded else "hf", point.state.get("world_size"), world, saved,
                               fingerprint_layout(settings), deepspeed)
    if point.sharded:
        return problems or ([] if (point.path / "rank0.pt").is_file() else ["rank0.pt is missing"])
    missing = [r for r in range(world) if not (point.path / f"rank{r}.pt").is_file()]
    if missing and not problems:
        problems.append(f"rank files {', '.join(f'rank{r}.pt' for r in missing)} are missing")
    if problems:
        problems.append("DeepSpeed ZeRO checkpoints (per-rank partitions) resume on the same launch and parallel "
                        "flags only")
    return problems


def check_resume(point: ResumePoint | None, settings: dict[str, Any], world: int, data_ranks: int,
                 deepspeed: bool = False) -> ResumePoint | None:
    """One line for everything that stops this checkpoint from resuming this run; the point with
    how this run continues it (same layout or resharded, the batch re-split)."""
    if point is None:
        return None
    layout = layout_problems(point, settings, world, deepspeed)
    if layout:
        raise UserError(f"--resume {point.path}: cannot resume: {'; '.join(layout)}. Or start a new run from its "
                        f"weights: python -m toolkit convert-checkpoint {point.path} --output DIR, then --model DIR")
    changed = mismatch(point, settings, data_ranks)
    if changed and not settings["resume_ignore_mismatch"]:
        raise UserError(f"--resume {point.path}: this is not the run that wrote it: {'; '.join(changed)}. "
                        "Restore them, or pass --resume-ignore-mismatch to continue anyway")
    same = same_layout(point, settings, world)
    notes = list(point.notes)
    notes += [] if same else [f"resharding: the checkpoint was written by {point.state.get('world_size')} processes "
                             f"({point.state.get('layout', '?')}); random streams reseeded to seed + step per rank"]
    split, said = keep_global_batch(point, settings, data_ranks, deepspeed)
    return ResumePoint(point.path, point.step, point.state, same, tuple(notes + said), split)


def resume_point(settings: dict[str, Any], parallel: ParallelConfig, accelerator) -> ResumePoint | None:
    """The checkpoint to resume from, checked against the layout `parallel` gives the launched world
    (None: start from step 0). The main process reads and verifies it and tells the others (each
    would read every file again). Its `split`, when set, is the (micro-batch, accumulation) this run
    must take: the caller's new config."""
    import os

    from toolkit.layout.rules import accelerate_plugin, dims_for

    world = accelerator.num_processes
    if world == 1:
        found = find_checkpoint(settings)
    else:
        import torch.distributed as dist

        verdict: list = [None]
        if accelerator.is_main_process:
            try:
                verdict = [("found", find_checkpoint(settings))]
            except UserError as e:
                verdict = [("error", str(e))]
        dist.broadcast_object_list(verdict, src=0)
        kind, found = verdict[0]
        if kind == "error":
            raise UserError(found)
    dims, _ = dims_for(parallel, world, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    return check_resume(found, settings, world, dims.dp, accelerate_plugin(parallel) == "deepspeed")


def resumed_weights(model, point: ResumePoint | None, method: str):
    """`model` with a DeepSpeed-format checkpoint's weights written in, once `parallelize` shaped it (its
    adapters are there; DeepSpeed's layouts cut nothing, and its engine partitions at `prepare`); a sharded
    checkpoint is read into each layout's own pieces after `prepare` (`checkpoint.restore_sharded`)."""
    if point is not None and not point.sharded:
        from toolkit.train.checkpoint import restore_weights

        restore_weights(model, point.path, method)
    return model
