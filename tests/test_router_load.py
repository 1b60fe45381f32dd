"""The expert load (toolkit.model.router_load): tokens per expert counted by hooks on the experts modules equal
the top-k of the routers' own logits (the model's `output_router_logits`), real tokens only, training
forwards only, once per forward under gradient checkpointing; and the record's ratios."""

from __future__ import annotations

import pytest
import torch
from helpers import random_model, records

from toolkit.model.router_load import RouterLoad, experts_modules, load_stats
from toolkit.model.synthetic import ZOO


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3"])
def test_counts_are_the_routers_top_k_over_real_tokens(model_type):
    model = random_model(model_type, **ZOO[model_type], vocab_size=97).train()
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
    model = random_model("qwen3_moe", **ZOO["qwen3_moe"], vocab_size=97).train()
    ids = torch.randint(0, 97, (2, 10))
    load = RouterLoad.attach(model)
    model(input_ids=ids).logits.sum().backward()
    plain = load.take(torch.device("cpu"))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model(input_ids=ids).logits.sum().backward()  # the blocks' forwards run again inside backward
    assert torch.equal(load.take(torch.device("cpu")), plain)


def test_dense_models_have_no_experts_to_count():
    assert RouterLoad.attach(random_model("llama", **ZOO["llama"], vocab_size=97).train()) is None


def test_load_stats_are_shares_of_each_layers_mean():
    counts = torch.tensor([[10.0, 10.0, 10.0, 10.0], [0.0, 5.0, 15.0, 20.0], [0.0, 0.0, 0.0, 0.0]])
    stats = load_stats(counts)  # the third layer saw no token (another stage's): left out
    assert stats["expert_load_min"] == 0.0 and stats["expert_load_max"] == 2.0
    cv = torch.tensor([0.0, 5.0, 15.0, 20.0]).std(unbiased=False).item() / 10.0
    assert stats["expert_load_cv"] == pytest.approx(cv / 2)
    assert load_stats(torch.zeros(2, 4)) == {}


def test_idle_experts_are_said_only_where_the_window_could_not_leave_them_empty_by_chance():
    """An expert without a token counts once its layer's experts averaged IDLE_MIN_MEAN tokens in the
    window (an even router leaves one empty there with chance e^-32); a smaller window says nothing."""
    from toolkit.model.router_load import IDLE_MIN_MEAN, idle_experts, idle_warning, layer_label

    assert IDLE_MIN_MEAN == 32
    counts = torch.tensor([[0.0, 64.0, 64.0, 0.0], [32.0] * 4, [0.0, 0.0, 20.0, 20.0], [0.0] * 4])
    assert idle_experts(counts) == {0: 2}  # the third layer's mean is 10: too few tokens to tell
    assert idle_experts(counts, min_mean=10) == {0: 2, 2: 2}
    line = idle_warning(counts, ["layer 1", "layer 2", "layer 3", "layer 4"], step=7)
    assert line.startswith("expert load: the window ending at step 7 routed no token to 2 of 4 experts in layer 1 "
                           "(1 of 4 MoE layers), where an even spread gives each expert at least 32 tokens")
    assert idle_warning(torch.full((2, 4), 40.0), ["layer 0", "layer 1"], step=7) is None
    assert layer_label("model.layers.3.mlp.experts") == "layer 3"


def test_a_run_whose_router_sends_every_token_to_one_expert_says_so_once(tmp_path, data_files, capsys):
    """A tiny gpt-oss (its router has a bias) whose routers' bias makes expert 0 win every token (top-1):
    the run trains, expert_load_min is 0 in every record, and one line names the idle experts of both
    MoE layers, once, though every logged window has them."""
    from safetensors.torch import load_file, save_file

    import finetune
    from toolkit.model.synthetic import build_zoo_model_dir

    model = build_zoo_model_dir(tmp_path / "model", "gpt_oss", num_experts_per_tok=1)
    (weights,) = model.glob("*.safetensors")
    state = load_file(weights)
    for name in [n for n in state if ".mlp.router." in n]:
        state[name] = torch.zeros_like(state[name])
        if name.endswith("bias"):
            state[name][0] = 10.0  # the logits are the bias alone: expert 0 first for every token
    save_file(state, weights, metadata={"format": "pt"})
    out = tmp_path / "out"
    capsys.readouterr()
    finetune.main(["--model", str(model), "--dataset", str(data_files["alpaca"]), "--output-dir", str(out),
                   "--seq-len", "64", "--max-steps", "4", "--log-every", "2", "--micro-batch-size", "8",
                   "--mixed-precision", "no", "--method", "full", "--report-to", "none", "--verify", "none"])
    loads = [r["expert_load_min"] for r in records(out, "loss")]
    assert len(loads) == 2 and set(loads) == {0.0}
    said = [x for x in capsys.readouterr().out.splitlines() if x.startswith("expert load:")]
    assert len(said) == 1, said
    assert "routed no token to 3 of 4 experts in layer 0, 3 of 4 in layer 1 (2 of 2 MoE layers)" in said[0]
