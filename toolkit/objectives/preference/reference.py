"""DPO's and KTO's reference for a full finetune, without a second model: the log-probabilities of every
pair's two sequences (a KTO example's sequence and its KL sequence) under the model as loaded, computed
in one pass before step 1 and carried by the rows into each micro-batch (`ref_logps`, `ref_kl_logps`). A new LoRA needs
none of this: its reference is the base model with
the adapters disabled (`toolkit.objectives.preference.loss.PreferenceLoss.reference_logps`). A LoRA that trains on the
SFT
adapter `--model` names does (`toolkit.model.source.sft_adapter`): its reference is that adapter, on, as loaded.

The pass scores only the training rows the run's steps read (`toolkit.data.loader.rows_read`: a 15-step
run scores 15 global batches, not the file); a row it did not score holds NaN, and reading one is an
error, never a silent loss. Eval rows are scored whole.

The pass is cached, keyed by the rows' tokens, the model's weight files and the compute precision,
and written beside the run (`reference_logps.safetensors` in the output folder), so a resume reads
what the first run computed: computing it again from the trained weights would move the reference.
A fresh run reads the cache and scores only the rows it lacks (a longer run after a short one pays for
the difference); it reads no old run's file in an output folder it overwrites (not its own).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from toolkit.errors import UserError

FILE = "reference_logps.safetensors"


def rows_key(rows_digest: str, precision: str) -> str:
    """What the run's own file is checked against: the rows' tokens (a padding-free run's marked: its values are
    its kernel's rounding) and the precision (its weights are the run's by construction; a touched or
    re-downloaded model folder does not make it stale)."""
    return hashlib.sha256(f"{rows_digest}\x00{precision}".encode()).hexdigest()


def cache_key(rows_key: str, *model_dirs: str) -> str:
    """The shared cache's key: `rows_key`, the model's weight files (name, size, mtime): the base's, and an SFT
    adapter's trained on, whose output the reference is; and the torch and transformers versions, which decide how
    those files load and compute (one folder loaded by two transformers releases can give two models)."""
    import transformers

    h = hashlib.sha256(f"{rows_key}\x00{torch.__version__}\x00{transformers.__version__}".encode())
    for i, model_dir in enumerate(model_dirs):
        path = Path(model_dir)
        # an adapter's folder after the base's, told apart
        if i:
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
    # absent, or damaged: safetensors raises SafetensorError
    except (OSError, ValueError, RuntimeError):
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
        save_file({**old, name: values.contiguous(),
                   f"{name}_key": torch.tensor(list(key.encode()), dtype=torch.uint8)}, str(tmp))
        os.replace(tmp, path)
    except OSError as e:
        log(f"reference: could not write {path} ({e.strerror or e}); a resume of this run then cannot find it")


def unscored(values: torch.Tensor | None, needed: torch.Tensor) -> torch.Tensor:
    """The rows of `needed` (indices) that `values` ((N, 2), NaN where not scored) holds no score for."""
    if values is None:
        return needed
    return needed[torch.isnan(values[needed]).any(1)]


@torch.no_grad()
# compiled blocks keep their training graphs
@torch.compiler.set_stance("force_eager")
def compute_reference(strategy, model, rows, batch_size: int, pad_id: int, padding_free: bool = False) -> torch.Tensor:
    """(N, 2) float32: each pair's (chosen, rejected) sequence log-probabilities under `model` (a KTO
    example's: its sequence's, its KL sequence's), in eval mode. Each data-parallel rank takes a strided shard
    (model-parallel peers the same one), the
    batches in lock-step, and the shards are summed over every rank. `padding_free`: the sequences end to end,
    each scored as its own document by the kernel a padding-free run trains with, so the policy at step 1 is
    the reference to the bit (DPO's ln 2, KTO's KL estimate 0), as padded rows are to padded ones."""
    from toolkit.objectives.preference.functions import kl_batch
    from toolkit.objectives.evaluate import sharded_batches

    accelerator = strategy.accelerator
    out = torch.zeros(len(rows), 2, dtype=torch.float64, device=accelerator.device)
    model.eval()
    for batch, held in sharded_batches(strategy, rows, batch_size, pad_id, strategy.eval_device(model), padding_free):
        logps = strategy.sequence_logps(model, batch)
        # KTO: one sequence per example, and its KL sequence
        if "kl_input_ids" in batch:
            logps = torch.stack([logps, strategy.sequence_logps(model, kl_batch(batch))], 1)
        if held:
            out[torch.tensor(held, device=out.device)] = logps.view(-1, 2).to(out.device, torch.float64)
    model.train()
    return (accelerator.reduce(out, "sum") / strategy.data.replicas).float().cpu()


def needed_rows(accelerator, n: int, read: set[int] | None) -> torch.Tensor:
    """The indices any rank reads (`read`: this rank's; None: all `n`), the same on every rank."""
    if read is None:
        return torch.arange(n)
    mask = torch.zeros(n, dtype=torch.float32, device=accelerator.device)
    mask[torch.tensor(sorted(read), dtype=torch.long, device=mask.device)] = 1
    return torch.nonzero(accelerator.reduce(mask, "sum").cpu() > 0).flatten()


def attach_reference(run, rows, name: str, log, resuming: bool = False, needed: set[int] | None = None,
                     unit: str = "pairs") -> None:
    """Give `rows` (training or eval pairs, or KTO's examples) their reference log-probabilities: from the run's
    output folder (a resume), the cache, or a pass now over those of them the run reads (`needed`: this rank's
    row indices; None: all) that the cache lacks, saved to both. A resume that finds them in neither stops in one
    line: its weights are no longer the reference's (a DeepSpeed-format checkpoint's are already loaded, the
    others' about to be). `run`: the run's `toolkit.objectives.base.Context`; `unit`: what the rows are called."""
    import time

    from toolkit.cache import cache_dir
    from toolkit.model.load import resolved_precision
    from toolkit.model.source import sft_adapter

    from toolkit.model.attention import padding_free_on

    strategy, accelerator = run.strategy, run.strategy.accelerator
    # the training rows of a padding-free run are scored as it trains them (eval's stay padded, as eval runs); so are
    # packed image pairs, which train end to end as padding-free rows do (`toolkit.data.image_rows.ImageBins`)
    free = name == "train" and (padding_free_on(run.cfg, getattr(strategy.unwrap(run.model).config.get_text_config(),
                                                                 "_attn_implementation", None))
                                or (run.cfg.data.packing and getattr(rows, "processor", None) is not None))
    key = rows_key(rows.digest() + ("\x00padding-free" if free else ""), resolved_precision(run.cfg))
    mine = run.out_dir / FILE
    adapter = sft_adapter(run.cfg.model)
    dirs = (strategy.unwrap(run.model).config._name_or_path, *([adapter] if adapter else []))
    cached = cache_dir() / "reference" / f"{cache_key(key, *dirs)}.safetensors"
    need = needed_rows(accelerator, len(rows), needed)
    have = None
    for path in (mine, cached) if resuming else (cached,):
        found = read_saved(path, name, key)
        if found is not None and not len(unscored(found, need)):
            rows.reference = found
            log(f"reference: {name} {unit}' log-probabilities read from {path}")
            if path != mine and accelerator.is_main_process:
                save(mine, name, key, found, log)
            return
        if path == cached:
            # what the cache holds, of other runs' rows: only the rest is scored
            have = found
    todo = unscored(have, need)
    if resuming:
        raise UserError(f"--resume: the reference log-probabilities of {len(todo)} {name} {unit} this run reads are in "
                        f"neither {mine} nor {cached} (its first run scored those its own steps read), and the "
                        "checkpoint's weights are trained, no longer the reference; start the run again without "
                        "--resume")
    start = time.perf_counter()
    try:
        scores = compute_reference(strategy, run.model, torch.utils.data.Subset(rows, todo.tolist()),
                                   run.cfg.train.micro_batch_size, run.tokenizer.pad_token_id, free)
    except torch.OutOfMemoryError:
        raise UserError(f"out of memory in the reference pass over the {name} {unit} (a forward at --micro-batch-size "
                        f"{run.cfg.train.micro_batch_size}): lower --micro-batch-size") from None
    values = torch.full((len(rows), 2), float("nan")) if have is None else have.clone()
    values[todo] = scores
    rows.reference = values
    read = "" if needed is None else f"; the {len(need)} the run's {run.total_steps} steps read" + (
        f", {len(need) - len(todo)} of them from the cache" if len(todo) < len(need) else "")
    log(f"reference: {len(todo)} of {len(rows)} {name} {unit}' log-probabilities computed before step 1 (the model as "
        f"loaded{read}), in {time.perf_counter() - start:.1f} s")
    if accelerator.is_main_process:
        for path in (mine, cached):
            save(path, name, key, values, log)
