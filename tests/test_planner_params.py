"""Planner parameter counts equal a meta-device instantiation; LoRA counts equal peft's."""

import pytest
import torch

from toolkit.planner.params import count_params, lora_params
from toolkit.planner.presets import PRESETS

CONFIGS = {
    **{name: PRESETS[name] for name in ("smollm2-135m", "llama-3-8b", "mistral-7b", "qwen2.5-7b")},
    "tiny-mha-untied": dict(model_type="llama", hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                            num_attention_heads=4, num_key_value_heads=4, vocab_size=300, tie_word_embeddings=False),
    "tiny-gqa-tied-bias": dict(model_type="llama", hidden_size=96, intermediate_size=256, num_hidden_layers=2,
                               num_attention_heads=6, num_key_value_heads=2, vocab_size=1000, tie_word_embeddings=True,
                               attention_bias=True, mlp_bias=True),
    "tiny-headdim": dict(model_type="qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=500,
                         tie_word_embeddings=True),
}


def meta_model(cfg):
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = AutoConfig.for_model(**cfg)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf)


def unique_numel(model) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


@pytest.mark.parametrize("name", list(CONFIGS))
def test_param_count_matches_meta_model(name):
    cfg = CONFIGS[name]
    assert count_params(cfg).total == unique_numel(meta_model(cfg))


@pytest.mark.parametrize("targets", ["all-linear", "q_proj,v_proj", "gate_proj,up_proj,down_proj"])
@pytest.mark.parametrize("name", ["tiny-mha-untied", "tiny-gqa-tied-bias"])
def test_lora_trainable_count_matches_peft(name, targets):
    from peft import LoraConfig, get_peft_model

    cfg = CONFIGS[name]
    model = get_peft_model(meta_model(cfg), LoraConfig(
        r=8, target_modules=targets if targets == "all-linear" else targets.split(","), task_type="CAUSAL_LM"))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert lora_params(cfg, 8, targets) == trainable
