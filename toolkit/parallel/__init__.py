"""Parallel layouts at run time: the Accelerator and the strategy a run is built with
(`build`), the strategies themselves (`strategy`: the typed seam; `accelerated`, `sharded`,
`pp.strategy`), the device mesh, the TP/PP/CP runtimes and DeepSpeed's pieces (`zero`)."""

from __future__ import annotations


def rank_max(accelerator, values):
    """The elementwise max of `values` (a tensor on the accelerator's device) over every rank: one
    all-reduce, none with one process. torch's own op: accelerate's `reduce` takes "max" only from 1.14,
    and its 1.10-1.13 (within our floor) sum whatever they are asked."""
    if accelerator.num_processes == 1:
        return values
    import torch.distributed as dist

    out = values.detach().clone()
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return out


def any_rank(accelerator, flag: bool) -> bool:
    """True on every rank when `flag` is True on any (one all-reduce; none with one process)."""
    if accelerator.num_processes == 1:
        return flag
    import torch

    return rank_max(accelerator, torch.tensor([float(flag)], device=accelerator.device)).item() > 0


# the default group it was made beside -> the group
_HOST_GROUP: dict = {}


def host_group():
    """A process group over every rank whose collectives run on the CPU (gloo): for agreeing on host
    facts (a signal arrived) without waiting for the work queued on a GPU. The default group where
    that is gloo already. Collective the first time in a process group: every rank calls it, in the
    same order."""
    import torch.distributed as dist

    default = dist.distributed_c10d._get_default_group()
    if default not in _HOST_GROUP:
        _HOST_GROUP.clear()
        _HOST_GROUP[default] = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
    return _HOST_GROUP[default]


def host_all_reduce_max(value: float) -> float:
    """The max of `value` over every rank, on the CPU (`host_group`); `value` itself without a process group."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    flag = torch.tensor([value])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=host_group())
    return float(flag.item())


def host_gather(value) -> list:
    """`value` from every rank, in rank order (a CPU all-gather of picklable objects, `host_group`)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [value]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value, group=host_group())
    return out
