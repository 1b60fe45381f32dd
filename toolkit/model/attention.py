"""Padding-free attention for packed rows: each document attends only to itself, with no dense mask.

With `--packing` a row concatenates several documents, `position_ids` restarting at 0 in each. The
`sdpa` path has transformers build a dense block-diagonal (B, 1, S, S) mask from those positions
(`masking_utils.find_packed_sequence_indices`), and SDPA given a mask cannot use its flash kernel:
on an H100 packing ran at about half the useful tokens/s of padding (benchmarks/packing.md). The
kernels here take the documents' boundaries instead, through transformers' AttentionInterface:

    varlen  `torch.nn.attention.varlen.varlen_attn` (CUDA, fp16/bf16) on the documents laid end to
            end, cu_seqlens marking where each starts; elsewhere the same contract is served by one
            causal SDPA call per document (`reference_varlen`: torch has no CPU varlen kernel)
    flex    `flex_attention` with a document-causal BlockMask (torch.compile'd on CUDA; on CPU
            torch 2.13 runs it forward only, so it cannot train there)
    flash   the flash-attn package (2, 3 or 4) through transformers' own `_flash_attention_forward`,
            given cu_seqlens: its `flash_attention_2` alone treats packed rows as documents only when
            the batch has one row (`_is_packed_sequence`), and attends across them otherwise

The boundaries come from `position_ids` (a document starts wherever positions do not step by 1, the
rule of transformers' `find_packed_sequence_indices`), once per forward: `model_inputs` passes
`cu_seq_lens_q`/`max_length_q` (transformers' `FlashAttentionKwargs`) when the collate computed them
on the CPU, else the first layer derives them (one device-to-host copy) and the rest reuse them
(`_memo`, keyed on the position tensor every layer is handed). Where a mask was built (a padded
batch, a KV cache) or queries and keys differ in length (decoding), varlen and flex hand the call to
transformers' SDPA with that mask, so unpacked batches and generation run as with `sdpa`.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from toolkit.errors import UserError

CHOICES = ("auto", "sdpa", "flex", "varlen", "flash")
NAMES = {"sdpa": "sdpa", "varlen": "packed_varlen", "flex": "packed_flex", "flash": "packed_fa"}
# our names avoid "flash", "sdpa" and "flex_attention": transformers keys behaviour on those substrings


@dataclass(frozen=True)
class Documents:
    """Where each document starts in the batch's tokens laid end to end (B*S of them): padding at a
    row's end is a document of its own, as `collate_packed` gives it positions restarting at 0."""

    # (N + 1,) int32 on the model's device: 0, starts..., B*S
    cu_seqlens: torch.Tensor
    # the longest document, which flash-style kernels size their grids by
    max_length: int
    rows: int

    @property
    def single(self) -> bool:
        """Every row is one document (an unpacked batch): plain causal attention, sdpa's flash kernel."""
        # rows always start a document; a shape, no sync
        return self.cu_seqlens.numel() == self.rows + 1


def document_bounds(position_ids: torch.Tensor) -> dict:
    """transformers' varlen kwargs for packed `position_ids` (B, S): cu_seq_lens_q/k (int32, on
    their device) and max_length_q/k (ints). Computed on the CPU: on a GPU one copy of the positions
    is the only sync (transformers' `prepare_fa_kwargs_from_position_ids` syncs twice per layer)."""
    pos = position_ids.detach().to("cpu", torch.int64)
    b, s = pos.shape
    start = torch.ones((b, s), dtype=torch.bool)
    # find_packed_sequence_indices' rule; every row starts one
    start[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    cu = torch.cat([start.flatten().nonzero().flatten(), torch.tensor([b * s])]).to(torch.int32)
    longest = int(cu.diff().max())
    cu = cu.to(position_ids.device)
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}


# kind -> (weakref to the position tensor, its version, rows, what was built from it)
_memo: dict = {}


def _per_forward(kind: str, pos: torch.Tensor, rows: int, build):
    """`build()`, once per position tensor: every layer of a forward is handed the same one (and
    checkpointed layers recompute with it), so the first layer builds and the others reuse."""
    hit = _memo.get(kind)
    if hit is None or hit[0]() is not pos or hit[1] != pos._version or hit[2] != rows:
        hit = _memo[kind] = (weakref.ref(pos), pos._version, rows, build())
    return hit[3]


def _documents(query: torch.Tensor, kwargs: dict) -> Documents:
    """This forward's documents: from the caller's kwargs, or derived from `position_ids`."""
    b, s = query.shape[0], query.shape[2]
    if kwargs.get("cu_seq_lens_q") is not None and kwargs.get("max_length_q") is not None:
        return Documents(kwargs["cu_seq_lens_q"], int(kwargs["max_length_q"]), b)
    pos = kwargs.get("position_ids")
    # no positions: the model numbers every row 0..S-1
    if pos is None:
        return Documents(torch.arange(0, b * s + 1, s, dtype=torch.int32, device=query.device), s, b)
    if pos.dim() != 2 or pos.shape[-1] != s:
        raise ValueError(f"packed attention needs position_ids of shape (B, {s}); got {tuple(pos.shape)} "
                         "(context parallel hands the kernels a slice's positions: use sdpa there)")

    def derive() -> Documents:
        # positions may come unexpanded, (1, S)
        bounds = document_bounds(pos.expand(b, -1))
        return Documents(bounds["cu_seq_lens_q"], bounds["max_length_q"], b)

    return _per_forward("documents", pos, b, derive)


def _to_sdpa(query: torch.Tensor, key: torch.Tensor, attention_mask) -> bool:
    """The calls varlen and flex leave to SDPA: a mask was built (padding, a KV cache), or the keys
    are not the queries' own tokens (decoding with a cache)."""
    return attention_mask is not None or key.shape[2] != query.shape[2]


def _sdpa(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _supported(kernel: str, query: torch.Tensor, dropout: float, kwargs: dict) -> None:
    """What varlen and flex do not implement, said instead of computed wrongly."""
    window = kwargs.get("sliding_window")
    unsupported = [name for name in ("softcap", "s_aux", "position_bias") if kwargs.get(name) is not None]
    if window is not None and window < query.shape[2]:
        unsupported.append("sliding_window")
    if dropout:
        unsupported.append("attention dropout")
    if kwargs.get("is_causal") is False:
        unsupported.append("bidirectional attention")
    if unsupported:
        raise UserError(f"--attn {kernel} does not implement this model's {', '.join(unsupported)}; "
                        "use --attn sdpa (or flash)")


def _compute_dtype(query: torch.Tensor) -> torch.dtype:
    """The dtype SDPA would run in: autocast's where it is on (q/k may arrive fp32 there, promoted by
    rotary's fp32 cos/sin, while v is already half), else the query's."""
    device = query.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else query.dtype


# --- varlen
# its loop over the documents would tie a compiled block's graph to their count
@torch.compiler.disable
def reference_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                     enable_gqa=False) -> torch.Tensor:
    """`torch.nn.attention.varlen.varlen_attn`'s contract, (T, H, D) in and out, as one SDPA call per
    document: what varlen runs where torch has no kernel for it (CPU, fp32), and its test reference.
    Documents are `split`, not sliced: a slice's backward writes a zero tensor the size of the whole
    input, per document (half the step's time on CPU, measured)."""
    q_lengths, k_lengths = _lengths("q", cu_seq_q), _lengths("k", cu_seq_k)
    causal = tuple(window_size) == (-1, 0)
    parts = [F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                            is_causal=causal, scale=scale, enable_gqa=enable_gqa)[0].transpose(0, 1)
             # (1, H, L, D)
             for q, k, v in zip(query.split(q_lengths), key.split(k_lengths), value.split(k_lengths))]
    return torch.cat(parts)


# as `reference_varlen` is: traced, the memo kept one forward's lengths for the next
@torch.compiler.disable
def _lengths(side: str, cu_seqlens: torch.Tensor) -> list[int]:
    """Each document's length, read to the host once per forward: every layer is handed the same
    `cu_seqlens` (a device-to-host copy where it lives on a GPU: the reference runs there in fp32)."""
    return _per_forward(f"lengths_{side}", cu_seqlens, 0, lambda: cu_seqlens.diff().tolist())


def _varlen_kernel(device: torch.device, dtype: torch.dtype):
    """torch's varlen kernel where it runs (CUDA, half precision: it is FlashAttention), else the reference."""
    if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16):
        from torch.nn.attention.varlen import varlen_attn

        return adapt_varlen(varlen_attn)
    return reference_varlen


@functools.lru_cache
def adapt_varlen(kernel):
    """`kernel` (torch's `varlen_attn`) called with the newest contract, `reference_varlen`'s, whatever
    its torch version takes: torch 2.11's has no `enable_gqa` (every packed --attn varlen run on it stopped
    with a TypeError), so k and v are repeated to the query's heads there;
    one that takes `is_causal` in place of `window_size` gets the causal flag (no other window)."""
    params = inspect.signature(kernel).parameters

    def call(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
        kw: dict = {"scale": scale}
        if "window_size" in params:
            kw["window_size"] = window_size
        elif tuple(window_size) in ((-1, 0), (-1, -1)):
            kw["is_causal"] = tuple(window_size) == (-1, 0)
        else:
            raise UserError("--attn varlen: this torch's varlen_attn has no sliding window; use --attn sdpa")
        if enable_gqa and "enable_gqa" in params:
            kw["enable_gqa"] = True
        elif k.shape[1] != q.shape[1]:
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        return kernel(q, k, v, cu_q, cu_k, max_q, max_k, **kw)

    return call


def varlen_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers' attention signature: q (B, H, S, D), k/v (B, H_kv, S, D) -> ((B, S, H, D), None)."""
    if _to_sdpa(query, key, attention_mask):
        return _sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    _supported("varlen", query, dropout, kwargs)
    docs = _documents(query, kwargs)
    if docs.single:
        return _sdpa(module, query, key, value, None, scaling=scaling, **kwargs)
    b, h, s, d = query.shape
    dtype = _compute_dtype(query)
    # (B, H, S, D) -> (B*S, H, D): the rows end to end, so cu_seqlens index documents in every row
    q, k, v = (t.transpose(1, 2).reshape(b * s, t.shape[1], t.shape[3]).to(dtype) for t in (query, key, value))
    out = _varlen_kernel(q.device, dtype)(q, k, v, docs.cu_seqlens, docs.cu_seqlens, docs.max_length, docs.max_length,
                                          scale=scaling, window_size=(-1, 0), enable_gqa=k.shape[1] != h)
    return out.view(b, s, h, -1), None


# --- flex
_compiled: dict = {}


def _compiled_on(device: torch.device, fn):
    """`fn` (flex_attention, create_block_mask) torch.compile'd once for CUDA, as transformers'
    `WrappedFlexAttention` does: uncompiled, flex materializes the scores (its own warning). Plain on
    CPU, where flex only runs forward (compiling took 33 s here), and inside an outer torch.compile."""
    if device.type != "cuda" or torch.compiler.is_compiling():
        return fn
    if fn not in _compiled:
        _compiled[fn] = torch.compile(fn)
    return _compiled[fn]


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """(B, S) index of each token's document within its row, on the positions' device (no sync)."""
    new = torch.zeros_like(position_ids, dtype=torch.int32)
    new[:, 1:] = (position_ids[:, 1:] != position_ids[:, :-1] + 1).to(torch.int32)
    return new.cumsum(-1)


def _block_mask(query: torch.Tensor, kwargs: dict):
    """The document-causal BlockMask of this forward, built by its first layer (torchtune's
    `packed_block_causal_mask`: causal within a document, nothing across)."""
    from torch.nn.attention.flex_attention import create_block_mask

    b, s = query.shape[0], query.shape[2]
    pos = kwargs.get("position_ids")
    if pos is None:
        pos = torch.arange(s, device=query.device).unsqueeze(0)

    def build():
        doc = document_ids(pos.expand(b, -1).to(query.device))

        def same_document_causal(bi, hi, qi, ki):
            return (qi >= ki) & (doc[bi, qi] == doc[bi, ki])

        return _compiled_on(query.device, create_block_mask)(same_document_causal, b, None, s, s, device=query.device)

    return _per_forward("block_mask", pos, b, build)


def flex_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers' attention signature: q (B, H, S, D), k/v (B, H_kv, S, D) -> ((B, S, H, D), None)."""
    if _to_sdpa(query, key, attention_mask):
        return _sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    _supported("flex", query, dropout, kwargs)
    query, key, value = (t.to(_compute_dtype(query)) for t in (query, key, value))
    heads = query.shape[1]
    gqa = key.shape[1] != heads
    # flex's GQA wants a power-of-2 head count (as transformers' flex path says)
    if gqa and heads & (heads - 1):
        key, value = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (key, value))
        gqa = False
    from torch.nn.attention.flex_attention import flex_attention as flex

    out = _compiled_on(query.device, flex)(query, key, value, block_mask=_block_mask(query, kwargs), scale=scaling,
                                           enable_gqa=gqa)
    return out.transpose(1, 2).contiguous(), None


# --- flash (the flash-attn package)
def flash_package() -> str | None:
    """transformers' name for the installed flash-attn (2 first: the most used with varlen backward;
    provisional until the GPU says otherwise), or None."""
    from transformers.utils import import_utils as iu

    present = {"flash_attention_2": iu.is_flash_attn_2_available, "flash_attention_3": iu.is_flash_attn_3_available,
               "flash_attention_4": iu.is_flash_attn_4_available}
    return next((name for name, found in present.items() if found()), None)


def fa_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, sliding_window=None,
                 softcap=None, is_causal=None, s_aux=None, **kwargs):
    """transformers' `flash_attention_forward` (integrations/flash_attention.py, less its MLA head-dim
    padding), naming the flash package itself (ours is not a `flash_attention_N` name) and giving
    packed rows their cu_seqlens, which it infers only for a batch of one row."""
    from transformers.integrations.flash_attention import _use_top_left_mask, get_target_dtype
    from transformers.modeling_flash_attention_utils import _flash_attention_forward

    if attention_mask is None and key.shape[2] == query.shape[2] and kwargs.get("cu_seq_lens_q") is None:
        docs = _documents(query, kwargs)
        if not docs.single:
            kwargs.update(cu_seq_lens_q=docs.cu_seqlens, cu_seq_lens_k=docs.cu_seqlens,
                          max_length_q=docs.max_length, max_length_k=docs.max_length)
    seq_len = query.shape[2]
    # (B, S, H, D), flash's layout
    query, key, value = (t.transpose(1, 2) for t in (query, key, value))
    out = _flash_attention_forward(
        query, key, value, attention_mask, query_length=seq_len,
        is_causal=is_causal if is_causal is not None else module.is_causal, dropout=dropout,
        softmax_scale=scaling, sliding_window=sliding_window, softcap=softcap, use_top_left_mask=_use_top_left_mask,
        target_dtype=get_target_dtype(query, module), attn_implementation=flash_package(),
        layer_idx=getattr(module, "layer_idx", None), s_aux=s_aux.to(query.dtype) if s_aux is not None else None,
        **kwargs)
    return out, None


# --- masks
def packed_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0, attention_mask=None, **kwargs):
    """varlen's and flex's mask: none where the kernels take the documents from the positions (no
    padding mask, no cache), else sdpa's, which those kernels then hand to SDPA with the call."""
    fresh = isinstance(q_offset, int) and isinstance(kv_offset, int) and q_offset == kv_offset == 0
    if attention_mask is None and fresh and q_length == kv_length:
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                     kv_offset=kv_offset, attention_mask=attention_mask, **kwargs)


def register(kernel: str) -> str:
    """Register `kernel`'s attention and mask functions with transformers; returns the name a model
    is loaded (or `set_attn_implementation`) with. Idempotent."""
    if kernel == "sdpa":
        return "sdpa"
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask
    from transformers.modeling_utils import AttentionInterface

    attend, mask = {"varlen": (varlen_attention, packed_mask), "flex": (flex_attention, packed_mask),
                    "flash": (fa_attention, flash_attention_mask)}[kernel]
    AttentionInterface.register(NAMES[kernel], attend)
    AttentionMaskInterface.register(NAMES[kernel], mask)
    return NAMES[kernel]


# --- choosing
def unavailable(kernel: str, device_type: str) -> str | None:
    """Why `kernel` cannot train on `device_type` here, with the fix, or None when it can."""
    if kernel == "varlen" and device_type == "cuda":
        try:
            from torch.nn.attention.varlen import varlen_attn  # noqa: F401
        except ImportError:
            return (f"--attn varlen needs torch.nn.attention.varlen, which torch {torch.__version__} lacks: "
                    "upgrade torch, or use --attn flash, flex or sdpa")
    if kernel == "flex":
        try:
            from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
        except ImportError:
            return f"--attn flex needs torch.nn.attention.flex_attention, which torch {torch.__version__} lacks"
        if device_type != "cuda":
            return (f"--attn flex cannot train on {device_type}: torch {torch.__version__}'s flex_attention has "
                    "no backward there; use --attn varlen or sdpa")
    if kernel == "flash":
        if device_type != "cuda":
            return f"--attn flash runs on NVIDIA GPUs only, not {device_type}; use --attn varlen or sdpa"
        if flash_package() is None:
            return ("--attn flash needs the flash-attn package: pip install flash-attn --no-build-isolation "
                    "(or use --attn varlen, which torch ships)")
    return None


# What a packed kernel implements beyond causal attention within documents (flash-attn takes softcap,
# windows and sinks itself; ours refuse them at the call: `_supported`)
IMPLEMENTS = {"varlen": frozenset(), "flex": frozenset(),
              "flash": frozenset({"softcap", "sliding windows", "attention sinks", "attention dropout"})}
# Llama's, GPT-2's, BERT's
DROPOUT_KEYS = ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob")


def model_features(model, seq_len: int) -> list[str]:
    """What `model`'s attention does beyond plain causal attention, that a packed kernel must implement:
    logit softcapping (Gemma 2), attention sinks (gpt-oss), sliding windows shorter than the rows
    (Gemma 2/3, gpt-oss: `layer_types`; Mistral-style `sliding_window`), dropout on the attention
    probabilities (GPT-2's attn_pdrop 0.1)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    found = ["softcap"] if getattr(config, "attn_logit_softcapping", None) else []
    if any(getattr(config, key, 0) or 0 for key in DROPOUT_KEYS):
        found.append("attention dropout")
    if any(isinstance(getattr(m, "sinks", None), torch.Tensor) for m in model.modules()):
        found.append("attention sinks")
    window, types = getattr(config, "sliding_window", None), getattr(config, "layer_types", None)
    sliding = "sliding_attention" in types if types else getattr(config, "use_sliding_window", True)
    if window and sliding and window < seq_len:
        found.append("sliding windows")
    return found


def default_attention(model) -> str:
    """What transformers loads a model with when not told: sdpa where the class supports it, else eager."""
    return "sdpa" if getattr(model, "_supports_sdpa", False) else "eager"


def choose_attention(choice: str, device_type: str, packing: bool, model, seq_len: int,
                     padding_free: str | None = None) -> tuple[str | None, str]:
    """`--attn` for this model on this machine: (the name to `set_attn_implementation`, or None to keep
    the one transformers picked for it, the line that says what runs); one-line UserError where the
    model or the machine cannot run the choice. `packing` False for layouts that cut rows (--cp);
    `padding_free` (`end_to_end`): "on", unpacked rows laid end to end whatever the kernel (--padding-free);
    "auto", laid end to end only where the kernel picked here keeps them apart without a dense mask (else
    padded); None, padded."""
    if choice not in CHOICES:
        raise UserError(f"--attn {choice!r}: choose one of {', '.join(CHOICES)}")
    own, features, cls = default_attention(model), model_features(model, seq_len), type(model).__name__
    apart = "padding-free rows: each example attends within itself" if padding_free and not packing else \
        "packed rows attend within their documents"
    if choice == "sdpa" and own != "sdpa":
        raise UserError(f"--attn sdpa: {cls} does not support torch's scaled_dot_product_attention (transformers "
                        f"runs it with {own}); leave --attn out (auto) to run it with {own}")
    if choice in ("varlen", "flex", "flash"):
        # or why this machine cannot run it
        name = attn_implementation(choice, device_type, packing)
        missing = [f for f in features if f not in IMPLEMENTS[choice]]
        if missing:
            raise UserError(f"--attn {choice} does not implement {cls}'s {', '.join(missing)}; leave --attn out (auto: "
                            f"its own {own} attention, with a block-diagonal mask for packed rows)"
                            + ("" if choice == "flash" else " or use --attn flash on a GPU with flash-attn"))
        return name, f"attention: {choice} ({apart})"
    if choice == "sdpa" or not (packing or padding_free):
        return None, f"attention: {own} (transformers' for {cls})"
    have = [k for k in available(device_type) if k != "sdpa" and not set(features) - IMPLEMENTS[k]]
    kernel = auto_choice(device_type, True, have + ["sdpa"])
    if kernel == "sdpa":
        why = f" (the padding-free kernels here do not implement {cls}'s {', '.join(features)})" if features else ""
        # a dense mask over the micro-batch's tokens: padded instead
        if padding_free == "auto" and not packing:
            return None, f"attention: {own} (transformers' for {cls}); batches padded{why}"
        rows = "packed" if packing else "padding-free"
        return None, f"attention: {own} with a block-diagonal mask for {rows} rows{why}"
    return register(kernel), f"attention: {kernel} ({apart})"


def kernel_of(attn_implementation: str | None) -> str | None:
    """`--attn`'s name for a model's `_attn_implementation` (ours registered as `NAMES`), else it as it is."""
    return {name: kernel for kernel, name in NAMES.items()}.get(attn_implementation, attn_implementation)


# --- padding-free batches: which runs lay an unpacked micro-batch's examples end to end
# kernels that need no dense mask
PADDING_FREE = frozenset(NAMES[k] for k in ("varlen", "flex", "flash"))


def end_to_end(cfg) -> tuple[bool, str | None]:
    """(--packing, where rows are not cut by --cp; `choose_attention`'s `padding_free`: "on" for
    --padding-free, "auto" unset, None for --no-padding-free or where padding-free cannot run:
    `toolkit.config.checks.padding_free_blocked`, or --packing, whose rows are already laid end to end).
    Context parallel runs the model's own attention on its slices (`toolkit.parallel.cp`)."""
    from toolkit.config.checks import padding_free_blocked

    d = cfg.data
    packing = d.packing and cfg.parallel.cp == 1
    if d.packing or d.padding_free is False or padding_free_blocked(cfg) is not None:
        return packing, None
    return packing, "on" if d.padding_free else "auto"


def padding_free_on(cfg, attn_implementation: str | None) -> bool:
    """Whether this run's unpacked micro-batches reach the model padding-free (`toolkit.data.packing.
    Collate`): asked (--padding-free), or by default where its attention (the model's `_attn_implementation`)
    is one of the padding-free kernels (varlen, flex, flash: documents kept apart from their boundaries; sdpa
    or eager would build a dense block-diagonal mask over the micro-batch's tokens, B x the attention of
    padded rows); never with --no-padding-free, --packing (its rows are already packed) or where the layout
    cuts the rows (`toolkit.config.checks.padding_free_blocked`). A pure function of its inputs."""
    mode = end_to_end(cfg)[1]
    return mode == "on" or (mode == "auto" and attn_implementation in PADDING_FREE)


def available(device_type: str) -> list[str]:
    """The kernels (of sdpa, flex, varlen, flash) that can train on `device_type` here."""
    return [k for k in ("sdpa", "flex", "varlen", "flash") if unavailable(k, device_type) is None]


def auto_choice(device_type: str, packing: bool, have: Sequence[str]) -> str:
    """What `--attn auto` runs. Unpacked batches: sdpa everywhere (a padded batch goes to SDPA with
    a mask whichever kernel is named). Packed rows on CUDA: varlen, else flash, else flex, else sdpa:
    PROVISIONAL, an order by expectation (varlen and flash run FlashAttention-2 kernels on the
    documents end to end; flex is close behind once compiled), until measured on an H100. Packed rows
    on CPU: varlen, the per-document SDPA loop, over sdpa's dense mask: faster attention and a faster
    step on a 2-core CPU (benchmarks/packing.md). Its many small calls suffer most when other processes
    compete for the cores."""
    if not packing:
        return "sdpa"
    order = ("varlen", "flash", "flex", "sdpa") if device_type == "cuda" else ("varlen", "sdpa")
    return next(k for k in order if k in have)


def attn_implementation(choice: str, device_type: str, packing: bool) -> str:
    """`--attn` -> the name to load the model with (`from_pretrained(attn_implementation=...)` or
    `model.set_attn_implementation`), registering ours; one-line UserError if it cannot run here."""
    if choice not in CHOICES:
        raise UserError(f"--attn {choice!r}: choose one of {', '.join(CHOICES)}")
    kernel = auto_choice(device_type, packing, available(device_type)) if choice == "auto" else choice
    why = unavailable(kernel, device_type)
    if why:
        raise UserError(why)
    return register(kernel)
