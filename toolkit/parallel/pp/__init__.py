"""Pipeline parallelism, one flag (`--pp N`) for two runtimes:

- one process: the naive pipeline (`naive.NaivePipeline`) puts N stages on `--pp-devices`
  (default cuda:0..N-1; `cpu` for every stage on a machine without GPUs);
- several processes: each rank runs one stage on torch.distributed.pipelining
  (`stages.StagePipeline`), with data parallelism across pipeline groups (world = N x dp).

Both present the same interface to the training loop: `train_step(batch, scale)` (forward and
backward of m micro-batches, returns the summed token loss), `finish_grads()`,
`clip_grad_norm(max)`, `loss_sum(batch)` for eval and `gather()` for the HF model to save.
"""

from __future__ import annotations

import torch

from toolkit.layout.flags import ParallelConfig
from toolkit.errors import UserError
from toolkit.parallel.pp.naive import NaivePipeline, bubble_fraction
from toolkit.parallel.pp.split import balance, decoder_parts, param_costs, time_costs
from toolkit.parallel.pp.stages import PipelineLayout, StagePipeline, make_pipeline_layout

__all__ = ["NaivePipeline", "StagePipeline", "PipelineLayout", "bubble_fraction", "balance", "decoder_parts",
           "pipeline_problems", "pipeline_devices", "build_pipeline", "make_pipeline_layout"]


def pipeline_problems(model_config, trust_remote_code: bool = False) -> list[str]:
    """Whether the model can be cut into stages by its config's `base_model_pp_plan` (`split.decoder_parts`),
    found on a meta-device copy of the architecture (no weights are read). Stages against blocks, the
    world size and the router loss: `toolkit.layout.rules.model_problems`."""
    from toolkit.parallel.meta import meta_model

    try:
        decoder_parts(meta_model(model_config, trust_remote_code))
    except UserError as e:
        return [str(e)]
    return []


def pipeline_devices(par: ParallelConfig) -> list[torch.device]:
    """The naive pipeline's stage devices: --pp-devices, else the first N GPUs, else cpu for all."""
    n = par.pp
    if par.pp_devices:
        names = [x.strip() for x in par.pp_devices.split(",") if x.strip()]
        try:
            devices = [torch.device(x) for x in names]
        except RuntimeError as e:
            raise UserError(f"--pp-devices {par.pp_devices}: {e}") from None
        gpus = torch.cuda.device_count()
        bad = [str(d) for d in devices if d.type == "cuda" and (d.index or 0) >= gpus]
        if bad:
            raise UserError(f"--pp-devices {par.pp_devices}: {', '.join(bad)} not present "
                            f"({gpus} GPU{'s' if gpus != 1 else ''} visible)")
        return devices
    if not torch.cuda.is_available():
        return [torch.device("cpu")] * n
    if torch.cuda.device_count() < n:
        raise UserError(f"--pp {n} in one process needs {n} GPUs, {torch.cuda.device_count()} visible; "
                        "pass --pp-devices (a device may repeat) or launch one process per stage")
    return [torch.device("cuda", i) for i in range(n)]


def build_pipeline(par: ParallelConfig, accelerator, layout: PipelineLayout | None, model,
                   sample_shape: tuple[int, int], pad_id: int, loss_fn, shard=None, experts=()):
    """The naive pipeline in one process (no layout), this rank's stage with several (FSDP2-sharded
    as `shard` says, a `toolkit.parallel.parallelize.FsdpSpec`; `experts`: expert parallel's holders)."""
    from toolkit.parallel.fsdp import half_dtype

    compute = half_dtype(accelerator.mixed_precision)  # autocast's dtype, or the FSDP2 policy's
    if layout is None:
        return NaivePipeline(model, pipeline_devices(par), par.pp_microbatches, par.pp_balance,
                             (sample_shape[0] // par.pp_microbatches, sample_shape[1]), compute, loss_fn)
    import torch.distributed as dist

    parts = decoder_parts(model)
    if par.pp_balance == "time":  # measured once, on rank 0, so every rank cuts the model the same way
        costs = [time_costs(parts, sample_shape[0] // par.pp_microbatches, sample_shape[1], accelerator.device)
                 if accelerator.is_main_process else None]
        dist.broadcast_object_list(costs, src=0)
        blocks, first, last = costs[0]
    else:
        blocks, first, last = param_costs(parts)
    sizes = balance(blocks, par.pp, first, last)
    return StagePipeline(model, layout, sizes, par.pp_microbatches, par.pp_schedule, accelerator.device,
                         pad_id, compute, loss_fn, shard, experts)
