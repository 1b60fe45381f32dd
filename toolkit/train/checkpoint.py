"""Saving standard Hugging Face folders (a full model or a peft adapter, tokenizer included) and
resumable checkpoints.

Everything is written to `<name>.tmp` and renamed into place only when every rank's part is
written, so a crash mid-save never leaves a half-written folder under the final name. A checkpoint
is the HF folder plus what exact resumption needs: `trainer_state.json` (step, data position,
fingerprint, config) and one `rank{r}.pt` per rank (optimizer, scheduler, fp16 gradient scaler and
RNG states, read back with `torch.load(weights_only=True)`; `optimizer_state` says what each
strategy stores).
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


def save_final(strategy, model, tokenizer, path: Path) -> None:
    """Every rank must call this: sharded strategies gather the state dict collectively."""
    accelerator = strategy.accelerator
    tmp = _fresh_tmp(accelerator, path)
    _write_model(accelerator, strategy.unwrap(model), tokenizer, tmp, strategy.state_dict(model))
    _publish(accelerator, tmp, path)


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


def save_checkpoint(strategy, model, tokenizer, optimizer, scheduler, path: Path, state: dict,
                    fault=None) -> None:
    """A resumable checkpoint (collective). `state` is what `trainer_state.json` records; `fault`
    is the fault-injection hook the crash tests use (see `toolkit.train.faults`).

    A full disk on any rank is one clear error on every rank (they agree through one all-reduce
    after the writes, so none waits at a barrier for a rank that gave up); the half-written `.tmp`
    folder is removed and earlier checkpoints stay."""
    accelerator = strategy.accelerator
    tmp = _fresh_tmp(accelerator, path)
    saved = strategy.export(model, final=False)  # a model split across ranks, gathered into one HF model
    model_state = strategy.state_dict(saved)  # the collectives first: every rank takes part
    scaler = getattr(accelerator, "scaler", None)  # fp16 outside DeepSpeed (whose loss scaler is in its optimizer state)
    rank_state = {"optimizer": strategy.optimizer_state(model, optimizer), "scheduler": scheduler.state_dict(),
                  "rng": rng_state(), "scaler": scaler.state_dict() if scaler is not None else None}
    full = False
    try:
        _write_model(accelerator, strategy.unwrap(saved), tokenizer, tmp, model_state)
        if fault is not None:
            fault("save", state["step"])  # a crash here leaves only <name>.tmp: the previous checkpoint stays usable
        torch.save(rank_state, tmp / f"rank{accelerator.process_index}.pt")
        if accelerator.is_main_process:  # <name>.tmp is never read: the rename below is what publishes
            (tmp / TRAINER_STATE).write_text(json.dumps({**state, "world_size": accelerator.num_processes}, indent=2))
    except OSError as e:
        if e.errno != errno.ENOSPC:
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


def load_rank_state(path: Path, rank: int) -> dict:
    return torch.load(path / f"rank{rank}.pt", map_location="cpu", weights_only=True)


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
