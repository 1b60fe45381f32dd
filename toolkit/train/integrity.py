"""After the final save: prove the folder holds the trained model. Sharded saves (ZeRO-3, FSDP) are
where peers ship empty or stale weights, and a full disk or a killed writer leaves a short file; this
turns such a save into one loud line instead of a model that silently is not the one trained.

Levels (`--verify`), each including the ones above it:
- `files`: every weight file the folder (or its index) names exists and parses, and every tensor in it
  equals the in-memory tensor that was saved (names, shapes, dtypes, values); nothing the model has is
  missing. Reads the files back once: seconds even for an 8B model.
- `load` (the default): plain transformers/peft load the folder in this process, on the CPU, and give
  the trained model's loss on a short batch (2 rows of at most 64 tokens). The trained loss comes from
  the sharded model itself, so this also checks a ZeRO-3/FSDP gather. Skipped, and said, when the
  model would not fit in half the free host memory or its CPU forward would take minutes (above ~8B
  parameters); the files are then checked against the gathered tensors only.
- `full`: the same load in a fresh process with none of the run's state (the clean-room reload the
  toolkit did by default before; it costs a second start-up, ~10 s on 2 cores, and a second copy of
  the model).
- `none`: nothing is checked.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator

import torch

from toolkit.data import collate
from toolkit.data.image_rows import ImageRows, MediaCollate
from toolkit.data.packing import model_inputs
from toolkit.train.numerics import FP32_RTOL, agreement
from toolkit.parallel import any_rank
from toolkit.objectives.sft.evaluate import eval_loss

LEVELS = ("none", "files", "load", "full")
WEIGHT_FILES = ("model.safetensors", "adapter_model.safetensors")
INDEX = "model.safetensors.index.json"
# the reload batch: its cost, not its length, is what matters
PROBE_ROWS, PROBE_TOKENS = 2, 64
# ~10-30 s of CPU forward (an 8B model on this batch): above it `load` checks the files only
RELOAD_FLOPS = 2e12


def tolerance(precision: str) -> float:
    """Relative: the trained loss (computed in `precision`) against an fp32 reload's, a whole forward in
    bf16 away: twice bf16's `agreement` (3.1e-2; fp32 against fp32: 1e-4). fp16 keeps bf16's bound, as
    before (its own would be 8x tighter; no fp16 run has measured the gap)."""
    return FP32_RTOL if precision == "no" else 2 * agreement(torch.bfloat16)


def saved_state(model, state: dict) -> dict[str, torch.Tensor]:
    """The tensors `save_pretrained(state_dict=state)` writes, under the names it writes them: a peft
    model saves its adapter's weights only, renamed (peft's `get_peft_model_state_dict`); a transformers
    model drops tied copies and undoes its load-time weight conversions (MoE experts fused in memory
    are written one file entry per expert), as `PreTrainedModel.save_pretrained` does."""
    if hasattr(model, "peft_config"):
        from peft import get_peft_model_state_dict

        return get_peft_model_state_dict(model, state_dict=state, adapter_name=model.active_adapter)
    out = dict(state)
    for key in getattr(model, "_keys_to_ignore_on_save", None) or ():
        out.pop(key, None)
    try:
        from transformers.core_model_loading import revert_weight_conversion
        from transformers.modeling_utils import remove_tied_weights_from_state_dict
    # a transformers without load-time conversions saves the state as it is
    except ImportError:
        return out
    return revert_weight_conversion(model, remove_tied_weights_from_state_dict(out, model))


def weight_files(folder: Path) -> tuple[list[Path], list[str]]:
    """(the weight files the folder holds, problems): an index's shards must all exist."""
    index = folder / INDEX
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError) as e:
            return [], [f"{index.name} is not a readable index ({e})"]
        missing = [s for s in shards if not (folder / s).is_file()]
        return [folder / s for s in shards], [f"{index.name} names {m}, which is missing" for m in missing]
    files = [folder / f for f in WEIGHT_FILES if (folder / f).is_file()]
    return files, [] if files else [f"no weight file ({', '.join(WEIGHT_FILES)} or {INDEX})"]


def check_files(folder: Path, expected: dict[str, torch.Tensor]) -> tuple[int, list[str]]:
    """(tensors read, problems): every saved tensor equals the in-memory tensor saved under its name
    (compared on the CPU), and every in-memory tensor was saved."""
    from safetensors import SafetensorError, safe_open

    files, problems = weight_files(folder)
    unmatched = dict(expected)
    seen = 0
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    saved = f.get_tensor(name)
                    seen += 1
                    mine = unmatched.pop(name, None)
                    if mine is None:
                        problems.append(f"{path.name}: {name} is not a tensor of the trained model")
                    elif not _same(saved, mine):
                        problems.append(f"{path.name}: {name} differs from the trained model's "
                                        f"({_describe(saved)} saved, {_describe(mine)} in memory)")
        except (SafetensorError, OSError) as e:
            problems.append(f"{path.name} cannot be read ({' '.join(str(e).split())[:200]})")
    problems += [f"{k} was not saved" for k in list(unmatched)[:5]]
    return seen, problems


def _same(saved: torch.Tensor, mine: torch.Tensor) -> bool:
    return saved.shape == mine.shape and saved.dtype == mine.dtype and torch.equal(saved, mine.detach().cpu())


def _describe(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"


def saved_params(folder: Path) -> int:
    """Parameters in a folder's safetensors files, from their headers alone (no tensor is read)."""
    import struct

    n = 0
    for path in weight_files(folder)[0]:
        with open(path, "rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        for name, entry in header.items():
            if name != "__metadata__":
                n += math.prod(entry["shape"])
    return n


def probe_batch(rows) -> list[dict]:
    """PROBE_ROWS rows, each cut to its last PROBE_TOKENS tokens (the completion, where the targets are)."""
    processor = getattr(rows, "processor", None)
    # rows with images whole: a cut would split an image's tokens
    if processor is not None:
        return ImageRows([dict(r) for r in rows[:PROBE_ROWS]], processor)
    out = []
    for r in list(rows[:PROBE_ROWS]):
        out.append({"input_ids": list(r["input_ids"])[-PROBE_TOKENS:], "labels": list(r["labels"])[-PROBE_TOKENS:]})
    return out if any(x != -100 for r in out for x in r["labels"]) else [dict(r) for r in list(rows[:PROBE_ROWS])]


def reload_fits(folder: Path, base: str, tokens: int) -> str | None:
    """None when a CPU reload of the model is cheap enough for `load`; else why not. The size is read
    from the safetensors headers (the base's, for an adapter)."""
    n = saved_params(folder) + (saved_params(Path(base)) if (folder / "adapter_config.json").is_file()
                                and Path(base).is_dir() else 0)
    free = _available_bytes()
    if free is not None and 4 * n > free / 2:
        return f"the model ({4 * n / 2**30:.1f} GiB in fp32) is over half the free host memory"
    if 2 * n * tokens > RELOAD_FLOPS:
        return f"a CPU forward of the {n / 1e9:.1f}B-parameter model would take minutes"
    return None


def _available_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


@contextlib.contextmanager
def plain_loading() -> Iterator[None]:
    """from_pretrained as a fresh process runs it: not partitioned by the run's ZeRO-3 config (which
    transformers finds through a global reference) nor loaded rank-0-only under FSDP's env flags."""
    from transformers.integrations import deepspeed as hf_ds

    ref = hf_ds._hf_deepspeed_config_weak_ref
    hf_ds._hf_deepspeed_config_weak_ref = None
    saved = {k: os.environ.pop(k) for k in ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED") if k in os.environ}
    try:
        yield
    finally:
        hf_ds._hf_deepspeed_config_weak_ref = ref
        os.environ.update(saved)


def verify_saved(strategy, model, tokenizer, rows: list[dict], final_dir: Path, base: str,
                 precision: str, quantized: bool, log=print, level: str = "load",
                 expected: dict[str, torch.Tensor] | None = None) -> dict:
    """Check the saved folder at `level` (module docstring); `expected` is what `save_final` returned
    (the in-memory tensors written, on the main process). Collective. Writes integrity.json; a failed
    check is one line and a non-zero exit."""
    accelerator = strategy.accelerator
    result: dict = {"level": level}
    if level == "none":
        log("integrity: not checked (--verify none)")
        return result
    batch = probe_batch(rows)
    trained = eval_loss(strategy, model, batch, batch_size=len(batch), pad_id=tokenizer.pad_token_id) \
        if level in ("load", "full") else None
    result["trained_loss"] = trained
    problem = None
    if accelerator.is_main_process:
        # whatever goes wrong here is the finding, and reaches the other ranks (no hang)
        try:
            problem = _check_main(result, final_dir, base, batch, tokenizer.pad_token_id, quantized, precision,
                                  level, expected, trained)
        except Exception as e:  # noqa: BLE001
            problem = f"the check itself failed ({type(e).__name__}: {' '.join(str(e).split())[:300]})"
        result["ok"] = problem is None
        try:
            (final_dir.parent / "integrity.json").write_text(json.dumps(result, indent=2))
        except OSError as e:
            problem = problem or f"integrity.json cannot be written ({e})"
    if any_rank(accelerator, problem is not None):
        raise SystemExit(f"integrity check FAILED: {final_dir}: {problem or 'see the main process'}")
    if accelerator.is_main_process:
        what = f"{result['files']['tensors']} tensors equal the trained weights" if expected is not None else ""
        if "reloaded_loss" in result:
            how = "in a fresh process" if level == "full" else "in this process"
            # the next-token loss of a few training rows held for this check, whatever the objective trains
            what += f"{'; ' if what else ''}reloads with plain transformers/peft {how}: next-token loss of a " \
                    f"held batch {result['reloaded_loss']:.6f} vs trained {trained:.6f}"
        elif "reload" in result:
            what += f"; reload {result['reload']}"
        log(f"integrity: {final_dir}: {what or 'checked'}")
    return result


def _check_main(result: dict, final_dir: Path, base: str, batch: list[dict], pad_id: int, quantized: bool,
                precision: str, level: str, expected: dict | None, trained: float | None) -> str | None:
    """The main process's part of `verify_saved`: fills `result`, returns the first problem or None."""
    n, problems = check_files(final_dir, expected) if expected is not None else (0, [])
    result["files"] = {"tensors": n, "problems": problems[:10]}
    if problems:
        return problems[0]
    if level not in ("load", "full"):
        return None
    skip = reload_fits(final_dir, base, sum(len(r["input_ids"]) for r in batch)) if level == "load" else None
    # the files equal what was gathered; the gather itself is then not checked independently
    if skip:
        result["reload"] = f"skipped: {skip} (a sharded gather is checked only by a reload: --verify full)"
        return None
    result["reloaded_loss"], error = _reload(final_dir, base, batch, pad_id, quantized, fresh_process=level == "full")
    if error:
        return f"reloading it fails ({error})"
    rel = abs(result["reloaded_loss"] - trained) / max(abs(trained), 1e-12)
    result["relative_diff"] = rel
    if rel > tolerance(precision):
        return (f"reloaded with plain transformers/peft it gives loss {result['reloaded_loss']:.6f} but the trained "
                f"model gives {trained:.6f}")
    return None


def _reload(folder: Path, base: str, batch: list[dict], pad_id: int, quantized: bool,
            fresh_process: bool) -> tuple[float | None, str | None]:
    """(loss of the folder reloaded with plain from_pretrained on `batch`, error)."""
    if not fresh_process:
        try:
            with plain_loading():
                return reload_loss(str(folder), base, batch, pad_id, quantized), None
        except Exception as e:  # noqa: BLE001 - any failure to load is the finding
            return None, f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(batch, f)
    cmd = [sys.executable, "-m", "toolkit", "verify", "--folder", str(folder), "--base", base,
           "--batch", f.name, "--pad-id", str(pad_id)] + (["--load-4bit"] if quantized else [])
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "")}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        # a plain single process, as a user loading the folder would have
        env.pop(k, None)
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    os.unlink(f.name)
    if p.returncode != 0:
        return None, p.stderr.strip().splitlines()[-1] if p.stderr.strip() else f"exit {p.returncode}"
    return json.loads(p.stdout.strip().splitlines()[-1])["loss"], None


def reload_loss(folder: str, base: str, batch: list[dict] | str, pad_id: int, load_4bit: bool) -> float:
    """Plain from_pretrained, nothing from the training run: the folder's loss on `batch` (rows, or
    a JSON file of them)."""
    from transformers import AutoConfig

    from toolkit.data.labels import count_targets
    from toolkit.model.load import nf4_config
    from toolkit.model.vision import auto_class
    from toolkit.objectives.sft.loss import token_loss_sum

    kwargs: dict = {"dtype": torch.float32}
    adapter = (Path(folder) / "adapter_config.json").is_file()
    config = AutoConfig.from_pretrained(base if adapter else folder)
    rows = json.loads(Path(batch).read_text()) if isinstance(batch, str) else batch
    # rows with images: the image-text class, as the run trained it
    images = bool(rows) and "images" in rows[0]
    if load_4bit:
        kwargs["quantization_config"] = nf4_config(config, torch.float32, images)
    cls = auto_class(config, images)
    if adapter:
        from peft import PeftModel

        model = PeftModel.from_pretrained(cls.from_pretrained(base, **kwargs), folder)
    else:
        model = cls.from_pretrained(folder, **kwargs)
    model.eval()
    if images:
        from toolkit.model.vision import load_processor

        # the folder's own processor: final/ reloads as a user loads it (AutoProcessor; without torchvision, a
        # processor whose video processor needs it is built without one)
        collated = MediaCollate(load_processor(folder), pad_id)(rows)
    else:
        collated = collate(rows, pad_id)
    # 4-bit loads on the GPU
    batch = {k: v.to(model.device) for k, v in collated.items()}
    with torch.no_grad():
        logits = model(**model_inputs(batch)).logits
    return (token_loss_sum(logits, batch["labels"]) / count_targets(batch["labels"])).item()
