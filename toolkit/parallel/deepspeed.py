"""DeepSpeed JSON and FSDP plugin built from the run's config.

`deepspeed_config` is a pure function: the files in `ds_configs/` are its output for the standard
variants (`scripts/gen_ds_configs.py`), and each run writes the one it used to
`OUTPUT_DIR/ds_config.json`. Values accelerate fills in from the run (batch sizes, accumulation,
clipping) stay `"auto"`, as in accelerate's own DeepSpeed examples.
"""

from __future__ import annotations

from typing import Any

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
        "fp16": {"enabled": "auto" if mixed_precision == "auto" else mixed_precision == "fp16", "loss_scale": 0, "initial_scale_power": 16,
                 "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1},
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
