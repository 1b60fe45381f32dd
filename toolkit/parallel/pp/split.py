"""Cutting an HF decoder into contiguous pipeline stages.

Stage 0 holds the embeddings and the first blocks, the last stage the last blocks, the final norm
and the LM head; the blocks in between are split so the largest stage is as small as possible
(by parameter count, or by measured block time). Each stage is an `nn.Module` that reuses the
model's own modules (same Parameter objects), so the HF model itself is what gets saved.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass

import torch
from torch import nn

from toolkit.errors import UserError
from toolkit.objectives.sft.loss import LogitTransform


# the attention kinds whose masks transformers builds from the 2D mask and positions alone
# (`masking_utils.create_masks_for_generate`); other layer types (recurrent, linear) need state a stage
# does not carry
MASKED_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")


@dataclass
class DecoderParts:
    """The pieces of an HF decoder that the stages are cut from, named by its config's
    `base_model_pp_plan` (transformers' own: the decoder's modules in forward order, one of them the
    blocks) in the decoder the model class names (`base_model_prefix`: `model`, `gpt_neox`), and the
    model's LM head (`get_output_embeddings`) with its logit transform."""
    config: object
    # the base model: its forward makes the embeddings (`embeddings`) the plan's entries before the blocks: the
    # embedding first the plan's entry that runs per layer
    decoder: nn.Module
    before: dict[str, nn.Module]
    blocks: str
    layers: list[nn.Module]
    # the plan's entries after the blocks: the final norm the decoder's `rotary_emb`, where it has one
    after: dict[str, nn.Module]
    rotary: nn.Module | None
    head: nn.Module
    # what the model's forward does to the head's logits
    transform: LogitTransform

    @property
    def embed(self) -> nn.Module:
        return next(iter(self.before.values()))

    def embeddings(self, input_ids: torch.Tensor, attention_mask, position_ids) -> torch.Tensor:
        """What the decoder's own forward gives its first block: that forward, run with no blocks and
        the entries after them as identities, so whatever it does between the embedding and the blocks
        (Gemma's scaled embedding, Granite's `embedding_multiplier`, GPT-NeoX's dropout) is done its way."""
        empty = {self.blocks: nn.ModuleList(), **{name: nn.Identity() for name in self.after}}
        saved = {name: getattr(self.decoder, name) for name in empty}
        for name, module in empty.items():
            setattr(self.decoder, name, module)
        try:
            return self.decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                use_cache=False).last_hidden_state
        finally:
            for name, module in saved.items():
                setattr(self.decoder, name, module)

    def block_kwargs(self, x: torch.Tensor, attention_mask, position_ids, indices) -> list[dict]:
        """For each block in `indices`, what the decoder's own forward passes it: the mask of its layer
        type (`config.layer_types[i]`: full, sliding window, chunked), built by transformers' own
        `create_masks_for_generate` (the forwards' mask mapping, for a cache-free forward), and the rotary
        embeddings (per layer type where the rotary takes one, as Gemma 3's)."""
        from transformers.masking_utils import create_masks_for_generate

        masks = create_masks_for_generate(self.config, x, attention_mask, None, position_ids)
        types = getattr(self.config, "layer_types", None)
        kinds = [types[i] if types else None for i in indices]
        rotary = {}
        if self.rotary is not None:
            if "layer_type" in inspect.signature(self.rotary.forward).parameters:
                rotary = {k: self.rotary(x, position_ids, k) for k in set(kinds)}
            else:
                rotary = dict.fromkeys(kinds, self.rotary(x, position_ids))
        out = []
        for kind in kinds:
            kw = dict(attention_mask=masks[kind] if isinstance(masks, dict) else masks, position_ids=position_ids,
                      use_cache=False)
            if rotary:
                kw["position_embeddings"] = rotary[kind]
            out.append(kw)
        return out

    def final(self, x: torch.Tensor) -> torch.Tensor:
        """The decoder's output from the last block's: the plan's entries after the blocks (the norm)."""
        for module in self.after.values():
            x = module(x)
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head and the model's own transform of its logits (Cohere's logit_scale, Granite's
        logits_scaling, Gemma's final softcapping), as the model's forward applies them."""
        return self.transform.apply(self.head(hidden.to(self.head.weight.device)))


def decoder_parts(model: nn.Module, flag: str = "--pp") -> DecoderParts:
    """Find the decoder's pieces in a (possibly peft-wrapped) HF causal LM from its config's
    `base_model_pp_plan`, or say in one line what is missing."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
    what = f"{type(base).__name__} (model type {getattr(config, 'model_type', '?')})"
    plan = list(getattr(config, "base_model_pp_plan", None) or {})
    if not plan:
        raise UserError(f"{flag}: {what} declares no base_model_pp_plan; --pp needs it")
    prefix = getattr(base, "base_model_prefix", "model")
    decoder = getattr(base, prefix, None)
    modules = {name: getattr(decoder, name, None) for name in plan} if decoder is not None else {}
    missing = [f"{prefix}.{name}" for name in plan if modules.get(name) is None]
    blocks = [name for name, m in modules.items() if isinstance(m, nn.ModuleList)]
    head = base.get_output_embeddings()
    if missing or len(blocks) != 1 or blocks[0] == plan[0] or head is None:
        why = (f"{', '.join(missing)} missing" if missing else "no LM head" if head is None
               else f"{len(blocks)} block lists ({', '.join(blocks)})" if len(blocks) != 1
               else "no embedding before the blocks")
        raise UserError(f"{flag}: cannot cut {what} into pipeline stages by its base_model_pp_plan "
                        f"({', '.join(plan)}): {why}")
    unknown = sorted(set(getattr(config, "layer_types", None) or ()) - set(MASKED_LAYER_TYPES))
    if unknown:
        raise UserError(f"{flag}: {what} has {', '.join(unknown)} layers, whose state pipeline stages do not "
                        f"carry (they run {', '.join(MASKED_LAYER_TYPES)})")
    # masks the stages' causal ones would not match
    if getattr(config, "use_bidirectional_attention", False):
        raise UserError(f"{flag}: {what} sets use_bidirectional_attention, which pipeline stages do not run")
    at = plan.index(blocks[0])
    return DecoderParts(config, decoder, {n: modules[n] for n in plan[:at]}, blocks[0], list(modules[blocks[0]]),
                        {n: modules[n] for n in plan[at + 1:]}, getattr(decoder, "rotary_emb", None), head,
                        LogitTransform.of(base))


def autocast(device: torch.device, dtype: torch.dtype | None):
    """The stages' autocast (`dtype`, or none) on `device`'s type."""
    return torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()


class _Given(nn.Module):
    """A decoder stand-in that returns the final hidden states it was given (`own_loss`)."""

    def __init__(self, hidden: torch.Tensor):
        super().__init__()
        self.hidden = hidden

    def forward(self, *args, **kwargs):
        from transformers.modeling_outputs import MoeModelOutputWithPast

        return MoeModelOutputWithPast(last_hidden_state=self.hidden)


@torch.no_grad()
def own_loss(model: nn.Module, hidden: torch.Tensor, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The model's own loss (`model(input_ids, labels=...)`) on the final hidden states `hidden` (its
    decoder's output): its forward run with the decoder replaced by a stand-in that returns them, so its
    own LM head, logit transform and loss function give the reference the pipeline's last stage is
    checked against."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    prefix = getattr(base, "base_model_prefix", "model")
    decoder = getattr(base, prefix)
    device = base.get_output_embeddings().weight.device
    setattr(base, prefix, _Given(hidden.to(device)))
    try:
        return base(input_ids=input_ids.to(device), labels=labels.to(device)).loss
    finally:
        setattr(base, prefix, decoder)


def param_costs(parts: DecoderParts) -> tuple[list[float], float, float]:
    """(per-block, embeddings, norm + head) parameter counts; a tied head counts once, on stage 0."""
    def count(*modules: nn.Module) -> int:
        return sum(p.numel() for m in modules for p in m.parameters())

    tied = parts.head.weight is parts.embed.weight
    last = count(*parts.after.values()) + (0 if tied else count(parts.head))
    return [float(count(b)) for b in parts.layers], float(count(*parts.before.values())), float(last)


def time_costs(parts: DecoderParts, batch: int, seq: int, device: torch.device,
               reps: int = 3) -> tuple[list[float], float, float]:
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

    x = torch.randn(batch, seq, h, device=device, dtype=parts.embed.weight.dtype, requires_grad=True)
    with torch.no_grad():
        inputs = parts.block_kwargs(x.detach(), None, pos, range(len(parts.layers)))

    def block(layer, kw):
        return lambda: layer(x, **kw).float().sum().backward()

    blocks = [timed(block(b, kw)) for b, kw in zip(parts.layers, inputs)]
    embed = timed(lambda: parts.embed(ids).float().sum().backward() if parts.embed.weight.requires_grad
                  else parts.embed(ids))
    last = timed(lambda: parts.logits(parts.final(x)).float().logsumexp(-1).sum().backward())
    for m in (*parts.before.values(), *parts.after.values(), parts.head, *parts.layers):
        m.zero_grad(set_to_none=True)
    return blocks, embed, last


class DecoderStage(nn.Module):
    """Blocks [start, stop) of the decoder; stage 0 embeds token ids, the last stage applies the
    final norm, the LM head and the model's logit transform. forward(x, attention_mask=None,
    position_ids=None) takes token ids (stage 0) or hidden states (B, T, h) and returns hidden
    states or logits (B, T, V).

    Stage 0's embeddings come from the decoder's own forward (`DecoderParts.embeddings`); each
    stage rebuilds its blocks' masks (causal, packed block-diagonal, sliding window, per layer type)
    and rotary embeddings from `attention_mask` / `position_ids` with the model's own machinery
    (`DecoderParts.block_kwargs`), so only hidden states travel between stages."""

    def __init__(self, parts: DecoderParts, start: int, stop: int, first: bool, last: bool,
                 autocast_dtype: torch.dtype | None = None):
        super().__init__()
        # a dataclass, not a module: the stage registers only the pieces it holds
        self.parts = parts
        self.config, self.start, self.first, self.last = parts.config, start, first, last
        self.before = nn.ModuleList(parts.before.values()) if first else None
        self.layers = nn.ModuleList(parts.layers[start:stop])
        self.after = nn.ModuleList(parts.after.values()) if last else None
        self.head = parts.head if last else None
        self.rotary = parts.rotary
        self.autocast_dtype = autocast_dtype
        # the last stage's final hidden states, for the loss check
        self.keep_hidden, self.kept = False, None

    @property
    def embed(self) -> nn.Module | None:
        return self.before[0] if self.before is not None else None

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        device = next(self.layers.parameters()).device if len(self.layers) else x.device
        with autocast(device, self.autocast_dtype):
            return self._forward(x, attention_mask, position_ids, device)

    def _forward(self, x, attention_mask, position_ids, device) -> torch.Tensor:
        if position_ids is None:
            position_ids = torch.arange(x.shape[1], device=device).unsqueeze(0).expand(x.shape[0], -1)
        # a tied embedding may live on another stage's device
        if self.first:
            at = self.embed.weight.device
            x = self.parts.embeddings(x.to(at), attention_mask.to(at) if attention_mask is not None else None,
                                      position_ids.to(at))
        x = x.to(device)
        position_ids = position_ids.to(device)
        attention_mask = attention_mask.to(device) if attention_mask is not None else None
        inputs = self.parts.block_kwargs(x, attention_mask, position_ids,
                                         range(self.start, self.start + len(self.layers)))
        for layer, kw in zip(self.layers, inputs):
            x = layer(x, **kw)
        if self.last:
            x = self.parts.final(x)
            if self.keep_hidden:
                self.kept = x.detach()
            x = self.parts.logits(x)
        return x
