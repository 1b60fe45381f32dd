"""The device mesh for a `ParallelDims`: `init_device_mesh` with named dimensions, and the
process groups the TP layers and pipeline stages use, taken from it."""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from toolkit.parallel.dims import MESH_DIMS, ParallelDims


def build_mesh(dims: ParallelDims, device_type: str) -> DeviceMesh:
    """Every rank calls this once, in the same order (it creates the groups of each dimension)."""
    mesh = init_device_mesh(device_type, dims.shape, mesh_dim_names=MESH_DIMS)
    mesh["dp_replicate", "dp_shard"]._flatten("dp")  # the data-parallel group: replicas and shards together
    return mesh


def fsdp_mesh(mesh: DeviceMesh, dims: ParallelDims) -> DeviceMesh:
    """What FSDP2 shards over: `dp_shard`, or (HSDP) `dp_replicate` x `dp_shard`, replicated across the
    outer dimension and sharded within."""
    return mesh["dp_replicate", "dp_shard"] if dims.dp_replicate > 1 else mesh["dp_shard"]


def local_mesh(tp: int = 1, pp: int = 1) -> DeviceMesh:
    """A mesh over the running world with the given model-parallel degrees, the rest data parallel
    (for tests and benchmarks that build layouts without the CLI)."""
    from toolkit.parallel.dims import infer_dims
    from toolkit.errors import UserError

    dims, problems = infer_dims(dist.get_world_size(), tp=tp, pp=pp)
    if problems:
        raise UserError("; ".join(problems))
    return build_mesh(dims, "cuda" if dist.get_backend() == "nccl" else "cpu")
