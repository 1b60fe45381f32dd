"""Sampling completions for `--objective grpo` from the policy itself (an HF causal LM, peft-wrapped or not: no
second copy of the weights): a decode loop over a KV cache (transformers' DynamicCache) in eval mode.

Why not `model.generate`: its draws come from one global random stream over the whole batch, so a
completion depends on which other prompts share its batch, and so on the layout (how many ranks split the
generation batch, and in what order). Here each completion draws from its own torch.Generator, seeded from
(seed, step, prompt index, generation index) (`completion_seed`): its tokens depend only on those, the
model and the prompt, alone or in any batch (tests/test_grpo_functions.py checks it on a tiny model in fp32;
under bf16 or on another kernel a batch's shape can move a logit by an ulp, and a draw that lands on that
boundary would change). All of a completion's uniforms are drawn up front on the CPU (one per position),
and each token is the inverse CDF of the processed distribution at that uniform, so a step costs no
per-row Python.

The distribution is transformers' sampling: the last position's logits in fp32 through TemperatureLogitsWarper,
TopKLogitsWarper, TopPLogitsWarper and MinPLogitsWarper, in that order (`GenerationMixin._get_logits_processor`,
which TRL's GRPOTrainer uses with do_sample=True), then softmax. A row stops at its first EOS (any of
`eos_ids`, TRL's list: the tokenizer's and the generation config's); later positions hold `pad_id`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Callable, Sequence

import torch


@dataclass(frozen=True)
class SamplingConfig:
    """TRL's GRPOConfig generation settings (its defaults; top_k 0 and top_p 1.0 turn those off)."""
    max_completion_length: int = 512
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float | None = None

    def __post_init__(self):
        if self.max_completion_length < 1:
            raise ValueError(f"max_completion_length {self.max_completion_length}: at least 1")
        if not self.temperature > 0:
            raise ValueError(f"temperature {self.temperature}: above 0 (sampling; greedy is not GRPO)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p {self.top_p}: in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"top_k {self.top_k}: 0 (off) or more")
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p {self.min_p}: in [0, 1]")


@dataclass(frozen=True)
class Completions:
    """ids (B, L) right-padded with pad_id after each row's EOS; mask (B, L) 1 on a completion's tokens, its
    EOS included (TRL's completion_mask); truncated (B,) True where no EOS came within max_completion_length.
    L is the longest completion's length, at most max_completion_length."""
    ids: torch.Tensor
    mask: torch.Tensor
    truncated: torch.Tensor

    def token_lists(self) -> list[list[int]]:
        """Each completion's tokens, EOS included, no padding: TRL's completion_ids for reward functions."""
        return [row[m.bool()].tolist() for row, m in zip(self.ids.cpu(), self.mask.cpu())]


def completion_seed(seed: int, step: int, prompt: int, generation: int) -> int:
    """A 63-bit seed for one completion: blake2b of the four numbers, so neighbouring prompts, steps or
    generations get unrelated streams. `prompt` is the record's index in the dataset (not its place in a
    batch), so the seed does not depend on the layout."""
    digest = hashlib.blake2b(f"{seed}/{step}/{prompt}/{generation}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def logits_warpers(cfg: SamplingConfig):
    """transformers' LogitsProcessorList for `cfg`, in `GenerationMixin._get_logits_processor`'s order and with
    its conditions (a warper that would do nothing is left out)."""
    from transformers import (LogitsProcessorList, MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper,
                              TopPLogitsWarper)

    warpers = LogitsProcessorList()
    if cfg.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(cfg.temperature))
    if cfg.top_k != 0:
        warpers.append(TopKLogitsWarper(top_k=cfg.top_k, min_tokens_to_keep=1))
    if cfg.top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=cfg.top_p, min_tokens_to_keep=1))
    if cfg.min_p is not None:
        warpers.append(MinPLogitsWarper(min_p=cfg.min_p, min_tokens_to_keep=1))
    return warpers


def uniforms(seeds: Sequence[int], n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """(B, n) uniforms in [0, 1), row i from its own CPU generator seeded with seeds[i] (the CPU's stream, so
    the same on every device type)."""
    rows = [torch.rand(n, generator=torch.Generator().manual_seed(s), dtype=torch.float64) for s in seeds]
    return torch.stack(rows).to(device)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """(B,) the token at which each row's cumulative probability first exceeds u x its total: an exact draw
    from `probs` (B, V) given u (B,) uniform in [0, 1). Never a token of probability 0."""
    cdf = probs.double().cumsum(-1)
    token = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
    last = torch.where(probs > 0, torch.arange(probs.shape[1], device=probs.device), -1).amax(1)
    return torch.minimum(token, last)  # u x total rounding up to the total would pick past the end


def left_pad(prompt_ids: Sequence[Sequence[int]], pad_id: int,
             device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention mask), (B, P): prompts left-padded to the longest, as generation needs them."""
    width = max(len(p) for p in prompt_ids)
    ids = torch.full((len(prompt_ids), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompt_ids), width), dtype=torch.long)
    for i, p in enumerate(prompt_ids):
        if len(p):
            ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p):] = 1
    return ids.to(device), mask.to(device)


class _EvalMode:
    """Every module in eval mode (dropout off), each module's own mode restored after."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def __enter__(self):
        self.modes = [(m, m.training) for m in self.model.modules()]
        self.model.eval()

    def __exit__(self, *exc):
        for m, training in self.modes:
            m.training = training


def _accepts_logits_to_keep(model: torch.nn.Module) -> bool:
    import inspect

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "logits_to_keep" in inspect.signature(base.forward).parameters


def any_unfinished_here(unfinished: torch.Tensor) -> bool:
    """Whether any row on this rank still samples. Under ZeRO-3 or FSDP every forward is a collective, so every
    rank must run as many steps: pass a reduction over ranks instead (any rank unfinished)."""
    return bool(unfinished.any())


@torch.no_grad()
def sample(model: torch.nn.Module, prompt_ids: Sequence[Sequence[int]], seeds: Sequence[int], cfg: SamplingConfig,
           eos_ids: Sequence[int], pad_id: int,
           any_unfinished: Callable[[torch.Tensor], bool] = any_unfinished_here) -> Completions:
    """One completion per prompt (a prompt repeated for its G generations, each with its own seed), sampled
    from `model` with a KV cache; the model's train/eval mode is restored after."""
    from transformers import DynamicCache

    if len(seeds) != len(prompt_ids):
        raise ValueError(f"sample: {len(seeds)} seeds for {len(prompt_ids)} prompts")
    device = next(model.parameters()).device
    ids, attention = left_pad(prompt_ids, pad_id, device)
    positions = (attention.cumsum(-1) - 1).clamp(min=0)  # each prompt's own positions from 0, as generate's
    u = uniforms(seeds, cfg.max_completion_length, device)
    warpers = logits_warpers(cfg)
    eos = torch.tensor(list(eos_ids), dtype=torch.long, device=device)
    keep = {"logits_to_keep": 1} if _accepts_logits_to_keep(model) else {}
    config = model.get_base_model().config if hasattr(model, "get_base_model") else model.config
    tokens, masks = [], []
    finished = torch.zeros(len(prompt_ids), dtype=torch.bool, device=device)
    cache = DynamicCache(config=config)
    with _EvalMode(model):
        out = model(input_ids=ids, attention_mask=attention, position_ids=positions, cache=cache, use_cache=True,
                    **keep)
        for t in range(cfg.max_completion_length):
            scores = warpers(ids, out.logits[:, -1].float())
            token = inverse_cdf(torch.softmax(scores, dim=-1), u[:, t])
            token = torch.where(finished, pad_id, token)
            masks.append(~finished)
            tokens.append(token)
            finished = finished | torch.isin(token, eos)
            if t + 1 == cfg.max_completion_length or not any_unfinished(~finished):
                break
            attention = torch.cat([attention, attention.new_ones(len(prompt_ids), 1)], dim=1)
            positions = positions[:, -1:] + 1
            out = model(input_ids=token.unsqueeze(1), attention_mask=attention, position_ids=positions,
                        cache=cache, use_cache=True, **keep)
    return Completions(torch.stack(tokens, 1), torch.stack(masks, 1).long(), ~finished)
