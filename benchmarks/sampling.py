"""GRPO's sampling loop (`toolkit.objectives.grpo.sampling.sample`) on the CPU: its decode paths side
by side, and against transformers' `model.generate`. The same prompts, the same warpers (temperature 0.8,
top-k 40, top-p 0.9), the same number of new tokens (no EOS stops any: ours gets no EOS ids, generate an
EOS id no draw can produce), a KV cache every arm; tokens/s of new tokens, the median of `--repeats` rounds, each round
every arm in turn, after one warm-up call of each (which compiles the compiled arm).

Arms:
- dynamic: DynamicCache, eager steps (the CPU default);
- static: a StaticCache, the step eager (what the preallocated cache alone changes);
- static_compiled: a StaticCache and the step torch.compile'd with inductor (CUDA's default path, without
  CUDA graphs, which the CPU has not);
- generate: `model.generate(do_sample=True)` with its default dynamic cache, compile disabled.

Models: the tests' tiny Llama (hidden 64, 2 blocks, vocab 384) and a larger random Llama (hidden 512, 8
blocks, vocab 32000, 56M parameters), fp32, on `--threads` torch threads (default 1: on a shared machine two
threads wait on each other at every op, and the figures are noise).

    python -m benchmarks.sampling            # -> benchmarks/sampling.{json,md}
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.common import BENCH, md_table, write_pair

import torch

LARGER = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
              num_key_value_heads=4, vocab_size=32000, max_position_embeddings=1024)
ARMS = ("dynamic", "static", "static_compiled", "generate")


def model_for(name: str, folder: Path):
    from transformers import AutoModelForCausalLM

    from toolkit.model.synthetic import build_model_dir

    overrides = LARGER if name == "larger" else {}
    path = build_model_dir(folder / name, **overrides)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def prompts_for(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, min(vocab, 384)) for _ in range(rng.randint(16, 48))] for _ in range(n)]


def time_ours(model, prompts, cfg, decoder) -> tuple[float, int, list]:
    from toolkit.objectives.grpo.sampling import completion_seed, sample

    start = time.perf_counter()
    out = sample(model, prompts, [completion_seed(0, 0, i, 0) for i in range(len(prompts))], cfg, [], pad_id=0,
                 decoder=decoder)
    return time.perf_counter() - start, int(out.mask.sum()), out.token_lists()


def time_generate(model, prompts, cfg, never: int) -> tuple[float, int, None]:
    from transformers import GenerationConfig

    from toolkit.objectives.grpo.sampling import left_pad

    ids, mask = left_pad(prompts, 0)
    gen = GenerationConfig(do_sample=True, temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p,
                           max_new_tokens=cfg.max_completion_length, pad_token_id=0, eos_token_id=never,
                           disable_compile=True)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gen)
    return time.perf_counter() - start, (out.shape[1] - ids.shape[1]) * len(prompts), None


def main() -> None:
    from toolkit.objectives.grpo.sampling import SamplingConfig, StaticDecoder

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
            decoders = {"static": StaticDecoder(None, "cpu"), "static_compiled": StaticDecoder("inductor", "cpu")}
            run = {"dynamic": lambda: time_ours(model, prompts, cfg, None),
                   "static": lambda: time_ours(model, prompts, cfg, decoders["static"]),
                   "static_compiled": lambda: time_ours(model, prompts, cfg, decoders["static_compiled"]),
                   "generate": lambda: time_generate(model, prompts, cfg, never)}
            warmup = {arm: run[arm]()[0] for arm in ARMS}  # the compiled arm compiles here
            assert all(d.failed is None for d in decoders.values()), {k: d.failed for k, d in decoders.items()}
            tps = {arm: [] for arm in ARMS}
            tokens = {}
            for _ in range(args.repeats):
                for arm in ARMS:
                    seconds, n, tokens[arm] = run[arm]()
                    assert n == batch * length, (arm, n)
                    tps[arm].append(n / seconds)
            same = tokens["dynamic"] == tokens["static"] == tokens["static_compiled"]  # the paths' tokens
            med = {arm: statistics.median(v) for arm, v in tps.items()}
            params = sum(p.numel() for p in model.parameters())
            data.append(dict(model=name, parameters=params, prompts=batch, new_tokens=length, tok_s=tps, median=med,
                             warmup_s=warmup, same_tokens=same,
                             ratios={arm: med[arm] / med["dynamic"] for arm in ARMS}))
            rows.append([name, f"{params / 1e6:.1f}M", batch, length,
                         *(f"{med[a]:.0f} ({min(tps[a]):.0f}-{max(tps[a]):.0f})" for a in ARMS),
                         *(f"{med[a] / med['dynamic']:.2f}" for a in ARMS[1:]), f"{warmup['static_compiled']:.0f}",
                         "yes" if same else "**no**"])
    load = os.getloadavg()[0]
    lines = ["# GRPO sampling: decode paths and model.generate (CPU, fp32)", "",
             f"`python -m benchmarks.sampling` ({torch.get_num_threads()} torch thread(s) on {os.cpu_count()} "
             f"cores, load average {load:.1f} at the end; median (min-max) of {args.repeats} rounds, each arm in turn; "
             "new tokens per second). dynamic: DynamicCache, eager (the CPU default); static: StaticCache, eager "
             "step; static_compiled: StaticCache, step compiled by inductor (CUDA's default path without CUDA "
             "graphs); generate: model.generate, dynamic cache. Ratios are against dynamic; `same tokens`: the "
             "three paths of ours drew identical completions.", ""]
    lines += md_table(["model", "parameters", "prompts", "new tokens each", *(f"{a} tok/s" for a in ARMS),
                       *(f"{a} / dynamic" for a in ARMS[1:]), "compile warm-up s", "same tokens"], rows)
    write_pair(args.out, {"load_average": load, "threads": torch.get_num_threads(), "cases": data}, lines)


if __name__ == "__main__":
    main()
