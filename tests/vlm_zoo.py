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

from toolkit.model.synthetic import build_qwen_vl_dir as qwen_vl_dir
from toolkit.model.synthetic import build_tokenizer, vlm_chat_template
from toolkit.model.synthetic import vlm_text_config as _text
from toolkit.model.synthetic import vlm_tokenizer as _tokenizer

QWEN = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
KINDS = ("idefics3", "gemma3", "mllama", "paligemma", *QWEN)


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
    model = model_class(config)
    with torch.no_grad():
        for weight in model.parameters():
            # what transformers starts at zero between the image and the text (Gemma 3's mm_input_projection_weight,
            # Mllama's cross-attention gates) would leave every image without effect: a test could not tell an image
            # read from one dropped (a matrix, or a scalar gate; zero biases, and Gemma's norms' zero offsets, stay)
            if not weight.any() and (weight.dim() > 1 or weight.numel() == 1):
                weight.normal_(0, 0.02 if weight.dim() > 1 else 0.5)
    model.save_pretrained(path, safe_serialization=True)
    processor.save_pretrained(path)
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
