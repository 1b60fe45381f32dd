"""How an MoE layer's experts run, measured side by side, and what expert parallel sends.

1. Implementations (`--experts`, transformers' `experts_implementation`): one Qwen3-MoE experts module
   (the model's own class, random weights) forward and backward on the same routed tokens under eager
   (a loop over the experts hit), grouped_mm (one grouped matmul: torch's grouped_mm where the device
   has it, else transformers' fallback) and batched_mm; rounds interleaved, the median per arm, and
   each arm's output and weight gradients against eager's (relative max difference).
2. Expert parallel's all-to-all (`toolkit.parallel.ep`), 2 gloo ranks: the bytes each rank sent in one
   forward and backward (`toolkit.parallel.traffic.counting("ep")`) against the count the planner prices,
   2 x T x top-k x hidden x bytes x (ep-1)/ep in forward (dispatch and combine) and again in backward
   (uniform routing), and a step's time at ep 1 and ep 2
   (each rank half the experts; on a 2-core CPU that ratio says little about GPUs: recorded, not claimed).

    python -m benchmarks.experts                 # CPU: writes benchmarks/experts_cpu.{json,md}
    python -m benchmarks.experts --device cuda   # Qwen3-30B-A3B's layer in bf16: benchmarks/gpu/experts_cuda.*
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.common import BENCH, md_table, spawn_ranks, write_pair

# Qwen/Qwen3-30B-A3B config.json: hidden 2048, moe_intermediate 768, 128 experts, top-8 (toolkit.planner.presets)
SHAPES = {"cpu": dict(hidden_size=256, moe_intermediate_size=128, num_experts=16, num_experts_per_tok=4, tokens=512),
          "cuda": dict(hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                       tokens=8192)}
ARMS = ("eager", "grouped_mm", "batched_mm")


def experts_module(shape: dict, device: str, dtype: torch.dtype, implementation: str):
    """Qwen3-MoE's experts class with `implementation`, seed-0 weights (the same for every arm)."""
    from transformers import AutoConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = AutoConfig.for_model("qwen3_moe", hidden_size=shape["hidden_size"], num_experts=shape["num_experts"],
                                  moe_intermediate_size=shape["moe_intermediate_size"],
                                  num_experts_per_tok=shape["num_experts_per_tok"])
    config._experts_implementation = implementation
    torch.manual_seed(0)
    module = Qwen3MoeExperts(config).to(device, dtype)
    for p in module.parameters():
        torch.nn.init.normal_(p, std=0.02)
    return module


def routed(shape: dict, device: str, dtype: torch.dtype, seed: int = 1):
    """Tokens, their top-k experts (a random router: near-uniform load) and normalised weights."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape["tokens"], shape["hidden_size"], generator=g).to(device, dtype)
    logits = torch.randn(shape["tokens"], shape["num_experts"], generator=g)
    weights, index = logits.softmax(-1).topk(shape["num_experts_per_tok"], dim=-1)
    return x, index.to(device), (weights / weights.sum(-1, keepdim=True)).to(device, dtype)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def implementations(device: str, dtype: torch.dtype, rounds: int, shape: dict | None = None) -> dict:
    """Each arm's median forward + backward seconds, speed against eager, and output and gradient
    differences against eager's, on `shape` (default: the device's)."""
    shape = shape or SHAPES[device]
    x, index, weights = routed(shape, device, dtype)
    modules = {arm: experts_module(shape, device, dtype, arm) for arm in ARMS}
    out, grads, times = {}, {}, {arm: [] for arm in ARMS}

    def step(arm: str):
        m = modules[arm]
        m.zero_grad(set_to_none=True)
        xi = x.detach().requires_grad_()
        y = m(xi, index, weights)
        y.float().square().sum().backward()
        return y.detach(), [p.grad for p in m.parameters()] + [xi.grad]

    for arm in ARMS:  # a warm-up each; the results compared
        out[arm], grads[arm] = step(arm)
    for _ in range(rounds):
        for arm in ARMS:
            sync(device)
            t0 = time.perf_counter()
            step(arm)
            sync(device)
            times[arm].append(time.perf_counter() - t0)

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()

    return {arm: {"seconds": statistics.median(times[arm]), "vs_eager": statistics.median(times["eager"]) /
                  statistics.median(times[arm]), "output_rel_diff": rel(out[arm], out["eager"]),
                  "grad_rel_diff": max(rel(a, b) for a, b in zip(grads[arm], grads["eager"]))} for arm in ARMS}


def _ep_rank(rank: int, n: int, shape: dict, rounds: int) -> dict:
    """One rank of n: the same experts module split by `apply_expert_parallel`, this rank's tokens."""
    import torch.distributed as dist
    from torch import nn

    from toolkit.parallel.ep import apply_expert_parallel
    from toolkit.parallel.traffic import counting

    torch.set_num_threads(1)
    whole = experts_module(shape, "cpu", torch.float32, "grouped_mm")
    holder = nn.Module()
    holder.experts = experts_module(shape, "cpu", torch.float32, "grouped_mm")
    apply_expert_parallel(holder, dist.group.WORLD)
    x, index, weights = routed(shape, "cpu", torch.float32, seed=10 + rank)
    times = {"ep1": [], "ep2": []}
    for _ in range(rounds + 1):
        for name, m in (("ep1", whole), ("ep2", holder.experts)):
            with counting("ep") as traffic:
                dist.barrier()
                t0 = time.perf_counter()
                m(x.requires_grad_(), index, weights).square().sum().backward()
                dist.barrier()
                times[name].append(time.perf_counter() - t0)
            sent = dict(traffic)
    # dispatch and combine: T x k rows of hidden x 4 bytes each, (n-1)/n of them to other ranks
    expected = 2 * shape["tokens"] * shape["num_experts_per_tok"] * shape["hidden_size"] * 4 * (n - 1) / n
    return {"sent_forward": sent["forward"], "sent_backward": sent["backward"], "expected": expected,
            "seconds": {k: statistics.median(v[1:]) for k, v in times.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    if args.device == "cpu":
        torch.set_num_threads(1)  # as each of the 2 ranks below runs: the arms compared on one core
    result = {"device": args.device, "dtype": str(dtype), "shape": SHAPES[args.device],
              "implementations": implementations(args.device, dtype, args.rounds)}
    if args.device == "cpu":
        result["expert_parallel"] = spawn_ranks(_ep_rank, 2, SHAPES["cpu"], args.rounds)
    rows = [(arm, f"{r['seconds'] * 1e3:.1f}", f"{r['vs_eager']:.2f}x", f"{r['output_rel_diff']:.1e}",
             f"{r['grad_rel_diff']:.1e}") for arm, r in result["implementations"].items()]
    s = SHAPES[args.device]
    md = [f"# Experts implementations ({args.device}, {dtype})", "",
          f"`python -m benchmarks.experts{' --device cuda' if args.device == 'cuda' else ''}`: one Qwen3-MoE "
          f"experts module, {s['num_experts']} experts, top-{s['num_experts_per_tok']}, hidden {s['hidden_size']}, "
          f"expert intermediate {s['moe_intermediate_size']}, {s['tokens']} tokens; forward + backward, median of "
          f"{args.rounds} interleaved rounds; differences against eager (relative to its largest value).", "",
          *md_table(["--experts", "ms", "speed vs eager", "output diff", "gradient diff"], rows)]
    if "expert_parallel" in result:
        ep = result["expert_parallel"]
        md += ["", "## Expert parallel, 2 gloo ranks", "",
               *md_table(["rank", "sent forward (B)", "sent backward (B)", "count, forward or backward (B)",
                          "measured / count", "ep1 ms", "ep2 ms"],
                         [(r, v["sent_forward"], v["sent_backward"], int(v["expected"]),
                           f"{v['sent_forward'] / v['expected']:.3f}", f"{v['seconds']['ep1'] * 1e3:.1f}",
                           f"{v['seconds']['ep2'] * 1e3:.1f}") for r, v in sorted(ep.items())]),
               "", "Bytes sent depend on where the router sends each token; the count assumes an even spread. The "
               "times are this 2-core machine's (one thread a rank; ep1: each rank runs all 16 experts on its own "
               "tokens, ep2: 8 experts on the tokens routed to them from both ranks): recorded, not claimed."]
    stem = BENCH / "gpu" / "experts_cuda" if args.device == "cuda" else BENCH / "experts_cpu"
    write_pair(stem, result, md)


if __name__ == "__main__":
    main()
