"""The device mesh for a `ParallelDims`: `init_device_mesh` with named dimensions, and the
process groups the TP layers and pipeline stages use, taken from it."""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from toolkit.layout.dims import MESH_DIMS, ParallelDims


def build_mesh(dims: ParallelDims, device_type: str) -> DeviceMesh:
    """Every rank calls this once, in the same order (it creates the groups of each dimension). The
    flattened dimensions are kept as `mesh.flat[name]` (torch deprecates slicing them from the root);
    their process groups are `mesh.get_group(name)`."""
    mesh = init_device_mesh(device_type, dims.shape, mesh_dim_names=MESH_DIMS)
    mesh.flat = {"dp": mesh["dp_replicate", "dp_shard"]._flatten("dp")}  # the data-parallel group: replicas and shards
    if dims.cp > 1:  # cp ranks read the same data but hold different tokens: gradients average over them too
        mesh.flat["dp_cp"] = mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
        mesh.flat["dp_shard_cp"] = mesh["dp_shard", "cp"]._flatten("dp_shard_cp")  # torchtitan's: FSDP2 shards over cp too
    mesh.ep = ep_mesh(dims, device_type) if dims.ep > 1 else None
    return mesh


EP_DIMS = ("pp", "dp_replicate", "dp_shard_mod_ep", "ep", "cp", "tp")


def ep_mesh(dims: ParallelDims, device_type: str) -> DeviceMesh:
    """The same ranks with dp_shard cut into (dp_shard_mod_ep, ep), ep inner: `init_device_mesh` lays
    both meshes out as arange(world) in row-major order, so rank r has the same pp/dp_replicate/cp/tp
    coordinates in each, and dp_shard coordinate d = m * ep + e. The ep groups exchange tokens; the
    experts are FSDP-sharded over `expert_fsdp_mesh`."""
    shape = (dims.pp, dims.dp_replicate, dims.dp_shard // dims.ep, dims.ep, dims.cp, dims.tp)
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=EP_DIMS)
    mesh.flat = {"dp_shard_mod_ep_cp": mesh["dp_shard_mod_ep", "cp"]._flatten("dp_shard_mod_ep_cp")} if dims.cp > 1 else {}
    return mesh


def expert_groups(mesh: DeviceMesh, dims: ParallelDims) -> tuple:
    """(the ep group, the expert FSDP mesh, the expert shard group: what the experts' gradient norm sums
    over, replicas apart), or (None, None, None) without --ep."""
    if dims.ep == 1:
        return None, None, None
    inner = mesh.ep.flat["dp_shard_mod_ep_cp"] if dims.cp > 1 else mesh.ep["dp_shard_mod_ep"]
    return mesh.ep.get_group("ep"), expert_fsdp_mesh(mesh.ep, dims), inner.get_group()


def expert_fsdp_mesh(mesh: DeviceMesh, dims: ParallelDims) -> DeviceMesh:
    """What FSDP2 shards the experts over: the ranks that hold the same experts, dp_shard_mod_ep (x cp),
    replicated across dp_replicate (HSDP) as the dense parts are."""
    inner = "dp_shard_mod_ep_cp" if dims.cp > 1 else "dp_shard_mod_ep"
    if dims.dp_replicate > 1:
        return mesh["dp_replicate", inner]
    return mesh.flat[inner] if dims.cp > 1 else mesh[inner]


def fsdp_mesh(mesh: DeviceMesh, dims: ParallelDims) -> DeviceMesh:
    """What FSDP2 shards over: `dp_shard` (x `cp`), or (HSDP) `dp_replicate` x that, replicated across
    the outer dimension and sharded within."""
    if dims.cp == 1:
        return mesh["dp_replicate", "dp_shard"] if dims.dp_replicate > 1 else mesh["dp_shard"]
    return mesh["dp_replicate", "dp_shard_cp"] if dims.dp_replicate > 1 else mesh.flat["dp_shard_cp"]


def grad_dim(dims: ParallelDims, sharded: bool = False) -> str:
    """The mesh dimension gradients are averaged (`sharded`: reduce-scattered) over."""
    if sharded:
        return "dp_shard_cp" if dims.cp > 1 else "dp_shard"
    return "dp_cp" if dims.cp > 1 else "dp"


def local_mesh(tp: int = 1, pp: int = 1) -> DeviceMesh:
    """A mesh over the running world with the given model-parallel degrees, the rest data parallel
    (for tests and benchmarks that build layouts without the CLI)."""
    from toolkit.layout.dims import infer_dims
    from toolkit.errors import UserError

    dims, problems = infer_dims(dist.get_world_size(), tp=tp, pp=pp)
    if problems:
        raise UserError("; ".join(problems))
    return build_mesh(dims, "cuda" if dist.get_backend() == "nccl" else "cpu")
