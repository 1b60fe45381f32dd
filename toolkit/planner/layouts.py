"""Composed layouts on the device mesh: every pp x dp_replicate x dp_shard x cp x tp that the
runtime can build for a world size, with each rank's bytes (per pipeline stage) and a predicted step.

How the runtime lays a model out (`toolkit.parallel`), which the formulas follow:
- tp: the block linears split by t (Megatron column/row), embeddings, norms and the head replicated;
- pp: contiguous blocks per stage (`stages.balance`, the runtime's split), the embedding on the first
  stage, norm and head on the last (a tied head is a second copy there); the micro-batch runs as
  one pipeline micro-batch per example, 1F1B when there are at least as many as stages, else GPipe;
- cp: every rank holds the whole (tp/pp-sliced) model and s/cp tokens of each row;
- dp_shard > 1: FSDP2 shards the rank's slice over dp_shard x cp (torchtitan's `dp_shard_cp`),
  replicated over dp_replicate (HSDP); dp_shard = 1: DDP over dp_replicate x cp;
- ep (MoE models): each rank keeps E/ep of every MoE layer's routed experts, whole; tokens go to
  their experts' ranks and back by all-to-all (`cost.expert_all_to_all_bytes`). Without tp, ep is
  borrowed from dp_shard: the experts are FSDP2-sharded over the dp_shard/ep x cp ranks that hold the
  same ones, so a block's gather brings E/ep experts and the state at rest is E/(dp_shard x cp) experts'
  worth, as without ep. Under tp the ep group is the TP group (ep = tp; no expert is TP-cut): the E/ep
  experts FSDP2-shard over dp_shard x cp as the dense parts do, and each TP rank sends 1/tp of the
  tokens (its share), so the all-to-all carries no token twice.
Gradients are averaged over every data-parallel rank and cp (the ranks that see different tokens).
Pure Python: no torch.
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache
from typing import Any, NamedTuple

from toolkit.layout.dims import MESH_DIMS, ParallelDims
from toolkit.layout.rules import (cp_divisibility_problems, ep_problems, not_runnable, num_experts, pipeline_schedule,
                                  tp_divisibility_problems)
from toolkit.planner.cost import (ADAM_STEP_BYTES, Traffic, expert_all_to_all_bytes, flops_per_token,
                                  forward_flops_per_token, fsdp_bytes, pipeline_bubble, ring_factor, step_terms)
from toolkit.planner.memory import (ADAM_BYTES, chunked_loss_bytes, frozen_bytes_per_param, gathered_bytes_per_param,
                                    logits_bytes, ulysses_comm_bytes, vision_split)
from toolkit.planner import saved
from toolkit.planner.params import blocks as model_blocks, count_params, head_dim, lora_layer_params, lora_params
from toolkit.planner.stages import balance


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def flags(d: ParallelDims, micro_batch: int) -> list[str]:
    """The finetune.py flags that lay the mesh out this way on d.world_size ranks (dp_replicate is
    inferred from the world unless both data-parallel degrees are above 1)."""
    out = []
    for k in MESH_DIMS:
        v = getattr(d, k)
        if v > 1 and (k != "dp_replicate" or d.dp_shard > 1):
            out += [f"--{k.replace('_', '-')}", str(v)]
    if d.ep > 1:
        out += ["--ep", str(d.ep)]
    if d.pp > 1:
        schedule, m = pipeline_schedule(d, micro_batch)
        out += ["--pp-microbatches", str(m), "--pp-schedule", schedule]
    return out


def mesh_layouts(cfg: dict[str, Any], world: int, gpus_per_node: int, tps: list[int] | None = None,
                 pps: list[int] | None = None, cps: list[int] | None = None,
                 eps: list[int] | None = None) -> list[ParallelDims]:
    """Every valid mesh layout of `world` ranks other than the 1-D data-parallel ones (all
    dp_replicate: DDP; all dp_shard: FSDP), which the strategy table covers. TP stays inside a node;
    tp and cp follow the runtime's divisibility rules; pp needs a block per stage. `tps`/`pps`/`cps`/
    `eps` restrict those degrees (1 is always allowed). An MoE model's layouts come again with each
    ep > 1 (`ep_degrees`)."""
    layers = cfg["num_hidden_layers"]

    def allowed(v: int, only: list[int] | None) -> bool:
        return v == 1 or not only or v in only

    out = []
    for tp in divisors(world):
        if tp > gpus_per_node or tp_divisibility_problems(cfg, tp) or not allowed(tp, tps):
            continue
        for pp in divisors(world // tp):
            if pp > layers or not allowed(pp, pps):
                continue
            for cp in divisors(world // (tp * pp)):
                if cp_divisibility_problems(cfg, tp, cp) or not allowed(cp, cps):
                    continue
                dp = world // (tp * pp * cp)
                for shard in divisors(dp):
                    d = ParallelDims(world, pp=pp, dp_replicate=dp // shard, dp_shard=shard, cp=cp, tp=tp)
                    if not (tp == pp == cp == 1 and 1 in (shard, dp // shard)):
                        out.append(d)
                    out += [replace(d, ep=ep) for ep in ep_degrees(cfg, d) if allowed(ep, eps)]
    return out


def ep_degrees(cfg: dict[str, Any], d: ParallelDims) -> list[int]:
    """The expert-parallel degrees above 1 a layout `d` can take: without tp those dividing dp_shard (ep
    borrows its ranks), under tp the TP degree itself (the ep group is the TP group; not over DDP's
    replicas: the flags --ep infers shard them); each dividing the
    model's routed experts (`rules.ep_problems`; none for a dense model), where the run's own rules take
    --ep with the layout's other degrees (`rules.not_runnable` for a full bf16 run; the method's own
    refusals are the row's `why_not`)."""
    if not num_experts(cfg):
        return []
    # --ep shards the data-parallel ranks it is given
    if d.tp > 1 and d.dp_shard == 1 and d.dp_replicate > 1:
        return []
    return [ep for ep in ([d.tp] if d.tp > 1 else divisors(d.dp_shard)[1:])
            if not ep_problems(cfg, ep) and not not_runnable(replace(d, ep=ep), "full", "bf16", "auto")]


def stage_blocks(cfg: dict[str, Any], pp: int) -> list[int]:
    """Blocks per pipeline stage, as the runtime splits them (`toolkit.parallel.pp.split`)."""
    counts = count_params(cfg)
    return list(_split(counts.layers, counts.embedding, counts.lm_head + counts.final_norm, pp))


@lru_cache(maxsize=None)
def _split(layers: tuple[int, ...], first: int, last: int, pp: int) -> tuple[int, ...]:
    return (len(layers),) if pp == 1 else tuple(balance(list(layers), pp, first, last))


def stage_range(cfg: dict[str, Any], pp: int, stage: int) -> tuple[int, int]:
    """The blocks [start, stop) of pipeline stage `stage`."""
    sizes = stage_blocks(cfg, pp)
    return sum(sizes[:stage]), sum(sizes[:stage + 1])


class RankParams(NamedTuple):
    """Parameters one rank of a pipeline stage holds before FSDP2 shards them (its tp slice; under ep,
    E/ep of each MoE layer's routed experts), the trainable ones, and the routed experts' part of each
    (what FSDP2 shards over the expert mesh under ep, `at_rest`)."""
    params: int
    trainable: int
    experts: int
    experts_trainable: int


def stage_params(cfg: dict[str, Any], d: ParallelDims, stage: int, method: str, lora_r: int,
                 lora_targets: str) -> RankParams:
    """What one rank of pipeline stage `stage` holds, before sharding (`RankParams`)."""
    counts = count_params(cfg)
    start, stop = stage_range(cfg, d.pp, stage)
    first, last = stage == 0, stage == d.pp - 1
    # tied: the last stage holds a copy
    head = counts.lm_head or (counts.embedding if d.pp > 1 else 0)
    blocks = model_blocks(cfg)[start:stop]
    params = sum(b.per_rank(d.tp, d.ep) for b in blocks) + (counts.embedding if first else 0) \
        + (counts.final_norm + head if last else 0)
    experts = sum(b.experts_per_rank(d.tp, d.ep) for b in blocks)
    if method == "full":
        return RankParams(params, params, experts, experts)
    lora = [sum(lora_layer_params(cfg, lora_r, lora_targets, d.tp, d.ep, experts_only)[start:stop])
            for experts_only in (False, True)]
    return RankParams(params, lora[0], experts, lora[1])


def at_rest(total: int, experts: int, d: ParallelDims) -> int:
    """What one rank keeps at rest of `total` (bytes or parameters of its stage before sharding,
    `experts` of them its routed experts'): FSDP2 shards the dense part over dp_shard x cp and, under
    ep, the rank's E/ep experts over the dp_shard/ep x cp ranks that hold the same ones
    (`toolkit.parallel.mesh.Mesh.expert_fsdp`): (dense + ep x experts) / (dp_shard x cp), E/(dp_shard
    x cp) experts' worth, the same as FSDP2 without ep. Under tp x ep (the ep group is the TP group) the
    E/ep experts shard over dp_shard x cp as the dense part does: total / (dp_shard x cp). Without
    dp_shard (DDP) all of it."""
    if d.dp_shard == 1:
        return total
    return (total + (d.ep_in_dp_shard - 1) * experts) // (d.dp_shard * d.cp)


def gathered_block(cfg: dict[str, Any], d: ParallelDims) -> int:
    """Parameters of the largest block as FSDP2 gathers it on one rank: 1/tp of it, and under ep the
    E/ep routed experts the rank holds instead of all E (their own FSDP2 unit, gathered over the
    expert mesh, torchtitan's `apply_fsdp` with ep); under tp x ep the block's TP slice (`per_rank`: its
    split linears 1/tp) with the E/ep experts whole."""
    if d.ep_over_tp:
        return max(b.per_rank(d.tp, d.ep) for b in model_blocks(cfg))
    return max(b.per_rank(1, d.ep) for b in model_blocks(cfg)) // d.tp


def moe_layers(cfg: dict[str, Any], d: ParallelDims) -> int:
    """MoE layers of the pipeline stage with the most of them."""
    return max(sum(b.experts is not None for b in model_blocks(cfg)[slice(*stage_range(cfg, d.pp, s))])
               for s in range(d.pp))


def loss_bytes(inp, micro_batch: int, vocab: int, h: int, act: int, pipeline: bool = False,
               seq_len: int | None = None) -> int:
    """The loss step's buffers (`inp` is an `estimate.PlanInput`; shared with the 1-D rows): full logits,
    or one chunk's under `--loss chunked`/`auto` (the pipeline's last stage always computes full
    logits), for `seq_len` tokens (default: the whole)."""
    s = seq_len or inp.seq_len
    if inp.loss == "full" or pipeline:
        return logits_bytes(micro_batch, s, vocab, act)
    return chunked_loss_bytes(micro_batch, s, vocab, h, act, head_trainable=inp.method == "full")


def stage_bytes(inp, d: ParallelDims, stage: int, checkpointing: bool, micro_batch: int) -> dict[str, int]:
    """Per-rank bytes of pipeline stage `stage` (`inp` is an `estimate.PlanInput`): weights, gradients,
    Adam state (sharded over dp_shard x cp by FSDP2, as much under ep: `at_rest`), activations of the
    examples in flight, the loss buffers on the last stage, all resident at once (gradients included:
    FSDP2's sharded gradients and DDP's buckets outlive the step). Activations: `toolkit.planner.saved`'s
    terms, the blocks split by tp, s/cp tokens per rank, E/ep merged LoRA experts. Buffers and
    fragmentation are added by the caller."""
    cfg = inp.model
    h = cfg["hidden_size"]
    act = 2 if inp.precision in ("bf16", "fp16") else 4
    p = stage_params(cfg, d, stage, inp.method, inp.lora_r, inp.lora_targets)

    # LoRA: the frozen base at its width, fp32 adapters
    def weight_bytes(params: int, trainable: int) -> int:
        return 4 * params if inp.method == "full" else frozen_bytes_per_param(inp.precision) * params + 4 * trainable

    start, stop = stage_range(cfg, d.pp, stage)
    first, last = stage == 0, stage == d.pp - 1
    tokens = -(-inp.seq_len // d.cp)
    # FSDP2's mixed-precision policy: the stream in the compute dtype, no autocast copies
    fsdp = d.dp_shard > 1
    dt = saved.dtypes(inp.method, inp.precision, fsdp=fsdp)
    per = saved.layers(cfg, dt, None if inp.method == "full" else inp.lora_targets, inp.lora_r, inp.lora_dropout,
                       d.tp, start, stop, d.ep)
    outside = (8 if first else 0) + (saved.rmsnorm(h, dt) if last else 0) + 2 * head_dim(cfg) * dt.residual
    schedule, m = pipeline_schedule(d, micro_batch)
    in_flight = micro_batch if d.pp == 1 or schedule == "gpipe" else micro_batch * min(d.pp - stage, m) // m
    # a pipeline runs a forward per example; without one the micro-batch is one forward, whose per-forward
    # terms (LoRA's merged experts) count once
    forwards = in_flight if d.pp > 1 else 1
    kept, backward = saved.stack(per, in_flight // forwards * tokens, h, dt, checkpointing)
    logits = loss_bytes(inp, in_flight if d.pp > 1 else micro_batch, cfg["vocab_size"], h, act,
                        pipeline=d.pp > 1, seq_len=tokens) if last else 0
    # under autocast each fp32 weight's cast for its matmul is saved for backward
    casts = 0 if fsdp else saved.autocast_copies(p.trainable, 4, dt)
    # an image-text model's vision side, on the first stage: whole on every TP rank (as the embeddings), sharded
    # by FSDP2; a full finetune's params hold what trains, LoRA's the frozen base beside `trainable`
    v_frozen, v_trained = vision_split(inp.vision, inp.method, inp.train_vision) if first else (0, 0)
    params = p.params + v_frozen + (v_trained if inp.method == "full" else 0)
    trainable = p.trainable + v_trained
    return {"weights": at_rest(weight_bytes(params, trainable), weight_bytes(p.experts, p.experts_trainable), d),
            "grads": at_rest(4 * trainable, 4 * p.experts_trainable, d),
            "optimizer": at_rest(ADAM_BYTES * trainable, ADAM_BYTES * p.experts_trainable, d),
            "autocast_copies": casts, "activations": forwards * (kept + backward) + in_flight * tokens * outside,
            "logits": logits}


def traffic(inp, d: ParallelDims, checkpointing: bool, micro_batch: int, hw) -> list[Traffic]:
    """Each exchange of a micro-batch step (`cost.Traffic`: bytes a rank sends, link bandwidth,
    collective calls, kind, term; `cost.step_terms` for the kinds): TP all-reduces, Ulysses and
    expert-parallel all-to-alls and pipeline sends block; data-parallel gradient sync overlaps the
    backward (DDP's once per optimizer step, FSDP2's reduce-scatters and gathers every micro-batch,
    under ep the experts' over the ranks holding the same ones: `at_rest`). Ranks are laid
    out tp innermost, pp outermost (`dims.MESH_DIMS`), so a group of degree g whose stride is the
    product of the inner degrees spans stride x g ranks."""
    cfg, G = inp.model, inp.gpus_per_node
    h = cfg["hidden_size"]
    kv = (cfg.get("num_key_value_heads") or cfg["num_attention_heads"]) * head_dim(cfg)
    act = 2 if inp.precision in ("bf16", "fp16") else 4
    blocks = max(stage_blocks(cfg, d.pp))
    tokens = -(-inp.seq_len // d.cp)
    out = []
    # 2 all-reduces of b x s x h per block forward, 2 backward, 2 more to recompute
    if d.tp > 1:
        calls = (4 + 2 * checkpointing) * blocks
        out.append(Traffic(calls * micro_batch * tokens * h * act * ring_factor(d.tp), hw.link(d.tp, G), calls,
                           "blocking", "tp"))
    # q, k, v, out exchanged forward and backward (+ forward again to recompute), heads / tp
    if d.cp > 1:
        sent = ulysses_comm_bytes(blocks, h, kv, micro_batch, inp.seq_len, d.cp, act) / d.tp
        out.append(Traffic(sent * (1 + 0.5 * checkpointing), hw.link(d.tp * d.cp, G), (8 + 4 * checkpointing) * blocks,
                           "blocking", "cp"))
    # tokens to their experts' ranks and back: ep consecutive dp_shard ranks, stride cp x tp;
    if d.ep > 1:
        # under tp the TP group itself, each TP rank sending its 1/tp of the tokens
        e = next(b.experts for b in model_blocks(cfg) if b.experts)
        moe = moe_layers(cfg, d)
        sent = expert_all_to_all_bytes(moe, micro_batch * tokens // (d.tp if d.ep_over_tp else 1), e.top_k, e.hidden,
                                       d.ep, act, checkpointing)
        # + the per-expert counts, each forward
        calls = (4 + 2 * checkpointing + 1 + checkpointing) * moe
        span = d.tp if d.ep_over_tp else d.ep * d.cp * d.tp
        out.append(Traffic(sent, hw.link(span, G), calls, "blocking", "ep"))
    p = max(stage_params(cfg, d, s, inp.method, inp.lora_r, inp.lora_targets) for s in range(d.pp))
    dp = d.dp_replicate * d.dp_shard * d.cp
    if dp > 1:
        span = d.tp * dp
        grads = 4 * p.trainable
        # FSDP2: reduce-scatter the gradients, gather every block forward and backward
        if d.dp_shard > 1:
            shard, gathers, width = d.dp_shard * d.cp, 2 + checkpointing, gathered_bytes_per_param(inp.precision)
            # the dense part over dp_shard x cp; under ep the rank's E/ep experts over dp_shard/ep x cp (under
            # tp x ep over dp_shard x cp, as the dense part)
            sent = fsdp_bytes(shard, 4 * (p.trainable - p.experts_trainable), width * (p.params - p.experts), gathers) \
                + fsdp_bytes(shard // d.ep_in_dp_shard, 4 * p.experts_trainable, width * p.experts, gathers)
            # HSDP: shards all-reduced
            sent += ring_factor(d.dp_replicate) * at_rest(grads, 4 * p.experts_trainable, d)
            # under ep the experts are units of their own
            units = blocks + (moe_layers(cfg, d) if d.ep > 1 else 0)
            out.append(Traffic(sent, hw.link(span, G), (3 + checkpointing) * units, "overlapped", "dp"))
        else:
            out.append(Traffic(ring_factor(dp) * grads, hw.link(span, G), 1 + -(-grads // (25 * 1024**2)),
                               "overlapped_once", "dp_sync"))
    # each stage boundary: activations forward, their gradients backward, per example
    if d.pp > 1:
        out.append(Traffic(2 * micro_batch * tokens * h * act, hw.link(d.world_size, G), 2 * micro_batch,
                           "blocking", "pp"))
    return out


def mesh_step_terms(inp, d: ParallelDims, checkpointing: bool, micro_batch: int, hw) -> dict[str, float]:
    """Seconds per micro-batch step of the slowest rank, term by term (`cost.step_terms`): its share
    of the FLOPs (1/tp of each block, s/cp tokens, its stage's blocks) and of the recomputed forward,
    the pipeline bubble, `traffic`, and the optimizer's pass over the rank's shard of the state."""
    cfg = inp.model
    counts = count_params(cfg)
    layers, h = cfg["num_hidden_layers"], cfg["hidden_size"]
    # a token's compute: an MoE layer's top-k experts
    active = counts.active
    trainable = active if inp.method == "full" else lora_params(cfg, inp.lora_r, inp.lora_targets)
    per_token = flops_per_token(active, trainable, layers, h, inp.seq_len, False)
    recompute = flops_per_token(active, trainable, layers, h, inp.seq_len, True) - per_token if checkpointing else 0
    # a preference objective's no-grad forwards (LoRA's reference, KTO's KL estimate)
    per_token += inp.extra_forwards * forward_flops_per_token(active, layers, h, inp.seq_len)
    share = max(stage_blocks(cfg, d.pp)) / layers if d.pp > 1 else 1.0
    # tokens x the fraction of the model this rank computes
    rank = micro_batch * inp.seq_len * share / (d.tp * d.cp)
    bubble = pipeline_bubble(d.pp, pipeline_schedule(d, micro_batch)[1]) if d.pp > 1 else 0.0
    p = max(stage_params(cfg, d, s, inp.method, inp.lora_r, inp.lora_targets) for s in range(d.pp))
    return step_terms(rank * per_token, inp.precision, traffic(inp, d, checkpointing, micro_batch, hw), hw,
                      bubble=bubble, optimizer_bytes=ADAM_STEP_BYTES * at_rest(p.trainable, p.experts_trainable, d),
                      recompute_flops=rank * recompute)
