"""Useful (non-padding) tokens/s of padding-free micro-batches against padded ones, on GSM8K's lengths.

SmolLM2-135M-Instruct, LoRA, fp32 CPU, the toolkit's own tokenization and collators. Both variants train on
the same `--examples` examples (the toolkit's epoch-0 order) in the same micro-batches of `--micro-batch`
examples: padded = right-padded to their longest (`toolkit.data.collate`: what `--no-padding-free` runs),
padding-free = each micro-batch's examples end to end in one row (`toolkit.data.packing.collate_padding_free`:
the default on the CPU), so the examples per step and the loss are the same and only the layout differs.
One model, its attention `--attn varlen` as the default sets it: a padding-free row's documents go through the
CPU's varlen (one SDPA call per example), a padded batch's mask to transformers' SDPA (`toolkit.model.attention`:
what `--attn sdpa` runs). Timing is `benchmarks.packing.useful_tokens_per_sec`'s: forward + backward + AdamW step
over every micro-batch, one warm-up micro-batch each, rounds alternating; real tokens / median seconds.

    python -m benchmarks.padding_free        # needs ../shared/data/gsm8k_train_alpaca.json
Writes benchmarks/padding_free.{json,md}.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks.common import BENCH, ROOT, write_pair
from benchmarks.packing import gsm8k_rows, useful_tokens_per_sec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dataset", default=str(ROOT.parent / "shared" / "data" / "gsm8k_train_alpaca.json"))
    ap.add_argument("--examples", type=int, default=32)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    if not Path(a.dataset).is_file():
        raise SystemExit(f"{a.dataset}: not found (the shared GSM8K file); pass --dataset")
    import torch

    from toolkit.model.attention import register
    from toolkit.data import collate
    from toolkit.data.packing import collate_padding_free
    from toolkit.model.load import ModelShape, load_model
    from toolkit.parallel.parallelize import Parallelism, parallelize

    cfg, tok, path, chosen = gsm8k_rows(a.dataset, a.seq_len, a.examples)
    micro = [chosen[i:i + a.micro_batch] for i in range(0, len(chosen), a.micro_batch)]
    variants = {"padded": [collate(m, tok.pad_token_id) for m in micro],
                "padding-free": [collate_padding_free(m, tok.pad_token_id, whole=True) for m in micro]}
    real = sum(len(r["input_ids"]) for r in chosen)
    slots = {k: sum(b["input_ids"].numel() for b in v) for k, v in variants.items()}
    assert all(real == sum(int(b["attention_mask"].sum()) for b in v) for v in variants.values())
    torch.manual_seed(0)
    model = parallelize(load_model(cfg, path), Parallelism(ModelShape.of(cfg)))[0]  # the weights, then LoRA
    model.set_attn_implementation(register("varlen"))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr)
    tps, times = useful_tokens_per_sec(model, opt, variants, real, a.rounds)
    ratio = tps["padding-free"] / tps["padded"]
    result = {"dataset": Path(a.dataset).name, "model": "SmolLM2-135M-Instruct", "method": "lora", "dtype": "float32",
              "examples": a.examples, "micro_batch": a.micro_batch, "seq_len": a.seq_len, "real_tokens": real,
              "token_slots": slots, "computed_over_real": {k: v / real for k, v in slots.items()},
              "seconds": times, "useful_tokens_per_sec": tps, "padding_free_over_padded": ratio,
              "torch": torch.__version__, "threads": torch.get_num_threads()}
    md = ["# Padding-free vs padded micro-batches: useful tokens/s (GSM8K lengths)", "",
          "Reproduce: `python -m benchmarks.padding_free` (method in its docstring). SmolLM2-135M-Instruct, LoRA, "
          f"fp32, CPU ({torch.get_num_threads()} threads).", "",
          "| variant | micro-batches | token slots | computed / real tokens | useful tokens/s (median of rounds) |",
          "|---|---|---|---|---|"]
    for k in variants:
        md.append(f"| {k} ({a.micro_batch} examples each) | {len(micro)} | {slots[k]:,} | "
                  f"{result['computed_over_real'][k]:.3f} | {tps[k]:.1f} |")
    md += ["", f"padding-free / padded: **{ratio:.2f}x** on {a.examples} examples ({real:,} real tokens), {a.rounds} "
           "rounds, on a CPU shared with other processes. The same examples per micro-batch and the same loss; "
           "the padding-free rows run one SDPA call per example (no CPU varlen kernel), the padded batch one SDPA "
           "call with a padding mask."]
    write_pair(BENCH / "padding_free", result, md)


if __name__ == "__main__":
    main()
