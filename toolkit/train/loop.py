"""The training loop on accelerate: micro-batches, accumulation, global-token loss normalisation.

One optimizer step consumes `grad_accum` micro-batches on each of `world` ranks. The micro-batches
of a step are fetched first so the number of target tokens in the whole global batch (`n_global`)
is known before any backward: each micro-batch's summed loss is divided by it, which makes the
update independent of how the global batch is split over ranks and accumulation steps.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Iterator

import torch
from torch.utils.data import DataLoader, Sampler

from toolkit.config import Config, sample_prompts
from toolkit.errors import UserError
from toolkit.cache import cache_dir
from toolkit.parallel import any_rank
from toolkit.data import collate
from toolkit.data.packing import PackedRows, collate_packed, count_examples, pack_bins
from toolkit.train.evaluate import eval_loss, sample_completions
from toolkit.train.flops import head_params, matmul_params, mfu_warning, run_peak, step_flops
from toolkit.loss import count_targets
from toolkit.parallel.memory import grad_bytes, held_bytes
from toolkit.train.metrics import MetricsLogger, log_interval
from toolkit.tracker_spec import requested


class EpochShuffleSampler(Sampler[int]):
    """A permutation that depends only on (seed, epoch): identical on every rank and for every
    world size, so sharding it gives disjoint, reproducible data per rank."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed, self.epoch, self.skip = n, seed, 0, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        """The epoch's permutation; a resume sets `skip` to start mid-epoch without loading the
        skipped examples (it applies to one pass only)."""
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        skip, self.skip = self.skip, 0
        return iter(torch.randperm(self.n, generator=g).tolist()[skip:])

    def __len__(self) -> int:
        return self.n


@dataclass
class TrainResult:
    steps: int  # the run's last step
    final_loss: float
    tokens: int
    elapsed_s: float  # of this process's steps
    first_step: int = 1  # > 1 after a resume

    @property
    def steps_run(self) -> int:
        return self.steps - self.first_step + 1


def device_peak(device: torch.device) -> int | None:
    """The allocator's peak since `reset_device_peak` (torch.cuda.max_memory_allocated); None on the CPU,
    which has no allocator statistics."""
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def reset_device_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def preflight(cfg: Config, accelerator, model_cfg: dict, warn) -> dict:
    """After the first step on a GPU: the measured allocator peak beside the planner's prediction for
    this layout (metrics.jsonl), and one warning line when it is more than 1.1x the prediction."""
    measured = device_peak(accelerator.device)
    if measured is None:
        return {}
    from toolkit.models import resolved_precision
    from toolkit.planner.auto import predicted_peak

    predicted = predicted_peak(cfg, model_cfg, resolved_precision(cfg))
    if predicted and measured > 1.1 * predicted and accelerator.is_main_process:
        warn(f"warning: step 1 peaked at {measured / 2**30:.2f} GiB of device memory, {measured / predicted:.2f}x the "
             f"planner's {predicted / 2**30:.2f} GiB for this layout; memory plans (--strategy auto, plan) may not fit")
    return {"peak_allocated_bytes": measured, "predicted_peak_bytes": predicted}


def out_of_memory(cfg: Config, step: int, strategy, model_cfg: dict, out_dir: Path) -> str:
    """One line for an out-of-memory at `step`: where, the planner's figures and a layout that fits,
    and what was kept (the checkpoints on disk are complete: a save is renamed into place whole)."""
    from toolkit.models import resolved_precision
    from toolkit.layout.rules import strategy_name
    from toolkit.planner.auto import memory_advice
    from toolkit.train.checkpoint import complete_checkpoints

    t, p = cfg.train, cfg.parallel
    kept = complete_checkpoints(out_dir)
    layout = strategy_name(p) or f"tp {p.tp} x pp {p.pp} x cp {p.cp} x dp-shard {p.dp_shard or 1}"
    where = (f"layout {layout} on {strategy.accelerator.num_processes} process(es), micro-batch {t.micro_batch_size}, seq-len {cfg.data.seq_len}, "
             f"gradient checkpointing {'on' if t.gradient_checkpointing else 'off'}")
    return (f"out of memory at step {step} ({where}): {memory_advice(cfg, model_cfg, resolved_precision(cfg))}. "
            + (f"The last checkpoint, {kept[-1]}, is intact (--resume auto continues from it)" if kept
               else "No checkpoint had been written (--save-every N keeps some)"))


def make_optimizer(model: torch.nn.Module, cfg: Config) -> torch.optim.Optimizer:
    """AdamW; no weight decay on biases and norm weights (1-D tensors), as in nanoGPT.

    The fused kernel (one pass over each parameter's memory; transformers.Trainer's default on
    torch >= 2.8) where the parameters' device and dtype have it: a step over SmolLM2-135M's weights
    is 9x faster than torch's default per-tensor loop on a 2-core CPU (benchmarks/adamw.md). The
    update is the same AdamW; ZeRO and FSDP step it on their own partitions."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.train.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.999), eps=1e-8, fused=fused_adamw_supported(params))


def fused_adamw_supported(params: list[torch.Tensor]) -> bool:
    """torch's own rule (floating point, a device with fused kernels), checked here because AdamW
    applies it only at the first step."""
    try:
        from torch.optim.optimizer import _device_dtype_check_for_fused

        for p in params:
            _device_dtype_check_for_fused(p)
    except (ImportError, RuntimeError):
        return False
    return True


def make_loader(rows: list[dict], cfg: Config, pad_id: int) -> DataLoader:
    """Micro-batches in a seeded per-epoch order; accelerate.prepare shards it across ranks.
    With --packing the rows are packed once (deterministically) and the packed rows shuffled."""
    sampler = EpochShuffleSampler(len(rows), cfg.train.seed)
    # Its own generator: a DataLoader iterator otherwise draws its base seed from the global RNG when
    # it starts, which would shift dropout's random stream depending on where a resumed run started.
    return DataLoader(rows, batch_size=cfg.train.micro_batch_size, sampler=sampler,
                      collate_fn=partial(collate_packed if cfg.data.packing else collate, pad_id=pad_id),
                      generator=torch.Generator().manual_seed(cfg.train.seed))


def stream_loader(stream, cfg: Config, tokenizer) -> DataLoader:
    """Micro-batches of records in stream order, tokenized (and packed) by the collate_fn on the rank
    that trains them; accelerate.prepare shards it (`toolkit.data.stream`)."""
    from toolkit.data.stream import StreamCollate

    return DataLoader(stream, batch_size=cfg.train.micro_batch_size,
                      collate_fn=StreamCollate(stream, tokenizer.pad_token_id, cfg.data.packing))


def global_batches(loader, grad_accum: int, sampler: EpochShuffleSampler | None = None, start: tuple[int, int] = (0, 0),
                   ) -> Iterator[tuple[int, list[dict]]]:
    """(epoch, micro-batches of one optimizer step), forever; an epoch's last step may be short.
    `start` = (epoch, sampler indices already consumed in it) resumes mid-epoch."""
    epoch, skip = start
    while True:
        loader.set_epoch(epoch)
        if skip:
            sampler.skip, skip = skip, 0
        chunk: list[dict] = []
        for batch in loader:
            chunk.append(batch)
            if len(chunk) == grad_accum:
                yield epoch, chunk
                chunk = []
        if chunk:
            yield epoch, chunk
        epoch += 1


def keep_records_through(path: Path, step: int) -> None:
    """Drop metrics records past `step` (written by a run that died before its next checkpoint)."""
    if path.exists():
        lines = [ln for ln in path.read_text().splitlines() if ln.strip() and json.loads(ln).get("step", 0) <= step]
        path.write_text("".join(ln + "\n" for ln in lines))


def per_rank_bytes(accelerator, mine: dict[str, int]) -> dict[str, list[int]]:
    """{key: [rank 0 value, rank 1 value, ...]} for the memory record."""
    keys = sorted(mine)
    local = torch.tensor([mine[k] for k in keys], dtype=torch.int64, device=accelerator.device)
    every = accelerator.gather(local.unsqueeze(0)).view(accelerator.num_processes, len(keys)).cpu()
    return {k: every[:, i].tolist() for i, k in enumerate(keys)}


def train(cfg: Config, strategy, model, tokenizer, train_rows: list[dict], eval_rows: list[dict],
          out_dir: Path, log=print, resume=None) -> tuple[torch.nn.Module, TrainResult]:
    """Train `model` with `strategy` (a `toolkit.parallel.strategy.Strategy`: it prepares the model,
    runs each step's forward and backward, clips and saves); returns the model to save."""
    from transformers import get_scheduler

    from toolkit.train.checkpoint import (load_rank_state, prune_checkpoints, restore_sharded, save_checkpoint,
                                          set_rng_state, torch_optimizer)
    from toolkit.train.faults import EXIT_PREEMPTED, Preemption, fault_hook
    from toolkit.train.resume import fingerprint

    t = cfg.train
    streamed = cfg.data.streaming  # train_rows is a RecordStream: tokenized per micro-batch as it is read
    if cfg.data.packing and not streamed:  # from the lengths column of a table: no row is read to pack
        n_examples = len(train_rows)
        lengths = getattr(train_rows, "lengths", None)
        lengths = [len(r["input_ids"]) for r in train_rows] if lengths is None else lengths
        train_rows = PackedRows(train_rows, pack_bins(lengths, cfg.data.seq_len), lengths)
        fill = sum(lengths) / (len(train_rows) * cfg.data.seq_len)
        log(f"packing: {n_examples} examples -> {len(train_rows)} rows of <= {cfg.data.seq_len} tokens ({fill:.1%} full)")
    loader = stream_loader(train_rows, cfg, tokenizer) if streamed else make_loader(train_rows, cfg,
                                                                                     tokenizer.pad_token_id)
    sampler = None if streamed else loader.sampler
    accelerator = strategy.accelerator
    model, optimizer, loader = strategy.prepare(model, partial(make_optimizer, cfg=cfg), loader)
    unwrapped = strategy.unwrap(model)
    log(strategy.describe())
    steps_per_epoch = t.max_steps if streamed else math.ceil(len(loader) / t.grad_accum)  # a stream: no epochs
    total_steps = t.max_steps if t.max_steps > 0 else t.epochs * steps_per_epoch
    # Not passed to prepare(): accelerate would step it once per process.
    scheduler = strategy.scheduler(optimizer, total_steps) or get_scheduler(
        t.lr_schedule, optimizer, num_warmup_steps=min(t.warmup_steps, total_steps), num_training_steps=total_steps)
    world, replicas = strategy.data.ranks, strategy.data.replicas  # model-parallel peers read the same data
    strategy.save_run_config(out_dir)
    log(f"training: {total_steps} steps ({steps_per_epoch}/epoch), global batch "
        f"{t.micro_batch_size} x {t.grad_accum} accum x {world} data-parallel ranks = "
        f"{t.micro_batch_size * t.grad_accum * world} examples")

    # MFU: model FLOPs over the devices' datasheet peak (a probe where the device is unknown).
    model_cfg, n_matmul, n_head = unwrapped.config, matmul_params(unwrapped), head_params(unwrapped)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(accelerator.mixed_precision, torch.float32)
    reset_device_peak(accelerator.device)  # step 1's peak (preflight) counts what is loaded, then the run's own
    peak = run_peak(accelerator, dtype, cache_dir() / "peaks.json")
    mfu_warned = False
    first_step, tokens_seen = 1, 0
    if resume is not None:  # weights, optimizer, scheduler, data position (global: examples consumed), RNG
        # another layout reads rank 0's scheduler and hyperparameters (the same on every rank)
        saved = load_rank_state(accelerator, resume.path, accelerator.process_index if resume.same_layout else 0)
        if resume.sharded:  # this layout's pieces, whatever layout wrote them
            restore_sharded(strategy, model, optimizer, resume.path)
            for group, hyper in zip(torch_optimizer(optimizer).param_groups, saved["param_groups"]):
                group.update(hyper)
        else:  # weights were restored at load (DeepSpeed's format)
            strategy.load_optimizer_state(model, optimizer, saved["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])
        if saved.get("scaler") is not None and accelerator.scaler is not None:
            accelerator.scaler.load_state_dict(saved["scaler"])
        first_step, tokens_seen = resume.step + 1, int(resume.state.get("tokens", 0))
        for note in resume.notes:
            log(note)
        log(f"resumed from {resume.path}: continuing at step {first_step} of {total_steps}")
    if cfg.output.resume and accelerator.is_main_process:  # records past the checkpoint (or all, when
        keep_records_through(out_dir / "metrics.jsonl", first_step - 1)  # none was found) are of lost steps
    epoch0, step_in_epoch = divmod(first_step - 1, steps_per_epoch)
    if streamed:  # skipped in the stream itself, before it is sharded: steps x global batch records
        train_rows.start, step_in_epoch = (first_step - 1) * t.grad_accum * t.micro_batch_size * world, 0
    batches = global_batches(loader, t.grad_accum, sampler,
                             (epoch0, step_in_epoch * t.grad_accum * t.micro_batch_size * world))
    pad_id = tokenizer.pad_token_id
    metrics = MetricsLogger(out_dir, total_steps, accelerator.is_main_process, done=first_step - 1,
                            report_to=requested(cfg.output.report_to), config=cfg.flat())
    log_every = log_interval(cfg.output.log_every, total_steps)
    prompts = sample_prompts(cfg.output.sample_prompts) if cfg.output.sample_prompts else []

    def evaluate(step: int) -> None:
        t_eval = time.perf_counter()
        el = eval_loss(strategy, model, eval_rows, t.micro_batch_size, pad_id)
        metrics.log({"step": step, "eval_loss": el, "elapsed_s": time.perf_counter() - start})
        metrics.write(f"step {step}: eval_loss {el:.4f}")
        window["t0"] += time.perf_counter() - t_eval  # keep eval time out of tokens_per_sec

    def sample(step: int) -> None:
        t_sample = time.perf_counter()
        metrics.samples(step, prompts, sample_completions(strategy, model, tokenizer, prompts,
                                                          cfg.output.sample_max_new_tokens))
        window["t0"] += time.perf_counter() - t_sample

    fault, preempt, bad_steps = fault_hook(), Preemption(), 0

    def checkpoint(step: int, epoch: int) -> Path:
        path = out_dir / f"checkpoint-{step}"
        state = {"step": step, "epoch": epoch, "tokens": tokens_seen, "fingerprint": fingerprint(cfg, world),
                 "config": cfg.flat()}
        save_checkpoint(strategy, model, tokenizer, optimizer, scheduler, path, state, fault)
        prune_checkpoints(accelerator, out_dir, cfg.output.keep_last)
        return path

    start = time.perf_counter()
    window = {"loss": 0.0, "targets": 0.0, "tokens": 0.0, "examples": 0.0, "t0": start}
    last_loss = float("nan")
    memory: dict[str, list[int]] = {}
    model.train()
    if resume is not None:  # last: model set-up above may draw random numbers
        if resume.same_layout:
            set_rng_state(saved["rng"])
        else:  # per-rank streams (dropout) cannot carry over to other ranks: reseeded deterministically
            from accelerate.utils import set_seed

            set_seed(cfg.train.seed + resume.step, device_specific=True)
    try:  # the progress bar closes before any error line, and the signal handlers are put back
        if first_step == 1 and cfg.output.eval_on_start:  # the model as loaded: step 0
            if eval_rows:
                evaluate(0)
            if prompts:
                sample(0)
        for step in range(first_step, total_steps + 1):
            epoch, micro = next(batches)
            counts = torch.stack([sum(count_targets(b["labels"]) for b in micro),
                                  sum(b["attention_mask"].sum() for b in micro),
                                  sum(count_examples(b) for b in micro)]).to(torch.float64)
            n_global, tokens_global, examples_global = (accelerator.reduce(counts, "sum") / replicas).tolist()
            # each micro-batch's summed loss over the global batch's target count; x world: data-parallel
            # ranks average their gradients
            loss_sum = strategy.forward_backward(model, micro, scale=world / n_global)
            grads_held = grad_bytes(model) if step == first_step and not strategy.frees_grads else None
            grad_norm = strategy.clip_grad_norm(model, t.max_grad_norm or float("inf"))
            step_loss = accelerator.reduce(loss_sum, "sum").item() / replicas
            if math.isfinite(step_loss) and (grad_norm is None or math.isfinite(float(grad_norm))) or strategy.always_steps:
                optimizer.step()
                if strategy.step_applied(model):  # DeepSpeed skips fp16 overflow steps; so does the schedule
                    scheduler.step()
                bad_steps = 0 if math.isfinite(step_loss) else bad_steps + 1
            else:  # skip the update: the weights, optimizer and schedule stay where they were
                bad_steps += 1
            optimizer.zero_grad(set_to_none=True)
            if step == first_step:
                memory = preflight(cfg, accelerator, unwrapped.config.to_dict(), metrics.write)
                memory.update({**per_rank_bytes(accelerator, held_bytes(model, optimizer)),
                          "grad_bytes": per_rank_bytes(accelerator, {"g": grads_held})["g"] if grads_held is not None else None})
            if bad_steps:
                metrics.log({"step": step, "skipped_update": True, "loss_sum": step_loss,
                             "grad_norm": float(grad_norm) if grad_norm is not None else None})
                metrics.write(f"step {step}: non-finite loss or gradient norm; update skipped ({bad_steps} in a row)")
                if bad_steps >= t.max_bad_steps:
                    path = checkpoint(step, epoch)
                    raise UserError(f"stopped at step {step}: the loss or gradient norm was not finite for {bad_steps} "
                                    f"steps in a row (--max-bad-steps {t.max_bad_steps}); state saved to {path}. Lower "
                                    "--lr, check the data for broken rows, or use --mixed-precision bf16 instead of fp16")
                continue

            window["loss"] += step_loss
            window["targets"] += n_global
            window["tokens"] += tokens_global
            window["examples"] += examples_global
            tokens_seen += int(tokens_global)
            metrics.advance()
            if step % log_every == 0 or step == total_steps:
                now = time.perf_counter()
                last_loss = window["loss"] / window["targets"]
                tokens_per_sec = window["tokens"] / (now - window["t0"])
                flops = step_flops(window["tokens"], window["targets"] if strategy.loss.fused else window["tokens"], n_matmul, n_head,
                                   model_cfg.num_hidden_layers, model_cfg.hidden_size,
                                   window["tokens"] / window["examples"])  # context: mean example length
                per_token = flops / window["tokens"]
                mfu = per_token * tokens_per_sec / peak.flops
                if peak.cache is not None and any_rank(accelerator, mfu > 1):  # cached under load: probe again
                    peak = run_peak(accelerator, dtype, peak.cache, fresh=True)
                    mfu = per_token * tokens_per_sec / peak.flops
                warning = None if mfu_warned else mfu_warning(mfu, peak)
                if warning:
                    metrics.write(warning)
                    mfu_warned = True
                metrics.log({"step": step, "epoch": epoch, "loss": last_loss, "lr": scheduler.get_last_lr()[0],
                             "grad_norm": float(grad_norm) if grad_norm is not None else None,
                             "tokens": tokens_seen, "tokens_per_sec": tokens_per_sec,
                             "mfu": mfu, "flops_per_token": per_token, "peak_flops": peak.flops,
                             "peak_source": peak.source, "measured_peak_flops": peak.measured,
                             "elapsed_s": now - start, **memory})
                memory = {}
                window = {"loss": 0.0, "targets": 0.0, "tokens": 0.0, "examples": 0.0, "t0": now}
            at_eval = (cfg.output.eval_every and step % cfg.output.eval_every == 0) or step == total_steps
            if eval_rows and at_eval:
                evaluate(step)
            every = cfg.output.sample_every
            if prompts and (step == total_steps or (step % every == 0 if every else at_eval)):
                sample(step)
            if cfg.output.save_every and step % cfg.output.save_every == 0 and step != total_steps:
                checkpoint(step, epoch)
            if fault is not None:
                fault("step", step)
            if step != total_steps and preempt.requested(accelerator):
                path = checkpoint(step, epoch)
                metrics.write(f"preempted at step {step}: checkpoint saved to {path}; continue with --resume auto")
                metrics.close()  # the bar ends before the exit
                accelerator.end_training()
                raise SystemExit(EXIT_PREEMPTED)
    except torch.OutOfMemoryError:
        raise UserError(out_of_memory(cfg, step, strategy, unwrapped.config.to_dict(), out_dir)) from None
    finally:
        preempt.restore()
        metrics.close()
    return strategy.export(model), TrainResult(total_steps, last_loss, tokens_seen, time.perf_counter() - start, first_step)
