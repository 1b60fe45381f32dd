"""Cutting an HF decoder into contiguous pipeline stages.

Stage 0 holds the embeddings and the first blocks, the last stage the last blocks, the final norm
and the LM head; the blocks in between are split so the largest stage is as small as possible
(by parameter count, or by measured block time). Each stage is an `nn.Module` that reuses the
model's own modules (same Parameter objects), so the HF model itself is what gets saved.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from toolkit.errors import UserError
from toolkit.planner.stages import balance, stage_bounds  # pure: the planner cuts the same way


@dataclass
class DecoderParts:
    """The pieces of a Llama-style decoder (`model.model.{embed_tokens,layers,norm,rotary_emb}`,
    `model.lm_head`) that the stages are cut from."""
    config: object
    embed: nn.Module
    layers: list[nn.Module]
    norm: nn.Module
    rotary: nn.Module
    head: nn.Module


def stage_names(config, model_cls: type | None = None) -> tuple[str, str, str, str]:
    """(embeddings, blocks, final norm, LM head) attribute names, from the config's
    `base_model_pp_plan` and the model class's `_pp_plan` (transformers' own: the decoder's modules in
    forward order, the blocks being the one that runs per layer); Llama's names where none is declared."""
    plan = list(getattr(config, "base_model_pp_plan", None) or {})
    embed, layers, norm = (plan[0], plan[1], plan[-1]) if len(plan) == 3 else ("embed_tokens", "layers", "norm")
    head = next(iter(getattr(model_cls, "_pp_plan", None) or {}), "lm_head")
    return embed, layers, norm, head


def decoder_parts(model: nn.Module, flag: str = "--pp") -> DecoderParts:
    """Find the decoder's pieces in a (possibly peft-wrapped) HF causal LM, or say what is there."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    inner = getattr(base, "model", None)
    embed, layers, norm, head_name = stage_names(base.config, type(base))
    names = {embed: None, layers: None, norm: None, "rotary_emb": None}
    for name in names:
        names[name] = getattr(inner, name, None) if inner is not None else None
    head = getattr(base, head_name, None)
    missing = [f"model.{k}" for k, v in names.items() if v is None] + ([] if head is not None else [head_name])
    if missing:
        found = ", ".join(f"{n} ({type(m).__name__})" for n, m in base.named_children())
        inner_found = ", ".join(f"model.{n} ({type(m).__name__})" for n, m in inner.named_children()) if inner is not None else ""
        raise UserError(f"{flag}: cannot split {type(base).__name__} into pipeline stages: missing "
                        f"{', '.join(missing)}; found {found}{'; ' + inner_found if inner_found else ''}. "
                        "Supported: Llama-style decoders (Llama, Mistral, Qwen2, Qwen3, SmolLM)")
    return DecoderParts(base.config, names[embed], list(names[layers]), names[norm], names["rotary_emb"], head)


def param_costs(parts: DecoderParts) -> tuple[list[float], float, float]:
    """(per-block, embeddings, norm + head) parameter counts; a tied head counts once, on stage 0."""
    def count(m: nn.Module) -> int:
        return sum(p.numel() for p in m.parameters())

    tied = parts.head.weight is parts.embed.weight
    last = count(parts.norm) + (0 if tied else count(parts.head))
    return [float(count(b)) for b in parts.layers], float(count(parts.embed)), float(last)


def time_costs(parts: DecoderParts, batch: int, seq: int, device: torch.device, reps: int = 3) -> tuple[list[float], float, float]:
    """(per-block, embeddings, norm + head) forward+backward seconds on a random (batch, seq)
    input, median of `reps` after a warm-up; for models whose blocks differ in cost."""
    import time

    h = parts.config.hidden_size
    ids = torch.randint(0, parts.config.vocab_size, (batch, seq), device=device)
    pos = torch.arange(seq, device=device).unsqueeze(0).expand(batch, seq)

    def timed(fn) -> float:
        fn()
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            ts.append(time.perf_counter() - t0)
        return sorted(ts)[len(ts) // 2]

    x = torch.randn(batch, seq, h, device=device, requires_grad=True)
    with torch.no_grad():
        rot = tuple(t.detach() for t in parts.rotary(x, pos))

    def block(layer):
        return lambda: layer(x, attention_mask=None, position_embeddings=rot, position_ids=pos,
                             use_cache=False).float().sum().backward()

    blocks = [timed(block(b)) for b in parts.layers]
    embed = timed(lambda: parts.embed(ids).float().sum().backward() if parts.embed.weight.requires_grad
                  else parts.embed(ids))
    last = timed(lambda: parts.head(parts.norm(x)).float().logsumexp(-1).sum().backward())
    for m in (parts.embed, parts.norm, parts.head, *parts.layers):
        m.zero_grad(set_to_none=True)
    return blocks, embed, last


class DecoderStage(nn.Module):
    """Blocks [start, stop) of the decoder; stage 0 embeds token ids, the last stage applies the
    final norm and LM head. forward(x, attention_mask=None, position_ids=None) takes token ids
    (stage 0) or hidden states (B, T, h) and returns hidden states or logits (B, T, V).

    The causal (or packed block-diagonal, or sliding-window) mask and the rotary embeddings are
    rebuilt on every stage from `attention_mask` / `position_ids`, exactly as the HF model's own
    forward builds them, so only hidden states travel between stages."""

    def __init__(self, parts: DecoderParts, start: int, stop: int, first: bool, last: bool,
                 autocast_dtype: torch.dtype | None = None):
        super().__init__()
        self.config, self.start, self.first, self.last = parts.config, start, first, last
        self.embed = parts.embed if first else None
        self.layers = nn.ModuleList(parts.layers[start:stop])
        self.norm = parts.norm if last else None
        self.head = parts.head if last else None
        self.rotary = parts.rotary
        self.autocast_dtype = autocast_dtype

    def _masks(self, x: torch.Tensor, attention_mask, position_ids) -> dict[str, object]:
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        kw = dict(config=self.config, inputs_embeds=x, attention_mask=attention_mask, past_key_values=None,
                  position_ids=position_ids)
        kinds = set(self._kinds())
        return {k: (create_sliding_window_causal_mask if k == "sliding_attention" else create_causal_mask)(**kw)
                for k in kinds}

    def _kinds(self) -> list[str]:
        types = getattr(self.config, "layer_types", None)
        if types:
            return [types[self.start + i] for i in range(len(self.layers))]
        sliding = getattr(self.config, "model_type", "") == "mistral" and getattr(self.config, "sliding_window", None)
        return ["sliding_attention" if sliding else "full_attention"] * len(self.layers)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        device = next(self.layers.parameters()).device if len(self.layers) else x.device
        if self.autocast_dtype is None:
            return self._forward(x, attention_mask, position_ids, device)
        with torch.autocast(device.type, dtype=self.autocast_dtype):
            return self._forward(x, attention_mask, position_ids, device)

    def _forward(self, x, attention_mask, position_ids, device) -> torch.Tensor:
        if self.embed is not None:  # a tied embedding may live on another stage's device
            x = self.embed(x.to(self.embed.weight.device)).to(device)
        x = x.to(device)
        if position_ids is None:
            position_ids = torch.arange(x.shape[1], device=device).unsqueeze(0).expand(x.shape[0], -1)
        position_ids = position_ids.to(device)
        attention_mask = attention_mask.to(device) if attention_mask is not None else None
        masks = self._masks(x, attention_mask, position_ids)
        rotary = self.rotary(x, position_ids=position_ids)
        for layer, kind in zip(self.layers, self._kinds()):
            x = layer(x, attention_mask=masks[kind], position_embeddings=rotary, position_ids=position_ids,
                      use_cache=False)
        if self.last:
            x = self.norm(x)
            x = self.head(x.to(self.head.weight.device))
        return x
