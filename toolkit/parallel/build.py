"""What a run is built on, decided once: the `Accelerator` (DDP, or DeepSpeed ZeRO's plugin; gloo on
CPU) and the strategy for the layout the flags and the launched world give
(`toolkit.layout.rules.runtime`), checked against the model's config before any weights are read, built
from its parts in one place (`compose`)."""

from __future__ import annotations

import os
from functools import partial
from typing import Callable

from toolkit.config.schema import Config
from toolkit.errors import UserError
from toolkit.layout.dims import ParallelDims
from toolkit.layout.rules import accelerate_plugin
from toolkit.objectives.sft.loss import token_loss_sum
from toolkit.objectives.build import build_objective
from toolkit.objectives.head import LossFn, LossHead
from toolkit.objectives.base import LayoutHooks, Objective
from toolkit.parallel.parallelize import DdpSpec, Parallelism, StageSpec
from toolkit.parallel.strategy import ContextSlices, DataShard, Settings, Strategy


def make_accelerator(cfg: Config, model_path: str | None = None):
    """DDP (gloo on CPU, NCCL on GPU) by default; DeepSpeed's plugin from the flags (FSDP2 is applied by
    the mesh strategies, `toolkit.parallel.fsdp`).
    `model_path` gives the hidden size that DeepSpeed's bucket sizes scale with."""
    import torch
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    # imports torch: not at package import (the planner reads dims)
    from toolkit.model.load import resolved_precision
    from toolkit.parallel.cpu_rehearsal import cpu_rehearsal
    from toolkit.parallel.elastic import join_restarted_group
    from toolkit.parallel import launch

    # a torchrun restart: a fresh store prefix, not the dead attempt's addresses
    join_restarted_group()
    kind = accelerate_plugin(cfg.parallel)
    # DeepSpeed and FSDP need a process group, also for one process that no launcher started: the same
    # variables on a GPU and a CPU (toolkit.parallel.launch).
    launch.ensure_rank_env(needs_group=kind is not None or cfg.parallel.fsdp)
    from accelerate.utils import DataLoaderConfiguration, GradientAccumulationPlugin

    # The loop fetches a step's micro-batches before running them, so the loader reaches its end
    # early; syncing "with the dataloader" would then step mid-accumulation. The loop sets the
    # count per step instead. DeepSpeed keeps its own count (and loss scaling): give it --grad-accum.
    ga = cfg.train.grad_accum if kind == "deepspeed" else 1
    # each rank reads its own micro-batches (a stream included: rank 0 would otherwise read and
    # tokenize every rank's and send them), copied to a GPU without waiting for its queued work (the
    # loop pins them); no generator broadcast at each epoch's start (`rng_types`: every rank seeds
    # the loader's generator alike and the sampler draws from (seed, epoch), so it would change no
    # value, only add a collective and a read-back at the epoch boundary)
    kwargs: dict = {"mixed_precision": resolved_precision(cfg), "rng_types": [],
                    "dataloader_config": DataLoaderConfiguration(dispatch_batches=False, non_blocking=launch.on_cuda()),
                    "gradient_accumulation_plugin": GradientAccumulationPlugin(num_steps=ga,
                                                                               sync_with_dataloader=False)}
    if kind == "deepspeed":
        from accelerate.utils import DeepSpeedPlugin

        # An accelerate config file's DeepSpeed fields were adopted (or refused as conflicting) by
        # config validation; accelerate would reject them next to an explicit JSON config.
        os.environ.pop("ACCELERATE_CONFIG_DS_FIELDS", None)
        os.environ.pop("ACCELERATE_DEEPSPEED_CONFIG_FILE", None)
        kwargs["deepspeed_plugin"] = DeepSpeedPlugin(hf_ds_config=run_deepspeed_config(cfg, model_path))
    # FSDP2 is the mesh layouts' own (`toolkit.parallel.fsdp`); an `accelerate launch` FSDP config was
    # adopted as --fsdp by config validation, and accelerate would otherwise build its plugin from it
    for key in ("ACCELERATE_USE_FSDP", "FSDP_VERSION"):
        os.environ.pop(key, None)
    with cpu_rehearsal(kind) as rehearsing:
        # Without cpu=True accelerate ignores torchrun's WORLD_SIZE on a machine with no accelerator
        # and every rank trains alone; with it, ranks join one gloo group (see cpu_rehearsal).
        accelerator = Accelerator(cpu=not launch.on_cuda() and not rehearsing, **kwargs)
    if accelerator.num_processes == 1 and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise RuntimeError("launched with WORLD_SIZE > 1 but accelerate started a single process")
    set_seed(cfg.train.seed)
    if accelerator.device.type == "cpu":
        torch.set_num_threads(cpu_threads_per_rank(int(os.environ.get("LOCAL_WORLD_SIZE", accelerator.num_processes))))
        map_large_allocations()
    return accelerator


# The toolkit's values for keys a --deepspeed file leaves out: no per-step prints (accelerate would
# write an infinite steps_per_print, which is not JSON), and its own torch AdamW allowed under ZeRO.
QUIET_DEFAULTS = {"steps_per_print": 2**31 - 1, "wall_clock_breakdown": False, "zero_allow_untested_optimizer": True,
                  "zero_force_ds_cpu_optimizer": False}


def run_deepspeed_config(cfg: Config, model_path: str | None = None) -> dict:
    """The DeepSpeed JSON this run hands to accelerate: the user's `--deepspeed` file with its "auto"s
    filled from the run's settings, else the toolkit's own for --zero-stage/--offload. A file's
    "scheduler" is left out here: the loop builds and steps it (`AccelerateStrategy.scheduler`), and
    `save_run_config` writes it back. On a CPU machine a file's Adam runs as torch's (`with_torch_adam`:
    DeepSpeed's own would be compiled first). `model_path` gives the hidden size the ZeRO buckets scale with."""
    from toolkit.model.load import resolved_precision
    from toolkit.parallel import launch
    from toolkit.layout.deepspeed import (compiles_cpu_adam, deepspeed_accelerator, deepspeed_config, fill_auto,
                                          read_user_config, with_torch_adam)

    hidden = None
    if model_path:
        from transformers import AutoConfig

        # an image-text model's: its language model's
        hidden = getattr(AutoConfig.from_pretrained(model_path, trust_remote_code=cfg.model.trust_remote_code)
                         .get_text_config(), "hidden_size", None)
    t = cfg.train
    if not cfg.parallel.deepspeed:
        ds = deepspeed_config(cfg.parallel.zero_stage, cfg.parallel.offload, resolved_precision(cfg), hidden,
                              overlap_comm=launch.on_cuda())
        ds["gradient_clipping"] = t.max_grad_norm
        return ds
    ds = read_user_config(cfg.parallel.deepspeed)
    # Keys the file leaves out are the run's, as "auto" would be: accelerate would otherwise put 1 for a
    # missing accumulation (the loop scales the loss by --grad-accum for DeepSpeed to divide by) and
    # DeepSpeed would not clip; no zero_optimization section is stage 0 (accelerate refuses none).
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size",
                "gradient_clipping"):
        ds.setdefault(key, "auto")
    ds.setdefault("zero_optimization", {"stage": 0})
    ds = fill_auto(ds, micro_batch=t.micro_batch_size, grad_accum=t.grad_accum, data_ranks=int(os.environ.get(
        "WORLD_SIZE", "1")), mixed_precision=resolved_precision(cfg), max_grad_norm=t.max_grad_norm, lr=cfg.lr,
        weight_decay=t.weight_decay, hidden_size=hidden)
    ds.pop("scheduler", None)
    # said by config (torch_adam_note)
    if compiles_cpu_adam(ds) and deepspeed_accelerator()[0] == "cpu":
        ds = with_torch_adam(ds)
    # what the file does not say
    for key, value in QUIET_DEFAULTS.items():
        ds.setdefault(key, value)
    return ds


# glibc's mallopt parameter (malloc.h): the size from which an allocation is a mapping of its own
M_MMAP_THRESHOLD = -3
# 1 MiB: a step's activations and logits are mapped; a decode step's KV-cache blocks (128 KiB-1 MiB, made
# anew each token) stay in the heap, where mapping them made each token's page faults cost 1.4x in time
# (benchmarks/grpo_cpu.md)
HOST_MMAP_THRESHOLD = 2 ** 20


def map_large_allocations(threshold: int = HOST_MMAP_THRESHOLD) -> bool:
    """Host allocations of `threshold` bytes or more (CPU tensors) made as mappings of their own, which `free`
    unmaps, so the resident memory follows the live tensors. glibc's own threshold rises to the size of each
    mapped block freed (up to 32 MiB), after which a step's activations come from the heap, which gives memory
    back only from its top: the resident memory keeps the holes a step's freed tensors left. Left alone where
    MALLOC_MMAP_THRESHOLD_ is set (the user's choice) or the C library is not glibc. Returns whether the
    threshold was set."""
    import ctypes
    import platform

    if "MALLOC_MMAP_THRESHOLD_" in os.environ or platform.libc_ver()[0] != "glibc":
        return False
    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, threshold))
    except (OSError, AttributeError):
        return False


def cpu_threads_per_rank(local_ranks: int) -> int:
    """Cores available to this process split evenly over the ranks of this node.

    Launchers default OMP_NUM_THREADS to 1 (accelerate without --cpu, torchrun with several ranks),
    which leaves cores idle for a single CPU process; `TOOLKIT_NUM_THREADS` overrides.
    """
    if os.environ.get("TOOLKIT_NUM_THREADS"):
        return max(1, int(os.environ["TOOLKIT_NUM_THREADS"]))
    return max(1, len(os.sched_getaffinity(0)) // max(1, local_ranks))


def make_strategy(cfg: Config, accelerator, model_path: str | None = None,
                  loss_fn: LossFn = token_loss_sum, objective: Objective | None = None, tokenizer=None) -> Strategy:
    """Decide the layout once from the flags and the launched world (`toolkit.layout.rules`), check it
    against the model's config (one line for every problem, before any weights are read), and build the
    strategy from its parts (`compose`). The config stops here: what the strategies and `parallelize` read
    of it is `Settings`. `objective`: the run's (`toolkit.objectives.build.build_objective`, built from the config
    where not given), whose loss the strategy's head runs under the layout's hooks; `tokenizer`: the run's, which
    the objective checks too (GRPO's tools need a chat template that renders them)."""
    from toolkit.layout import rules

    par, world = cfg.parallel, accelerator.num_processes
    problems = _model_problems(cfg, model_path, world) + rules.world_problems(par, world)
    dims, dim_problems = rules.dims_for(par, world, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    # the model checks above name the world size already
    problems += [p for p in dim_problems if not problems]
    if problems:
        raise UserError("; ".join(problems))
    kind = rules.runtime(par, dims)
    objective = objective or build_objective(cfg)
    problems = objective.layout_problems(kind, dims)
    problems += objective.tokenizer_problems(tokenizer) if tokenizer is not None else []
    if problems:
        raise UserError("; ".join(problems))
    return compose(kind, accelerator, dims, Settings.of(cfg), objective, loss_fn)


def compose(kind: str, accelerator, dims: ParallelDims, settings: Settings, objective: Objective | None = None,
            loss_fn: LossFn = token_loss_sum) -> Strategy:
    """The one construction every strategy shares: the mesh `kind` needs, context parallel's slices, what the
    layout decides for the objective (`LayoutHooks`), the objective built under them and the loss head given
    it, the data shard, and what `parallelize` applies (`Parallelism`); then `kind`'s class
    (`toolkit.layout.rules.runtime`'s kind -> `_strategies()`), which adds its step only."""
    from toolkit.parallel.mesh import Mesh

    mesh = Mesh(dims, accelerator.device.type) if kind not in ("accelerate", "deepspeed", "pipeline_one_process") \
        else None
    context = ContextSlices(mesh, dims)
    hooks = _hooks(kind, context, dims)
    loss = LossHead(loss_fn, accelerator.device.type, accelerator.mixed_precision,
                    objective.make_loss(hooks) if objective is not None else None)
    data = DataShard(accelerator, dims, mesh.local_rank("batch") if mesh is not None else None)
    parallelism = _parallelism(kind, accelerator, dims, settings, mesh, context)
    return _strategies()[kind](accelerator, dims, settings, data, loss, parallelism, hooks, context, mesh,
                               objective=objective)


def _hooks(kind: str, context: ContextSlices, dims: ParallelDims) -> LayoutHooks:
    """What the layout decides for an objective: a pipeline's rows run through its stages; under context
    parallel a sequence's slices are summed over the cp group."""
    if kind.startswith("pipeline"):
        from toolkit.parallel.pp.strategy import pipeline_logps

        return LayoutHooks(forward_logps=pipeline_logps)
    if context.group is not None:
        from toolkit.parallel.tp.comm import reduce_from_tp

        return LayoutHooks(sum_slices=partial(reduce_from_tp, group=context.group), cp=dims.cp)
    return LayoutHooks()


def _parallelism(kind: str, accelerator, dims: ParallelDims, settings: Settings, mesh, context) -> Parallelism:
    """What `parallelize` applies for `kind` on this mesh: every kind its kernels, adapters, checkpointing and
    compile; the mesh's kinds their TP and EP groups and FSDP2 (sharded) or DDP; a pipeline its stages."""
    from toolkit.parallel.fsdp import FsdpSpec, half_dtype

    common = {"model": settings.model, "checkpointing": settings.checkpointing, "compile": settings.compile}
    if kind in ("accelerate", "accelerate_cp", "deepspeed"):
        return Parallelism(**common, context=context if kind == "accelerate_cp" else None)
    if kind == "pipeline_one_process":
        from toolkit.parallel.pp import pipeline_devices

        # a missing GPU fails now, not later
        devices = tuple(pipeline_devices(settings.pp, settings.pp_devices))
        return Parallelism(**common, stages=StageSpec(settings.pp, settings.pp_microbatches, settings.pp_schedule,
                                                      settings.pp_balance, devices=devices))
    ep_group, experts_mesh, _ = mesh.expert_groups()
    groups = {"tp_group": mesh.optional_group("tp"), "ep_group": ep_group, "device": accelerator.device}
    fsdp = FsdpSpec(mesh.fsdp(), settings.reshard, half_dtype(accelerator.mixed_precision), experts_mesh)
    if kind == "pipeline":
        from toolkit.parallel.pp import make_pipeline_layout

        stages = StageSpec(dims.pp, settings.pp_microbatches, settings.pp_schedule, settings.pp_balance,
                           make_pipeline_layout(dims.pp, mesh))
        return Parallelism(**common, **groups, fsdp=fsdp if dims.dp_shard > 1 else None, stages=stages)
    if kind == "mesh_fsdp":
        return Parallelism(**common, **groups, context=context, fsdp=fsdp)
    cuda = accelerator.device.type == "cuda"
    ddp = DdpSpec(mesh.optional_group("loss"), [accelerator.local_process_index] if cuda else None,
                  accelerator.autocast if accelerator.mixed_precision == "bf16" else None)
    return Parallelism(**common, **groups, context=context, ddp=ddp)


def _strategies() -> dict[str, Callable]:
    """`toolkit.layout.rules.runtime`'s kind -> the class that runs its step."""
    from toolkit.parallel.accelerated import AccelerateStrategy, DeepSpeedStrategy
    from toolkit.parallel.pp.strategy import PipelineStrategy
    from toolkit.parallel.sharded import MeshStrategy

    return {"accelerate": AccelerateStrategy, "accelerate_cp": AccelerateStrategy, "deepspeed": DeepSpeedStrategy,
            "pipeline_one_process": PipelineStrategy, "pipeline": PipelineStrategy, "mesh_fsdp": MeshStrategy,
            "mesh_ddp": MeshStrategy}


def _model_problems(cfg: Config, model_path: str | None, world: int) -> list[str]:
    """What the model's architecture refuses for --tp / --pp / --cp / --ep (read from its config and its module
    tree on the meta device, no weights)."""
    par = cfg.parallel
    if not model_path or (par.tp == 1 and par.pp == 1 and par.cp == 1 and par.ep == 1):
        return []
    from transformers import AutoConfig

    from toolkit.layout.rules import model_problems

    from toolkit.model.load import config_values

    config = AutoConfig.from_pretrained(model_path, trust_remote_code=cfg.model.trust_remote_code)
    values = config_values(config)
    # what the model will be loaded with (`toolkit.model.kernels.router_kwargs`)
    if cfg.model.router_aux_loss_coef is not None:
        values.update(router_aux_loss_coef=cfg.model.router_aux_loss_coef,
                      output_router_logits=cfg.model.router_aux_loss_coef > 0)
    # a class attribute of the config, which to_dict() leaves out
    if par.tp > 1:
        from toolkit.parallel.tp.plan import text_config

        values["base_model_tp_plan"] = getattr(text_config(config), "base_model_tp_plan", None)
    problems = model_problems(values, par.tp, par.pp, par.cp, world, cfg.model.method, par.ep)
    from toolkit.model.vision import only_image_text

    # tensor parallel splits the language model's blocks (`get_decoder`), the vision tower and projector whole on
    # every rank as the embeddings are; pipeline, context and expert parallel not yet
    cut = [f"--{d} {n}" for d, n in (("pp", par.pp), ("cp", par.cp), ("ep", par.ep)) if n > 1]
    # a run that reads images (the resolved --images), or a model that trains only as an image-text one
    images = getattr(getattr(cfg, "data", None), "images", "off") == "on"
    if cut and (images or only_image_text(config)):
        problems.insert(0, f"{', '.join(cut)}: not yet for image-text models ({type(config).__name__}); their layouts "
                           "are data-parallel (DDP, --zero-stage 1/2/3, --fsdp) and --tp")
    if par.pp > 1 and not problems:
        from toolkit.parallel.pp import pipeline_problems

        problems += pipeline_problems(config, cfg.model.trust_remote_code)
    # the plan's regions against the blocks, on a meta-device copy
    if par.tp > 1 and not problems:
        from toolkit.parallel.tp.plan import tp_tree_problems

        problems += tp_tree_problems(config, cfg.model.trust_remote_code)
    return problems
