"""What autograd saves for backward in a decoder block, in bytes per token, term by term: `block` for a
Llama-family block, `layer` for any layer `toolkit.planner.params` describes (MoE, MLA, Gemma 3).

Each term names the tensors it counts and the code that saves them (transformers' LlamaDecoderLayer,
LlamaRMSNorm and SDPA attention; peft's lora.Linear; bitsandbytes' MatMul4Bit; torch autocast). The
dtypes are the point: under bf16 autocast a full finetune keeps fp32 weights, so its residual stream,
norms and the rotary tables are fp32 and every linear casts its fp32 input to bf16 on its own; a LoRA
run's frozen base is bf16, so its stream is bf16; QLoRA's unquantized rest is fp32 again and
bitsandbytes returns its output in the input's dtype, so the MLP runs in fp32.

Checked on the CPU under bf16 autocast against the storages `saved_tensors_hooks` sees, per block
and model, for full, LoRA (dropout on and off) and fp32 (tests/test_planner_activations.py). The CPU
and CUDA differ in one place: dropout. CUDA runs `native_dropout`, which saves a bool mask (1 byte per
element); the CPU multiplies by a noise tensor of the input's dtype (`aten/src/ATen/native/Dropout.cpp`,
`is_fused_kernel_acceptable`). `Dtypes.mask` carries that.

A mixture-of-experts layer (`moe_*`, `layer`) follows transformers' default experts kernel,
`grouped_mm_experts_forward` (integrations/moe.py): the router's fp32 probabilities and top-k
indices; the tokens permuted to expert order (k copies per token, gathered by a sort's indices and
put back by the inverse ones); each copy's gate_up and down outputs and the activation between them,
in the experts' weights' dtype (the kernel casts its input to it; CPU autocast does not cast
grouped_mm); the routing weights. A LoRA of the experts (peft's ParamWrapper) adds B A to the stacked
weights in every forward, so each forward also saves the merged expert weights. Checked against
`saved_tensors_hooks` on tiny Qwen3-MoE and Mixtral models (tests/test_planner_activations.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

from toolkit.planner import params

# `block`'s; the rest are row-parallel
COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")


@dataclass(frozen=True)
class Dtypes:
    """Byte widths of a run's tensors (see `dtypes`)."""

    # the residual stream and norms' inputs: the embedding's dtype
    residual: int
    # autocast's dtype (2 under bf16/fp16), else the weights'
    compute: int
    # the projections' outputs: `compute`, except bitsandbytes (the input's dtype)
    mlp: int
    # the base linears and norms train (a full finetune)
    trains_base: bool
    # bytes per element of a dropout mask: 1 on CUDA (bool), the input's width on the CPU
    mask: int
    # peft casts each adapter's input to the adapters' dtype (fp32 under autocast)
    adapter_cast: bool = True


def dtypes(method: str, precision: str, device: str = "cuda", fsdp: bool = False) -> Dtypes:
    """How the toolkit loads and runs each method (`toolkit.model.load.load_model`): a full finetune keeps
    fp32 weights under autocast; LoRA loads the base in the half dtype; QLoRA keeps the unquantized
    rest (embedding, norms, head) in fp32 (peft's prepare_model_for_kbit_training) and bitsandbytes
    returns each projection in its input's dtype. Under FSDP2 (`fsdp`) there is no autocast: its
    mixed-precision policy gathers every parameter, the adapters' too, in the compute dtype
    (`toolkit.parallel.fsdp`), so the stream is in the compute dtype as in a model loaded in it."""
    half = precision in ("bf16", "fp16")
    compute = 2 if half else 4
    residual = 2 if half and (method == "lora" or fsdp) else 4
    mlp = residual if method == "qlora" else compute
    # peft casts the input to the adapters' dtype before their dropout
    adapter_input = compute if fsdp else 4
    # lora_A's copy of its input: autocast's cast to the compute dtype; none in fp32 (no autocast, the stream and
    # the adapters both fp32) or under FSDP2's policy (both in the compute dtype)
    return Dtypes(residual, compute, mlp, method == "full", 1 if device == "cuda" else adapter_input,
                  adapter_cast=half and not fsdp)


def rmsnorm(h: int, d: Dtypes) -> int:
    """LlamaRMSNorm: its input upcast to fp32 (saved by pow and the rsqrt multiply; the same storage
    when the stream is already fp32) and the rsqrt per token; when its weight trains, the normalized
    input cast back to the stream's dtype, which the weight multiply saves."""
    return 4 * h + 4 + (d.residual * h if d.trains_base else 0)


def attention(h: int, kv_dim: int, heads: int, d: Dtypes, q_dim: int | None = None, v_dim: int | None = None) -> int:
    """SDPA's flash / memory-efficient kernels: q, k and v in the compute dtype (autocast's casts of
    fp32 ones), the output (also o_proj's input: one storage) and the fp32 logsumexp per head. No
    seq x seq term: these kernels recompute the scores in backward. k and v at the grouped-query
    width: transformers passes enable_gqa when there is no mask (no padding). q and the output are h
    wide unless `q_dim` (heads x head_dim, MLA's heads x qk_head_dim) and `v_dim` (MLA: heads x
    v_head_dim, which the output also has) say otherwise."""
    q, v = q_dim or h, v_dim or kv_dim
    return d.compute * (q + kv_dim + v + (v_dim or q)) + 4 * heads


def attention_inputs(h: int, d: Dtypes, readers: int = 3) -> int:
    """The linears that read the attention norm's output (q, k, v; MLA's q_a and kv_a) save it only
    for their weights' gradients, so only when the base trains: each its own cast to the compute
    dtype, or one shared storage when no cast is needed."""
    if not d.trains_base:
        return 0
    return d.compute * (readers if d.residual != d.compute else 1) * h


def mlp_inputs(h: int, i: int, d: Dtypes, tp: int = 1) -> int:
    """A SwiGLU's gate and up save the norm's output when the base trains (each its own cast, or one
    shared storage), down the MLP product (1/tp of it under tensor parallelism)."""
    if not d.trains_base:
        return 0
    return d.compute * (2 if d.residual != d.compute else 1) * h + d.mlp * i // tp


def projection_inputs(h: int, i: int, d: Dtypes, tp: int = 1) -> int:
    """A linear saves its input only for its weight's gradient, so only when the base trains: q, k,
    v, gate and up each cast an fp32 input to the compute dtype on their own (five copies), or share
    one input per norm when no cast is needed; down saves the MLP product (1/tp of it under tensor
    parallelism, whose column-parallel inputs stay whole). o_proj's input is the attention output,
    counted there."""
    return attention_inputs(h, d) + mlp_inputs(h, i, d, tp)


def mlp(i: int, d: Dtypes) -> int:
    """SwiGLU: SiLU saves its input (gate's output); the product saves SiLU's output and up's."""
    return 3 * d.mlp * i


# The storage an adapter's lora_A saves when it reads its linear's input as it is (no cast, no dropout):
# shared with its siblings (q, k and v read the attention norm's output; gate and up the MLP norm's),
# kept already (o_proj's: the attention output, which SDPA saves: None), or its own (down's MLP product).
SHARED_INPUT = {"q_proj": "attention_norm", "k_proj": "attention_norm", "v_proj": "attention_norm",
                "gate_proj": "mlp_norm", "up_proj": "mlp_norm", "o_proj": None}


def lora(in_features: list[int], r: int, dropout: float, d: Dtypes, names: list[str] | None = None) -> int:
    """peft lora.Linear on each adapted linear (`names`) of in-features f: lora_A saves its input cast to
    the compute dtype (a copy of f even with no dropout: the input was cast to the adapter's fp32 first),
    the dropout its mask when p > 0, and lora_B saves lora_A's r outputs. Where the adapters are in the
    stream's dtype (FSDP2's policy) and there is no dropout, lora_A saves the input itself
    (`SHARED_INPUT`)."""
    if d.adapter_cast or dropout > 0 or names is None:
        per = d.compute + (d.mask if dropout > 0 else 0)
        return sum(per * f + d.compute * r for f in in_features)
    reads = {key: f for name, f in zip(names, in_features) if (key := SHARED_INPUT.get(name, name)) is not None}
    return d.compute * (sum(reads.values()) + r * len(in_features))


def block(h: int, i: int, kv_dim: int, heads: int, d: Dtypes, adapted: dict[str, int] | None = None, r: int = 0,
          dropout: float = 0.0, tp: int = 1) -> int:
    """One decoder block, bytes per token: two norms, attention, projections, MLP, adapters. Under
    tensor parallelism of degree tp (Korthikanti et al. 2022, eq. 2) the norms and the inputs of the
    column-parallel linears stay whole on every rank; attention heads, the MLP's width and the
    row-parallel linears' inputs (o_proj, down) are split. `adapted`: LoRA's linears, name -> in-features."""
    adapted = adapted or {}
    features = [f if name in COLUMN_PARALLEL else f // tp for name, f in adapted.items()]
    return (2 * rmsnorm(h, d) + attention(h, kv_dim, heads, d) // tp + projection_inputs(h, i, d, tp)
            + mlp(i, d) // tp + lora(features, r, dropout, d, list(adapted)))


def moe_router(h: int, experts: int, top_k: int, d: Dtypes, trains: bool) -> int:
    """Per token, the router (Qwen3MoeTopKRouter, MixtralTopKRouter): its input when its weight trains
    (a full finetune, or a LoRA of it: the compute dtype), the fp32 softmax over the experts that its
    backward keeps (DeepSeek's sigmoid alike; gpt-oss's softmax over the top-k only: counted alike), and
    top-k's int64 indices."""
    return (d.compute * h if trains else 0) + 4 * experts + 8 * top_k


def moe_dispatch(top_k: int) -> int:
    """Per token, the grouped_mm kernel's int64 index vectors of its k copies: the gather into expert
    order, the sort's permutation and its inverse that puts them back."""
    return 3 * 8 * top_k


def moe_experts(h: int, i: int, top_k: int, d: Dtypes, trains: bool, tp: int = 1) -> int:
    """Per token, each of its k copies through an expert, in the experts' weights' dtype (the
    embedding's, `d.residual`): its permuted input and the activation's product (down's input) only
    when the experts' weights need a gradient (trained, or merged with a LoRA); gate_up's output
    (2 I: SiLU's input and the product's `up`), SiLU's output (I), down's output (h, which the
    routing weight multiplies), and that routing weight in the compute dtype. Under tensor
    parallelism each rank holds 1/tp of every expert's I."""
    w, i = d.residual, i // tp
    return top_k * (w * ((h + i if trains else 0) + 3 * i + h) + d.compute)


def moe_merged(e: "params.Experts", adapters: list, d: Dtypes, tp: int = 1, ep: int = 1) -> int:
    """Per forward (not per token): a LoRA of a stacked parameter (peft's ParamWrapper) adds B A to it
    inside the forward (`torch.baddbmm(W, B, A)` for the experts, `W + B A` for the router), in the
    weight's dtype: grouped_mm and the router's linear keep the merged weight, and the factors' casts
    are kept for their gradients. Under expert parallel degree `ep` a rank merges only the E/ep experts
    it holds (`toolkit.parallel.ep` splits the adapters with them), whole under tp (the ep group is the
    TP group)."""
    w, out = d.residual, 0
    for a in adapters:
        if a.expert:
            out += w * (a.count // ep * a.fan_in * a.fan_out // (1 if ep > 1 else tp) + a.params(tp, ep))
        elif a.name == "gate":
            out += w * (e.count * e.hidden + a.params())
    return out


class Layer(NamedTuple):
    """What one decoder layer keeps for backward (`layer`)."""
    # bytes it saves per token
    per_token: int
    # bytes it saves per forward whatever the tokens (LoRA-merged expert weights)
    per_forward: int
    # bytes per token of the gradients alive at once inside its backward
    transient: int


def layer(cfg: dict, index: int, d: Dtypes, targets: str | None = None, r: int = 0, dropout: float = 0.0,
          tp: int = 1, ep: int = 1) -> Layer:
    """Decoder layer `index` of the model `cfg` describes. `targets`: LoRA's (None for a full
    finetune), of rank `r`. Norms (four in Gemma 3, MLA's q_a and kv_a norms, Qwen3's and Gemma 3's
    per-head q/k norms), attention, its inputs, a dense MLP or an MoE layer (router, dispatch,
    experts, shared experts), the nn.Linear adapters. Under expert parallel degree `ep` the per-token
    terms stay (with balanced routing a rank's experts take T k copies, as many as it sends; the
    combine's routing-weight multiply saves the h-wide output the module's own would), the merged
    LoRA experts are E/ep (`moe_merged`); under tp x ep (the ep group is the TP group) each TP rank
    routes 1/tp of the tokens to whole experts, so the routed copies' terms are 1/tp."""
    b = params.blocks(cfg)[index]
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    ads = params.adapters(cfg, index, r, targets) if targets else []
    linear = [a for a in ads if not a.expert and a.name != "gate"]
    features = [a.fan_in // tp if a.tp == "row" else a.fan_in for a in linear]
    norms = params.norms_per_block(cfg) * rmsnorm(h, d)
    # MLA: q_a and kv_a read the norm's output; q_b and kv_b their latents
    if cfg.get("kv_lora_rank"):
        q_rank, kv_rank = cfg.get("q_lora_rank") or 0, cfg["kv_lora_rank"]
        qk = heads * (cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"])
        norms += (rmsnorm(q_rank, d) if q_rank else 0) + rmsnorm(kv_rank, d)
        att = attention(h, qk, heads, d, q_dim=qk, v_dim=heads * cfg["v_head_dim"]) // tp \
            + attention_inputs(h, d, 2 if q_rank else 1) + (d.compute * (q_rank + kv_rank) if d.trains_base else 0)
    else:
        hd, nkv = params.head_dim(cfg), params.kv_heads(cfg)
        att = attention(h, nkv * hd, heads, d, q_dim=heads * hd) // tp + attention_inputs(h, d)
        if cfg.get("model_type") in params.QK_NORM or cfg.get("use_qk_norm"):
            norms += qk_norms((heads + nkv) * hd, heads + nkv, d) // tp
    per_token = norms + att + lora(features, r, dropout, d, [a.name for a in linear])
    e = b.experts
    if e is None:
        i = cfg["intermediate_size"]
        return Layer(per_token + mlp_inputs(h, i, d, tp) + mlp(i, d) // tp, 0, backward_transient(h, i // tp, d))
    # DeepSeek's / Qwen2-MoE's shared experts
    shared = sum(x.fan_out for x in b.linears if x.name == "gate_proj")
    router_trains = d.trains_base or any(a.name == "gate" for a in ads)
    experts_train = d.trains_base or any(a.expert for a in ads)
    # the ep group is the TP group: each TP rank routes 1/tp of the tokens to whole experts
    if ep > 1 and tp > 1:
        routed = (moe_dispatch(e.top_k) + moe_experts(h, e.intermediate, e.top_k, d, experts_train)) // tp
    # under tp without ep every expert's I is cut, and every TP rank routes every token
    else:
        routed = moe_dispatch(e.top_k) + moe_experts(h, e.intermediate, e.top_k, d, experts_train, tp)
    per_token += moe_router(h, e.count, e.top_k, d, router_trains) + routed
    if shared:
        per_token += mlp_inputs(h, shared, d, tp) + mlp(shared, d) // tp
    # backward: the residual's gradients, and each copy's through its expert (3 I, in the experts' dtype)
    transient = 2 * d.residual * h + 3 * d.residual * e.top_k * e.intermediate // tp + 3 * d.mlp * shared // tp
    return Layer(per_token, moe_merged(e, ads, d, tp, ep), transient)


def layers(cfg: dict, d: Dtypes, targets: str | None = None, r: int = 0, dropout: float = 0.0, tp: int = 1,
           start: int = 0, stop: int | None = None, ep: int = 1) -> list[Layer]:
    """`layer` for blocks start..stop-1 (a pipeline stage's; default: all)."""
    stop = cfg["num_hidden_layers"] if stop is None else stop
    targets = targets if targets is None or isinstance(targets, str) else ",".join(targets)
    return list(_layers(params.frozen(cfg), d, targets, r, dropout, tp, start, stop, ep))


@lru_cache(maxsize=256)
def _layers(key: tuple, d: Dtypes, targets: str | None, r: int, dropout: float, tp: int, start: int,
            stop: int, ep: int) -> tuple[Layer, ...]:
    cfg = dict(key)
    return tuple(layer(cfg, i, d, targets, r, dropout, tp, ep) for i in range(start, stop))


def stack(per: list[Layer], tokens: int, h: int, d: Dtypes, checkpointing: bool) -> tuple[int, int]:
    """Bytes of a stack of layers for `tokens` tokens: (what its forward keeps: every layer's saved
    tensors, or with activation checkpointing each block's input; what its backward adds at its
    peak: under checkpointing the largest layer recomputed, and the gradients alive in one layer's
    backward)."""
    full = [tokens * x.per_token + x.per_forward for x in per]
    kept = len(per) * tokens * checkpointed_block(h, d) if checkpointing else sum(full)
    return kept, max((f if checkpointing else 0) + tokens * x.transient for f, x in zip(full, per))


def outside_blocks(h: int, head_dim: int, d: Dtypes) -> int:
    """Per token, once per model: the embedding's int64 indices, the final norm, and the rotary cos
    and sin tables (in the stream's dtype) every block's rotary multiply saves."""
    return 8 + rmsnorm(h, d) + 2 * head_dim * d.residual


def qk_norms(width: int, heads: int, d: Dtypes) -> int:
    """Per-head RMSNorms of q and k (Qwen3, Gemma 3; `width` their q + k features): the projections'
    outputs upcast to fp32 and an rsqrt per head; when the weights train, the normalized input, cast
    back to the projections' (compute) dtype before the weight multiplies it."""
    return 4 * width + 4 * heads + (d.compute * width if d.trains_base else 0)


def checkpointed_block(h: int, d: Dtypes) -> int:
    """With activation checkpointing a block keeps only its input, in the stream's dtype."""
    return d.residual * h


def autocast_copies(matmul_params: int, weight_bytes: int, d: Dtypes) -> int:
    """torch autocast caches its cast of every leaf weight that requires grad for the whole forward,
    and each linear saves that copy for backward: compute-dtype bytes per trainable matmul weight
    when the weights are stored wider than the compute dtype."""
    return d.compute * matmul_params if weight_bytes > d.compute else 0


def backward_transient(h: int, i: int, d: Dtypes) -> int:
    """Gradients alive at once inside one block's backward, on top of what is saved: the residual's
    incoming and outgoing gradients (2 x h in the stream's dtype) and the MLP's (the product's
    gradient, then SiLU's output's and up's: 3 x i in the projections' dtype)."""
    return 2 * d.residual * h + 3 * d.mlp * i


def allocated_peak(weights: int, grads: int, optimizer: int, casts: int, forward: int, backward: int, loss: int,
                   checkpointing: bool, grads_resident: bool, embedding_grad: int, probe: int) -> int:
    """The allocator's peak (`torch.cuda.max_memory_allocated`) over the phases of a step after the
    first (Adam's moments exist from the first step on; `zero_grad(set_to_none=True)` frees the
    gradients after each step):
    - backward starts: every saved activation (`forward`: the blocks, or their checkpointed inputs,
      and what lies outside them), one block's recomputed activations and gradients (`backward`), the
      loss's buffers, the forward's autocast copies unless checkpointing freed them at the end of the
      forward; gradients only where a buffer keeps them (DDP's buckets, DeepSpeed's partitions);
    - a checkpointed forward ends: its autocast copies are still cached;
    - backward ends: every gradient, and a trained embedding's dense gradient before it is added;
    - the MFU probe at start-up (weights only): `toolkit.train.flops.measure_peak_flops`' matmul."""
    static = weights + optimizer
    held = grads if grads_resident else 0
    phases = [static + held + forward + backward + loss + (0 if checkpointing else casts),
              static + held + casts + forward + loss if checkpointing else 0,
              static + grads + embedding_grad,
              weights + probe]
    return max(phases)
