"""Which layouts may run: the one place that says which parallel dimensions compose, what must divide
what, what each method and precision allows, which runtime builds a layout, and the words of each
refusal. Config validation, the planner, the strategy builders, resuming and the command line all
ask here.

Pure Python: no torch, no torch.distributed, no model loading (a model is its config as a dict).
The flags are `toolkit.layout.flags.ParallelConfig`, the config's parallel section, which the planner
builds too.
"""

from __future__ import annotations

from typing import Any

from toolkit.layout.dims import ParallelDims, infer_dims
from toolkit.layout.flags import ParallelConfig
from toolkit.layout.tp_regions import NotExpressible, read_tp_plan

# Losses that fuse the LM head into the loss (`toolkit.objectives.sft.loss`); the pipeline's last stage computes full
# logits
FUSED_LOSSES = ("chunked", "liger", "cce")


# ----------------------------------------------------------------------------- what the flags ask for

def mesh_sharded(par: ParallelConfig) -> bool:
    """Sharded data parallel: FSDP2 on the toolkit's device mesh (`toolkit.parallel.fsdp.apply_fsdp`,
    TP inside, HSDP), asked for with --fsdp, --dp-shard or --dp-replicate. --fsdp is --dp-shard over
    the data-parallel ranks the other degrees leave (`dims_for`); --ep borrows its ranks from them."""
    return par.dp_shard > 0 or par.dp_replicate > 0 or par.fsdp or par.ep > 1


def off_mesh_layout(par: ParallelConfig) -> str | None:
    """The flag that asks for a layout outside the device mesh (the planner's, DeepSpeed), which
    --tp, --pp and --cp do not compose with; None if there is none."""
    if par.strategy == "auto":
        return "--strategy auto"
    return f"--zero-stage {par.zero_stage}" if par.zero_stage is not None else None


def accelerate_plugin(par: ParallelConfig) -> str | None:
    """The accelerate plugin to build: 'deepspeed', or None (DDP, and FSDP2, which the mesh layouts
    apply themselves with one mixed-precision policy)."""
    return "deepspeed" if par.zero_stage is not None and not mesh_sharded(par) else None


def strategy_name(par: ParallelConfig) -> str | None:
    """The planner's name for a 1-D layout (ddp, zero{0-3}[_offload|_offload_param], fsdp_full,
    fsdp_grad_op); None for a tp/pp/cp/dp-shard mesh."""
    if max(par.tp, par.pp, par.cp, par.ep, par.dp_shard or 1) > 1:
        return None
    if par.fsdp:
        return "fsdp_grad_op" if par.fsdp_sharding == "grad_op" else "fsdp_full"
    if par.zero_stage:
        return (f"zero{par.zero_stage}"
                + {"none": "", "optimizer": "_offload", "optimizer+param": "_offload_param"}[par.offload])
    return "ddp"


def layout_words(par: ParallelConfig) -> str:
    """The layout as a line names it: the 1-D strategy's name, else the mesh's sizes."""
    return strategy_name(par) or f"tp {par.tp} x pp {par.pp} x cp {par.cp} x dp-shard {par.dp_shard or 1}"


def flags_of(name: str) -> ParallelConfig:
    """`strategy_name`'s inverse: the flags of a planner's 1-D strategy."""
    if name.startswith("zero"):
        return ParallelConfig(zero_stage=int(name[4]), offload="optimizer+param" if name.endswith("offload_param")
                              else "optimizer" if "offload" in name else "none")
    if name.startswith("fsdp"):
        return ParallelConfig(fsdp=True, fsdp_sharding=name.split("_", 1)[1])
    return ParallelConfig()


def mesh_flags(d: ParallelDims, micro_batch: int) -> ParallelConfig:
    """The flags that lay the mesh out as `d` (the data-parallel degrees given where they shard)."""
    schedule, m = pipeline_schedule(d, micro_batch)
    return ParallelConfig(tp=d.tp, pp=d.pp, cp=d.cp, ep=d.ep, dp_shard=d.dp_shard if d.dp_shard > 1 else 0,
                          dp_replicate=d.dp_replicate if d.dp_shard > 1 and d.dp_replicate > 1 else 0,
                          pp_microbatches=m if d.pp > 1 else 1, pp_schedule=schedule if d.pp > 1 else "gpipe")


def pipeline_schedule(d: ParallelDims, micro_batch: int) -> tuple[str, int]:
    """(schedule, pipeline micro-batches): one example each; 1F1B where there are >= pp of them."""
    return ("1f1b" if micro_batch >= d.pp else "gpipe"), micro_batch


def runtime(par: ParallelConfig, dims: ParallelDims) -> str:
    """Which strategy builds the layout (`toolkit.parallel.build.make_strategy`), named after its class
    and variant: 'accelerate' (DDP, or one process), 'accelerate_cp' (cp x DDP through accelerate),
    'deepspeed', 'pipeline_one_process' (--pp in one process), 'pipeline', 'mesh_fsdp' (FSDP2 on the
    mesh, TP inside when tp > 1) or 'mesh_ddp' (TP layers, DDP over dp)."""
    on_mesh = dims.world_size > 1 and (dims.pp > 1 or dims.tp > 1 or dims.cp > 1
                                       or (mesh_sharded(par) and dims.dp_shard > 1))
    if not on_mesh:
        if par.pp > 1:
            return "pipeline_one_process"
        if accelerate_plugin(par) == "deepspeed":
            return "deepspeed"
        # --fsdp on one rank shards nothing, but gathers in the compute dtype without autocast's copies
        return "mesh_fsdp" if par.fsdp and dims.world_size == 1 else "accelerate"
    if dims.pp > 1:
        return "pipeline"
    if dims.dp_shard > 1 and mesh_sharded(par):
        return "mesh_fsdp"
    return "mesh_ddp" if dims.tp > 1 else "accelerate_cp"


def checkpoint_format(par: ParallelConfig) -> str:
    """'hf' for DeepSpeed ZeRO, which keeps its own per-rank partitioning (resumed on the same layout
    only), else 'sharded' (torch.distributed.checkpoint, readable by any other layout)."""
    return "hf" if accelerate_plugin(par) == "deepspeed" else "sharded"


# ----------------------------------------------------------------------------- what may run

def layout_problems(par: ParallelConfig, method: str, precision: str, loss: str, micro_batch: int,
                    compiled: bool = False, attn: str = "auto", sampling: str | None = None) -> list[str]:
    """Every reason the flags' layout cannot run with this method ("full", "lora", "qlora"), mixed
    precision ("fp16" is the one that matters), --loss, micro-batch, --compile and `sampling` (the --objective
    that samples from the policy while it trains, None where it does not), that
    needs neither the model nor the world size (`model_problems`, `dims.infer_dims` check those)."""
    p: list[str] = []

    def need(cond: bool, msg: str) -> None:
        if not cond:
            p.append(msg)

    need(not (par.strategy == "auto" and (par.fsdp or par.zero_stage is not None or par.offload != "none")),
         "--strategy auto picks the sharding itself; drop --zero-stage/--fsdp/--offload or use --strategy manual")
    need(not (par.fsdp and par.zero_stage is not None),
         f"--fsdp and --zero-stage {par.zero_stage} both shard the model; choose one")
    need(not (par.offload != "none" and par.zero_stage in (None, 0)),
         f"--offload {par.offload} needs --zero-stage 1, 2 or 3")
    need(not (par.offload == "optimizer+param" and par.zero_stage in (1, 2)),
         f"--offload optimizer+param needs --zero-stage 3 (got {par.zero_stage}); use --offload optimizer")
    need(not (method == "qlora" and par.offload == "optimizer+param"),
         "--method qlora cannot offload its 4-bit base weights (--offload optimizer+param); use --offload optimizer")
    need(not (method == "qlora" and (par.zero_stage == 3 or par.fsdp)),
         "--method qlora with ZeRO-3/FSDP sharding is not supported; use --zero-stage 2 or DDP")
    need(par.tp >= 1, f"--tp must be >= 1 (got {par.tp})")
    p += _mesh_problems(par, method, precision)
    if par.tp > 1:
        other = off_mesh_layout(par)
        need(other is None, f"--tp {par.tp} with {other} is not supported; tensor parallelism composes "
                            "with DDP, or with FSDP2 on the device mesh: use --dp-shard N (drop one of them)")
        p += _method_problems(f"--tp {par.tp}", "tp", method, precision)
    p += _pipeline_problems(par, method, precision, loss, micro_batch)
    p += _cp_problems(par, method, precision)
    p += _ep_problems(par, method, precision)
    if compiled and par.zero_stage == 3:
        p.append("--compile with --zero-stage 3 is not supported (ZeRO-3's parameter hooks break the compiled "
                 "blocks' graphs); use --fsdp or --dp-shard N, which compile, or drop --compile")
    if compiled and par.ep > 1:
        p.append(f"--compile with --ep {par.ep} is not supported yet (the experts' token exchange reads its counts on "
                 "the host inside the block); drop one of them")
    if compiled and par.pp > 1:
        p.append(f"--compile with --pp {par.pp} is not supported yet; drop one of them")
    if par.cp > 1 and attn not in ("auto", "sdpa"):
        p.append(f"--attn {attn} with --cp {par.cp} is not supported: context parallel's Ulysses attention wraps "
                 "sdpa (and --attn auto takes sdpa under --cp); drop --attn")
    return p + generation_problems(par, sampling)


def generation_problems(par: ParallelConfig, objective: str | None) -> list[str]:
    """An `objective` that samples from the policy while it trains (`toolkit.config.objectives.generates`) needs
    the whole model's forward, token by token, on every rank (`Strategy.generating`): refused under pipeline
    stages and context-parallel slices, which hold neither."""
    if objective is None:
        return []
    off = [f"--{name} {degree}" for name, degree in (("pp", par.pp), ("cp", par.cp)) if degree > 1]
    said = [f"--objective {objective} does not run under --pp / --cp yet: it samples completions token by token "
            f"from the whole model, which pipeline stages and context-parallel slices do not hold; drop "
            f"{' and '.join(off)}"] if off else []
    # each rank's decode steps would exchange tokens with the others' experts: not parity-tested
    if par.ep > 1:
        said.append(f"--objective {objective} does not run under --ep {par.ep} yet: sampling with the experts split "
                    "over ranks is not tested against one process; drop --ep (each rank then holds every expert)")
    return said


# What the mesh dimensions allow of a method and a precision: QLoRA's 4-bit base and fp16's loss scaling
# stay off every one of them; why, where there is more to say than "not supported"
# dimension -> (why not QLoRA, why not fp16)
MESH_REFUSALS = {
    "tp": (" (4-bit weights cannot be sliced)", " (no loss scaling across TP shards)"),
    "shard": (" (4-bit weights are not sharded)", " (no loss scaling across shards)"),
    "cp": ("", ""),
    "pp": ("", " (no loss scaling across stages)"),
}


def _method_problems(flag: str, dimension: str, method: str, precision: str) -> list[str]:
    qlora, fp16 = MESH_REFUSALS[dimension]
    return ([f"{flag} with --method qlora is not supported{qlora}; use --method lora"] if method == "qlora" else []) \
        + ([f"{flag} with --mixed-precision fp16 is not supported{fp16}; use bf16"] if precision == "fp16" else [])


def _mesh_problems(par: ParallelConfig, method: str, precision: str) -> list[str]:
    """--dp-shard / --dp-replicate checks that need no world size (ParallelDims checks the product)."""
    p = [f"--{name.replace('_', '-')} must be >= 1, or 0 to infer it (got {getattr(par, name)})"
         for name in ("dp_shard", "dp_replicate") if getattr(par, name) < 0]
    if not mesh_sharded(par):
        return p
    flags = " ".join(f"--{n.replace('_', '-')} {getattr(par, n)}"
                     for n in ("dp_shard", "dp_replicate") if getattr(par, n))
    # --fsdp alone: its clashes with --zero-stage, --strategy auto and QLoRA are said above
    if not flags:
        # --ep: _ep_problems
        return p + _method_problems("--fsdp", "shard", "full", precision) if par.fsdp else p
    if par.zero_stage is not None:
        p.append(f"{flags} with --zero-stage {par.zero_stage}: DeepSpeed does not run on the device mesh; "
                 "drop --zero-stage (--dp-shard is FSDP2's ZeRO-3)")
    if par.strategy == "auto":
        p.append(f"{flags} with --strategy auto: the planner picks the whole layout itself; drop {flags} or use "
                 "--strategy manual")
    return p + _method_problems(flags, "shard", method, precision)


def _cp_problems(par: ParallelConfig, method: str, precision: str) -> list[str]:
    """--cp checks that need no model (heads vs tp x cp: `model_problems`)."""
    if par.cp < 1:
        return [f"--cp must be >= 1 (got {par.cp})"]
    if par.cp == 1:
        return []
    other = f"--pp {par.pp}" if par.pp > 1 else off_mesh_layout(par)
    p = []
    if other:
        p.append(f"--cp {par.cp} with {other} is not supported; context parallel composes with DDP, "
                 "--dp-shard N (FSDP2 on the mesh) and --tp (drop one of them)")
    return p + _method_problems(f"--cp {par.cp}", "cp", method, precision)


def _ep_problems(par: ParallelConfig, method: str, precision: str) -> list[str]:
    """--ep checks that need no model (experts vs ep: `model_problems`)."""
    if par.ep < 1:
        return [f"--ep must be >= 1 (got {par.ep})"]
    if par.ep == 1:
        return []
    other = off_mesh_layout(par)
    p = [f"--ep {par.ep} with {other} is not supported; expert parallel runs on the device mesh, with --dp-shard "
         "(FSDP2), --dp-replicate, --cp, --tp and --pp (drop one of them)"] if other else []
    p += ep_tp_problems(par.tp, par.ep)
    return p + _method_problems(f"--ep {par.ep}", "shard", method, precision)


def ep_tp_problems(tp: int, ep: int) -> list[str]:
    """Under TP the ep group is the TP group (`toolkit.layout.dims`: whole experts, E/ep a rank, each TP
    rank dispatching its 1/tp of the tokens; no expert is cut over TP, benchmarks/etp.md): --ep must
    equal --tp."""
    if tp > 1 and ep > 1 and ep != tp:
        return [f"--ep {ep} with --tp {tp} is not supported; under tensor parallel the experts are split over the "
                f"TP group itself (each expert whole, each TP rank dispatching its share of the tokens), so --ep must "
                f"equal --tp: use --ep {tp} --tp {tp}, or drop --tp (--ep {ep} then borrows from --dp-shard)"]
    return []


def _pipeline_problems(par: ParallelConfig, method: str, precision: str, loss: str, micro_batch: int) -> list[str]:
    """--pp checks that need no model (stages vs blocks: `model_problems`)."""
    if par.pp < 1:
        return [f"--pp must be >= 1 (got {par.pp})"]
    p = []
    if par.pp_microbatches < 1:
        p.append(f"--pp-microbatches must be >= 1 (got {par.pp_microbatches})")
    elif micro_batch % par.pp_microbatches:
        p.append(f"--pp-microbatches {par.pp_microbatches} does not divide --micro-batch-size "
                 f"{micro_batch}; use a divisor of it or change the batch size")
    if par.pp == 1:
        if par.pp_devices:
            p.append("--pp-devices needs --pp N with N > 1")
        return p
    other = off_mesh_layout(par)
    if other:
        p.append(f"--pp {par.pp} with {other} is not supported; pipeline stages compose with --tp and with "
                 "data parallel on the mesh: use --dp-shard N (FSDP2) or DDP (drop one of them)")
    p += _method_problems(f"--pp {par.pp}", "pp", method, precision)
    if loss in FUSED_LOSSES:
        p.append(f"--pp {par.pp} with --loss {loss} is not supported; the last stage computes full logits "
                 "(use --loss full)")
    if par.pp_schedule == "1f1b" and par.pp_microbatches < par.pp:
        p.append(f"--pp-schedule 1f1b needs --pp-microbatches >= --pp ({par.pp_microbatches} < {par.pp})")
    devices = [x for x in par.pp_devices.split(",") if x.strip()]
    if par.pp_devices and len(devices) != par.pp:
        p.append(f"--pp-devices lists {len(devices)} devices for --pp {par.pp}; give one per stage (for example "
                 "cuda:0,cuda:1)")
    return p


def not_runnable(d: ParallelDims, method: str, precision: str, loss: str, micro_batch: int = 1) -> str:
    """Why the runtime refuses the mesh layout `d` ('' when it runs): `layout_problems`' first line for
    the flags that ask for it."""
    problems = layout_problems(mesh_flags(d, micro_batch), method, precision, loss, micro_batch)
    return problems[0] if problems else ""


# ----------------------------------------------------------------------------- the model and the world

def tp_divisibility_problems(cfg: dict[str, Any], t: int) -> list[str]:
    """Each rank keeps whole query and kv heads and an equal slice of the MLP: t must divide the
    attention heads, the kv heads and the intermediate size (those the config has)."""
    if t < 1:
        return [f"--tp {t}: must be >= 1"]
    nq = cfg.get("num_attention_heads")
    sizes = (("attention heads", nq), ("kv heads", cfg.get("num_key_value_heads") or nq),
             ("intermediate size", cfg.get("intermediate_size")),
             ("experts' intermediate size", cfg.get("moe_intermediate_size")))
    bad = [f"{what} ({n})" for what, n in sizes if isinstance(n, int) and n % t]
    return [f"--tp {t}: must divide the {', '.join(bad)}"] if bad else []


def tp_plan_problems(cfg: dict[str, Any], t: int, method: str = "full") -> list[str]:
    """--tp t against the config's `base_model_tp_plan` (the config class's attribute, which `to_dict()`
    leaves out: the caller puts it under that key; where the key is absent it is not checked): the
    TP layers must express it (`toolkit.layout.tp_regions`), and LoRA's adapters on stacked MoE experts
    (peft's target_parameters) are not split."""
    if "base_model_tp_plan" not in cfg:
        return []
    model = cfg.get("model_type", "?")
    try:
        plan = read_tp_plan(cfg["base_model_tp_plan"])
    except NotExpressible as e:
        arch = ", ".join(cfg.get("architectures") or [])
        return [f"--tp {t}: {model}{f' ({arch})' if arch else ''}: {e}; drop --tp (--dp-shard N or --zero-stage 3 "
                "shard this model instead)"]
    if method != "full" and any(r.experts for r in plan.regions):
        return [f"--tp {t} with --method {method}: {model}'s LoRA adapts its stacked experts, which TP does not "
                "split yet; use --method full with --tp, or drop --tp (--dp-shard N or --zero-stage 3)"]
    return []


def cp_divisibility_problems(cfg: dict[str, Any], tp: int, cp: int) -> list[str]:
    """The heads each rank keeps after TP must split again over cp (Ulysses exchanges whole heads)."""
    if cp == 1:
        return []
    q, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    if q % (tp * cp) or kv % (tp * cp):
        return [f"--cp {cp}{f' x --tp {tp}' if tp > 1 else ''} needs query and key/value heads divisible by "
                f"{tp * cp} (this model has {q} and {kv}); choose cp{' x tp' if tp > 1 else ''} dividing both"]
    return []


# Mixtral/gpt-oss, Qwen-MoE, DeepSeek
EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")


def num_experts(cfg: dict[str, Any]) -> int:
    """The routed experts of each MoE layer (0: a dense model)."""
    return next((cfg[k] for k in EXPERT_KEYS if cfg.get(k)), 0)


def ep_problems(cfg: dict[str, Any], ep: int) -> list[str]:
    """Each ep rank keeps E/ep whole experts of every MoE layer."""
    if ep == 1:
        return []
    n = num_experts(cfg)
    if not n:
        return [f"--ep {ep}: model type {cfg.get('model_type', '?')} has no routed experts (none of "
                f"{', '.join(EXPERT_KEYS)} in its config); drop --ep"]
    return [f"--ep {ep} must divide the model's {n} experts per layer; use a divisor of {n}"] if n % ep else []


def model_problems(cfg: dict[str, Any], tp: int, pp: int, cp: int, world: int, method: str = "full",
                   ep: int = 1) -> list[str]:
    """What the model's config (a text config's `to_dict()`, with `base_model_tp_plan` where --tp is
    asked for) and the launched world refuse for --tp / --pp / --cp. The pipeline's block structure
    is checked on the model itself (`toolkit.parallel.pp.pipeline_problems`)."""
    problems = ep_problems(cfg, ep)
    if tp > 1:
        problems += tp_plan_problems(cfg, tp, method) or tp_divisibility_problems(cfg, tp)
        if tp > world or world % tp:
            problems.append(f"--tp {tp} needs a world size that is a multiple of {tp} (got {world} process"
                            f"{'es' if world != 1 else ''}); launch with torchrun --nproc_per_node {tp} "
                            "(x data-parallel groups)")
    if pp > 1:
        # the planner's config (the run: its model)
        if "base_model_pp_plan" in cfg and not cfg["base_model_pp_plan"]:
            problems.append(f"--pp {pp}: model type {cfg.get('model_type', '?')} declares no base_model_pp_plan; "
                            "--pp needs it")
        if pp > cfg.get("num_hidden_layers", pp):
            problems.append(f"--pp {pp}: more stages than the model's {cfg['num_hidden_layers']} decoder blocks; "
                            f"use --pp {cfg['num_hidden_layers']} or fewer")
        if world > 1 and world % pp:
            problems.append(f"--pp {pp} across processes needs a world size that is a multiple of {pp} (got {world}); "
                            f"launch with torchrun --nproc_per_node {pp} (x data-parallel groups), or one process for "
                            "the naive pipeline")
        if router_aux(cfg):
            problems.append(f"--pp {pp}: {router_aux_line(cfg)}; it is a product of means over every layer's router "
                            "statistics, which no pipeline stage holds; pass --router-aux-loss-coef 0 to train without "
                            "it, or drop --pp")
    if cp > 1:
        problems += cp_divisibility_problems(cfg, tp, cp)
        if router_aux(cfg):
            problems.append(f"--cp {cp}: {router_aux_line(cfg)}; it is a product of means over a sequence's tokens, "
                            "which a cp rank's slice does not have; pass --router-aux-loss-coef 0 to train without it, "
                            "or drop --cp")
    return problems


def router_aux(cfg: dict[str, Any]) -> bool:
    """Whether the model adds a router load-balancing loss to its own (`LossHead.aux`)."""
    return bool(cfg.get("output_router_logits")) and bool(cfg.get("router_aux_loss_coef"))


def router_aux_line(cfg: dict[str, Any]) -> str:
    return (f"model type {cfg.get('model_type', '?')} adds a router load-balancing loss (output_router_logits, "
            f"coefficient {cfg.get('router_aux_loss_coef')})")


def dims_for(par: ParallelConfig, world: int, local_world: int) -> tuple[ParallelDims, list[str]]:
    """The degrees the flags give `world` ranks (`local_world` per node), and every problem: one
    process runs the naive pipeline (pp 1 on the mesh); ZeRO/FSDP shard the inferred data-parallel
    degree; `--fsdp-sharding hybrid` alone replicates across nodes (HSDP)."""
    replicate = par.dp_replicate
    if par.fsdp and par.fsdp_sharding == "hybrid" and not (par.dp_shard or par.dp_replicate):
        replicate = world // local_world
    dims, problems = infer_dims(world, tp=par.tp, pp=par.pp if world > 1 else 1,
                                sharded=par.fsdp or par.zero_stage is not None or par.ep > 1, dp_shard=par.dp_shard,
                                dp_replicate=replicate, cp=par.cp, ep=par.ep)
    return dims, ep_tp_problems(par.tp, par.ep) + problems


def world_problems(par: ParallelConfig, world: int) -> list[str]:
    """What the launched world refuses that the flags alone cannot tell."""
    if world > 1 and par.pp_devices and par.pp > 1:
        return ["--pp-devices is for the single-process pipeline; launched with several processes each rank runs "
                "its stage on its own device (drop --pp-devices)"]
    return []


def resume_problems(fmt: str, saved_world: int | None, world: int, saved_layout: dict, layout: dict,
                    deepspeed: bool) -> list[str]:
    """Whether a checkpoint of format `fmt` ('sharded' or 'hf', `checkpoint_format`) written by
    `saved_world` ranks with the layout keys `saved_layout` resumes on this one: a sharded checkpoint
    on any layout but DeepSpeed's; DeepSpeed's per-rank ZeRO state on the same world and layout only."""
    if fmt == "sharded":
        return ["it is a sharded checkpoint, which DeepSpeed ZeRO cannot read; resume it without --zero-stage "
                "(--fsdp shards the same state)"] if deepspeed else []
    problems = [] if saved_world == world else [f"it was saved by {saved_world} processes and this run has {world}"]
    problems += [f"--{k.replace('_', '-')} was {saved_layout.get(k)!r}, now {v!r}" for k, v in layout.items()
                 if saved_layout.get(k) != v]
    return problems
