"""TRL's GRPOTrainer as its users run it on a prompts file: the yardstick of `--objective grpo`'s speed
(benchmarks/gpu/gpu_user.py runs it beside finetune.py).

    python -m benchmarks.gpu.grpo_trainer_user --model DIR --dataset prompts.jsonl --output-dir OUT [--method full]
        [--continuous-batching] [--num-generations 8] [--max-completion-length 256]
        [--micro-batch-size 8] [--max-steps 6] [--grad-accum 1] [--temperature 1.0] [--lr LR] [--seed 42]
        [--threads N]

The records are `{"prompt": text, "answer": ...}` (TRL's standard form: a string prompt is fed as it is,
no chat template); the reward is the toolkit's builtin:math_answer as a plain Python function (the
`answer` column reaches it as a keyword, as TRL passes a dataset's columns), so both trainers score
with the same code. Everything else is GRPOConfig's defaults (generation by `model.generate`, dynamic
KV cache, no compile; temperature 1, top-p 1, top-k off; loss dapo; beta 0), with bf16 on a GPU,
LoRA r 16 / alpha 32 on all linear layers (the base in bf16) or a full finetune, the toolkit's learning
rates, a log every step, report_to none. `--continuous-batching` sets
`use_transformers_continuous_batching=True` (transformers' `generate_batch`: paged attention, its own
scheduler and compile settings; TRL caps its KV cache at half the free memory).

Figures (OUT/grpo_metrics.json), each over the steps after WARMUP (compile and allocator growth left out):
- generation_tokens_per_s: completion tokens (EOS included: the toolkit's count) over the seconds inside
  `_generate_single_turn`, the call that generates (wrapped with a timer; its lists of ids are on the
  host when it returns, so the GPU has finished);
- training_tokens_per_s: the step's prompt and completion tokens (TRL's logged `num_tokens`, cumulative;
  the toolkit's `tokens` count the same rows) over the step's seconds outside
  `_generate_and_score_completions` (generation, rewards, old log-probabilities: the toolkit keeps its
  whole round out of its training tokens/s the same way);
- step_s: a whole optimizer step's seconds, generation included (a callback notes each step's end);
plus wall_s, seconds_to_step1, peak_gib and what ran. Runs on the CPU too (fp32): the smoke test, and
benchmarks/grpo_cpu.py's TRL arm, for which a CPU run also records the process's peak resident memory
(peak_rss_mib: the kernel's high-water mark, VmHWM) and the peak over the steps after WARMUP alone
(steady_peak_rss_mib: the mark reset when the warm-up's last step ends, read when the last step ends),
and each step's seconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

WARMUP = 2  # steps left out: the first compiles (continuous batching's graphs) and grows the allocator


def math_answer(prompts, completions, answer, **kwargs):
    """builtin:math_answer, the toolkit's (the last number of the completion against the answer's)."""
    from toolkit.objectives.grpo.rewards import math_answer as toolkit_math_answer

    return toolkit_math_answer(prompts, completions, answer=answer)


def status_kib(field: str) -> int:
    """A `/proc/self/status` figure in KiB (VmHWM: the process's peak resident memory)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def main() -> None:
    t_start = time.perf_counter()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--dataset", required=True, help="JSONL of {prompt, answer}")
    ap.add_argument("--output-dir", required=True)
    ap.add_argument("--method", choices=("lora", "full"), default="lora")
    ap.add_argument("--continuous-batching", action="store_true")
    ap.add_argument("--num-generations", type=int, default=8)
    ap.add_argument("--max-completion-length", type=int, default=256)
    ap.add_argument("--micro-batch-size", type=int, default=8, help="per_device_train_batch_size (completions)")
    ap.add_argument("--grad-accum", type=int, default=1, help="gradient_accumulation_steps (TRL samples the "
                    "micro-batches of a step together: steps_per_generation defaults to it)")
    ap.add_argument("--max-steps", type=int, default=6)
    ap.add_argument("--temperature", type=float, default=1.0, help="GRPOConfig's temperature (its default 1.0)")
    ap.add_argument("--lr", type=float, default=None, help="learning rate (default: 2e-4 with LoRA, 2e-5 full)")
    ap.add_argument("--seed", type=int, default=42, help="GRPOConfig's seed (its default 42)")
    ap.add_argument("--threads", type=int, default=0, help="torch's CPU threads (0: torch's default)")
    ap.add_argument("--warmup", type=int, default=WARMUP, help="steps left out of the figures")
    ap.add_argument("--cb-config", default=None, help="transformers_continuous_batching_config as JSON (default TRL's: "
                    "a KV cache of half the free memory; the CPU smoke gives a small num_blocks, as on a CPU that "
                    "half is of the machine's RAM)")
    a = ap.parse_args()

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    gpu = torch.cuda.is_available()
    if a.threads:
        torch.set_num_threads(a.threads)
    rows = [json.loads(x) for x in Path(a.dataset).read_text().splitlines() if x.strip()]
    config = GRPOConfig(output_dir=a.output_dir, max_steps=a.max_steps, per_device_train_batch_size=a.micro_batch_size,
                        gradient_accumulation_steps=a.grad_accum,
                        num_generations=a.num_generations, max_completion_length=a.max_completion_length, bf16=gpu,
                        use_transformers_continuous_batching=a.continuous_batching,
                        transformers_continuous_batching_config=json.loads(a.cb_config) if a.cb_config else None,
                        logging_steps=1, report_to="none", save_strategy="no",
                        learning_rate=a.lr if a.lr is not None else 2e-4 if a.method == "lora" else 2e-5,
                        temperature=a.temperature, seed=a.seed, use_cpu=not gpu)
    tokenizer = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16 if gpu and a.method == "lora" else None)
    peft_config = None
    if a.method == "lora":
        from peft import LoraConfig

        peft_config = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear",
                                 task_type="CAUSAL_LM")
    ends: list[float] = []
    generation: list[tuple[float, int]] = []  # (seconds, completion tokens) per generate call
    rounds: list[float] = []  # seconds of each _generate_and_score_completions
    warmup_hwm: list[int] = []  # KiB: the process's peak until the warm-up's last step ended (CPU)
    steps_hwm: list[int] = []  # KiB: the peak from then until the last step ended

    class StepTimes(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if gpu:
                torch.cuda.synchronize()
            ends.append(time.perf_counter())
            if not gpu and len(ends) == a.warmup:  # the steady steps' peak starts from the memory held now
                warmup_hwm.append(status_kib("VmHWM"))
                Path("/proc/self/clear_refs").write_text("5")
            if not gpu and warmup_hwm and len(ends) == a.max_steps:  # ... and ends with the last step
                steps_hwm.append(status_kib("VmHWM"))

    trainer = GRPOTrainer(model=model, reward_funcs=math_answer, args=config, train_dataset=Dataset.from_list(rows),
                          processing_class=tokenizer, peft_config=peft_config, callbacks=[StepTimes()])
    generate, generate_and_score = trainer._generate_single_turn, trainer._generate_and_score_completions

    def timed_generate(*args, **kwargs):
        t0 = time.perf_counter()
        completion_ids, logprobs = generate(*args, **kwargs)
        generation.append((time.perf_counter() - t0, sum(len(c) for c in completion_ids)))
        return completion_ids, logprobs

    def timed_round(*args, **kwargs):
        t0 = time.perf_counter()
        out = generate_and_score(*args, **kwargs)
        if gpu:
            torch.cuda.synchronize()
        rounds.append(time.perf_counter() - t0)
        return out

    trainer._generate_single_turn, trainer._generate_and_score_completions = timed_generate, timed_round
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    t_train = time.perf_counter()
    trainer.train()
    starts = [t_train, *ends[:-1]]
    # one generation round a step (steps_per_generation = gradient_accumulation_steps, num_iterations 1)
    steady = list(range(a.warmup, min(len(ends), len(generation), len(rounds))))
    step_s = [ends[i] - starts[i] for i in steady]
    gen_s, tokens = sum(generation[i][0] for i in steady), sum(generation[i][1] for i in steady)
    train_s = sum(ends[i] - starts[i] - rounds[i] for i in steady)
    seen = [0, *(int(float(r["num_tokens"])) for r in trainer.state.log_history if "num_tokens" in r and "loss" in r)]
    trained = sum(seen[i + 1] - seen[i] for i in steady if i + 1 < len(seen))  # prompt + completion tokens
    out = {"method": a.method, "continuous_batching": a.continuous_batching, "num_generations": a.num_generations,
           "max_completion_length": a.max_completion_length, "micro_batch": a.micro_batch_size,
           "grad_accum": a.grad_accum,
           "cb_config": json.loads(a.cb_config) if a.cb_config else None,
           "generation": "transformers generate_batch (continuous batching)" if a.continuous_batching else
           "transformers generate (dynamic cache)", "dtype": "bf16" if gpu else "fp32", "steps": len(ends),
           "steady_steps": len(steady), "completion_tokens": tokens,
           "generation_tokens_per_s": tokens / gen_s if steady and gen_s else None,
           "training_tokens_per_s": trained / train_s if steady and train_s > 0 else None,
           "step_s": statistics.mean(step_s) if step_s else None,
           "step_s_median": statistics.median(step_s) if step_s else None, "step_s_each": step_s,
           "generation_s_each": [generation[i][0] for i in steady],
           "completion_tokens_each": [generation[i][1] for i in steady],
           "step_time_cv": statistics.pstdev(step_s) / statistics.mean(step_s) if len(step_s) > 1 else None,
           "generate_s_per_step": gen_s / len(steady) if steady else None,
           "seconds_to_step1": round(ends[0] - t_start, 1) if ends else None,
           "warmup_s": round(ends[a.warmup - 1] - t_train, 1) if a.warmup and len(ends) >= a.warmup else None,
           "wall_s": round(time.perf_counter() - t_start, 1),
           "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if gpu else None,
           "peak_rss_mib": None if gpu else max([status_kib("VmHWM"), *warmup_hwm]) / 1024,
           "steady_peak_rss_mib": steps_hwm[0] / 1024 if steps_hwm else None,
           "temperature": a.temperature, "lr": config.learning_rate, "seed": a.seed,
           "threads": torch.get_num_threads(),
           "completions_mean_length": [r["completions/mean_length"] for r in trainer.state.log_history
                                       if "completions/mean_length" in r]}
    Path(a.output_dir, "grpo_metrics.json").write_text(json.dumps(out, indent=2))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
