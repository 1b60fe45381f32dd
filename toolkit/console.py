"""A quiet console: the toolkit's own lines and the progress bar, not third-party notices the user
cannot act on. `--debug` (TOOLKIT_DEBUG=1) leaves everything as the libraries print it.

Each entry below names what prints it and why it is noise. Python warnings are ignored through
`warnings` filters; library lines printed or logged straight to stdout/stderr are dropped by a thin
line filter around `sys.stdout`/`sys.stderr`, installed before those libraries are imported (their
log handlers keep the stream object they found at import); transformers' per-checkpoint progress
bars are turned off with its own switch.
"""

from __future__ import annotations

import re
import sys
import warnings
from typing import TextIO

from toolkit.errors import debug

WARNINGS: tuple[tuple[str, type[Warning]], ...] = (
    # transformers 5 deprecates the property that peft and accelerate still read on every run, and
    # the older name of the method checkpointing is enabled by (`toolkit.parallel.parallelize.apply_checkpointing`)
    (r"`is_gradient_checkpointing` is deprecated", FutureWarning),
    (r"`gradient_checkpointing_enable` is deprecated", FutureWarning),
    # torch 2.13 renamed the collectives DeepSpeed 0.19 calls on every ZeRO step
    (r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated", FutureWarning),
    # peft 0.21, LoRA on a transformers-5 MoE whose experts fuse gate and up (Qwen-MoE, Mixtral): peft adds
    # the rank pattern itself (twice the rank on gate_up_proj, a target *parameter*) and then checks it
    # against the targeted *modules* only, so it says the pattern was ignored; the adapter does hold that
    # rank (tests/test_lora_targets.py checks it). Only that exact pattern: one a user wrote still warns.
    (r"The following (rank|alpha)_pattern keys did not match any targeted module and were ignored: "
     + re.escape(repr([r".*\.gate_up_proj"])) + r"\.?$", RuntimeWarning),
)

LINES: tuple[str, ...] = (
    # DeepSpeed, per rank, whenever it is imported (accelerate imports it to unwrap any model)
    r"Setting accelerator to CPU\. If you have GPU",
    r"Setting ds_accelerator to",
    # DeepSpeed's shared-memory collectives on CPU, per rank
    r"DeepSpeed \S+ built successfully",
    # DeepSpeed's warm-up schedules (a --deepspeed file's "scheduler"), once, when built: their lr
    # before the first step is warmup_min_lr, which is what they then use
    r"Attempting to get learning rate from scheduler before it has started",
    # bitsandbytes on import (peft imports it), with or without QLoRA
    r"Failed to load CPU gemm_4bit_forward from kernels-community",
)
_LINES = re.compile("|".join(f"(?:{p})" for p in LINES), re.MULTILINE)


class LineFilter:
    """Wraps a text stream and drops writes that match `LINES`. A write is one print argument or one
    log record, so matching per write keeps progress bars (written with '\\r') untouched; the newline
    that print() writes separately after a dropped argument goes with it."""

    def __init__(self, stream: TextIO):
        self._stream = stream
        self._dropped = False

    def write(self, text: str) -> int:
        if self._dropped and text == "\n":
            self._dropped = False
            return len(text)
        self._dropped = bool(_LINES.search(text))
        return len(text) if self._dropped else self._stream.write(text)

    # flush, fileno, isatty, encoding, buffer ...
    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def quiet() -> None:
    """Install the filters for this process (idempotent); nothing under --debug."""
    if debug():
        return
    for pattern, category in WARNINGS:
        warnings.filterwarnings("ignore", message=pattern, category=category)
    if not isinstance(sys.stdout, LineFilter):
        sys.stdout = LineFilter(sys.stdout)
    if not isinstance(sys.stderr, LineFilter):
        sys.stderr = LineFilter(sys.stderr)
    from transformers.utils import logging as hf_logging

    # a bar per checkpoint load and save (downloads keep theirs)
    hf_logging.disable_progress_bar()
