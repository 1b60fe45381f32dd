"""What the command-line process leaves unimported: packages other libraries import on the chance they
are needed, which this run's layout never uses.

- peft imports bitsandbytes when peft itself is imported (`peft/helpers.py`: `try: import bitsandbytes`),
  and bitsandbytes pulls in torch._inductor: 1.3 s of a LoRA run's 9 s start on 2 cores, 3.2 s of
  peft's 17 s import on the H100 machine (`-X importtime`, 2026-11-25). Only QLoRA uses it.
- accelerate imports DeepSpeed to unwrap any model when it is installed
  (`accelerate.utils.extract_model_from_parallel`): 0.4 s here, 5.6 s standalone on the H100 machine.
  Only a DeepSpeed layout uses it.
- transformers imports scipy.optimize with its model code (`loss.loss_for_object_detection`, for
  DETR's matching): 0.28 s of the import on 2 cores (`-X importtime`, 2026-11-25). No causal LM uses it.
- accelerate imports boto3 for its SageMaker launcher config when it is installed
  (`accelerate/commands/config/sagemaker.py`, reached from `accelerate.utils.other`): 0.28 s of a tiny
  run's start on 2 cores (`-X importtime`, 2026-11-25). Training never uses it; mlflow's and wandb's
  S3 artifact stores may, so it stays importable when either is asked for.

A package set to None in `sys.modules` fails to import and `importlib.util.find_spec` answers None for
it, which is how peft, transformers and accelerate ask whether it is installed, so each takes its "not
installed" path. Only a process that runs one layout may do this: `finetune.py` on the command line
(a library caller, the tests or `tests/layouts.py`, may run a DeepSpeed or QLoRA run next).
"""

from __future__ import annotations

import sys

from toolkit.config import Config
from toolkit.tracker_spec import requested


def unused_packages(cfg: Config) -> list[str]:
    """Installed packages this run will not import itself; `--strategy auto` may still choose DeepSpeed."""
    par, out = cfg.parallel, ["scipy"]
    if cfg.model.method != "qlora":
        out.append("bitsandbytes")
    if par.zero_stage is None and not par.deepspeed and par.strategy != "auto":
        out.append("deepspeed")
    if not {"mlflow", "wandb"} & set(requested(cfg.output.report_to)):
        out.append("boto3")
    return out


def leave_unimported(cfg: Config) -> None:
    for name in unused_packages(cfg):
        if name not in sys.modules:
            sys.modules[name] = None  # type: ignore[assignment]
