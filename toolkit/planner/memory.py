"""Per-GPU memory of each strategy, as pure functions of counts and byte widths.

Model states follow the ZeRO paper (Rajbhandari et al. 2020, sec. 3-5: with Adam, K = 12 bytes of
optimizer state per parameter in mixed precision, partitioned over N_d ranks at stage 1, plus
gradients at stage 2, plus parameters at stage 3), adapted to how this toolkit runs:
- trainable weights are loaded in fp32, so DDP/FSDP trainable weights and gradients are 4 bytes per
  parameter; DDP computes in bf16 under autocast (which keeps a bf16 copy of each trainable weight for
  backward), FSDP2 under its mixed-precision policy (each block gathered in bf16, no copies); DeepSpeed with bf16
  converts the module to 2-byte weights
  and keeps an fp32 master copy (4 bytes) next to Adam's two fp32 moments (8 bytes);
- a LoRA run's frozen base is loaded in the half dtype under bf16/fp16 (`toolkit.model.load.load_model`),
  2 bytes per parameter under every strategy; fp32 runs keep it in fp32;
- DeepSpeed keeps that fp32 master partition in fp32 runs too (measured: `master_bytes`);
- only trainable parameters (LoRA: the adapters) have gradients and optimizer state;
- the counts are totals: an MoE model holds every expert (`params.ParamCounts.total`), though a
  token's compute uses its top-k (`cost.flops_per_token`).
Activations are `toolkit.planner.saved`'s terms; the allocator's peak over a step's phases is
`saved.allocated_peak`.
"""

from __future__ import annotations

from dataclasses import dataclass

# exp_avg + exp_avg_sq in fp32
ADAM_BYTES = 8
# DeepSpeed's fp32 master partition
MASTER_BYTES = 4


@dataclass(frozen=True)
class Sharding:
    """What a 1-D layout spreads over its ranks (the planner's; the runtime's classes are
    `toolkit.parallel.strategy.Strategy`)."""

    name: str
    deepspeed: bool = False
    # ZeRO-1+ / FSDP
    shard_optimizer: bool = False
    # ZeRO-2+ / FSDP
    shard_grads: bool = False
    # ZeRO-3 / FSDP full
    shard_params: bool = False
    offload_optimizer: bool = False
    offload_params: bool = False
    # FSDP2: its mixed-precision policy gathers in the compute dtype, no autocast
    fsdp: bool = False


STRATEGIES: dict[str, Sharding] = {s.name: s for s in [
    Sharding("ddp"),
    Sharding("zero1", deepspeed=True, shard_optimizer=True),
    Sharding("zero2", deepspeed=True, shard_optimizer=True, shard_grads=True),
    Sharding("zero3", deepspeed=True, shard_optimizer=True, shard_grads=True, shard_params=True),
    Sharding("zero2_offload", deepspeed=True, shard_optimizer=True, shard_grads=True, offload_optimizer=True),
    Sharding("zero3_offload", deepspeed=True, shard_optimizer=True, shard_grads=True, shard_params=True,
             offload_optimizer=True),
    Sharding("zero3_offload_param", deepspeed=True, shard_optimizer=True, shard_grads=True, shard_params=True,
             offload_optimizer=True, offload_params=True),
    # FSDP2 shards parameters in both modes; grad_op keeps them gathered between forward and backward.
    Sharding("fsdp_full", shard_optimizer=True, shard_grads=True, shard_params=True, fsdp=True),
    Sharding("fsdp_grad_op", shard_optimizer=True, shard_grads=True, shard_params=True, fsdp=True),
]}


def weight_bytes_per_param(s: Sharding, precision: str) -> int:
    """Trainable weights (and their gradients): DeepSpeed casts the module to bf16/fp16; DDP/FSDP keep
    fp32 weights (DDP autocasts; FSDP2 gathers in the compute dtype: `gathered_bytes_per_param`)."""
    return 2 if s.deepspeed and precision in ("bf16", "fp16") else 4


def gathered_bytes_per_param(precision: str) -> int:
    """What FSDP2 all-gathers and holds per parameter of a block in use: its mixed-precision policy's
    compute dtype under bf16/fp16 (`toolkit.parallel.fsdp`), else fp32. Gradients reduce in fp32."""
    return 2 if precision in ("bf16", "fp16") else 4


def frozen_bytes_per_param(precision: str) -> int:
    """Frozen weights (a LoRA base): loaded in the half dtype under bf16/fp16, whatever the strategy."""
    return 2 if precision in ("bf16", "fp16") else 4


def vision_split(vision: tuple[int, int], method: str, train_vision: str) -> tuple[int, int]:
    """(frozen, trained) parameters of an image-text model's vision side, `vision` its (tower, projector) counts, as
    `toolkit.model.vision.freeze_vision` and `lora_extras` leave them: a full finetune trains the projector and
    (--train-vision all) the tower, the rest frozen; LoRA keeps both frozen and trains peft's whole copies
    (`modules_to_save`) of what --train-vision names, held beside them. Its activations are not counted: a frozen
    tower saves none for backward, and the image tokens are the language model's, counted in --seq-len."""
    tower, projector = vision
    named = (projector if train_vision in ("projector", "all") else 0) + (tower if train_vision == "all" else 0)
    if method == "full":
        trained = projector + (tower if train_vision == "all" else 0)
        return tower + projector - trained, trained
    return tower + projector, named


def weights_bytes(s: Sharding, frozen: int, trainable: int, n: int, precision: str) -> int:
    """Resident weights per GPU, frozen and trainable: all of them, or a 1/n shard (ZeRO-3, FSDP), or
    none (param offload)."""
    if s.offload_params:
        return 0
    total = frozen_bytes_per_param(precision) * frozen + weight_bytes_per_param(s, precision) * trainable
    return total // n if s.shard_params else total


def grads_bytes(s: Sharding, trainable: int, n: int, precision: str) -> int:
    """Gradients have the weights' dtype; partitioned from ZeRO-2 / FSDP on (ZeRO paper, P_os+g);
    with optimizer offload each reduced partition is copied to the host as it is produced
    (ZeRO-Offload, Ren et al. 2021, sec. 4.1), so the GPU keeps only the reduce buckets (buffers)."""
    if s.offload_optimizer:
        return 0
    total = weight_bytes_per_param(s, precision) * trainable
    return total // n if s.shard_grads else total


def optimizer_bytes(s: Sharding, trainable: int, n: int) -> int:
    """Adam moments (+ DeepSpeed's fp32 master) per GPU: 1/n of them from ZeRO-1 / FSDP on, none on
    the GPU with optimizer offload (they move to CPU RAM, see `cpu_bytes`)."""
    if s.offload_optimizer:
        return 0
    per_param = ADAM_BYTES + (MASTER_BYTES if s.deepspeed else 0)
    total = per_param * trainable
    return total // n if s.shard_optimizer else total


def cpu_bytes(s: Sharding, params: int, trainable: int, n: int, precision: str) -> int:
    """CPU RAM per GPU process that offload needs (the node needs this x GPUs per node)."""
    out = 0
    if s.offload_optimizer:
        # moments + master + fp32 grad partition
        out += (ADAM_BYTES + MASTER_BYTES + 4) * trainable // n
    if s.offload_params:
        out += weight_bytes_per_param(s, precision) * params // n
    return out


def logits_bytes(micro_batch: int, seq_len: int, vocab: int, act_bytes: int) -> int:
    """The LM head's logits (compute dtype), the toolkit's fp32 copy for the loss, and
    cross-entropy's saved fp32 log-softmax: (act_bytes + 4 + 4) x b x s x V."""
    return (act_bytes + 8) * micro_batch * seq_len * vocab


def kv_cache_bytes(layers: int, kv_dim: int, rows: int, tokens: int, act_bytes: int) -> int:
    """A KV cache of `rows` sequences of `tokens` (transformers' DynamicCache, which `toolkit.objectives.grpo.sampling`
    fills:
    each layer's keys and values, (rows, kv heads, tokens, head dim) each): 2 x layers x rows x tokens x
    kv heads x head dim x act_bytes (checked against the cache's own tensors: tests/test_planner_params.py)."""
    return 2 * layers * rows * tokens * kv_dim * act_bytes


def generation_bytes(layers: int, kv_dim: int, vocab: int, rows: int, tokens: int, act_bytes: int,
                     gathered: int = 0) -> int:
    """What --objective grpo's sampling holds beside the weights and optimizer state: the KV cache, the last
    position's logits in fp32 and their probabilities (2 x 4 x rows x V), and the parameters a sharded layout
    gathers once for the round (`gathered`: `Strategy.generating`)."""
    return kv_cache_bytes(layers, kv_dim, rows, tokens, act_bytes) + 8 * rows * vocab + gathered


def chunked_loss_bytes(micro_batch: int, seq_len: int, vocab: int, h: int, act_bytes: int, head_trainable: bool,
                       chunk: int = 256) -> int:
    """`--loss chunked` (toolkit.objectives.sft.loss): one chunk's logits in the compute dtype and in fp32
    ((act_bytes + 4) x chunk x V), the target rows of the hidden states and their gradient (at most
    2 x b x s x h x act_bytes), and the head's fp32 gradient (4 x V x h) when the head trains."""
    return (act_bytes + 4) * chunk * vocab + 2 * act_bytes * micro_batch * seq_len * h \
        + (4 * vocab * h if head_trainable else 0)


def ulysses_comm_bytes(layers: int, h: int, kv_dim: int, micro_batch: int, seq_len: int, cp: int,
                       act_bytes: int) -> int:
    """Bytes each rank sends per micro-batch under Ulysses context parallelism of degree cp (Jacobs et
    al. 2023, DeepSpeed-Ulysses, sec. 3.2): per layer, q, k, v (h, kv_dim, kv_dim wide) and the
    attention output (h) are each all-to-all'd once forward and once backward, and a rank sends the
    (cp-1)/cp of its s/cp tokens' slice that other ranks' heads need."""
    # forward + backward
    per_token = 2 * (2 * h + 2 * kv_dim)
    return layers * micro_batch * (-(-seq_len // cp)) * per_token * act_bytes * (cp - 1) // cp
