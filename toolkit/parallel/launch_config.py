"""An accelerate YAML for users who prefer `accelerate launch --config_file`.

The file names the strategy the same way the toolkit's flags do (finetune.py adopts it when no
flag says otherwise, and refuses a conflicting flag). `deepspeed_config_file` points at the shipped
`ds_configs/` variant so DeepSpeed-only launches use the same JSON.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

import yaml

REPO = Path(__file__).resolve().parents[2]


def accelerate_yaml(zero_stage: int | None, offload: str, fsdp: bool, fsdp_sharding: str, num_processes: int,
                    num_machines: int = 1, machine_rank: int = 0, main_process_ip: str | None = None,
                    main_process_port: int = 29500, mixed_precision: str = "no") -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE", "debug": False, "downcast_bf16": "no",
        "machine_rank": machine_rank, "main_training_function": "main", "mixed_precision": mixed_precision,
        "num_machines": num_machines, "num_processes": num_processes, "rdzv_backend": "static",
        "same_network": True, "use_cpu": False, "gpu_ids": "all",
    }
    if num_machines > 1:
        cfg.update({"main_process_ip": main_process_ip or "127.0.0.1", "main_process_port": main_process_port})
    if fsdp:
        cfg["distributed_type"] = "FSDP"
        cfg["fsdp_config"] = {"fsdp_version": 2, "fsdp_reshard_after_forward": fsdp_sharding != "grad_op",
                              "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                              "fsdp_state_dict_type": "FULL_STATE_DICT", "fsdp_cpu_ram_efficient_loading": False}
    elif zero_stage is not None:
        cfg["distributed_type"] = "DEEPSPEED"
        cfg["deepspeed_config"] = {
            "zero_stage": zero_stage,
            "offload_optimizer_device": "cpu" if offload != "none" else "none",
            "offload_param_device": "cpu" if offload == "optimizer+param" else "none",
            "zero3_init_flag": False, "zero3_save_16bit_model": True, "gradient_accumulation_steps": 1,
        }
    else:
        cfg["distributed_type"] = "MULTI_GPU" if num_processes > 1 else "NO"
    return cfg


def write_accelerate_yaml(path: Path, cfg: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))


def accelerate_default_config(env: Mapping[str, str] = os.environ) -> Path:
    """Where `accelerate config` saves and `accelerate launch` reads by default (accelerate's
    `commands/config/config_args.py`: $HF_HOME, else $XDG_CACHE_HOME/huggingface, /accelerate)."""
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(os.path.expanduser(home)) / "accelerate" / "default_config.yaml"
