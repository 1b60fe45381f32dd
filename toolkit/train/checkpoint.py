"""Saving standard Hugging Face folders (a full model or a peft adapter, tokenizer included) and
resumable checkpoints.

Everything is written to `<name>.tmp` and renamed into place only when every rank's part is
written, so a crash mid-save never leaves a half-written folder under the final name. A checkpoint
holds `trainer_state.json` (step, data position, fingerprint, layout, config) and one `rank{r}.pt`
per rank (scheduler, optimizer hyperparameters, fp16 gradient scaler and RNG states, read back
with `torch.load(weights_only=True)`), and the weights and optimizer state in one of two formats:

- "sharded" (every layout but DeepSpeed ZeRO): `state/`, a `torch.distributed.checkpoint` folder
  where each rank wrote its own pieces of the trainable parameters and of their optimizer state
  (`toolkit.train.sharded_state`), readable by any other layout; beside it the model's
  `config.json` (or `adapter_config.json`) and the tokenizer, so `convert_checkpoint` can write a
  standard HF folder from it on one process.
- "hf" (DeepSpeed ZeRO-1/2/3, which keeps its own partitioning): the gathered HF folder plus each
  rank's ZeRO optimizer partition in `rank{r}.pt` (`optimizer_state`); resumed on the same layout only.
"""

from __future__ import annotations

import errno
import json
import os
import random
import re
import shutil
from functools import partial
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from toolkit.errors import UserError
from toolkit.parallel import any_rank
from toolkit.parallel.zero import load_full_state_dict
from toolkit.train.manifest import MANIFEST, damage, write_manifest
# the names checkpoints are read by
from toolkit.config.output_dir import TRAINER_STATE, complete_checkpoints  # noqa: F401
# the DCP folder inside checkpoint-N (toolkit.train.sharded_state, imported only where a checkpoint is
# written or read: torch.distributed.checkpoint costs ~0.8 s of a run's start-up on 2 cores)
STATE_DIR = "state"


def _write_model(accelerator, model, tokenizer, folder: Path, state: dict) -> None:
    """The HF folder, written by the main process from the gathered `state` (complete on the main
    process only under ZeRO-3); `model` is the unwrapped HF model or peft model."""
    if accelerator.is_main_process:
        state = {k: v.contiguous() for k, v in state.items()}
        model.save_pretrained(folder, state_dict=state, safe_serialization=True)
        tokenizer.save_pretrained(folder)


def _fresh_tmp(accelerator, path: Path) -> Path:
    tmp = path.with_name(path.name + ".tmp")
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    return tmp


def _publish(accelerator, tmp: Path, path: Path) -> None:
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    accelerator.wait_for_everyone()


def save_final(strategy, model, tokenizer, path: Path) -> dict[str, torch.Tensor]:
    """Every rank must call this: sharded strategies gather the state dict collectively. Returns the
    tensors written, by the names they were written under (main process; empty elsewhere), for the
    integrity check to compare the files with. A full disk is one line on every rank, the
    checkpoints beside it intact."""
    from toolkit.train.integrity import saved_state

    accelerator = strategy.accelerator
    tmp = _fresh_tmp(accelerator, path)
    unwrapped, state = strategy.unwrap(model), strategy.state_dict(model)
    failed = None
    try:
        _write_model(accelerator, unwrapped, tokenizer, tmp, state)
    except Exception as e:
        failed = write_failure(e, tmp)
        if failed is None:
            raise
    _stop_if_failed(accelerator, failed, tmp, path, lambda: sum(_local_bytes(v) for v in state.values()))
    _publish(accelerator, tmp, path)
    return saved_state(unwrapped, state) if accelerator.is_main_process else {}


def rng_state() -> dict:
    """Python, numpy and torch generator states as weights_only-loadable values."""
    kind, keys, pos = random.getstate()[0], random.getstate()[1], random.getstate()[2]
    np_state = np.random.get_state()
    return {"python": [kind, list(keys), pos],
            "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]],
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def set_rng_state(state: dict) -> None:
    kind, keys, pos = state["python"]
    random.setstate((kind, tuple(keys), pos))
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _write_model_files(accelerator, model, tokenizer, folder: Path) -> None:
    """What a standard HF folder holds besides the weights: the config (the adapter's for peft) and
    the tokenizer (main process)."""
    if not accelerator.is_main_process:
        return
    if hasattr(model, "peft_config"):
        model.peft_config[model.active_adapter].save_pretrained(folder)
    else:
        model.config.save_pretrained(folder)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


NO_SPACE = "no space left on the device"


def write_failure(e: BaseException, where: Path) -> str | None:
    """Why a write under `where` failed, for a person (None: `e` is not a write failure). safetensors
    reports the OS error in its message; torch.save only as a zip-writer position mismatch, which is
    taken for a full disk when `where` has under 64 MB free; DCP wraps each rank's failure."""
    if isinstance(e, OSError):
        return NO_SPACE if e.errno == errno.ENOSPC else (e.strerror or str(e)).lower()
    text = str(e)
    match = re.search(r"os error (\d+)", text)
    if type(e).__name__ == "SafetensorError" and match:
        code = int(match.group(1))
        return NO_SPACE if code == errno.ENOSPC else os.strerror(code).lower()
    if isinstance(e, RuntimeError) and ("unexpected pos" in text or "PytorchStreamWriter" in text):
        free = shutil.disk_usage(where).free if where.exists() else 0
        return NO_SPACE if free < 64 << 20 else "the write failed (an I/O error)"
    # CheckpointException: {rank: (exception, traceback)}
    for f in (getattr(e, "failures", None) or {}).values():
        reason = write_failure(f[0] if isinstance(f, tuple) else f, where)
        if reason:
            return reason
    return None


def save_checkpoint(strategy, model, tokenizer, optimizer, scheduler, path: Path, state: dict,
                    fault=None, rank_extra: dict | None = None) -> None:
    """A resumable checkpoint (collective). `state` is what `trainer_state.json` records; `fault`
    is the fault-injection hook the crash tests use (see `toolkit.train.faults`); `rank_extra`: more of this
    rank's state (--objective grpo's round in progress), in its rank file.

    Sharded (every layout but DeepSpeed): each rank writes its pieces, nothing is gathered. A full
    disk on any rank is one clear error on every rank (they agree through one all-reduce after the
    writes, so none waits at a barrier for a rank that gave up); the half-written `.tmp` folder is
    removed and earlier checkpoints stay."""
    from torch.distributed.checkpoint.api import CheckpointException

    from toolkit.train.sharded_state import save_sharded

    accelerator = strategy.accelerator
    tmp = _fresh_tmp(accelerator, path)
    sharded = strategy.checkpoint_format == "sharded"
    # DeepSpeed: the HF folder, gathered
    if not sharded:
        # a model split across ranks, gathered into one HF model
        saved = strategy.export(model, final=False)
        # the collectives first: every rank takes part
        model_state = strategy.state_dict(saved)
    inner = torch_optimizer(optimizer)
    # fp16 outside DeepSpeed (whose loss scaler is in its optimizer state)
    scaler = getattr(accelerator, "scaler", None)
    rank_state = {"scheduler": scheduler.state_dict(), "rng": rng_state(),
                  "scaler": scaler.state_dict() if scaler is not None else None,
                  "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in inner.param_groups]}
    if not sharded:
        rank_state["optimizer"] = strategy.optimizer_state(model, optimizer)
    rank_state.update(rank_extra or {})
    failed = None
    try:
        if sharded:
            save_sharded(tmp / STATE_DIR, strategy.named_trainable(model), inner)
            _write_model_files(accelerator, strategy.unwrap(model), tokenizer, tmp)
        else:
            _write_model(accelerator, strategy.unwrap(saved), tokenizer, tmp, model_state)
        if fault is not None:
            # a crash here leaves only <name>.tmp: the previous checkpoint stays usable
            fault("save", state["step"])
        torch.save(rank_state, tmp / f"rank{accelerator.process_index}.pt")
        # <name>.tmp is never read: the rename below is what publishes
        if accelerator.is_main_process:
            record = {**state, "format": "sharded" if sharded else "hf", "world_size": accelerator.num_processes,
                      "layout": strategy.dims.describe(), "data_ranks": strategy.data.ranks, "manifest": MANIFEST}
            (tmp / TRAINER_STATE).write_text(json.dumps(record, indent=2))
    # a write that failed (full disk, I/O error): one line
    except (Exception, CheckpointException) as e:
        failed = write_failure(e, tmp)
        if failed is None:
            raise
    needed = partial(_checkpoint_bytes, accelerator, path.parent, inner)
    # an all-reduce: past it, every rank's files are written
    _stop_if_failed(accelerator, failed, tmp, path, needed)
    if accelerator.is_main_process:
        try:
            write_manifest(tmp)
        except OSError as e:
            failed = write_failure(e, tmp)
    _stop_if_failed(accelerator, failed, tmp, path, needed)
    _publish(accelerator, tmp, path)


def _local_bytes(t: torch.Tensor) -> int:
    # a DTensor: this rank's shard
    t = getattr(t, "_local_tensor", t)
    return t.numel() * t.element_size()


def _checkpoint_bytes(accelerator, out_dir: Path, optimizer) -> int:
    """About what one more checkpoint takes: the last complete one's size, else every rank's
    trainable weights and optimizer state (collective)."""
    earlier = complete_checkpoints(out_dir)
    if earlier:
        return sum(f.stat().st_size for f in earlier[-1].rglob("*") if f.is_file())
    mine = sum(_local_bytes(p) for g in optimizer.param_groups for p in g["params"])
    mine += sum(_local_bytes(v) for st in optimizer.state.values() for v in st.values() if torch.is_tensor(v))
    if accelerator.num_processes == 1:
        return mine
    return int(accelerator.reduce(torch.tensor([mine], dtype=torch.float64, device=accelerator.device), "sum").item())


def _stop_if_failed(accelerator, failed: str | None, tmp: Path, path: Path, needed: Callable[[], int]) -> None:
    """One error on every rank when any rank's write failed (collective): the half-written `.tmp`
    removed, the space needed (`needed()`, called on every rank) and free said, the earlier
    checkpoints named as intact. Every rank raises the main process's line, so it is printed once."""
    if not any_rank(accelerator, failed is not None):
        return
    if accelerator.num_processes > 1:
        import torch.distributed as dist

        every: list = [None] * accelerator.num_processes
        dist.all_gather_object(every, failed)
        failed = next(f for f in every if f is not None)
    size = needed()
    line = [""]
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        earlier = [p.name for p in complete_checkpoints(path.parent)]
        fix = "Free space (or keep fewer with --keep-last)" if failed == NO_SPACE else "Check the disk"
        line = [f"could not write {path}: {failed} (it needs about {_size(size)}, "
                f"{_size(shutil.disk_usage(path.parent).free)} free there); it was not saved"
                + (f" ({', '.join(earlier)} intact). {fix}, then continue with --resume auto" if earlier
                   else f". {fix}, then run again")]
    if accelerator.num_processes > 1:
        dist.broadcast_object_list(line, src=0)
    raise UserError(line[0])


def _size(n: float) -> str:
    for unit in ("bytes", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def prune_checkpoints(accelerator, out_dir: Path, keep_last: int) -> None:
    if keep_last and accelerator.is_main_process:
        for old in complete_checkpoints(out_dir)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()


def torch_optimizer(optimizer):
    """The torch optimizer inside accelerate's wrapper (its param_groups and per-parameter state)."""
    return getattr(optimizer, "optimizer", optimizer)


RANK_KEYS = ("scheduler", "rng", "param_groups")


def load_rank_state(accelerator, path: Path, rank: int) -> dict:
    """`rank{rank}.pt` (collective: a rank whose file cannot be read stops every rank). Read with
    `weights_only=True`: a file holding anything but tensors and plain values is refused unread."""
    import pickle

    f = path / f"rank{rank}.pt"
    problem, state = None, {}
    try:
        state = torch.load(f, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        problem = (f"{f} holds objects other than tensors and plain values, which this toolkit never writes "
                   "(the file was replaced or altered); it was refused unread")
    except (RuntimeError, EOFError, OSError) as e:
        problem = f"{f} is damaged ({str(e).splitlines()[0][:120]})"
    if problem is None and not (isinstance(state, dict) and all(k in state for k in RANK_KEYS)):
        problem = f"{f} is not a rank file of this toolkit (it lacks {', '.join(RANK_KEYS)})"
    if any_rank(accelerator, problem is not None):
        raise UserError(f"--resume {path}: {problem or 'a rank file is damaged on another rank'}; resume from an "
                        "earlier checkpoint")
    return state


def restore_sharded(strategy, model, optimizer, folder: Path) -> None:
    """Read this layout's pieces of the trainable weights and their optimizer state from a sharded
    checkpoint (collective; in place, after the model is split and the optimizer built)."""
    from toolkit.train.sharded_state import load_sharded, read_metadata

    named = strategy.named_trainable(model)
    names = {n for n, _, _ in named}
    # every rank file's header: read once
    saved = read_metadata(folder / STATE_DIR)
    missing = sorted(n for n in names if f"model.{n}" not in saved)
    # every rank stops, none waits in DCP's collectives
    if any_rank(strategy.accelerator, bool(missing)):
        raise UserError(f"--resume {folder}: the checkpoint's weights do not fit this model (missing "
                        f"{missing[:3] or 'on another rank'}); it is from another model or method")
    load_sharded(folder / STATE_DIR, named, torch_optimizer(optimizer), meta=saved)


def convert_checkpoint(ckpt: Path, output: Path) -> str:
    """A step checkpoint as a standard HF model or adapter folder (one process, no GPU): the
    sharded state read whole, written as safetensors beside the checkpoint's config and tokenizer."""
    from safetensors.torch import save_file

    from toolkit.train.sharded_state import full_tensors

    ckpt, output = Path(ckpt), Path(output)
    if not (ckpt / TRAINER_STATE).is_file():
        raise UserError(f"{ckpt}: not a complete checkpoint (no {TRAINER_STATE}); pick a checkpoint-N folder")
    problem = damage(ckpt)
    if problem:
        raise UserError(f"{ckpt}: the checkpoint is damaged: {problem}; pick an earlier checkpoint-N folder")
    if output.exists() and any(output.iterdir()):
        raise UserError(f"--output {output} is not empty; choose another folder")
    output.mkdir(parents=True, exist_ok=True)
    sharded = json.loads((ckpt / TRAINER_STATE).read_text()).get("format") == "sharded"
    # config, tokenizer (and, for a DeepSpeed checkpoint, the weights themselves)
    for f in ckpt.iterdir():
        if (f.is_file() and f.name not in (TRAINER_STATE, MANIFEST)
                and not (f.name.startswith("rank") and f.suffix == ".pt")):
            shutil.copy2(f, output / f.name)
    if not sharded:
        return f"{ckpt} holds an HF folder already (DeepSpeed format): copied to {output}"
    tensors = {k: v.contiguous() for k, v in full_tensors(ckpt / STATE_DIR).items()}
    # peft's file names: the adapter's name left out
    if (output / "adapter_config.json").is_file():
        config = json.loads((output / "adapter_config.json").read_text())
        (output / "adapter_config.json").write_text(json.dumps({**config, "inference_mode": True}, indent=2))
        save_file({k.replace(".default.", "."): v for k, v in tensors.items()}, output / "adapter_model.safetensors",
                  metadata={"format": "pt"})
        return f"adapter written to {output} ({len(tensors)} tensors)"
    save_file(tensors, output / "model.safetensors", metadata={"format": "pt"})
    return f"model written to {output} ({len(tensors)} tensors)"


def restore_weights(model, folder: Path, method: str) -> None:
    """Load a checkpoint's weights (safetensors) into the freshly built model or adapter."""
    from safetensors.torch import load_file

    state: dict = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        state.update(load_file(f))
    if not state:
        raise UserError(f"--resume {folder}: no .safetensors weights in the checkpoint")
    if method in ("lora", "qlora"):
        from peft import set_peft_model_state_dict

        result = set_peft_model_state_dict(model, state)
        missing = [k for k in getattr(result, "missing_keys", []) if "lora_" in k]
        unexpected = list(getattr(result, "unexpected_keys", []))
    else:
        result = load_full_state_dict(model, state)
        tied = getattr(model.config, "tie_word_embeddings", False)
        missing = [k for k in result.missing_keys if not (tied and k.endswith("lm_head.weight"))]
        unexpected = list(result.unexpected_keys)
    if missing or unexpected:
        raise UserError(f"--resume {folder}: the checkpoint's weights do not fit this model "
                        f"(missing {missing[:3]}, unexpected {unexpected[:3]}); it is from another model or method")
