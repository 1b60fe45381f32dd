"""`--strategy auto`: detect the hardware, plan, and write the chosen settings into the config,
whatever the plan chose: a 1-D strategy (DDP/ZeRO/FSDP/offload) or a mesh layout (tp/pp/cp/dp_shard)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from toolkit.config import Config
from toolkit.errors import UserError
from toolkit.hardware import host_memory_bytes
from toolkit.planner.cost import HARDWARE, Hardware, load_hardware
from toolkit.layout.dims import ParallelDims
from toolkit.layout.rules import pipeline_schedule
from toolkit.planner.plan import Plan, PlanInput, plan, render_table

DEVICE_PRESETS = {"H100": "h100-sxm", "H200": "h100-sxm", "A100": "a100-80gb", "L40S": "l40s"}


def detect_hardware() -> tuple[int, int, int, str]:
    """(devices per node, bytes per device, nodes, what): GPUs when present, else CPU RAM per rank."""
    import torch

    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    nodes = max(1, world // max(1, local))
    if torch.cuda.is_available():
        return local, torch.cuda.get_device_properties(0).total_memory, nodes, torch.cuda.get_device_name(0)
    ram = host_memory_bytes()
    return local, ram // local, nodes, f"CPU ({ram / 1024**3:.0f} GiB RAM / {local} rank(s))"


def time_model(device: str) -> Hardware:
    """The time model's figures for this device: `TOOLKIT_HARDWARE` (a preset or a file from
    `plan --calibrate`), else the preset of a known GPU, else the CPU placeholders."""
    if os.environ.get("TOOLKIT_HARDWARE"):
        return load_hardware(os.environ["TOOLKIT_HARDWARE"])
    for key, preset in DEVICE_PRESETS.items():
        if key in device:
            return HARDWARE[preset]
    return HARDWARE["cpu" if device.startswith("CPU") else "h100-sxm"]


def apply_plan(cfg: Config, result: Plan) -> None:
    """Write the chosen layout, checkpointing and batch sizes into `cfg` (the flags `plan` prints)."""
    d, p, t = result.chosen_detail, cfg.parallel, cfg.train
    name = result.chosen
    if d.dims is not None:
        dims = ParallelDims(result.world, **d.dims)
        p.tp, p.pp, p.cp = dims.tp, dims.pp, dims.cp
        p.dp_shard = dims.dp_shard if dims.dp_shard > 1 else 0
        p.dp_replicate = dims.dp_replicate if dims.dp_shard > 1 and dims.dp_replicate > 1 else 0
        if dims.pp > 1:
            p.pp_schedule, p.pp_microbatches = pipeline_schedule(dims, d.micro_batch)
    elif name.startswith("zero"):
        p.zero_stage = int(name[4])
        p.offload = "optimizer+param" if name.endswith("offload_param") else "optimizer" if "offload" in name else "none"
    elif name.startswith("fsdp"):
        p.fsdp, p.fsdp_sharding = True, name.split("_", 1)[1]
    t.gradient_checkpointing, t.micro_batch_size, t.grad_accum = d.checkpointing, d.micro_batch, result.grad_accum


def plan_input(cfg: Config, model_cfg: dict, precision: str, per_node: int, memory: int, nodes: int,
               what: str) -> PlanInput:
    """The planner's question for this run on this hardware (`detect_hardware`)."""
    t = cfg.train
    return PlanInput(model=model_cfg, gpu_memory=memory, gpus_per_node=per_node, nodes=nodes,
                     cpu_memory=host_memory_bytes(), method=cfg.model.method, lora_r=cfg.model.lora_r,
                     lora_targets=cfg.model.lora_targets, lora_dropout=cfg.model.lora_dropout, seq_len=cfg.data.seq_len,
                     micro_batch=t.micro_batch_size, precision=precision,
                     checkpointing=True if t.gradient_checkpointing else None,
                     global_batch=t.micro_batch_size * t.grad_accum * per_node * nodes, loss=t.loss,
                     hardware=time_model(what))


def strategy_name(cfg: Config) -> str | None:
    """The planner's name for the 1-D layout `cfg` runs (None for a tp/pp/cp/dp-shard mesh)."""
    p = cfg.parallel
    if max(p.tp, p.pp, p.cp, p.dp_shard or 1) > 1:
        return None
    if p.fsdp:
        return "fsdp_grad_op" if p.fsdp_sharding == "grad_op" else "fsdp_full"
    if p.zero_stage:
        return f"zero{p.zero_stage}" + {"none": "", "optimizer": "_offload", "optimizer+param": "_offload_param"}[p.offload]
    return "ddp"


def predicted_peak(cfg: Config, model_cfg: dict, precision: str) -> int | None:
    """The planner's allocator peak (`bytes.allocated`) for the 1-D layout `cfg` runs on this hardware;
    None for a mesh layout or a model the planner cannot count."""
    from toolkit.planner.memory import STRATEGIES
    from toolkit.planner.plan import estimate

    name, t = strategy_name(cfg), cfg.train
    if name not in STRATEGIES:
        return None
    try:
        inp = plan_input(cfg, model_cfg, precision, *detect_hardware())
        return estimate(inp, STRATEGIES[name], t.gradient_checkpointing, t.micro_batch_size).bytes["allocated"]
    except (KeyError, ValueError, UserError):
        return None


def memory_advice(cfg: Config, model_cfg: dict, precision: str) -> str:
    """For an out-of-memory line: the planner's peak for the layout that ran against the device's
    memory, and the flags of a layout that fits (or why none does)."""
    from toolkit.planner.memory import STRATEGIES
    from toolkit.planner.plan import GiB, estimate

    per_node, memory, nodes, what = detect_hardware()
    inp = plan_input(cfg, model_cfg, precision, per_node, memory, nodes, what)
    name, t = strategy_name(cfg), cfg.train
    parts = []
    try:
        if name in STRATEGIES:
            ran = estimate(inp, STRATEGIES[name], t.gradient_checkpointing, t.micro_batch_size)
            parts.append(f"the planner puts this layout's peak at {ran.bytes['total'] / GiB:.1f} GiB per device, "
                         f"against {memory / GiB:.1f} GiB")
        inp.checkpointing = None  # let it choose
        result = plan(inp)
    except (KeyError, ValueError, UserError) as e:
        return f"the planner cannot say more for this model ({e})"
    parts.append(f"a layout that fits: {' '.join(result.flags)}" if result.chosen else result.advice)
    return "; ".join(parts)


def apply_auto_strategy(cfg: Config, model_path: str, precision: str) -> tuple[Plan, str]:
    per_node, memory, nodes, what = detect_hardware()
    model_cfg = json.loads((Path(model_path) / "config.json").read_text()) if Path(model_path).is_dir() else None
    if model_cfg is None:
        from transformers import AutoConfig

        model_cfg = AutoConfig.from_pretrained(model_path).to_dict()
    inp = plan_input(cfg, model_cfg, precision, per_node, memory, nodes, what)
    try:
        result = plan(inp)
    except (KeyError, ValueError) as e:
        raise UserError(f"--strategy auto: cannot plan for {model_path} ({e}); pass --zero-stage/--fsdp yourself") from None
    if not result.chosen:
        raise UserError(f"--strategy auto: {result.advice}")
    apply_plan(cfg, result)
    return result, (f"planned for {per_node} x {what}, {nodes} node(s), host RAM per node from this machine, "
                    f"time model {inp.hw.name}\n" + render_table(result))
