"""Planner parameter counts equal a meta-device instantiation of transformers' own model (every preset,
the zoo's architectures, tiny MoE variants); active counts equal that model's with top-k of each MoE
layer's experts; LoRA counts equal peft's; the plan counts published MoE configs at their published
totals and never picks a layout the run's rules refuse; a rank's parameters under --ep equal what the
run's expert split leaves it."""

import json

import pytest
import torch

from toolkit.planner.params import count_params, lora_params, matmul_params
from toolkit.planner.presets import HUB_IDS, PRESETS
from toolkit.model.synthetic import ZOO

TINY = {
    "tiny-mha-untied": dict(model_type="llama", hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                            num_attention_heads=4, num_key_value_heads=4, vocab_size=300, tie_word_embeddings=False),
    "tiny-gqa-tied-bias": dict(model_type="llama", hidden_size=96, intermediate_size=256, num_hidden_layers=2,
                               num_attention_heads=6, num_key_value_heads=2, vocab_size=1000, tie_word_embeddings=True,
                               attention_bias=True, mlp_bias=True),
    "tiny-headdim": dict(model_type="qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=500,
                         tie_word_embeddings=True),
    # MoE layers where the config says: Qwen-MoE's mlp_only_layers and decoder_sparse_step, DeepSeek's
    # first_k_dense_replace, MLA without q_lora_rank, Qwen2-MoE's shared expert and its gate
    "tiny-qwen3-moe-sparse-step": dict(model_type="qwen3_moe", hidden_size=64, intermediate_size=96,
                                       moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
                                       num_key_value_heads=2, head_dim=16, vocab_size=100, num_experts=8,
                                       num_experts_per_tok=2, mlp_only_layers=[0], decoder_sparse_step=2),
    "tiny-deepseek-v3": dict(model_type="deepseek_v3", hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                             num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, vocab_size=100,
                             n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=2, first_k_dense_replace=1,
                             q_lora_rank=24, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12,
                             n_group=2, topk_group=1),
    "tiny-deepseek-v3-no-q-lora": dict(model_type="deepseek_v3", hidden_size=64, intermediate_size=96,
                                       moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=4, vocab_size=100, n_routed_experts=4, n_shared_experts=1,
                                       num_experts_per_tok=2, first_k_dense_replace=0, q_lora_rank=None,
                                       kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12,
                                       n_group=1, topk_group=1),
    "tiny-qwen2-moe": dict(model_type="qwen2_moe", hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                           shared_expert_intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=100, num_experts=8, num_experts_per_tok=2,
                           mlp_only_layers=[1]),
    "tiny-gpt-oss": dict(model_type="gpt_oss", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=100,
                         num_local_experts=4, num_experts_per_tok=2),
    "tiny-mixtral": dict(model_type="mixtral", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=100, num_local_experts=4,
                         num_experts_per_tok=2),
    "tiny-gemma": dict(ZOO["gemma3_text"], model_type="gemma3_text", vocab_size=100),
}
COUNTED_ZOO = [t for t in ZOO if t not in ("gpt2", "gpt_neox")]  # other block shapes: refused in one line

# Qwen/Qwen3-30B-A3B/config.json as published (copied in alibaba/InferSim, hf_configs/qwen3-30B-A3B_config.json)
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144, "max_position_embeddings": 40960,
    "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
    "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936}


def hf_config(cfg, model_type=None):
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **cfg) if model_type else AutoConfig.for_model(**cfg)


def meta_model(hf):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf)


def unique(model):
    return {id(p): (n, p) for n, p in model.named_parameters(remove_duplicate=False)}.values()


def meta_counts(model, top_k: int, experts: int) -> tuple[int, int]:
    """(every parameter, those one token uses: each stacked expert tensor scaled by top_k / experts)."""
    total = active = 0
    for name, p in unique(model):
        total += p.numel()
        active += p.numel() * top_k // experts if ".mlp.experts." in name else p.numel()
    return total, active


def moe_of(hf) -> tuple[int, int]:
    experts = getattr(hf, "num_local_experts", None) or getattr(hf, "num_experts", None) or 1
    return (getattr(hf, "num_experts_per_tok", None) or 1), experts


CASES = {**{f"preset:{k}": (v, None) for k, v in PRESETS.items()}, **{k: (v, None) for k, v in TINY.items()},
         **{f"zoo:{t}": (ZOO[t], t) for t in COUNTED_ZOO}}


@pytest.mark.parametrize("name", list(CASES))
def test_param_count_matches_meta_model(name):
    """Total and active parameters of every preset (its published config) and architecture against
    transformers' model built on the meta device from the same config; a zoo entry is counted from its
    config's `to_dict()`, as a model folder's config.json reads."""
    cfg, model_type = CASES[name]
    hf = hf_config(cfg, model_type)
    ours = count_params(cfg if model_type is None else hf.to_dict())
    total, active = meta_counts(meta_model(hf), *moe_of(hf))
    assert (ours.total, ours.active) == (total, active)


def test_other_block_shapes_are_refused_in_one_line():
    from toolkit.errors import UserError

    for t in ("gpt2", "gpt_neox"):
        with pytest.raises(UserError, match=f"model type '{t}' has blocks of another shape"):
            count_params(hf_config(ZOO[t], t).to_dict())


@pytest.mark.parametrize("name", ["tiny-qwen3-moe-sparse-step", "tiny-deepseek-v3", "tiny-mixtral", "tiny-gpt-oss",
                                  "preset:qwen3-30b-a3b"])
def test_mfu_counts_the_active_matmul_weights(name):
    """The run's MFU (`toolkit.train.flops.matmul_params_from_config`) counts the weights one token
    multiplies: the meta model's, with top-k of each MoE layer's experts, less the input embedding
    (a lookup)."""
    from toolkit.train.flops import matmul_params_from_config

    cfg, _ = CASES[name]
    hf = hf_config(cfg)
    model = meta_model(hf)
    _, active = meta_counts(model, *moe_of(hf))
    assert matmul_params_from_config(cfg) == active - model.get_input_embeddings().weight.numel()
    assert matmul_params_from_config(cfg) < matmul_params(cfg, active=False)


LORA = [(n, t) for n in ("tiny-mha-untied", "tiny-gqa-tied-bias") for t in ("all-linear", "q_proj,v_proj",
                                                                             "gate_proj,up_proj,down_proj")]
LORA += [(n, t) for n in ("tiny-qwen3-moe-sparse-step", "tiny-qwen2-moe", "tiny-gemma")
         for t in ("all-linear", "q_proj,v_proj", "gate_proj,up_proj,down_proj", "o_proj,down_proj")]
LORA += [("tiny-deepseek-v3", t) for t in ("all-linear", "q_b_proj,kv_b_proj", "gate_proj,up_proj,down_proj")]
LORA += [(n, t) for n in ("tiny-mixtral", "tiny-gpt-oss") for t in ("all-linear", "q_proj,v_proj")]


@pytest.mark.parametrize("name, targets", LORA)
def test_lora_trainable_count_matches_peft(name, targets):
    """peft's trainable parameters for `targets`, including its rewrite of the MoE models whose experts
    transformers 5 stacks (qwen3_moe, deepseek_v3, mixtral): per-expert adapters of gate_up_proj (at twice
    the rank) and down_proj, the router's, and no adapters on the dense layers' gate/up/down_proj."""
    from peft import LoraConfig, get_peft_model

    cfg = TINY[name]
    model = get_peft_model(meta_model(hf_config(cfg)), LoraConfig(
        r=8, target_modules=targets if targets == "all-linear" else targets.split(","), task_type="CAUSAL_LM"))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert lora_params(cfg, 8, targets) == trainable


def part_of(name: str) -> str:
    """Where a parameter of transformers' model (or peft's adapter on it) sits, by its qualified name:
    the planner's `params.PARTS`."""
    import re

    if "self_attn." in name:
        return "attention"
    if re.search(r"\.mlp\.experts\.", name):
        return "experts"
    if re.search(r"\.mlp\.(gate|router|shared_expert_gate)\.", name):
        return "router"
    if ".mlp." in name:
        return "mlp"
    if "embed_tokens" in name:
        return "embeddings"
    if "lm_head" in name:
        return "lm_head"
    assert "norm" in name, name
    return "norms"


@pytest.mark.parametrize("name, targets", [(n, "all-linear") for n in TINY] + [
    ("tiny-qwen2-moe", "gate_proj,up_proj,down_proj"), ("tiny-deepseek-v3", "q_b_proj,kv_b_proj")])
def test_trainable_parts_match_the_model_part_by_part(name, targets):
    """Issue 57: the plan breaks its trainable count down by where the parameters sit (attention, MLP,
    routed experts, routers, norms, embeddings, LM head). Each part equals the sum of the meta model's
    parameters under that part's module names: every parameter for a full finetune, peft's trainable
    ones for LoRA (its adapters on the stacked experts and the router included)."""
    from collections import Counter

    from peft import LoraConfig, get_peft_model

    from toolkit.planner.params import trainable_parts

    cfg = TINY[name]
    full = Counter()
    for n, p in meta_model(hf_config(cfg)).named_parameters():  # a tied head: counted once, as the embedding
        full[part_of(n)] += p.numel()
    assert trainable_parts(cfg, "full") == {k: v for k, v in full.items() if v}
    model = get_peft_model(meta_model(hf_config(cfg)), LoraConfig(
        r=8, target_modules=targets if targets == "all-linear" else targets.split(","), task_type="CAUSAL_LM"))
    lora = Counter()
    for n, p in model.named_parameters():
        if p.requires_grad:
            lora[part_of(n)] += p.numel()
    assert trainable_parts(cfg, "lora", 8, targets) == {k: v for k, v in lora.items() if v}


def test_lora_of_half_a_fused_pair_is_refused_like_peft():
    from peft import LoraConfig, get_peft_model

    cfg = TINY["tiny-qwen3-moe-sparse-step"]
    with pytest.raises(ValueError, match="gate_proj without also targeting up_proj"):
        get_peft_model(meta_model(hf_config(cfg)), LoraConfig(r=8, target_modules=["gate_proj"], task_type="CAUSAL_LM"))
    with pytest.raises(ValueError, match="LoRA target gate_proj needs up_proj"):
        lora_params(cfg, 8, "gate_proj")


def test_plan_counts_published_moe_configs(capsys, tmp_path):
    """`python -m toolkit plan` counts Qwen3-30B-A3B at 30.5B parameters (its published config.json, and
    the preset) and gpt-oss-120b at 116.8B (by hub id): the figures their model cards publish."""
    from toolkit.cli.main import main as cli

    (tmp_path / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    for spec, billions in ((str(tmp_path), 30.5), ("qwen3-30b-a3b", 30.5), ("openai/gpt-oss-120b", 116.8)):
        cli(["plan", "--model", spec, "--method", "lora", "--cpu-memory", "2TB", "--json"])
        assert round(json.loads(capsys.readouterr().out)["params"] / 1e9, 1) == billions, spec
    assert HUB_IDS["openai/gpt-oss-120b"] == "gpt-oss-120b"


def test_plan_asks_the_runs_model_rules(monkeypatch):
    """Every mesh row of a plan for the MoE presets is runnable exactly when the run's own rules
    (`rules.not_runnable`, `rules.model_problems` on the config with its class's TP plan, as
    `parallel.build` gives it) accept it, and the chosen layout is one of those: Qwen3-30B-A3B's tp rows
    are all refused under LoRA (its adapters on the stacked experts) and the choice has no tp. The wiring, shown
    with one rule: a model_problems that refuses every --tp leaves no runnable tp row, each one giving its words."""
    from toolkit.layout import rules
    from toolkit.layout.dims import ParallelDims
    from toolkit.planner import estimate
    from toolkit.planner.explain import plan
    from toolkit.planner.params import with_tp_plan

    def plan_for(name):
        return plan(estimate.PlanInput(model=PRESETS[name], gpu_memory=80 * 2**30, gpus_per_node=8, method="lora",
                                       cpu_memory=2**41))

    for name in ("qwen3-30b-a3b", "gpt-oss-120b", "mixtral-8x7b"):
        p = plan_for(name)
        for c in p.strategies:
            if c.dims is None:
                continue
            d = ParallelDims(8, **c.dims)
            accepted = not rules.not_runnable(d, "lora", "bf16", "auto") and not rules.model_problems(
                with_tp_plan(PRESETS[name]), d.tp, d.pp, d.cp, 8, "lora", ep=d.ep)
            assert c.runnable == accepted, (name, c.name, c.why_not)
        assert p.chosen_detail is None or p.chosen_detail.runnable
        if name == "qwen3-30b-a3b":
            assert not any(c.runnable for c in p.strategies if c.dims and c.dims["tp"] > 1)
            assert (p.chosen_detail.dims or {}).get("tp", 1) == 1

    def refuse_tp(cfg, tp, pp, cp, world, method, ep=1):
        return [f"--tp {tp}: refused for this test"] if tp > 1 else []

    monkeypatch.setattr(estimate, "model_problems", refuse_tp)
    p = plan_for("qwen3-30b-a3b")
    tp_rows = [c for c in p.strategies if c.dims and c.dims["tp"] > 1]
    assert tp_rows and all(not c.runnable for c in tp_rows)
    assert all(c.why_not == f"--tp {c.dims['tp']}: refused for this test" or c.why_not == rules.not_runnable(
        ParallelDims(8, **c.dims), "lora", "bf16", "auto") for c in tp_rows)
    assert not (p.chosen_detail.dims or {}).get("tp", 1) > 1


def test_tp_plan_read_from_source_is_the_config_class_attribute():
    """The planner reads a config class's `base_model_tp_plan` and `base_model_pp_plan` from
    transformers' source (no import of transformers, which imports torch); each equals the class
    attribute for every preset's and zoo architecture's model type. GPT-2 declares no pipeline plan:
    the planner offers it no --pp row (the run refuses one)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from toolkit.layout.rules import model_problems
    from toolkit.planner.params import MODEL_PLANS, with_tp_plan

    for model_type in sorted({c["model_type"] for c in PRESETS.values()} | set(ZOO)):
        read = with_tp_plan({"model_type": model_type})
        for attr in MODEL_PLANS:
            assert read[attr] == getattr(CONFIG_MAPPING[model_type], attr), (model_type, attr)
    gpt2 = with_tp_plan({"model_type": "gpt2", "num_hidden_layers": 4})
    assert model_problems(gpt2, 1, 2, 1, 2) == ["--pp 2: model type gpt2 declares no base_model_pp_plan; --pp needs it"]
    assert not model_problems(with_tp_plan({"model_type": "llama", "num_hidden_layers": 4}), 1, 2, 1, 2)


@pytest.mark.parametrize("rank", [0, 1])
def test_expert_parallel_rank_params_equal_the_split_model(monkeypatch, rank):
    """The planner's parameters per rank under --ep 2 --dp-shard 2 before FSDP2 shards them
    (`layouts.stage_params`: E/ep experts per MoE layer, and their LoRA adapters) equal what
    `toolkit.parallel.ep.apply_expert_parallel` leaves on a rank of the zoo's Qwen3-MoE (4 experts, its
    first layer dense), full and LoRA (r 8, all-linear: peft's adapters on the stacked experts). The
    split needs only the group's size and this rank (no collective): those are given, on the meta
    device, instead of launching 2 gloo ranks."""
    import torch.distributed as dist
    from peft import LoraConfig, get_peft_model

    from toolkit.layout.dims import ParallelDims
    from toolkit.parallel.ep import apply_expert_parallel
    from toolkit.planner.layouts import stage_params

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: rank)
    hf = hf_config(ZOO["qwen3_moe"], "qwen3_moe")
    d = ParallelDims(2, dp_shard=2, ep=2)
    for method in ("full", "lora"):
        model = meta_model(hf)
        if method == "lora":
            model = get_peft_model(model, LoraConfig(r=8, target_modules="all-linear", task_type="CAUSAL_LM"))
        apply_expert_parallel(model, None)
        params = [p for _, p in unique(model)]
        ours = stage_params(hf.to_dict(), d, 0, method, 8, "all-linear")
        assert ours.experts and ours.params < count_params(hf.to_dict()).total  # the split is counted
        base = ours.params + (ours.trainable if method == "lora" else 0)  # LoRA: the base, then its adapters
        assert (base, ours.trainable) == (sum(p.numel() for p in params),
                                          sum(p.numel() for p in params if p.requires_grad)), method


@pytest.mark.parametrize("rank", [0, 1])
def test_expert_parallel_over_tp_rank_params_equal_the_split_model(monkeypatch, rank):
    """--tp 2 --ep 2 (the ep group is the TP group): the planner's parameters per rank before FSDP2
    (`layouts.stage_params`: the dense blocks 1/tp, E/ep whole experts, no TP cut of them) and the
    gathered block (`layouts.gathered_block`) equal what TP (experts skipped) then EP leave on a rank of
    the zoo's Qwen3-MoE (its first layer dense), full finetune, on the meta device."""
    import torch.distributed as dist

    from toolkit.layout.dims import ParallelDims
    from toolkit.parallel.ep import apply_expert_parallel
    from toolkit.parallel.tp import apply_tensor_parallel
    from toolkit.planner.layouts import gathered_block, stage_params

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: rank)
    hf = hf_config(ZOO["qwen3_moe"], "qwen3_moe")
    d = ParallelDims(4, dp_shard=2, tp=2, ep=2)
    model = meta_model(hf)
    apply_tensor_parallel(model, None, skip_experts=True)
    apply_expert_parallel(model, None)
    params = [p for _, p in unique(model)]
    ours = stage_params(hf.to_dict(), d, 0, "full", 8, "all-linear")
    assert ours.params == sum(p.numel() for p in params)
    experts = [p for n, p in model.named_parameters() if ".experts." in n]
    assert ours.experts == sum(p.numel() for p in experts)
    blocks = model.model.layers
    assert gathered_block(hf.to_dict(), d) == max(sum(p.numel() for p in b.parameters()) for b in blocks)


def test_the_kv_cache_term_is_the_cache_sampling_fills(tiny_model):
    """--objective grpo's sampling holds a KV cache (`memory.kv_cache_bytes`): the bytes of the cache a forward
    over 3 rows of 20 tokens fills, in fp32 and bf16, as transformers' DynamicCache holds them; and a plan for
    grpo counts sampling's peak where it is the larger (a short sequence, many long completions)."""
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    from toolkit.planner.memory import kv_cache_bytes
    from toolkit.planner.estimate import PlanInput, estimate
    from toolkit.planner.memory import STRATEGIES

    for dtype, size in ((torch.float32, 4), (torch.bfloat16, 2)):
        model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=dtype)
        cache = DynamicCache(config=model.config)
        model(input_ids=torch.ones(3, 20, dtype=torch.long), cache=cache, past_key_values=cache, use_cache=True)
        held = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
        c = model.config
        head = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        assert kv_cache_bytes(c.num_hidden_layers, c.num_key_value_heads * head, 3, 20, size) == held
    cfg = {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
           "num_key_value_heads": 8, "vocab_size": 128256}
    base = dict(model=cfg, gpu_memory=80 << 30, gpus_per_node=1, seq_len=128, micro_batch=1, precision="bf16")
    plain = estimate(PlanInput(**base), STRATEGIES["ddp"], False, 1)
    sampling = estimate(PlanInput(**base, generation=(64, 8192)), STRATEGIES["ddp"], False, 1)
    kv = kv_cache_bytes(16, 8 * 64, 64, 8192, 2)
    assert sampling.bytes["allocated"] > plain.bytes["allocated"]
    assert sampling.bytes["allocated"] >= sampling.bytes["weights"] + sampling.bytes["optimizer"] + kv
