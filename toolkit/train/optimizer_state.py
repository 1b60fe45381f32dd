"""Optimizer state for resumable checkpoints, for every strategy, as `weights_only`-loadable values.

- DDP, TP, PP: the rank's own `optimizer.state_dict()` (plain tensors and numbers).
- DeepSpeed ZeRO-1/2/3: the ZeRO optimizer's own per-rank `state_dict()` (this rank's fp32 master
  partition and Adam moments), with the few Python objects in it (the loss scaler, enums,
  dataclasses, named tuples) turned into plain values, since DeepSpeed's own `load_checkpoint` unpickles with
  `weights_only=False`. It is loaded back through the ZeRO optimizer's `load_state_dict` with
  `load_from_fp32_weights=True`, so the fp32 masters come back exactly (not rounded from bf16).
- FSDP2: the consolidated state from `torch.distributed.checkpoint.state_dict` (full tensors on
  rank 0, keyed by parameter name), broadcast from rank 0 when loaded.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect

import torch

LOSS_SCALER_KEY = "__loss_scaler__"


def _plain(value, where: str = "optimizer state"):
    """A copy of `value` built from tensors, numbers, strings, lists, tuples and dicts only."""
    if isinstance(value, enum.Enum):  # before the numbers: an IntEnum is an int too
        return _plain(value.value, where)
    if value is None or isinstance(value, (torch.Tensor, bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {k: _plain(v, f"{where}[{k!r}]") for k, v in value.items()}
    if isinstance(value, tuple):  # named tuples and torch.Size become plain tuples
        return tuple(_plain(v, where) for v in value)
    if isinstance(value, list):
        return [_plain(v, where) for v in value]
    if dataclasses.is_dataclass(value):  # e.g. DeepSpeed's fragment_address (where a parameter sits in a partition)
        return _plain(dataclasses.asdict(value), where)
    if type(value).__name__.endswith("LossScaler"):  # DeepSpeed's (Dynamic)LossScaler: its numbers
        return {LOSS_SCALER_KEY: {k: _plain(v, where) for k, v in vars(value).items()}}
    raise TypeError(f"{where}: cannot store a {type(value).__name__} in a weights_only checkpoint")


def _zero_optimizer(accelerator, optimizer):
    """DeepSpeed's optimizer behind accelerate's wrapper (ZeRO-1/2/3, or the client optimizer at stage 0)."""
    return optimizer.optimizer if accelerator.distributed_type == "DEEPSPEED" else None


def optimizer_state(accelerator, model, optimizer) -> dict:
    """This rank's share of the optimizer state (collective under FSDP)."""
    if accelerator.distributed_type == "FSDP":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        return get_optimizer_state_dict(model, optimizer.optimizer,
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    zero = _zero_optimizer(accelerator, optimizer)
    return _plain(zero.state_dict() if zero is not None else optimizer.state_dict())


def load_optimizer_state(accelerator, model, optimizer, saved: dict) -> None:
    """Undo `optimizer_state` (collective under FSDP). The model weights are already restored."""
    if accelerator.distributed_type == "FSDP":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(model, optimizer.optimizer, saved,
                                 options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        return
    zero = _zero_optimizer(accelerator, optimizer)
    if zero is None:
        optimizer.load_state_dict(saved)
        return
    saved = dict(saved)
    for key, value in list(saved.items()):  # the live loss scaler object, with the saved numbers
        if isinstance(value, dict) and LOSS_SCALER_KEY in value:
            scaler = getattr(zero, "loss_scaler", None)
            if scaler is not None:
                vars(scaler).update(value[LOSS_SCALER_KEY])
            saved[key] = scaler
    if "state_dict_list" in inspect.signature(zero.load_state_dict).parameters:  # ZeRO-1/2/3: one entry per dp rank
        states = [None] * accelerator.num_processes
        states[accelerator.process_index] = saved
        zero.load_state_dict(states, load_optimizer_states=True, load_from_fp32_weights=True)
    else:
        zero.load_state_dict(saved)
