"""The expert load (toolkit.router_load): tokens per expert counted by hooks on the experts modules equal
the top-k of the routers' own logits (the model's `output_router_logits`), real tokens only, training
forwards only, once per forward under gradient checkpointing; and the record's ratios."""

from __future__ import annotations

import pytest
import torch

from toolkit.router_load import RouterLoad, experts_modules, load_stats
from toolkit.synthetic import ZOO


def tiny(model_type: str, **overrides):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **{**ZOO[model_type], "vocab_size": 97, **overrides})
    return AutoModelForCausalLM.from_config(config).train()


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3"])
def test_counts_are_the_routers_top_k_over_real_tokens(model_type):
    model = tiny(model_type)
    load = RouterLoad.attach(model)
    assert load is not None and len(load.handles) - 1 == len(experts_modules(model)) >= 1
    ids = torch.randint(0, 97, (3, 12))
    mask = torch.ones_like(ids)
    mask[1, 7:], mask[2, 4:] = 0, 0  # padded rows
    out = model(input_ids=ids, attention_mask=mask, output_router_logits=True)
    out.logits.sum().backward()
    counts = load.take(torch.device("cpu"))
    k, experts = model.config.num_experts_per_tok, load.experts
    assert counts.shape == (len(experts_modules(model)), experts)
    assert counts.sum(1).tolist() == [mask.sum().item() * k] * len(counts)  # each real token to k experts
    if model_type in ("qwen3_moe", "mixtral"):  # against the model's own router logits, layer by layer
        real = mask.reshape(-1).bool()
        for layer, logits in zip(counts, out.router_logits):
            chosen = logits.topk(k, dim=-1).indices[real]
            assert layer.tolist() == torch.bincount(chosen.reshape(-1), minlength=experts).double().tolist()
    assert load.take(torch.device("cpu")).sum() == 0  # taken: zeros until the next training forward
    with torch.no_grad():  # evaluation, a reference or a KL forward: not training's routing
        model(input_ids=ids, attention_mask=mask)
    assert load.take(torch.device("cpu")).sum() == 0


def test_a_checkpointed_block_is_counted_once():
    model = tiny("qwen3_moe")
    ids = torch.randint(0, 97, (2, 10))
    load = RouterLoad.attach(model)
    model(input_ids=ids).logits.sum().backward()
    plain = load.take(torch.device("cpu"))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model(input_ids=ids).logits.sum().backward()  # the blocks' forwards run again inside backward
    assert torch.equal(load.take(torch.device("cpu")), plain)


def test_dense_models_have_no_experts_to_count():
    assert RouterLoad.attach(tiny("llama")) is None


def test_load_stats_are_shares_of_each_layers_mean():
    counts = torch.tensor([[10.0, 10.0, 10.0, 10.0], [0.0, 5.0, 15.0, 20.0], [0.0, 0.0, 0.0, 0.0]])
    stats = load_stats(counts)  # the third layer saw no token (another stage's): left out
    assert stats["expert_load_min"] == 0.0 and stats["expert_load_max"] == 2.0
    cv = torch.tensor([0.0, 5.0, 15.0, 20.0]).std(unbiased=False).item() / 10.0
    assert stats["expert_load_cv"] == pytest.approx(cv / 2)
    assert load_stats(torch.zeros(2, 4)) == {}
