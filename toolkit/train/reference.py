"""DPO's and KTO's reference for a full finetune, without a second model: the log-probabilities of every
pair's two sequences (a KTO example's sequence and its KL sequence) under the model as loaded, computed
in one pass before step 1 and carried by the rows into each micro-batch (`ref_logps`, `ref_kl_logps`). A new LoRA needs none of this: its reference is the base model with
the adapters disabled (`toolkit.preference.PreferenceLoss.reference_logps`). A LoRA that trains on the SFT
adapter `--model` names does (`toolkit.models.sft_adapter`): its reference is that adapter, on, as loaded.

The pass is cached, keyed by the rows' tokens, the model's weight files and the compute precision,
and written beside the run (`reference_logps.safetensors` in the output folder), so a resume reads
what the first run computed: computing it again from the trained weights would move the reference.
A fresh run reads only the cache (an old run's file in an output folder it overwrites is not its own).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from toolkit.errors import UserError

FILE = "reference_logps.safetensors"


def rows_key(rows_digest: str, precision: str) -> str:
    """What the run's own file is checked against: the rows' tokens and the precision (its weights are
    the run's by construction; a touched or re-downloaded model folder does not make it stale)."""
    return hashlib.sha256(f"{rows_digest}\x00{precision}".encode()).hexdigest()


def cache_key(rows_key: str, *model_dirs: str) -> str:
    """The shared cache's key: `rows_key` and the model's weight files (name, size, mtime): the base's,
    and an SFT adapter's trained on, whose output the reference is."""
    h = hashlib.sha256(rows_key.encode())
    for i, model_dir in enumerate(model_dirs):
        path = Path(model_dir)
        if i:  # one folder hashes as it always did: older cache entries still match
            h.update(f"{i}\x00".encode())
        for f in sorted(path.iterdir()) if path.is_dir() else []:
            if f.suffix in (".safetensors", ".bin", ".json") and f.is_file():
                st = f.stat()
                h.update(f"{f.name}\x00{st.st_size}\x00{st.st_mtime_ns}\x00".encode())
    return h.hexdigest()


def read_saved(path: Path, name: str, key: str) -> torch.Tensor | None:
    """`name`'s log-probabilities from a file written by `save`, if it holds them for `key` (an
    unreadable or truncated file counts as absent)."""
    from safetensors.torch import load_file

    try:
        saved = load_file(str(path))
    except (OSError, ValueError, RuntimeError):  # absent, or damaged: safetensors raises SafetensorError
        return None
    if name not in saved or bytes(saved.get(f"{name}_key", torch.zeros(0, dtype=torch.uint8)).tolist()).decode() != key:
        return None
    return saved[name]


def save(path: Path, name: str, key: str, values: torch.Tensor, log=print) -> None:
    """Add `name` to the file at `path`, written whole and renamed into place; best effort (the run
    goes on without the file where the folder is read-only, and says so)."""
    import os

    from safetensors.torch import load_file, save_file

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            old = load_file(str(path)) if path.is_file() else {}
        except (OSError, ValueError, RuntimeError):
            old = {}
        tmp = path.with_name(path.name + ".tmp")
        save_file({**old, name: values.contiguous(), f"{name}_key": torch.tensor(list(key.encode()), dtype=torch.uint8)},
                  str(tmp))
        os.replace(tmp, path)
    except OSError as e:
        log(f"reference: could not write {path} ({e.strerror or e}); a resume of this run then cannot find it")


@torch.no_grad()
@torch.compiler.set_stance("force_eager")  # compiled blocks keep their training graphs
def compute_reference(strategy, model, rows, batch_size: int, pad_id: int) -> torch.Tensor:
    """(N, 2) float32: each pair's (chosen, rejected) sequence log-probabilities under `model` (a KTO
    example's: its sequence's, its KL sequence's), in eval mode. Each data-parallel rank takes a strided shard (model-parallel peers the same one), the
    batches in lock-step, and the shards are summed over every rank."""
    from toolkit.preference_functions import kl_batch
    from toolkit.train.evaluate import sharded_batches

    accelerator = strategy.accelerator
    out = torch.zeros(len(rows), 2, dtype=torch.float64, device=accelerator.device)
    model.eval()
    for batch, held in sharded_batches(strategy, rows, batch_size, pad_id, strategy.eval_device(model)):
        logps = strategy.sequence_logps(model, batch)
        if "kl_input_ids" in batch:  # KTO: one sequence per example, and its KL sequence
            logps = torch.stack([logps, strategy.sequence_logps(model, kl_batch(batch))], 1)
        if held:
            out[torch.tensor(held, device=out.device)] = logps.view(-1, 2).to(out.device, torch.float64)
    model.train()
    return (accelerator.reduce(out, "sum") / strategy.data.replicas).float().cpu()


def attach_reference(run, rows, name: str, log, resuming: bool = False) -> None:
    """Give `rows` (training or eval pairs, or KTO's examples) their reference log-probabilities: from the run's output
    folder (a resume), the cache, or a pass over them now, saved to both. A resume that finds neither
    stops in one line: its weights are no longer the reference's (a DeepSpeed-format checkpoint's are
    already loaded, the others' about to be)."""
    import time

    from toolkit.cache import cache_dir
    from toolkit.models import resolved_precision, sft_adapter

    strategy, accelerator = run.strategy, run.strategy.accelerator
    unit = strategy.loss.objective.kind.unit
    key = rows_key(rows.digest(), resolved_precision(run.cfg))
    mine = run.out_dir / FILE
    adapter = sft_adapter(run.cfg)
    dirs = (strategy.unwrap(run.model).config._name_or_path, *([adapter] if adapter else []))
    cached = cache_dir() / "reference" / f"{cache_key(key, *dirs)}.safetensors"
    for path in (mine, cached) if resuming else (cached,):
        found = read_saved(path, name, key)
        if found is not None:
            rows.reference = found
            log(f"reference: {name} {unit}' log-probabilities read from {path}")
            if path != mine and accelerator.is_main_process:
                save(mine, name, key, found, log)
            return
    if resuming:
        raise UserError(f"--resume: this run's reference log-probabilities ({name} {unit}) are in neither {mine} "
                        f"nor {cached}, and the checkpoint's weights are trained, no longer the reference; start the "
                        "run again without --resume")
    start = time.perf_counter()
    try:
        rows.reference = compute_reference(strategy, run.model, rows, run.cfg.train.micro_batch_size,
                                           run.tokenizer.pad_token_id)
    except torch.OutOfMemoryError:
        raise UserError(f"out of memory in the reference pass over the {name} {unit} (a forward at --micro-batch-size "
                        f"{run.cfg.train.micro_batch_size}): lower --micro-batch-size") from None
    log(f"reference: {len(rows)} {name} {unit}' log-probabilities computed before step 1 (the model as loaded), "
        f"in {time.perf_counter() - start:.1f} s")
    if accelerator.is_main_process:
        for path in (mine, cached):
            save(path, name, key, rows.reference, log)
