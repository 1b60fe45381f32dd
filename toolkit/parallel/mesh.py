"""The device mesh for a `ParallelDims` and its named views, looked up by name as torchtitan's
`ParallelDims.get_mesh("dp_shard")` does: one `init_device_mesh` with the named dimensions, the
flattened ones (`dp`, `dp_cp`, `dp_shard_cp`) and, under expert parallel without TP, `dp_shard`
unflattened into (dp_shard_mod_ep, ep) from the same world mesh; under TP the `ep` view is the `tp`
one (`toolkit.layout.dims`). Nothing is attached to torch's objects.

The views a layout asks for by what they do are named by role, as torchtitan names them: `batch` (the
ranks that read different data: dp), `loss` (the ranks a gradient averages over: dp, x cp), `fsdp` (the
ranks FSDP2 shards a parameter over: dp_shard, x cp) and `efsdp` (the experts' shard ranks). `optional`
answers None for a dimension that is off (one rank), so a layout asks `mesh.optional_group("tp")` and
gets its TP group or none. A pipeline's groups are views too: `pp`, `batch`, and `pp_ends`, each
pipeline's first and last stage (a tied embedding's two halves)."""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from toolkit.layout.dims import MESH_DIMS, ParallelDims


class Mesh:
    """The world mesh and every view of it a layout asks for by name. Every rank builds it once, in the
    same order (each view creates its process groups)."""

    def __init__(self, dims: ParallelDims, device_type: str):
        self.dims = dims
        self.world = init_device_mesh(device_type, dims.shape, mesh_dim_names=MESH_DIMS)
        views = {name: self.world[name] for name in MESH_DIMS}
        # the data-parallel group: replicas and shards
        views["dp"] = self.world["dp_replicate", "dp_shard"]._flatten("dp")
        # cp ranks read the same data but hold different tokens: gradients average over them too
        if dims.cp > 1:
            views["dp_cp"] = self.world["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
            # torchtitan's: FSDP2 shards over cp too
            views["dp_shard_cp"] = self.world["dp_shard", "cp"]._flatten("dp_shard_cp")
        self.experts = None
        # the ep group is the TP group: whole experts, sharded as the dense parts are
        if dims.ep_over_tp:
            if dims.ep != dims.tp:
                raise ValueError(f"--ep {dims.ep} with --tp {dims.tp}: under TP --ep must equal --tp "
                                 "(toolkit.layout.rules.ep_tp_problems)")
            views["ep"] = views["tp"]
        # dp_shard = (dp_shard_mod_ep, ep), ep inner: dp_shard coordinate d = m * ep + e
        elif dims.ep > 1:
            # by index: torch 2.11's `_unflatten` refuses a dimension given by its name (its check is inverted)
            self.experts = self.world._unflatten(MESH_DIMS.index("dp_shard"), (dims.dp_shard // dims.ep, dims.ep),
                                                 ("dp_shard_mod_ep", "ep"))
            views["ep"], views["dp_shard_mod_ep"] = self.experts["ep"], self.experts["dp_shard_mod_ep"]
            if dims.cp > 1:
                views["dp_shard_mod_ep_cp"] = self.experts["dp_shard_mod_ep", "cp"]._flatten("dp_shard_mod_ep_cp")
        views["batch"] = views["dp"]
        views["loss"] = views[grad_dim(dims)]
        views["fsdp"] = views[grad_dim(dims, sharded=True)]
        efsdp = "dp_shard_mod_ep_cp" if dims.cp > 1 else "dp_shard_mod_ep"
        views["efsdp"] = views["fsdp"] if dims.ep_over_tp else views.get(efsdp)
        self.views = {k: v for k, v in views.items() if v is not None}
        self.pp_ends = self._pipeline_ends() if dims.pp > 1 else None

    def _pipeline_ends(self):
        """This rank's pipeline's {first stage, last stage} group; every rank creates every pipeline's, in
        order. pp is the outermost dimension: a pipeline is one column of the (pp, rest) world."""
        pipelines = self.world.mesh.reshape(self.dims.pp, -1).T.tolist()
        ends = [dist.new_group([ranks[0], ranks[-1]]) for ranks in pipelines]
        return ends[next(i for i, ranks in enumerate(pipelines) if dist.get_rank() in ranks)]

    def get(self, name: str) -> DeviceMesh:
        """The 1-D mesh of a dimension, flattened or not (`dp`, `dp_shard_cp`, `ep`, ...), or of a role
        (`batch`, `loss`, `fsdp`, `efsdp`)."""
        if name not in self.views:
            raise KeyError(f"no mesh dimension {name!r} in this layout (has {', '.join(self.views)})")
        return self.views[name]

    def optional(self, name: str) -> DeviceMesh | None:
        """`get`, or None where the dimension is off: absent, or one rank."""
        view = self.views.get(name)
        return view if view is not None and view.size() > 1 else None

    def group(self, name: str):
        """The process group of a view; `pp_ends`: this rank's pipeline's first and last stage."""
        if name == "pp_ends" and self.pp_ends is not None:
            return self.pp_ends
        return self.get(name).get_group()

    def optional_group(self, name: str):
        """`group`, or None where the dimension is off (`optional`)."""
        view = self.optional(name)
        return view.get_group() if view is not None else None

    def local_rank(self, name: str) -> int:
        return self.get(name).get_local_rank()

    def size(self, name: str) -> int:
        return self.get(name).size()

    def fsdp(self) -> DeviceMesh:
        """What FSDP2 shards the dense parts over: `dp_shard` (x `cp`), or (HSDP) `dp_replicate` x that,
        replicated across the outer dimension and sharded within."""
        inner = "dp_shard_cp" if self.dims.cp > 1 else "dp_shard"
        return self.world["dp_replicate", inner] if self.dims.dp_replicate > 1 else self.get(inner)

    def expert_fsdp(self) -> DeviceMesh | None:
        """What FSDP2 shards the experts over: the ranks that hold the same experts, dp_shard_mod_ep (x cp),
        replicated across dp_replicate (HSDP) as the dense parts are; under TP (the ep group is the TP
        group) the dense parts' own mesh, dp_shard (x cp) at this TP coordinate; None without --ep."""
        if self.dims.ep_over_tp:
            return self.fsdp()
        if self.experts is None:
            return None
        inner = "dp_shard_mod_ep_cp" if self.dims.cp > 1 else "dp_shard_mod_ep"
        # a flattened view is registered on the world mesh, not the unflattened one
        if self.dims.dp_replicate > 1:
            return (self.world if self.dims.cp > 1 else self.experts)["dp_replicate", inner]
        return self.get(inner)

    def expert_groups(self) -> tuple:
        """(the ep group, the expert FSDP mesh, the expert shard group: what the experts' gradient norm sums
        over, replicas apart), or (None, None, None) without --ep. Under TP: the TP group, and the dense
        parts' shard mesh and group (dp_shard, x cp)."""
        if not self.dims.ep_over_tp and self.experts is None:
            return None, None, None
        return self.group("ep"), self.expert_fsdp(), self.group("efsdp")


def grad_dim(dims: ParallelDims, sharded: bool = False) -> str:
    """The mesh dimension gradients are averaged (`sharded`: reduce-scattered) over."""
    if sharded:
        return "dp_shard_cp" if dims.cp > 1 else "dp_shard"
    return "dp_cp" if dims.cp > 1 else "dp"


def local_mesh(tp: int = 1, pp: int = 1) -> Mesh:
    """A mesh over the running world with the given model-parallel degrees, the rest data parallel
    (for tests and benchmarks that build layouts without the CLI)."""
    from toolkit.layout.dims import infer_dims
    from toolkit.errors import UserError

    dims, problems = infer_dims(dist.get_world_size(), tp=tp, pp=pp)
    if problems:
        raise UserError("; ".join(problems))
    return Mesh(dims, "cuda" if dist.get_backend() == "nccl" else "cpu")
