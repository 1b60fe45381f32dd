"""Context parallelism, DeepSpeed-Ulysses style: each rank of a `cp` group holds S/cp tokens of every
sequence, and every layer except attention is token-local, so it runs on that slice unchanged.
Attention is the one place a token needs the others; there an all-to-all turns the sequence
split into a head split and back (Jacobs et al. 2023, arXiv:2309.14509):

    q, k, v  (B, H, S/cp, D)  --all-to-all-->  (B, H/cp, S, D)   attention over the whole sequence
    out      (B, S, H/cp, D)  --all-to-all-->  (B, S/cp, H, D)   for this rank's heads

Each all-to-all moves (cp-1)/cp of the tensor, and its backward is the same exchange with the
split and gathered dimensions swapped. Heads (after TP's own split) must divide by cp.

It plugs in through transformers' attention interface (`ulysses_<inner>` wraps the model's own
`sdpa`/`eager` function), so any model that calls attention through it works. Outside a
`ContextParallel.shard` block the wrapper is the inner function itself (evaluation, generation).

Why not DeepSpeed 0.19's `UlyssesSPAttentionHF`: it drops 4-D masks (packed rows would attend
across documents with SDPA and eager; only flash-attention varlen keeps them apart), takes its group
from DeepSpeed's own sequence-parallel state (consecutive ranks, not the mesh's `cp` dimension,
which is strided when TP is inside), and replaces the global `sdpa` entry for every model.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from functools import partial
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F

from toolkit.data.tokenize import IGNORE_INDEX
from toolkit.data.labels import shift_labels
from toolkit.config.objectives import WHOLE
from toolkit.objectives.preference.functions import orpo_labels

# the attention functions the wrapper has been checked with inside `shard`: {"group": ..., "mask": the whole sequence's
# mask}
INNER = ("sdpa", "eager")
_active: dict | None = None


class _AllToAll(torch.autograd.Function):
    """Split `x` into cp parts along `scatter`, send part j to rank j, concatenate what arrives along
    `gather` (in rank order). Backward: the same exchange with the two dimensions swapped."""

    @staticmethod
    def forward(ctx, x, group, scatter: int, gather: int):
        ctx.group, ctx.dims = group, (scatter, gather)
        return _exchange(x, group, scatter, gather)

    @staticmethod
    def backward(ctx, grad):
        scatter, gather = ctx.dims
        return _exchange(grad, ctx.group, gather, scatter), None, None, None


def _exchange(x: torch.Tensor, group, scatter: int, gather: int) -> torch.Tensor:
    n = dist.get_world_size(group)
    # (n, ...): part j goes to rank j
    send = torch.stack(x.chunk(n, dim=scatter)).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), dim=gather)


def ulysses_attention(module, query, key, value, attention_mask, *args, inner: str, **kwargs):
    """transformers' attention signature: q, k, v (B, heads, S_local, D) -> ((B, S_local, heads, D), None)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    # eager is not in the interface: each modeling file has its own (the default it falls back to)
    attend = (ALL_ATTENTION_FUNCTIONS[inner] if inner != "eager"
              else sys.modules[type(module).__module__].eager_attention_forward)
    if _active is None:
        return attend(module, query, key, value, attention_mask, *args, **kwargs)
    group = _active["group"]
    # heads split, whole sequence
    q, k, v = (_AllToAll.apply(t, group, 1, 2) for t in (query, key, value))
    # The model built its mask for the local slice; attention here needs the whole sequence's, of this
    # layer's kind (a sliding-window layer its window's).
    window = kwargs.get("sliding_window") or getattr(module, "sliding_window", None)
    mask = _active["masks"]["sliding" if window else "full"]
    # per-head sinks (gpt-oss): this rank's heads
    if isinstance(getattr(module, "sinks", None), torch.Tensor):
        module = _HeadSlice(module, dist.get_rank(group), dist.get_world_size(group))
    # (B, S, H/cp, D)
    out, _ = attend(module, q, k, v, mask, *args, **kwargs)
    # (B, S/cp, H, D)
    return _AllToAll.apply(out, group, 1, 2), None


class _HeadSlice:
    """An attention module as the inner attention function sees it after the all-to-all: its per-head
    parameters (attention sinks) cut to the heads this rank now holds (the r-th of cp equal parts).
    Each rank's slice gets only its heads' gradient; the cp ranks' sum is the whole one."""

    def __init__(self, module, rank: int, cp: int):
        heads = module.sinks.shape[0] // cp
        self._module, self.sinks = module, module.sinks[rank * heads:(rank + 1) * heads]

    def __getattr__(self, name: str):
        return getattr(self._module, name)


def use_ulysses(model) -> str:
    """Switch `model` to the Ulysses wrapper of its current attention; returns the inner name."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    inner = model.config._attn_implementation
    if inner.startswith("ulysses_"):
        return inner.removeprefix("ulysses_")
    if inner not in INNER:
        from toolkit.errors import UserError

        raise UserError(f"--cp needs sdpa or eager attention; this model runs {inner!r} "
                        "(load it with --attn-implementation sdpa)")
    name = f"ulysses_{inner}"
    AttentionInterface.register(name, partial(ulysses_attention, inner=inner))
    # masks as the inner builds them
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[inner])
    model.set_attn_implementation(name)
    return inner


def pad_to_multiple(batch: dict[str, torch.Tensor], n: int) -> dict[str, torch.Tensor]:
    """Right-pad a collated batch to a multiple of n tokens: padding attends nowhere real (attention
    mask 0; packed rows: positions restart at 0, a block of its own) and has no targets."""
    ids = batch["input_ids"]
    width, extra = ids.shape[1], -ids.shape[1] % n
    packed = "position_ids" in batch
    # explicit positions for plain rows too: a slice must not restart them at 0
    positions = batch["position_ids"] if packed else torch.arange(width, device=ids.device).expand_as(ids)
    if not extra:
        return {**batch, "position_ids": positions}
    more = torch.arange(extra, device=ids.device).expand(len(ids), -1)
    pad = partial(F.pad, pad=(0, extra))
    return {**batch, "input_ids": pad(ids, value=0), "labels": pad(batch["labels"], value=IGNORE_INDEX),
            "attention_mask": pad(batch["attention_mask"], value=0),
            "position_ids": torch.cat([positions, more if packed else more + width], 1)}


class ContextParallel:
    """This rank's slice of every sequence, and the attention that sees the whole of it."""

    def __init__(self, group, model_config, dtype: torch.dtype = torch.float32):
        # dtype: the masks' (as the model's)
        self.group, self.config, self.dtype = group, model_config, dtype
        self.cp, self.rank = dist.get_world_size(group), dist.get_rank(group)
        text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
        # some layers may attend in a window
        self.sliding = getattr(text, "sliding_window", None) is not None

    @contextmanager
    def shard(self, batch: dict[str, torch.Tensor]) -> Iterator[dict]:
        """{"inputs": this rank's model inputs, "targets": its shifted labels}; the forward and the
        backward (checkpointed layers recompute attention) run inside. Packed rows keep their own
        positions and block-diagonal mask: both are built on the whole sequence, then split."""
        global _active
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        packed = "position_ids" in batch
        full = pad_to_multiple(batch, self.cp)
        ids, positions = full["input_ids"], full["position_ids"]
        b, s = ids.shape
        shape_only = torch.empty((b, s, 0), device=ids.device, dtype=self.dtype)
        no_cache = {_cache_name(create_causal_mask): None}
        masks = {kind: make(config=self.config, inputs_embeds=shape_only, **no_cache,
                            attention_mask=None if packed else full["attention_mask"], position_ids=positions)
                 for kind, make in (("full", create_causal_mask), ("sliding", create_sliding_window_causal_mask))
                 if kind == "full" or self.sliding}
        mask = masks["full"]
        part = slice(self.rank * s // self.cp, (self.rank + 1) * s // self.cp)
        local = {"inputs": {"input_ids": ids[:, part], "position_ids": positions[:, part], "use_cache": False,
                            # a 4-D mask goes through the model as it is (or None)
                            "attention_mask": mask},
                 # shifted whole: a slice's last token keeps its target
                 "targets": shift_labels(full["labels"])[:, part],
                 # pairs: ORPO's NLL labels
                 **({"orpo_targets": shift_labels(orpo_labels(full))[:, part]}
                    if "pairs" in batch and "desirable" not in batch else {}),
                 # a preference objective's, whole
                 **{k: batch[k] for k in WHOLE if k in batch}}
        _active = {"group": self.group, "masks": masks}
        try:
            yield local
        finally:
            _active = None


def _cache_name(fn) -> str:
    """What transformers' mask builders call the KV cache: `cache` since 5.x renamed it, `past_key_values`
    before (the old name still works, with a warning at every call)."""
    import inspect

    return "cache" if "cache" in inspect.signature(fn).parameters else "past_key_values"
