"""Useful (non-padding) tokens/s with --packing vs padded micro-batches, on GSM8K's lengths.

SmolLM2-135M-Instruct, LoRA, fp32 CPU, the toolkit's own tokenization and collators. Both variants
train on the same `--examples` examples (the toolkit's epoch-0 order): padded = micro-batches of
`--micro-batch` examples right-padded to their longest; packed = the same examples packed (first-fit
decreasing) into rows of `--seq-len` tokens, `--rows` rows per micro-batch. Each timed pass is
forward + backward + AdamW step over all of them, rounds alternate padded/packed after one warm-up
step each; figure = real tokens / seconds, median over rounds.

    python -m benchmarks.packing        # needs ../shared/data/gsm8k_train_alpaca.json
Writes benchmarks/packing.{json,md}.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.common import BENCH, ROOT, sync, write_pair


def useful_tokens_per_sec(model, opt, variants: dict[str, list[dict]], real: int, rounds: int,
                          autocast=contextlib.nullcontext,
                          log=print) -> tuple[dict[str, float], dict[str, list[float]]]:
    """Timed passes (forward + backward + optimizer step over every micro-batch of a variant), one
    warm-up micro-batch each, then `rounds` rounds alternating the variants: `real` tokens / the
    median seconds per variant, and every round's seconds. Batches are already on the model's device."""
    from toolkit.data.packing import model_inputs
    from toolkit.data.labels import count_targets
    from toolkit.objectives.sft.loss import token_loss_sum

    model.train()

    def one_pass(batches) -> float:
        sync()
        t0 = time.perf_counter()
        for b in batches:
            with autocast():
                logits = model(**model_inputs(b)).logits
            loss = token_loss_sum(logits, b["labels"]) / count_targets(b["labels"])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        sync()
        return time.perf_counter() - t0

    for batches in variants.values():
        one_pass(batches[:1])
    times: dict[str, list[float]] = {k: [] for k in variants}
    for r in range(rounds):
        for name, batches in variants.items():
            times[name].append(one_pass(batches))
            log(f"round {r + 1} {name}: {real / times[name][-1]:.1f} useful tokens/s")
    return {k: real / statistics.median(v) for k, v in times.items()}, times


def gsm8k_rows(dataset: str, seq_len: int, examples: int):
    """(config, tokenizer, model path, the first `examples` tokenized rows in the run's epoch order): the
    default model's LoRA run on `dataset`, as the benchmarks of batch layouts time it."""
    from toolkit.config import parse_config
    from toolkit.data import load_examples, tokenize_examples
    from toolkit.data.tokenize import ensure_chat_template
    from toolkit.model.load import load_tokenizer
    from toolkit.model.source import resolve_model
    from toolkit.data.loader import EpochShuffleSampler

    cfg = parse_config(["--dataset", dataset, "--method", "lora", "--seq-len", str(seq_len), "--mixed-precision", "no",
                        "--output-dir", tempfile.mkdtemp(), "--overwrite-output-dir"])
    path = resolve_model(cfg.model.model)
    tok = load_tokenizer(path)
    ensure_chat_template(tok)
    rows, _ = tokenize_examples(load_examples(cfg.data_settings).train, tok, cfg.data_settings)
    order = list(EpochShuffleSampler(len(rows), cfg.train.seed))
    return cfg, tok, path, [rows[i] for i in order[:examples]]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dataset", default=str(ROOT.parent / "shared" / "data" / "gsm8k_train_alpaca.json"))
    ap.add_argument("--examples", type=int, default=32)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    if not Path(a.dataset).is_file():
        raise SystemExit(f"{a.dataset}: not found (the shared GSM8K file); pass --dataset")
    import torch

    from toolkit.data import collate
    from toolkit.data.packing import collate_packed, pack_rows
    from toolkit.model.load import ModelShape, load_model
    from toolkit.parallel.parallelize import Parallelism, parallelize

    cfg, tok, path, chosen = gsm8k_rows(a.dataset, a.seq_len, a.examples)
    padded = [collate(chosen[i:i + a.micro_batch], tok.pad_token_id) for i in range(0, len(chosen), a.micro_batch)]
    packed_rows = pack_rows(chosen, a.seq_len)
    packed = [collate_packed(packed_rows[i:i + a.rows], tok.pad_token_id) for i in range(0, len(packed_rows), a.rows)]
    real = sum(len(r["input_ids"]) for r in chosen)
    assert (real == sum(int(b["attention_mask"].sum()) for b in padded)
            == sum(int(b["attention_mask"].sum()) for b in packed))
    slots = {"padded": sum(b["input_ids"].numel() for b in padded),
             "packed": sum(b["input_ids"].numel() for b in packed)}
    torch.manual_seed(0)
    # the weights, then LoRA (as the run's)
    model = parallelize(load_model(cfg, path), Parallelism(ModelShape.of(cfg)))[0]
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr)
    tps, times = useful_tokens_per_sec(model, opt, {"padded": padded, "packed": packed}, real, a.rounds)
    result = {"dataset": Path(a.dataset).name, "model": "SmolLM2-135M-Instruct", "method": "lora", "dtype": "float32",
              "examples": a.examples, "real_tokens": real, "token_slots": slots,
              "padding_fraction": {k: 1 - real / v for k, v in slots.items()},
              "micro_batches": {"padded": len(padded), "packed": len(packed)},
              "packed_rows": len(packed_rows), "seconds": times, "useful_tokens_per_sec": tps,
              "packed_over_padded": tps["packed"] / tps["padded"], "torch": torch.__version__}
    md = ["# Packing vs padded micro-batches: useful tokens/s (GSM8K lengths)", "",
          "Reproduce: `python -m benchmarks.packing` (method in its docstring). SmolLM2-135M-Instruct, LoRA, fp32, "
          "CPU.", "",
          "| variant | micro-batches | token slots | padding | useful tokens/s (median of rounds) |",
          "|---|---|---|---|---|"]
    for k in ("padded", "packed"):
        desc = f"{a.micro_batch} examples" if k == "padded" else f"{a.rows} rows of <= {a.seq_len}"
        md.append(f"| {k} ({desc}) | {len(padded) if k == 'padded' else len(packed)} | {slots[k]:,} | "
                  f"{result['padding_fraction'][k]:.1%} | {tps[k]:.1f} |")
    md += ["", f"packed / padded: **{result['packed_over_padded']:.2f}x** on {a.examples} examples "
           f"({real:,} real tokens), {a.rounds} rounds. Packed attention runs over whole {a.seq_len}-token rows with "
           "a block-diagonal mask (SDPA on CPU does not skip the masked blocks), which the ratio includes."]
    write_pair(BENCH / "packing", result, md)


if __name__ == "__main__":
    main()
