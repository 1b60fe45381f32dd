"""Image-text models (LLaVA, Idefics3/SmolVLM, Gemma 3, Mllama, ... : transformers' `AutoModelForImageTextToText`):
which configs are one, their processor, and the model's parts named from the model itself, never from a table of
names: the language model is `get_decoder()`, the output head `get_output_embeddings()`, the vision towers the
submodules built from `config.vision_config`; beside them, what the class's `get_image_features` and `forward` read
(LLaVA's `multi_modal_projector`, Idefics3's `connector`, BLIP-2's `qformer`) is the projector, and what they do not
(an audio tower) stays frozen. `vision_problem` refuses, from the config alone, the classes this cannot name
(tests/test_image_classes.py runs it over every class transformers ships).

What trains (`--train-vision`): LoRA adapts the language model's linears only; a full finetune trains the language
model and the projector. `projector` adds the projector to a LoRA run (as modules_to_save), `all` the vision tower
too."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
from pathlib import Path

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
             # Gemma 4's attention, MiniCPM-V 4.7's layout, Molmo2's; M-RoPE's are read from the ids
             "mm_token_type_ids": "its forward reads each token's modality (mm_token_type_ids)",
             "cross_attention_mask": "its images enter through cross-attention (cross_attention_mask)",
             "image_grid_thw": "its positions are multi-axis (M-RoPE, image_grid_thw)"}


def row_bound(config) -> tuple[str, list[str]]:
    """(the model class's name, the `ROW_BOUND` inputs its forward takes that are not laid out here): multi-axis
    positions (M-RoPE) are laid out per example (`packed_mrope`, `padded_mrope`), KTO's KL rows' too."""
    import inspect

    from transformers.models.auto.auto_factory import _get_model_class
    from transformers import AutoModelForImageTextToText

    cls = _get_model_class(config, AutoModelForImageTextToText._model_mapping)
    taken = inspect.signature(cls.forward).parameters
    laid_out = set() if mrope_axes(config) != 3 else {"image_grid_thw", "mm_token_type_ids"}
    return cls.__name__, [name for name in ROW_BOUND if name in taken and name not in laid_out]


def end_to_end_problem(config) -> str | None:
    """Why this image-text model's batches cannot go padding-free (None: they can): its image features are placed at
    their tokens in order (LLaVA's, Idefics3's, Qwen2-VL's), so examples laid end to end take theirs unchanged, unless
    its forward takes one of `ROW_BOUND`'s per-row inputs (`row_bound`)."""
    name, bound = row_bound(config)
    return f"{name}: {'; '.join(ROW_BOUND[k] for k in bound)}" if bound else None


def mrope_axes(config) -> int:
    """The number of position axes of a model's multi-axis rotary embedding (Qwen2/2.5/3-VL's M-RoPE: 3, temporal,
    height and width), from its text config's `mrope_section`; 0 where it names none. Three are laid out here."""
    text = config.get_text_config()
    for rope in (getattr(text, "rope_parameters", None), getattr(text, "rope_scaling", None)):
        if isinstance(rope, dict) and rope.get("mrope_section"):
            return len(rope["mrope_section"])
    return 0


def image_types(module, input_ids: torch.Tensor) -> torch.Tensor:
    """The modality of each token (1: an image's, 0: text) as M-RoPE's `get_rope_index` reads it, from the ids
    (`config.image_token_id`): the processor's `mm_token_type_ids` say the same of the rows it padded itself."""
    return (input_ids == module.config.image_token_id).to(torch.int32)


def packed_mrope(module, input_ids: torch.Tensor, position_ids: torch.Tensor,
                 image_grid_thw: torch.Tensor | None = None) -> torch.Tensor:
    """(4, 1, T) positions of a padding-free row (1, T) of a model with multi-axis rotary positions (Qwen2-VL's
    M-RoPE): the text positions, restarting per example, which transformers reads as the examples' bounds (Qwen2-VL's
    text model: "packed `position_ids` ... [4, bs, seq-len]"), then each example's temporal, height and width
    positions as its own padded row gets them: the model's `get_rope_index` on the examples stacked as a
    right-padded batch, whose image grids it takes in the row's order."""
    from toolkit.model.attention import document_ids

    if position_ids.shape[0] != 1:
        raise RuntimeError(f"multi-axis positions are laid out for one padding-free row; got {position_ids.shape[0]}")
    text = position_ids.view(1, 1, -1)
    if image_grid_thw is None:
        return text.expand(4, 1, -1)
    doc, col = document_ids(position_ids)[0].long(), position_ids[0].long()
    # one sync: the examples' count and the longest
    n, width = (int(v) for v in torch.stack([doc.max() + 1, col.max() + 1]).tolist())
    ids = input_ids.new_zeros(n, width)
    ids[doc, col] = input_ids[0]
    mask = torch.zeros(n, width, dtype=torch.long, device=ids.device)
    mask[doc, col] = 1
    axes, _ = module.get_rope_index(ids, mm_token_type_ids=image_types(module, ids), image_grid_thw=image_grid_thw,
                                    attention_mask=mask)
    return torch.cat([text, axes[:, doc, col].unsqueeze(1).to(text.dtype)])


def padded_mrope(module, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor,
                 image_grid_thw: torch.Tensor | None, cache=None) -> torch.Tensor:
    """(3, B, L) positions of padded rows given with their own (B, L) text positions (GRPO's left-padded prompts,
    their completions, each decode step's token): the model's `get_rope_index` on the rows (`image_types`), as
    transformers computes them when it is given none. A decode step
    (`cache` holding tokens) continues each row from its prompt's last position: its text position plus the row's
    offset (`rope_deltas`), kept from the prompt's forward."""
    if cache is not None and cache.get_seq_length() > 0:
        deltas = getattr(module, "_mrope_deltas", None)
        shifted = position_ids + (deltas.to(position_ids.device) if deltas is not None else 0)
        return shifted.unsqueeze(0).expand(3, -1, -1)
    if image_grid_thw is None:
        module._mrope_deltas = None
        return position_ids.unsqueeze(0).expand(3, -1, -1)
    axes, module._mrope_deltas = module.get_rope_index(input_ids, mm_token_type_ids=image_types(module, input_ids),
                                                       image_grid_thw=image_grid_thw, attention_mask=attention_mask)
    return axes.to(position_ids.dtype)


def _mrope_hook(module, args, kwargs):
    """Multi-axis positions for rows the model is handed text positions of (B, L): a padding-free row (no 2-D mask:
    `packed_mrope`) or padded rows (`padded_mrope`); where none are given the model computes its own."""
    pos, ids, mask = kwargs.get("position_ids"), kwargs.get("input_ids"), kwargs.get("attention_mask")
    if pos is None or pos.ndim != 2 or ids is None:
        return None
    if mask is None:
        kwargs["position_ids"] = packed_mrope(module, ids, pos, kwargs.get("image_grid_thw"))
    else:
        # the KV cache under either name (`past_key_values` before transformers renamed it)
        kwargs["position_ids"] = padded_mrope(module, ids, pos, mask, kwargs.get("image_grid_thw"),
                                              kwargs.get("cache", kwargs.get("past_key_values")))
    return args, kwargs


def lay_out_positions(model: torch.nn.Module) -> bool:
    """Give a model with multi-axis positions (a submodule with `get_rope_index`: Qwen2-VL, Qwen2.5-VL, ...) the
    positions of padding-free rows (`packed_mrope`, as a forward pre-hook); False where it has none."""
    found = next((m for m in model.modules() if callable(getattr(m, "get_rope_index", None))), None)
    if found is not None and mrope_axes(found.config) != 3:
        return False
    if found is not None and not getattr(found, "_packed_mrope", False):
        found.register_forward_pre_hook(_mrope_hook, with_kwargs=True)
        found._packed_mrope = True
    return found is not None


def text_config_key(model) -> str:
    """The name of the language model's sub-config ("text_config"), "" for a model that is its own language model:
    `set_attn_implementation({key: kernel})` gives the language model alone a kernel (the vision tower keeps its own,
    bidirectional attention)."""
    config = model.config
    text = config.get_text_config()
    return next((key for key in getattr(config, "sub_configs", {}) if getattr(config, key, None) is text), "")


def load_processor(path: str, trust_remote_code: bool = False, **bounds: int):
    """The model's processor (tokenizer + image processor + chat template). transformers falls back to the PIL image
    processor where torchvision is missing; a processor whose video processor needs it (Qwen2-VL's, Qwen2.5-VL's,
    Qwen3-VL's) is built without one (`without_video`: image training never calls it); a processor that has no such
    fallback is one line naming the package. `bounds`: the image processor's pixel bounds (`min_pixels`,
    `max_pixels`, --image-min/max-pixels), as `AutoProcessor.from_pretrained` takes them, where it declares them."""
    from transformers import AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(path, trust_remote_code=trust_remote_code, **bounds)
    except ImportError as e:
        fallback = "VideoProcessor" in str(e) and without_video(path, trust_remote_code)
        if not fallback:
            raise _missing_package(path, e) from None
        try:
            processor = fallback.from_pretrained(path, trust_remote_code=trust_remote_code, **bounds)
        except (ImportError, ValueError, OSError) as again:
            raise _missing_package(path, again) from None
    except (OSError, ValueError) as e:
        # transformers' words where no backend of an image processor can be imported; older releases (5.4) name
        # no class for Qwen2-VL's without torchvision and call the image processor unrecognized
        if "Missing optional dependencies" in str(e):
            raise _missing_package(path, e) from None
        if "Unrecognized image processor" in str(e) and importlib.util.find_spec("torchvision") is None and \
                _names_image_processor(path):
            raise _missing_package(path, e, "torchvision") from None
        raise UserError(f"--model {path}: an image-text model, but its processor could not be loaded "
                        f"({type(e).__name__}: {' '.join(str(e).split())[:200]}); the folder needs the processor's "
                        "files (preprocessor_config.json, the tokenizer)") from None
    image = getattr(processor, "image_processor", None)
    declared = {k for c in getattr(getattr(image, "valid_kwargs", None), "__mro__", ())
                for k in getattr(c, "__annotations__", {})}
    for name in (k for k, v in bounds.items() if v and k not in declared):
        raise UserError(f"--image-{name.replace('_', '-')}: {type(image).__name__} takes no {name} (it resizes "
                        f"by its own settings, size {dict(getattr(image, 'size', None) or {})}); leave the flag "
                        f"out, or change those in {path}/preprocessor_config.json")
    return processor


def _names_image_processor(path: str) -> bool:
    """Whether the folder's preprocessor_config.json names its image processor class (a folder that does not is
    missing its processor's files, whatever is installed)."""
    try:
        return bool(json.loads((Path(path) / "preprocessor_config.json").read_text()).get("image_processor_type"))
    except (OSError, ValueError):
        return False


def _missing_package(path: str, e: Exception, package: str | None = None) -> UserError:
    """The one line for a processor that needs a package that is not installed, naming it where the error does
    (or `package`)."""
    package = package or next((p for p in ("torchvision", "timm", "av", "decord", "librosa") if p in str(e).lower()),
                              None)
    needs = f"{package} (`pip install {package}`, the build that matches your torch)" if package else \
        "a package that is not installed"
    return UserError(f"--model {path}: its processor needs {needs}: {' '.join(str(e).split())[:160]}")


def without_video(path: str, trust_remote_code: bool = False):
    """The processor class of the model at `path` with its video processor left out (None where its parts are not
    an image processor, a tokenizer and a video processor): transformers builds a processor's parts from its
    `__init__`'s signature, so a subclass whose signature omits `video_processor` loads and saves (as the class it
    derives from) the image processor and the tokenizer alone."""
    from transformers import AutoConfig
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES, processor_class_from_name

    # as AutoProcessor finds it: the class a processor file names (an adapter folder has no config.json), else the
    # model type's
    named = [json.loads((Path(path) / f).read_text()).get("processor_class")
             for f in ("processor_config.json", "preprocessor_config.json", "tokenizer_config.json")
             if (Path(path) / f).is_file()]
    name = next((n for n in named if n), None) or PROCESSOR_MAPPING_NAMES.get(
        AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code).model_type)
    cls = processor_class_from_name(name) if name else None
    if cls is None or cls.get_attributes() != ["image_processor", "tokenizer", "video_processor"]:
        return None

    # named parameters: transformers passes a processor file's entries (chat_template) to those the code names
    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        cls.__init__(self, image_processor=image_processor, tokenizer=tokenizer, video_processor=None,
                     chat_template=chat_template, **kwargs)

    def save_pretrained(self, save_directory, *args, **kwargs):
        # the source's video processor config beside what it saves (its own file, preprocessor_config.json, or
        # processor_config.json's entry; a folder or a hub id's cached files): what loads the folder where
        # torchvision is installed
        from transformers.utils import cached_file

        saved = cls.save_pretrained(self, save_directory, *args, **kwargs)
        out = Path(save_directory)

        def source(name: str) -> Path | None:
            found = cached_file(path, name, _raise_exceptions_for_missing_entries=False)
            return Path(found) if found else None

        for name in ("preprocessor_config.json", "video_preprocessor_config.json"):
            if (found := source(name)) and not (out / name).exists():
                shutil.copyfile(found, out / name)
        nested = source("processor_config.json")
        video = json.loads(nested.read_text()).get("video_processor") if nested else None
        if video and (out / "processor_config.json").is_file():
            mine = json.loads((out / "processor_config.json").read_text())
            (out / "processor_config.json").write_text(json.dumps({**mine, "video_processor": video}, indent=2))
        return saved

    return type(cls.__name__, (cls,), {"__init__": __init__, "save_pretrained": save_pretrained,
                                       "__module__": cls.__module__, "__doc__": cls.__doc__})


def _name_of(model: torch.nn.Module, target: torch.nn.Module | None) -> str:
    """The module name of `target` in `model` ("" where it is none of its modules: BLIP's output head is its
    text decoder's)."""
    return next((name for name, module in model.named_modules() if module is target and name), "")


def has_vision(model: torch.nn.Module) -> bool:
    """`model` holds a vision tower (an image-text model loaded as one; Mllama's causal LM holds none)."""
    vision = getattr(model.config, "vision_config", None)
    return vision is not None and any(getattr(m, "config", None) is vision for m in model.modules())


def _inside(name: str, outer: str) -> bool:
    return outer == "" or name == outer or name.startswith(outer + ".")


def _read_by(cls: type, method: str, depth: int, seen: set[str] | None = None) -> set[str]:
    """The attributes `cls.method`'s source reads as `self.<name>`, and those of the methods it calls, `depth` deep."""
    import inspect

    seen = set() if seen is None else seen
    fn = getattr(cls, method, None)
    if fn is None or method in seen or depth == 0:
        return set()
    seen.add(method)
    try:
        names = set(re.findall(r"self\.(\w+)", inspect.getsource(inspect.unwrap(fn))))
    except (OSError, TypeError):
        return set()
    return names.union(*(_read_by(cls, n, depth - 1, seen) for n in names if callable(getattr(cls, n, None))))


def parts(model: torch.nn.Module) -> dict[str, tuple[str, ...]]:
    """{part: module names} of an image-text model (`has_vision`), read from the model (names under `model`'s own, so a
    peft wrapper's prefix is not in them):
    - `language`: the decoder (`get_decoder()`), one name;
    - `tower`: every module built from `config.vision_config` (Video-LLaVA has an image and a video tower);
    - `projector`: the modules beside the towers that the image path reads, as `get_image_features` and `forward`
      name them in their code: LLaVA's `multi_modal_projector`, BLIP-2's `qformer` and `language_projection`;
      all of them where the class has no `get_image_features`;
    - `others`: the modules beside them it does not read (an audio tower, Janus's image generation head): frozen.
    A model whose language model holds its vision tower (IDEFICS, GIT) cannot train its language side alone: one
    line (`UserError`)."""
    config = model.config
    language, head = _name_of(model, model.get_decoder()), _name_of(model, model.get_output_embeddings())
    # the config's own names for its vision encoders' configs: vision_config, DeepSeek-VL-Hybrid's
    # high_res_vision_config
    keys = {k for k in (*getattr(config, "sub_configs", {}), "vision_config") if k.endswith("vision_config")}
    visions = {id(c) for k in keys if (c := getattr(config, k, None)) is not None}
    towers = [n for n, m in model.named_modules() if n and id(getattr(m, "config", None)) in visions]
    towers = [n for n in towers if not any(_inside(n, t) and n != t for t in towers)]
    if not language or not towers:
        what = "is built from its vision_config (a vision tower)" if language else "is its get_decoder()"
        raise UserError(f"{type(model).__name__}: no module of it {what}, so the toolkit cannot tell its language "
                        "model from its vision side")
    if any(_inside(t, language) for t in towers):
        raise UserError(f"{type(model).__name__}: its language model ({language}) holds its vision tower "
                        f"({towers[0]}), so its language side cannot train alone; the toolkit trains image-text models "
                        "whose language model is a module of its own")
    parent = towers[0].rpartition(".")[0]
    outer = model.get_submodule(parent) if parent else model
    read = (_read_by(type(outer), "get_image_features", 3) | _read_by(type(outer), "forward", 1)
            if hasattr(outer, "get_image_features") else None)
    taken = [n for n in (language, head, *towers) if n]
    beside = [(child, f"{parent}.{child}" if parent else child) for child, m in outer.named_children()
              if any(True for _ in m.parameters())]
    beside = [(child, name) for child, name in beside if not any(_inside(t, name) for t in taken)]
    # code that cannot be read (an install without sources): all are the projector (trained by a full finetune),
    # never all frozen
    if read is not None and not read:
        read = None
    return {"language": (language,), "tower": tuple(towers),
            "projector": tuple(name for child, name in beside if read is None or child in read),
            "others": tuple(name for child, name in beside if read is not None and child not in read)}


def skeleton(config, images: bool = True) -> torch.nn.Module:
    """The model `auto_class` builds, on the meta device: no weights read, no memory taken (buffers neither: some
    classes build rotary tables of gigabytes)."""
    with torch.device("meta"):
        return auto_class(config, images).from_config(config)


def vision_problem(config) -> str | None:
    """Why the toolkit cannot train this image-text class on images (None: it can), from its config alone, before any
    weight loads: a class whose images enter without a vision tower of their own (no vision_config: Fuyu,
    Chameleon), one transformers cannot build here (a package it needs is missing), or whose parts `parts` cannot
    tell apart."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    if config.model_type not in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        return None
    if getattr(config, "vision_config", None) is None:
        return (f"model type {config.model_type} reads images without a vision tower of its own (no vision_config "
                "in its config.json), which the toolkit does not train on images yet")
    try:
        parts(skeleton(config))
    # transformers' own words ("requires the timm library") or Python's (No module named 'timm')
    except ImportError as e:
        said = re.search(r"requires the (\S+) library", str(e))
        package = said.group(1) if said else getattr(e, "name", None)
        if package is None:
            raise
        return f"model type {config.model_type} needs the {package} package, not installed here: pip install {package}"
    except UserError as e:
        return str(e)
    return None


def plan_view(model_cfg: dict) -> tuple[dict, tuple[int, int]]:
    """A config.json as the planner counts it (`toolkit.planner.estimate.PlanInput`): an image-text model's language
    model config (with its class's defaults filled in) and its (frozen vision side, projector) parameters, counted
    on a `skeleton` (`parts`: the towers and `others`; the projector); a text model's as it is."""
    if "vision_config" not in model_cfg:
        return model_cfg, (0, 0)
    from transformers import AutoConfig

    config = AutoConfig.for_model(**model_cfg)
    model = skeleton(config)
    found = parts(model)
    count = lambda names: sum(p.numel() for n in names for p in model.get_submodule(n).parameters())  # noqa: E731
    text = config.get_text_config().to_dict()
    # the head's tying is the whole model's
    text["tie_word_embeddings"] = bool(getattr(config, "tie_word_embeddings", text.get("tie_word_embeddings")))
    return text, (count(found["tower"] + found["others"]), count(found["projector"]))


def unquantized(config, images: bool) -> list[str] | None:
    """What QLoRA leaves unquantized in an image-text model (bitsandbytes' `llm_int8_skip_modules`): the vision side
    (`parts`) and the output head of the class `auto_class` loads, named on a `skeleton`; None where it holds no
    vision tower."""
    if not image_text(config):
        return None
    model = skeleton(config, images)
    if not has_vision(model):
        return None
    found = parts(model)
    head = _name_of(model, model.get_output_embeddings())
    return [*found["tower"], *found["others"], *found["projector"], *([head] if head else [])]


def language_linears(model: torch.nn.Module, skip: set[str] = frozenset(), names: list[str] | None = None) -> str:
    """peft's `target_modules` (a regex, matched whole) for the language model's Linears, less `skip` (`names`: only
    those with these leaf names, --lora-targets): the text side only, so the vision tower and the projector (whose
    q_proj and v_proj share the names) keep their weights."""
    (language,) = parts(model)["language"]
    leaves = sorted({name.rsplit(".", 1)[-1] for name, module in model.get_submodule(language).named_modules()
                     if isinstance(module, torch.nn.Linear) and f"{language}.{name}" not in skip
                     and (names is None or name.rsplit(".", 1)[-1] in names)})
    return rf"{re.escape(language)}\..*\.({'|'.join(map(re.escape, leaves))})"


def freeze_vision(model: torch.nn.Module, train_vision: str, method: str) -> None:
    """The vision side's `requires_grad` for a full finetune: the towers frozen unless --train-vision all, `others`
    always (no image-text example reaches them); the projector trains (LoRA runs freeze the whole base and
    add what --train-vision names as modules_to_save: `lora_extras`)."""
    if method != "full" or not has_vision(model):
        return
    found = parts(model)
    for name in found["others"] + (found["tower"] if train_vision != "all" else ()):
        model.get_submodule(name).requires_grad_(False)


def lora_extras(model: torch.nn.Module, train_vision: str) -> list[str] | None:
    """peft's `modules_to_save` for --train-vision under LoRA: the projector, or the projector and the towers."""
    found = parts(model)
    names = {"none": [], "projector": ["projector"], "all": ["projector", "tower"]}[train_vision]
    return [name for n in names for name in found[n]] or None


def processor_for(path: str, tokenizer, trust_remote_code: bool = False, chat_template: str = "",
                  pixels: tuple[int, int] = (0, 0)):
    """The processor of the image-text model at `path` with the run's `tokenizer` in it (its pad token), rendering with
    --chat-template where given (the tokenizer carries it), else its own template; `pixels`: --image-min-pixels and
    --image-max-pixels (0: the processor's own), kept in the processor final/ saves."""
    if any(v < 0 for v in pixels) or 0 < pixels[1] < pixels[0]:
        raise UserError(f"--image-min-pixels {pixels[0]} / --image-max-pixels {pixels[1]}: give pixel counts, the "
                        "minimum at most the maximum (0: the processor's own)")
    bounds = {k: v for k, v in zip(("min_pixels", "max_pixels"), pixels) if v}
    processor = load_processor(path, trust_remote_code, **bounds)
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
