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

Two decode paths draw the same tokens (tests/test_grpo_functions.py checks it, fp32 on the CPU):
- dynamic: transformers' DynamicCache, every step eager, the cache grown by a concatenation a step. The CPU
  default (benchmarks/sampling.md, 2 cores, fp32): a preallocated cache alone changed nothing (0.98x, 1.04x),
  the inductor-compiled step drew 1.21x (tiny Llama) and 1.15x (56M Llama) the tokens/s once compiled, but
  its compile took ~50 s and ~170 s: the 56M model's 10 s round saves ~1.3 s, so 130 rounds repay it (as
  --compile auto leaves training eager on a CPU).
- static (`StaticDecoder`): a StaticCache sized prompt + max_completion_length, the prompt's forward eager,
  then each one-token step (forward, warpers, softmax, inverse-CDF draw, EOS bookkeeping) one
  torch.compile'd function, with mode "reduce-overhead" on CUDA: CUDA graphs, so a step is one graph
  launch, not a Python loop over ~10 kernels a layer. This is what transformers' own `generate` does
  with cache_implementation="static" (a StaticCache, `get_compiled_call` with CompileConfig's default
  mode "reduce-overhead", the prefill eager), and the CUDA default here (`decoder_for`).
Not continuous batching (`generate_batch`, paged attention): it samples with torch.multinomial over
whatever batch its scheduler formed, so a completion would depend on the other requests; and a GRPO
round's rows start together and share a length cap, which a static batch already serves.
"""

from __future__ import annotations

import hashlib
import os
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
    # ids never sampled (transformers' suppress_tokens): an image-text model's image token, which in a completion
    # would ask its training forward for an image the prompt does not hold
    suppress: tuple[int, ...] = ()

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
    # (B, L) 1 on the model's tokens, 0 on tool results' (`toolkit.objectives.grpo.turns`: in the context, never
    # in the loss); None without tools
    tool_mask: torch.Tensor | None = None

    @classmethod
    def from_lists(cls, ids: list[list[int]], truncated: list[bool], tool_masks: list[list[int]] | None, pad_id: int,
                   device) -> "Completions":
        """Completions of token lists (each EOS included, no padding), right-padded; `tool_masks` each row's 0/1
        list (None: no tools)."""
        width = max(1, max(len(x) for x in ids))
        tensor = torch.full((len(ids), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(ids), width), dtype=torch.long)
        tools = torch.ones((len(ids), width), dtype=torch.long)
        for i, row in enumerate(ids):
            tensor[i, :len(row)] = torch.tensor(row, dtype=torch.long)
            mask[i, :len(row)] = 1
            if tool_masks is not None:
                tools[i, :len(tool_masks[i])] = torch.tensor(tool_masks[i], dtype=torch.long)
        return cls(tensor.to(device), mask.to(device), torch.tensor(truncated, dtype=torch.bool, device=device),
                   tools.to(device) if tool_masks is not None else None)

    def token_lists(self) -> list[list[int]]:
        """Each completion's tokens, EOS included, no padding: TRL's completion_ids for reward functions."""
        return [row[m.bool()].tolist() for row, m in zip(self.ids.cpu(), self.mask.cpu())]


def completion_seed(seed: int, step: int, prompt: int, generation: int) -> int:
    """A 63-bit seed for one completion: blake2b of the four numbers, so neighbouring prompts, steps or
    generations get unrelated streams. `prompt` is the record's index in the dataset (not its place in a
    batch), so the seed does not depend on the layout."""
    digest = hashlib.blake2b(f"{seed}/{step}/{prompt}/{generation}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def turn_seed(seed: int, turn: int) -> int:
    """The seed of a completion's `turn`-th sampling after tool results (turn 0: its own `seed`; a negative turn:
    dynamic sampling's later attempts at a step, `toolkit.objectives.grpo.dynamic.attempt`)."""
    if turn == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}/turn/{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def logits_warpers(cfg: SamplingConfig):
    """transformers' LogitsProcessorList for `cfg`, in `GenerationMixin._get_logits_processor`'s order and with
    its conditions (a warper that would do nothing is left out)."""
    from transformers import (LogitsProcessorList, MinPLogitsWarper, SuppressTokensLogitsProcessor,
                              TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

    warpers = LogitsProcessorList()
    # a processor before the warpers, as transformers orders them
    if cfg.suppress:
        warpers.append(SuppressTokensLogitsProcessor(cfg.suppress))
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


def _draw(logits: torch.Tensor, u: torch.Tensor, finished: torch.Tensor, warpers, eos: torch.Tensor, pad_id: int
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(token, finished after it): each row's next token from its last position's `logits` (B, V) at uniform
    `u` (B,), pad_id where the row had already finished. The warpers are called one by one (not through
    LogitsProcessorList.__call__, which inspects signatures: a graph break under torch.compile); these five
    read no input ids."""
    scores = logits.float()
    for warper in warpers:
        scores = warper(None, scores)
    token = torch.where(finished, pad_id, inverse_cdf(torch.softmax(scores, dim=-1), u))
    return token, finished | torch.isin(token, eos)


def _decode_step(model, token, attention, positions, cache: dict, u, finished, warpers, eos, pad_id: int,
                 keep: dict):
    """One static-cache step: `token` (B,) forwarded at `positions` (B, 1), then the next one drawn (`_draw`);
    `cache`: the cache under the name the model's forward takes (`cached`). The function `StaticDecoder` compiles."""
    out = model(input_ids=token.unsqueeze(1), attention_mask=attention, position_ids=positions, **cache,
                use_cache=True, **keep)
    return _draw(out.logits[:, -1], u, finished, warpers, eos, pad_id)


def cached(model, cache) -> dict:
    """`cache` under the name the model's forward takes it (`toolkit.objectives.evaluate.cache_kwarg`: `cache` since
    transformers renamed it, `past_key_values` before; 5.4, the floor, ignores `cache=` and recomputes every step
    from the one token it is given)."""
    from toolkit.objectives.evaluate import cache_kwarg

    return {cache_kwarg(model): cache}


DECODE_ENV = "TOOLKIT_DECODE"  # dynamic or static: overrides `decoder_for`'s choice (tests, benchmarks)
CACHE_BUCKET = 128  # a static cache's length is a multiple of this: fewer shapes, fewer compiles


class StaticDecoder:
    """The static decode path: one compiled step function and a StaticCache per batch size, both kept across
    `sample` calls. Kept, because a CUDA graph records its inputs' addresses: a new cache each round would
    re-record the graph each round, and past torch's limit (`cudagraph_unexpected_rerecord_limit`, 128) it
    would run without graphs. A cache only grows (to the next multiple of CACHE_BUCKET that holds the
    longest prompt + max_completion_length, and `reserve`), so its shapes, and the compiles they cost, stay
    few; a run reserves its longest prompt's length up front, so its training rounds see one shape (a
    second shape recompiles, with dynamic shapes, in the middle of the run).

    `backend`: torch.compile's; "inductor" gets mode "reduce-overhead" on CUDA (CUDA graphs); another
    ("aot_eager": the CPU tests, as TOOLKIT_COMPILE_BACKEND) compiles without a mode; None runs the step
    eagerly (the benchmark's arm that separates the cache from the compile). `check_every`: steps between
    the host's look at whether any row is still unfinished (a device-to-host sync: between looks the host
    queues steps ahead of the GPU). A row that ends in between only adds padding, trimmed at the end."""

    def __init__(self, backend: str | None = "inductor", device_type: str = "cuda", check_every: int = 8):
        self.backend, self.check_every = backend, check_every
        self.graphs = backend == "inductor" and device_type == "cuda"
        if backend is None:
            self.step = _decode_step
        elif backend == "inductor":
            self.step = torch.compile(_decode_step, mode="reduce-overhead" if self.graphs else None)
        else:
            self.step = torch.compile(_decode_step, backend=backend)
        self.caches: dict[int, tuple[int, object]] = {}  # batch size -> (length, StaticCache)
        self.reserve = 0  # the length every cache gets at least (`Rollouts`: the longest prompt's + completion's)
        self.failed: str | None = None  # why the compiled step could not run (then `sample` goes dynamic)

    def describe(self) -> str:
        how = ("torch.compile mode reduce-overhead: CUDA graphs" if self.graphs else
               f"torch.compile backend {self.backend}" if self.backend else "eager")
        return (f"static KV cache (prompt + completion length), the prompt's forward eager, each decode step "
                f"compiled ({how})")

    def cache(self, config, batch: int, length: int):
        """(its length, a StaticCache) for `batch` rows of at least `length` positions, emptied (the one held
        reused where it is long enough)."""
        from transformers import StaticCache

        size, held = self.caches.get(batch, (0, None))
        if size < length:
            size = -(-max(length, self.reserve) // CACHE_BUCKET) * CACHE_BUCKET
            held = self.caches.pop(batch, None)  # the shorter one freed before the longer one is allocated
            held = StaticCache(config=config, max_cache_len=size)
            self.caches[batch] = (size, held)
        held.reset()
        return size, held

    def decode(self, model, ids, attention, positions, u, cfg: SamplingConfig, warpers, eos, pad_id: int, keep: dict,
               any_unfinished) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
        """(tokens, each token's row-unfinished-before flags, finished) of one batch, a step at a time."""
        config = model.get_base_model().config if hasattr(model, "get_base_model") else model.config
        batch, width = ids.shape
        size, cache = self.cache(config, batch, width + cfg.max_completion_length)
        cache = cached(model, cache)
        mask = attention.new_zeros(batch, size)  # full width: one shape for every step
        mask[:, :width] = attention
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, **cache, use_cache=True, **keep)
        finished = torch.zeros(batch, dtype=torch.bool, device=ids.device)
        token, after = _draw(out.logits[:, -1], u[:, 0], finished, warpers, eos, pad_id)
        del out
        tokens, live, finished = [token], [~finished], after
        positions = positions[:, -1:]
        with torch.compiler.set_stance("default"):  # the caller's force_eager keeps --compile's blocks eager
            for t in range(1, cfg.max_completion_length):
                if t % self.check_every == 0 and not any_unfinished(~finished):
                    break
                mask[:, width + t - 1] = 1  # the token drawn last enters the cache now
                positions = positions + 1
                if self.graphs:
                    torch.compiler.cudagraph_mark_step_begin()
                token, after = self.step(model, token, mask, positions, cache, u[:, t], finished, warpers, eos, pad_id,
                                         keep)
                if self.graphs:  # a graph's outputs are overwritten by its next replay
                    token, after = token.clone(), after.clone()
                tokens.append(token)
                live.append(~finished)
                finished = after
        return tokens, live, finished


def static_problem(model) -> str | None:
    """Why `model` cannot take the static path, or None: its class does not declare that it compiles with a
    static cache (`_can_compile_fullgraph`), its quantization does not compile (bitsandbytes' 4-bit: QLoRA),
    or its weights are sharded (FSDP2's or TP's DTensors, ZeRO-3's partitions: each forward gathers them, a
    collective a CUDA graph cannot hold)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not getattr(base, "_can_compile_fullgraph", False):
        return f"{type(base).__name__} does not declare a compilable static cache"
    quantizer = getattr(base, "hf_quantizer", None)
    if quantizer is not None and not quantizer.is_compileable:
        return f"its {type(quantizer).__name__} quantization does not compile"
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) or hasattr(p, "ds_id") for p in model.parameters()):
        return "its weights are sharded (FSDP2, TP or ZeRO-3): each forward gathers them"
    return None


def decoder_for(model) -> tuple[StaticDecoder | None, str]:
    """(the decoder `sample` should use, None for the dynamic path; the line naming it, for the run's log).
    CUDA: the static path where `static_problem` finds nothing; the CPU: dynamic (why: the module's
    docstring). TOOLKIT_DECODE=dynamic|static overrides the device's default; the static path compiles
    with TOOLKIT_COMPILE_BACKEND's backend where it is set (the CPU tests' aot_eager)."""
    from toolkit.model.kernels import COMPILE_BACKEND_ENV

    device = next(model.parameters()).device.type
    forced = os.environ.get(DECODE_ENV, "")
    if forced not in ("", "dynamic", "static"):
        raise ValueError(f"{DECODE_ENV}={forced}: dynamic or static")
    want = forced or ("static" if device == "cuda" else "dynamic")
    problem = static_problem(model) if want == "static" else None
    if want == "dynamic" or problem:
        why = (f"{DECODE_ENV}=dynamic" if forced == "dynamic" else problem if problem else
               "the CPU default: a compiled step's minutes of inductor build outweigh its ~1.2x there")
        return None, f"decode: dynamic KV cache, eager steps ({why})"
    decoder = StaticDecoder(os.environ.get(COMPILE_BACKEND_ENV, "inductor"), device)
    return decoder, f"decode: {decoder.describe()}"


# per-token image inputs a completion's tokens take from its prompt's last token: the images they attend to
CARRIED = ("cross_attention_mask",)


@torch.no_grad()
def sample(model: torch.nn.Module, prompt_ids: Sequence[Sequence[int]], seeds: Sequence[int], cfg: SamplingConfig,
           eos_ids: Sequence[int], pad_id: int,
           any_unfinished: Callable[[torch.Tensor], bool] = any_unfinished_here,
           decoder: StaticDecoder | None = None, media: dict | None = None,
           limits: Sequence[int] | None = None) -> Completions:
    """One completion per prompt (a prompt repeated for its G generations, each with its own seed), sampled
    from `model` with a KV cache; the model's train/eval mode is restored after. `decoder`: the static path
    (None: the dynamic one); where its compiled step fails to build or run, it says why once and this call
    and later ones take the dynamic path (out of memory is raised: another path would not fit either).
    `media`: an image-text model's image inputs of the prompts (pixel_values, ...; a per-token one as a function of
    the left-padded ids), read by the prompts' forward alone (the dynamic path: their features then sit in the cache,
    and the decode steps attend causally, as transformers' `generate` leaves Gemma 3's token_type_ids to the
    prefill; Mllama's cross-attention mask is carried on from the prompt's last token, `CARRIED`). `limits`: each
    row's own token budget below `cfg.max_completion_length` (a completion's turn after tool results: what its budget
    has left; the dynamic path), a row that reaches it truncated."""
    if len(seeds) != len(prompt_ids):
        raise ValueError(f"sample: {len(seeds)} seeds for {len(prompt_ids)} prompts")
    device = next(model.parameters()).device
    ids, attention = left_pad(prompt_ids, pad_id, device)
    positions = (attention.cumsum(-1) - 1).clamp(min=0)  # each prompt's own positions from 0, as generate's
    # a per-token input given as a function of the ids (Gemma 3's modality types: `PromptRows.media`), of these
    media = {k: v(ids) if callable(v) else v for k, v in (media or {}).items()}
    u = uniforms(seeds, cfg.max_completion_length, device)
    warpers = logits_warpers(cfg)
    eos = torch.tensor(list(eos_ids), dtype=torch.long, device=device)
    keep = {"logits_to_keep": 1} if _accepts_logits_to_keep(model) else {}
    config = model.get_base_model().config if hasattr(model, "get_base_model") else model.config
    if getattr(config, "output_router_logits", False):  # an MoE's router loss: not wanted, and at one query
        keep["output_router_logits"] = False  # per row against a wider mask its sum fails (Qwen3-MoE)
    with _EvalMode(model):
        decoded = None
        if decoder is not None and decoder.failed is None and limits is None:
            try:
                decoded = decoder.decode(model, ids, attention, positions, u, cfg, warpers, eos, pad_id, keep,
                                         any_unfinished)
            except torch.OutOfMemoryError:
                raise
            except Exception as e:  # noqa: BLE001 - a compiler's failure: said, then the dynamic path
                decoder.failed = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]
                print(f"decode: the static path failed ({decoder.failed}); dynamic KV cache, eager steps from here",
                      flush=True)
        tokens, live, finished = decoded or _decode_dynamic(model, ids, attention, positions, u, cfg, warpers, eos,
                                                            pad_id, keep, any_unfinished, media or {},
                                                            limits)
    ids, mask = torch.stack(tokens, 1), torch.stack(live, 1).long()
    width = int(mask.sum(1).max())  # the static path may run a few all-finished steps past the last end
    return Completions(ids[:, :width], mask[:, :width], ~finished)


def _decode_dynamic(model, ids, attention, positions, u, cfg: SamplingConfig, warpers, eos, pad_id: int, keep: dict,
                    any_unfinished, media: dict | None = None, limits: Sequence[int] | None = None
                    ) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """The dynamic path: a DynamicCache, every forward eager; the host looks at the rows after every step.
    `media`: the prompts' image inputs, given to their forward alone; `limits`: each row's token budget (it
    stops there, unfinished: truncated)."""
    from transformers import DynamicCache

    config = model.get_base_model().config if hasattr(model, "get_base_model") else model.config
    tokens, live = [], []
    finished = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
    ended = finished  # by an EOS (`finished` also holds the rows out of budget)
    budget = None if limits is None else torch.tensor(list(limits), device=ids.device)
    cache = cached(model, DynamicCache(config=config))
    media = {k: v.to(ids.device) for k, v in (media or {}).items()}
    # what each decode step carries of the prompt's per-token inputs: its last token's (as transformers' generate
    # extends Mllama's cross_attention_mask); the rest of the image inputs sit in the cache
    carried = {k: media[k][:, -1:] for k in CARRIED if k in media}
    out = model(input_ids=ids, attention_mask=attention, position_ids=positions, **cache, use_cache=True, **keep,
                **media)
    for t in range(cfg.max_completion_length):
        token, after = _draw(out.logits[:, -1], u[:, t], finished, warpers, eos, pad_id)
        tokens.append(token)
        live.append(~finished)
        ended = ended | (after & ~finished)
        finished = after if budget is None else after | (budget <= t + 1)
        if t + 1 == cfg.max_completion_length or not any_unfinished(~finished):
            break
        attention = torch.cat([attention, attention.new_ones(ids.shape[0], 1)], dim=1)
        positions = positions[:, -1:] + 1
        out = model(input_ids=token.unsqueeze(1), attention_mask=attention, position_ids=positions, **cache,
                    use_cache=True, **keep, **carried)
    return tokens, live, ended
