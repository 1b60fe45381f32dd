"""Config-built models and synthetic token rows: nothing is downloaded.

The tests, the benchmarks and the GPU acceptance run (`benchmarks/gpu/gpu_acceptance.py`, on a machine that
has no hub access and no SmolLM2 package) all need a model that goes through the real
`from_pretrained` path; this builds one from a Llama config with random weights and a small BPE
tokenizer trained here, and saves both as a standard HF folder.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import TYPE_CHECKING


if TYPE_CHECKING:
    from transformers import PretrainedConfig

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly mix potions near "
         "old towers and bright rivers under cold northern skies with purple dragons").split()
SPECIAL_TOKENS = ("<pad>", "</s>", "<s>", "<|im_start|>", "<|im_end|>")


def corpus(n: int = 400, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) for _ in range(n)]


def build_tokenizer(chat_template: str | None = None, vocab_size: int = 384, texts: list[str] | None = None):
    """A byte-level BPE of `vocab_size` tokens trained on `corpus()` (and `texts`: a benchmark's own records, so its
    text splits into about as many tokens as a published tokenizer makes of it), with the usual special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus() + ["<|user|> <|assistant|> <|system|> " * 3] + list(texts or []), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", pad_token="<pad>", bos_token="<s>",
                                   additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    if chat_template:
        fast.chat_template = chat_template
    return fast


def build_model_dir(path: Path, chat_template: str | None = None, device: str = "cpu", **overrides) -> Path:
    """A Llama (2 blocks, hidden 64, GQA unless `overrides` say otherwise) saved with the tokenizer.
    `vocab_size` may exceed the tokenizer's: the extra ids are only ever fed as synthetic rows.
    `device`: where the random init runs (a GPU initializes a 1B model in seconds, a CPU in minutes)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = build_tokenizer(chat_template)
    kw = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=256,
              tie_word_embeddings=False, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
              bos_token_id=tok.bos_token_id)
    kw.update(overrides)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(**kw))
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return Path(path)


def token_rows(n: int, lengths: tuple[int, int], vocab: int, seed: int = 0, prompt: float = 0.5) -> list[dict]:
    """`n` tokenized examples as `toolkit.data.tokenize_examples` returns them: lengths uniform in
    `lengths` (inclusive; equal bounds give rows without padding), ids drawn past the special tokens,
    the first `prompt` fraction of each row masked from the loss as a chat prompt would be."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        length = rng.randint(*lengths)
        ids = [rng.randrange(len(SPECIAL_TOKENS), vocab) for _ in range(length)]
        cut = int(length * prompt)
        rows.append({"input_ids": ids, "labels": [-100] * cut + ids[cut:]})
    return rows


# Tiny random configs of the architectures people finetune (the zoo): each keeps what makes it
# differ from Llama (logit transforms, softcapping, sliding windows, fused projections, MoE routers,
# MLA, attention sinks, GPT-2/NeoX attribute names) at hidden 64, 2 blocks, without dropout (parity runs
# compare layouts step by step). `model_type` -> overrides of transformers' config defaults (`AutoConfig.for_model`).
_SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256)
_WINDOWS = dict(sliding_window=16, layer_types=["sliding_attention", "full_attention"])
ZOO: dict[str, dict] = {
    "llama": dict(_SMALL),
    "qwen3": dict(_SMALL, head_dim=16),
    "gemma2": dict(_SMALL, head_dim=16, query_pre_attn_scalar=16, final_logit_softcapping=5.0,
                   attn_logit_softcapping=10.0, **_WINDOWS),
    "gemma3_text": dict(_SMALL, head_dim=16, query_pre_attn_scalar=16, **_WINDOWS),
    # fused qkv_proj and gate_up_proj
    "phi3": dict(_SMALL),
    "cohere": dict(_SMALL, logit_scale=0.25),
    "granite": dict(_SMALL, logits_scaling=8.0, embedding_multiplier=2.0, residual_multiplier=0.5,
                    attention_multiplier=0.25),
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4, n_positions=256, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0),
    "gpt_neox": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     max_position_embeddings=256, rotary_pct=0.5),
    "mixtral": dict(_SMALL, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
                    router_aux_loss_coef=0.5),
    "qwen3_moe": dict(_SMALL, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      mlp_only_layers=[0], output_router_logits=True, router_aux_loss_coef=0.5),
    "deepseek_v3": dict(_SMALL, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
                        qk_nope_head_dim=8, v_head_dim=16, head_dim=8, n_routed_experts=4, num_experts_per_tok=2,
                        n_shared_experts=1, moe_intermediate_size=32, first_k_dense_replace=1, n_group=1, topk_group=1),
    "gpt_oss": dict(_SMALL, head_dim=16, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
                    output_router_logits=True, router_aux_loss_coef=0.5, **_WINDOWS),
}


def build_zoo_model_dir(path: Path, model_type: str, chat_template: str | None = None, device: str = "cpu",
                        **overrides) -> Path:
    """`ZOO[model_type]`'s tiny random model (or, with `overrides`, another shape of that architecture),
    saved with the tokenizer like `build_model_dir`; `device`: where the random init runs."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    tok = build_tokenizer(chat_template)
    kw = dict(ZOO[model_type], vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
              bos_token_id=tok.bos_token_id, tie_word_embeddings=False)
    kw.update(overrides)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **kw))
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return Path(path)


# Each planner preset (`toolkit.planner.presets`) as a tiny runnable model: the published config with its
# widths shrunk and its structure kept. Kept: the model type, the layer pattern (`layer_types`,
# one period of it at least), which layers are dense and which routed (`mlp_only_layers`,
# `decoder_sparse_step`, `first_k_dense_replace`), shared experts, group-limited routing, GQA against MHA,
# a head_dim apart from hidden/heads, sliding windows (shrunk below the tests' sequence length), biases,
# dropout, tied embeddings, every other published or default value. Shrunk: the widths below, the experts
# to 4 (top 2), the kv heads in the published ratio (at least 1).
_TINY_WIDTHS = dict(hidden_size=64, num_attention_heads=4, intermediate_size=128, moe_intermediate_size=32,
                    vocab_size=384, max_position_embeddings=256, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
                    qk_nope_head_dim=16, v_head_dim=16, sliding_window=16)
_TINY_EXPERTS = dict(num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, n_group=2,
                     topk_group=1)


def tiny_preset(preset: dict) -> PretrainedConfig:
    """The config of a preset's tiny model (`preset`: its published values, `toolkit.planner.presets.PRESETS`;
    its `layer_types` and class defaults resolved as the published model's are; `AutoModelForCausalLM.from_config`
    builds it, `build_zoo_model_dir`'s steps
    save it). The block count: 2, or one period of the layer pattern and the first routed layer, whichever
    is more (Gemma 3's 5 sliding : 1 full, 6 blocks; DeepSeek-V3's 3 dense blocks then a routed one, 4)."""
    from transformers import AutoConfig

    values = dict(preset)
    model_type = values.pop("model_type")
    published = AutoConfig.for_model(model_type, **values)
    kinds = list(getattr(published, "layer_types", None) or [])
    period = next((p for p in range(1, len(kinds) + 1) if all(k == kinds[i % p] for i, k in enumerate(kinds))), 1)
    layers = max(2, period, (getattr(published, "first_k_dense_replace", 0) or 0) + 1,
                 getattr(published, "decoder_sparse_step", 1) or 1)
    tiny = {k: v for k, v in _TINY_WIDTHS.items() if getattr(published, k, None) is not None}
    tiny |= {k: v for k, v in _TINY_EXPERTS.items() if (getattr(published, k, None) or 0) > 1}
    heads, kv = published.num_attention_heads, published.num_key_value_heads or published.num_attention_heads
    tiny["num_key_value_heads"] = max(1, 4 * kv // heads)
    # MLA derives its own
    if getattr(published, "head_dim", None) and "qk_rope_head_dim" not in values:
        tiny["head_dim"] = 16 if published.head_dim * heads == published.hidden_size else 32
    # Gemma: hidden/heads, or the head_dim
    if getattr(published, "query_pre_attn_scalar", None):
        tiny["query_pre_attn_scalar"] = 16 if published.query_pre_attn_scalar == published.hidden_size // heads \
            else tiny.get("head_dim", 16)
    if kinds:
        tiny["layer_types"] = kinds[:layers]
    if getattr(published, "mlp_only_layers", None) is not None:
        tiny["mlp_only_layers"] = [i for i in published.mlp_only_layers if i < layers]
    return AutoConfig.for_model(model_type, **{**values, **tiny, "num_hidden_layers": layers})


def vlm_chat_template(placeholder: str, prefix: str = "") -> str:
    """A chat template in the shape of the hub's image-text ones: content parts, each image written as
    `placeholder` (`prefix`: Jinja put before all)."""
    return (
        prefix + "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
        "{% if c['type'] == 'image' %}" + placeholder + "{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


VLM_CHAT_TEMPLATE = vlm_chat_template("<image>")


def vlm_tokenizer(extra: list[str], vocab_size: int = 384, texts: list[str] | None = None, **named):
    """`build_tokenizer(vocab_size=, texts=)` with `extra` special tokens; `named`: model-specific named tokens
    (Gemma 3's `boi_token`...), which the processor reads as `tokenizer.boi_token` / `tokenizer.image_token_id`."""
    from transformers import PreTrainedTokenizerFast

    tok = build_tokenizer(vocab_size=vocab_size, texts=texts)
    tokens = ["<|im_start|>", "<|im_end|>", *extra]
    tok.add_special_tokens({"additional_special_tokens": tokens})
    if not named:
        return tok
    return PreTrainedTokenizerFast(tokenizer_object=tok.backend_tokenizer, eos_token=tok.eos_token,
                                   pad_token=tok.pad_token, bos_token=tok.bos_token,
                                   additional_special_tokens=tokens, **named)


def vlm_text_config(tok, **kw) -> dict:
    """A tiny image-text model's language model: hidden 64, 2 blocks, 4 heads, 2 kv heads, `tok`'s vocabulary."""
    return dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=256,
                pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id, **kw)


def qwen_vl_config(kind: str, tok, ids: dict, text: dict | None = None, vision: dict | None = None):
    """The config of a Qwen2-VL, Qwen2.5-VL (window attention in the tower, full in its last block) or Qwen3-VL
    (interleaved M-RoPE, the tower's first block's features stacked into the language model's first layers):
    tiny (language model as `vlm_text_config`, tower hidden 32, 2 blocks) unless `text` / `vision` give the
    published sizes."""
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig, Qwen3VLConfig

    marks = dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                 vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    mrope = {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}
    text, vision = text or {}, vision or {}
    if kind == "qwen2_vl":
        return Qwen2VLConfig(text_config={**vlm_text_config(tok, rope_scaling={"type": "mrope",
                                                                               "mrope_section": [2, 3, 3]}), **text},
                             vision_config={**dict(depth=2, embed_dim=32, hidden_size=64, num_heads=4, mlp_ratio=2,
                                                   patch_size=14, spatial_merge_size=2, temporal_patch_size=2),
                                            **vision}, **marks)
    if kind == "qwen2_5_vl":
        return Qwen2_5_VLConfig(text_config={**vlm_text_config(tok, rope_parameters=mrope), **text},
                                vision_config={**dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4,
                                                      out_hidden_size=64, patch_size=14, window_size=56,
                                                      fullatt_block_indexes=[1]), **vision}, **marks)
    return Qwen3VLConfig(text_config={**vlm_text_config(tok, head_dim=16, rope_parameters={
                             **mrope, "mrope_interleaved": True}), **text},
                         vision_config={**dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4,
                                               out_hidden_size=64, patch_size=14, num_position_embeddings=64,
                                               deepstack_visual_indexes=[0]), **vision}, **marks)


def build_qwen_vl_dir(path, kind: str = "qwen2_vl", text: dict | None = None, vision: dict | None = None,
                      pixels: tuple[int, int] = (56 * 56, 112 * 112), device: str = "cpu", dtype=None,
                      tokenizer_vocab: int = 384, tokenizer_texts: list[str] | None = None) -> Path:
    """A Qwen2-VL, Qwen2.5-VL or Qwen3-VL (`kind`; `qwen_vl_config`'s sizes) folder as the hub ships one, written
    file by file (its config, weights, the tests' tokenizer with Qwen's image tokens, `preprocessor_config.json`
    read by both its image and its video processor, `processor_config.json`, the chat template): without
    torchvision its processor cannot be built (its video processor needs it), so `AutoProcessor` fails on it as on
    the real Qwen2-VL-2B, and the toolkit builds it without the video processor (`toolkit.model.vision.
    without_video`). `pixels`: the image processor's min and max pixels (by default 56x56 to 112x112 images: 2x2 to
    4x4 merged 14 px patches, 4 to 16 tokens). `device`: where the random init runs; `dtype`: the saved weights';
    `tokenizer_vocab`, `tokenizer_texts`: the tokenizer's size and extra training text (`build_tokenizer`)."""
    import json

    import torch
    from transformers import AutoModelForImageTextToText
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    marks = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
    tok = vlm_tokenizer(marks, tokenizer_vocab, tokenizer_texts)
    config = qwen_vl_config(kind, tok, {t: tok.convert_tokens_to_ids(t) for t in marks}, text, vision)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForImageTextToText.from_config(config, **({"dtype": dtype} if dtype else {}))
    model.save_pretrained(path, safe_serialization=True)
    del model
    tok.save_pretrained(path)
    Qwen2VLImageProcessorPil(min_pixels=pixels[0], max_pixels=pixels[1],
                             patch_size=config.vision_config.patch_size).save_pretrained(path)
    processor = {"qwen2_vl": "Qwen2VLProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor"}.get(kind, "Qwen3VLProcessor")
    (Path(path) / "processor_config.json").write_text(json.dumps({"processor_class": processor}))
    (Path(path) / "chat_template.jinja").write_text(vlm_chat_template("<|vision_start|><|image_pad|><|vision_end|>"))
    return Path(path)


def build_llava_dir(path: Path, image_size: int = 28, patch_size: int = 14, **text) -> Path:
    """A LLaVA (a CLIP vision tower of 2 blocks, hidden 32; the Llama of `build_model_dir` as its language model)
    saved with its processor: the tests' tokenizer with an `<image>` token, CLIP's image processor resizing to
    `image_size`, `VLM_CHAT_TEMPLATE`. Each image is (image_size / patch_size)^2 tokens."""
    import torch
    from transformers import CLIPImageProcessor, LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor

    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<image>"]})
    size = {"shortest_edge": image_size}
    processor = LlavaProcessor(image_processor=CLIPImageProcessor(size=size, crop_size={"height": image_size,
                                                                                       "width": image_size}),
                               tokenizer=tok, patch_size=patch_size, vision_feature_select_strategy="full",
                               chat_template=VLM_CHAT_TEMPLATE, num_additional_image_tokens=1)
    text_config = {**dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, vocab_size=len(tok),
                          max_position_embeddings=256, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                          bos_token_id=tok.bos_token_id), **text}
    vision_config = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, image_size=image_size, patch_size=patch_size)
    config = LlavaConfig(vision_config=vision_config, text_config=text_config, vision_feature_layer=-1,
                         image_token_index=tok.convert_tokens_to_ids("<image>"), vision_feature_select_strategy="full")
    torch.manual_seed(0)
    LlavaForConditionalGeneration(config).save_pretrained(path, safe_serialization=True)
    processor.save_pretrained(path)
    return Path(path)
