"""`python -m toolkit accelerate-config`: an accelerate YAML for `accelerate launch --config_file`,
its parallel settings checked as finetune.py checks them."""

from __future__ import annotations

from pathlib import Path


def cmd_accelerate_config(args) -> None:
    from toolkit.config import parse_config
    from toolkit.layout.launcher import accelerate_yaml, write_accelerate_yaml

    flags = ["--offload", args.offload, "--fsdp-sharding", args.fsdp_sharding, "--output-dir", "/nonexistent"]
    flags += ((["--zero-stage", str(args.zero_stage)] if args.zero_stage is not None else [])
              + (["--fsdp"] if args.fsdp else []))
    # same checks as finetune.py
    par = parse_config(flags, prog="python -m toolkit accelerate-config").parallel
    cfg = accelerate_yaml(par.zero_stage, par.offload, par.fsdp, par.fsdp_sharding, args.num_processes,
                          args.num_machines, args.machine_rank, args.main_process_ip, args.main_process_port,
                          args.mixed_precision)
    write_accelerate_yaml(Path(args.output), cfg)
    print(f"wrote {args.output}: accelerate launch --config_file {args.output} finetune.py ...")
