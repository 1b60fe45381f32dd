"""TRL's SFTTrainer as its users run it on an alpaca file: the yardstick of the GPU user path
(benchmarks/gpu/gpu_user.py runs it beside finetune.py).

    python -m benchmarks.gpu.sft_trainer_user --model DIR --dataset alpaca.json --output-dir OUT [--method full]
        [--best [--no-compile]] [--seq-len 2048] [--micro-batch-size 4] [--max-steps 30]

The records become TRL's prompt-completion form (the completion trained, as the toolkit trains the
answer), packed to --seq-len (`packing=True`: TRL's best-fit decreasing, padding-free rows), bf16 on a
GPU, LoRA r 16 / alpha 32 on all linear layers or a full finetune, the toolkit's learning rates and
schedule, a log every step. `--best` adds TRL's documented speed flags: `torch_compile=True`,
`padding_free=True`, `use_liger_kernel=True` where liger_kernel imports, the attention TRL's docs recommend
with padding-free (FlashAttention 2, `attn_implementation="flash_attention_2"`) where flash_attn imports, and
turns off the gradient checkpointing SFTConfig turns on by default (TRL at its real best; the Llama-
3.2-1B shape at 2048 x 4 fits an H100/H200 without it: the toolkit's run peaked at 18 GiB); what it could not
use is said in the JSON. Without --best, TRL's defaults (checkpointing on).
A chat file whose user turns hold image parts (gpu_user.py's `vlm` case) is read as TRL's vision datasets are
written: prompt-completion conversations with `{"type": "image"}` placeholders and an `images` column (the files,
decoded by `datasets.Image`), the completion trained; the model loads as `AutoModelForImageTextToText` with
`AutoProcessor` (without torchvision, Qwen2-VL's processor cannot build its video processor: it is then built
without it, `toolkit.model.vision.without_video`, as the toolkit does, and the JSON says so); LoRA on the language
model's linear layers alone, as the toolkit's default. TRL refuses packing and padding-free on vision datasets:
padded batches, in the default and in `--best`.
Tokens/s come from TRL's own log (`num_tokens`, cumulative) over the wall time between steps (a callback
notes each step's end): the steps after WARMUP, as the user part counts the toolkit's. Writes
OUT/sft_metrics.json: tokens_per_s, step_time_cv, seconds_to_step1, warmup_s (the first WARMUP steps,
compile included), wall_s, peak_gib, padding_fraction (of the batches' slots, where they carry an attention mask),
and what ran.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from pathlib import Path

WARMUP = 3  # as benchmarks/gpu/gpu_user.py


def records(path: str, limit: int | None = None) -> list[dict]:
    """Alpaca records as TRL's prompt-completion rows (instruction and input joined as the prompt)."""
    rows = json.loads(Path(path).read_text())[:limit]
    return [{"prompt": "\n\n".join(x for x in (r["instruction"], r.get("input")) if x) + "\n",
             "completion": r["output"]} for r in rows]


def vlm_records(path: str) -> list[dict] | None:
    """A chat file with image parts as TRL's vision prompt-completion rows (None: not one): the user turn's
    image parts become placeholders, their files (relative to the data file) the `images` column."""
    rows = json.loads(Path(path).read_text())
    if not (isinstance(rows, list) and rows and "messages" in rows[0]):
        return None
    base = Path(path).parent
    out = []
    for r in rows:
        user, answer = r["messages"]
        out.append({"prompt": [{"role": "user", "content": [{"type": "image"} if c["type"] == "image" else c
                                                            for c in user["content"]]}],
                    "completion": [{"role": "assistant", "content": [{"type": "text", "text": answer["content"]}]}],
                    "images": [str(base / c["image"]) for c in user["content"] if c["type"] == "image"]})
    return out


def vlm_processor(model: str) -> tuple[object, str]:
    """(`AutoProcessor`'s processor, "AutoProcessor"), or without torchvision where it cannot be built (Qwen2-VL's
    video processor needs it) the toolkit's build without the video processor, so named."""
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(model), "AutoProcessor"
    except (ImportError, ValueError, TypeError) as e:
        from toolkit.model.vision import without_video

        cls = without_video(model)
        if cls is None:
            raise
        why = " ".join(str(e).split())[:120]
        return cls.from_pretrained(model), f"without its video processor ({type(e).__name__}: {why})"


def main() -> None:
    t_start = time.perf_counter()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--output-dir", required=True)
    ap.add_argument("--method", choices=("lora", "full"), default="lora")
    ap.add_argument("--best", action="store_true")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--max-steps", type=int, default=30)
    ap.add_argument("--compile-backend", default="inductor",
                    help="--best's torch.compile backend (a CPU smoke: aot_eager)")
    ap.add_argument("--no-compile", action="store_true", help="--best without torch.compile")
    a = ap.parse_args()

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    gpu = torch.cuda.is_available()
    liger = importlib.util.find_spec("liger_kernel") is not None
    flash = gpu and importlib.util.find_spec("flash_attn") is not None
    vision = vlm_records(a.dataset)
    # transformers turns torch_compile on wherever a backend is named: none named without it
    compiled = {} if a.no_compile else {"torch_compile": True, "torch_compile_backend": a.compile_backend}
    best = {**compiled, "padding_free": vision is None,
            "gradient_checkpointing": False,
            "use_liger_kernel": liger and gpu} if a.best else {}
    # TRL refuses packing for vision datasets; keep_end truncation too (its default is keep_start)
    config = SFTConfig(output_dir=a.output_dir, max_steps=a.max_steps, per_device_train_batch_size=a.micro_batch_size,
                       max_length=a.seq_len, packing=vision is None, bf16=gpu, logging_steps=1, report_to="none",
                       save_strategy="no", learning_rate=2e-4 if a.method == "lora" else 2e-5,
                       lr_scheduler_type="cosine", warmup_steps=10, **best)
    attn = {"attn_implementation": "flash_attention_2"} if a.best and flash else {}
    dtype = torch.bfloat16 if gpu and a.method == "lora" else None
    if vision is None:
        processing, processor_from = AutoTokenizer.from_pretrained(a.model), None
        model = AutoModelForCausalLM.from_pretrained(a.model, dtype=dtype, **attn)
        dataset = Dataset.from_list(records(a.dataset))
    else:
        import datasets
        from transformers import AutoModelForImageTextToText

        processing, processor_from = vlm_processor(a.model)
        model = AutoModelForImageTextToText.from_pretrained(a.model, dtype=dtype, **attn)
        dataset = Dataset.from_list(vision).cast_column("images", datasets.Sequence(datasets.Image()))
    peft_config = None
    if a.method == "lora":
        from peft import LoraConfig

        # an image-text model: the language model's linear layers alone (the toolkit's default; "all-linear"
        # would add the vision tower's)
        targets = "all-linear" if vision is None else \
            r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
        peft_config = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=targets, task_type="CAUSAL_LM")
    ends: list[float] = []

    class StepTimes(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if gpu:
                torch.cuda.synchronize()
            ends.append(time.perf_counter())

    trainer = SFTTrainer(model=model, args=config, train_dataset=dataset, processing_class=processing,
                         peft_config=peft_config, callbacks=[StepTimes()])
    # the batches' tokens and their padding, as the collator hands them over (the loader is built in train())
    seen = {"tokens": 0, "slots": 0}
    collate = trainer.data_collator

    def counted(examples):
        batch = collate(examples)
        mask = batch.get("attention_mask")
        if mask is not None:
            seen["tokens"] += int(mask.sum())
            seen["slots"] += mask.numel()
        return batch

    trainer.data_collator = counted
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    t_train = time.perf_counter()
    trainer.train()
    tokens = [r["num_tokens"] for r in trainer.state.log_history if "num_tokens" in r and "loss" in r]
    steps = list(zip(tokens, ends))
    pairs = [(b[0] - a_[0], b[1] - a_[1]) for a_, b in zip(steps[WARMUP - 1:], steps[WARMUP:])]
    times = [t for _, t in pairs]
    out = {"method": a.method, "best": best, "images": vision is not None, "processor": processor_from,
           "trainable_params": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
           "liger_left_out": a.best and not (liger and gpu),
           "attention": model.config._attn_implementation, "flash_attn_left_out": a.best and not flash,
           "gradient_checkpointing": config.gradient_checkpointing, "torch_compiled": config.torch_compile,
           "padding_fraction": 1 - seen["tokens"] / seen["slots"] if seen["slots"] else None,
           "steps": len(ends),
           "tokens_per_s": sum(n for n, _ in pairs) / sum(times) if pairs else None,
           "step_time_cv": statistics.pstdev(times) / statistics.mean(times) if len(times) > 1 else None,
           "seconds_to_step1": round(ends[0] - t_start, 1) if ends else None,
           "warmup_s": round(ends[WARMUP - 1] - t_train, 1) if len(ends) >= WARMUP else None,
           "wall_s": round(time.perf_counter() - t_start, 1),
           "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if gpu else None}
    Path(a.output_dir, "sft_metrics.json").write_text(json.dumps(out, indent=2))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
