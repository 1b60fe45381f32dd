"""`--strategy auto`: detect the hardware, plan, and write the chosen settings into the config,
whatever the plan chose: a 1-D strategy (DDP/ZeRO/FSDP/offload) or a mesh layout (tp/pp/cp/dp_shard)."""

from __future__ import annotations

from dataclasses import replace

import json
import os
from pathlib import Path

from toolkit.config.schema import Config
from toolkit.errors import UserError
from toolkit.hardware import host_memory_bytes
from toolkit.planner.cost import HARDWARE, Hardware, load_hardware
from toolkit.layout.dims import ParallelDims
from toolkit.layout.rules import flags_of, mesh_flags, strategy_name
from toolkit.planner.estimate import Candidate, Plan, PlanInput, reestimate
from toolkit.planner.explain import plan, render_table

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


def apply_plan(cfg: Config, result: Plan) -> Config:
    """The config with the chosen layout, checkpointing and batch sizes (the flags `plan` prints)."""
    d = result.chosen_detail
    return apply_layout(cfg, result.world, d.name, d.dims, d.checkpointing, d.micro_batch, result.grad_accum)


def apply_layout(cfg: Config, world: int, name: str, dims: dict | None, checkpointing: bool, micro_batch: int,
                 grad_accum: int) -> Config:
    """The config with a planned layout (a 1-D strategy `name`, or mesh `dims`) and its batch split."""
    flags = mesh_flags(ParallelDims(world, **dims), micro_batch) if dims is not None else flags_of(name)
    layout = {k: getattr(flags, k) for k in ("zero_stage", "offload", "fsdp", "fsdp_sharding", "dp_shard",
                                            "dp_replicate", "tp", "cp", "ep", "pp", "pp_microbatches", "pp_schedule")}
    # the pipeline settings stay the user's
    if dims is None or ParallelDims(world, **dims).pp == 1:
        del layout["pp_microbatches"], layout["pp_schedule"]
    return cfg.replace(**layout, gradient_checkpointing=checkpointing, micro_batch_size=micro_batch,
                       grad_accum=grad_accum)


# --strategy auto after an out-of-memory: how many of the plan's fallbacks this process is past
FALLBACK_ENV = "TOOLKIT_AUTO_FALLBACK"
# an out-of-memory in these first steps falls back; a later one is the layout's to report
FALLBACK_STEPS = 3


def restart_after_oom(result: Plan, step: int, say) -> None:
    """--strategy auto, one process, an out-of-memory in the first steps: say the plan's next fallback
    in one line and run the same command again on it, in this process (exec: every byte it held on
    the device is given back; the run's output folder, which holds no checkpoint yet, is written
    again). Returns only where the step is past the first ones or no fallback is left."""
    import sys

    taken = int(os.environ.get(FALLBACK_ENV, "0"))
    if step > FALLBACK_STEPS or taken >= len(result.fallbacks):
        return
    nxt = result.fallbacks[taken]
    say(f"out of memory at step {step} under --strategy auto: falling back to {nxt['what']} "
        f"({' '.join(nxt['flags'])}; fallback {taken + 1} of {len(result.fallbacks)}), starting again")
    os.environ[FALLBACK_ENV] = str(taken + 1)
    argv = list(sys.orig_argv)
    if "--overwrite-output-dir" not in argv:
        argv.append("--overwrite-output-dir")
    sys.stdout.flush(), sys.stderr.flush()
    os.execv(sys.executable, argv)


def plan_input(cfg: Config, model_cfg: dict, precision: str, per_node: int, memory: int, nodes: int,
               what: str, vision: tuple[int, int] = (0, 0)) -> PlanInput:
    """The planner's question for this run on this hardware (`detect_hardware`). The global batch is
    the run's micro-batch x accumulation x ranks; the plan keeps it and may re-split it. An image-text model:
    `model_cfg` its language model's, `vision` its (tower, projector) parameters (`toolkit.model.vision.plan_view`)."""
    from toolkit.config.objectives import plan_terms

    t = cfg.train
    # a preference pair: two sequences, full logits
    terms = plan_terms(t.objective, cfg.model.method, t.loss, cfg)
    return PlanInput(model=model_cfg, gpu_memory=memory, gpus_per_node=per_node, nodes=nodes,
                     sequences=terms["sequences"], extra_forwards=terms["extra_forwards"],
                     generation=terms.get("generation"),
                     cpu_memory=host_memory_bytes(), method=cfg.model.method, lora_r=cfg.model.lora_r,
                     lora_targets=cfg.model.lora_targets, lora_dropout=cfg.model.lora_dropout,
                     seq_len=terms.get("seq_len", cfg.data.seq_len),
                     micro_batch=t.micro_batch_size, grad_accum=t.grad_accum, precision=precision,
                     checkpointing=True if t.gradient_checkpointing else None, loss=terms["loss"],
                     hardware=time_model(what), device="CPU" if what.startswith("CPU") else "GPU",
                     vision=vision, train_vision=cfg.model.train_vision)


def predicted_peak(cfg: Config, model_cfg: dict, precision: str, vision: tuple[int, int] = (0, 0)) -> int | None:
    """The planner's allocator peak (`bytes.allocated`) for the 1-D layout `cfg` runs on this hardware;
    None for a mesh layout or a model the planner cannot count (`plan_input`'s `model_cfg` and `vision`)."""
    from toolkit.planner.memory import STRATEGIES
    from toolkit.planner.estimate import estimate

    name, t = strategy_name(cfg.parallel), cfg.train
    if name not in STRATEGIES:
        return None
    try:
        inp = plan_input(cfg, model_cfg, precision, *detect_hardware(), vision=vision)
        return estimate(inp, STRATEGIES[name], t.gradient_checkpointing, t.micro_batch_size).bytes["allocated"]
    except (KeyError, ValueError, UserError):
        return None


def memory_advice(cfg: Config, model_cfg: dict, precision: str, vision: tuple[int, int] = (0, 0)) -> str:
    """For an out-of-memory line: the planner's peak for the layout that ran against the device's
    memory, and the flags of a layout that fits (or why none does)."""
    from toolkit.planner.memory import STRATEGIES
    from toolkit.planner.estimate import GiB, estimate

    per_node, memory, nodes, what = detect_hardware()
    inp = plan_input(cfg, model_cfg, precision, per_node, memory, nodes, what, vision)
    name, t = strategy_name(cfg.parallel), cfg.train
    parts = []
    try:
        if name in STRATEGIES:
            ran = estimate(inp, STRATEGIES[name], t.gradient_checkpointing, t.micro_batch_size)
            parts.append(f"the planner puts this layout's peak at {ran.bytes['total'] / GiB:.1f} GiB per device, "
                         f"against {memory / GiB:.1f} GiB")
        # let it choose
        inp.checkpointing = None
        result = plan(inp)
    except (KeyError, ValueError, UserError) as e:
        return f"the planner cannot say more for this model ({e})"
    parts.append(f"a layout that fits: {' '.join(result.flags)}" if result.chosen else result.advice)
    return "; ".join(parts)


def full_logits_fit(inp: PlanInput, c: Candidate) -> bool:
    """Whether `c` still fits with the loss on full (B, T, V) fp32 logits instead of a chunk's: then no
    chunk loop can be faster on a GPU (`toolkit.objectives.sft.loss.choose_loss`). Estimated again, because the loss
    buffers do not add linearly into the allocator peak (`saved.allocated_peak`)."""
    import dataclasses

    return reestimate(dataclasses.replace(inp, loss="full"), c, c.micro_batch).fits


def apply_auto_strategy(cfg: Config, model_path: str, precision: str, tree_check=None,
                        view=None) -> tuple[Config, Plan, str]:
    """(the config with the plan's choices, the plan, its table for the log). `tree_check`: the run's
    check of a layout on the model's module tree (`toolkit.parallel.tree.tree_problem`; `PlanInput.tree_check`);
    `view`: what the planner counts of a config (`toolkit.model.vision.plan_view`: an image-text model's language
    model and vision side), handed in as `tree_check` is."""
    per_node, memory, nodes, what = detect_hardware()
    model_cfg = json.loads((Path(model_path) / "config.json").read_text()) if Path(model_path).is_dir() else None
    if model_cfg is None:
        from transformers import AutoConfig

        model_cfg = AutoConfig.from_pretrained(model_path).to_dict()
    model_cfg, vision = view(model_cfg) if view is not None else (model_cfg, (0, 0))
    inp = replace(plan_input(cfg, model_cfg, precision, per_node, memory, nodes, what, vision), tree_check=tree_check)
    try:
        result = plan(inp)
    except (KeyError, ValueError) as e:
        raise UserError(f"--strategy auto: cannot plan for {model_path} ({e}); pass --zero-stage/--fsdp "
                        "yourself") from None
    if not result.chosen:
        raise UserError(f"--strategy auto: {result.advice}")
    taken = int(os.environ.get(FALLBACK_ENV, "0"))
    # a restart after an out-of-memory: the plan's fallback, not its choice
    if taken:
        if taken > len(result.fallbacks):
            raise UserError(f"--strategy auto: out of memory on every fallback of the plan ({len(result.fallbacks)}); "
                            "use more GPUs, --method qlora or a shorter --seq-len")
        f = result.fallbacks[taken - 1]
        cfg = apply_layout(cfg, result.world, f["name"], f["dims"], True, f["micro_batch"], f["grad_accum"])
        return cfg.replace(notes=(f"layout: fallback {taken} of the plan after an out-of-memory: {f['what']} "
                                  f"({' '.join(f['flags'])})",)), result, render_table(result)
    cfg = apply_plan(cfg, result)
    if cfg.train.loss == "auto" and "CPU" not in what and full_logits_fit(inp, result.chosen_detail):
        cfg = cfg.replace(loss="full", notes=("loss: full logits (--loss auto: the plan says they fit; no chunked "
                                              "loop is faster then)",))
    return cfg, result, (f"planned for {per_node} x {what}, {nodes} node(s), host RAM per node from this machine, "
                    f"time model {inp.hw.name}\n" + render_table(result))
