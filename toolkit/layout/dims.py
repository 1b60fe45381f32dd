"""The degree of every parallel dimension, decided once from the flags and the launcher.

    world = pp x dp_replicate x dp_shard x cp x tp

The mesh is laid out in that order, outermost first (torchtitan's and Megatron's order): TP
innermost, so its per-layer collectives run between consecutive ranks, which share a node; PP
outermost, since stages exchange only activations at their boundaries. `cp` (context parallel:
ranks that hold different tokens of the same sequences) sits inside data parallel and outside TP,
as in torchtitan. One degree is inferred from the rest: the data-parallel one.

`ep` (expert parallel) adds no ranks. Without TP it borrows from `dp_shard`, whose ranks read
different tokens: dp_shard = dp_shard_mod_ep x ep, ep innermost, so an ep group is ep consecutive
dp_shard coordinates, and every MoE layer's experts are split over an ep group and FSDP-sharded over
the ranks that hold the same experts (dp_shard_mod_ep, x cp). Under TP (tp > 1) the ep group IS the
TP group (torchtitan's etp=1 with ep = tp; `--ep` must equal `--tp`: `toolkit.layout.rules`): the TP
plan leaves the routed experts whole, E/ep of them a rank, each TP rank dispatches its 1/tp of the
tokens, and the experts FSDP-shard over the dense parts' dp_shard (x cp) ranks at the same TP
coordinate (benchmarks/etp.md). The dense parts shard over dp_shard (x cp) as always
(`toolkit.parallel.ep`).

Pure Python: the planner and config checks import this without torch.distributed.
"""

from __future__ import annotations

from dataclasses import dataclass

# outermost first
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class ParallelDims:
    world_size: int = 1
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    # borrowed from dp_shard, or the TP group under tp > 1: not a dimension of its own (module docstring)
    ep: int = 1

    @property
    def dp(self) -> int:
        """Data-parallel ranks: each reads its own shard of every global batch."""
        return self.dp_replicate * self.dp_shard

    @property
    def replicas(self) -> int:
        """Ranks that read the same shard of the data (the model-parallel group)."""
        return self.pp * self.cp * self.tp

    @property
    def ep_over_tp(self) -> bool:
        """Expert parallel over the TP group (tp > 1 and ep > 1): whole experts, no ranks borrowed from
        dp_shard (module docstring)."""
        return self.tp > 1 and self.ep > 1

    @property
    def ep_in_dp_shard(self) -> int:
        """The part of ep borrowed from dp_shard: ep without TP, 1 under TP (the ep group is the TP group)."""
        return 1 if self.ep_over_tp else self.ep

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, d) for d in MESH_DIMS)

    def problems(self) -> list[str]:
        """Every way these degrees fail to cover the world, as one list."""
        p = [f"--{d.replace('_', '-')} must be >= 1 (got {getattr(self, d)})"
             for d in MESH_DIMS if getattr(self, d) < 1]
        if self.ep < 1:
            p.append(f"--ep must be >= 1 (got {self.ep})")
        # the TP group: --ep against --tp is `toolkit.layout.rules`' refusal
        elif self.ep_over_tp:
            pass
        elif self.dp_shard < self.ep:
            p.append(self._too_few_for_ep())
        elif self.dp_shard % self.ep:
            fits = [e for e in range(2, self.dp_shard + 1) if self.dp_shard % e == 0]
            p.append(f"--ep {self.ep} must divide dp_shard {self.dp_shard} (the ranks left by pp x dp_replicate x cp "
                     f"x tp): expert parallel splits the experts over ranks that shard the data; "
                     f"use --ep {' or '.join(map(str, fits))}")
        if not p and self.pp * self.dp * self.cp * self.tp != self.world_size:
            p.append(f"{self.describe()} is {self.pp * self.dp * self.cp * self.tp} ranks, but {self.world_size} "
                     f"were launched; launch {self.pp * self.dp * self.cp * self.tp} processes or change the degrees")
        return p

    def _too_few_for_ep(self) -> str:
        """Fewer data-parallel ranks than --ep (one process, most often): say how many processes the
        launch needs, since no choice of the other flags gives ep ranks to split the experts over."""
        others = {d: getattr(self, d) for d in MESH_DIMS if d != "dp_shard" and getattr(self, d) > 1}
        after = " x ".join(f"{d} {v}" for d, v in others.items())
        has = f"{self.world_size} process{'es' if self.world_size != 1 else ''}"
        if others:
            has += f", which leave {self.dp_shard} after {after}"
        need = self.ep * self.pp * self.dp_replicate * self.cp * self.tp
        return (f"--ep {self.ep} needs at least {self.ep} data-parallel ranks to split the experts over (ep borrows "
                f"them from dp_shard); this launch has {has}: launch with torchrun --nproc_per_node {need}"
                + (" or lower --dp-replicate" if self.dp_replicate > 1 else ""))

    def describe(self) -> str:
        """'pp 2 x dp_replicate 2' (the dimensions above 1)."""
        parts = [f"{d} {getattr(self, d)}" for d in MESH_DIMS if getattr(self, d) > 1]
        parts += [f"ep {self.ep} ({'the tp group' if self.ep_over_tp else 'in dp_shard'})"] * (self.ep > 1)
        return " x ".join(parts) or "one rank"


def infer_dims(world_size: int, tp: int = 1, pp: int = 1, sharded: bool = False, dp_shard: int = 0,
               dp_replicate: int = 0, cp: int = 1, ep: int = 1) -> tuple[ParallelDims, list[str]]:
    """The layout for `world_size` ranks: the model-parallel degrees (and cp) as given, the
    data-parallel ones as given (0 = inferred: what the others leave, sharded with ZeRO/FSDP when
    `sharded`, else replicated). Returns the dims and every problem found."""
    model_parallel = tp * pp * cp
    if model_parallel < 1 or world_size % model_parallel:
        flags = " x ".join(f"--{n} {v}" for n, v in (("pp", pp), ("cp", cp), ("tp", tp)) if v != 1)
        return ParallelDims(world_size, pp=pp, cp=cp, tp=tp), [
            f"{flags} needs a world size that is a multiple of {model_parallel} (got {world_size}); launch "
            f"torchrun --nproc_per_node {model_parallel} (times the data-parallel degree you want)"]
    rest = world_size // model_parallel
    given = " x ".join(f"--{n} {v}" for n, v in (("dp-replicate", dp_replicate), ("dp-shard", dp_shard)) if v)
    if not dp_shard and not dp_replicate:
        dp_shard, dp_replicate = (rest, 1) if sharded else (1, rest)
    elif not dp_shard:
        dp_shard = rest // dp_replicate if rest % dp_replicate == 0 else 0
    elif not dp_replicate:
        dp_replicate = rest // dp_shard if rest % dp_shard == 0 else 0
    if dp_shard < 1 or dp_replicate < 1 or dp_shard * dp_replicate != rest:
        return ParallelDims(world_size, pp=pp, cp=cp, tp=tp), [
            f"{given} does not fit: {world_size} process{'es' if world_size != 1 else ''} / (pp {pp}"
            f"{f' x cp {cp}' if cp > 1 else ''} x tp {tp}) leave {rest} data-parallel rank{'s' if rest != 1 else ''}; "
            f"launch {model_parallel * (dp_shard or 1) * (dp_replicate or 1)} processes or change the degrees"]
    dims = ParallelDims(world_size, pp=pp, tp=tp, cp=cp, dp_shard=dp_shard, dp_replicate=dp_replicate, ep=ep)
    return dims, dims.problems()


def layout_name(d: ParallelDims) -> str:
    """'tp2_dp4', 'pp2_tp2_dp_shard2', 'dp2_dp_shard4' (HSDP): model-parallel degrees, then data."""
    parts = [f"{k}{getattr(d, k)}" for k in ("pp", "cp", "tp", "ep") if getattr(d, k) > 1]
    parts += [f"dp{d.dp_replicate}"] * (d.dp_replicate > 1) + [f"dp_shard{d.dp_shard}"] * (d.dp_shard > 1)
    return "_".join(parts) or "one_rank"
