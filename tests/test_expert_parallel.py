"""Expert parallel (issue 49): each MoE layer's experts split over the ranks of an ep group, tokens sent to
their experts' ranks and back by all-to-all (`toolkit.parallel.ep`).

The model-level check runs the zoo's four MoE architectures (Qwen3-MoE, Mixtral, DeepSeek-V3, gpt-oss:
stacked [E, 2I, H] experts, gpt-oss's transposed with biases), full and LoRA (peft's ParamWrapper on the
stacked experts where peft converts the targets), on 2 gloo ranks that read different tokens, as
data-parallel ranks do. Against the unsplit model on the same tokens: the model's own loss (its router
load-balancing loss included) and logits within 1e-5, and every gradient, summed over the ranks as FSDP
reduces them, within 1e-5 (an expert's gradient comes from every rank's tokens routed to it, so its
owner's equals the unsplit sum).
"""

from __future__ import annotations

import json

import pytest
import torch
from distributed import run_distributed
from helpers import losses, records

MOE = ("qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss")


def _init():
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    return dist


def _build(model_type: str, method: str):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from toolkit.model.synthetic import ZOO

    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **{**ZOO[model_type], "vocab_size": 96, "tie_word_embeddings": False})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    if method == "lora":  # B random too (init_lora_weights=False), so every adapter's gradient is non-zero
        model = get_peft_model(model, LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0, target_modules="all-linear",
                                                 init_lora_weights=False))
    return model


def _ep_against_unsplit(tp: int = 1) -> dict:
    """Per (arch, method): the largest differences of loss, logits and gradients, and what was split.
    tp > 1: `parallelize`'s TP then EP, the ep group the TP group: TP leaves the experts whole, EP splits
    them over the TP pair, each TP rank dispatching half of the pair's tokens."""
    dist = _init()
    from toolkit.layout.dims import ParallelDims
    from toolkit.parallel.cut import full_state_dict
    from toolkit.parallel.mesh import Mesh
    from toolkit.parallel.parallelize import Parallelism, parallelize
    from toolkit.parallel.traffic import counting

    world = dist.get_world_size()
    mesh = Mesh(ParallelDims(world, dp_shard=world // tp, tp=tp, ep=world // tp if tp == 1 else tp), "cpu")
    group, dp = mesh.group("ep"), mesh.group("dp_shard")
    tp_group = mesh.group("tp") if tp > 1 else None
    out = {}
    for model_type in MOE if tp == 1 else ("qwen3_moe", "mixtral", "deepseek_v3"):
        for method in ("full", "lora") if tp == 1 else ("full",):
            ref = _build(model_type, method)
            ep, cut = parallelize(_build(model_type, method), Parallelism(tp_group=tp_group, ep_group=group))
            split, shards = cut.cuts, cut.experts  # the run's table of cuts (`toolkit.parallel.cut`)
            experts = {n for n, c in split.items() if c.ep is not None}
            assert not any(c.ep is not None and c.tp is not None for c in split.values())
            g = torch.Generator().manual_seed(mesh.local_rank("dp_shard"))  # data-parallel ranks: other tokens
            ids = torch.randint(4, 96, (2, 16), generator=g)
            with counting("ep") as traffic:
                got, want = ep(input_ids=ids, labels=ids), ref(input_ids=ids, labels=ids)
                got.loss.backward()
                want.loss.backward()
            diffs = {"loss": (got.loss - want.loss).abs().item(),
                     "logits": (got.logits - want.logits).abs().max().item()}
            ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
            assert {n for n, p in ep.named_parameters() if p.grad is not None} == set(ref_grads), model_type
            grads = full_state_dict(_Grads(ep), split)  # TP slices or EP slices, gathered
            worst = 0.0
            for name, full in ref_grads.items():
                full = full.clone()
                dist.all_reduce(full, group=dp)  # what FSDP sums over the data-parallel ranks
                mine = grads[name].clone()
                # an expert's owner already holds every data-parallel rank's tokens' sum where the ep group is
                # dp_shard; under TP (the ep group is the TP pair) its experts' sum over dp_shard is FSDP's
                if name not in experts or tp > 1:
                    dist.all_reduce(mine, group=dp)
                worst = max(worst, (mine - full).abs().max().item())
            gathered = full_state_dict(ep, split)
            weights = max((gathered[k] - v).abs().max().item() for k, v in ref.state_dict().items())
            out[f"{model_type}/{method}"] = {**diffs, "grad": worst, "weights": weights,
                                             "split": sorted(experts), "line": shards.line,
                                             "sent": traffic["forward"], "returned": traffic["backward"]}
    dist.destroy_process_group()
    return out


class _Grads:
    """A model's gradients where `full_state_dict` reads its state dict."""

    def __init__(self, model):
        self.model = model

    def state_dict(self) -> dict:
        return {n: p.grad for n, p in self.model.named_parameters() if p.grad is not None}


@pytest.fixture(scope="module")
def ep2():
    return run_distributed(_ep_against_unsplit, 2, timeout=600)


@pytest.fixture(scope="module")
def ep2_tp2():
    return run_distributed(_ep_against_unsplit, 4, 2, timeout=600)


@pytest.mark.parametrize("method", ["full", "lora"])
@pytest.mark.parametrize("model_type", MOE)
def test_expert_parallel_equals_the_unsplit_model(ep2, model_type, method):
    for rank, result in enumerate(ep2):
        r = result[f"{model_type}/{method}"]
        assert r["loss"] < 1e-5 and r["logits"] < 1e-5, (rank, r)
        assert r["grad"] < 1e-5, (rank, r)
        assert r["weights"] == 0, (rank, r)  # the slices gathered are the full model's weights
        assert r["split"] and all(".experts." in n for n in r["split"]), r["split"]
        assert "2 of 4 experts each per rank" in r["line"], r["line"]
        assert r["sent"] > 0 and r["returned"] > 0  # tokens crossed ranks, both ways


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_expert_parallel_inside_tensor_parallel_equals_the_unsplit_model(ep2_tp2, model_type):
    """--tp 2 x --ep 2 on 4 ranks: the experts whole, split over the TP pair (the ep group is the TP group),
    each TP rank dispatching half the pair's tokens, the outputs summed over TP; the same checks, the
    experts' gradients summed over dp_shard as FSDP2 sums them."""
    for rank, result in enumerate(ep2_tp2):
        r = result[f"{model_type}/full"]
        assert r["loss"] < 1e-5 and r["logits"] < 1e-5 and r["grad"] < 1e-5 and r["weights"] == 0, (rank, r)
        assert r["sent"] > 0
        assert "expert parallel over the TP group's 2 ranks" in r["line"] and "2 of 4 experts" in r["line"], r["line"]


def _all_to_rank_zero() -> dict:
    """`_no_tokens_on_rank_one` under each experts implementation, in one process group."""
    dist = _init()
    out = {impl: _no_tokens_on_rank_one(dist, impl) for impl in ("eager", "grouped_mm", "batched_mm")}
    dist.destroy_process_group()
    return out


def _no_tokens_on_rank_one(dist, implementation: str) -> float:
    """Every token routed to rank 0's experts (0 and 1 of 4): rank 1 receives none. The experts module
    alone under `implementation`, forward and backward on each rank's own tokens, against the unsplit
    module: outputs, input gradients and (gathered) weight gradients; the largest relative difference."""
    from torch import nn

    from toolkit.parallel.ep import apply_expert_parallel
    from transformers import AutoConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from toolkit.model.synthetic import ZOO

    config = AutoConfig.for_model("qwen3_moe", **ZOO["qwen3_moe"])
    config._experts_implementation = implementation
    holder = nn.Module()
    torch.manual_seed(0)
    whole = Qwen3MoeExperts(config)
    for p in whole.parameters():
        torch.nn.init.normal_(p, std=0.1)
    holder.experts = Qwen3MoeExperts(config)
    holder.experts.load_state_dict(whole.state_dict())
    cuts = {}
    apply_expert_parallel(holder, dist.group.WORLD, cuts)
    g = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(6, config.hidden_size, generator=g)
    index = torch.tensor([[0, 1], [1, 0]] * 3)
    weights = torch.rand(6, 2, generator=g)
    xs = [x.clone().requires_grad_() for _ in range(2)]
    got, want = holder.experts(xs[0], index, weights), whole(xs[1], index, weights)
    got.square().sum().backward()
    want.square().sum().backward()

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a - b).abs().max() / b.abs().max()).item()

    worst = max(rel(got, want), rel(xs[0].grad, xs[1].grad))
    for name, p in holder.experts.named_parameters():
        full = whole.get_parameter(name).grad.clone()
        dist.all_reduce(full)
        worst = max(worst, rel(cuts[f"experts.{name}"].gather(p.grad), full))
    return worst


def test_a_rank_that_receives_no_tokens_still_exchanges_and_reduces():
    """Rank 1's experts get no token, under eager, grouped_mm and batched_mm: its dispatch and combine
    still run both ways (no hang), its experts' gradients are zeros, and both ranks' results equal the
    unsplit module's within 1e-5 (relative to the largest value)."""
    for rank in run_distributed(_all_to_rank_zero, 2, timeout=180):
        assert all(worst < 1e-5 for worst in rank.values()) and len(rank) == 3, rank


# ---------------------------------------------------------------- finetune.py under --ep

AUX0 = ["--router-aux-loss-coef", "0"]  # one process's router loss is over all its tokens: off where compared to it
PARITY = ["--max-steps", "4", *AUX0]
TOL = 1e-4  # relative, per-step losses (fp32; the experts' sums in another order)
# Qwen3-30B-A3B's structure as published (every layer routed: mlp_only_layers [], decoder_sparse_step 1), each
# layout with the global batch of 8 of the one-process run: name -> (ranks, flags)
ROUTED = {"ep2": (2, ["--ep", "2", "--micro-batch-size", "2", "--grad-accum", "2"]),
          "tp2": (2, ["--tp", "2", "--micro-batch-size", "4", "--grad-accum", "2"]),
          "ep2_tp2": (4, ["--ep", "2", "--tp", "2", "--micro-batch-size", "2", "--grad-accum", "2"])}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_files, tiny_model):
    """Three launches (1, 2 and 4 ranks) of tiny Qwen3-MoE and Mixtral models (4 experts): one process
    with micro-batch 8; --ep 2 (micro-batch 2 x accumulation 2 x 2 ranks), also against --dp-shard 2
    with the router loss on; --ep 2 x --dp-shard 4 (experts sharded again over 2 ranks each) and --ep 4
    resuming the --ep 2 run's checkpoint-2; --ep 2 with --cp 2 (experts sharded over dp_shard_mod_ep x cp) and
    with HSDP (--dp-replicate 2), inside --tp 2, and on the stages of --pp 2. And a Qwen3-MoE with every
    layer routed (`routed`: no dense MLP for the TP plan's `mlp` entries to match) under `ROUTED`'s
    layouts, in the same launches."""
    from distributed import launch_layouts

    from toolkit.model.synthetic import build_zoo_model_dir

    root = tmp_path_factory.mktemp("ep")
    models = {t: str(build_zoo_model_dir(root / t, t)) for t in ("qwen3_moe", "mixtral")}
    common = ["--dataset", str(data_files["alpaca"]), "--seq-len", "64", "--log-every", "1", "--lr", "1e-3",
              "--warmup-steps", "0", "--mixed-precision", "no", "--seed", "7", "--report-to", "none",
              "--lora-dropout", "0"]
    q = ["--model", models["qwen3_moe"]]
    one = {f"qwen3_moe-{m}-one": [*q, "--method", m, "--micro-batch-size", "8", *PARITY] for m in ("full", "lora")}
    two = {f"qwen3_moe-{m}-ep2": [*q, "--method", m, "--ep", "2", "--micro-batch-size", "2", "--grad-accum", "2",
                                  *PARITY, "--save-every", "2"] for m in ("full", "lora")}
    # the next run of the launch resumes it on plain FSDP2 (no ep): experts whole again, sharded over dp_shard
    two["qwen3_moe-full-shard2_resumed"] = [*q, "--method", "full", "--dp-shard", "2", "--micro-batch-size", "2",
                                            "--grad-accum", "2", *PARITY, "--resume",
                                            str(root / "ranks2" / "qwen3_moe-full-ep2" / "checkpoint-2")]
    two.update({f"{t}-{m}-{name}": ["--model", models[t], "--method", m, *flags, "--micro-batch-size", "2",
                                    "--max-steps", "3",
                                    *(["--experts", "eager"] if t == "mixtral" else [])]  # its local experts in a loop
                for t, m in (("qwen3_moe", "full"), ("mixtral", "full"), ("mixtral", "lora"))
                for name, flags in (("ep2_aux", ["--ep", "2"]), ("shard2_aux", ["--dp-shard", "2"]))})
    # bf16 (FSDP2's policy: the experts gathered in bf16, the routing weights as the router made them)
    two.update({f"qwen3_moe-full-{name}_bf16": [*q, "--method", "full", *flags, "--micro-batch-size", "2",
                                                "--max-steps", "3", "--mixed-precision", "bf16"]
                for name, flags in (("ep2", ["--ep", "2"]), ("shard2", ["--dp-shard", "2"]))})
    pairs = root / "pairs.jsonl"  # DPO under --ep: the policy's and the reference's forwards route over ranks
    rows = json.loads(data_files["alpaca"].read_text())  # each answer chosen, the next record's rejected
    pairs.write_text("".join(json.dumps({"prompt": r["instruction"], "chosen": r["output"], "rejected": n["output"]})
                             + "\n" for r, n in zip(rows, rows[1:])))
    two.update({f"qwen3_moe-lora-dpo_{name}": [*q, "--dataset", str(pairs), "--method", "lora", "--objective", "dpo",
                                               *flags, "--micro-batch-size", "2", "--max-steps", "2", *AUX0]
                for name, flags in (("ep2", ["--ep", "2"]), ("shard2", ["--dp-shard", "2"]))})
    two["llama-full-ep2"] = ["--model", str(tiny_model), "--method", "full", "--ep", "2", "--max-steps", "1"]  # dense
    routed = ["--model", str(build_zoo_model_dir(root / "routed", "qwen3_moe", mlp_only_layers=[]))]  # as published
    one.update({f"routed-{m}-one": [*routed, "--method", m, "--micro-batch-size", "8", *PARITY]
                for m in ("full", "lora")})
    two.update({f"routed-{m}-{name}": [*routed, "--method", m, *flags, *PARITY] for m in ("full", "lora")
                for name, (ranks, flags) in ROUTED.items() if ranks == 2})
    out = {}
    for n, group in ((1, one), (2, two)):
        out.update(launch_layouts(root / f"ranks{n}", common, group, nproc=n, launcher="fork"))
    four = {f"qwen3_moe-{m}-ep2_shard4": [*q, "--method", m, "--ep", "2", "--dp-shard", "4", "--micro-batch-size", "2",
                                          *PARITY] for m in ("full", "lora")}
    four["qwen3_moe-full-ep2_cp2"] = [*q, "--method", "full", "--ep", "2", "--cp", "2", "--micro-batch-size", "2",
                                      "--grad-accum", "2", *PARITY]
    four["qwen3_moe-lora-ep2_hsdp"] = [*q, "--method", "lora", "--ep", "2", "--dp-shard", "2", "--dp-replicate", "2",
                                       "--micro-batch-size", "2", *PARITY]
    four["qwen3_moe-full-ep2_tp2"] = [*q, "--method", "full", "--ep", "2", "--tp", "2", "--micro-batch-size", "2",
                                      "--grad-accum", "2", *PARITY, "--save-every", "2"]
    # the next run of the launch resumes it with the experts over dp_shard instead of the TP pair
    four["qwen3_moe-full-ep2_tp2_resumed"] = [*q, "--method", "full", "--ep", "2", "--dp-shard", "4",
                                              "--micro-batch-size", "2", *PARITY, "--resume",
                                              str(root / "ranks4" / "qwen3_moe-full-ep2_tp2" / "checkpoint-2")]
    four.update({f"routed-{m}-{name}": [*routed, "--method", m, *flags, *PARITY] for m in ("full", "lora")
                 for name, (ranks, flags) in ROUTED.items() if ranks == 4})
    four.update({f"qwen3_moe-{m}-ep2_pp2": [*q, "--method", m, "--ep", "2", "--pp", "2", "--pp-microbatches", "2",
                                            "--micro-batch-size", "2", "--grad-accum", "2", *PARITY]
                 for m in ("full", "lora")})
    four.update({f"qwen3_moe-{m}-ep4_resumed": [*q, "--method", m, "--ep", "4", "--micro-batch-size", "2", *PARITY,
                                                "--resume", str(out[f"qwen3_moe-{m}-ep2"]["out"] / "checkpoint-2")]
                 for m in ("full", "lora")})
    out.update(launch_layouts(root / "ranks4", common, four, nproc=4, timeout=1200))
    return out


def _norms(run) -> list[float]:
    return [r["grad_norm"] for r in records(run["out"], "grad_norm")]


def _ran(run) -> str:
    said, err = run["stdout"].read_text(), run["stderr"].read_text()
    assert run["exit"] == 0 and "Traceback" not in err, err[-3000:]
    return said


# what each layout's experts are FSDP2-sharded over (the ranks that hold the same experts; under --tp the ep group is
# the TP pair, so the dense parts' dp_shard ranks at the same TP coordinate hold the same experts)
EXPERT_SHARDS = {"ep2": "over dp_shard_mod_ep: 1 rank(s)", "ep2_shard4": "over dp_shard_mod_ep: 2 rank(s)",
                 "ep2_cp2": "over dp_shard_mod_ep_cp: 2 rank(s)", "ep2_tp2": "over dp_shard: 2 rank(s)",
                 "ep2_pp2": "over dp_shard_mod_ep: 1 rank(s)",
                 "ep2_hsdp": "over dp_replicate x dp_shard_mod_ep: 2 rank(s)"}


@pytest.mark.parametrize(("method", "layout"), [("full", "ep2"), ("lora", "ep2"), ("full", "ep2_shard4"),
                                                ("lora", "ep2_shard4"), ("full", "ep2_cp2"), ("lora", "ep2_hsdp"),
                                                ("full", "ep2_tp2"), ("full", "ep2_pp2"), ("lora", "ep2_pp2")])
def test_expert_parallel_runs_match_one_process(runs, method, layout):
    """Same seed and data: each step's loss within 1e-4 of one process's; the saved folder reloads in
    plain transformers/peft with the trained loss (the run's own integrity check)."""
    said = _ran(runs[f"qwen3_moe-{method}-{layout}"])
    assert "2 of 4 experts each per rank, tokens dispatched and combined by all-to-all" in said, said[-2000:]
    assert EXPERT_SHARDS[layout] in said, said[-2000:]
    assert "reloads with plain transformers/peft" in said
    want = dict(losses(runs[f"qwen3_moe-{method}-one"]["out"], steps=True))
    assert len(want) == 4
    assert dict(losses(runs[f"qwen3_moe-{method}-{layout}"]["out"], steps=True)) == pytest.approx(want, rel=TOL)
    # the gradient norm: every part's squares summed over the groups that split it (the experts' over ep)
    assert _norms(runs[f"qwen3_moe-{method}-{layout}"]) == pytest.approx(_norms(runs[f"qwen3_moe-{method}-one"]),
                                                                        rel=TOL)


@pytest.mark.parametrize("method", ["full", "lora"])
@pytest.mark.parametrize("layout", list(ROUTED))
def test_every_layer_routed_as_published_trains_like_one_process_or_is_refused_in_one_line(runs, layout, method):
    """Qwen3-30B-A3B's structure as published: every layer routed, so the TP plan's dense-MLP entries
    (`layers.*.mlp.gate_proj` ...) match no block, which is no refusal. Each step's loss and gradient norm
    within TOL (1e-4 relative, as the other --ep and --tp x --ep runs here) of one process's: fp32 on the
    same 8 examples a step, only the experts' sums in another order (TP all-reduces the halves of every
    expert's intermediate, EP runs a token's experts on the rank that holds them); a top-k choice that
    rounding flipped would move a step's loss by far more. LoRA under --tp is refused in one line before
    any step, naming the piece that is missing (TP does not split the adapters on the stacked experts)."""
    run = runs[f"routed-{method}-{layout}"]
    if method == "lora" and "tp" in layout:
        err = run["stderr"].read_text()
        lines = [x for x in err.splitlines() if x.startswith("finetune.py: error:")]
        assert run["exit"] == 2 and "Traceback" not in err and len(lines) == 1, err[-3000:]
        assert "--tp 2 with --method lora: qwen3_moe's LoRA adapts its stacked experts, which TP does not split yet" \
            in lines[0], lines[0]
        assert not (run["out"] / "metrics.jsonl").exists()
        return
    said = _ran(run)
    if layout == "tp2":  # the routed experts split, and no dense MLP region applied
        assert "mlp.experts gate_up_proj -> down_proj (every expert's intermediate)" in said, said[-2000:]
        assert "mlp gate_proj" not in said, said[-2000:]
    if layout == "ep2_tp2":  # the experts whole, split over the TP pair by expert parallel
        assert "mlp.experts whole (expert parallel over the TP group)" in said, said[-2000:]
        assert "every expert's intermediate" not in said and "mlp gate_proj" not in said, said[-2000:]
        assert "expert parallel over the TP group's 2 ranks" in said, said[-2000:]
    if "ep" in layout:
        assert "2 of 4 experts each per rank" in said, said[-2000:]
    want = dict(losses(runs[f"routed-{method}-one"]["out"], steps=True))
    assert len(want) == 4 and dict(losses(run["out"], steps=True)) == pytest.approx(want, rel=TOL)
    assert _norms(run) == pytest.approx(_norms(runs[f"routed-{method}-one"]), rel=TOL)


@pytest.mark.parametrize(("model_type", "method"), [("qwen3_moe", "full"), ("mixtral", "full"), ("mixtral", "lora")])
def test_the_router_loss_under_expert_parallel_equals_the_data_parallel_ranks(runs, model_type, method):
    """With the router load-balancing loss on (the zoo's coefficient 0.5), --ep 2 trains what --dp-shard 2
    trains: each rank's router loss over its own tokens, the experts' outputs equal; the expert load
    the same too. Mixtral's with --experts eager (the local experts in a loop), Qwen3-MoE's grouped_mm."""
    ep, shard = runs[f"{model_type}-{method}-ep2_aux"], runs[f"{model_type}-{method}-shard2_aux"]
    said = _ran(ep) + _ran(shard)
    implementation = "eager" if model_type == "mixtral" else "grouped_mm"  # --experts eager, or transformers' choice
    assert said.count(f"experts: {implementation} (transformers' experts_implementation)") == 2, said[-2000:]
    assert dict(losses(ep["out"], steps=True)) == pytest.approx(dict(losses(shard["out"], steps=True)), rel=TOL)
    load = [[r["expert_load_cv"] for r in records(x["out"], "loss")] for x in (ep, shard)]
    assert load[0] == pytest.approx(load[1], rel=TOL)


def test_bf16_under_expert_parallel_trains_what_fsdp2_trains(runs):
    """bf16 under FSDP2's policy, the router loss on: --ep 2's losses within 1e-3 of --dp-shard 2's (the
    experts' sums in another order, rounded to bf16 between them; measured 3e-5 at step 3, 2026-11-26)."""
    ep, shard = runs["qwen3_moe-full-ep2_bf16"], runs["qwen3_moe-full-shard2_bf16"]
    _ran(ep), _ran(shard)
    got, want = dict(losses(ep["out"], steps=True)), dict(losses(shard["out"], steps=True))
    assert len(got) == 3 and got == pytest.approx(want, rel=1e-3)


def test_dpo_under_expert_parallel_equals_the_data_parallel_ranks(runs):
    """LoRA DPO: the policy's forward and its reference (the adapters off) both route over the ep group;
    step 1 is ln 2 and both steps equal --dp-shard 2's."""
    ep, shard = runs["qwen3_moe-lora-dpo_ep2"], runs["qwen3_moe-lora-dpo_shard2"]
    _ran(ep), _ran(shard)
    got, want = dict(losses(ep["out"], steps=True)), dict(losses(shard["out"], steps=True))
    assert got[1] == pytest.approx(0.6931472, abs=1e-6) and got == pytest.approx(want, rel=TOL)


def test_ep_on_a_dense_model_is_refused_in_one_line_before_the_weights_load(runs):
    run = runs["llama-full-ep2"]
    err = run["stderr"].read_text()
    lines = [x for x in err.splitlines() if x.startswith("finetune.py: error:")]
    assert run["exit"] == 2 and "Traceback" not in err and len(lines) == 1, err[-3000:]
    assert "--ep 2: model type llama has no routed experts" in lines[0]
    assert not (run["out"] / "metrics.jsonl").exists()


@pytest.mark.parametrize(("method", "resumed"), [("full", "ep4_resumed"), ("lora", "ep4_resumed"),
                                                 ("full", "shard2_resumed"), ("full", "ep2_tp2_resumed")])
def test_a_checkpoint_of_ep2_resumes_on_another_ep_or_dp_degree(runs, method, resumed):
    """checkpoint-2 of the --ep 2 run (each rank's two experts, LoRA's adapters on them split alike)
    resumed on 4 ranks holding one expert each, or on 2 ranks without ep (every expert, FSDP2-sharded);
    and the --ep 2 --tp 2 run's (the experts split over the TP pair) resumed under --ep 2 --dp-shard 4
    (over dp_shard pairs): steps 3 and 4 equal the uninterrupted one-process run's."""
    said = _ran(runs[f"qwen3_moe-{method}-{resumed}"])
    assert ("1 of 4 experts each per rank" in said) == (resumed == "ep4_resumed")
    got = dict(losses(runs[f"qwen3_moe-{method}-{resumed}"]["out"], steps=True))
    want = dict(losses(runs[f"qwen3_moe-{method}-one"]["out"], steps=True))
    assert sorted(got) == [3, 4]
    assert got == pytest.approx({s: want[s] for s in (3, 4)}, rel=TOL)


# ---------------------------------------------------------------- what --ep refuses, in one line each

def test_ep_is_borrowed_from_dp_shard_and_refused_where_it_does_not_compose():
    from toolkit.layout.dims import ParallelDims
    from toolkit.layout.flags import ParallelConfig
    from toolkit.layout.rules import dims_for, ep_problems, layout_problems

    dims, problems = dims_for(ParallelConfig(ep=2), 2, 2)  # --ep alone: FSDP2 over the ranks, ep borrowed from them
    assert not problems and (dims.dp_shard, dims.ep, dims.dp_replicate) == (2, 2, 1)
    assert dims.describe() == "dp_shard 2 x ep 2 (in dp_shard)"
    _, problems = dims_for(ParallelConfig(ep=2), 1, 1)
    assert problems == ["--ep 2 needs at least 2 data-parallel ranks to split the experts over (ep borrows them "
                        "from dp_shard); this launch has 1 process: launch with torchrun --nproc_per_node 2"]
    assert ParallelDims(6, dp_shard=3, ep=2).problems()[0].endswith("; use --ep 3")
    assert ParallelDims(8, dp_shard=4, dp_replicate=2, ep=4).problems() == []

    def refused(**flags) -> list[str]:
        return layout_problems(ParallelConfig(**flags), flags.pop("method", "full"), "no", "auto", 2)

    assert refused(ep=2, zero_stage=3)[0] == ("--ep 2 with --zero-stage 3 is not supported; expert parallel runs on "
                                              "the device mesh, with --dp-shard (FSDP2), --dp-replicate, --cp, --tp "
                                              "and --pp (drop one of them)")
    assert layout_problems(ParallelConfig(ep=2), "qlora", "no", "auto", 2) == [
        "--ep 2 with --method qlora is not supported (4-bit weights are not sharded); use --method lora"]
    assert refused(ep=2, cp=2) == refused(ep=2, tp=2) == refused(ep=2, dp_shard=4, dp_replicate=2) == []
    # under --tp the ep group is the TP group (no expert cut over TP): --ep must equal --tp, one line
    assert refused(ep=4, tp=2) == refused(ep=4, tp=2, dp_shard=2) == [
        "--ep 4 with --tp 2 is not supported; under tensor parallel the experts are split over the TP group itself "
        "(each expert whole, each TP rank dispatching its share of the tokens), so --ep must equal --tp: use --ep 2 "
        "--tp 2, or drop --tp (--ep 4 then borrows from --dp-shard)"]
    assert refused(ep=2, tp=4)[0].startswith("--ep 2 with --tp 4 is not supported;")
    dims, problems = dims_for(ParallelConfig(ep=2, tp=2), 2, 2)  # the TP pair is the ep group: no dp_shard needed
    assert not problems and (dims.tp, dims.ep, dims.dp_shard) == (2, 2, 1)
    assert dims.describe() == "tp 2 x ep 2 (the tp group)"
    assert refused(ep=2, pp=2, pp_microbatches=2) == []
    assert layout_problems(ParallelConfig(ep=2), "full", "no", "auto", 2, compiled=True) == [
        "--compile with --ep 2 is not supported yet (the experts' token exchange reads its counts on the host inside "
        "the block); drop one of them"]
    assert ep_problems({"model_type": "llama"}, 2) == [
        "--ep 2: model type llama has no routed experts (none of num_local_experts, num_experts, n_routed_experts "
        "in its config); drop --ep"]
    assert ep_problems({"model_type": "qwen3_moe", "num_experts": 6}, 4) == [
        "--ep 4 must divide the model's 6 experts per layer; use a divisor of 6"]
    assert ep_problems({"model_type": "qwen3_moe", "num_experts": 6}, 3) == []


def _ep_groups(world: int = 4, degrees: dict | None = None) -> dict:
    import torch.distributed as dist

    from toolkit.layout.dims import ParallelDims
    from toolkit.parallel.mesh import Mesh

    dist.init_process_group("gloo")
    mesh = Mesh(ParallelDims(world, **(degrees or {"dp_shard": 4, "ep": 2})), "cpu")
    experts = mesh.expert_fsdp()
    out = {"ep": dist.get_process_group_ranks(mesh.group("ep")), "experts_mesh": experts.mesh.tolist(),
           "experts": dist.get_process_group_ranks(experts.get_group()) if experts.ndim == 1 else None,
           "dense": dist.get_process_group_ranks(mesh.group("dp_shard"))}
    dist.destroy_process_group()
    return out


def test_hsdp_cp_ep_shards_the_experts_over_replicas_and_cp_ranks_of_the_same_experts():
    """dp_replicate 2 x dp_shard 2 x cp 2 with ep 2 (8 ranks, rank = 4 r + 2 s + c): the ep groups pair the
    dp_shard ranks; the experts of ep coordinate s shard over its cp ranks, replicated across dp_replicate."""
    got = run_distributed(_ep_groups, 8, 8, dict(dp_replicate=2, dp_shard=2, cp=2, ep=2))
    assert [g["ep"] for g in got] == [[0, 2], [1, 3], [0, 2], [1, 3], [4, 6], [5, 7], [4, 6], [5, 7]]
    assert [g["experts_mesh"] for g in got] == [[[0, 1], [4, 5]], [[0, 1], [4, 5]], [[2, 3], [6, 7]],
                                                [[2, 3], [6, 7]]] * 2


def test_an_ep_group_is_consecutive_dp_shard_ranks_and_the_experts_shard_across_groups():
    """dp_shard 4 x ep 2: ranks {0,1} and {2,3} exchange tokens; ranks 0 and 2 hold the same experts and
    FSDP2 shards them over {0,2}; the dense parts over all four."""
    got = run_distributed(_ep_groups, 4)
    assert [g["ep"] for g in got] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [g["experts"] for g in got] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert all(g["dense"] == [0, 1, 2, 3] for g in got)


def test_experts_flag_on_a_dense_model_is_one_line_before_the_weights_load(tiny_model, tmp_path):
    from toolkit.config import parse_config
    from toolkit.errors import UserError
    from toolkit.model.load import check_model

    cfg = parse_config(["--model", str(tiny_model), "--experts", "eager", "--output-dir", str(tmp_path / "o")])
    with pytest.raises(UserError, match=r"^--experts eager: LlamaForCausalLM has no routed experts; "
                                        r"leave the flag out$"):
        check_model(cfg, str(tiny_model))
