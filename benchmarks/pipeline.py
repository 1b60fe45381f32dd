"""Pipeline bubble on this machine: step time against the micro-batch count m, and each stage's
measured idle fraction against GPipe's (p-1)/(m+p-1) (Huang et al. 2019, section 2.2).

Multi-process (`StagePipeline`, torch.distributed.pipelining, gloo): p ranks, one CPU thread each,
one stage per rank, a fixed batch split into m micro-batches. For every m each rank also times its
own stage alone (forward + backward of the same m micro-batches, no sends or waits): its busy time.
    idle = 1 - busy / step time
counts both the bubble and the send/recv cost. GPipe and 1F1B have the same bubble; 1F1B holds
fewer micro-batches' activations at once.

Single process (`NaivePipeline`): every stage on `cpu`, so the stages share the same cores and
cannot overlap: the step time shows what micro-batching costs without the overlap a GPU per stage
gives. With GPUs (`--devices cuda:0,cuda:1`) the same numbers measure the naive wrapper's overlap.

    python -m benchmarks.pipeline            # writes benchmarks/pipeline.{json,md,png}
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from benchmarks.common import BENCH, llama, median_seconds, spawn_ranks, sync, write_pair

SHAPES = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=8, num_attention_heads=8,
              num_key_value_heads=4, vocab_size=2048, tie_word_embeddings=False)
BATCH, SEQ, STEPS = 16, 128, 7
MICROBATCHES = [int(x) for x in os.environ.get("BENCH_PP_M", "1,2,4,8,16").split(",")]


def build_model():
    return llama(**SHAPES, max_position_embeddings=SEQ).float()


def make_batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, SHAPES["vocab_size"], (BATCH, SEQ), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def stage_busy_seconds(stage, batch, m: int, first: bool, last: bool) -> float:
    """This stage's forward + backward over m micro-batches, alone: no sends, no waits."""
    from toolkit.parallel.pp.naive import split_microbatches
    from toolkit.objectives.sft.loss import token_loss_sum

    t0 = time.perf_counter()
    for mb in split_microbatches(batch, m):
        x = mb["input_ids"] if first else torch.randn(mb["input_ids"].shape + (SHAPES["hidden_size"],),
                                                      requires_grad=True)
        out = stage(x, attention_mask=mb["attention_mask"])
        (token_loss_sum(out, mb["labels"]) if last else out.float().sum()).backward()
    stage.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def _measure(rank: int, world: int, schedule: str, by: str) -> dict:
    torch.set_num_threads(1)
    import torch.distributed as dist

    from toolkit.parallel.pp import balance, decoder_parts, make_pipeline_layout
    from toolkit.parallel.pp.split import param_costs, time_costs
    from toolkit.parallel.pp.stages import StagePipeline

    layout = make_pipeline_layout(world)
    model = build_model()
    if by == "time":  # measured on rank 0, as finetune.py --pp-balance time does
        costs = [time_costs(decoder_parts(model), BATCH // max(MICROBATCHES), SEQ, torch.device("cpu"))
                 if rank == 0 else None]
        dist.broadcast_object_list(costs, src=0)
        blocks, first, last = costs[0]
    else:
        blocks, first, last = param_costs(decoder_parts(model))
    sizes = balance(blocks, world, first, last)
    batch = make_batch()
    n_targets = (batch["labels"][:, 1:] != -100).sum().item()
    out = {}
    for m in MICROBATCHES:
        if schedule == "1f1b" and m < world:
            continue
        pipe = StagePipeline(model, layout, sizes, m, schedule, torch.device("cpu"), pad_id=0)
        pipe.train_step(batch, 1.0 / n_targets)  # warm-up (and shape inference)
        pipe.stage.zero_grad(set_to_none=True)
        steps = []
        for _ in range(STEPS):
            dist.barrier()
            t0 = time.perf_counter()
            pipe.train_step(batch, 1.0 / n_targets)
            dist.barrier()
            steps.append(time.perf_counter() - t0)
            pipe.stage.zero_grad(set_to_none=True)
        busy = statistics.median(stage_busy_seconds(pipe.stage, batch, m, pipe.first, pipe.last) for _ in range(3))
        out[m] = {"step_s": statistics.median(steps), "busy_s": busy}
    return {"sizes": sizes, **out}


def multi_process(world: int, schedule: str, by: str) -> list[dict]:
    results = spawn_ranks(_measure, world, schedule, by)
    rows = []
    for m in [k for k in results[0] if k != "sizes"]:
        step = max(results[r][m]["step_s"] for r in range(world))
        busy = [results[r][m]["busy_s"] for r in range(world)]
        rows.append({"runtime": f"{world} ranks, {schedule}, split by {by}", "p": world, "m": m, "step_s": step,
                     "blocks_per_stage": results[0]["sizes"],
                     "busy_s": busy, "idle_measured": [1 - b / step for b in busy],
                     "idle_gpipe": (world - 1) / (m + world - 1)})
    return rows


def naive(devices: list[str]) -> list[dict]:
    from toolkit.parallel.pp import NaivePipeline
    from toolkit.objectives.sft.loss import token_loss_sum

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    batch = make_batch()
    n_targets = (batch["labels"][:, 1:] != -100).sum().item()
    rows = []
    unsplit = build_model()

    def unsplit_step() -> None:
        (token_loss_sum(unsplit(input_ids=batch["input_ids"]).logits, batch["labels"]) / n_targets).backward()
        unsplit.zero_grad(set_to_none=True)

    unsplit_s = median_seconds(unsplit_step, STEPS, warmup=1)
    for m in MICROBATCHES:
        pipe = NaivePipeline(build_model(), [torch.device(d) for d in devices], m)

        def pipe_step() -> None:
            pipe.train_step({k: v.to(devices[0]) for k, v in batch.items()}, 1.0 / n_targets)
            sync()
            pipe.zero_grad(set_to_none=True)

        p = len(devices)
        rows.append({"runtime": f"naive, {','.join(devices)}", "p": p, "m": m, "blocks_per_stage": pipe.sizes,
                     "step_s": median_seconds(pipe_step, STEPS, warmup=1),
                     "unsplit_step_s": unsplit_s, "idle_gpipe": (p - 1) / (m + p - 1)})
    return rows


def write(rows: list[dict], out: Path) -> None:
    meta = {"model": SHAPES, "batch": BATCH, "seq": SEQ, "steps": STEPS, "torch": torch.__version__,
            "cores": len(os.sched_getaffinity(0)),
            "device": "cpu" if not torch.cuda.is_available() else torch.cuda.get_device_name()}
    lines = ["# Pipeline step time vs micro-batches (`python -m benchmarks.pipeline`)", "",
             f"Llama {SHAPES['num_hidden_layers']} blocks, h {SHAPES['hidden_size']}, batch {BATCH} x seq {SEQ}, "
             f"fp32, {meta['cores']} CPU cores, torch {meta['torch']}; median of {STEPS} steps.", "",
             "| runtime | blocks per stage | m | step s | idle per stage (measured) | (p-1)/(m+p-1) |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        idle = ", ".join(f"{x:.0%}" for x in r["idle_measured"]) if "idle_measured" in r else \
            f"n/a (unsplit model: {r['unsplit_step_s']:.3f} s)"
        lines.append(f"| {r['runtime']} | {'+'.join(map(str, r['blocks_per_stage']))} | {r['m']} | "
                     f"{r['step_s']:.3f} | {idle} | {r['idle_gpipe']:.0%} |")
    write_pair(out / "pipeline", {"meta": meta, "rows": rows}, lines)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for runtime in dict.fromkeys(r["runtime"] for r in rows if "idle_measured" in r):
            rs = [r for r in rows if r["runtime"] == runtime]
            ax.plot([r["m"] for r in rs], [max(r["idle_measured"]) for r in rs], "o-",
                    label=f"{runtime}: measured (worst stage)")
        rs = [r for r in rows if "idle_measured" in r]
        ms = sorted({r["m"] for r in rs})
        p = rs[0]["p"]
        ax.plot(ms, [(p - 1) / (m + p - 1) for m in ms], "k--", label="(p-1)/(m+p-1)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("micro-batches m")
        ax.set_ylabel("idle fraction")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "pipeline.png", dpi=120)
    except ImportError:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--devices", default="cpu,cpu", help="naive pipeline stage devices")
    ap.add_argument("--balance", default="params", choices=["params", "time"], help="how blocks are split")
    ap.add_argument("--out", default=str(BENCH))
    args = ap.parse_args()
    rows = (multi_process(args.stages, "gpipe", args.balance) + multi_process(args.stages, "1f1b", args.balance)
            + naive(args.devices.split(",")))
    write(rows, Path(args.out))


if __name__ == "__main__":
    main()
