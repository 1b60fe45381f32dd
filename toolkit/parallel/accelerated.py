"""The layouts accelerate prepares: DDP and one process (`AccelerateStrategy`, context parallel
inside on the mesh), and DeepSpeed ZeRO-0..3 with offload (`DeepSpeedStrategy`, every DeepSpeed quirk
in one place). Their engines wrap the model themselves, at `prepare` (`parallelize.apply_engine`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from toolkit.layout.deepspeed import zero3_first_steps_note
from toolkit.parallel import zero
from toolkit.parallel.parallelize import apply_engine
from toolkit.parallel.strategy import Parts, Strategy, accumulate


class AccelerateStrategy(Parts, Strategy):
    """DDP over every rank, or one process; with a mesh, context parallel inside (cp x DDP, the
    data sharded by dp rank only, since cp peers read the same rows)."""

    @property
    def whole_batches(self) -> bool:
        return self.dims.cp == 1

    def prepare(self, model, optimizer_fn: Callable, loader):
        optimizer = optimizer_fn(model)
        # accelerate would shard the data over every rank, cp peers included
        if self.context.context is not None:
            model, optimizer = apply_engine(self.accelerator, model, optimizer)
            loader = self.data.loader(loader)
        else:
            model, optimizer, loader = apply_engine(self.accelerator, model, optimizer, loader)
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


class DeepSpeedStrategy(Parts, Strategy):
    """DeepSpeed ZeRO through accelerate's plugin. Its engine keeps its own loss scaling, accumulation
    count, gradient partitions (freed inside backward) and per-rank checkpoint format; a --deepspeed
    file may bring its own optimizer and schedule (`toolkit.parallel.zero`). ZeRO-3 partitions inside
    `from_pretrained` itself."""

    # its per-rank ZeRO partitions: resumed on the same layout only
    checkpoint_format = "hf"
    # the engine must step every time (a non-finite step only counts as skipped there)
    always_steps = True
    frees_grads = True
    # a --deepspeed file's "scheduler", as it runs
    file_schedule: dict | None = None

    def prepare(self, model, optimizer_fn: Callable, loader):
        optimizer = zero.file_optimizer(self.ds_config, model, self.settings) or optimizer_fn(model)
        model, optimizer, loader = apply_engine(self.accelerator, model, optimizer, loader)
        self.loss.choose(self.unwrap(model), self.settings.loss)
        return model, optimizer, loader

    @property
    def ds_config(self) -> dict:
        """The JSON the engine runs with (accelerate's "auto"s filled in)."""
        return self.accelerator.state.deepspeed_plugin.deepspeed_config

    def scheduler(self, optimizer, total_steps: int):
        """A --deepspeed file's schedule (`toolkit.parallel.zero.file_scheduler`: stepped by the loop), or None."""
        self.file_schedule, scheduler = zero.file_scheduler(self.settings, optimizer, total_steps)
        return scheduler

    def schedule_words(self) -> str:
        return "the --deepspeed file's schedule"

    def describe(self) -> str:
        # why its step 2 is slow
        slow = zero3_first_steps_note(self.ds_config)
        return zero_layout(self.ds_config, self.accelerator.num_processes) + "\n" + (slow + "\n" if slow else "") \
            + self.loss.describe()

    def forward_backward(self, model, micro: list[dict], scale):
        """The engine averages gradients over its data-parallel ranks and divides each loss by its configured
        --grad-accum (not this step's count)."""
        return accumulate(self.accelerator, model, micro, scale, self.loss, self.context, self.dims.dp,
                          divided_by=self.settings.grad_accum)

    def clip_grad_norm(self, model, max_norm: float):
        return self.accelerator.clip_grad_norm_(model.parameters(), max_norm)

    def step_applied(self, model) -> bool:
        """DeepSpeed skips a step on an fp16 overflow, and then its schedule must not advance either."""
        return model.was_step_applied() if hasattr(model, "was_step_applied") else True

    def eval_device(self, model):
        """Partitioned parameters can report the CPU under offload: the rank's device."""
        return self.accelerator.device

    def gathered(self, model):
        """ZeRO-3: every parameter gathered once for the block; ZeRO-0..2 hold them whole."""
        return zero.gathered(model)

    def state_dict(self, model) -> dict:
        return zero.full_state_dict(self.accelerator, model)

    def save_run_config(self, out_dir: Path) -> None:
        """What DeepSpeed ran with, accelerate's "auto"s filled in (the file's schedule, which the loop steps)."""
        if self.accelerator.is_main_process:
            config = {**self.ds_config, **({"scheduler": self.file_schedule} if self.file_schedule else {})}
            (out_dir / "ds_config.json").write_text(json.dumps(zero.json_safe(config), indent=2))

    def optimizer_state(self, model, optimizer) -> dict:
        return zero.plain(optimizer.optimizer.state_dict())

    def load_optimizer_state(self, model, optimizer, saved: dict) -> None:
        zero.load_partitioned(optimizer.optimizer, zero.restore_loss_scaler(optimizer.optimizer, saved),
                              self.accelerator.process_index, self.accelerator.num_processes)


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
