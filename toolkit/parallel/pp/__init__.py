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

from toolkit.errors import UserError
from toolkit.parallel.pp.naive import NaivePipeline, bubble_fraction
from toolkit.parallel.pp.split import decoder_parts, param_costs, time_costs
from toolkit.planner.stages import balance
from toolkit.parallel.pp.stages import PipelineLayout, StagePipeline, make_pipeline_layout

__all__ = ["NaivePipeline", "StagePipeline", "PipelineLayout", "bubble_fraction", "balance", "decoder_parts",
           "pipeline_problems", "pipeline_devices", "make_pipeline_layout", "time_costs", "param_costs"]


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


def pipeline_devices(n: int, given: str = "") -> list[torch.device]:
    """The naive pipeline's `n` stage devices: `given` (--pp-devices), else the first n GPUs, else cpu for all."""
    if given:
        names = [x.strip() for x in given.split(",") if x.strip()]
        try:
            devices = [torch.device(x) for x in names]
        except RuntimeError as e:
            raise UserError(f"--pp-devices {given}: {e}") from None
        gpus = torch.cuda.device_count()
        bad = [str(d) for d in devices if d.type == "cuda" and (d.index or 0) >= gpus]
        if bad:
            raise UserError(f"--pp-devices {given}: {', '.join(bad)} not present "
                            f"({gpus} GPU{'s' if gpus != 1 else ''} visible)")
        return devices
    if not torch.cuda.is_available():
        return [torch.device("cpu")] * n
    if torch.cuda.device_count() < n:
        raise UserError(f"--pp {n} in one process needs {n} GPUs, {torch.cuda.device_count()} visible; "
                        "pass --pp-devices (a device may repeat) or launch one process per stage")
    return [torch.device("cuda", i) for i in range(n)]
