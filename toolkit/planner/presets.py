"""Public architectures' configs (the fields the planner reads), copied from each model's
config.json on the Hugging Face hub, so planning needs no download."""

from __future__ import annotations

from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    "smollm2-135m": dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True,
                         max_position_embeddings=8192),
    "llama-3-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False,
                       max_position_embeddings=8192),
    "llama-3-70b": dict(model_type="llama", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                        num_attention_heads=64, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False,
                        max_position_embeddings=8192),
    "llama-3.1-405b": dict(model_type="llama", hidden_size=16384, intermediate_size=53248, num_hidden_layers=126,
                           num_attention_heads=128, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False,
                           max_position_embeddings=131072),
    "mistral-7b": dict(model_type="mistral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, vocab_size=32000, tie_word_embeddings=False,
                       max_position_embeddings=32768),
    "qwen2.5-7b": dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False,
                       max_position_embeddings=32768),
    "qwen2.5-72b": dict(model_type="qwen2", hidden_size=8192, intermediate_size=29568, num_hidden_layers=80,
                        num_attention_heads=64, num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False,
                        max_position_embeddings=32768),
}

# Llama 3.1: Llama 3's shapes, trained to 131072 positions
PRESETS["llama-3.1-8b"] = {**PRESETS["llama-3-8b"], "max_position_embeddings": 131072}
PRESETS["llama-3.1-70b"] = {**PRESETS["llama-3-70b"], "max_position_embeddings": 131072}

# hub ids (base and instruct: the same shapes) -> preset, so a run's YAML plans without a download
HUB_IDS: dict[str, str] = {
    **{f"HuggingFaceTB/SmolLM2-135M{s}": "smollm2-135m" for s in ("", "-Instruct")},
    **{f"meta-llama/Meta-Llama-3-8B{s}": "llama-3-8b" for s in ("", "-Instruct")},
    **{f"meta-llama/Meta-Llama-3-70B{s}": "llama-3-70b" for s in ("", "-Instruct")},
    **{f"meta-llama/Llama-3.1-8B{s}": "llama-3.1-8b" for s in ("", "-Instruct")},
    **{f"meta-llama/Llama-3.1-70B{s}": "llama-3.1-70b" for s in ("", "-Instruct")},
    **{f"meta-llama/Llama-3.1-405B{s}": "llama-3.1-405b" for s in ("", "-Instruct")},
    **{f"mistralai/Mistral-7B-{s}": "mistral-7b" for s in ("v0.1", "v0.3", "Instruct-v0.3")},
    **{f"Qwen/Qwen2.5-7B{s}": "qwen2.5-7b" for s in ("", "-Instruct")},
    **{f"Qwen/Qwen2.5-72B{s}": "qwen2.5-72b" for s in ("", "-Instruct")},
}

# GPUs people have: (memory as the vendor quotes it, in GB; the time model's preset, None where there is
# none: the step times then assume the default h100-sxm and say so)
GPU_PRESETS: dict[str, tuple[int, str | None]] = {
    "l4": (24, None), "a10g": (24, None), "rtx3090": (24, None), "rtx4090": (24, None),
    "a100-40gb": (40, "a100-80gb"), "a100-80gb": (80, "a100-80gb"), "l40s": (48, "l40s"),
    "h100": (80, "h100-sxm"), "h200": (141, "h100-sxm"),
}
