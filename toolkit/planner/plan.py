"""Predict per-GPU memory for every strategy and pick the cheapest that fits.

"Cheapest" = least communication per step: offload last (it adds host<->device traffic), then
bytes moved between GPUs (ZeRO paper sec. 7: DDP and ZeRO-1/2 move 2 x gradients, ZeRO-3 adds two
all-gathers of the parameters, which for LoRA are the whole frozen base). Without gradient
checkpointing first; then the largest micro-batch that fits and the accumulation that reaches the
target global batch.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any

from toolkit.errors import UserError
from toolkit.planner.memory import (ADAM_BYTES, STRATEGIES, Strategy, activation_bytes, chunked_loss_bytes,
                                    cpu_bytes, grads_bytes, logits_bytes, optimizer_bytes,
                                    tp_activation_elements_per_token, weight_bytes_per_param, weights_bytes)
from toolkit.planner.memory import activation_elements_per_token
from toolkit.planner.params import count_params, head_dim, linear_shapes, lora_params
from toolkit.planner.stages import balance

GiB = 1024**3
FRAMEWORK_CONTEXT = 1 * GiB  # CUDA context, cuBLAS/cuDNN workspaces, allocator pools (typical H100 run)
DDP_BUCKET = 25 * 1024**2  # torch DDP bucket_cap_mb default
FRAGMENTATION = 0.10  # caching-allocator slack, as a fraction of everything else
QLORA_BITS = 4.127  # NF4 + double-quantized constants (QLoRA paper, sec. 3: 0.127 bits/param)
ORDER = ["ddp", "zero1", "zero2", "fsdp_grad_op", "zero3", "fsdp_full", "zero2_offload", "zero3_offload",
         "zero3_offload_param"]


def parse_size(text: str, what: str) -> int:
    """'80GB', '80GiB', '512MB', '1.5TB' or a plain number of bytes -> bytes (GB = GiB here, as
    vendors quote GPU memory)."""
    m = re.fullmatch(r"\s*(-?[0-9]*\.?[0-9]+)\s*([KMGT]i?B|[KMGT])?\s*", str(text), re.IGNORECASE)
    if not m:
        raise UserError(f"--{what} {text!r} is not a size; use a number with KB/MB/GB/TB, e.g. 80GB")
    value = float(m.group(1)) * 1024 ** {"": 0, "K": 1, "M": 2, "G": 3, "T": 4}[(m.group(2) or "")[:1].upper()]
    if value <= 0:
        raise UserError(f"--{what} must be positive, got {text!r}")
    return int(value)


@dataclass
class PlanInput:
    model: dict[str, Any]
    gpu_memory: int
    gpus_per_node: int = 8
    nodes: int = 1
    cpu_memory: int | None = None  # per node
    method: str = "lora"
    lora_r: int = 16
    lora_targets: str = "all-linear"
    seq_len: int = 2048
    micro_batch: int = 1
    precision: str = "bf16"
    checkpointing: bool | None = None  # None: try without first
    global_batch: int | None = None
    tp: list[int] | None = None  # TP degrees to predict (default: every valid one)
    pp: list[int] | None = None  # pipeline degrees to predict (default: 2 and 4 where they fit the blocks)
    loss: str = "auto"  # the runtime's --loss: auto and chunked never hold (b, s, V) logits, except under pp


def loss_bytes(inp: PlanInput, micro_batch: int, vocab: int, h: int, act: int, pipeline: bool = False) -> int:
    """The loss step's buffers: full logits, or one chunk's under `--loss chunked`/`auto` (the
    pipeline's last stage always computes full logits)."""
    if inp.loss == "full" or pipeline:
        return logits_bytes(micro_batch, inp.seq_len, vocab, act)
    return chunked_loss_bytes(micro_batch, inp.seq_len, vocab, h, act, head_trainable=inp.method == "full")


def tp_divisibility_problems(cfg: dict[str, Any], t: int) -> list[str]:
    """Each rank keeps whole query and kv heads and an equal slice of the MLP: t must divide the
    attention heads, the kv heads and the intermediate size. The runtime (`--tp`) uses this too."""
    nq, nkv = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    if t < 1:
        return [f"--tp {t}: must be >= 1"]
    bad = [f"{what} ({n})" for what, n in (("attention heads", nq), ("kv heads", nkv),
                                           ("intermediate size", cfg["intermediate_size"])) if n % t]
    return [f"--tp {t}: must divide the {', '.join(bad)}"] if bad else []


def valid_tp(cfg: dict[str, Any], gpus_per_node: int, world: int) -> list[int]:
    """t passes `tp_divisibility_problems`, stays inside a node (TP all-reduces every layer) and
    divides the world (data parallel across TP groups)."""
    return [t for t in range(2, gpus_per_node + 1) if not tp_divisibility_problems(cfg, t) and world % t == 0]


def check_tp(cfg: dict[str, Any], t: int, gpus_per_node: int, world: int) -> None:
    problems = tp_divisibility_problems(cfg, t)
    if problems:
        raise UserError(problems[0])
    if t > gpus_per_node or world % t:
        raise UserError(f"--tp {t}: must be <= GPUs per node ({gpus_per_node}) and divide the world size ({world})")


@dataclass
class Candidate:
    name: str
    checkpointing: bool
    micro_batch: int
    bytes: dict[str, int]
    cpu_bytes_per_node: int
    comm_bytes: int
    fits: bool


@dataclass
class Plan:
    params: int
    trainable_params: int
    world: int
    strategies: list[Candidate]
    chosen: str | None
    chosen_detail: Candidate | None = None
    grad_accum: int = 1
    flags: list[str] = field(default_factory=list)
    advice: str = ""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _dims(cfg: dict[str, Any]) -> tuple[int, int, int, int, int]:
    nkv = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    return cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"], nkv * head_dim(cfg), cfg["vocab_size"]


def estimate(inp: PlanInput, s: Strategy, checkpointing: bool, micro_batch: int) -> Candidate:
    cfg = inp.model
    counts = count_params(cfg)
    params = counts.total
    trainable = params if inp.method == "full" else lora_params(cfg, inp.lora_r, inp.lora_targets)
    n = inp.gpus_per_node * inp.nodes
    layers, h, i, kv, vocab = _dims(cfg)
    act = 2 if inp.precision in ("bf16", "fp16") else 4
    if inp.method == "qlora":
        linear = layers * sum(a * b for a, b in linear_shapes(cfg).values())
        weights = int(linear * QLORA_BITS / 8) + 4 * (params - linear) + 4 * trainable
    else:
        weights = weights_bytes(s, params, n, inp.precision) + (4 * trainable if inp.method == "lora" else 0)
    b = {
        "weights": weights,
        "grads": grads_bytes(s, trainable, n, inp.precision),
        "optimizer": optimizer_bytes(s, trainable, n),
        "activations": activation_bytes(layers, h, i, kv, micro_batch, inp.seq_len, act, checkpointing),
        "logits": loss_bytes(inp, micro_batch, vocab, h, act),
    }
    wb = weight_bytes_per_param(s, inp.precision)
    block = counts.per_block * wb
    buckets = DDP_BUCKET * 2 if not s.deepspeed and not s.shard_params else 0
    if s.deepspeed:
        buckets += 2 * 4 * h * h  # reduce bucket (h*h, fp32) double-buffered
    if s.shard_params:
        buckets += 2 * block  # the gathered block in use + the next one prefetched
    b["buffers"] = FRAMEWORK_CONTEXT + buckets
    b["buffers"] += int(FRAGMENTATION * sum(b.values()))
    b["total"] = sum(b.values())
    cpu = cpu_bytes(s, params, trainable, n, inp.precision) * inp.gpus_per_node
    gathers = (2 if s.name != "fsdp_grad_op" else 1) * params * wb if s.shard_params else 0
    comm = 2 * trainable * wb + gathers if n > 1 else 0
    fits = b["total"] <= inp.gpu_memory and (inp.cpu_memory is None or cpu <= inp.cpu_memory)
    return Candidate(s.name, checkpointing, micro_batch, b, cpu, comm, fits)


def estimate_model_parallel(inp: PlanInput, kind: str, degree: int, checkpointing: bool) -> Candidate:
    """tpT[_dpD]: Megatron TP of degree T inside a node, DDP across the D = world/T groups;
    ppP: P pipeline stages split as the runtime splits them (GPipe: every micro-batch's activations
    alive at once; a tied embedding is also held by the last stage), the heaviest stage taken. Weights stay fp32 under autocast, as in DDP."""
    cfg = inp.model
    counts = count_params(cfg)
    layers, h, i, kv, vocab = _dims(cfg)
    trainable_all = counts.total if inp.method == "full" else lora_params(cfg, inp.lora_r, inp.lora_targets)
    act = 2 if inp.precision in ("bf16", "fp16") else 4
    world = inp.gpus_per_node * inp.nodes
    outside = counts.embedding + counts.lm_head + counts.final_norm
    if kind == "tp":
        block_linear = sum(a * b for a, b in linear_shapes(cfg).values())
        params = layers * (counts.per_block - block_linear + block_linear // degree) + outside
        trainable = params if inp.method == "full" else lora_params(cfg, inp.lora_r, inp.lora_targets, tp=degree)
        params += 0 if inp.method == "full" else trainable  # adapters are weights too
        per_token = layers * h + 3 * h if checkpointing else tp_activation_elements_per_token(layers, h, i, kv, degree)
        acts = act * inp.micro_batch * inp.seq_len * per_token
        logits = loss_bytes(inp, inp.micro_batch, vocab, h, act)
        comm = 4 * 2 * layers * inp.micro_batch * inp.seq_len * h * act  # 2 all-reduces fwd + 2 bwd per block
        name = f"tp{degree}" + (f"_dp{world // degree}" if world // degree > 1 else "")
        b = {"weights": 4 * params, "grads": 4 * trainable, "optimizer": ADAM_BYTES * trainable,
             "activations": acts, "logits": logits}
    else:  # the runtime's split (toolkit.parallel.pp); the stage with the largest total is taken
        tied = counts.lm_head == 0
        sizes = balance([counts.per_block] * layers, degree, counts.embedding, counts.lm_head + counts.final_norm)
        per_layer = activation_elements_per_token(1, h, i, kv, checkpointing) - 3 * h
        stages = []
        for s, n in enumerate(sizes):
            last = s == degree - 1
            params = n * counts.per_block + (counts.embedding if s == 0 else 0) \
                + (counts.final_norm + (counts.embedding if tied else counts.lm_head) if last else 0)  # tied: a copy
            trainable = params if inp.method == "full" else trainable_all * n // layers
            params += 0 if inp.method == "full" else trainable
            acts = act * inp.micro_batch * inp.seq_len * (n * per_layer + 2 * h)  # GPipe: every micro-batch alive
            logits = loss_bytes(inp, inp.micro_batch, vocab, h, act, pipeline=True) if last else 0
            stages.append({"weights": 4 * params, "grads": 4 * trainable, "optimizer": ADAM_BYTES * trainable,
                           "activations": acts, "logits": logits})
        b = max(stages, key=lambda x: sum(x.values()))
        comm = 2 * (degree - 1) * inp.micro_batch * inp.seq_len * h * act  # activations + their grads
        name = f"pp{degree}"
    b["buffers"] = FRAMEWORK_CONTEXT + 2 * DDP_BUCKET
    b["buffers"] += int(FRAGMENTATION * sum(b.values()))
    b["total"] = sum(b.values())
    return Candidate(name, checkpointing, inp.micro_batch, b, 0, comm, b["total"] <= inp.gpu_memory)


def plan(inp: PlanInput) -> Plan:
    problems = []
    if inp.gpus_per_node < 1 or inp.nodes < 1:
        problems.append("--gpus-per-node and --nodes must be >= 1")
    if inp.seq_len < 1 or inp.micro_batch < 1:
        problems.append("--seq-len and --micro-batch-size must be >= 1")
    if inp.method not in ("full", "lora", "qlora"):
        problems.append(f"--method must be full, lora or qlora (got {inp.method})")
    if problems:
        raise UserError("; ".join(problems))
    names = [n for n in ORDER if not (inp.method == "qlora" and (STRATEGIES[n].shard_params or STRATEGIES[n].offload_params))]
    gc_options = [inp.checkpointing] if inp.checkpointing is not None else [False, True]
    rows = [estimate(inp, STRATEGIES[n], gc, inp.micro_batch) for gc in gc_options for n in names]
    world = inp.gpus_per_node * inp.nodes
    if inp.tp:
        for t in inp.tp:
            check_tp(inp.model, t, inp.gpus_per_node, world)
    tps = inp.tp or valid_tp(inp.model, inp.gpus_per_node, world)
    pps = inp.pp or [p for p in (2, 4) if p <= inp.model["num_hidden_layers"] and p <= world]
    for p in pps:
        if p < 2 or p > inp.model["num_hidden_layers"]:
            raise UserError(f"--pp {p}: needs 2 <= stages <= blocks ({inp.model['num_hidden_layers']})")
    rows += [estimate_model_parallel(inp, "tp", t, gc_options[0]) for t in tps]
    rows += [estimate_model_parallel(inp, "pp", p, gc_options[0]) for p in pps]
    counts = count_params(inp.model)
    trainable = counts.total if inp.method == "full" else lora_params(inp.model, inp.lora_r, inp.lora_targets)
    result = Plan(counts.total, trainable, world, rows, None)
    ranked = sorted(names, key=lambda n: (STRATEGIES[n].offload_optimizer, STRATEGIES[n].offload_params,
                                          estimate(inp, STRATEGIES[n], False, 1).comm_bytes, ORDER.index(n)))
    for gc in gc_options:
        for name in ranked:
            c = estimate(inp, STRATEGIES[name], gc, inp.micro_batch)
            if c.fits:
                mb = inp.micro_batch
                cap = -(-inp.global_batch // world) if inp.global_batch else 256  # never past the target
                while mb * 2 <= cap and estimate(inp, STRATEGIES[name], gc, mb * 2).fits:
                    mb *= 2
                best = estimate(inp, STRATEGIES[name], gc, mb)
                target = inp.global_batch or mb * world
                result.chosen, result.chosen_detail = name, best
                result.grad_accum = max(1, -(-target // (mb * world)))
                result.flags = flags_for(name, gc, mb, result.grad_accum, inp.method)
                return result
    smallest = min((estimate(inp, STRATEGIES[n], True, 1) for n in names), key=lambda c: c.bytes["total"])
    short = smallest.bytes["total"] - inp.gpu_memory
    result.advice = (f"nothing fits: the smallest plan ({smallest.name}, gradient checkpointing, micro-batch 1) needs "
                     f"{smallest.bytes['total'] / GiB:.1f} GiB per GPU, {max(short, 0) / GiB:.1f} GiB more than "
                     f"{inp.gpu_memory / GiB:.0f} GiB" + (f" (or {smallest.cpu_bytes_per_node / GiB:.0f} GiB CPU RAM per node)"
                                                        if short <= 0 else "")
                     + "; more GPUs, CPU offload, --method qlora or a shorter --seq-len would reduce it")
    return result


def flags_for(name: str, gc: bool, mb: int, ga: int, method: str) -> list[str]:
    s = STRATEGIES[name]
    flags = ["--method", method]
    if s.deepspeed:
        flags += ["--zero-stage", name[4]]
        if s.offload_optimizer:
            flags += ["--offload", "optimizer+param" if s.offload_params else "optimizer"]
    elif name.startswith("fsdp"):
        flags += ["--fsdp", "--fsdp-sharding", name.split("_", 1)[1]]
    if gc:
        flags.append("--gradient-checkpointing")
    return flags + ["--micro-batch-size", str(mb), "--grad-accum", str(ga)]


def render_table(p: Plan, gpu_memory: int) -> str:
    cols = ["weights", "grads", "optimizer", "activations", "logits", "buffers", "total"]
    lines = [f"params {p.params:,}  trainable {p.trainable_params:,}  world {p.world} GPUs  "
             f"GPU memory {gpu_memory / GiB:.0f} GiB  (GiB per GPU below)",
             f"{'strategy':<22}" + "".join(f"{c:>12}" for c in cols) + f"{'cpu/node':>10}{'fits':>6}"]
    for c in p.strategies:
        lines.append(f"{c.name + (' +gc' if c.checkpointing else ''):<22}"
                     + "".join(f"{c.bytes[k] / GiB:>12.2f}" for k in cols)
                     + f"{c.cpu_bytes_per_node / GiB:>10.1f}{'yes' if c.fits else 'no':>6}")
    if any(c.name.startswith(("tp", "pp")) for c in p.strategies):
        lines.append("tp/pp rows run with --tp N / --pp N (torchrun, world = N x data-parallel; --pp also in one "
                     "process over N GPUs); auto picks among DDP/ZeRO/FSDP")
    if p.chosen:
        d = p.chosen_detail
        lines.append(f"chosen: {p.chosen}{' with gradient checkpointing' if d.checkpointing else ''}, micro-batch "
                     f"{d.micro_batch}, grad-accum {p.grad_accum}: {d.bytes['total'] / GiB:.1f} GiB per GPU")
        lines.append("flags: " + " ".join(p.flags))
    else:
        lines.append(p.advice)
    return "\n".join(lines)
