"""`--strategy auto`: detect the hardware, plan, and write the chosen settings into the config."""

from __future__ import annotations

import json
import os
from pathlib import Path

from toolkit.config import Config
from toolkit.errors import UserError
from toolkit.hardware import host_memory_bytes
from toolkit.planner.plan import Plan, PlanInput, plan, render_table


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
                    global_batch=t.micro_batch_size * t.grad_accum * per_node * nodes, loss=t.loss)
    try:
        result = plan(inp)
    except (KeyError, ValueError) as e:
        raise UserError(f"--strategy auto: cannot plan for {model_path} ({e}); pass --zero-stage/--fsdp yourself") from None
    if not result.chosen:
        raise UserError(f"--strategy auto: {result.advice}")
    d, p = result.chosen_detail, cfg.parallel
    name = result.chosen
    if name.startswith("zero"):
        p.zero_stage = int(name[4])
        p.offload = "optimizer+param" if name.endswith("offload_param") else "optimizer" if "offload" in name else "none"
    elif name.startswith("fsdp"):
        p.fsdp, p.fsdp_sharding = True, name.split("_", 1)[1]
    t.gradient_checkpointing, t.micro_batch_size, t.grad_accum = d.checkpointing, d.micro_batch, result.grad_accum
    return result, (f"planned for {per_node} x {what}, {nodes} node(s), host RAM per node from this machine\n"
                    + render_table(result))
