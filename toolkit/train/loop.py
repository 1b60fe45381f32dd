"""The training loop on accelerate: micro-batches, accumulation, global-token loss normalisation.

One optimizer step consumes `grad_accum` micro-batches on each of `data_ranks` data-parallel ranks.
The micro-batches of a step are fetched first so the number of target tokens in the whole global
batch (`n_global`) is known before any backward: each micro-batch's summed loss is divided by it,
which makes the update independent of how the global batch is split over ranks and accumulation steps.

`train` reads top to bottom as a run goes: `set_up` (loader, strategy, schedule, resume), then per
step `one_step` (forward, backward, clip, update: no host sync, `toolkit.train.step`),
`log_window` (the one read-back per metrics record), `after_step` (eval, samples, checkpoints,
faults, preemption), and `finish`.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from toolkit.cache import cache_dir
from toolkit.config import Config
from toolkit.config.paths import sample_prompts
from toolkit.data.packing import Collate
from toolkit.errors import UserError
from toolkit.parallel import any_rank, rank_max
from toolkit.parallel.grad_norm import full
from toolkit.parallel.memory import grad_bytes, held_bytes
from toolkit.train.compiling import EAGER_STEPS, Compiling
from toolkit.train.compiling import plan as compile_plan
from toolkit.objectives.base import Batches, Context, Interrupted
from toolkit.objectives.evaluate import sample_completions
from toolkit.train.flops import Peak, head_params, matmul_params, mfu_warning, run_peak, step_flops
from toolkit.train.loss_check import check_causal, check_loss, check_packing
from toolkit.train.metrics import MetricsLogger, log_interval
from toolkit.train.step import Step, Window, batch_counts, host, sync_free


@dataclass
class TrainResult:
    # the run's last step
    steps: int
    final_loss: float
    tokens: int
    # of this process's steps
    elapsed_s: float
    # > 1 after a resume
    first_step: int = 1
    # of the steps before the checkpoint it resumed from the last one measured
    elapsed_before: float = 0.0
    eval_loss: float | None = None
    # the device allocator's peak over the steps (None on a CPU)
    peak_allocated_bytes: int | None = None

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
    from toolkit.model.load import resolved_precision
    from toolkit.model.vision import plan_view
    from toolkit.planner.auto import predicted_peak

    # an image-text model: its language model and its vision side's parameters
    text, vision = plan_view(model_cfg)
    predicted = predicted_peak(cfg, text, resolved_precision(cfg), vision)
    if predicted and measured > 1.1 * predicted and accelerator.is_main_process:
        warn(f"warning: step 1 peaked at {measured / 2**30:.2f} GiB of device memory, {measured / predicted:.2f}x the "
             f"planner's {predicted / 2**30:.2f} GiB for this layout; memory plans (--strategy auto, plan) may not fit")
    return {"peak_allocated_bytes": measured, "predicted_peak_bytes": predicted}


def out_of_memory(cfg: Config, step: int, strategy, model_cfg: dict, out_dir: Path) -> str:
    """One line for an out-of-memory at `step`: where, the planner's figures and a layout that fits,
    and what was kept (the checkpoints on disk are complete: a save is renamed into place whole)."""
    from toolkit.layout.rules import layout_words
    from toolkit.model.load import resolved_precision
    from toolkit.model.vision import plan_view
    from toolkit.planner.auto import memory_advice
    from toolkit.train.checkpoint import complete_checkpoints

    t = cfg.train
    kept = complete_checkpoints(out_dir)
    where = (f"layout {layout_words(cfg.parallel)} on {strategy.accelerator.num_processes} process(es), "
             f"micro-batch {t.micro_batch_size}, "
             f"seq-len {cfg.data.seq_len}, gradient checkpointing {'on' if t.gradient_checkpointing else 'off'}")
    text, vision = plan_view(model_cfg)
    advice = memory_advice(cfg, text, resolved_precision(cfg), vision)
    return (f"out of memory at step {step} ({where}): {advice}. "
            + (f"The last checkpoint, {kept[-1]}, is intact (--resume auto continues from it)" if kept
               else "No checkpoint had been written (--save-every N keeps some)"))


def make_optimizer(model: torch.nn.Module, cfg: Config) -> torch.optim.Optimizer:
    """AdamW; no weight decay on biases and norm weights (1-D tensors), as in nanoGPT.

    The fused kernel (one pass over each parameter's memory; transformers.Trainer's default on
    torch >= 2.8) where the parameters' device and dtype have it: a step over SmolLM2-135M's weights
    is 9x faster than torch's default per-tensor loop on a 2-core CPU (benchmarks/adamw.md), and it
    skips a non-finite step on the device (`toolkit.train.step`). The update is the same AdamW;
    ZeRO and FSDP step it on their own partitions."""
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


# the checkpoint's key for what the objective's batches keep (`Batches.state_dict`; its name in older checkpoints)
BATCHES_STATE = "rollout"


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


@dataclass
class Run:
    """One training run between its steps: what `set_up` built and what the steps carry forward."""
    cfg: Config
    # toolkit.parallel.strategy.Strategy
    strategy: Any
    model: torch.nn.Module
    optimizer: Any
    scheduler: Any
    tokenizer: Any
    eval_rows: list
    out_dir: Path
    # the objective's: read from the rows, or sampled
    batches: Batches
    metrics: MetricsLogger
    total_steps: int
    first_step: int
    tokens_seen: int
    peak: Peak
    dtype: torch.dtype
    log_every: int
    prompts: list[str]
    fault: Any
    preempt: Any
    start: float
    window: Window
    sync_free: bool
    # step 1's memory figures, for its record
    memory: dict = field(default_factory=dict)
    # whether and from when blocks compile
    compiling: Compiling = field(default_factory=lambda: Compiling("off"))
    # training seconds before the checkpoint this run resumed from
    elapsed_before: float = 0.0
    last_eval: float | None = None
    bad_in_a_row: int = 0
    mfu_warned: bool = False
    # experts left without a token: said once a run (`toolkit.model.router_load.idle_warning`)
    idle_warned: bool = False
    # the loss head computed the logits of the target tokens only (the MFU's LM-head FLOPs)
    fused: bool = False
    # the MoE layers, the rows of a step's expert load
    moe_layers: tuple[str, ...] = ()
    last_loss: float = float("nan")
    # the run's (`toolkit.objectives.base.Objective`): the strategy's
    objective: Any = None
    # what the objective is given of the run
    context: Context | None = None
    # the step of the newest checkpoint, this process's or the one it resumed from (step, epoch) of the last step whose
    # update was applied
    saved_step: int = 0
    done: tuple[int, int] = (0, 0)
    # how to continue this run, in the preemption's line
    resume_hint: str = "--resume auto"

    @property
    def data_ranks(self) -> int:
        """The data-parallel degree: ranks that read different micro-batches (not the world size)."""
        return self.strategy.data.ranks

    def elapsed(self, now: float) -> float:
        """Training seconds of the whole run at `now`, the runs it resumed from included."""
        return now - self.start + self.elapsed_before

    @property
    def replicas(self) -> int:
        # model-parallel peers read the same data
        return self.strategy.data.replicas


def train(cfg: Config, strategy, model, tokenizer, train_rows: list[dict], eval_rows: list[dict],
          out_dir: Path, log=print, resume=None, restart=None, trackers=None,
          on_start=None) -> tuple[torch.nn.Module, TrainResult]:
    """Train `model` with `strategy` (a `toolkit.parallel.strategy.Strategy`: it prepares the model,
    runs each step's forward and backward, clips and saves); returns the model to save. `restart(step)`:
    what --strategy auto does about an out-of-memory (`planner.auto.restart_after_oom`) before it is
    reported. `trackers`: `toolkit.train.trackers.start_trackers`' (None: metrics.jsonl only).
    `on_start(model)`: run on the prepared model before the first step (the exact match before training)."""
    run = set_up(cfg, strategy, model, tokenizer, train_rows, eval_rows, out_dir, log, resume, trackers, on_start)
    step = run.first_step - 1
    profiler = None
    if cfg.output.profile:
        from toolkit.train.profiling import StepProfiler

        profiler = StepProfiler(out_dir, strategy.accelerator.device.type, run.first_step, run.total_steps,
                                strategy.accelerator.is_main_process, run.metrics.write)
    # the progress bar closes before any error line, and the signal handlers are put back
    try:
        # the model as loaded: step 0
        if run.first_step == 1 and cfg.output.eval_on_start:
            evaluate(run, 0)
        for step in range(run.first_step, run.total_steps + 1):
            epoch, micro = next(run.batches)
            # sampling and scoring: not training
            run.window.t0 += run.batches.take_seconds()
            # the loss this layout trains is the model's own, or the run stops
            if step == run.first_step:
                check_loss(run, micro[0])
                # images: the processor's inputs keep the text causal (GRPO's rows are the sampler's, left-padded)
                if cfg.data.images == "on" and "labels" in micro[0] and "completion_ids" not in micro[0]:
                    check_causal(run, micro[0])
                # packed or padding-free rows (pp and cp build the masks themselves)
                if "position_ids" in micro[0] and run.strategy.whole_batches:
                    check_packing(run, micro[0])
            if profiler is not None:
                profiler.before(step)
            run.window.add(step, one_step(run, micro, first=step == run.first_step))
            run.done = (step, epoch)
            if profiler is not None:
                # its record: the profiler's overhead in it
                run.memory["profiled"] = profiler.active(step) or None
                run.memory = {k: v for k, v in run.memory.items() if v is not None}
                profiler.after(step)
            run.metrics.advance()
            compile_auto(run, step)
            # the compile step gets a record of its own, and so do the eager steps before it: compile time kept apart
            apart = run.compiling.at is not None and step in (run.compiling.at - 1, run.compiling.at)
            if step % run.log_every == 0 or step == run.total_steps or apart:
                log_window(run, step, epoch)
            after_step(run, step, epoch)
    # a signal while the objective sampled or evaluated: its work is abandoned
    except Interrupted as stopped:
        preempted(run, *run.done, f"while {stopped}")
    except torch.OutOfMemoryError:
        if restart is not None:
            run.metrics.close()
            # runs the command again on the plan's next fallback, or returns: none left
            restart(step)
        raise UserError(out_of_memory(cfg, step, strategy, run.strategy.unwrap(run.model).config.to_dict(),
                                      out_dir)) from None
    finally:
        # a fault between two records: what the steps measured is written (as far as it can be)
        if run.window.steps:
            try:
                log_window(run, *run.done)
            except Exception:  # noqa: BLE001 - the device itself may be what failed; the fault is what is raised
                pass
        run.preempt.restore()
        run.metrics.close()
    return finish(run)


def set_up(cfg: Config, strategy, model, tokenizer, train_rows, eval_rows, out_dir: Path, log, resume,
           trackers=None, on_start=None) -> Run:
    """The loader, the prepared model and optimizer, the schedule, the MFU peak; a resumed run's state."""
    from transformers import get_scheduler

    from toolkit.train.faults import Preemption, fault_hook

    t = cfg.train
    device = strategy.accelerator.device
    compiling = compile_plan(cfg, device.type, model, strategy.accelerator.num_processes, cache_dir(), log,
                             keeps=strategy.accelerator.is_main_process)
    objective = strategy.objective
    # the language model's (an image-text model's vision tower keeps its own)
    attn = getattr(strategy.unwrap(model).config.get_text_config(), "_attn_implementation", None)
    loader = objective.loader(train_rows, tokenizer, log, device.type == "cuda", strategy.whole_batches, attn)
    # widths to bucket
    compiling.collate = loader.collate_fn if isinstance(loader.collate_fn, Collate) else None
    model, optimizer, loader = strategy.prepare(model, partial(make_optimizer, cfg=cfg), loader)
    log(strategy.describe())
    world = strategy.data.ranks
    steps_per_epoch = objective.steps_per_epoch(loader, train_rows, world)
    total_steps = t.max_steps if t.max_steps > 0 else t.epochs * steps_per_epoch
    # Not passed to prepare(): accelerate would step it once per process.
    scheduler = strategy.scheduler(optimizer, total_steps)
    schedule = strategy.schedule_words() if scheduler is not None else t.lr_schedule + (
        f" after {min(t.warmup_steps, total_steps)} warm-up steps" if t.warmup_steps else "")
    scheduler = scheduler or get_scheduler(
        t.lr_schedule, optimizer, num_warmup_steps=min(t.warmup_steps, total_steps), num_training_steps=total_steps)
    strategy.save_run_config(out_dir)
    log(f"training: {total_steps} steps ({steps_per_epoch}/epoch), global batch "
        f"{t.micro_batch_size} x {t.grad_accum} accum x {world} data-parallel ranks = "
        + objective.batch_words(t.micro_batch_size * t.grad_accum * world))
    log(f"learning rate: {cfg.lr_words}, {schedule}")
    accelerator = strategy.accelerator
    # MFU: model FLOPs over the devices' datasheet peak (a probe where the device is unknown).
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(accelerator.mixed_precision, torch.float32)
    # step 1's peak (preflight) counts what is loaded, then the run's own
    reset_device_peak(accelerator.device)
    peak = run_peak(accelerator, dtype, cache_dir() / "peaks.json")
    run = Run(cfg, strategy, model, optimizer, scheduler, tokenizer, eval_rows, out_dir, iter(()),
              None, total_steps, 1, 0, peak, dtype, log_interval(cfg.output.log_every, total_steps),
              sample_prompts(cfg.output.sample_prompts) if cfg.output.sample_prompts else [], fault_hook(),
              Preemption(), 0.0, Window(0.0), sync_free(optimizer, accelerator, strategy.always_steps),
              compiling=compiling)
    run.objective = objective
    try:
        return _start(run, log, loader, train_rows, eval_rows, steps_per_epoch, resume, trackers, on_start)
    # the loop's own `finally` is not reached yet: the signal handlers are put back here, the metrics closed
    except BaseException:
        run.preempt.restore()
        # the set-up's own error is the one to say
        with contextlib.suppress(Exception):
            if run.metrics is not None:
                run.metrics.close()
        raise


def _start(run: Run, log, loader, train_rows, eval_rows, steps_per_epoch: int, resume, trackers, on_start) -> Run:
    """The objective's set-up, a checkpoint's state, the batches and the metrics: `set_up`'s part after the
    signal handlers are installed."""
    cfg, strategy, model, objective = run.cfg, run.strategy, run.model, run.objective
    accelerator, compiling, total_steps = strategy.accelerator, run.compiling, run.total_steps
    run.context = Context(cfg, strategy, model, run.tokenizer, run.out_dir, total_steps, run.log_every, log,
                          partial(frozen_copy, cfg, strategy, model), lambda: run.preempt.signal is not None,
                          run.fault, lambda line: run.metrics.write(line), run.preempt.abandonable)
    # before the checkpoint's weights are restored: a reference is the model as loaded
    objective.before_training(run.context, loader, train_rows, eval_rows, steps_per_epoch, resume is not None)
    saved = restore(run, resume, log) if resume is not None else None
    run.saved_step, run.done = run.first_step - 1, (run.first_step - 1, 0)
    # --compile: compiled by `parallelize`, its first forward the warm-up
    if compiling.mode == "on":
        compiling.at = run.first_step
        compiling.bucket()
    # records past the checkpoint (or all, when none was found) are of lost steps
    if cfg.output.resume and accelerator.is_main_process:
        keep_records_through(run.out_dir / "metrics.jsonl", run.first_step - 1)
    # a checkpoint written mid-round keeps the round's rest
    run.batches = objective.batches(run.context, loader, train_rows, run.first_step, steps_per_epoch,
                                    saved.get(BATCHES_STATE) if saved is not None else None)
    # before the bar: what it prints stays whole
    if on_start is not None:
        on_start(model)
    run.metrics = MetricsLogger(run.out_dir, total_steps, accelerator.is_main_process, done=run.first_step - 1,
                                trackers=trackers)
    run.start = time.perf_counter()
    run.window = Window(run.start)
    model.train()
    # last: model set-up above may draw random numbers
    if resume is not None:
        reseed(run, resume, saved)
    return run


def frozen_copy(cfg: Config, strategy, model) -> torch.nn.Module:
    """A frozen copy of the model as loaded (read again from its folder: a resumed run's weights are trained),
    in eval mode, on this rank's device: an objective's reference for a full finetune (the objective allows it
    only where the model is whole on each rank)."""
    from toolkit.model.load import ModelShape, load_model
    from toolkit.parallel.parallelize import Parallelism, parallelize

    # the policy's kernels (--attn, --experts, --kernels), no adapters (a full finetune) and no layout
    path = strategy.unwrap(model).config._name_or_path
    reference, _ = parallelize(load_model(cfg, path), Parallelism(ModelShape.of(cfg)))
    reference = reference.to(strategy.accelerator.device).eval()
    reference.requires_grad_(False)
    return reference


def restore(run: Run, resume, log) -> dict:
    """Weights, optimizer, scheduler and scaler of a checkpoint (the data position is global: examples
    consumed); returns this rank's saved state (its RNG is set last, by `reseed`)."""
    from toolkit.train.checkpoint import load_rank_state, restore_sharded, torch_optimizer

    strategy, accelerator = run.strategy, run.strategy.accelerator
    # another layout reads rank 0's scheduler and hyperparameters (the same on every rank)
    saved = load_rank_state(accelerator, resume.path, accelerator.process_index if resume.same_layout else 0)
    # this layout's pieces, whatever layout wrote them
    if resume.sharded:
        restore_sharded(strategy, run.model, run.optimizer, resume.path)
        for group, hyper in zip(torch_optimizer(run.optimizer).param_groups, saved["param_groups"]):
            group.update(hyper)
    # weights were restored at load (DeepSpeed's format)
    else:
        strategy.load_optimizer_state(run.model, run.optimizer, saved["optimizer"])
    run.scheduler.load_state_dict(saved["scheduler"])
    if saved.get("scaler") is not None and accelerator.scaler is not None:
        accelerator.scaler.load_state_dict(saved["scaler"])
    run.first_step, run.tokens_seen = resume.step + 1, int(resume.state.get("tokens", 0))
    # elapsed_s counts the whole run
    run.elapsed_before = float(resume.state.get("elapsed_s", 0.0))
    for note in resume.notes:
        log(note)
    log(f"resumed from {resume.path}: continuing at step {run.first_step} of {run.total_steps}")
    return saved


def reseed(run: Run, resume, saved: dict) -> None:
    """The random streams where the checkpoint left them; per-rank streams (dropout) cannot carry over
    to other ranks, so another layout reseeds deterministically."""
    if resume.same_layout:
        from toolkit.train.checkpoint import set_rng_state

        set_rng_state(saved["rng"])
    else:
        from accelerate.utils import set_seed

        set_seed(run.cfg.train.seed + resume.step, device_specific=True)


def one_step(run: Run, micro: list[dict], first: bool = False) -> Step:
    """Forward and backward of the global batch, the clip and the update; its numbers stay on the
    device (`toolkit.train.step`). Each micro-batch's summed loss is divided by the global batch's
    target count (n_global); what a backend's gradient sync and accumulation divide by is undone inside
    the strategy (`toolkit.parallel.strategy.loss_scale`)."""
    from toolkit.train.checkpoint import torch_optimizer

    strategy, accelerator, t = run.strategy, run.strategy.accelerator, run.cfg.train
    counts = accelerator.reduce(batch_counts(micro, accelerator.device), "sum") / run.replicas
    run.objective.begin_step(run.model, micro, partial(accelerator.reduce, reduction="sum"), run.replicas, counts[0])
    loss = strategy.forward_backward(run.model, micro, scale=1 / counts[0])
    # the loss head's, once: the router's aux loss, the objective's sums, the load
    taken = strategy.take_metrics()
    run.fused = taken.fused
    aux, sums = taken.aux, taken.objective
    if sums is not None:
        sums = accelerator.reduce(sums, "sum") / run.replicas
    held = grad_bytes(run.model) if first and not strategy.frees_grads else None
    grad_norm = strategy.clip_grad_norm(run.model, t.max_grad_norm or float("inf"))
    # FSDP2's is a DTensor (replicated): its local value, every rank alike
    if grad_norm is not None:
        grad_norm = full(torch.as_tensor(grad_norm)).to(accelerator.device)
    loss = accelerator.reduce(loss, "sum") / run.replicas
    finite = torch.isfinite(loss)
    if grad_norm is not None:
        finite = finite & torch.isfinite(grad_norm)
    # a non-finite step is skipped inside the fused kernel; the schedule goes on
    if run.sync_free:
        torch_optimizer(run.optimizer).found_inf = (~finite).float()
        run.optimizer.step()
        run.scheduler.step()
    elif strategy.always_steps or host(finite)[0]:
        run.optimizer.step()
        # DeepSpeed skips fp16 overflow steps; so does the schedule
        if strategy.step_applied(run.model):
            run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    if first:
        run.memory.update(preflight(run.cfg, accelerator, strategy.unwrap(run.model).config.to_dict(),
                                    run.metrics.write))
        run.memory.update({**per_rank_bytes(accelerator, held_bytes(run.model, run.optimizer)),
                           "grad_bytes": per_rank_bytes(accelerator, {"g": held})["g"] if held is not None else None})
    if aux is not None:
        aux = accelerator.reduce(aux, "sum") / run.replicas
    load = None
    # tokens per expert: ratios are read from it, so no normaliser
    if taken.load is not None:
        load = accelerator.reduce(taken.load, "sum")
        run.moe_layers = taken.layers
    return Step(loss, counts, grad_norm, finite, aux, sums, load)


def compile_auto(run: Run, step: int) -> None:
    """--compile auto (`toolkit.train.compiling`): time EAGER_STEPS eager steps after the first (every
    rank's slowest: they decide alike), then compile the blocks from the next step if that pays."""
    c = run.compiling
    if c.mode != "auto" or c.at is not None:
        return
    accelerator = run.strategy.accelerator

    def sync() -> None:
        if accelerator.device.type == "cuda":
            torch.cuda.synchronize(accelerator.device)

    def slowest(seconds: float) -> float:
        return float(rank_max(accelerator, torch.tensor([seconds], device=accelerator.device)).item())

    if step == run.first_step:
        c.start_timing(sync)
    # through `parallelize`'s own compile step
    elif step == run.first_step + EAGER_STEPS:
        from toolkit.parallel.parallelize import apply_compile

        c.decide(step, run.total_steps, sync, lambda: apply_compile(run.strategy.unwrap(run.model)), run.metrics.write,
                 slowest)


def log_window(run: Run, step: int, epoch: int) -> None:
    """The metrics record of the steps since the last one: the one read-back of their numbers, the
    skipped updates among them, and the stop after --max-bad-steps non-finite steps in a row."""
    w, t = run.window.read(), run.cfg.train
    for s, finite, loss, grad_norm in w["steps"]:
        run.bad_in_a_row = 0 if finite else run.bad_in_a_row + 1
        if not finite:
            run.metrics.log({"step": s, "skipped_update": True, "loss_sum": loss, "grad_norm": grad_norm})
            run.metrics.write(f"step {s}: non-finite loss or gradient norm; update skipped "
                              f"({run.bad_in_a_row} in a row)")
    if run.bad_in_a_row >= t.max_bad_steps:
        path = checkpoint(run, step, epoch)
        # recorded above, step by step
        run.window = Window(time.perf_counter())
        raise UserError(f"stopped at step {step}: the loss or gradient norm was not finite for {run.bad_in_a_row} "
                        f"steps in a row (--max-bad-steps {t.max_bad_steps}); state saved to {path}. Lower "
                        "--lr, check the data for broken rows, or use --mixed-precision bf16 instead of fp16")
    run.tokens_seen += int(w["tokens"])
    now = time.perf_counter()
    # some step of the window was finite
    if w["targets"]:
        record_step(run, step, epoch, w, now)
    run.window = Window(now)


def record_step(run: Run, step: int, epoch: int, w: dict, now: float) -> None:
    """Loss, throughput and MFU of the window's finite steps, into metrics.jsonl and the trackers."""
    strategy = run.strategy
    unwrapped = strategy.unwrap(run.model)
    model_cfg = unwrapped.config.get_text_config()
    run.last_loss = w["loss"] / w["targets"]
    tokens_per_sec = w["tokens"] / (now - run.window.t0)
    shape = (matmul_params(unwrapped), head_params(unwrapped), model_cfg.num_hidden_layers, model_cfg.hidden_size,
             # context: mean example length
             w["tokens"] / w["examples"])
    flops = step_flops(w["tokens"], w["targets"] if run.fused else w["tokens"], *shape)
    # the objective's no-grad forwards (LoRA's reference, KTO's KL): 2N of 6N each
    flops += run.objective.extra_forwards() * step_flops(w["tokens"], w["tokens"], *shape) / 3
    per_token = flops / w["tokens"]
    mfu = per_token * tokens_per_sec / run.peak.flops
    # cached under load: probe again
    if run.peak.cache is not None and any_rank(strategy.accelerator, mfu > 1):
        run.peak = run_peak(strategy.accelerator, run.dtype, run.peak.cache, fresh=True)
        mfu = per_token * tokens_per_sec / run.peak.flops
    warning = None if run.mfu_warned else mfu_warning(mfu, run.peak)
    if warning:
        run.metrics.write(warning)
        run.mfu_warned = True
    grad_norm = w["steps"][-1][3]
    warmup = {}
    # left out of every later record's tokens/s
    if step == run.compiling.at:
        run.compiling.warmed_up(step, now - run.window.t0, run.metrics.write)
        warmup = {"compile_warmup": True, "compiled_graphs": run.compiling.graphs_after_warmup}
    else:
        # graphs compiled so far, once warmed up
        warmup = run.compiling.recompiles(run.metrics.write)
    extra = {"aux_loss": w["aux"] / w["targets"]} if w.get("aux") is not None else {}
    # how evenly the routers spread the window's tokens
    if w.get("load") is not None:
        from toolkit.model.router_load import idle_warning, load_stats

        extra.update(load_stats(w["load"]))
        idle = None if run.idle_warned else idle_warning(w["load"], list(run.moe_layers), step)
        if idle:
            run.metrics.write(idle)
            run.idle_warned = True
    # the objective's (TRL's names, means over the window's units), and what producing its batches measured
    if w.get("objective") is not None:
        extra.update(run.objective.metric_values(w["objective"], w["targets"]))
    extra.update(run.batches.take_metrics())
    run.metrics.log({"step": step, "epoch": epoch, "loss": run.last_loss, **extra, "lr": run.scheduler.get_last_lr()[0],
                     "grad_norm": grad_norm, "tokens": run.tokens_seen, "tokens_per_sec": tokens_per_sec,
                     "padding_ratio": w["computed"] / w["tokens"],
                     "mfu": mfu, "flops_per_token": per_token, "peak_flops": run.peak.flops,
                     "peak_source": run.peak.source, "measured_peak_flops": run.peak.measured,
                     "elapsed_s": run.elapsed(now), **warmup, **run.memory})
    run.memory = {}


def after_step(run: Run, step: int, epoch: int) -> None:
    """Eval loss and samples at their cadence, a checkpoint every --save-every and at the last step, the
    fault-injection hook, and a preemption: checkpoint and exit."""
    o, last = run.cfg.output, step == run.total_steps
    at_eval = (o.eval_every and step % o.eval_every == 0) or last
    if run.eval_rows and at_eval:
        evaluate(run, step, samples=False)
    if run.prompts and (last or (step % o.sample_every == 0 if o.sample_every else at_eval)):
        sample(run, step)
    # the last step too: --continue-finished goes on from it, at step N + 1, not from an earlier one
    if o.save_every and (step % o.save_every == 0 or last):
        checkpoint(run, step, epoch)
    if run.fault is not None:
        run.fault("step", step)
    if not last and run.preempt.requested(run.strategy.accelerator):
        preempted(run, step, epoch, f"at step {step}")


def preempted(run: Run, step: int, epoch: int, where: str) -> None:
    """A stop asked for by a signal: the metrics of the steps not yet recorded written, the last finished step
    (`step`) saved where no checkpoint holds it yet, and the exit (status 143)."""
    from toolkit.train.faults import EXIT_PREEMPTED

    if run.window.steps:
        log_window(run, step, epoch)
    if step < 1:
        said = "nothing to save before step 1"
    else:
        path = run.out_dir / f"checkpoint-{step}"
        if run.saved_step != step:
            path = checkpoint(run, step, epoch)
        said = f"checkpoint saved to {path}; continue with {run.resume_hint}"
    run.metrics.write(f"preempted {where}: {said}")
    # the bar ends before the exit
    run.metrics.close()
    run.strategy.accelerator.end_training()
    raise SystemExit(EXIT_PREEMPTED)


def evaluate(run: Run, step: int, samples: bool = True) -> None:
    """The eval loss (and, at step 0, the samples); their time is kept out of tokens_per_sec."""
    t0 = time.perf_counter()
    if run.eval_rows:
        with run.metrics.pause(f"eval, {len(run.eval_rows)} examples"):
            record = run.objective.evaluate(run.context, run.eval_rows)
        name = run.objective.eval_metric
        el = record[name]
        run.metrics.log({"step": step, **record, "elapsed_s": run.elapsed(time.perf_counter())})
        run.last_eval = el
        run.metrics.write(f"step {step}: {name} {el:.4f}")
    run.window.t0 += time.perf_counter() - t0
    if samples and run.prompts:
        sample(run, step)


def sample(run: Run, step: int) -> None:
    t0 = time.perf_counter()
    with run.metrics.pause(f"sampling {len(run.prompts)} prompts"):
        completions = sample_completions(run.strategy, run.model, run.tokenizer, run.prompts,
                                         run.cfg.output.sample_max_new_tokens)
    run.metrics.samples(step, run.prompts, completions)
    run.window.t0 += time.perf_counter() - t0


def checkpoint(run: Run, step: int, epoch: int) -> Path:
    from toolkit.train.checkpoint import prune_checkpoints, save_checkpoint
    from toolkit.train.resume import fingerprint

    path = run.out_dir / f"checkpoint-{step}"
    # this window's steps are not in tokens_seen yet
    tokens = run.tokens_seen + run.window.tokens()
    settings = run.cfg.flat()
    state = {"step": step, "epoch": epoch, "tokens": tokens, "fingerprint": fingerprint(settings, run.data_ranks),
             "config": settings, "elapsed_s": run.elapsed(time.perf_counter())}
    batches = run.batches.state_dict()
    save_checkpoint(run.strategy, run.model, run.tokenizer, run.optimizer, run.scheduler, path, state, run.fault,
                    {BATCHES_STATE: batches} if batches is not None else None)
    prune_checkpoints(run.strategy.accelerator, run.out_dir, run.cfg.output.keep_last)
    run.saved_step = step
    return path


def finish(run: Run) -> tuple[torch.nn.Module, TrainResult]:
    # read before the export gathers anything
    peak = device_peak(run.strategy.accelerator.device)
    return run.strategy.export(run.model), TrainResult(run.total_steps, run.last_loss, run.tokens_seen,
                                                       time.perf_counter() - run.start, run.first_step,
                                                       run.elapsed_before, run.last_eval, peak)
