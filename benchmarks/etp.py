"""Does expert tensor parallel (ETP: EP inside TP, each expert's intermediate also cut over TP) earn its
complexity? Four layouts of the same 4 ranks, side by side in one launch, on one MoE model:

    dp4_ep2        --ep 2, no TP: dp_shard 4, ep groups {0,1} {2,3}; whole experts, E/2 a rank
    tp2_ep2_etp    --tp 2 --ep 2 as the toolkit ran it with ETP (since removed): TP {0,1} {2,3}, ep over dp_shard at
                   the same TP coordinate {0,2} {1,3}; E/2 experts a rank, each cut to I/2; both TP peers
                   dispatch the same tokens (the all-to-all is repeated across TP ranks), the experts'
                   partial outputs are all-reduced over TP
    tp2_ep4_noetp  torchtitan's etp=1 (kept when it removed ETP, pytorch/torchtitan#3167): TP only in
                   attention, experts NOT TP-cut; ep borrows TP too (ep = dp_shard x tp = 4, E/4 whole
                   experts a rank); each TP rank routes 1/tp of its tokens (torchtitan's
                   ReordererSequenceParallel), so no token travels twice; the experts' outputs, zero on the
                   other TP rank's tokens (Partial), are all-reduced over TP as ETP's are
    tp2_ep2_noetp  the same, ep = the TP group (E/2 whole experts a rank, replicated over dp_shard)

The noetp arms are emulated here without library changes: the config's TP plan minus its routed-experts
(and, every layer being routed, dense-MLP) entries, `apply_expert_parallel` over the wider group, and a
wrapper around the experts module's forward that keeps this TP rank's slice of the tokens and all-reduces
the partial result (`toolkit.parallel.tp.comm`'s copy_to_tp / reduce_from_tp, so the TP bytes are counted
by the same counter). The other arms call the library as `parallelize` does: `apply_tensor_parallel`, then
`apply_expert_parallel`.

Measured per arm, in the same 4 gloo processes (spawned, one thread each), arms interleaved round by
round: per-rank bytes of the TP all-reduces and of the EP all-to-alls per step (forward and backward;
`toolkit.parallel.traffic.counting("tp")` and `counting("ep")`, averaged over ranks and steps), the median
forward+backward step time, and, as a check that the layouts compute the same thing, the loss summed over
the global batch and the summed gradient of layer 0's router against dp4_ep2's. Every arm trains the same
global batch (dp4: a quarter of the rows a rank; tp arms: half a TP group, TP peers the same rows).

The model: Qwen3-30B-A3B's structure (`toolkit.planner.presets`, every layer routed, top-8 of 128
experts, hidden/moe_intermediate = 2048/768) scaled to a CPU: hidden 256, moe_intermediate 96, 32 experts
top-2 (the same experts/top-k ratio 16), 4 layers. Also printed, analytically, for the published shapes
of the MoE presets (bf16, uniform routing): bytes per rank per step and the expert GEMMs each layout
gives (experts a rank, rows per expert M, gate_up output width 2I/tp, down inner width I/tp).

    python -m benchmarks.etp                    # writes benchmarks/etp.json, prints the tables
    python -m benchmarks.etp --rounds 3 --seq 128     # shorter

On a 2-core CPU, 4 ranks share 2 cores and gloo's collectives are memory copies: the step-time ratio is
this machine's, not a GPU's (NVLink / InfiniBand costs, grouped-GEMM tile efficiency at width I/tp are
not measured here).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch
import torch.nn.functional as F

from benchmarks.common import BENCH, md_table, spawn_ranks

WORLD = 4
ARMS = ("dp4_ep2", "tp2_ep2_etp", "tp2_ep4_noetp", "tp2_ep2_noetp")
# (tp, ep, token split over TP before dispatch, experts TP-cut)
LAYOUT = {"dp4_ep2": (1, 2, False, False), "tp2_ep2_etp": (2, 2, False, True),
          "tp2_ep4_noetp": (2, 4, True, False), "tp2_ep2_noetp": (2, 2, True, False)}
PRESET = "qwen3-30b-a3b"
# Qwen3-30B-A3B scaled: hidden : moe_intermediate as 2048 : 768, experts : top-k as 128 : 8, GQA kept
# (kv heads 2, so TP 2 splits them), every layer routed as published
SCALED = dict(hidden_size=256, moe_intermediate_size=96, intermediate_size=768, num_experts=32,
              num_experts_per_tok=2, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
              num_hidden_layers=4, vocab_size=1024, max_position_embeddings=1024, mlp_only_layers=[],
              output_router_logits=False)
ANALYTIC = ("qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3", "gpt-oss-120b", "mixtral-8x7b")


def config(**overrides):
    from transformers import AutoConfig

    from toolkit.planner.presets import PRESETS

    values = dict(PRESETS[PRESET])
    model_type = values.pop("model_type")
    return AutoConfig.for_model(model_type, **{**values, **SCALED, **overrides})


def _no_expert_tp(cfg) -> None:
    """The config's TP plan without the routed experts (and the dense MLP, which no layer has when every
    layer is routed): TP then cuts attention only, as torchtitan's etp=1 does."""
    plan = dict(type(cfg).base_model_tp_plan)
    dense = bool(getattr(cfg, "mlp_only_layers", None))
    cfg.base_model_tp_plan = {k: v for k, v in plan.items()
                              if ".experts" not in k and (dense or ".mlp." not in k)}


def _split_tokens(module, tp_group) -> None:
    """torchtitan's ReordererSequenceParallel + Partial -> Replicate, around EP's routed forward: this TP
    rank dispatches its 1/tp of the tokens; the output, zero on the peers' tokens, is all-reduced over TP.
    copy_to_tp on the inputs: their gradients (each rank's covers its own tokens) are summed in backward."""
    import torch.distributed as dist

    from toolkit.parallel.tp.comm import copy_to_tp, reduce_from_tp

    routed = module.forward
    t, r = dist.get_world_size(tp_group), dist.get_rank(tp_group)

    def forward(hidden_states, top_k_index, top_k_weights):
        hidden_states, top_k_weights = copy_to_tp(hidden_states, tp_group), copy_to_tp(top_k_weights, tp_group)
        n = hidden_states.shape[0]
        if n % t:
            raise ValueError(f"{n} tokens do not split over {t} TP ranks")
        rows = slice(r * n // t, (r + 1) * n // t)
        mine = routed(hidden_states[rows], top_k_index[rows], top_k_weights[rows])
        partial = F.pad(mine, (0, 0, rows.start, n - rows.stop))
        return reduce_from_tp(partial, tp_group)

    module.forward = forward


def build(arm: str, groups: dict, implementation: str):
    from transformers import AutoModelForCausalLM

    from toolkit.parallel.ep import apply_expert_parallel
    from toolkit.parallel.tp.plan import apply_tensor_parallel
    from toolkit.model.kernels import experts_modules

    tp, ep, split, etp = LAYOUT[arm]
    cfg = config()
    if tp > 1 and not etp:
        _no_expert_tp(cfg)
    torch.manual_seed(0)  # the same full weights on every rank and in every arm
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa")
    model.set_experts_implementation(implementation)
    model.train()
    tp_group = groups["pair"] if tp > 1 else None
    ep_group = {"dp4_ep2": groups["pair"], "tp2_ep2_etp": groups["cross"], "tp2_ep4_noetp": groups["world"],
                "tp2_ep2_noetp": groups["pair"]}[arm]
    if tp_group is not None:  # what `toolkit.parallel.parallelize` does: TP, then EP
        apply_tensor_parallel(model, tp_group)
    apply_expert_parallel(model, ep_group)
    if split:
        for module in experts_modules(model):
            _split_tokens(module, tp_group)
    experts = experts_modules(model)[0]
    shapes = {n: list(p.shape) for n, p in experts.named_parameters()}
    return model, shapes


def _worker(rank: int, world: int, arms: tuple, rounds: int, batch: int, seq: int, implementation: str) -> dict:
    torch.set_num_threads(1)
    import torch.distributed as dist

    from toolkit.objectives.sft.loss import token_loss_sum
    from toolkit.parallel.traffic import counting

    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # consecutive ranks: TP groups, dp4's ep groups
    cross = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # same TP coordinate: ETP's ep groups
    groups = {"pair": pairs[rank // 2], "cross": cross[rank % 2], "world": dist.group.WORLD}
    ids = torch.randint(4, SCALED["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(1))
    models, inputs, out = {}, {}, {}
    for arm in arms:
        tp = LAYOUT[arm][0]
        dp, d = world // tp, rank // tp  # data-parallel degree and coordinate
        inputs[arm] = ids[d * batch // dp:(d + 1) * batch // dp]
        models[arm], shapes = build(arm, groups, implementation)
        out[arm] = {"times": [], "tp": {}, "ep": {}, "local_expert_shapes": shapes}

    def step(arm: str) -> torch.Tensor:
        model = models[arm]
        model.zero_grad(set_to_none=True)
        loss = token_loss_sum(model(input_ids=inputs[arm]).logits, inputs[arm])
        loss.backward()
        dist.barrier()
        return loss.detach()

    grads = {}
    for arm in arms:  # warm-up, and the check: loss and router gradient summed over the global batch
        loss = step(arm)
        gate = models[arm].model.layers[0].mlp.gate.weight.grad.detach().clone()
        for t in (loss, gate):
            dist.all_reduce(t)
            t /= LAYOUT[arm][0]  # TP peers hold the same rows: counted once
        out[arm]["loss_sum"], grads[arm] = loss.item(), gate
    for arm in arms:
        diff = (grads[arm] - grads[arms[0]]).abs().max() / grads[arms[0]].abs().max()
        out[arm]["gate_grad_max_rel_diff"] = diff.item()
    for _ in range(rounds):
        for arm in arms:
            with counting("tp") as tp_sent, counting("ep") as ep_sent:
                t0 = time.perf_counter()
                step(arm)
                out[arm]["times"].append(time.perf_counter() - t0)
            for key, sent in (("tp", tp_sent), ("ep", ep_sent)):
                for phase, n in sent.items():
                    out[arm][key][phase] = out[arm][key].get(phase, 0) + n / rounds
    return out


# ----------------------------------------------------------------------------- analytic


def analytic(values: dict, tokens: int, elem: int = 2) -> dict:
    """Per rank, per step of `tokens` global tokens on 4 ranks, uniform routing, each layout of ARMS:
    bytes sent by the EP all-to-alls and the TP all-reduces (forward + backward; an all-reduce of 2 ranks
    sends its tensor's size; Megatron's 2 all-reduces of tokens x hidden per block each way, plus the routing
    weights' gradient; not counted: DeepSeek's shared experts, q/k-norm gradients), and the expert GEMMs:
    experts a rank, rows per expert, widths."""
    h = values["hidden_size"]
    inter = values.get("moe_intermediate_size") or values["intermediate_size"]
    experts = values.get("num_experts") or values.get("num_local_experts") or values.get("n_routed_experts")
    k = values["num_experts_per_tok"]
    dense = (values.get("first_k_dense_replace") or 0) + len(values.get("mlp_only_layers") or [])
    layers = values["num_hidden_layers"] - dense  # routed layers
    all_layers = values["num_hidden_layers"]
    rows = {}
    for arm in ARMS:
        tp, ep, split, etp = LAYOUT[arm]
        group_tokens = tokens // (WORLD // tp)  # one TP group's (one dp rank's) tokens
        routed = group_tokens // (tp if split else 1)  # tokens this rank dispatches
        ep_bytes = 2 * 2 * routed * k * h * elem * (ep - 1) / ep * layers  # dispatch + combine, fwd and bwd
        tp_bytes = 0 if tp == 1 else (2 * group_tokens * h * elem * all_layers  # attention: output, input's grad
                                      + 2 * group_tokens * h * elem * all_layers  # MLP / experts: the same
                                      + group_tokens * k * elem * layers)  # routing weights' gradient
        m = routed * k * ep / experts
        rows[arm] = {"ep_bytes": ep_bytes, "tp_bytes": tp_bytes, "local_experts": experts // ep,
                     "rows_per_expert": m, "gate_up_width": 2 * inter // (tp if etp else 1),
                     "down_inner_width": inter // (tp if etp else 1),
                     "expert_flops": 2 * 3 * h * (inter // (tp if etp else 1)) * m * (experts // ep) * layers}
    return rows


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--batch", type=int, default=8, help="global rows per step (divisible by 4)")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--experts", default="grouped_mm", help="transformers' experts_implementation")
    ap.add_argument("--arms", default=",".join(ARMS))
    args = ap.parse_args()
    arms = tuple(args.arms.split(","))
    t0 = time.perf_counter()
    ranks = spawn_ranks(_worker, WORLD, arms, args.rounds, args.batch, args.seq, args.experts)
    wall = time.perf_counter() - t0
    base = arms[0]
    measured = {}
    for arm in arms:
        per = [ranks[r][arm] for r in range(WORLD)]
        mean = lambda kind, phase: statistics.mean(p[kind].get(phase, 0) for p in per)  # noqa: E731
        step_s = statistics.median(statistics.median(p["times"]) for p in per)
        measured[arm] = {
            "tp_forward_bytes": mean("tp", "forward"), "tp_backward_bytes": mean("tp", "backward"),
            "tp_backward_param_bytes": mean("tp", "backward_param"),
            "ep_forward_bytes": mean("ep", "forward"), "ep_backward_bytes": mean("ep", "backward"),
            "step_s": step_s, "times_rank0": per[0]["times"], "loss_sum": per[0]["loss_sum"],
            "gate_grad_max_rel_diff_vs_" + base: per[0]["gate_grad_max_rel_diff"],
            "local_expert_shapes": per[0]["local_expert_shapes"]}
    tokens = args.batch * args.seq
    expect = analytic(SCALED, tokens, elem=4)
    for arm in arms:
        m = measured[arm]
        m["ep_bytes"] = m["ep_forward_bytes"] + m["ep_backward_bytes"]
        m["tp_bytes"] = m["tp_forward_bytes"] + m["tp_backward_bytes"] + m["tp_backward_param_bytes"]
        m["ep_bytes_expected_uniform"], m["tp_bytes_expected"] = expect[arm]["ep_bytes"], expect[arm]["tp_bytes"]
        m["gemm"] = {k: expect[arm][k]
                     for k in ("local_experts", "rows_per_expert", "gate_up_width", "down_inner_width")}

    from toolkit.planner.presets import PRESETS

    real_tokens = WORLD * 4096
    real = {name: analytic(PRESETS[name], real_tokens) for name in ANALYTIC}
    meta = {"model": f"{PRESET} scaled", "config": SCALED, "world": WORLD, "backend": "gloo", "dtype": "float32",
            "global_batch": [args.batch, args.seq], "rounds": args.rounds, "experts_implementation": args.experts,
            "threads_per_rank": 1, "machine": f"CPU, {os.cpu_count()} cores", "torch": torch.__version__,
            "python": platform.python_version(), "wall_s": wall,
            "analytic": {"global_tokens": real_tokens, "dtype_bytes": 2, "routing": "uniform"}}
    (BENCH / "etp.json").write_text(__import__("json").dumps(
        {"meta": meta, "measured": measured, "analytic_real": real, "analytic_scaled": expect}, indent=2) + "\n")

    b = measured[base]
    lines = [f"Measured: {PRESET} scaled ({SCALED['num_hidden_layers']} layers, hidden {SCALED['hidden_size']}, "
             f"{SCALED['num_experts']} experts top-{SCALED['num_experts_per_tok']}, moe_intermediate "
             f"{SCALED['moe_intermediate_size']}), global batch {args.batch}x{args.seq}, fp32, 4 gloo ranks, "
             f"median of {args.rounds} interleaved steps; bytes per rank per step, ratios against {base}.", ""]
    lines += md_table(
        ["layout", "TP bytes", "TP / count", "EP bytes", "EP / uniform count", f"TP+EP vs {base}", "EP vs ETP",
         "step s", f"step vs {base}", "experts x (2I, I) a rank", "rows/expert", "loss sum", "router grad diff"],
        [[arm, f"{m['tp_bytes']:,.0f}",
          f"{m['tp_bytes'] / m['tp_bytes_expected']:.4f}" if m["tp_bytes_expected"] else "-",
          f"{m['ep_bytes']:,.0f}", f"{m['ep_bytes'] / m['ep_bytes_expected_uniform']:.3f}",
          f"{(m['tp_bytes'] + m['ep_bytes']) / (b['tp_bytes'] + b['ep_bytes']):.2f}",
          f"{m['ep_bytes'] / measured['tp2_ep2_etp']['ep_bytes']:.2f}" if "tp2_ep2_etp" in measured else "",
          f"{m['step_s']:.3f}", f"{m['step_s'] / b['step_s']:.2f}",
          f"{m['gemm']['local_experts']} x ({m['gemm']['gate_up_width']}, {m['gemm']['down_inner_width']})",
          f"{m['gemm']['rows_per_expert']:.0f}", f"{m['loss_sum']:.4f}",
          f"{m['gate_grad_max_rel_diff_vs_' + base]:.1e}"] for arm, m in measured.items()])
    for name, rows in real.items():
        v = PRESETS[name]
        lines += ["", f"Analytic, {name} (hidden {v['hidden_size']}, "
                  f"{v.get('num_experts') or v.get('num_local_experts') or v.get('n_routed_experts')} experts "
                  f"top-{v['num_experts_per_tok']}): {real_tokens} global tokens a step on 4 ranks, bf16, "
                  "GiB per rank."]
        lines += md_table(["layout", "TP GiB", "EP GiB", "TP+EP GiB", "EP vs ETP", "experts a rank",
                           "rows/expert", "gate_up width", "down inner width"],
                          [[arm, _gib(r["tp_bytes"]), _gib(r["ep_bytes"]), _gib(r["tp_bytes"] + r["ep_bytes"]),
                            f"{r['ep_bytes'] / rows['tp2_ep2_etp']['ep_bytes']:.2f}", r["local_experts"],
                            f"{r['rows_per_expert']:.0f}", r["gate_up_width"], r["down_inner_width"]]
                           for arm, r in rows.items()])
    lines += ["", f"wall {wall:.1f} s (4 processes spawned, models built, {args.rounds} rounds of {len(arms)} arms)"]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
