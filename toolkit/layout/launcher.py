"""What the launcher says about the layout: who started this process (accelerate, torchrun, DeepSpeed's
launcher), the settings an accelerate config or `accelerate launch` flags carry, and the accelerate
YAML the CLI writes for a layout. Pure: reads an environment mapping, argv and the parent's command
line; the rank environment itself is set up in `toolkit.parallel.launch`.

The YAML names the strategy the same way the toolkit's flags do: finetune.py adopts it when no flag
says otherwise, and refuses a conflicting flag (`adopt_launcher`, on the settings `toolkit.config.parse`
is resolving).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, MutableMapping

import yaml

def pop_local_rank(argv: list[str]) -> tuple[list[str], int | None, str | None]:
    """(argv without `--local_rank`/`--local-rank`, its value, a problem): DeepSpeed's launcher
    appends `--local_rank=K` to every rank's arguments (torch.distributed.launch did too)."""
    out, value, problem = [], None, None
    it = iter(argv)
    for arg in it:
        name, eq, rest = arg.partition("=")
        if name not in ("--local_rank", "--local-rank"):
            out.append(arg)
            continue
        raw = rest if eq else next(it, "")
        try:
            value = int(raw)
        except ValueError:
            problem = f"{name} must be an integer (got {raw!r})"
    return out, value, problem


def local_rank_problem(value: int | None, env: Mapping[str, str]) -> str | None:
    """`--local_rank K` must come from a launcher that also set LOCAL_RANK to K."""
    if value is None:
        return None
    if "LOCAL_RANK" not in env or "WORLD_SIZE" not in env:
        return (f"--local_rank {value} was given, but no launcher set LOCAL_RANK and WORLD_SIZE; launch with "
                "deepspeed, torchrun or accelerate launch, or drop --local_rank")
    if int(env["LOCAL_RANK"]) != value:
        return f"--local_rank {value} disagrees with the launcher's LOCAL_RANK={env['LOCAL_RANK']}; drop --local_rank"
    return None


def accelerate_config_file(env: Mapping[str, str], parent_cmdline: list[str] | None = None) -> str | None:
    """The accelerate config a launch read: `--config_file X` on the launching process's command line
    (accelerate's launcher is this process's parent), else accelerate's default config if it exists."""
    if not any(k.startswith("ACCELERATE_") for k in env):
        return None
    if parent_cmdline is None:
        parent_cmdline = _parent_cmdline()
    for i, arg in enumerate(parent_cmdline):
        name, eq, rest = arg.partition("=")
        if name in ("--config_file", "--config-file"):
            return rest if eq else (parent_cmdline[i + 1] if i + 1 < len(parent_cmdline) else None)
    default = accelerate_default_config(env)
    return str(default) if default.is_file() else None


def launch_source(env: Mapping[str, str], parent_cmdline: list[str] | None = None) -> str:
    """Where an accelerate launch's DeepSpeed or FSDP setting came from, for messages:
    "accelerate launch --use_deepspeed --zero_stage 3" when the flags said it, else "accelerate config PATH"."""
    if parent_cmdline is None:
        parent_cmdline = _parent_cmdline()
    flags = [a for a in parent_cmdline if a.split("=")[0] in ("--use_deepspeed", "--use_fsdp", "--use-deepspeed",
                                                                "--use-fsdp")]
    if flags:
        stage = None
        for i, arg in enumerate(parent_cmdline):
            name, eq, rest = arg.partition("=")
            if name in ("--zero_stage", "--zero-stage"):
                stage = rest if eq else (parent_cmdline[i + 1] if i + 1 < len(parent_cmdline) else None)
        return "accelerate launch " + " ".join(flags) + (f" --zero_stage {stage}" if stage else "")
    path = accelerate_config_file(env, parent_cmdline)
    return f"accelerate config {path}" if path else "accelerate launch"


def _parent_cmdline() -> list[str]:
    """The launching process's own arguments (those before the script it runs)."""
    try:
        args = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []
    script = next((i for i, a in enumerate(args) if a.endswith(".py") and i > 0), len(args))
    return args[:script]


def nproc_problem(nproc: int, env: Mapping[str, str]) -> str | None:
    """`--nproc-per-node N` in a process a launcher started with another number of processes (N = theirs is
    a rank `--nproc-per-node` itself started, or the same count asked twice)."""
    if nproc < 0:
        return f"--nproc-per-node must be >= 0 (got {nproc})"
    world = env.get("WORLD_SIZE")
    if nproc > 0 and world is not None and int(world) != nproc:
        who = "accelerate launch" if any(k.startswith("ACCELERATE_") for k in env) else \
            "torchrun" if "TORCHELASTIC_RUN_ID" in env else "a launcher"
        return (f"--nproc-per-node {nproc} in a launch of {world} process(es) by {who}, which started them already; "
                "drop --nproc-per-node, or run python finetune.py --nproc-per-node N without a launcher")
    return None


def single_process_launch(env) -> bool:
    """accelerate's simple launcher (`--num_processes N > 1` without `--multi_gpu`, which is what a
    machine without a GPU gets) sets the rendezvous address for N processes but starts one, with no
    WORLD_SIZE: it would train alone, silently, with 1/N of the global batch asked for."""
    return "ACCELERATE_USE_CPU" in env and "MASTER_ADDR" in env and "WORLD_SIZE" not in env


def single_process_refusal(parent_cmdline: list[str] | None = None) -> str:
    """The one line that refuses `single_process_launch`: the processes asked for, the two commands
    that start them, and, unless accelerate runs with --quiet, that the traceback it prints next is
    its report of this exit: its simple launcher raises CalledProcessError for any child that exits
    non-zero (accelerate/commands/launch.py, `simple_launcher`), which read as a second failure.
    The child cannot start the N processes itself soundly: the launch's port, its CPU affinity
    variables and a second machine's rank are the launcher's, and a launcher inside a launcher is
    one more path to keep working for a mistake that one flag fixes."""
    if parent_cmdline is None:
        parent_cmdline = _parent_cmdline()
    n = _flag_value(parent_cmdline, ("--num_processes", "--num-processes")) or "N"
    line = (f"accelerate launch --num_processes {n} started one process, not {n}: accelerate starts several only "
            f"with --multi_gpu (or by itself where it sees more than one GPU); run accelerate launch --multi_gpu "
            f"--num_processes {n} finetune.py ..., or torchrun --nproc_per_node {n} finetune.py ...")
    if not {"--quiet", "-q"} & set(parent_cmdline):
        line += ("; the traceback accelerate prints below (CalledProcessError, exit status 2) is its report of "
                 "this exit, not a second error")
    return line


def _flag_value(cmdline: list[str], names: tuple[str, ...]) -> str | None:
    """The value of the first of `names` on a command line, given as `--flag value` or `--flag=value`."""
    for i, arg in enumerate(cmdline):
        name, eq, rest = arg.partition("=")
        if name in names:
            return rest if eq else (cmdline[i + 1] if i + 1 < len(cmdline) else None)
    return None


FSDP1_STRATEGIES = {"1": "FULL_SHARD", "2": "SHARD_GRAD_OP", "3": "NO_SHARD", "4": "HYBRID_SHARD",
                    "5": "HYBRID_SHARD_ZERO2"}


def accelerate_fsdp_sharding(env) -> tuple[str, str | None]:
    """(--fsdp-sharding, a problem) from what `accelerate launch` exports for FSDP. FSDP2 configs say
    it with FSDP_RESHARD_AFTER_FORWARD true/false (accelerate always exports FSDP_SHARDING_STRATEGY,
    FULL_SHARD by default); FSDP1 ones with a strategy name or number, in FSDP_RESHARD_AFTER_FORWARD
    (newer accelerate) or FSDP_SHARDING_STRATEGY. The toolkit runs FSDP2 either way."""
    reshard = env.get("FSDP_RESHARD_AFTER_FORWARD", "")
    if env.get("FSDP_VERSION") == "2":
        return ("grad_op" if reshard.lower() == "false" else "full"), None
    name = reshard if reshard.upper() in FSDP1_STRATEGIES.values() else env.get("FSDP_SHARDING_STRATEGY", "FULL_SHARD")
    name = FSDP1_STRATEGIES.get(name, name.upper())
    ours = {"FULL_SHARD": "full", "SHARD_GRAD_OP": "grad_op", "HYBRID_SHARD": "hybrid"}.get(name)
    if ours is None:
        return "full", (f"says FSDP {name}, which the toolkit does not run (it runs FSDP2 with FULL_SHARD, "
                        "SHARD_GRAD_OP or HYBRID_SHARD); change the config, or drop FSDP for plain DDP")
    return ours, None




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


# set by `adopt_launcher` for `toolkit.layout.deepspeed.adopt_deepspeed_file`, not config keys: the accelerate
# config that named the --deepspeed file, and the (stage, launcher) a launcher gave beside one
NAMED_BY, LAUNCHER_STAGE = "_deepspeed_named_by", "_deepspeed_launcher_stage"


def adopt_launcher(values: MutableMapping[str, Any], given: set[str], notes: list[str]) -> list[str]:
    """`accelerate launch --use_deepspeed/--use_fsdp`, or an accelerate config naming DeepSpeed or FSDP,
    must agree with our flags. What only the launcher says is adopted (an accelerate config alone
    works) and said in one line (`notes`); a flag the user gave that disagrees is refused. Returns the
    refusals; (stage, launcher) beside a --deepspeed file is left in `values` for `adopt_deepspeed_file`.
    `values`: the flat settings resolved so far, written in place, where a key not set reads as its default
    (`toolkit.config.parse._Settings`); `given`: the keys the user set."""
    env = os.environ
    if single_process_launch(env):
        return [single_process_refusal()]
    deepspeed = env.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true"
    fsdp = env.get("ACCELERATE_USE_FSDP", "").lower() == "true"
    if not (deepspeed or fsdp):
        return []
    source = launch_source(env)
    says = "DeepSpeed" if deepspeed else "FSDP"
    if values["strategy"] == "auto":
        return [f"{source} says {says}, and --strategy auto picks the layout itself; drop one of them"]
    adopted: list[str] = []
    precision = env.get("ACCELERATE_MIXED_PRECISION", "no")
    if precision in ("bf16", "fp16") and "mixed_precision" not in given:
        # "no" is also what accelerate says when nobody chose
        values["mixed_precision"] = precision
        adopted.append(precision)
    if fsdp:
        if values["zero_stage"] is not None or values["deepspeed"]:
            asked = f"--zero-stage {values['zero_stage']}" if values["zero_stage"] is not None \
                else f"--deepspeed {values['deepspeed']}"
            return [f"{source} says FSDP, {asked} asks for DeepSpeed; drop one of them"]
        values["fsdp"] = True
        sharding, problem = accelerate_fsdp_sharding(env)
        if problem:
            return [f"{source} {problem}"]
        if "fsdp_sharding" in given and values["fsdp_sharding"] != sharding:
            return [f"{source} says FSDP with {sharding} sharding, --fsdp-sharding {values['fsdp_sharding']} "
                    "disagrees; drop one of them"]
        values["fsdp_sharding"] = sharding
        notes.append(f"layout: FSDP2, {sharding} sharding, from {source}"
                     + (f"; {', '.join(adopted)} from it too" if adopted else ""))
        return []
    if "fsdp" in given and values["fsdp"]:
        return [f"{source} says DeepSpeed, --fsdp asks for FSDP; drop one of them"]
    ds_file = env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")
    # the config names a DeepSpeed JSON: read as --deepspeed FILE
    if ds_file not in ("", "none"):
        if values["deepspeed"] and Path(values["deepspeed"]).resolve() != Path(ds_file).resolve():
            return [f"{source} names DeepSpeed config {ds_file}, --deepspeed names {values['deepspeed']}; "
                    "drop one of them"]
        values["deepspeed"] = ds_file
        values[NAMED_BY] = source
        return []
    # the file decides the stage; a stage the launcher was given must agree with it
    if values["deepspeed"]:
        named = env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE")
        values[LAUNCHER_STAGE] = (int(named), source) if named not in (None, "") else None
        return []
    # accelerate's default stage
    stage = int(env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2"))
    if values["zero_stage"] is not None and values["zero_stage"] != stage:
        return [f"{source} says ZeRO-{stage}, --zero-stage {values['zero_stage']} disagrees; drop one of them"]
    values["zero_stage"] = stage
    optim = env.get("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "none")
    offload = "optimizer+param" if env.get("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "none") not in ("none", "") \
        else "optimizer" if optim not in ("none", "") else "none"
    if "offload" in given and values["offload"] != offload:
        return [f"{source} says offload {offload}, --offload {values['offload']} disagrees; drop one of them"]
    values["offload"] = offload
    what = f"ZeRO-{stage}" + ("" if offload == "none" else f" with {offload} offload")
    notes.append(f"layout: {what} from {source}" + (f"; {', '.join(adopted)} from it too" if adopted else ""))
    return []
