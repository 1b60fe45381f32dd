"""Every image-text class transformers ships (`MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES`: 100 model types in 5.24),
each on a weightless skeleton of its own default config (the meta device), named by the toolkit or refused by it in
one line (issue 73, item 1).

For a class the toolkit takes (`toolkit.model.vision.vision_problem` is None), `parts` names its language model,
vision towers, projector and the modules the image path does not read, from the model and its code, never from a
table of names; every cell asserts that the parts are disjoint, that with the output head and the image path's own
parameters they hold every parameter once, that LoRA's targets lie in the language model alone, and that the
planner reads it (`plan_view`). A class it refuses has the words expected below; a class
transformers itself cannot build from its default config here is listed with transformers' words. Either list
changing is a change this test shows.

The 8 architectures that train end to end through finetune.py (LLaVA, Idefics3, Gemma 3, Mllama, PaliGemma and the
Qwen-VL family, with their real processors) are tests/test_images.py's.
"""

from __future__ import annotations

import re

import pytest
import torch
from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

from toolkit.model.vision import language_linears, parts, plan_view, skeleton, vision_problem

TYPES = sorted(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)
# model type -> words of transformers' own failure to build its default config, here
NOT_BUILT = {
    "aya_vision": "embed_dim must be divisible by num_heads",
    "cohere_compass": "full_attention",
    "deepseek_ocr2": "'NoneType' object is not subscriptable",
    "diffusion_gemma": "must be tuple of ints",
    "granite4_vision": "object of type 'NoneType' has no len()",
    "hunyuan_vl": "unsupported operand type(s) for ** or pow()",
    "qwen4_exp": "unsupported operand type(s) for //",
}
# model type -> words of the toolkit's one line
REFUSED = {
    # the language model holds the vision tower: LoRA on it would adapt the tower too
    "git": "its language model (git) holds its vision tower (git.image_encoder)",
    "idefics": "its language model (model) holds its vision tower (model.vision_model)",
    # its images enter through an embedder, no vision tower
    "gemma4_unified": "no module of it is built from its vision_config (a vision tower)",
    # images enter without a vision tower of their own (no vision_config)
    **{t: "reads images without a vision tower of its own" for t in (
        "chameleon", "emu3", "evolla", "fuyu", "mistral4", "pi0", "t5gemma2", "udop", "vision-encoder-decoder")},
    # their vision tower is timm's
    **{t: "needs the timm package, not installed here: pip install timm" for t in ("fast_vlm", "gemma3n",
                                                                                    "perception_lm")},
}
# what the models' code says, read by hand: the cases a name-based guess gets wrong
EXPECTED = {
    "blip-2": {"projector": ("qformer", "language_projection")},
    "qwen2_5_omni_thinker": {"others": ("model.audio_tower",)},
    "janus": {"projector": ("model.aligner",), "others": ("model.vqmodel", "model.generation_embeddings",
                                                          "model.generation_aligner", "model.generation_head")},
    "video_llava": {"tower": ("model.video_tower", "model.image_tower")},
    "llama4": {"projector": ("multi_modal_projector",)},
    "idefics2": {"projector": ("model.connector",)},
    # its high-resolution SAM encoder is built from high_res_vision_config: a tower, frozen as the other
    "deepseek_vl_hybrid": {"tower": ("model.high_res_vision_model", "model.high_res_vision_neck",
                                     "model.high_res_vision_proj", "model.vision_model"),
                           "projector": ("model.aligner",)},
    "llava": {"language": ("model.language_model",), "tower": ("model.vision_tower",),
              "projector": ("model.multi_modal_projector",), "others": ()},
}


def default_config(model_type: str):
    """The class's default config, as transformers writes it (Gemma 4's vision_config defaults to none: its own)."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type)
    if "vision_config" in getattr(config, "sub_configs", {}) and config.vision_config is None:
        config = AutoConfig.for_model(model_type, vision_config={})
    return config


@pytest.mark.parametrize("model_type", TYPES)
def test_each_image_text_class_is_named_by_its_parts_or_refused_in_one_line(model_type):
    config = default_config(model_type)
    if model_type in NOT_BUILT:
        with pytest.raises(Exception, match=re.escape(NOT_BUILT[model_type])):
            skeleton(config)
        return
    if model_type in REFUSED:
        problem = vision_problem(config)
        assert problem is not None and REFUSED[model_type] in problem and "\n" not in problem, problem
        return
    # what `vision_problem` asks of a class it takes
    model = skeleton(config)
    found = parts(model)
    for part, names in EXPECTED.get(model_type, {}).items():
        assert found[part] == names, (part, found)
    (language,) = found["language"]
    named = [n for part in ("language", "tower", "projector", "others") for n in found[part]]
    inside = lambda name, outer: name == outer or name.startswith(outer + ".")  # noqa: E731
    assert found["tower"] and not any(inside(a, b) for a in named for b in named if a != b), found
    # every parameter once: in a part, the output head, or on the module that holds the tower (LLaVA-NeXT's
    # image_newline, BLIP-2's query_tokens)
    head = next((n for n, m in model.named_modules() if m is model.get_output_embeddings() and n), "")
    holder = found["tower"][0].rpartition(".")[0]
    for name, _ in model.named_parameters():
        owners = [n for n in named if inside(name, n)]
        assert len(owners) == 1 or (not owners and (inside(name, head) or name.rpartition(".")[0] == holder)), name
    targets = re.compile(language_linears(model))
    adapted = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and targets.fullmatch(n)]
    assert adapted and all(inside(n, language) for n in adapted)
    # the planner reads every class (a skeleton on the meta device: no class's tables are allocated)
    text, (frozen, projector) = plan_view(config.to_dict())
    assert 0 < frozen and frozen + projector < sum(p.numel() for p in model.parameters())
    assert text["model_type"] == config.get_text_config().model_type


def test_a_class_whose_code_cannot_be_read_trains_all_beside_its_tower_and_a_vision_encoder_is_no_image_text_model(
        monkeypatch):
    """Where the source of `get_image_features` cannot be read (an install without sources), everything beside the
    tower is the projector, which a full finetune trains: never all frozen. A config with a vision_config that is no
    image-text class (CLIP) is not asked (`vision_problem` None: the text-only line comes after)."""
    import inspect

    from transformers import AutoConfig

    def unreadable(obj):
        raise OSError("could not get source code")

    # built first: importing the model's module reads sources (torch._dynamo's)
    model = skeleton(default_config("llava"))
    monkeypatch.setattr(inspect, "getsource", unreadable)
    found = parts(model)
    assert found["projector"] == ("model.multi_modal_projector",) and found["others"] == ()
    assert vision_problem(AutoConfig.for_model("clip")) is None


def test_a_forward_that_reads_each_tokens_modality_pads_its_image_batches_unless_its_positions_are_m_rope():
    """Gemma 4's forward reads mm_token_type_ids (its image tokens attend both ways): laid end to end they would be
    dropped, so its image batches are padded; Qwen2-VL's are read from the ids by its M-RoPE positions (its config as
    the hub's: three sections), laid out per example; LLaVA's forward takes none."""
    from transformers import AutoConfig

    from toolkit.model.vision import end_to_end_problem

    assert "mm_token_type_ids" in end_to_end_problem(default_config("gemma4"))
    rope = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]}
    assert end_to_end_problem(AutoConfig.for_model("qwen2_vl", text_config={"rope_parameters": rope})) is None
    assert end_to_end_problem(default_config("llava")) is None
