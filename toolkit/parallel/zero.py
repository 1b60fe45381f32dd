"""The DeepSpeed runtime pieces the strategies use: a `--deepspeed` file's learning-rate schedule
(built here, stepped by the loop), full weights written into a model ZeRO-3 partitioned while
loading, and ZeRO's optimizer state for its resumable checkpoints (every other layout writes
sharded state: `toolkit.train.sharded_state`).

The optimizer state is the ZeRO optimizer's own per-rank `state_dict()` (this rank's fp32 master
partition and Adam moments), with the few Python objects in it (the loss scaler, enums, dataclasses,
named tuples) turned into plain, `weights_only`-loadable values, since DeepSpeed's own
`load_checkpoint` unpickles with `weights_only=False`. It is loaded back through the ZeRO optimizer's
`load_state_dict` with `load_from_fp32_weights=True`, so the fp32 masters come back exactly (not
rounded from bf16).
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
from contextlib import contextmanager
from typing import Any, Iterator

import torch

from toolkit.layout.deepspeed import fill_auto, read_user_config

LOSS_SCALER_KEY = "__loss_scaler__"


def _plain(value, where: str = "optimizer state"):
    """A copy of `value` built from tensors, numbers, strings, lists, tuples and dicts only."""
    # before the numbers: an IntEnum is an int too
    if isinstance(value, enum.Enum):
        return _plain(value.value, where)
    if value is None or isinstance(value, (torch.Tensor, bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {k: _plain(v, f"{where}[{k!r}]") for k, v in value.items()}
    # named tuples and torch.Size become plain tuples
    if isinstance(value, tuple):
        return tuple(_plain(v, where) for v in value)
    if isinstance(value, list):
        return [_plain(v, where) for v in value]
    # e.g. DeepSpeed's fragment_address (where a parameter sits in a partition)
    if dataclasses.is_dataclass(value):
        return _plain(dataclasses.asdict(value), where)
    # DeepSpeed's (Dynamic)LossScaler: its numbers
    if type(value).__name__.endswith("LossScaler"):
        return {LOSS_SCALER_KEY: {k: _plain(v, where) for k, v in vars(value).items()}}
    raise TypeError(f"{where}: cannot store a {type(value).__name__} in a weights_only checkpoint")


def plain(value) -> dict:
    """`value` (an optimizer's state_dict) as weights_only-loadable values."""
    return _plain(value)


def restore_loss_scaler(optimizer, saved: dict) -> dict:
    """`saved` with its stored loss-scaler numbers put back into the optimizer's live scaler object."""
    saved = dict(saved)
    for key, value in list(saved.items()):
        if isinstance(value, dict) and LOSS_SCALER_KEY in value:
            scaler = getattr(optimizer, "loss_scaler", None)
            if scaler is not None:
                vars(scaler).update(value[LOSS_SCALER_KEY])
            saved[key] = scaler
    return saved


def load_partitioned(optimizer, saved: dict, rank: int, ranks: int) -> None:
    """Load this rank's partition into a partitioned (ZeRO-1/2/3) optimizer, whose `load_state_dict`
    takes one entry per data-parallel rank, with the fp32 masters restored exactly
    (`load_from_fp32_weights`, not rounded from bf16); a stage-0 client optimizer takes it as is."""
    if "state_dict_list" in inspect.signature(optimizer.load_state_dict).parameters:
        states = [None] * ranks
        states[rank] = saved
        optimizer.load_state_dict(states, load_optimizer_states=True, load_from_fp32_weights=True)
    else:
        optimizer.load_state_dict(saved)


def file_optimizer(ds_config: dict, model, settings):
    """A --deepspeed file that names an optimizer: DeepSpeed builds it (accelerate's DummyOptim stands in for
    it in `prepare`), with the file's values ("auto" ones filled in); None where the file names none."""
    if "optimizer" not in ds_config:
        return None
    from accelerate.utils import DummyOptim

    params, decay = [p for p in model.parameters() if p.requires_grad], settings.weight_decay
    # as make_optimizer:
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": decay},
              # no decay on norms, biases
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return DummyOptim([g for g in groups if g["params"]], lr=settings.lr, weight_decay=decay)


def file_scheduler(settings, optimizer, total_steps: int) -> tuple[dict[str, Any] | None, Any]:
    """(the file's "scheduler" section as it runs, DeepSpeed's scheduler on `optimizer`), or (None, None)
    when there is no --deepspeed file or it names none: the loop steps the toolkit's (--lr-schedule). Built
    on the prepared optimizer and stepped once per optimizer step by the loop, as DeepSpeed's engine steps
    it. Its "auto"s: warm-up from 0 to --lr over --warmup-steps, `total_steps` (`settings`:
    `toolkit.parallel.strategy.Settings`)."""
    if not settings.deepspeed_file:
        return None, None
    section = read_user_config(settings.deepspeed_file).get("scheduler")
    if not section:
        return None, None
    from deepspeed.runtime import lr_schedules

    s = settings
    filled = fill_auto({"scheduler": section}, micro_batch=s.micro_batch, grad_accum=s.grad_accum, data_ranks=1,
                       mixed_precision="no", max_grad_norm=s.max_grad_norm, lr=s.lr, weight_decay=s.weight_decay,
                       warmup_steps=s.warmup_steps, total_steps=total_steps)["scheduler"]
    return filled, getattr(lr_schedules, filled["type"])(optimizer, **filled.get("params", {}))


def full_state_dict(accelerator, engine) -> dict:
    """The engine's full state dict, gathered even where a --deepspeed file sets
    stage3_gather_16bit_weights_on_model_save false (accelerate then refuses; the final folder needs the whole
    model)."""
    if hasattr(engine, "zero_gather_16bit_weights_on_model_save") and \
            engine.zero_optimization_stage() == 3 and not engine.zero_gather_16bit_weights_on_model_save():
        return engine._zero3_consolidated_16bit_state_dict()
    return accelerator.get_state_dict(engine)


def json_safe(config: dict) -> dict:
    """The engine's config as JSON holds it: accelerate's "never" for steps_per_print is an infinity."""
    return {**config, "steps_per_print": 2**31 - 1} if config.get("steps_per_print") == float("inf") else config


def load_full_state_dict(model, state: dict):
    """`model.load_state_dict(state, strict=False)`, also for a model that ZeRO-3 partitioned while
    loading (transformers loads under `deepspeed.zero.Init` when accelerate's plugin is stage 3): there
    one parameter is gathered at a time, written and re-partitioned (collective; rank 0's copy is kept)."""
    if not any(hasattr(p, "ds_id") for p in model.parameters()):
        return model.load_state_dict(state, strict=False)
    from types import SimpleNamespace

    import deepspeed

    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, param in params.items():
            if name in state:
                with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
                    param.copy_(state[name])
    return SimpleNamespace(missing_keys=[k for k in params if k not in state],
                           unexpected_keys=[k for k in state if k not in params])


@contextmanager
def gathered(engine) -> Iterator[torch.nn.Module]:
    """The engine's module, for a block of forwards without gradients (generation). ZeRO-3: every
    parameter all-gathered once for the block (`deepspeed.zero.GatheredParameters`) and ZeRO's per-module
    fetch and release hooks off meanwhile, so no forward gathers or releases anything; the hooks and the
    coordinator's recorded order put back after (TRL's `unwrap_model_for_generation`, trl/models/utils.py;
    DeepSpeed's own in runtime/zero/stage3.py). ZeRO-0..2 hold whole parameters: the module as it is."""
    module = engine.module
    if engine.zero_optimization_stage() != 3:
        yield module
        return
    import deepspeed

    offload = getattr(engine.optimizer, "parameter_offload", engine.optimizer)
    with deepspeed.zero.GatheredParameters(list(module.parameters())):
        for hook in [*offload.forward_hooks, *offload.backward_hooks]:
            hook.remove()
        offload.forward_hooks, offload.backward_hooks = [], []
        try:
            yield module
        finally:
            coordinator = getattr(offload, "param_coordinator", None)
            if coordinator is not None and not coordinator.is_invalid_trace():
                # the generation's forwards are not training's order
                coordinator._invalidate_trace()
            offload._register_deepspeed_module(offload.module)
