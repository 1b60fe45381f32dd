"""After the final save: reload the folder in a fresh process with plain transformers/peft and
check it gives the trained model's loss on a fixed batch. Sharded saves (ZeRO-3, FSDP) are where
peers have shipped empty or stale weights; this turns such a save into a loud failure."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from toolkit.data import collate
from toolkit.parallel import any_rank
from toolkit.train.evaluate import eval_loss


def tolerance(precision: str) -> float:
    """Relative: fp32 reproduces to rounding; bf16/fp16 autocast vs an fp32 reload does not."""
    return 1e-4 if precision == "no" else 3e-2


def verify_saved(strategy, model, tokenizer, rows: list[dict], final_dir: Path, base: str,
                 precision: str, quantized: bool, log=print) -> dict:
    accelerator = strategy.accelerator
    batch = rows[:4]
    trained = eval_loss(strategy, model, batch, batch_size=len(batch), pad_id=tokenizer.pad_token_id)
    result = {"trained_loss": trained}
    if accelerator.is_main_process:
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(batch, f)
        cmd = [sys.executable, "-m", "toolkit", "verify", "--folder", str(final_dir), "--base", base,
               "--batch", f.name, "--pad-id", str(tokenizer.pad_token_id)] + (["--load-4bit"] if quantized else [])
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "")}
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(k, None)  # a plain single process, as a user loading the folder would have
        p = subprocess.run(cmd, capture_output=True, text=True, env=env)
        os.unlink(f.name)
        if p.returncode != 0:
            result["error"] = p.stderr.strip().splitlines()[-1] if p.stderr.strip() else f"exit {p.returncode}"
        else:
            result["reloaded_loss"] = json.loads(p.stdout.strip().splitlines()[-1])["loss"]
            rel = abs(result["reloaded_loss"] - trained) / max(abs(trained), 1e-12)
            result["relative_diff"] = rel
            result["ok"] = rel <= tolerance(precision)
    result["ok"] = any_rank(accelerator, bool(result.get("ok")))
    if accelerator.is_main_process:
        (final_dir.parent / "integrity.json").write_text(json.dumps(result, indent=2))
    if not result["ok"]:
        raise SystemExit(f"integrity check FAILED: {final_dir} reloaded with plain transformers/peft gives loss "
                         f"{result.get('reloaded_loss', result.get('error'))} but the trained model gives {trained:.6f}")
    log(f"integrity: {final_dir} reloads with plain transformers/peft; loss {result.get('reloaded_loss', trained):.6f} "
        f"vs trained {trained:.6f}")
    return result


def reload_loss(folder: str, base: str, batch_file: str, pad_id: int, load_4bit: bool) -> float:
    """What the fresh process runs: plain from_pretrained, nothing from the training run."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from toolkit.train.loss import count_targets, token_loss_sum

    kwargs: dict = {"dtype": torch.float32}
    if load_4bit:
        kwargs["quantization_config"] = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                           bnb_4bit_use_double_quant=True,
                                                           bnb_4bit_compute_dtype=torch.float32)
    if (Path(folder) / "adapter_config.json").is_file():
        from peft import PeftModel

        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, **kwargs), folder)
    else:
        model = AutoModelForCausalLM.from_pretrained(folder, **kwargs)
    model.eval()
    batch = collate(json.loads(Path(batch_file).read_text()), pad_id)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return (token_loss_sum(logits, batch["labels"]) / count_targets(batch["labels"])).item()
