"""`python -m toolkit plan`: the model's config (a preset, a folder or a file), a run's YAML read as
finetune.py reads it (`--config`), this machine's GPUs and host RAM, and the plan printed as a table or
JSON; `--calibrate` is `toolkit.cli.calibrate`'s."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from toolkit.errors import UserError

if TYPE_CHECKING:
    from toolkit.planner.estimate import Asked


def load_model_config(spec: str) -> dict:
    """A preset name, a model folder (its config.json) or a config JSON file."""
    import difflib
    import json

    from toolkit.planner.presets import HUB_IDS, PRESETS

    key = HUB_IDS.get(spec, spec.lower().removesuffix("-instruct"))
    if key in PRESETS:
        return dict(PRESETS[key])
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise UserError(f"--model {spec}: {path} is not valid JSON (line {e.lineno}: {e.msg})") from None
    hint = difflib.get_close_matches(key, list(PRESETS), n=1)
    raise UserError(f"--model {spec}: not a preset, model folder or config file"
                    + (f" (did you mean '{hint[0]}'?)" if hint else "") + f"; presets: {', '.join(PRESETS)}")


def from_run_config(args: argparse.Namespace) -> tuple[str, Asked | None]:
    """`plan --config RUN.yaml`: the run's settings as finetune.py reads them (`config.parse_config`:
    the same keys, aliases, checks and --deepspeed file) and the machine its plan keys name
    (`config.PlanConfig`), where no flag given here says otherwise. Sets them on `args`; returns the
    line that says what was read, and the layout the run asks for (`planner.estimate.Asked`; None under
    --strategy auto, where the plan's choice is the run's)."""
    import difflib
    import tempfile

    from toolkit.config import parse_config
    from toolkit.planner.estimate import Asked, parse_size
    from toolkit.planner.presets import GPU_PRESETS

    # the run's output folder is not the plan's to check
    with tempfile.TemporaryDirectory() as out:
        cfg = parse_config(["--config", args.config, "--output-dir", out], prog="python -m toolkit plan --config",
                           check_dataset=False)
    m, t, par, machine = cfg.model, cfg.train, cfg.parallel, cfg.plan
    typed, read = getattr(args, "typed", set()), []

    def take(dest: str, value, shown=None) -> None:
        if dest not in typed:
            setattr(args, dest, value)
            read.append(f"{dest} {value if shown is None else shown}")

    take("model", m.model)
    take("method", m.method)
    for key in ("lora_r", "lora_targets", "lora_dropout") if m.method != "full" else ():
        take(key, getattr(m, key))
    take("seq_len", cfg.data.seq_len)
    take("micro_batch_size", t.micro_batch_size)
    take("grad_accum", t.grad_accum)
    take("mixed_precision", "bf16" if t.mixed_precision == "auto" else t.mixed_precision,
         "auto (bf16 on the GPU)" if t.mixed_precision == "auto" else None)
    take("gradient_checkpointing", "on" if t.gradient_checkpointing else "auto",
         "on" if t.gradient_checkpointing else "off (the plan also tries it on)")
    take("loss", t.loss)
    take("objective", t.objective)
    asked = None
    if par.strategy == "auto":
        read.append("strategy auto (the plan's choice is the run's)")
    else:
        gc = {"on": True, "off": False}.get(args.gradient_checkpointing, t.gradient_checkpointing)
        asked = Asked(par, gc)
        read.append(f"layout {layout_words(par)}")

    where = f"--config {args.config}"
    if machine.plan_gpu and machine.plan_gpu_memory:
        raise UserError(f"{where}: plan_gpu and plan_gpu_memory both give the GPU's memory; keep one")
    if machine.plan_gpu and machine.plan_gpu not in GPU_PRESETS:
        hint = difflib.get_close_matches(machine.plan_gpu, list(GPU_PRESETS), n=1)
        raise UserError(f"{where}: plan_gpu '{machine.plan_gpu}' is not a card the planner knows"
                        + (f" (did you mean '{hint[0]}'?)" if hint else "") + f"; use one of {', '.join(GPU_PRESETS)}, "
                        "or plan_gpu_memory: SIZE")
    for key in ("plan_gpus_per_node", "plan_nodes"):
        if getattr(machine, key) is not None and getattr(machine, key) < 1:
            raise UserError(f"{where}: {key} must be >= 1 (got {getattr(machine, key)})")
    for key in ("plan_gpu_memory", "plan_cpu_memory"):
        value = getattr(machine, key)
        if value and not (key == "plan_cpu_memory" and value.strip().lower() in ("unlimited", "none")):
            try:
                parse_size(value, key.removeprefix("plan_").replace("_", "-"))
            except UserError as e:
                raise UserError(f"{where}: {key}: {e}") from None
    named = []
    if not {"gpu", "gpu_memory"} & typed and (machine.plan_gpu or machine.plan_gpu_memory):
        args.gpu, args.gpu_memory = machine.plan_gpu or None, machine.plan_gpu_memory or args.gpu_memory
        named.append(f"plan_gpu {machine.plan_gpu}" if machine.plan_gpu
                     else f"plan_gpu_memory {machine.plan_gpu_memory}")
    for dest in ("gpus_per_node", "nodes", "cpu_memory"):
        value = getattr(machine, f"plan_{dest}")
        if value not in (None, "") and dest not in typed:
            setattr(args, dest, value)
            named.append(f"plan_{dest} {value}")
    machine_line = (f"the machine from its {', '.join(named)}" if named else
                    "no machine named in it (plan_gpu, plan_gpus_per_node, plan_nodes): the plan's defaults")
    return f"{where}: {', '.join(read)}, as finetune.py reads them; {machine_line}", asked


def layout_words(par) -> str:
    """The layout a run's parallel settings (a `layout.flags.ParallelConfig`) ask for, in the planner's
    names or the mesh degrees."""
    from toolkit.layout.rules import strategy_name

    name = strategy_name(par)
    if name is not None:
        return name
    degrees = [f"{k} {getattr(par, k)}" for k in ("tp", "pp", "cp", "dp_shard", "dp_replicate") if getattr(par, k) > 1]
    return " x ".join(degrees)


def local_gpus() -> int:
    """NVIDIA GPUs this machine shows: CUDA_VISIBLE_DEVICES where set, else the driver's entries in
    /proc. Read without torch, so `plan`, pure numbers, answers in under a second."""
    import os

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and not d.strip().startswith("-")])
    root = Path("/proc/driver/nvidia/gpus")
    return len(list(root.iterdir())) if root.is_dir() else 0


def host_ram(args) -> tuple[int | None, bool, str | None]:
    """(host RAM per node in bytes, None where not checked; whether that is because it is unknown; the
    line that says where it came from).
    --cpu-memory where given (`unlimited`: not checked). Otherwise this machine's RAM, but only where
    the plan is for this machine: one node of as many GPUs as it has. A plan for another machine (a
    cluster, another GPU count) has no figure to read here: its host RAM is unknown, said so, and
    CPU offload is not checked against it (once, 8 x 80 GB were planned against a laptop's 24 GiB,
    and the offload rows showed "fits: no" for that)."""
    from toolkit.planner.estimate import parse_size

    if args.cpu_memory is not None:
        if args.cpu_memory.strip().lower() in ("unlimited", "none"):
            return None, False, None
        return parse_size(args.cpu_memory, "cpu-memory"), False, None
    here = local_gpus()
    if args.nodes == 1 and args.gpus_per_node == here:
        from toolkit.hardware import host_memory_bytes

        ram = host_memory_bytes()
        return ram, False, (f"host RAM per node: {ram / 1024**3:.0f} GiB, this machine's (the plan is for its "
                            f"{here} GPU{'s' * (here != 1)}; --cpu-memory SIZE to plan for another node, "
                            "--cpu-memory unlimited not to check it)")
    machine = f"{args.nodes} node{'s' * (args.nodes != 1)} of {args.gpus_per_node} GPU{'s' * (args.gpus_per_node != 1)}"
    return None, True, (f"host RAM per node: unknown: the plan is for {machine}, not this machine ({here} "
                        f"GPU{'s' * (here != 1)}), so CPU offload is not checked against host RAM (--cpu-memory "
                        "SIZE to check it)")


def cmd_plan(args) -> None:
    import json

    from toolkit.planner.cost import load_hardware
    from toolkit.planner.estimate import PlanInput, parse_size
    from toolkit.planner.explain import plan, render_table

    if args.calibrate:
        from toolkit.cli.calibrate import calibrate

        calibrate(Path(args.output or "hardware.json"))
        return
    if args.output:
        raise UserError("--output is where --calibrate writes; plan prints to stdout (use --json > FILE)")
    notes, asked = [], None
    if args.config:
        note, asked = from_run_config(args)
        notes.append(note)
    if args.gpu:
        from toolkit.planner.presets import GPU_PRESETS

        memory, timing = GPU_PRESETS[args.gpu]
        args.gpu_memory = f"{memory}GB"
        if args.hardware is None and timing:
            args.hardware = timing
        given = "--gpu" if not args.config or "gpu" in getattr(args, "typed", set()) else "plan_gpu"
        notes.append(f"{given} {args.gpu}: {memory} GB per GPU; step times from the {args.hardware or 'h100-sxm'} time "
                     "model" + ("" if timing else f" (none for {args.gpu}: measure one with --calibrate)"))
    hardware = load_hardware(args.hardware)

    from toolkit.model.vision import plan_view

    # an image-text model: its language model's config, and its vision side's parameters beside
    cfg, vision = plan_view(load_model_config(args.model_config or args.model))
    missing = [k for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
               if k not in cfg]
    if missing:
        raise UserError(f"--model {args.model}: config lacks {', '.join(missing)} (a decoder-only Llama-family "
                        "config is expected)")
    cpu_memory, unknown, note = host_ram(args)
    from toolkit.config.objectives import generates, plan_terms

    recipe = None
    # its sampling's settings: the recipe's (plan --config), else the defaults
    if generates(args.objective):
        from toolkit.config import Config

        recipe = Config.from_values({"objective": args.objective, "method": args.method, "seq_len": args.seq_len,
                                     "micro_batch_size": args.micro_batch_size, "grad_accum": args.grad_accum})
    # a preference pair: two sequences, full logits
    terms = plan_terms(args.objective, args.method, args.loss, recipe)
    from toolkit.parallel.tree import tree_problem

    inp = PlanInput(model=cfg, gpu_memory=parse_size(args.gpu_memory, "gpu-memory"), gpus_per_node=args.gpus_per_node,
                    nodes=args.nodes, cpu_memory=cpu_memory, cpu_memory_unknown=unknown, tree_check=tree_problem,
                    sequences=terms["sequences"],
                    extra_forwards=terms["extra_forwards"], generation=terms.get("generation"),
                    method=args.method, lora_r=args.lora_r, lora_targets=args.lora_targets,
                    lora_dropout=args.lora_dropout, seq_len=terms.get("seq_len", args.seq_len), vision=vision,
                    train_vision=getattr(args, "train_vision", "none"),
                    micro_batch=args.micro_batch_size, grad_accum=args.grad_accum, precision=args.mixed_precision,
                    checkpointing={"auto": None, "on": True, "off": False}[args.gradient_checkpointing],
                    global_batch=args.global_batch, tp=args.tp, pp=args.pp, cp=args.cp, ep=args.ep, loss=terms["loss"],
                    hardware=hardware, asked=asked)
    try:
        result = plan(inp)
    except ValueError as e:
        raise UserError(str(e)) from None
    result.notes[:0] = notes + ([note] if note else [])
    print(json.dumps(result.to_json(), indent=2) if args.json else render_table(result))
