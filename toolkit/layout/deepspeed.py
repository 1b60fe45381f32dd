"""The DeepSpeed JSON a layout runs with: built from the run's settings, or read from the user's
`--deepspeed` file with its "auto"s filled in, and checked by DeepSpeed's own config schema (imported
only when a file is given). No engine and no process group: the engine is accelerate's business
(`toolkit.parallel`).

A `--deepspeed` file's settings are adopted into the run's where no flag sets them, and a flag that
disagrees is refused (`adopt_deepspeed_file`, on the settings `toolkit.config.parse` is resolving).

`deepspeed_config` is a pure function: the files in `ds_configs/` are its output for the standard
variants (`scripts/gen_ds_configs.py`), and each run writes the one it used to
`OUTPUT_DIR/ds_config.json`. Values accelerate fills in from the run (batch sizes, accumulation,
clipping) stay `"auto"`, as in accelerate's own DeepSpeed examples.
"""

from __future__ import annotations

import os
from functools import cache
from typing import Any, Callable, MutableMapping

OFFLOADS = ("none", "optimizer", "optimizer+param")


def bucket_sizes(hidden_size: int | None) -> dict[str, Any]:
    """ZeRO communication buckets scaled to the model, as in transformers' DeepSpeed integration
    (`reduce_bucket_size = h*h`, `stage3_prefetch_bucket_size = 0.9*h*h`, `param_persistence =
    10*h`): one bucket holds about one h x h weight, so a layer's reduce overlaps the next
    layer's backward. Without a hidden size they stay "auto" for accelerate to fill."""
    if not hidden_size:
        return {"reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                "stage3_param_persistence_threshold": "auto"}
    return {"reduce_bucket_size": hidden_size * hidden_size,
            "stage3_prefetch_bucket_size": int(0.9 * hidden_size * hidden_size),
            "stage3_param_persistence_threshold": 10 * hidden_size}


def deepspeed_config(stage: int, offload: str = "none", mixed_precision: str = "auto",
                     hidden_size: int | None = None, overlap_comm: bool = True) -> dict[str, Any]:
    """The DeepSpeed JSON for ZeRO `stage` (0-3) with optional CPU offload.

    `mixed_precision` "auto" leaves bf16/fp16 to accelerate's `--mixed_precision`; `overlap_comm`
    overlaps gradient reduction with backward on GPUs (the CPU rehearsal turns it off: gloo has no
    streams to overlap on)."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0-3, got {stage}")
    if offload not in OFFLOADS:
        raise ValueError(f"offload must be one of {OFFLOADS}, got {offload}")
    if offload == "optimizer+param" and stage != 3:
        raise ValueError("parameter offload needs ZeRO stage 3")
    if offload != "none" and stage == 0:
        raise ValueError("offload needs ZeRO stage 1-3")
    buckets = bucket_sizes(hidden_size)
    zero: dict[str, Any] = {"stage": stage}
    if stage >= 1:
        zero.update({"overlap_comm": overlap_comm, "contiguous_gradients": True,
                     "reduce_bucket_size": buckets["reduce_bucket_size"]})
    if stage in (1, 2):
        zero.update({"allgather_partitions": True, "reduce_scatter": True,
                     "allgather_bucket_size": buckets["reduce_bucket_size"]})
    if stage == 3:
        zero.update({"stage3_prefetch_bucket_size": buckets["stage3_prefetch_bucket_size"],
                     "stage3_param_persistence_threshold": buckets["stage3_param_persistence_threshold"],
                     "stage3_max_live_parameters": 1_000_000_000, "stage3_max_reuse_distance": 1_000_000_000,
                     "stage3_gather_16bit_weights_on_model_save": True})
    if offload in ("optimizer", "optimizer+param"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if offload == "optimizer+param":
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": "auto" if mixed_precision == "auto" else mixed_precision == "bf16"},
        "fp16": {"enabled": "auto" if mixed_precision == "auto" else mixed_precision == "fp16", "loss_scale": 0,
                 "initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1},
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        # The toolkit passes its own torch AdamW; with offload DeepSpeed would otherwise insist on
        # its compiled CPU Adam.
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


def standard_variants() -> dict[str, dict[str, Any]]:
    """file name -> config for the files shipped in ds_configs/."""
    out = {f"zero{s}.json": deepspeed_config(s) for s in range(4)}
    out["zero1_offload.json"] = deepspeed_config(1, "optimizer")
    out["zero2_offload.json"] = deepspeed_config(2, "optimizer")
    out["zero3_offload.json"] = deepspeed_config(3, "optimizer")
    out["zero3_offload_param.json"] = deepspeed_config(3, "optimizer+param")
    return out


# --- a user's own DeepSpeed JSON (`--deepspeed ds_config.json`), in transformers.Trainer's convention:
# "auto" is filled from the toolkit's settings; a value the file sets wins over the toolkit's defaults
# and must agree with a flag the user gave (`adopt_deepspeed_file`).

def read_user_config(path: str) -> dict[str, Any]:
    """The file as a dict, or one UserError naming the file and what is wrong with it."""
    import json
    from pathlib import Path

    from toolkit.errors import UserError

    p = Path(path)
    if not p.is_file():
        raise UserError(f"--deepspeed {path}: file not found")
    try:
        data = json.loads(p.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        where = f" (line {e.lineno}, column {e.colno}: {e.msg})" if isinstance(e, json.JSONDecodeError) else ""
        raise UserError(f"--deepspeed {path}: not valid JSON{where}") from None
    if not isinstance(data, dict):
        raise UserError(f"--deepspeed {path}: expected a JSON object of DeepSpeed settings, got {type(data).__name__}")
    return data


def _set(value: Any) -> bool:
    return value is not None and value != "auto"


# --- DeepSpeed's spellings, read from DeepSpeed: published files use all of them, and
# accelerate refuses any "auto" left under any of them

@cache
def zero_fields() -> dict[str, str]:
    """Every key of "zero_optimization" that names a field of DeepSpeed's ZeRO model -> that field: its
    name and its alias (`prefetch_bucket_size` and `stage3_prefetch_bucket_size` are one field)."""
    from toolkit.console import quiet

    quiet()
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    return {key: name for name, field in DeepSpeedZeroConfig.model_fields.items() for key in (name, field.alias) if key}


def zero_value(zero: dict[str, Any], field: str, default: Any = None) -> Any:
    """The value of ZeRO `field` under whichever spelling the section uses (DeepSpeed refuses both at once)."""
    fields = zero_fields()
    return next((value for key, value in zero.items() if fields.get(key) == field), default)


@cache
def precision_keys() -> dict[str, tuple[str, ...]]:
    """"bf16"/"fp16" -> the top-level keys DeepSpeed reads that section from, first the one it prefers
    (its `get_bfloat16_config`: `bf16`, else `bfloat16`)."""
    from toolkit.console import quiet

    quiet()
    from deepspeed.runtime.constants import BFLOAT16, BFLOAT16_OLD, FP16

    return {"bf16": (BFLOAT16, BFLOAT16_OLD), "fp16": (FP16,)}


def precision_key(ds: dict[str, Any], dtype: str) -> str | None:
    """The key DeepSpeed reads `dtype`'s section from in `ds`, None where the file has none."""
    return next((key for key in precision_keys()[dtype] if key in ds), None)


def file_settings(ds: dict[str, Any]) -> dict[str, Any]:
    """The toolkit settings a DeepSpeed JSON fixes (its values that are not "auto"), by config key."""
    out: dict[str, Any] = {}
    zero = ds.get("zero_optimization") or {}
    out["zero_stage"] = int(zero["stage"]) if _set(zero.get("stage")) else 0
    param = (zero.get("offload_param") or {}).get("device", "none")
    optim = (zero.get("offload_optimizer") or {}).get("device", "none")
    out["offload"] = ("optimizer+param" if param not in ("none", None)
                      else "optimizer" if optim not in ("none", None) else "none")
    for key, ours in (("train_micro_batch_size_per_gpu", "micro_batch_size"),
                      ("gradient_accumulation_steps", "grad_accum"), ("gradient_clipping", "max_grad_norm")):
        if _set(ds.get(key)):
            out[ours] = ds[key]
    sections = {dtype: precision_key(ds, dtype) for dtype in ("bf16", "fp16")}
    enabled = {dtype: (ds.get(key) or {}).get("enabled", "auto") if key else False for dtype, key in sections.items()}
    if enabled["bf16"] is True:
        out["mixed_precision"] = "bf16"
    elif enabled["fp16"] is True:
        out["mixed_precision"] = "fp16"
    elif enabled["bf16"] is False and enabled["fp16"] is False and any(sections.values()):
        out["mixed_precision"] = "no"
    params = (ds.get("optimizer") or {}).get("params") or {}
    for key, ours in (("lr", "lr"), ("weight_decay", "weight_decay")):
        if _set(params.get(key)):
            out[ours] = params[key]
    return out


def fill_auto(ds: dict[str, Any], *, micro_batch: int, grad_accum: int, data_ranks: int, mixed_precision: str,
              max_grad_norm: float, lr: float, weight_decay: float, warmup_steps: int | None = None,
              total_steps: int | None = None, hidden_size: int | None = None) -> dict[str, Any]:
    """A copy of `ds` with every "auto" the toolkit knows replaced (transformers' `HfTrainerDeepSpeedConfig`
    fills the same keys): batch sizes, precision, clipping, AdamW's and the warm-up schedule's values,
    and the ZeRO buckets from the hidden size (`bucket_sizes`), under every spelling DeepSpeed reads
    (`zero_fields`, `precision_keys`). The schedule's step counts are filled once the run knows them
    (`total_steps`). A `bfloat16` section comes back as `bf16`: accelerate adds a `bf16` section of its
    own where there is none, and DeepSpeed would read that one instead of the file's."""
    import copy

    out = copy.deepcopy(ds)

    def fill(section: dict, key: str, value: Any) -> None:
        if value is not None and section.get(key) == "auto":
            section[key] = value

    fill(out, "train_micro_batch_size_per_gpu", micro_batch)
    fill(out, "gradient_accumulation_steps", grad_accum)
    fill(out, "train_batch_size", micro_batch * grad_accum * data_ranks)
    fill(out, "gradient_clipping", max_grad_norm)
    for dtype, keys in precision_keys().items():
        for key in keys:
            if isinstance(out.get(key), dict):
                fill(out[key], "enabled", mixed_precision == dtype)
    # `bfloat16` only where there is no `bf16`
    older = precision_key(out, "bf16")
    if older not in (None, "bf16"):
        out["bf16"] = out.pop(older)
    params = (out.get("optimizer") or {}).get("params")
    if isinstance(params, dict):
        for key, value in (("lr", lr), ("betas", [0.9, 0.999]), ("eps", 1e-8), ("weight_decay", weight_decay)):
            fill(params, key, value)
    params = (out.get("scheduler") or {}).get("params")
    if isinstance(params, dict):
        # DeepSpeed's warm-up schedules run at least 2 warm-up steps (WarmupLR takes max(2, n)): written as run
        warmup = None if warmup_steps is None or total_steps is None else max(2, min(warmup_steps, total_steps))
        for key, value in (("warmup_min_lr", 0.0), ("warmup_max_lr", lr), ("warmup_num_steps", warmup),
                           ("total_num_steps", total_steps), ("cos_min_ratio", 0.0)):
            fill(params, key, value)
    zero = out.get("zero_optimization")
    if isinstance(zero, dict) and hidden_size:
        fields = zero_fields()
        buckets = {fields[key]: value for key, value in bucket_sizes(hidden_size).items()}
        buckets["allgather_bucket_size"] = buckets["reduce_bucket_size"]
        for key in zero:
            fill(zero, key, buckets.get(fields.get(key)))
    return out


def deepspeed_accelerator() -> tuple[str, bool]:
    """(DeepSpeed's accelerator name, whether it runs fp16): what decides which of its compiled ops it
    builds and whether its engine accepts fp16 (`DeepSpeedEngine._do_sanity_check`). "cpu" on a
    machine without a GPU."""
    from toolkit.console import quiet

    quiet()
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    return accelerator.device_name(), bool(accelerator.is_fp16_supported())


def compiles_cpu_adam(ds: dict[str, Any]) -> bool:
    """Whether DeepSpeed would build the file's optimizer as its own compiled Adam: an "Adam"/"AdamW"
    without "torch_adam" is DeepSpeedCPUAdam under optimizer offload and FusedAdam otherwise
    (`DeepSpeedEngine.get_optimizer_configuration`), and on a CPU machine both are C++ extensions
    compiled at first use (minutes on a few cores). A file
    that asks for DeepSpeed's CPU optimizer by name ("zero_force_ds_cpu_optimizer": true) keeps it."""
    optimizer = ds.get("optimizer") or {}
    params = optimizer.get("params") or {}
    return (str(optimizer.get("type", "")).lower() in ("adam", "adamw") and "torch_adam" not in params
            and ds.get("zero_force_ds_cpu_optimizer") is not True)


def with_torch_adam(ds: dict[str, Any]) -> dict[str, Any]:
    """A copy of `ds` whose Adam/AdamW is torch's (`"torch_adam": true`): the same update, no C++ build.
    Used on a CPU machine only, where the toolkit says so in one line (`torch_adam_note`)."""
    import copy

    out = copy.deepcopy(ds)
    out["optimizer"].setdefault("params", {})["torch_adam"] = True
    return out


def torch_adam_note(path: str, ds: dict[str, Any]) -> str:
    return (f"optimizer: the {ds['optimizer']['type']} of --deepspeed {path} runs as torch's on this CPU (DeepSpeed's "
            "own is compiled at first use, minutes), the same update; \"torch_adam\": false in its params keeps "
            "DeepSpeed's")


def fp16_problem(path: str, from_file: bool, device: str) -> str:
    """fp16 where DeepSpeed's accelerator has none: its engine would stop with a traceback after the
    model is loaded."""
    what = (f"--deepspeed {path} sets fp16.enabled true" if from_file
            else f"--mixed-precision fp16 with --deepspeed {path}")
    fix = ("set fp16.enabled to \"auto\" (fp32 here, bf16 on a GPU that has it) or false" if from_file
           else "use --mixed-precision no or bf16")
    return f"{what}, and DeepSpeed has no fp16 on this machine (accelerator: {device}); {fix}, or run on a GPU"


def zero3_first_steps_note(ds: dict[str, Any]) -> str | None:
    """The one line a ZeRO-3 run prints about its slow step 2 (benchmarks/zero3_first_steps.md).
    At the end of step 1 DeepSpeed has recorded the order its modules ran in; in step 2, for each module
    it releases, it walks that order ahead until `stage3_max_reuse_distance` parameters (DeepSpeed's
    default and the toolkit's 1e9: all of a model under 1B) to keep what is used again soon, and caches
    the answer (`PartitionedParameterCoordinator.__params_to_release`): time that grows with the square
    of the module calls a step makes (LoRA adds its adapters). Distance 0 skips the walk but gathers
    every parameter again in backward, so the toolkit keeps DeepSpeed's default and says it here."""
    zero = ds.get("zero_optimization") or {}
    distance = zero_value(zero, "max_reuse_distance", 1e9)
    if int(zero.get("stage", 0)) != 3 or not distance:
        return None
    return (f"zero-3: step 2 runs long once: DeepSpeed maps, over the module order step 1 recorded, which "
            f"parameters are used again within stage3_max_reuse_distance {int(distance):,} (about 40 s of CPU for "
            "SmolLM2-135M with LoRA on 2 ranks, where later steps take 5 s); docs/parallelism.md#zero-3s-first-steps")


def user_config_problems(ds: dict[str, Any], path: str) -> list[str]:
    """What DeepSpeed itself rejects in the file (unknown keys, bad values), one line each, checked
    before any data or weights are read: its own config parser on a copy with batch sizes of one rank."""
    from toolkit.console import quiet

    quiet()
    from pydantic import ValidationError

    from deepspeed.runtime.config import DeepSpeedConfig

    probe = fill_auto(ds, micro_batch=1, grad_accum=1, data_ranks=1, mixed_precision="no", max_grad_norm=1.0,
                      lr=1e-4, weight_decay=0.0, warmup_steps=0, total_steps=1, hidden_size=8)
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size"):
        # their product is checked against the launched world later, by DeepSpeed
        probe.pop(key, None)
    probe["train_micro_batch_size_per_gpu"] = 1
    scheduler = (ds.get("scheduler") or {}).get("type")
    if scheduler is not None:
        from deepspeed.runtime.lr_schedules import VALID_LR_SCHEDULES

        if scheduler not in VALID_LR_SCHEDULES:
            return [f"--deepspeed {path}: scheduler.type {scheduler!r} is not one of DeepSpeed's schedules "
                    f"({', '.join(VALID_LR_SCHEDULES)})"]
    try:
        DeepSpeedConfig(probe)
    except ValidationError as e:
        section = SECTIONS.get(e.title, e.title)
        # as the file spells it
        if section == "bf16":
            section = precision_key(ds, "bf16") or section
        return [f"--deepspeed {path}: {'.'.join([section, *map(str, err['loc'])])}: {err['msg']}" for err in e.errors()]
    except (ValueError, TypeError, KeyError, AssertionError) as e:
        return [f"--deepspeed {path}: DeepSpeed rejects it: {' '.join(str(e).split())}"]
    return []


# pydantic model -> the JSON key it reads (deepspeed/runtime/*config.py)
SECTIONS = {"DeepSpeedZeroConfig": "zero_optimization", "DeepSpeedBF16Config": "bf16", "DeepSpeedFP16Config": "fp16",
            "DeepSpeedZeroOffloadOptimizerConfig": "zero_optimization.offload_optimizer",
            "DeepSpeedZeroOffloadParamConfig": "zero_optimization.offload_param",
            "DeepSpeedActivationCheckpointingConfig": "activation_checkpointing",
            "DeepSpeedFlopsProfilerConfig": "flops_profiler", "DeepSpeedMonitorConfig": "monitor",
            "CommsConfig": "comms_logger", "DeepSpeedAIOConfig": "aio"}


# a --deepspeed file's settings -> the DeepSpeed key that sets them (for messages)
DS_KEYS = {"zero_stage": "zero_optimization.stage", "offload": "zero_optimization.offload_optimizer/offload_param",
           "micro_batch_size": "train_micro_batch_size_per_gpu", "grad_accum": "gradient_accumulation_steps",
           "max_grad_norm": "gradient_clipping", "mixed_precision": "bf16/fp16 enabled", "lr": "optimizer.params.lr",
           "weight_decay": "optimizer.params.weight_decay"}


def adopt_deepspeed_file(values: MutableMapping[str, Any], given: set[str], notes: list[str],
                         coerce: Callable[[str, Any, str], Any]) -> list[str]:
    """`--deepspeed FILE`: DeepSpeed's own checks on the file first; then every setting it fixes is
    adopted where no flag set it, and a flag that disagrees is refused (one line each). `values`, `given`:
    as `toolkit.layout.launcher.adopt_launcher`'s; `coerce(key, value, origin)`: a value of the file as the
    key's type, or a UserError (`toolkit.config.parse._coerce`)."""
    path = values["deepspeed"]
    if not path:
        return []
    from toolkit.errors import UserError
    from toolkit.layout.launcher import LAUNCHER_STAGE, NAMED_BY

    try:
        ds = read_user_config(path)
    except UserError as e:
        return [str(e)]
    problems = user_config_problems(ds, path)
    if problems:
        return problems
    if values["fsdp"]:
        return [f"--deepspeed {path} with --fsdp: both shard the model; choose one"]
    if values["strategy"] == "auto":
        return [f"--deepspeed {path} with --strategy auto: the planner picks the sharding itself; drop one of them"]
    settings = file_settings(ds)
    launcher = values.get(LAUNCHER_STAGE)
    if launcher and launcher[0] != settings["zero_stage"]:
        return [f"{launcher[1]} says ZeRO-{launcher[0]}, --deepspeed {path} says stage {settings['zero_stage']}; "
                "drop one of them"]
    adopted = []
    for key, value in settings.items():
        value = coerce(key, value, f"--deepspeed {path} ({DS_KEYS[key]})")
        current = values[key]
        if key in given or (key == "zero_stage" and current is not None):
            if current != value:
                problems.append(f"--deepspeed {path} sets {DS_KEYS[key]} to {value}, --{key.replace('_', '-')} "
                                f"{current} disagrees; drop one of them")
            continue
        if current != value:
            adopted.append(f"{key.replace('_', ' ')} {value}")
        values[key] = value
    ranks = int(os.environ.get("WORLD_SIZE", "1"))
    want = values["micro_batch_size"] * values["grad_accum"] * ranks
    if isinstance(ds.get("train_batch_size"), int) and ds["train_batch_size"] != want:
        problems.append(f"--deepspeed {path}: train_batch_size {ds['train_batch_size']} is not micro batch "
                        f"{values['micro_batch_size']} x accumulation {values['grad_accum']} x {ranks} ranks = {want}; "
                        "set it to \"auto\" or make them agree")
    device, runs_fp16 = deepspeed_accelerator()
    if values["mixed_precision"] == "fp16" and not runs_fp16:
        problems.append(fp16_problem(path, settings.get("mixed_precision") == "fp16", device))
    if not problems:
        named_by = values.get(NAMED_BY)
        where = f"DeepSpeed config {path}, named by {named_by}" if named_by else f"--deepspeed {path}"
        also = [a for a in adopted if not a.startswith("zero")]
        notes.append(f"layout: ZeRO-{values['zero_stage']} from {where}" + (f"; also from the file: {', '.join(also)}"
                                                                            if also else ""))
        # swapped in `parallel.build.run_deepspeed_config`
        if device == "cpu" and compiles_cpu_adam(ds):
            notes.append(torch_adam_note(path, ds))
    return problems
