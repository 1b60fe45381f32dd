"""Context parallelism (Ulysses, `--cp N`): per-rank memory of one training step against sequence
length, for cp 1, 2 and 4 on CPU ranks (gloo), beside the planner's prediction.

Each (cp, sequence length) runs in fresh processes. A rank builds the model, takes one short
warm-up step (gradients and AdamW state now exist), then one step at the full length with its
S/cp slice of the sequence. Per rank it records:
- saved: bytes autograd keeps for backward (`torch.autograd.graph.saved_tensors_hooks`, each
  storage once): the activations the planner's terms (`toolkit.planner.saved`) predict;
- peak rise: how far the process's resident memory rises over forward + backward (RSS sampled
  every 2 ms, against the RSS before them), and its activation part: that rise less the rise of the
  same step at 64 tokens per rank (the LM head's gradient and other buffers that do not grow with S);
- forward + backward seconds (tokens/s = S / seconds for the cp group).
"Longest sequence within the budget" is the largest measured length whose weights + optimizer +
peak rise fit the per-rank budget (--budget-gib), and the same extrapolated linearly in S from the
two longest measured lengths (labelled as such).

Model: SmolLM2-135M's widths (hidden 576, MLP 1536, vocab 49,152, tied head) with 8 query / 4 kv
heads of 72 (SmolLM2's 9 / 3 split by neither 2 nor 4) and --layers blocks (default 2: on a 2-core
CPU a 30-block step at 16k tokens takes minutes; memory per block is what scales). Targets: the last
1/8 of every sequence (a long document and its answer), so the LM head runs on few rows, fp32.

    python -m benchmarks.context_parallel    # writes benchmarks/context_parallel.{json,md}
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from benchmarks.common import BENCH, PeakSampler, llama, spawn_ranks, write_pair

SHAPES = dict(hidden_size=576, intermediate_size=1536, num_attention_heads=8, num_key_value_heads=4, head_dim=72,
              vocab_size=49152, tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=100000.0)
PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def batch(seq: int, vocab: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[:, : seq - seq // 8] = -100  # targets: the last eighth
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def _worker(rank: int, world: int, layers: int, seq: int) -> dict:
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    import gc

    import torch.distributed as dist

    from toolkit.parallel.cp import ContextParallel, use_ulysses
    from toolkit.objectives.sft.loss import FusedLossHead

    model = llama(**SHAPES, num_hidden_layers=layers, max_position_embeddings=max(seq, 2048),
                  attn_implementation="sdpa")
    use_ulysses(model)
    head = FusedLossHead(model)  # the chunked loss
    cp = ContextParallel(dist.group.WORLD, model.config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):  # activations: what autograd keeps that is not a weight
        s = t.untyped_storage()
        if s.data_ptr() not in weights:
            saved[s.data_ptr()] = s.nbytes()
        return t

    def step(b) -> tuple[int, float]:
        """(RSS rise over forward + backward, their seconds); then the optimizer step."""
        saved.clear()
        gc.collect()
        before = rss()
        dist.barrier()
        t0 = time.perf_counter()
        with PeakSampler(rss, every=0.002) as peak, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with cp.shard(b) as local, head.labels(local["targets"], shifted=True):
                model(**local["inputs"]).logits.backward()
        dist.barrier()
        seconds = time.perf_counter() - t0
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # gradient buffers stay: held, not part of the rise
        return peak.peak - before, seconds

    small = batch(64 * world, SHAPES["vocab_size"])
    step(small)  # warm-up: gradients and AdamW state allocated
    fixed, _ = step(small)  # what a step's buffers take at a negligible length (the LM head's gradient, ...)
    held = rss()
    rise, seconds = step(batch(seq, SHAPES["vocab_size"]))
    return {"saved_bytes": sum(saved.values()), "peak_rise_bytes": rise, "fixed_rise_bytes": fixed,
            "activation_peak_bytes": rise - fixed, "held_bytes": held, "step_s": seconds}


def run(cp: int, layers: int, seq: int) -> dict:
    # Every allocation over 128 KiB gets its own mapping, returned to the OS when freed: RSS then
    # follows the live tensors instead of glibc's cached heap (glibc reads this when a rank starts).
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)
    ranks = spawn_ranks(_worker, cp, layers, seq, timeout=3600)
    worst = max(ranks.values(), key=lambda r: r["activation_peak_bytes"])
    return {"cp": cp, "seq": seq, "layers": layers, **worst, "tokens_per_s": seq / worst["step_s"],
            "per_rank_saved_bytes": [ranks[r]["saved_bytes"] for r in sorted(ranks)]}


def predicted_activation_bytes(layers: int, seq: int, cp: int) -> int:
    """The planner's figure for the same run (toolkit.planner: cp rows use s/cp tokens per rank)."""
    from toolkit.planner import saved

    h, d = SHAPES["hidden_size"], saved.dtypes("full", "no", device="cpu")
    kv = SHAPES["num_key_value_heads"] * SHAPES["head_dim"]
    block = saved.block(h, SHAPES["intermediate_size"], kv, SHAPES["num_attention_heads"], d)
    return -(-seq // cp) * (layers * block + saved.outside_blocks(h, SHAPES["head_dim"], d))


def longest_within(rows: list[dict], budget: int) -> tuple[int | None, int | None]:
    """(largest measured S that fits, linear extrapolation in S from the two longest measured)."""
    held = rows[0]["held_bytes"]
    fits = [r["seq"] for r in rows if held + r["peak_rise_bytes"] <= budget]
    a, b = sorted(rows, key=lambda r: r["seq"])[-2:]
    slope = (b["peak_rise_bytes"] - a["peak_rise_bytes"]) / (b["seq"] - a["seq"])
    extrapolated = int(b["seq"] + (budget - held - b["peak_rise_bytes"]) / slope) if slope > 0 else None
    return (max(fits) if fits else None), extrapolated


def render(rows: list[dict], budget: int, layers: int) -> str:
    gib = 1024 ** 3
    cps = sorted({r["cp"] for r in rows})
    seqs = sorted({r["seq"] for r in rows})
    at = {(r["cp"], r["seq"]): r for r in rows}
    lines = ["# Context parallelism (Ulysses): per-rank memory against sequence length", "",
             f"`python -m benchmarks.context_parallel`: SmolLM2-135M widths, 8/4 heads of 72, {layers} blocks, fp32, "
             "micro-batch 1, targets on the last 1/8 of each sequence, one step after a warm-up; gloo ranks on a "
             "2-core CPU. Per rank (the worst): the RSS rise over forward + backward, its activation part (less the "
             "same step's rise at 64 tokens per rank), the bytes autograd saved (weights excluded), and the planner's "
             "predicted activations (`toolkit.planner.saved`'s terms at S/cp tokens).", "",
             "| S | cp | peak rise MiB | activation part MiB | vs cp1 | saved MiB | planner MiB | planner / saved | "
             "planner / activation part | tokens/s |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in seqs:
        for c in cps:
            r = at.get((c, s))
            if r is None:
                continue
            base = at.get((1, s))
            vs = f"{base['activation_peak_bytes'] / r['activation_peak_bytes']:.2f}x less" if base and c > 1 else "-"
            lines.append(f"| {s} | {c} | {r['peak_rise_bytes'] / 2**20:.0f} | "
                         f"{r['activation_peak_bytes'] / 2**20:.0f} | "
                         f"{vs} | {r['saved_bytes'] / 2**20:.0f} | {r['predicted_activation_bytes'] / 2**20:.0f} | "
                         f"{r['predicted_activation_bytes'] / r['saved_bytes']:.2f} | "
                         f"{r['predicted_activation_bytes'] / r['activation_peak_bytes']:.2f} | "
                         f"{r['tokens_per_s']:.0f} |")
    lines += ["", f"Longest sequence within {budget / gib:.1f} GiB per rank (weights, gradients and AdamW state as "
              "held before the step, plus the step's rise):", "", "| cp | measured (largest S run that fits) | "
              "extrapolated (linear in S from the two longest runs) |", "|---:|---:|---:|"]
    for c in cps:
        fit, ext = longest_within([r for r in rows if r["cp"] == c], budget)
        lines.append(f"| {c} | {fit or 'none'} | {ext if ext is not None else '-'} |")
    lines += ["", "The activation part is a difference of two RSS peaks: where a rank's activations are a few hundred "
              "MiB or less, the buffers subtracted as fixed are of the same size and the difference is rough; the "
              "saved bytes are exact.", "",
              "tokens/s are of one cp group on this shared 2-core machine (all ranks on the same two cores): "
              "recorded, not claimed; on GPUs each rank has its own device."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-lens", default="2048,4096,8192,16384")
    ap.add_argument("--cps", default="1,2,4")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--budget-gib", type=float, default=2.0)
    ap.add_argument("--out", default=str(BENCH / "context_parallel"))
    ap.add_argument("--render", action="store_true", help="rewrite the .md from the .json without running")
    args = ap.parse_args()
    if args.render:
        saved = json.loads(Path(args.out + ".json").read_text())
        Path(args.out + ".md").write_text(render(saved["rows"], saved["budget_bytes"], saved["layers"]))
        return
    rows = []
    for seq in map(int, args.seq_lens.split(",")):
        for cp in map(int, args.cps.split(",")):
            r = run(cp, args.layers, seq)
            r["predicted_activation_bytes"] = predicted_activation_bytes(args.layers, seq, cp)
            rows.append(r)
            print(json.dumps(r), flush=True)
    budget = int(args.budget_gib * 1024 ** 3)
    write_pair(args.out, {"shapes": SHAPES, "layers": args.layers, "budget_bytes": budget, "rows": rows},
               render(rows, budget, args.layers))


if __name__ == "__main__":
    main()
