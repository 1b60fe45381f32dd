"""DeepSpeed ZeRO's optimizer state for its resumable checkpoints, as `weights_only`-loadable
values (every other layout writes sharded state: `toolkit.train.sharded_state`).

The ZeRO optimizer's own per-rank `state_dict()` (this rank's fp32 master partition and Adam
moments), with the few Python objects in it (the loss scaler, enums, dataclasses, named tuples)
turned into plain values, since DeepSpeed's own `load_checkpoint` unpickles with
`weights_only=False`. It is loaded back through the ZeRO optimizer's `load_state_dict` with
`load_from_fp32_weights=True`, so the fp32 masters come back exactly (not rounded from bf16).
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
