"""Predicted activation bytes vs what autograd actually saves (saved_tensors_hooks), tiny Llama."""

import pytest
import torch

from toolkit.planner.memory import activation_elements_per_token

CFG = dict(hidden_size=128, intermediate_size=352, num_hidden_layers=3, num_attention_heads=4,
           num_key_value_heads=2, vocab_size=512, tie_word_embeddings=False)


def saved_bytes(batch: int, seq: int, checkpointing: bool) -> int:
    """Bytes of distinct storages autograd keeps for backward, parameters excluded."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from toolkit.models import enable_checkpointing

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CFG, attn_implementation="sdpa"))
    model.config.use_cache = False
    if checkpointing:
        enable_checkpointing(model)
    model.train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen.setdefault(st.data_ptr(), st.nbytes())
        return t

    ids = torch.randint(0, CFG["vocab_size"], (batch, seq))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids)
    return sum(seen.values())


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("batch, seq", [(1, 64), (2, 128), (4, 256), (1, 512)])
def test_activation_formula_within_15_percent(batch, seq, checkpointing):
    h, i = CFG["hidden_size"], CFG["intermediate_size"]
    kv = CFG["num_key_value_heads"] * h // CFG["num_attention_heads"]
    predicted = 4 * batch * seq * activation_elements_per_token(CFG["num_hidden_layers"], h, i, kv, checkpointing)
    assert saved_bytes(batch, seq, checkpointing) == pytest.approx(predicted, rel=0.15)
