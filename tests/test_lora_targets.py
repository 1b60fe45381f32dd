"""LoRA's targets by behaviour (issue 57): a module that subclasses nn.Linear but does not return one tensor
of its width (an MoE router's scores and logits) is left out of the targets, found by running its forward on
meta tensors; every architecture transformers ships with one trains LoRA; peft's false rank_pattern warning
on fused MoE experts stays off the quiet console."""

from __future__ import annotations

import json
import math
import re
import warnings
from pathlib import Path

import pytest
import torch
from helpers import build_tokenizer, random_model, save_model_dir

from toolkit.config import parse_config
from toolkit.errors import UserError
from toolkit.model.load import ModelShape, apply_lora
from toolkit.model.lora import check_lora_targets, untargetable_linears

_SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, vocab_size=384)
# every nn.Linear subclass in transformers' modeling files (transformers 5.24) -> the tiny config of an
# architecture whose instance LoRA must leave alone, or None where it returns its tensor (a target as any Linear)
LINEAR_SUBCLASSES: dict[str, tuple[str, dict] | None] = {
    "Llama4Router": ("llama4_text", dict(_SMALL, head_dim=16, num_local_experts=4, num_experts_per_tok=1,
                                         intermediate_size_mlp=128, interleave_moe_layer_step=1)),
    "PhimoeTopKRouter": ("phimoe", dict(_SMALL, num_local_experts=4, num_experts_per_tok=2)),
    # a tensor, but grouped: (..., groups, out / groups), which peft's (..., out) delta cannot be added to
    "DeepseekV4GroupedLinear": ("deepseek_v4", dict(_SMALL, num_attention_heads=8, num_key_value_heads=1, head_dim=16,
                                                    q_lora_rank=32, moe_intermediate_size=32, num_experts_per_tok=2,
                                                    n_routed_experts=4, n_shared_experts=1, o_groups=8, o_lora_rank=16,
                                                    index_n_heads=2, index_head_dim=16, index_topk=8, sliding_window=16,
                                                    num_nextn_predict_layers=0)),
    "FalconLinear": None, "DoryLMHead": None, "EsmFoldLinear": None, "IdeficsDecoupledLinear": None,
}
REFUSED = {name: spec for name, spec in LINEAR_SUBCLASSES.items() if spec is not None}


def linear_subclasses() -> set[str]:
    """The classes transformers' modeling files derive from nn.Linear (read, not imported), and those derived
    from them."""
    import transformers

    texts = [f.read_text() for f in (Path(transformers.__file__).parent / "models").glob("*/modeling_*.py")]
    found: set[str] = set()
    bases = {"nn.Linear", "torch.nn.Linear"}
    while True:
        pattern = re.compile(rf"^class (\w+)\((?:{'|'.join(map(re.escape, bases))})\):", re.MULTILINE)
        more = {name for text in texts for name in pattern.findall(text)} - found
        if not more:
            return found
        found |= more
        bases |= more


def test_every_linear_subclass_transformers_ships_is_known():
    """A new one (a transformers upgrade) is named here: give it a tiny config above if LoRA must leave it alone."""
    assert linear_subclasses() == set(LINEAR_SUBCLASSES)


@pytest.mark.parametrize("cls", sorted(REFUSED))
def test_lora_leaves_a_linear_that_breaks_its_contract_and_trains(cls):
    """Exactly that class's modules are left out; LoRA applies to the rest and a forward and backward run
    (on the old targets peft wrapped them and the forward crashed: 'tuple' object has no attribute 'dtype')."""
    model_type, kw = REFUSED[cls]
    model = random_model(model_type, **kw).float()
    skipped = untargetable_linears(model)
    assert skipped and set(skipped.values()) == {cls}
    assert {n for n, m in model.named_modules() if type(m).__name__ == cls} == set(skipped)
    leaf = next(iter(skipped)).rsplit(".", 1)[-1]
    with pytest.raises(UserError, match=f"--lora-targets {leaf}: {cls} subclasses nn.Linear but does not return"):
        check_lora_targets(model, [leaf])
    shape = ModelShape.of(parse_config(["--model", "unused", "--lora-r", "4", "--lora-alpha", "8"]))
    peft_model = apply_lora(model, shape)
    for name in skipped:
        assert type(peft_model.get_base_model().get_submodule(name)).__name__ == cls  # not wrapped
    x = torch.randint(5, 300, (2, 12))
    out = peft_model(input_ids=x, labels=x)
    out.loss.backward()
    trained = [n for n, p in peft_model.named_parameters() if p.grad is not None]
    assert math.isfinite(out.loss.item()) and trained and all("lora_" in n for n in trained)


def test_a_linear_subclass_that_returns_its_tensor_stays_a_target():
    """Falcon's Linear (its own bias add) returns one tensor of its width: LoRA wraps it as any Linear."""
    model = random_model("falcon", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=384).float()
    assert not untargetable_linears(model)
    peft_model = apply_lora(model, ModelShape.of(parse_config(["--model", "unused"])))
    assert any(type(m).__name__ == "FalconLinear" for n, m in peft_model.named_modules() if n.endswith("base_layer"))


def test_a_router_model_trains_lora_end_to_end(tmp_path, data_files, capsys):
    """PhiMoE (its router returns logits, weights and experts) through finetune.py: LoRA trains, final/ reloads."""
    import finetune

    tok = build_tokenizer()
    model_type, kw = REFUSED["PhimoeTopKRouter"]
    model = random_model(model_type, **dict(kw, vocab_size=len(tok), pad_token_id=tok.pad_token_id,
                                            eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)).float()
    folder = save_model_dir(tmp_path / "phimoe", model, tok)
    out = tmp_path / "out"
    finetune.main(["--model", str(folder), "--dataset", str(data_files["alpaca"]), "--output-dir", str(out),
                   "--max-steps", "2", "--seq-len", "64", "--micro-batch-size", "2", "--report-to", "none"])
    said = capsys.readouterr().out
    assert "reloads with plain transformers/peft" in said
    config = json.loads((out / "final" / "adapter_config.json").read_text())
    assert config["exclude_modules"] and all(n.endswith("mlp.router") for n in config["exclude_modules"])


def test_peft_rank_pattern_false_alarm_stays_off_the_quiet_console(tmp_path, data_files):
    """LoRA on Qwen3-MoE: peft gives the fused gate_up_proj experts twice the rank and then warns that the
    pattern matched nothing (it checks modules, not the parameters it targets). The adapter holds that rank;
    the run prints no such warning; a pattern of the user's own that matches nothing still warns."""
    import finetune
    from safetensors.torch import load_file

    from toolkit import console
    from toolkit.model.synthetic import build_zoo_model_dir

    model = build_zoo_model_dir(tmp_path / "qwen3_moe", "qwen3_moe")
    out = tmp_path / "out"
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        finetune.main(["--model", str(model), "--dataset", str(data_files["alpaca"]), "--output-dir", str(out),
                       "--max-steps", "1", "--seq-len", "64", "--micro-batch-size", "2", "--lora-r", "4",
                       "--report-to", "none"])
        console.quiet()
        mine = [r".*\.gate_up_proj", "mine"]
        warnings.warn(f"The following rank_pattern keys did not match any targeted module and were ignored: {mine}.",
                      RuntimeWarning)
    said = [str(w.message) for w in seen if "_pattern keys did not match" in str(w.message)]
    assert said == ["The following rank_pattern keys did not match any targeted module and were ignored: "
                    "['.*\\\\.gate_up_proj', 'mine']."]
    config = json.loads((out / "final" / "adapter_config.json").read_text())
    assert config["rank_pattern"] == {r".*\.gate_up_proj": 8}
    weights = load_file(out / "final" / "adapter_model.safetensors")
    gate_up = [v for k, v in weights.items() if "experts" in k and "lora_A" in k and v.shape[1] == 64]
    experts = 4
    assert gate_up and all(v.shape[0] == experts * 8 for v in gate_up)  # rank 8 = 2 x --lora-r on each expert
