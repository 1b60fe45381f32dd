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
from toolkit.planner.layouts import pipeline_schedule
from toolkit.parallel.dims import ParallelDims
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


def apply_auto_strategy(cfg: Config, model_path: str, precision: str) -> tuple[Plan, str]:
    per_node, memory, nodes, what = detect_hardware()
    model_cfg = json.loads((Path(model_path) / "config.json").read_text()) if Path(model_path).is_dir() else None
    if model_cfg is None:
        from transformers import AutoConfig

        model_cfg = AutoConfig.from_pretrained(model_path).to_dict()
    t = cfg.train
    inp = PlanInput(model=model_cfg, gpu_memory=memory, gpus_per_node=per_node, nodes=nodes, cpu_memory=host_memory_bytes(),
                    method=cfg.model.method, lora_r=cfg.model.lora_r, lora_targets=cfg.model.lora_targets,
                    seq_len=cfg.data.seq_len, micro_batch=t.micro_batch_size, precision=precision,
                    checkpointing=True if t.gradient_checkpointing else None,
                    global_batch=t.micro_batch_size * t.grad_accum * per_node * nodes, loss=t.loss,
                    hardware=time_model(what))
    try:
        result = plan(inp)
    except (KeyError, ValueError) as e:
        raise UserError(f"--strategy auto: cannot plan for {model_path} ({e}); pass --zero-stage/--fsdp yourself") from None
    if not result.chosen:
        raise UserError(f"--strategy auto: {result.advice}")
    apply_plan(cfg, result)
    return result, (f"planned for {per_node} x {what}, {nodes} node(s), host RAM per node from this machine, "
                    f"time model {inp.hw.name}\n" + render_table(result))
