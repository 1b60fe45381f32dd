"""Image-text models (LLaVA, Idefics3/SmolVLM, Gemma 3, Mllama, ... : transformers' `AutoModelForImageTextToText`):
which configs are one, their processor, and the model's parts named from the model itself, never from a table of
names: the language model is `get_decoder()`, the output head `get_output_embeddings()`, the vision tower the
submodule built from `config.vision_config`; whatever else sits beside them (LLaVA's `multi_modal_projector`,
Idefics3's `connector`) is the projector.

What trains (`--train-vision`): LoRA adapts the language model's linears only; a full finetune trains the language
model and the projector. `projector` adds the projector to a LoRA run (as modules_to_save), `all` the vision tower too.
"""

from __future__ import annotations

import re

import torch

from toolkit.errors import UserError


def image_text(config) -> bool:
    """The config is an image-text-to-text model's: a `vision_config` and a class in transformers'
    `AutoModelForImageTextToText` mapping."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return getattr(config, "vision_config", None) is not None and \
        config.model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES


def only_image_text(config) -> bool:
    """An image-text model transformers builds no causal LM of (LLaVA, Idefics3): it trains as one even on text.
    Gemma 3, Mllama, Llama 4, Qwen3.5 also load as causal LMs, and train text as those."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return image_text(config) and config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


def auto_class(config, images: bool = False):
    """The Auto class that builds this config's model: image-text where the run reads images (`images`, the resolved
    --images) or the model is `only_image_text`, else the causal LM (a model of both kinds trained on text loads as it
    did before images were read)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if (images and image_text(config)) or only_image_text(config) \
        else AutoModelForCausalLM


# what a model's forward takes that ties an image to its example's own row: a micro-batch's examples laid end to end in
# one row would need it rebuilt per example (named from the forward's arguments, not from a table of models)
ROW_BOUND = {"token_type_ids": "its image tokens attend both ways (token_type_ids)",
             "cross_attention_mask": "its images enter through cross-attention (cross_attention_mask)",
             "image_grid_thw": "its positions are multi-axis (M-RoPE, image_grid_thw)"}


def end_to_end_problem(config) -> str | None:
    """Why this image-text model's batches cannot go padding-free (None: they can): its image features are placed at
    their tokens in order (LLaVA's, Idefics3's), so examples laid end to end take theirs unchanged, unless its forward
    takes one of `ROW_BOUND`'s per-row inputs."""
    import inspect

    from transformers.models.auto.auto_factory import _get_model_class
    from transformers import AutoModelForImageTextToText

    cls = _get_model_class(config, AutoModelForImageTextToText._model_mapping)
    taken = inspect.signature(cls.forward).parameters
    why = [reason for name, reason in ROW_BOUND.items() if name in taken]
    return f"{cls.__name__}: {'; '.join(why)}" if why else None


def text_config_key(model) -> str:
    """The name of the language model's sub-config ("text_config"), "" for a model that is its own language model:
    `set_attn_implementation({key: kernel})` gives the language model alone a kernel (the vision tower keeps its own,
    bidirectional attention)."""
    config = model.config
    text = config.get_text_config()
    return next((key for key in getattr(config, "sub_configs", {}) if getattr(config, key, None) is text), "")


def load_processor(path: str, trust_remote_code: bool = False):
    """The model's processor (tokenizer + image processor + chat template). transformers falls back to the PIL image
    processor where torchvision is missing; a processor that has no such fallback is one line naming the package."""
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
    except ImportError as e:
        package = next((p for p in ("torchvision", "timm", "av", "decord", "librosa") if p in str(e).lower()), None)
        needs = f"{package} (`pip install {package}`, the build that matches your torch)" if package else \
            "a package that is not installed"
        raise UserError(f"--model {path}: its processor needs {needs}: {' '.join(str(e).split())[:160]}") from None
    except (OSError, ValueError) as e:
        raise UserError(f"--model {path}: an image-text model, but its processor could not be loaded "
                        f"({type(e).__name__}: {' '.join(str(e).split())[:200]}); the folder needs the processor's "
                        "files (preprocessor_config.json, the tokenizer)") from None


def _name_of(model: torch.nn.Module, target: torch.nn.Module) -> str:
    """The module name of `target` in `model`."""
    return next(name for name, module in model.named_modules() if module is target)


def has_vision(model: torch.nn.Module) -> bool:
    """`model` holds a vision tower (an image-text model loaded as one; Mllama's causal LM holds none)."""
    vision = getattr(model.config, "vision_config", None)
    return vision is not None and any(getattr(m, "config", None) is vision for m in model.modules())


def parts(model: torch.nn.Module) -> dict[str, str]:
    """{part: module name} of an image-text model (`has_vision`): `language`, `tower`, and `projector` where the model
    has one (module names under `model`'s own, so a peft wrapper's prefix is not in them)."""
    config = model.config
    language = _name_of(model, model.get_decoder())
    tower = next(name for name, module in model.named_modules()
                 if getattr(module, "config", None) is config.vision_config and name)
    parent = tower.rsplit(".", 1)[0] if "." in tower else ""
    head = _name_of(model, model.get_output_embeddings())
    taken = {language, tower, head}
    rest = [name for name, module in (model.get_submodule(parent) if parent else model).named_children()
            if (f"{parent}.{name}" if parent else name) not in taken and any(True for _ in module.parameters())]
    found = {"language": language, "tower": tower}
    if rest:
        found["projector"] = f"{parent}.{rest[0]}" if parent else rest[0]
    return found


def unquantized(config, images: bool) -> list[str] | None:
    """What QLoRA leaves unquantized in an image-text model (bitsandbytes' `llm_int8_skip_modules`): the vision tower,
    the projector and the output head of the class `auto_class` loads, named on a weightless skeleton; None where it
    holds no vision tower."""
    from accelerate import init_empty_weights

    if not image_text(config):
        return None
    with init_empty_weights():
        skeleton = auto_class(config, images).from_config(config)
    if not has_vision(skeleton):
        return None
    found = parts(skeleton)
    return [name for name in (found["tower"], found.get("projector"),
                              _name_of(skeleton, skeleton.get_output_embeddings())) if name]


def language_linears(model: torch.nn.Module, skip: set[str] = frozenset(), names: list[str] | None = None) -> str:
    """peft's `target_modules` (a regex, matched whole) for the language model's Linears, less `skip` (`names`: only
    those with these leaf names, --lora-targets): the text side only, so the vision tower and the projector (whose
    q_proj and v_proj share the names) keep their weights."""
    language = parts(model)["language"]
    leaves = sorted({name.rsplit(".", 1)[-1] for name, module in model.get_submodule(language).named_modules()
                     if isinstance(module, torch.nn.Linear) and f"{language}.{name}" not in skip
                     and (names is None or name.rsplit(".", 1)[-1] in names)})
    return rf"{re.escape(language)}\..*\.({'|'.join(map(re.escape, leaves))})"


def freeze_vision(model: torch.nn.Module, train_vision: str, method: str) -> None:
    """The vision side's `requires_grad` for a full finetune: the tower frozen unless --train-vision all; the projector
    trains (LoRA runs freeze the whole base and add what --train-vision names as modules_to_save: `lora_extras`)."""
    if method != "full" or train_vision == "all" or not has_vision(model):
        return
    for p in model.get_submodule(parts(model)["tower"]).parameters():
        p.requires_grad_(False)


def lora_extras(model: torch.nn.Module, train_vision: str) -> list[str] | None:
    """peft's `modules_to_save` for --train-vision under LoRA: the projector, or the projector and the tower."""
    found = parts(model)
    names = {"none": [], "projector": ["projector"], "all": ["projector", "tower"]}[train_vision]
    return [found[n] for n in names if n in found] or None


def processor_for(path: str, tokenizer, trust_remote_code: bool = False, chat_template: str = ""):
    """The processor of the image-text model at `path` with the run's `tokenizer` in it (its pad token), rendering with
    --chat-template where given (the tokenizer carries it), else its own template."""
    processor = load_processor(path, trust_remote_code)
    processor.tokenizer = tokenizer
    if chat_template or not getattr(processor, "chat_template", None):
        processor.chat_template = tokenizer.chat_template
    probe = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "?"}]}]
    try:
        processor.apply_chat_template(probe, tokenize=False)
    except Exception as e:  # noqa: BLE001 - a template that cannot take content parts fails in Jinja's own ways
        raise UserError(f"--model {path}: the chat template cannot render a message with an image part "
                        f"({type(e).__name__}: {' '.join(str(e).split())[:120]}); pass --chat-template FILE, a "
                        "template that renders content parts") from None
    return processor
