"""Helpers the tests share: a run's metrics records and losses, and tiny models of random weights, in
memory or saved as a model folder with the tests' tokenizer (`toolkit.model.synthetic` builds the
Llama folder and the tokenizer)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from toolkit.model.synthetic import ZOO, build_model_dir, build_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["build_model_dir", "build_tokenizer", "losses", "records", "random_model", "save_model_dir", "tiny_llama"]


def records(out: str | Path, *keys: str) -> list[dict]:
    """The run's metrics.jsonl records (`out`: its output folder), in order; with `keys`, only those
    that hold every one of them."""
    rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if all(k in r for k in keys)]


def losses(out: str | Path, steps: bool = False) -> list[float] | list[tuple[int, float]]:
    """The run's logged training losses (its records that hold a `loss`), in order; with `steps`, as
    (step, loss) pairs (`dict(...)` of them: {step: loss})."""
    if steps:
        return [(r["step"], r["loss"]) for r in records(out, "loss")]
    return [r["loss"] for r in records(out, "loss")]


def random_model(model_type: str, **config) -> PreTrainedModel:
    """A causal LM of random weights (torch seed 0) from `AutoConfig.for_model(model_type, **config)`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **config))


def tiny_llama(**overrides) -> PreTrainedModel:
    """A Llama of random weights (torch seed 0) in memory: `ZOO["llama"]`'s 2 blocks of hidden 64, 4 heads
    over 2 key/value heads, with a vocabulary of 100 and 64 positions, unless `overrides` say otherwise."""
    return random_model("llama", **{**ZOO["llama"], "vocab_size": 100, "max_position_embeddings": 64, **overrides})


def save_model_dir(path: str | Path, model: PreTrainedModel,
                   tokenizer: PreTrainedTokenizerBase | None = None) -> Path:
    """`path`, a model folder `from_pretrained` loads: `model` saved with `tokenizer` (`build_tokenizer()`'s
    unless given; its ids are those `model`'s config was built with)."""
    model.save_pretrained(path, safe_serialization=True)
    (tokenizer or build_tokenizer()).save_pretrained(path)
    return Path(path)
