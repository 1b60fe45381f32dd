"""The one place where a loaded model is shaped for a run, in torchtitan's order (`parallelize_llama`,
`torchtitan/models/llama3/infra/parallelize.py`); `toolkit.model.load.load_model` only reads the weights.

`parallelize(model, Parallelism)`, once per run, right after loading (`Strategy.shard_model`):

    1. kernels and adapters  --attn, --experts, --kernels liger; LoRA or QLoRA (`toolkit.model.load`)
    2. context parallel      Ulysses attention (`toolkit.parallel.cp`)
    3. TP                    the project's layers from `base_model_tp_plan` (`toolkit.parallel.tp`)
    4. EP                    each MoE layer's experts over the ep group (`toolkit.parallel.ep`)
    5. checkpointing         every block, non-reentrant (`apply_checkpointing`)
    6. compile               every block in place (`apply_compile`)
    7. data parallel         FSDP2 (`toolkit.parallel.fsdp.apply_fsdp`), or DDP over the mesh (`apply_ddp`)

Two steps run at the strategy's `prepare`, from this module too:

- the pipeline's stage cut, with FSDP2 per stage (`apply_stages`): the blocks' balance may time a
  micro-batch of the loader's shape, and the stages are cut from the whole TP/EP-cut model, so the split
  and the parameter names stay the full model's;
- accelerate's engines (`apply_engine`: DDP and one process through accelerate, DeepSpeed's ZeRO engine):
  they wrap the model themselves, built from the model and its optimizer together.

`--compile auto` compiles later, from the loop, through `apply_compile`: `nn.Module.compile` compiles the
block's call, which runs the hooks FSDP2 put on it whenever they were put, so a block compiled after FSDP2
runs as one compiled before it. Nothing else in the package calls `fully_shard`, DDP, accelerate's
`prepare` on a model, `compile` on a block or the checkpoint wrapper (tests/test_architecture.py).

What the rest of the run needs of the cut is one object, `Parallelized`: the table of every cut parameter
by name (`toolkit.parallel.cut`: each slice's dim or parts, this rank's place and group, the replicated
parameters whose gradients are partial sums), the TP group, the expert shards, and from them the gradient
norm's parts and the full state dict. The TP plan and expert parallel write the table by name as they cut,
so FSDP2 replacing the parameters after changes nothing in it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from toolkit.model.load import ModelShape
from toolkit.parallel.cut import Cut, full_state_dict
from toolkit.parallel.fsdp import FsdpSpec, apply_fsdp
from toolkit.parallel.tp import apply_tensor_parallel


@dataclass
class Parallelized:
    """How `parallelize` cut the model: the one table of how each parameter was cut, by name
    (`toolkit.parallel.cut.Cut`: its TP slice, its expert slice, or a TP-partial gradient; a parameter not in
    it is whole), the TP group the TP layers exchange over, what expert parallel left (`ExpertShards`, or
    None) and the TP plan's line. What checkpoints, the gradient norm, the full state dict and the
    trainable-parameter listing read."""
    cuts: dict[str, Cut] = field(default_factory=dict)
    tp_group: Any = None
    experts: Any = None
    # what TP split, per block, and what it kept whole
    plan: str = ""

    def describe(self) -> str:
        """The TP plan's line of the layout's description (none without TP)."""
        return self.plan + "\n" if self.plan else ""

    def norm_parts(self, named: dict[str, nn.Parameter], shard: tuple = (), outer: tuple = (),
                   expert_groups: tuple = ()) -> list[tuple[list, tuple]]:
        """`toolkit.parallel.grad_norm.clip_grad_norm`'s parts: each parameter's squares summed over the
        groups that hold the rest of it. TP slices over the TP group and `shard` (FSDP2's shard group),
        the experts over `expert_groups` (their shards, the ep group: under TP the TP group itself), the
        rest over `shard`; all of them over `outer` (a pipeline's stages). A parameter is cut by TP or by
        EP, never both (`Cut`)."""
        tp = (self.tp_group,) if self.tp_group is not None else ()
        whole = Cut()
        cut = {n: self.cuts.get(n, whole) for n in named}

        def members(kind: str) -> list[nn.Parameter]:
            return [p for n, p in named.items()
                    if kind == ("ep" if cut[n].ep is not None else "tp" if cut[n].tp is not None else "whole")]

        parts = [(members("tp"), (*outer, *tp, *shard))]
        # the expert part, empty or not: every rank reduces the same parts
        if self.experts:
            parts.append((members("ep"), (*outer, *expert_groups)))
        return [*parts, (members("whole"), (*outer, *shard))]

    def reduce_partial_grads(self, model: nn.Module) -> None:
        """What the TP plan's gradient hooks do, on FSDP2's reduced shards (FSDP2 replaced the parameters, and
        with them the hooks): the sum over the TP group commutes with the mean over data-parallel ranks, and
        TP peers hold the same shard of these."""
        partial = [n for n, cut in self.cuts.items() if cut.partial]
        if not partial or self.tp_group is None:
            return
        import torch.distributed as dist

        from toolkit.parallel import grad_norm

        params = dict(model.named_parameters())
        for name in partial:
            if name in params and params[name].grad is not None:
                dist.all_reduce(grad_norm.local(params[name].grad), group=self.tp_group)

    def state_dict(self, model: nn.Module) -> dict:
        """The full tensors a one-process run would save (collective): FSDP2, TP and EP slices gathered."""
        return full_state_dict(model, self.cuts)


@dataclass(frozen=True)
class DdpSpec:
    """DDP over the mesh (TP layers, with or without context parallel): the group gradients average over
    (`loss`: dp, x cp; none for TP alone), the GPU it runs on, and autocast around the forward (bf16 on fp32
    weights: what accelerate's own `prepare` adds)."""
    group: Any = None
    device_ids: list[int] | None = None
    autocast: Callable | None = None


@dataclass(frozen=True)
class StageSpec:
    """The pipeline's part of a layout: its stages (one per rank of `layout`'s pp group, or every stage in
    this process on `devices` where `layout` is None), micro-batches, schedule and balance."""
    stages: int
    microbatches: int = 1
    schedule: str = "gpipe"
    # blocks split by parameter count, or by measured time
    balance: str = "params"
    # `toolkit.parallel.pp.PipelineLayout`
    layout: Any = None
    devices: tuple = ()


@dataclass(frozen=True)
class Parallelism:
    """What `parallelize` applies, decided once by `toolkit.parallel.build.make_strategy` from the settings
    and the mesh."""
    model: ModelShape = ModelShape()
    # `toolkit.parallel.strategy.ContextSlices`: Ulysses attention where cp > 1
    context: Any = None
    tp_group: Any = None
    ep_group: Any = None
    # --gradient-checkpointing
    checkpointing: bool = False
    # --compile (auto compiles later, from the loop, once steps are timed)
    compile: bool = False
    fsdp: FsdpSpec | None = None
    ddp: DdpSpec | None = None
    # where the model goes before FSDP2 or DDP
    device: Any = None
    # a pipeline: FSDP2 waits for the stages (`apply_stages`)
    stages: StageSpec | None = None


def parallelize(model: nn.Module, p: Parallelism) -> tuple[nn.Module, Parallelized]:
    """The model ready for its layout, in the module docstring's order. With both TP and EP the ep group is
    the TP group (`toolkit.layout.dims`): TP leaves the routed experts whole, and EP splits them over it,
    each TP rank dispatching its 1/tp of the tokens. Every rank calls it with the same full weights (and
    the same seed for LoRA's init), so TP=1 and TP=t start alike. Returns the model and how it was cut."""
    from toolkit.model.load import apply_kernels, apply_lora

    apply_kernels(model, p.model)
    if p.model.method in ("lora", "qlora"):
        model = apply_lora(model, p.model)
    if p.context is not None:
        model = p.context.attach(model)
    # how each parameter is cut, by name (`toolkit.parallel.cut`): TP's, then EP's
    cuts: dict[str, Cut] = {}
    if p.tp_group is not None:
        model = apply_tensor_parallel(model, p.tp_group, cuts, skip_experts=p.ep_group is not None)
    # what TP split: read before a DDP wrapper hides it
    plan = getattr(model, "toolkit_tp", "")
    experts = None
    if p.ep_group is not None:
        from toolkit.parallel.ep import apply_expert_parallel

        experts = apply_expert_parallel(model, p.ep_group, cuts, tp_group=p.tp_group)
    if p.checkpointing:
        apply_checkpointing(model)
    if p.compile:
        apply_compile(model)
    if p.fsdp is not None and p.stages is None:
        from toolkit.parallel.tp.plan import decoder_blocks

        model = model.to(p.device)
        shard(model, decoder_blocks(model), p.fsdp, experts.holders if experts else ())
    elif p.ddp is not None:
        model = apply_ddp(model.to(p.device), p.ddp)
    return model, Parallelized(cuts, p.tp_group, experts, plan)


def shard(root: nn.Module, blocks: list[nn.Module], spec: FsdpSpec, experts=()) -> None:
    """FSDP2 as `spec` says (`toolkit.parallel.fsdp.apply_fsdp`): `experts` first, each block, then `root`."""
    apply_fsdp(root, blocks, spec.mesh, spec.reshard, spec.compute_dtype, experts, spec.experts_mesh)


def apply_checkpointing(model: nn.Module) -> None:
    """Non-reentrant activation checkpointing of every block, by the name transformers >= 5.2x gives it
    (`gradient_checkpointing_enable` warns that it goes in v6), or the old one where it is all there is;
    transformers also makes the embeddings' output require grad (LoRA's frozen ones)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def apply_compile(model: nn.Module) -> None:
    """--compile: each decoder block compiled in place (`nn.Module.compile`: regional compilation, as
    torchtitan compiles per block), so one compiled graph serves every block, the parameters and
    state-dict keys stay the module's own, and the layout's changes to the blocks (TP's split projections
    and context parallel's attention before, FSDP2's hooks after) are traced at the first step. Padded and
    packed batches change width from step to step: the second width compiles again, with dynamic shapes
    (dynamo's automatic dynamic), and later widths reuse it. The backend: `COMPILE_BACKEND_ENV`, inductor."""
    from toolkit.errors import UserError
    from toolkit.model.kernels import COMPILE_BACKEND_ENV, decoder_layers

    blocks = decoder_layers(model)
    if not blocks:
        raise UserError(f"--compile: no decoder blocks at model.layers in {type(model).__name__}; leave --compile out")
    backend = os.environ.get(COMPILE_BACKEND_ENV, "inductor")
    for block in blocks:
        block.compile(backend=backend)


def apply_ddp(model: nn.Module, spec: DdpSpec) -> nn.Module:
    """What accelerate's `prepare` does for a model it does not prepare (the TP layers, whose DDP must
    average over the dp group only, not over TP peers): autocast around the forward where asked, DDP over
    `spec.group` where it has more than one rank."""
    if spec.autocast is not None:
        forward = model.forward

        def autocast(*args, **kwargs):
            with spec.autocast():
                return forward(*args, **kwargs)

        model.forward = autocast
    if spec.group is None:
        return model
    return torch.nn.parallel.DistributedDataParallel(model, process_group=spec.group, device_ids=spec.device_ids)


def apply_engine(accelerator, model: nn.Module, optimizer, *loader):
    """accelerate's `prepare` of the model and its optimizer (and the loader, where given): DDP over every
    rank or one process (autocast as the precision asks), or DeepSpeed's ZeRO engine, built from both. The
    one exception to `parallelize`: these engines wrap the model themselves, at the strategy's `prepare`."""
    return accelerator.prepare(model, optimizer, *loader)


def apply_stages(model: nn.Module, p: Parallelism, sample: tuple[int, int], pad_id: int, loss_fn, accelerator,
                 experts: list[nn.Module] = ()):
    """The pipeline's stage cut, on the TP/EP-cut whole model `parallelize` returned: its blocks balanced
    into `p.stages` (by parameters, or by a micro-batch of `sample`'s shape timed once on rank 0, so every
    rank cuts alike) and this rank's stage, FSDP2-sharded where `p.fsdp` (its blocks, then the stage; its
    `experts` (expert parallel's holders) first, over theirs); in one process, every stage on its device
    (the naive pipeline)."""
    import torch.distributed as dist

    from toolkit.parallel.fsdp import half_dtype
    from toolkit.parallel.pp import NaivePipeline, StagePipeline, balance, decoder_parts, param_costs, time_costs

    # autocast's dtype, or the FSDP2 policy's
    s, compute = p.stages, half_dtype(accelerator.mixed_precision)
    micro = (sample[0] // s.microbatches, sample[1])
    if s.layout is None:
        return NaivePipeline(model, list(s.devices), s.microbatches, s.balance, micro, compute, loss_fn)
    parts = decoder_parts(model)
    # measured once, on rank 0, so every rank cuts the model the same way
    if s.balance == "time":
        costs = [time_costs(parts, *micro, accelerator.device) if accelerator.is_main_process else None]
        dist.broadcast_object_list(costs, src=0)
        blocks, first, last = costs[0]
    else:
        blocks, first, last = param_costs(parts)
    pipe = StagePipeline(model, s.layout, balance(blocks, s.stages, first, last), s.microbatches, s.schedule,
                         accelerator.device, pad_id, compute, loss_fn, sharded=p.fsdp is not None)
    if p.fsdp is not None:
        mine = {id(m) for m in pipe.stage.modules()}
        shard(pipe.stage, list(pipe.stage.layers), p.fsdp, [h for h in experts if id(h) in mine])
    return pipe
