"""Saving standard Hugging Face folders: a full model or a peft adapter, tokenizer included.

Written to `<name>.tmp` and renamed into place only when complete, so a crash mid-save never
leaves a half-written folder under the final name.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def save_final(accelerator, model, tokenizer, path: Path) -> None:
    """Every rank must call this: sharded strategies gather the state dict collectively."""
    layout = getattr(accelerator, "tp_layout", None)
    if layout is not None:  # gather the TP shards back into the full tensors a non-TP run would save
        from toolkit.parallel.tp import gather_state_dict

        state = gather_state_dict(accelerator.unwrap_model(model), layout.tp_group)
    else:
        state = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        state = {k: v.contiguous() for k, v in state.items()}
        tmp = path.with_name(path.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        unwrapped = accelerator.unwrap_model(model)
        unwrapped.save_pretrained(tmp, state_dict=state, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    accelerator.wait_for_everyone()
