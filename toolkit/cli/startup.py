"""What the command-line process does before anything heavy: the run's settings checked (`settle`), and the
packages it leaves unimported: packages other libraries import on the chance they are needed, which this
run's layout never uses.

- peft imports bitsandbytes when peft itself is imported (`peft/helpers.py`: `try: import bitsandbytes`),
  and bitsandbytes pulls in torch._inductor: seconds of a run's start (`-X importtime`; the figures are in
  benchmarks/startup.md). Only QLoRA uses it.
- accelerate imports DeepSpeed to unwrap any model when it is installed
  (`accelerate.utils.extract_model_from_parallel`). Only a DeepSpeed layout uses it.
- transformers imports scipy.optimize with its model code (`loss.loss_for_object_detection`, for
  DETR's matching). No causal LM uses it.
- accelerate imports boto3 for its SageMaker launcher config when it is installed
  (`accelerate/commands/config/sagemaker.py`, reached from `accelerate.utils.other`). Training never uses
  it; mlflow's and wandb's
  S3 artifact stores may, so it stays importable when either is asked for.

A package set to None in `sys.modules` fails to import and `importlib.util.find_spec` answers None for
it, which is how peft, transformers and accelerate ask whether it is installed, so each takes its "not
installed" path. Only a process that runs one layout may do this: `finetune.py` on the command line
(a library caller, the tests or `tests/layouts.py`, may run a DeepSpeed or QLoRA run next).

A package that another installed distribution requires is never left out: that distribution may import
it unconditionally when something imports it, and the libraries above import optional packages
whenever they are installed. transformers 4.47 to 5.20 import scikit-learn at module level when it is
installed, and scikit-learn imports scipy: with scipy left out, no run started (on a stock CUDA
image). Requirements are read from the installed metadata (~0.05 s on 2 cores for 109
distributions); extras do not count (they are not installed by asking for the package).
"""

from __future__ import annotations

import re
import sys
from importlib import metadata

from toolkit.layout.flags import ParallelConfig
from toolkit.config.trackers import requested


def unused_packages(method: str, parallel: ParallelConfig, report_to: str) -> list[str]:
    """Installed packages a run of this `--method`, layout and `--report-to` will not import itself;
    `--strategy auto` may still choose DeepSpeed."""
    out = ["scipy"]
    if method != "qlora":
        out.append("bitsandbytes")
    if parallel.zero_stage is None and not parallel.deepspeed and parallel.strategy != "auto":
        out.append("deepspeed")
    if not {"mlflow", "wandb"} & set(requested(report_to)):
        out.append("boto3")
    return out


def required_elsewhere(names: list[str]) -> set[str]:
    """Those of `names` (import names that are also their distributions' names) that an installed
    distribution other than this toolkit requires, outside its extras and on this platform."""
    from packaging.requirements import Requirement

    first = re.compile(rf"^({'|'.join(map(re.escape, names))})(?![A-Za-z0-9_.-])", re.IGNORECASE)
    out: set[str] = set()
    for dist in metadata.distributions():
        if (dist.metadata["Name"] or "").lower() == "toolkit":
            continue
        for line in dist.requires or ():
            # parsed only where the name matches: most lines never are
            if first.match(line):
                req = Requirement(line)
                if req.marker is None or req.marker.evaluate({"extra": ""}):
                    out.add(req.name.lower())
    return out


def leave_unimported(method: str, parallel: ParallelConfig, report_to: str) -> None:
    names = [n for n in unused_packages(method, parallel, report_to) if n not in sys.modules]
    kept = required_elsewhere(names) if names else set()
    for name in names:
        if name not in kept:
            sys.modules[name] = None  # type: ignore[assignment]


def settle(argv: list[str] | None):
    """The run's `Config`, every check that needs no model done before torch is imported: the flags and the
    YAML, the data's columns (read from the files' first bytes by the full read's rules), a --push-to-hub
    that could not upload (offline, no token: refused now, not after training). Under --nproc-per-node N
    this process starts the ranks and exits with their code; the command line's own process leaves the
    packages this layout never uses unimported; third-party notices are quieted (shown with --debug)."""
    import os

    from toolkit.config import parse_config
    from toolkit.console import quiet
    from toolkit.data.peek import check_data
    from toolkit.parallel.launch import started_here

    if "--debug" in (sys.argv[1:] if argv is None else argv):
        os.environ["TOOLKIT_DEBUG"] = "1"
    cfg = parse_config(argv)
    check_data(cfg.data_settings)
    if cfg.output.push_to_hub:
        from toolkit.config.hub import check_push

        check_push(cfg.output.push_to_hub)
    if argv is None and started_here(cfg.parallel.nproc_per_node):
        from toolkit.parallel.launch import run_ranks

        sys.exit(run_ranks(cfg.parallel.nproc_per_node, sys.argv[0], sys.argv[1:]))
    if argv is None:
        leave_unimported(cfg.model.method, cfg.parallel, cfg.output.report_to)
    quiet()
    return cfg


def resolve_images(cfg, model_path: str):
    """`cfg` with --images made on or off, before the model or the data is read: on where the model is image-text
    (`toolkit.model.vision.image_text`) and the data holds images (`toolkit.data.peek.data_images`), or where the
    model trains only as an image-text one; images given to a text-only model are one line (unless off)."""
    from transformers import AutoConfig

    from toolkit.data.peek import data_images
    from toolkit.errors import UserError
    from toolkit.model.vision import end_to_end_problem, image_text, only_image_text, row_bound, vision_problem

    if cfg.data.images == "off":
        return cfg
    try:
        config = AutoConfig.from_pretrained(model_path, trust_remote_code=cfg.model.trust_remote_code)
    except ValueError as e:
        if "trust_remote_code" in str(e):
            raise UserError(f"--model {model_path} needs its own code to run; pass --trust-remote-code if you trust "
                            "its author") from None
        raise
    # a text model's data is only peeked (no full read on every run): what it misses, tokenizing refuses
    pictured = cfg.data.images == "on" or data_images(cfg.data_settings, full=image_text(config))
    on = pictured or only_image_text(config)
    problem = on and vision_problem(config)
    if problem:
        raise UserError(f"--model {cfg.model.model}: {problem}" + ("; pass --images off to train on the text alone"
                                                                   if not only_image_text(config) else ""))
    if pictured and not image_text(config):
        what = "a text-only model (no vision_config in its config.json)" \
            if getattr(config, "vision_config", None) is None else \
            f"no image-text model (model type {config.model_type} is no class of AutoModelForImageTextToText)"
        raise UserError(f"--dataset {cfg.data.dataset} holds images, but --model {cfg.model.model} is {what}; train "
                        "an image-text model, or pass --images off to train on the text alone")
    why = on and image_text(config) and end_to_end_problem(config)
    # GRPO's left-padded rows and KTO's KL rows take their per-token inputs made of their ids
    # (`toolkit.data.images.of_ids`: Gemma 3's token_type_ids, checked to be each token's modality when the data is
    # read, `refuse_prefix_types`; Mllama's cross_attention_mask); other per-row inputs would need them laid out again
    of_ids = why and set(row_bound(config)[1]) <= {"token_type_ids", "cross_attention_mask"}
    if why and cfg.train.objective in ("grpo", "kto") and not of_ids:
        what = "GRPO's sampling does" if cfg.train.objective == "grpo" else "KTO's KL sequences do"
        raise UserError(f"--objective {cfg.train.objective}: {why}, which {what} not lay out yet; it reads "
                        "images on models that place them at their tokens in order (LLaVA, Idefics3/SmolVLM, the "
                        "Qwen-VL family), on Gemma 3 and on Mllama")
    for flag, on_ in (("--padding-free", cfg.data.padding_free), ("--packing", cfg.data.packing)):
        if why and on_:
            raise UserError(f"{flag}: {why}, which a row of examples laid end to end does not keep apart; leave "
                            "it out (this model's image batches are padded)")
    if on and cfg.data.packing and cfg.data.padding_free is False:
        raise UserError("--packing with --no-padding-free: packed image examples are laid end to end, padding-free; "
                        "leave one of them out")
    if why:
        # padded whatever kernel --attn names (a padded batch's mask sends it to SDPA)
        return cfg.replace(images="on", padding_free=False)
    return cfg.replace(images="on" if on else "off")
