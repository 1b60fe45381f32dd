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
import shutil
from pathlib import Path

import numpy as np
import torch

from toolkit.errors import UserError
from toolkit.parallel import any_rank
from toolkit.parallel.strategy import load_full_state_dict
TRAINER_STATE = "trainer_state.json"
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
    integrity check to compare the files with."""
    from toolkit.train.integrity import saved_state

    accelerator = strategy.accelerator
    tmp = _fresh_tmp(accelerator, path)
    unwrapped, state = strategy.unwrap(model), strategy.state_dict(model)
    _write_model(accelerator, unwrapped, tokenizer, tmp, state)
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


def _disk_full(e: Exception) -> bool:
    """ENOSPC, also when DCP wrapped it (a `CheckpointException` holds each rank's failure)."""
    if isinstance(e, OSError):
        return e.errno == errno.ENOSPC
    failures = getattr(e, "failures", {}) or {}
    return any(isinstance(f[0] if isinstance(f, tuple) else f, OSError)
               and (f[0] if isinstance(f, tuple) else f).errno == errno.ENOSPC for f in failures.values())


def save_checkpoint(strategy, model, tokenizer, optimizer, scheduler, path: Path, state: dict,
                    fault=None) -> None:
    """A resumable checkpoint (collective). `state` is what `trainer_state.json` records; `fault`
    is the fault-injection hook the crash tests use (see `toolkit.train.faults`).

    Sharded (every layout but DeepSpeed): each rank writes its pieces, nothing is gathered. A full
    disk on any rank is one clear error on every rank (they agree through one all-reduce after the
    writes, so none waits at a barrier for a rank that gave up); the half-written `.tmp` folder is
    removed and earlier checkpoints stay."""
    from torch.distributed.checkpoint.api import CheckpointException

    from toolkit.train.sharded_state import save_sharded

    accelerator = strategy.accelerator
    tmp = _fresh_tmp(accelerator, path)
    sharded = strategy.sharded_checkpoints
    if not sharded:  # DeepSpeed: the HF folder, gathered
        saved = strategy.export(model, final=False)  # a model split across ranks, gathered into one HF model
        model_state = strategy.state_dict(saved)  # the collectives first: every rank takes part
    inner = torch_optimizer(optimizer)
    scaler = getattr(accelerator, "scaler", None)  # fp16 outside DeepSpeed (whose loss scaler is in its optimizer state)
    rank_state = {"scheduler": scheduler.state_dict(), "rng": rng_state(),
                  "scaler": scaler.state_dict() if scaler is not None else None,
                  "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in inner.param_groups]}
    if not sharded:
        rank_state["optimizer"] = strategy.optimizer_state(model, optimizer)
    full = False
    try:
        if sharded:
            save_sharded(tmp / STATE_DIR, strategy.named_trainable(model), inner, *strategy.tp_coordinates())
            _write_model_files(accelerator, strategy.unwrap(model), tokenizer, tmp)
        else:
            _write_model(accelerator, strategy.unwrap(saved), tokenizer, tmp, model_state)
        if fault is not None:
            fault("save", state["step"])  # a crash here leaves only <name>.tmp: the previous checkpoint stays usable
        torch.save(rank_state, tmp / f"rank{accelerator.process_index}.pt")
        if accelerator.is_main_process:  # <name>.tmp is never read: the rename below is what publishes
            record = {**state, "format": "sharded" if sharded else "hf", "world_size": accelerator.num_processes,
                      "layout": strategy.dims.describe(), "data_ranks": strategy.data_ranks}
            (tmp / TRAINER_STATE).write_text(json.dumps(record, indent=2))
    except (OSError, CheckpointException) as e:
        if not _disk_full(e):
            raise
        full = True
    if any_rank(accelerator, full):
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        earlier = [p.name for p in complete_checkpoints(path.parent)]
        raise UserError(f"no space left on the device while writing {path}; it was not saved"
                        + (f" ({', '.join(earlier)} intact)" if earlier else "")
                        + ". Free space (or use --keep-last), then continue with --resume auto")
    _publish(accelerator, tmp, path)


def prune_checkpoints(accelerator, out_dir: Path, keep_last: int) -> None:
    if keep_last and accelerator.is_main_process:
        for old in complete_checkpoints(out_dir)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()


def complete_checkpoints(out_dir: Path) -> list[Path]:
    """checkpoint-N folders (renamed from .tmp once complete) holding a trainer_state.json, oldest first."""
    found = [p for p in Path(out_dir).glob("checkpoint-*")
             if p.is_dir() and p.name.split("-", 1)[1].isdigit() and (p / TRAINER_STATE).is_file()]
    return sorted(found, key=lambda p: int(p.name.split("-", 1)[1]))


def torch_optimizer(optimizer):
    """The torch optimizer inside accelerate's wrapper (its param_groups and per-parameter state)."""
    return getattr(optimizer, "optimizer", optimizer)


def load_rank_state(path: Path, rank: int) -> dict:
    return torch.load(path / f"rank{rank}.pt", map_location="cpu", weights_only=True)


def restore_sharded(strategy, model, optimizer, folder: Path) -> None:
    """Read this layout's pieces of the trainable weights and their optimizer state from a sharded
    checkpoint (collective; in place, after the model is split and the optimizer built)."""
    from toolkit.train.sharded_state import load_sharded, read_metadata

    named = strategy.named_trainable(model)
    names = {n for n, _, _ in named}
    saved = read_metadata(folder / STATE_DIR)  # every rank file's header: read once
    missing = sorted(n for n in names if f"model.{n}" not in saved)
    if any_rank(strategy.accelerator, bool(missing)):  # every rank stops, none waits in DCP's collectives
        raise UserError(f"--resume {folder}: the checkpoint's weights do not fit this model (missing "
                        f"{missing[:3] or 'on another rank'}); it is from another model or method")
    load_sharded(folder / STATE_DIR, named, torch_optimizer(optimizer), *strategy.tp_coordinates(), meta=saved)


def convert_checkpoint(ckpt: Path, output: Path) -> str:
    """A step checkpoint as a standard HF model or adapter folder (one process, no GPU): the
    sharded state read whole, written as safetensors beside the checkpoint's config and tokenizer."""
    from safetensors.torch import save_file

    from toolkit.train.sharded_state import full_tensors

    ckpt, output = Path(ckpt), Path(output)
    if not (ckpt / TRAINER_STATE).is_file():
        raise UserError(f"{ckpt}: not a complete checkpoint (no {TRAINER_STATE}); pick a checkpoint-N folder")
    if output.exists() and any(output.iterdir()):
        raise UserError(f"--output {output} is not empty; choose another folder")
    output.mkdir(parents=True, exist_ok=True)
    sharded = json.loads((ckpt / TRAINER_STATE).read_text()).get("format") == "sharded"
    for f in ckpt.iterdir():  # config, tokenizer (and, for a DeepSpeed checkpoint, the weights themselves)
        if f.is_file() and f.name != TRAINER_STATE and not (f.name.startswith("rank") and f.suffix == ".pt"):
            shutil.copy2(f, output / f.name)
    if not sharded:
        return f"{ckpt} holds an HF folder already (DeepSpeed format): copied to {output}"
    tensors = {k: v.contiguous() for k, v in full_tensors(ckpt / STATE_DIR).items()}
    if (output / "adapter_config.json").is_file():  # peft's file names: the adapter's name left out
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
