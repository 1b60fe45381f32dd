"""What autograd saves for backward in a Llama-family decoder block, in bytes per token, term by term.

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
"""

from __future__ import annotations

from dataclasses import dataclass

from toolkit.planner.params import COLUMN_PARALLEL


@dataclass(frozen=True)
class Dtypes:
    """Byte widths of a run's tensors (see `dtypes`)."""

    residual: int  # the residual stream and norms' inputs: the embedding's dtype
    compute: int  # autocast's dtype (2 under bf16/fp16), else the weights'
    mlp: int  # the projections' outputs: `compute`, except bitsandbytes (the input's dtype)
    trains_base: bool  # the base linears and norms train (a full finetune)
    mask: int  # bytes per element of a dropout mask: 1 on CUDA (bool), the input's width on the CPU


def dtypes(method: str, precision: str, device: str = "cuda") -> Dtypes:
    """How the toolkit loads and runs each method (`toolkit.models.load_model`): a full finetune keeps
    fp32 weights under autocast; LoRA loads the base in the half dtype; QLoRA keeps the unquantized
    rest (embedding, norms, head) in fp32 (peft's prepare_model_for_kbit_training) and bitsandbytes
    returns each projection in its input's dtype."""
    half = precision in ("bf16", "fp16")
    compute = 2 if half else 4
    residual = 2 if half and method == "lora" else 4
    mlp = residual if method == "qlora" else compute
    adapter_input = 4  # peft casts the input to the adapters' fp32 before their dropout
    return Dtypes(residual, compute, mlp, method == "full", 1 if device == "cuda" else adapter_input)


def rmsnorm(h: int, d: Dtypes) -> int:
    """LlamaRMSNorm: its input upcast to fp32 (saved by pow and the rsqrt multiply; the same storage
    when the stream is already fp32) and the rsqrt per token; when its weight trains, the fp32
    normalized input the weight multiply saves."""
    return 4 * h + 4 + (4 * h if d.trains_base else 0)


def attention(h: int, kv_dim: int, heads: int, d: Dtypes) -> int:
    """SDPA's flash / memory-efficient kernels: q, k and v in the compute dtype (autocast's casts of
    fp32 ones), the output (also o_proj's input: one storage) and the fp32 logsumexp per head. No
    seq x seq term: these kernels recompute the scores in backward. k and v at the grouped-query
    width: transformers passes enable_gqa when there is no mask (no padding)."""
    return d.compute * (2 * h + 2 * kv_dim) + 4 * heads


def projection_inputs(h: int, i: int, d: Dtypes, tp: int = 1) -> int:
    """A linear saves its input only for its weight's gradient, so only when the base trains: q, k,
    v, gate and up each cast an fp32 input to the compute dtype on their own (five copies), or share
    one input per norm when no cast is needed; down saves the MLP product (1/tp of it under tensor
    parallelism, whose column-parallel inputs stay whole). o_proj's input is the attention output,
    counted there."""
    if not d.trains_base:
        return 0
    return d.compute * ((5 if d.residual != d.compute else 2) * h) + d.mlp * i // tp


def mlp(i: int, d: Dtypes) -> int:
    """SwiGLU: SiLU saves its input (gate's output); the product saves SiLU's output and up's."""
    return 3 * d.mlp * i


def lora(in_features: list[int], r: int, dropout: float, d: Dtypes) -> int:
    """peft lora.Linear on each adapted linear of in-features f: lora_A saves its input cast to the
    compute dtype (a copy of f even with no dropout: the input was cast to the adapter's fp32 first),
    the dropout its mask when p > 0, and lora_B saves lora_A's r outputs."""
    per = d.compute + (d.mask if dropout > 0 else 0)
    return sum(per * f + d.compute * r for f in in_features)


def block(h: int, i: int, kv_dim: int, heads: int, d: Dtypes, adapted: dict[str, int] | None = None, r: int = 0,
          dropout: float = 0.0, tp: int = 1) -> int:
    """One decoder block, bytes per token: two norms, attention, projections, MLP, adapters. Under
    tensor parallelism of degree tp (Korthikanti et al. 2022, eq. 2) the norms and the inputs of the
    column-parallel linears stay whole on every rank; attention heads, the MLP's width and the
    row-parallel linears' inputs (o_proj, down) are split. `adapted`: LoRA's linears, name -> in-features."""
    adapted = adapted or {}
    features = [f if name in COLUMN_PARALLEL else f // tp for name, f in adapted.items()]
    return (2 * rmsnorm(h, d) + attention(h, kv_dim, heads, d) // tp + projection_inputs(h, i, d, tp)
            + mlp(i, d) // tp + lora(features, r, dropout, d))


def outside_blocks(h: int, head_dim: int, d: Dtypes) -> int:
    """Per token, once per model: the embedding's int64 indices, the final norm, and the rotary cos
    and sin tables (in the stream's dtype) every block's rotary multiply saves."""
    return 8 + rmsnorm(h, d) + 2 * head_dim * d.residual


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
