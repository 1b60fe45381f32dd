"""GRPO's sampling loop (`toolkit.sampling.sample`) against transformers' `model.generate` on the CPU: the same
prompts, the same warpers (temperature 0.8, top-k 40, top-p 0.9), the same number of new tokens (no EOS
stops either: ours gets no EOS ids, generate an EOS id no draw can produce), KV cache both; tokens/s of new
tokens, the median of `--repeats` runs taken in turn (ours, generate, ours, ...) after one warm-up each.

Models: the tests' tiny Llama (hidden 64, 2 blocks, vocab 384) and a larger random Llama (hidden 512, 8
blocks, vocab 32000, 56M parameters), fp32, on `--threads` torch threads (default 1: on a shared machine two
threads wait on each other at every op, and the figures are noise).

    python scripts/bench_sampling.py            # -> benchmarks/sampling.{json,md}
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

from _bench_common import BENCH, md_table, write_pair

import torch

LARGER = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
              num_key_value_heads=4, vocab_size=32000, max_position_embeddings=1024)


def model_for(name: str, folder: Path):
    from transformers import AutoModelForCausalLM

    from toolkit.synthetic import build_model_dir

    overrides = LARGER if name == "larger" else {}
    path = build_model_dir(folder / name, **overrides)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def prompts_for(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, min(vocab, 384)) for _ in range(rng.randint(16, 48))] for _ in range(n)]


def time_ours(model, prompts, cfg) -> tuple[float, int]:
    from toolkit.sampling import completion_seed, sample

    start = time.perf_counter()
    out = sample(model, prompts, [completion_seed(0, 0, i, 0) for i in range(len(prompts))], cfg, [], pad_id=0)
    return time.perf_counter() - start, int(out.mask.sum())


def time_generate(model, prompts, cfg, never: int) -> tuple[float, int]:
    from transformers import GenerationConfig

    from toolkit.sampling import left_pad

    ids, mask = left_pad(prompts, 0)
    gen = GenerationConfig(do_sample=True, temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p,
                           max_new_tokens=cfg.max_completion_length, pad_token_id=0, eos_token_id=never,
                           disable_compile=True)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gen)
    return time.perf_counter() - start, (out.shape[1] - ids.shape[1]) * len(prompts)


def main() -> None:
    from toolkit.sampling import SamplingConfig

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)")
    ap.add_argument("--out", default=str(BENCH / "sampling"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cases = [("tiny", 32, 64), ("larger", 8, 64)]
    rows, data = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for name, batch, length in cases:
            model = model_for(name, Path(tmp))
            cfg = SamplingConfig(max_completion_length=length, temperature=0.8, top_k=40, top_p=0.9)
            prompts = prompts_for(batch, model.config.vocab_size)
            never = model.config.vocab_size  # an id past the vocabulary: no draw makes it
            time_ours(model, prompts, cfg), time_generate(model, prompts, cfg, never)  # warm-up
            ours, theirs = [], []
            for _ in range(args.repeats):
                seconds, tokens = time_ours(model, prompts, cfg)
                ours.append(tokens / seconds)
                seconds, gen_tokens = time_generate(model, prompts, cfg, never)
                theirs.append(gen_tokens / seconds)
                assert tokens == gen_tokens == batch * length, (tokens, gen_tokens)
            params = sum(p.numel() for p in model.parameters())
            a, b = statistics.median(ours), statistics.median(theirs)
            data.append(dict(model=name, parameters=params, prompts=batch, new_tokens=length, ours_tok_s=ours,
                             generate_tok_s=theirs, ours_median=a, generate_median=b, ratio=a / b))
            rows.append([name, f"{params / 1e6:.1f}M", batch, length, f"{a:.0f} ({min(ours):.0f}-{max(ours):.0f})",
                         f"{b:.0f} ({min(theirs):.0f}-{max(theirs):.0f})", f"{a / b:.2f}"])
    load = os.getloadavg()[0]
    lines = ["# GRPO sampling loop vs model.generate (CPU, fp32)", "",
             f"`python scripts/bench_sampling.py` ({torch.get_num_threads()} torch thread(s) on {os.cpu_count()} "
             "cores, "
             f"load average {load:.1f} at the end; median (min-max) of {args.repeats} runs taken in turn; new tokens "
             "per second):", ""]
    lines += md_table(["model", "parameters", "prompts", "new tokens each", "ours tok/s", "generate tok/s",
                       "ours / generate"], rows)
    write_pair(args.out, {"load_average": load, "threads": torch.get_num_threads(), "cases": data}, lines)


if __name__ == "__main__":
    main()
