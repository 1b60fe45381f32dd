"""The layouts accelerate prepares: DDP and one process (`AccelerateStrategy`, context parallel
inside on the mesh), and DeepSpeed ZeRO-0..3 with offload (`DeepSpeedStrategy`, every DeepSpeed quirk
in one place). accelerate wraps the model and shards the data over every rank."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from toolkit.config import Config
from toolkit.layout.dims import ParallelDims
from toolkit.loss import token_loss_sum
from toolkit.loss_head import LossFn, LossHead
from toolkit.parallel.parallelize import Parallelized, parallelize
from toolkit.parallel.strategy import ContextSlices, DataShard, Settings, Strategy, accumulate
from toolkit.parallel.tp import TPShards


class AccelerateStrategy(Strategy):
    """DDP over every rank, or one process; with a mesh, context parallel inside (cp x DDP, the
    data sharded by dp rank only, since cp peers read the same rows)."""

    def __init__(self, accelerator, dims: ParallelDims | None = None, settings: Settings = Settings(),
                 loss_fn: LossFn = token_loss_sum, mesh=None):
        n = accelerator.num_processes
        self.accelerator, self.settings = accelerator, settings
        self.dims = dims or ParallelDims(n, dp_replicate=n)
        self.data = DataShard(accelerator, self.dims, mesh.local_rank("dp") if mesh is not None else None)
        self.context = ContextSlices(mesh, self.dims)
        self.loss = LossHead(loss_fn, accelerator.device.type, accelerator.mixed_precision)
        self.parallelized = Parallelized(TPShards())  # nothing cut: TP and EP run on the mesh strategies

    @property
    def whole_batches(self) -> bool:
        return self.dims.cp == 1

    def shard_model(self, model):
        """Context parallel's attention, checkpointing, compile (`toolkit.parallel.parallelize`)."""
        model, self.parallelized = parallelize(model, self.settings.parallelism(context=self.context))
        return model

    def prepare(self, model, optimizer_fn: Callable, loader):
        optimizer = optimizer_fn(model)
        if self.context.context is not None:  # accelerate would shard the data over every rank, cp peers included
            model, optimizer = self.accelerator.prepare(model, optimizer)
            loader = self.data.loader(loader)
        else:
            model, optimizer, loader = self.accelerator.prepare(model, optimizer, loader)
        self.loss.choose(self.unwrap(model), self.settings.loss)
        return model, optimizer, loader

    def describe(self) -> str:
        n = self.accelerator.num_processes
        if self.context.context:
            layout = f"layout: device mesh {self.dims.describe()} (DDP over dp x cp)"
        elif n > 1:
            layout = f"layout: DDP over {n} ranks: each holds the whole model and optimizer; gradients all-reduced"
        else:
            layout = "layout: one process, the whole model"
        return layout + "\n" + self.context.describe() + self.loss.describe()

    def forward_backward(self, model, micro: list[dict], scale):
        """DDP averages gradients over every rank (dp x cp)."""
        return accumulate(self.accelerator, model, micro, scale, self.loss, self.context, self.dims.dp * self.dims.cp)

    def clip_grad_norm(self, model, max_norm: float):
        return self.accelerator.clip_grad_norm_(model.parameters(), max_norm)

    def state_dict(self, model) -> dict:
        return self.accelerator.get_state_dict(model)


class DeepSpeedStrategy(Strategy):
    """DeepSpeed ZeRO through accelerate's plugin. Its engine keeps its own loss scaling, accumulation
    count, gradient partitions (freed inside backward) and per-rank checkpoint format; a --deepspeed
    file may bring its own optimizer and schedule."""

    checkpoint_format = "hf"  # its per-rank ZeRO partitions: resumed on the same layout only
    always_steps = True  # the engine must step every time (a non-finite step only counts as skipped there)
    frees_grads = True

    def __init__(self, accelerator, dims: ParallelDims, cfg: Config, loss_fn: LossFn = token_loss_sum):
        self.accelerator, self.dims, self.cfg = accelerator, dims, cfg
        self.data = DataShard(accelerator, dims)
        self.context = ContextSlices(None, dims)  # no context parallel under DeepSpeed (toolkit.layout.rules)
        self.loss = LossHead(loss_fn, accelerator.device.type, accelerator.mixed_precision)
        self.parallelized = Parallelized(TPShards())  # nothing cut: TP and EP run on the mesh strategies
        self.file_schedule: dict | None = None  # a --deepspeed file's "scheduler", as it runs

    def shard_model(self, model):
        """Checkpointing and compile (`toolkit.parallel.parallelize`); ZeRO-3 partitions inside
        `from_pretrained` itself, and DeepSpeed's engine shards at `prepare`."""
        model, self.parallelized = parallelize(model, Settings.of(self.cfg).parallelism())
        return model

    def prepare(self, model, optimizer_fn: Callable, loader):
        optimizer = self._file_optimizer(model) or optimizer_fn(model)
        model, optimizer, loader = self.accelerator.prepare(model, optimizer, loader)
        self.loss.choose(self.unwrap(model), self.cfg.train.loss)
        return model, optimizer, loader

    def _file_optimizer(self, model):
        """A --deepspeed file that names an optimizer: DeepSpeed builds it (accelerate's DummyOptim
        stands in for it in `prepare`), with the file's values ("auto" ones filled in)."""
        if "optimizer" not in self.accelerator.state.deepspeed_plugin.deepspeed_config:
            return None
        from accelerate.utils import DummyOptim

        params, decay = [p for p in model.parameters() if p.requires_grad], self.cfg.train.weight_decay
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": decay},  # as make_optimizer:
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]  # no decay on norms, biases
        return DummyOptim([g for g in groups if g["params"]], lr=self.cfg.lr, weight_decay=decay)

    def scheduler(self, optimizer, total_steps: int):
        """The learning-rate schedule a --deepspeed file names (DeepSpeed's own class, built here on the
        prepared optimizer and stepped once per optimizer step by the loop, as DeepSpeed's engine steps
        it), or None for the toolkit's (--lr-schedule)."""
        if not self.cfg.parallel.deepspeed:
            return None
        from toolkit.parallel.zero import file_scheduler

        self.file_schedule, scheduler = file_scheduler(self.cfg, optimizer, total_steps)
        return scheduler

    def describe(self) -> str:
        from toolkit.layout.deepspeed import zero3_first_steps_note

        ds = self.accelerator.state.deepspeed_plugin.deepspeed_config
        slow = zero3_first_steps_note(ds)  # why its step 2 is slow (issue 45)
        return zero_layout(ds, self.accelerator.num_processes) + "\n" + (slow + "\n" if slow else "") \
            + self.loss.describe()

    def forward_backward(self, model, micro: list[dict], scale):
        """The engine averages gradients over its data-parallel ranks and divides each loss by its configured
        --grad-accum (not this step's count)."""
        return accumulate(self.accelerator, model, micro, scale, self.loss, self.context, self.dims.dp,
                          divided_by=self.cfg.train.grad_accum)

    def clip_grad_norm(self, model, max_norm: float):
        return self.accelerator.clip_grad_norm_(model.parameters(), max_norm)

    def step_applied(self, model) -> bool:
        """DeepSpeed skips a step on an fp16 overflow, and then its schedule must not advance either."""
        return model.was_step_applied() if hasattr(model, "was_step_applied") else True

    def eval_device(self, model):
        """Partitioned parameters can report the CPU under offload: the rank's device."""
        return self.accelerator.device

    def state_dict(self, model) -> dict:
        """Gathered even where a --deepspeed file sets stage3_gather_16bit_weights_on_model_save false
        (accelerate then refuses; the final folder needs the whole model)."""
        if hasattr(model, "zero_gather_16bit_weights_on_model_save") and \
                model.zero_optimization_stage() == 3 and not model.zero_gather_16bit_weights_on_model_save():
            return model._zero3_consolidated_16bit_state_dict()
        return self.accelerator.get_state_dict(model)

    def save_run_config(self, out_dir: Path) -> None:
        """What DeepSpeed ran with, accelerate's "auto"s filled in."""
        if self.accelerator.is_main_process:
            config = dict(self.accelerator.state.deepspeed_plugin.deepspeed_config)
            if self.file_schedule:  # stepped by the loop, not by the engine
                config["scheduler"] = self.file_schedule
            if config.get("steps_per_print") == float("inf"):  # accelerate's "never", which JSON cannot hold
                config["steps_per_print"] = 2**31 - 1
            (out_dir / "ds_config.json").write_text(json.dumps(config, indent=2))

    def optimizer_state(self, model, optimizer) -> dict:
        """The ZeRO optimizer's own per-rank state (fp32 master partition, Adam moments) as
        weights_only-loadable values, for its checkpoints."""
        from toolkit.parallel.zero import plain

        return plain(optimizer.optimizer.state_dict())

    def load_optimizer_state(self, model, optimizer, saved: dict) -> None:
        """Undo `optimizer_state`. The model weights are already restored."""
        from toolkit.parallel.zero import load_partitioned, restore_loss_scaler

        zero = optimizer.optimizer
        load_partitioned(zero, restore_loss_scaler(zero, saved), self.accelerator.process_index,
                         self.accelerator.num_processes)


ZERO_SHARDS = {0: "nothing partitioned (DDP-like)", 1: "optimizer state partitioned",
               2: "optimizer state and gradients partitioned",
               3: "parameters, gradients and optimizer state partitioned"}


def zero_layout(ds: dict, ranks: int) -> str:
    """'layout: DeepSpeed ZeRO-3 over 2 ranks: ...; optimizer state offloaded to cpu' from the JSON the
    engine runs with."""
    zero = ds.get("zero_optimization", {})
    stage = int(zero.get("stage", 0))
    line = f"layout: DeepSpeed ZeRO-{stage} over {ranks} rank{'s' if ranks > 1 else ''}: {ZERO_SHARDS.get(stage, '?')}"
    for key, what in (("offload_optimizer", "optimizer state"), ("offload_param", "parameters")):
        device = (zero.get(key) or {}).get("device", "none")
        if device not in ("none", None):
            line += f"; {what} offloaded to {device}"
    return line
