"""Model and tokenizer loading: the tokenizer with its chat template, the run's dtypes, the causal LM
for training and for inference, the folder an adapter trains on when merged first; what the architecture
alone refuses, checked on a weightless skeleton (`check_model`); and what parallelize applies first
(`ModelShape`: the kernels, the LoRA/QLoRA adapters)."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from toolkit.cache import cache_dir
from toolkit.config.chat_template import apply_template
from toolkit.config.schema import Config
from toolkit.errors import UserError
from toolkit.model.kernels import apply_liger, experts_line, kernels_problem, router_kwargs
from toolkit.model.lora import check_lora_targets, untargetable_linears
from toolkit.model.source import (adapter_base, adapter_base_path, is_adapter_dir, recorded_base, resolve_model,
                                  sft_adapter, tokenizer_dir)


def load_tokenizer(path: str, trust_remote_code: bool = False, chat_template: str = ""):
    """The tokenizer at `path`, with the chat template `chat_template` (--chat-template) names set on it:
    everything that renders a conversation, and final/'s saved tokenizer, then uses that one."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    # a damaged tokenizer file raises any of these
    except (ValueError, OSError, TypeError, KeyError) as e:
        if "trust_remote_code" in str(e):
            raise UserError(f"--model {path}: its tokenizer needs its own code to run; pass --trust-remote-code "
                            "if you trust its author") from None
        raise UserError(f"--model {path}: the tokenizer could not be loaded ({type(e).__name__}: "
                        f"{' '.join(str(e).split())[:200]}); its tokenizer files are damaged or incomplete") from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    apply_template(tok, chat_template, path)
    return tok


def compute_dtype(cfg: Config) -> torch.dtype:
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(resolved_precision(cfg), torch.float32)


def resolved_precision(cfg: Config) -> str:
    """`auto` means bf16 where the GPU supports it and fp32 elsewhere (bf16 matmul is slow on CPU)."""
    mp = cfg.train.mixed_precision
    if mp != "auto":
        return mp
    return "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "no"


def load_dtype(cfg: Config) -> torch.dtype:
    """What the checkpoint is loaded in. Trainable weights are fp32 masters (accelerate autocasts the
    compute to bf16/fp16); a LoRA base is frozen, so under bf16/fp16 it is loaded in that dtype and
    holds half the memory (peft then creates the adapters in fp32). QLoRA's unquantized rest stays
    fp32, as peft's `prepare_model_for_kbit_training` would upcast it anyway; CPU runs are fp32."""
    return compute_dtype(cfg) if cfg.model.method == "lora" else torch.float32


def nf4_config(config, compute: torch.dtype, images: bool = False):
    """QLoRA's quantization: NF4 with double quantization, computing in `compute`; an image-text model's vision
    side and output head left as they are (`toolkit.model.vision.unquantized`; `images`: the run reads images)."""
    from transformers import BitsAndBytesConfig

    from toolkit.model.vision import unquantized

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=compute, bnb_4bit_quant_storage=torch.uint8,
                              llm_int8_skip_modules=unquantized(config, images))


def load_model(cfg: Config, path: str):
    """Load the causal LM (`load_dtype`; QLoRA's frozen base in NF4, bitsandbytes, computing in the run's
    dtype), nothing else: the kernels, the adapters and every layout's changes follow in one place,
    `toolkit.parallel.parallelize` (the strategy's `shard_model`), so every layout starts from the same
    weights and adapter init."""
    from transformers import AutoConfig

    from toolkit.model.vision import auto_class, freeze_vision

    kwargs: dict = {"trust_remote_code": cfg.model.trust_remote_code, "dtype": load_dtype(cfg),
                    **router_kwargs(cfg.model)}
    config = AutoConfig.from_pretrained(path, trust_remote_code=cfg.model.trust_remote_code)
    # the resolved --images (`toolkit.cli.startup.resolve_images`)
    images = cfg.data.images == "on"
    if cfg.model.method == "qlora":
        kwargs["quantization_config"] = nf4_config(config, compute_dtype(cfg), images)
        if torch.cuda.is_available():
            kwargs["device_map"] = {"": int(os.environ.get("LOCAL_RANK", 0))}
    try:
        model = auto_class(config, images).from_pretrained(path, **kwargs)
    except ValueError as e:
        if "trust_remote_code" in str(e):
            raise UserError(f"--model {path} needs its own code to run; pass --trust-remote-code "
                            "if you trust its author") from None
        raise
    model.config.use_cache = False
    model.config.get_text_config().use_cache = False
    freeze_vision(model, cfg.model.train_vision, cfg.model.method)
    return model


@dataclass(frozen=True)
class ModelShape:
    """What the flags ask of the loaded model before any layout cuts it: its kernels (--attn, --experts,
    --kernels) and its adapters (LoRA or QLoRA on the --lora-* flags, or the SFT adapter `--model`
    names). Read from the config once (`of`); `toolkit.parallel.parallelize` applies it first."""
    method: str = "full"
    attn: str = "auto"
    # packed rows reach the model whole (--packing without --cp)
    packing: bool = False
    # unpacked rows end to end: "on", "auto" or None (`toolkit.model.attention.end_to_end`)
    padding_free: str | None = None
    seq_len: int = 2048
    experts: str = "auto"
    kernels: str = "none"
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.0
    lora_targets: str = "all-linear"
    # the SFT adapter trained on (`sft_adapter`)
    adapter: str | None = None
    # image-text models: --train-vision, and the run reads images (the resolved --images)
    train_vision: str = "none"
    images: bool = False

    @classmethod
    def of(cls, cfg: Config) -> "ModelShape":
        from toolkit.model.attention import end_to_end

        m = cfg.model
        return cls(m.method, m.attn, *end_to_end(cfg), cfg.data.seq_len, m.experts, cfg.train.kernels, m.lora_r,
                   m.lora_alpha, m.lora_dropout, m.lora_targets, sft_adapter(m), m.train_vision,
                   cfg.data.images == "on")


def apply_kernels(model, shape: ModelShape) -> None:
    """--experts, --attn and --kernels liger on the loaded model (each checked against the architecture
    by `check_model` before the weights were read)."""
    if shape.experts != "auto":
        model.set_experts_implementation(shape.experts)
    name, _ = attention(shape, model)
    if name is not None:
        from toolkit.model.vision import text_config_key

        # an image-text model's language model alone: the vision tower's attention is bidirectional
        key = text_config_key(model)
        model.set_attn_implementation({key: name} if key else name)
    if shape.images:
        from toolkit.model.vision import lay_out_positions

        # multi-axis positions (M-RoPE) of padding-free rows, per example
        lay_out_positions(model)
    if shape.kernels == "liger":
        apply_liger(model)


def attention(shape: ModelShape, model) -> tuple[str | None, str]:
    """`--attn` for this model (`toolkit.model.attention.choose_attention`): the kernel to set after loading
    (None: the one transformers picked, sdpa where the model supports it, else eager) and its line.
    Rows cut by --cp go through the Ulysses wrapper of the model's own attention; unpacked rows go padding-free
    where the kernel picked keeps them apart (`toolkit.model.attention.end_to_end`)."""
    from toolkit.model.attention import choose_attention

    from toolkit.model.vision import end_to_end_problem

    device = "cuda" if torch.cuda.is_available() else "cpu"
    # image batches of a model that ties its images to their rows are padded (`toolkit.data.image_rows`)
    why = shape.images and end_to_end_problem(model.config)
    name, line = choose_attention(shape.attn, device, shape.packing, model, shape.seq_len,
                                  None if why else shape.padding_free)
    return name, line + (f"; image batches padded ({why})" if why else "")


def apply_lora(model, shape: ModelShape, base: str | None = None):
    """The LoRA (QLoRA) model: a new adapter on the --lora-* flags' targets, less the Linears it cannot
    wrap (`untargetable_linears`), or the SFT adapter `--model` names, trainable (`sft_adapter`). The
    adapter records `base` (default: the path the model was loaded from) as `recorded_base` gives it."""
    from peft import LoraConfig, PeftModel, get_peft_model, prepare_model_for_kbit_training

    if shape.method == "qlora":
        # checkpointing is `toolkit.parallel.parallelize`'s step, as for every method
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    if shape.adapter is not None:
        model = PeftModel.from_pretrained(model, shape.adapter, is_trainable=True)
    else:
        from toolkit.model.vision import has_vision, language_linears, lora_extras

        targets: str | list[str] = shape.lora_targets
        skip = untargetable_linears(model)
        saved = None
        if targets != "all-linear":
            targets = [t.strip() for t in targets.split(",") if t.strip()]
            check_lora_targets(model, targets)
        if has_vision(model):
            # the language model's Linears only (all, or those --lora-targets names): the vision side trains as
            # --train-vision says
            targets, saved = (language_linears(model, set(skip), None if targets == "all-linear" else targets),
                              lora_extras(model, shape.train_vision))
        lora = LoraConfig(r=shape.lora_r, lora_alpha=shape.lora_alpha, lora_dropout=shape.lora_dropout,
                          target_modules=targets, exclude_modules=sorted(skip) or None, modules_to_save=saved,
                          task_type="CAUSAL_LM", bias="none")
        model = get_peft_model(model, lora)
    model.peft_config[model.active_adapter].base_model_name_or_path = recorded_base(
        base or model.get_base_model().name_or_path)
    return model


def weight_file_problem(path: str) -> str | None:
    """A truncated or missing weight file of a local folder, found from the safetensors headers and
    the shard index alone (no tensor is read): safetensors checks that a header covers its file."""
    from safetensors import safe_open

    folder = Path(path)
    if not folder.is_dir():
        # a hub id: transformers reads it from the cache and checks it
        return None
    index = next(folder.glob("*.safetensors.index.json"), None)
    if index is not None:
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError) as e:
            return f"{index} is unreadable ({e})"
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            return f"{index} names {', '.join(missing[:3])}, which {'is' if len(missing) == 1 else 'are'} not there"
    for f in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="pt"):
                pass
        except Exception as e:  # noqa: BLE001 - SafetensorError is not importable by name across versions
            return f"{f} is damaged or incomplete ({' '.join(str(e).split())[:160]})"
    return None


def config_values(config) -> dict:
    """A model's (text) config as a dict, with the standard names its `attribute_map` aliases added
    (GPT-2's n_head as num_attention_heads, n_layer as num_hidden_layers): what the layout rules read."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    values = text.to_dict()
    for standard, own in getattr(text, "attribute_map", {}).items():
        if standard not in values and own in values:
            values[standard] = values[own]
    return values


def check_model(cfg: Config, path: str) -> str:
    """What the architecture alone can refuse (code it needs from the hub, LoRA targets, a weight
    file cut short, an attention it cannot run), found on a weightless meta-device skeleton and the
    files' headers: before any weights are read or the output dir is touched. Returns the line that
    says which attention runs."""
    damaged = weight_file_problem(path)
    if damaged:
        raise UserError(f"--model {path}: {damaged}; copy or download the model again")
    if cfg.train.kernels == "liger":
        liger_problem = kernels_problem()
        if liger_problem:
            raise UserError(liger_problem)
    from accelerate import init_empty_weights
    from transformers import AutoConfig
    from transformers.utils import logging as hf_logging

    from toolkit.model.vision import auto_class

    m = cfg.model
    level = hf_logging.get_verbosity()
    # a custom model_type would also print a warning first
    hf_logging.set_verbosity_error()
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=m.trust_remote_code)
        with init_empty_weights():
            skeleton = auto_class(config, cfg.data.images == "on").from_config(config,
                                                                                trust_remote_code=m.trust_remote_code)
    except ValueError as e:
        if "trust_remote_code" in str(e):
            raise UserError(f"--model {path} needs its own code to run; pass --trust-remote-code "
                            "if you trust its author") from None
        raise
    finally:
        hf_logging.set_verbosity(level)
    # a kernel this model or machine cannot run: one line now
    _, attention_line = attention(ModelShape.of(cfg), skeleton)
    attention_line += experts_line(m, skeleton)
    if m.router_aux_loss_coef is not None and not hasattr(config.get_text_config(), "router_aux_loss_coef"):
        raise UserError(f"--router-aux-loss-coef: {type(skeleton).__name__} has no router load-balancing loss "
                        "(no router_aux_loss_coef in its config); leave the flag out")
    if m.method in ("lora", "qlora") and m.lora_targets != "all-linear" and sft_adapter(m) is None:
        check_lora_targets(skeleton, [t.strip() for t in m.lora_targets.split(",") if t.strip()])
    return attention_line


def count_parameters(model) -> tuple[int, int]:
    """(trainable, total) with tied or shared tensors counted once; ZeRO-3 partitions its parameters
    at load (`ds_numel` is the full size of what each holds a slice of)."""
    seen: set[int] = set()
    trainable = total = 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        # 2 per byte
        n = getattr(p, "ds_numel", p.numel()) * (2 if p.__class__.__name__ == "Params4bit" else 1)
        total += n
        trainable += n if p.requires_grad else 0
    return trainable, total


def human(n: int) -> str:
    """A parameter count for the log: 123.2K, 134.5M, 8.03B."""
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.1f}K"


def training_model(cfg: Config) -> tuple[str, str | None]:
    """(what `from_pretrained` opens for this run, a line on where it came from when `--model` is a
    LoRA adapter folder). An adapter trained on: its base, the adapter loaded onto it by `load_model`.
    Merged (--merge-adapter, or --method full): the merged folder (`merged_model_dir`)."""
    from toolkit.config.output_dir import TRAINER_STATE

    m = cfg.model
    folder = Path(m.model).expanduser()
    # its adapter is in sharded state/
    if is_adapter_dir(folder) and (folder / TRAINER_STATE).is_file():
        raise UserError(f"--model {m.model} is a step checkpoint: write its adapter folder first with `python -m "
                        f"toolkit convert-checkpoint {m.model} --output DIR`, then pass --model DIR")
    path = resolve_model(m.model)
    if not is_adapter_dir(folder):
        if m.merge_adapter:
            raise UserError(f"--merge-adapter: --model {m.model} is not a LoRA adapter folder (no "
                            "adapter_config.json); leave the flag out")
        return path, None
    adapter = sft_adapter(m)
    if adapter is not None:
        lora = json.loads((Path(adapter) / "adapter_config.json").read_text())
        return path, (f"model: {m.model} is a LoRA adapter on {path}: trained on as it is (its r {lora.get('r')}, "
                      f"alpha {lora.get('lora_alpha')}; --lora-r, --lora-alpha, --lora-targets do not apply); "
                      "--merge-adapter trains a new one on the merged model instead")
    merged = merged_model_dir(m.model, path, m.trust_remote_code)
    why = "--merge-adapter" if m.merge_adapter else "--method full"
    return merged, f"model: {m.model} merged into its base {path} ({why}), in {merged}"


def merged_model_dir(adapter: str, base: str, trust_remote_code: bool = False) -> str:
    """The adapter folded into its base, as `python -m toolkit merge` writes it (`load_for_inference`,
    peft's merge_and_unload, the adapter's tokenizer), once per adapter and base in the toolkit cache:
    the run's adapter then records that folder as its base. Ranks started together wait on a file lock;
    the folder is written under a temporary name and renamed into place whole."""
    import hashlib

    from filelock import FileLock

    folder = Path(adapter).expanduser()
    h = hashlib.sha256(os.path.abspath(base).encode() if Path(base).is_dir() else base.encode())
    for f in sorted(folder.iterdir()):
        if f.is_file():
            st = f.stat()
            h.update(f"{f.name}\x00{st.st_size}\x00{st.st_mtime_ns}\x00".encode())
    target = cache_dir() / "merged" / f"{folder.resolve().name}-{h.hexdigest()[:16]}"
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if (target / "config.json").is_file():
            return str(target)
        model = load_for_inference(str(folder), base=base, trust_remote_code=trust_remote_code).merge_and_unload()
        tmp = target.with_name(target.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp, safe_serialization=True)
        load_tokenizer(tokenizer_dir(str(folder), base), trust_remote_code).save_pretrained(tmp)
        os.replace(tmp, target)
    return str(target)


def load_for_inference(path: str, base: str | None = None, dtype: torch.dtype = torch.float32,
                       trust_remote_code: bool = False, flag: str = "--model"):
    """A full model folder or an adapter folder (base from `base` or from the adapter's config). A
    model that asks to run its own code is refused unless `trust_remote_code`, naming `flag`. A folder that holds an
    image processor (final/ of a run that read images) loads as an image-text model (`auto_class`)."""
    from transformers import AutoConfig

    from toolkit.model.vision import auto_class

    where = f"{flag} {path}"
    images = (Path(path) / "preprocessor_config.json").is_file()
    try:
        if is_adapter_dir(path):
            from peft import PeftModel

            base_path = resolve_model(base) if base else adapter_base_path(path, flag)
            where = f"the base model {base or adapter_base(path, flag)}"
            config = AutoConfig.from_pretrained(base_path, trust_remote_code=trust_remote_code)
            base_model = auto_class(config, images).from_pretrained(base_path, dtype=dtype,
                                                                   trust_remote_code=trust_remote_code)
            return PeftModel.from_pretrained(base_model, path)
        path = resolve_model(path)
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        return auto_class(config, images).from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code)
    except ValueError as e:
        if "trust_remote_code" in str(e):
            raise UserError(f"{where} needs its own code to run; pass --trust-remote-code if you trust its "
                            "author") from None
        raise
