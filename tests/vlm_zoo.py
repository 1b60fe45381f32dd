"""Tiny random image-text models of the architectures people finetune, each saved with its REAL processor.

`build_vlm_dir(path, kind)` follows `toolkit.model.synthetic.build_llava_dir`: the tests' BPE tokenizer
(`build_tokenizer()`) plus the special tokens the processor needs, a chat template in the style of
`VLM_CHAT_TEMPLATE` that writes the placeholder this processor expects, a language model of hidden 64,
2 blocks, 4 heads, 2 kv heads, and a vision tower of hidden 32, 2 blocks, on tiny images. Nothing is
downloaded; no torchvision is needed (transformers falls back to its PIL image processors).

kind            placeholder in the rendered text               tokens per image in input_ids
"idefics3"      <image>                                         <fake><global-img> 4x<image> <fake>  (6)
"gemma3"        <start_of_image>                                \n\n <boi> 4x<image_soft_token> <eoi> \n\n
"mllama"        <|image|>                                       1 (<|image|>; cross-attention to the tiles)
"paligemma"     <image>                                         4x<image> <bos> before the text (a prefix-LM)
"qwen2_vl"      <|vision_start|><|image_pad|><|vision_end|>     <|vision_start|> n x <|image_pad|> <|vision_end|>
"qwen2_5_vl"    (the same)                                      (n: the image's merged 28 px patches; M-RoPE)
"qwen3_vl"      (the same)
"""

from __future__ import annotations

from pathlib import Path

from toolkit.model.synthetic import build_tokenizer

QWEN = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
KINDS = ("idefics3", "gemma3", "mllama", "paligemma", *QWEN)
_CHAT = ("<|im_start|>", "<|im_end|>")


def vlm_chat_template(placeholder: str, prefix: str = "") -> str:
    """`VLM_CHAT_TEMPLATE` with `placeholder` written for each image part (`prefix`: Jinja put before all)."""
    return (
        prefix + "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
        "{% if c['type'] == 'image' %}" + placeholder + "{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _tokenizer(extra: list[str], **named):
    """`build_tokenizer()` with `extra` special tokens; `named`: model-specific named tokens (Gemma 3's
    `boi_token`...), which the processor reads as `tokenizer.boi_token` / `tokenizer.image_token_id`."""
    from transformers import PreTrainedTokenizerFast

    tok = build_tokenizer()
    tokens = [*_CHAT, *extra]
    tok.add_special_tokens({"additional_special_tokens": tokens})
    if not named:
        return tok
    return PreTrainedTokenizerFast(tokenizer_object=tok.backend_tokenizer, eos_token=tok.eos_token,
                                   pad_token=tok.pad_token, bos_token=tok.bos_token,
                                   additional_special_tokens=tokens, **named)


def _text(tok, **kw) -> dict:
    return dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=256,
                pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id, **kw)


def _idefics3(image_size: int = 56, patch_size: int = 14):
    """SmolVLM's shape: no image splitting, each image resized to `image_size` square; pixel shuffle
    (scale 2) makes (image_size / patch_size / 2)^2 = 4 `<image>` tokens, between `<fake_token_around_image>
    <global-img>` and `<fake_token_around_image>`."""
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3ImageProcessorPil, \
        Idefics3Processor

    tok = _tokenizer(["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"])
    scale = 2
    seq_len = (image_size // patch_size) ** 2 // scale ** 2
    edge = {"longest_edge": image_size}
    image_processor = Idefics3ImageProcessorPil(size=edge, max_image_size=edge, do_image_splitting=False)
    processor = Idefics3Processor(image_processor=image_processor, tokenizer=tok, image_seq_len=seq_len,
                                  chat_template=vlm_chat_template("<image>"))
    config = Idefics3Config(
        text_config=dict(_text(tok), model_type="llama", tie_word_embeddings=False),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           image_size=image_size, patch_size=patch_size),
        scale_factor=scale, image_token_id=tok.convert_tokens_to_ids("<image>"), pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False)
    return Idefics3ForConditionalGeneration, config, processor


def _gemma3(image_size: int = 56, patch_size: int = 14, tokens_per_image: int = 4):
    """A SigLIP tower on `image_size` squares whose (image_size / patch_size)^2 patches the projector
    pools to `tokens_per_image` soft tokens; the text holds `<start_of_image>`, the processor expands it
    to `\\n\\n<start_of_image>` + soft tokens + `<end_of_image>\\n\\n` and returns `token_type_ids` (1 on the
    soft tokens: the model's bidirectional image attention and, in training, a required input)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3ImageProcessorPil, \
        Gemma3Processor

    boi, eoi, soft = "<start_of_image>", "<end_of_image>", "<image_soft_token>"
    tok = _tokenizer([boi, eoi, soft], boi_token=boi, eoi_token=eoi, image_token=soft)
    image_processor = Gemma3ImageProcessorPil(size={"height": image_size, "width": image_size},
                                              do_pan_and_scan=False)
    processor = Gemma3Processor(image_processor=image_processor, tokenizer=tok, image_seq_length=tokens_per_image,
                                chat_template=vlm_chat_template(boi))
    text = _text(tok, head_dim=16, query_pre_attn_scalar=16, sliding_window=16,
                 layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=True)
    config = Gemma3Config(
        text_config=dict(text, model_type="gemma3_text"),
        vision_config=dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=4, image_size=image_size, patch_size=patch_size,
                           vision_use_head=False),
        mm_tokens_per_image=tokens_per_image, boi_token_index=tok.convert_tokens_to_ids(boi),
        eoi_token_index=tok.convert_tokens_to_ids(eoi), image_token_index=tok.convert_tokens_to_ids(soft),
        tie_word_embeddings=True)
    return Gemma3ForConditionalGeneration, config, processor


def _mllama(tile_size: int = 28, patch_size: int = 14, max_tiles: int = 2):
    """Llama 3.2 Vision's shape: one `<|image|>` token per image in the text (the template starts with
    `bos_token`, so the processor adds none), the image cut into up to `max_tiles` tiles of `tile_size`;
    text block 1 cross-attends to the tiles through the processor's `cross_attention_mask`."""
    from transformers import MllamaConfig, MllamaForConditionalGeneration, MllamaImageProcessorPil, \
        MllamaProcessor

    tok = _tokenizer(["<|image|>", "<|python_tag|>"])
    image_processor = MllamaImageProcessorPil(size={"height": tile_size, "width": tile_size},
                                              max_image_tiles=max_tiles)
    processor = MllamaProcessor(image_processor=image_processor, tokenizer=tok,
                                chat_template=vlm_chat_template("<|image|>", prefix="{{ bos_token }}"))
    # the aspect ratios (tiles wide, tiles high) the image processor chooses among, in its order
    ratios = [[w, h] for w in range(1, max_tiles + 1) for h in range(1, max_tiles + 1) if w * h <= max_tiles]
    layers = [1]
    config = MllamaConfig(
        text_config=dict(_text(tok), cross_attention_layers=[1]),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_global_layers=1,
                           attention_heads=4, image_size=tile_size, patch_size=patch_size, max_num_tiles=max_tiles,
                           supported_aspect_ratios=ratios, intermediate_layers_indices=layers,
                           vision_output_dim=32 * (len(layers) + 1)),
        image_token_index=tok.convert_tokens_to_ids("<|image|>"))
    return MllamaForConditionalGeneration, config, processor


def _paligemma(image_size: int = 28, patch_size: int = 14):
    """PaliGemma: a SigLIP tower whose (image_size / patch_size)^2 patches are the image's `<image>` tokens, put
    before the text with a BOS by the processor, which also returns `token_type_ids` (0: the prefix, which attends
    both ways; 1 only on a `suffix`)."""
    from transformers import PaliGemmaConfig, PaliGemmaForConditionalGeneration, PaliGemmaProcessor, \
        SiglipImageProcessorPil

    tok = _tokenizer(["<image>"], image_token="<image>")
    image_processor = SiglipImageProcessorPil(size={"height": image_size, "width": image_size})
    image_processor.image_seq_length = (image_size // patch_size) ** 2
    processor = PaliGemmaProcessor(image_processor=image_processor, tokenizer=tok,
                                   chat_template=vlm_chat_template("<image>"))
    config = PaliGemmaConfig(
        text_config=dict(_text(tok, head_dim=16), model_type="gemma"),
        vision_config=dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=4, image_size=image_size, patch_size=patch_size,
                           vision_use_head=False, projection_dim=64),
        image_token_index=tok.convert_tokens_to_ids("<image>"), projection_dim=64)
    return PaliGemmaForConditionalGeneration, config, processor


_BUILDERS = {"idefics3": _idefics3, "gemma3": _gemma3, "mllama": _mllama, "paligemma": _paligemma}


def build_vlm_dir(path, kind: str) -> Path:
    """The tiny random `kind` model (one of `KINDS`) saved at `path` with its processor (tokenizer, image
    processor, chat template); `AutoProcessor` and `AutoModelForImageTextToText` load it back."""
    import torch

    if kind in QWEN:
        return qwen_vl_dir(path, kind)
    if kind not in _BUILDERS:
        raise ValueError(f"unknown kind {kind!r}; one of {KINDS}")
    model_class, config, processor = _BUILDERS[kind]()
    torch.manual_seed(0)
    model_class(config).save_pretrained(path, safe_serialization=True)
    processor.save_pretrained(path)
    return Path(path)


def _qwen_vl_config(kind: str, tok, ids: dict):
    """The config of a tiny Qwen2-VL, Qwen2.5-VL (window attention in the tower, full in its second block) or
    Qwen3-VL (interleaved M-RoPE, the tower's first block's features stacked into the language model's first
    layers): language model as `_text`, tower hidden 32, 2 blocks."""
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig, Qwen3VLConfig

    marks = dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                 vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    mrope = {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}
    if kind == "qwen2_vl":
        return Qwen2VLConfig(text_config=_text(tok, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}),
                             vision_config=dict(depth=2, embed_dim=32, hidden_size=64, num_heads=4, mlp_ratio=2,
                                                patch_size=14, spatial_merge_size=2, temporal_patch_size=2),
                             **marks)
    if kind == "qwen2_5_vl":
        return Qwen2_5_VLConfig(text_config=_text(tok, rope_parameters=mrope),
                                vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4,
                                                   out_hidden_size=64, patch_size=14, window_size=56,
                                                   fullatt_block_indexes=[1]), **marks)
    return Qwen3VLConfig(text_config=_text(tok, head_dim=16, rope_parameters={**mrope, "mrope_interleaved": True}),
                         vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4,
                                            out_hidden_size=64, patch_size=14, num_position_embeddings=64,
                                            deepstack_visual_indexes=[0]), **marks)


def qwen_vl_dir(path, kind: str = "qwen2_vl") -> Path:
    """A tiny Qwen2-VL, Qwen2.5-VL or Qwen3-VL (`kind`) folder as the hub ships one, written file by file (its
    config, weights, tokenizer, `preprocessor_config.json` read by both its image and its video processor,
    `processor_config.json`, the chat template): without torchvision its processor cannot be built (its video
    processor needs it), so `AutoProcessor` fails on it as on the real Qwen2-VL-2B, and the toolkit builds it
    without the video processor (`toolkit.model.vision.without_video`). 56x56 to 112x112 images: 2x2 to 4x4
    merged 14 px patches, 4 to 16 tokens."""
    import json

    import torch
    from transformers import AutoModelForImageTextToText
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    marks = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
    tok = _tokenizer(marks)
    config = _qwen_vl_config(kind, tok, {t: tok.convert_tokens_to_ids(t) for t in marks})
    torch.manual_seed(0)
    AutoModelForImageTextToText.from_config(config).save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=112 * 112, patch_size=14).save_pretrained(path)
    processor = {"qwen2_vl": "Qwen2VLProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor"}.get(kind, "Qwen3VLProcessor")
    (Path(path) / "processor_config.json").write_text(json.dumps({"processor_class": processor}))
    (Path(path) / "chat_template.jinja").write_text(vlm_chat_template("<|vision_start|><|image_pad|><|vision_end|>"))
    return Path(path)


def lfm2_vl_without_torchvision(path) -> Path:
    """An LFM2-VL folder's config, tokenizer and processor configs (no weights: its processor is refused before any
    model loads): its image processor, `Lfm2VlImageProcessor`, has no PIL version, so without torchvision neither
    transformers nor the toolkit can build it."""
    import json

    from transformers import Lfm2VlConfig

    tok = _tokenizer(["<image>"])
    Lfm2VlConfig().save_pretrained(path)
    tok.save_pretrained(path)
    (Path(path) / "preprocessor_config.json").write_text(json.dumps({"image_processor_type": "Lfm2VlImageProcessor"}))
    (Path(path) / "processor_config.json").write_text(json.dumps({"processor_class": "Lfm2VlProcessor"}))
    return Path(path)


def class_dir(path, model_type: str) -> Path:
    """A tiny random model of an image-text class the toolkit refuses on images, with the tests' tokenizer and no
    processor (the refusal comes before either is read): GIT, whose language model holds its vision tower, or Fuyu,
    whose image patches enter without a vision tower of their own."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    tok = build_tokenizer()
    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=len(tok))
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    extra = {"git": {"vision_config": vision}, "fuyu": {"num_key_value_heads": 4}}[model_type]
    torch.manual_seed(0)
    AutoModelForImageTextToText.from_config(AutoConfig.for_model(model_type, **text, **extra)).save_pretrained(path)
    tok.save_pretrained(path)
    return Path(path)
