"""Predict per-GPU memory for every strategy and pick the one to run.

Order (docs/planner.md): what fits (GPU memory and host RAM) > no CPU offload > the least predicted
step time (`toolkit.planner.cost`: gradient checkpointing's extra forward, the bytes moved between
GPUs, offload's PCIe traffic and host optimizer step, compared rather than ranked by a fixed order).
On one GPU nothing is sharded: only DDP and the offload variants are planned. Then the largest
micro-batch that fits and the accumulation that reaches the target global batch.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any

from toolkit.errors import UserError
from toolkit.planner.cost import ADAM_HOST_BYTES, flops_per_token, step_seconds
from toolkit.planner.memory import (ADAM_BYTES, STRATEGIES, Strategy, activation_bytes, activation_elements_per_token,
                                    chunked_loss_bytes, cpu_bytes, frozen_bytes_per_param, grads_bytes, logits_bytes,
                                    optimizer_bytes, tp_activation_elements_per_token, ulysses_comm_bytes,
                                    weight_bytes_per_param,
                                    weights_bytes)
from toolkit.planner.params import count_params, head_dim, linear_shapes, lora_params
from toolkit.planner.stages import balance

GiB = 1024**3
FRAMEWORK_CONTEXT = 1 * GiB  # CUDA context, cuBLAS/cuDNN workspaces, allocator pools (typical H100 run)
DDP_BUCKET = 25 * 1024**2  # torch DDP bucket_cap_mb default
FRAGMENTATION = 0.10  # caching-allocator slack, as a fraction of everything else
TIE = 0.05  # predicted times closer than this are treated as equal
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
    cpu_memory: int | None = None  # host RAM per node; None: not checked
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
    cp: list[int] | None = None  # context-parallel degrees to predict (default: none)
    loss: str = "auto"  # the runtime's --loss: auto and chunked never hold (b, s, V) logits, except under pp


def loss_bytes(inp: PlanInput, micro_batch: int, vocab: int, h: int, act: int, pipeline: bool = False,
               seq_len: int | None = None) -> int:
    """The loss step's buffers: full logits, or one chunk's under `--loss chunked`/`auto` (the
    pipeline's last stage always computes full logits), for `seq_len` tokens (default: the whole)."""
    s = seq_len or inp.seq_len
    if inp.loss == "full" or pipeline:
        return logits_bytes(micro_batch, s, vocab, act)
    return chunked_loss_bytes(micro_batch, s, vocab, h, act, head_trainable=inp.method == "full")


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


def check_cp(cfg: dict[str, Any], c: int, world: int) -> None:
    """The runtime's rule (toolkit.parallel.cp.cp_problems): query and kv heads divide by cp."""
    nkv = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    if c < 2 or cfg["num_attention_heads"] % c or nkv % c or world % c:
        raise UserError(f"--cp {c}: must be >= 2 and divide the attention heads ({cfg['num_attention_heads']}), "
                        f"kv heads ({nkv}) and the world size ({world})")


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
    step_seconds: float | None = None  # predicted, for ranking (None: TP/PP rows, not ranked yet)


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
    gpu_memory: int = 0
    cpu_memory: int | None = None
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _dims(cfg: dict[str, Any]) -> tuple[int, int, int, int, int]:
    nkv = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    return cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"], nkv * head_dim(cfg), cfg["vocab_size"]


def offloads(s: Strategy) -> bool:
    return s.offload_optimizer or s.offload_params


def estimate(inp: PlanInput, s: Strategy, checkpointing: bool, micro_batch: int) -> Candidate:
    cfg = inp.model
    counts = count_params(cfg)
    params = counts.total
    trainable = params if inp.method == "full" else lora_params(cfg, inp.lora_r, inp.lora_targets)
    frozen = 0 if inp.method == "full" else params
    n = inp.gpus_per_node * inp.nodes
    layers, h, i, kv, vocab = _dims(cfg)
    act = 2 if inp.precision in ("bf16", "fp16") else 4
    if inp.method == "qlora":  # peft's prepare_model_for_kbit_training keeps the unquantized rest in fp32
        linear = layers * sum(a * b for a, b in linear_shapes(cfg).values())
        weights = int(linear * QLORA_BITS / 8) + 4 * (params - linear) + 4 * trainable
    else:
        weights = weights_bytes(s, frozen, trainable, n, inp.precision)
    b = {
        "weights": weights,
        "grads": grads_bytes(s, trainable, n, inp.precision),
        "optimizer": optimizer_bytes(s, trainable, n),
        "activations": activation_bytes(layers, h, i, kv, micro_batch, inp.seq_len, act, checkpointing),
        "logits": loss_bytes(inp, micro_batch, vocab, h, act),
    }
    wb = weight_bytes_per_param(s, inp.precision)
    model_bytes = frozen_bytes_per_param(inp.precision) * frozen + wb * trainable  # the whole model, once
    block = model_bytes * counts.per_block // max(params, 1)
    buckets = DDP_BUCKET * 2 if not s.deepspeed and not s.shard_params else 0
    if s.deepspeed:
        buckets += 2 * 4 * h * h  # reduce bucket (h*h, fp32) double-buffered
    if s.name == "fsdp_grad_op":  # every block stays gathered from its forward until its backward
        buckets += model_bytes - model_bytes // n
    elif s.shard_params:
        buckets += 2 * block  # the gathered block in use + the next one prefetched
    b["buffers"] = FRAMEWORK_CONTEXT + buckets
    b["buffers"] += int(FRAGMENTATION * sum(b.values()))
    b["total"] = sum(b.values())
    cpu = cpu_bytes(s, params, trainable, n, inp.precision) * inp.gpus_per_node
    # ZeRO-3 / FSDP full gather the parameters in forward and backward, and once more to recompute
    # a checkpointed forward; FSDP grad_op keeps them gathered from forward to the end of backward.
    gathers = (1 if s.name == "fsdp_grad_op" else 2 + checkpointing) if s.shard_params else 0
    comm = 2 * trainable * wb + gathers * model_bytes if n > 1 else 0
    pcie = 2 * wb * trainable // n if s.offload_optimizer else 0  # gradients down, updated weights up
    if s.offload_params:  # each rank fetches its partition before every gather
        pcie += (2 + checkpointing) * model_bytes // n
    flops = micro_batch * inp.seq_len * flops_per_token(params, trainable, layers, h, inp.seq_len, checkpointing)
    host = ADAM_HOST_BYTES * trainable // n if s.offload_optimizer else 0
    seconds = step_seconds(flops, inp.precision, comm, inp.nodes, pcie, host)
    fits = b["total"] <= inp.gpu_memory and (inp.cpu_memory is None or cpu <= inp.cpu_memory)
    return Candidate(s.name, checkpointing, micro_batch, b, cpu, comm, fits, seconds)


def estimate_model_parallel(inp: PlanInput, kind: str, degree: int, checkpointing: bool) -> Candidate:
    """tpT[_dpD]: Megatron TP of degree T inside a node, DDP across the D = world/T groups;
    cpC[_dpD]: Ulysses context parallel, each of C ranks holding s/C tokens of every sequence (and
    the whole model, as DDP), DDP across the D groups; ppP: P pipeline stages split as the runtime splits them (GPipe: every micro-batch's activations
    alive at once; a tied embedding is also held by the last stage), the heaviest stage taken.
    Trainable weights stay fp32 under autocast, as in DDP; a LoRA base is in the half dtype."""
    cfg = inp.model
    counts = count_params(cfg)
    layers, h, i, kv, vocab = _dims(cfg)
    trainable_all = counts.total if inp.method == "full" else lora_params(cfg, inp.lora_r, inp.lora_targets)
    act = 2 if inp.precision in ("bf16", "fp16") else 4
    world = inp.gpus_per_node * inp.nodes
    fb = frozen_bytes_per_param(inp.precision)

    def weights(params: int, trainable: int) -> int:  # LoRA: the base frozen, the adapters trainable
        return 4 * params if inp.method == "full" else fb * params + 4 * trainable

    outside = counts.embedding + counts.lm_head + counts.final_norm
    if kind == "tp":
        block_linear = sum(a * b for a, b in linear_shapes(cfg).values())
        params = layers * (counts.per_block - block_linear + block_linear // degree) + outside
        trainable = params if inp.method == "full" else lora_params(cfg, inp.lora_r, inp.lora_targets, tp=degree)
        per_token = layers * h + 3 * h if checkpointing else tp_activation_elements_per_token(layers, h, i, kv, degree)
        acts = act * inp.micro_batch * inp.seq_len * per_token
        logits = loss_bytes(inp, inp.micro_batch, vocab, h, act)
        comm = 4 * 2 * layers * inp.micro_batch * inp.seq_len * h * act  # 2 all-reduces fwd + 2 bwd per block
        name = f"tp{degree}" + (f"_dp{world // degree}" if world // degree > 1 else "")
        b = {"weights": weights(params, trainable), "grads": 4 * trainable, "optimizer": ADAM_BYTES * trainable,
             "activations": acts, "logits": logits}
    elif kind == "cp":  # every layer but attention is token-local: a rank's activations are its s/C tokens'
        local = -(-inp.seq_len // degree)
        acts = activation_bytes(layers, h, i, kv, inp.micro_batch, local, act, checkpointing)
        b = {"weights": weights(counts.total, trainable_all), "grads": 4 * trainable_all,
             "optimizer": ADAM_BYTES * trainable_all, "activations": acts,
             "logits": loss_bytes(inp, inp.micro_batch, vocab, h, act, seq_len=local)}
        comm = ulysses_comm_bytes(layers, h, kv, inp.micro_batch, inp.seq_len, degree, act)
        name = f"cp{degree}" + (f"_dp{world // degree}" if world // degree > 1 else "")
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
            acts = act * inp.micro_batch * inp.seq_len * (n * per_layer + 2 * h)  # GPipe: every micro-batch alive
            logits = loss_bytes(inp, inp.micro_batch, vocab, h, act, pipeline=True) if last else 0
            stages.append({"weights": weights(params, trainable), "grads": 4 * trainable, "optimizer": ADAM_BYTES * trainable,
                           "activations": acts, "logits": logits})
        b = max(stages, key=lambda x: sum(x.values()))
        comm = 2 * (degree - 1) * inp.micro_batch * inp.seq_len * h * act  # activations + their grads
        name = f"pp{degree}"
    b["buffers"] = FRAMEWORK_CONTEXT + 2 * DDP_BUCKET
    b["buffers"] += int(FRAGMENTATION * sum(b.values()))
    b["total"] = sum(b.values())
    return Candidate(name, checkpointing, inp.micro_batch, b, 0, comm, b["total"] <= inp.gpu_memory)


def planned_strategies(inp: PlanInput) -> list[str]:
    """The strategies worth predicting: QLoRA's 4-bit base can be neither sharded by parameter nor
    offloaded; on one GPU ZeRO and FSDP shard over a single rank (nothing saved, DeepSpeed's or
    FSDP's overhead paid), so only DDP and the CPU-offload variants remain."""
    world = inp.gpus_per_node * inp.nodes
    out = []
    for name in ORDER:
        s = STRATEGIES[name]
        if inp.method == "qlora" and (s.shard_params or s.offload_params):
            continue
        if world == 1 and s.shard_optimizer and not offloads(s):
            continue
        out.append(name)
    return out


def rank_key(c: Candidate) -> tuple:
    """Fits first, then no CPU offload, then the least predicted time per example; ties go to the
    simpler strategy (ORDER)."""
    return (not c.fits, offloads(STRATEGIES[c.name]), c.step_seconds / c.micro_batch, ORDER.index(c.name))


def choose(rows: list[Candidate]) -> Candidate:
    """The first by `rank_key`, except that predictions within `TIE` of the fastest count as equal
    (the time model is not that accurate) and the simpler strategy among them wins (ORDER, no
    checkpointing first)."""
    best = min(rows, key=rank_key)
    near = [c for c in rows if rank_key(c)[:2] == rank_key(best)[:2]
            and c.step_seconds / c.micro_batch <= (1 + TIE) * best.step_seconds / best.micro_batch]
    return min(near, key=lambda c: (ORDER.index(c.name), c.checkpointing))


def largest_micro_batch(inp: PlanInput, c: Candidate, cap: int) -> Candidate:
    """The candidate at the largest micro-batch that still fits (doubling, never past `cap`): per-step
    costs (gradient reduction, ZeRO-3 gathers, offload traffic, the host's Adam step) are then shared
    by more examples, which is how offload and sharding pay for themselves."""
    mb = c.micro_batch
    while mb * 2 <= cap and estimate(inp, STRATEGIES[c.name], c.checkpointing, mb * 2).fits:
        mb *= 2
    return c if mb == c.micro_batch else estimate(inp, STRATEGIES[c.name], c.checkpointing, mb)


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
    names = planned_strategies(inp)
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
    counts = count_params(inp.model)
    trainable = counts.total if inp.method == "full" else lora_params(inp.model, inp.lora_r, inp.lora_targets)
    result = Plan(counts.total, trainable, world, list(rows), None, gpu_memory=inp.gpu_memory, cpu_memory=inp.cpu_memory)
    if world == 1:
        result.notes.append("one GPU: ZeRO-1/2/3 and FSDP would shard over a single rank, so only DDP and the "
                            "CPU-offload variants are planned")
    result.strategies += [estimate_model_parallel(inp, "tp", t, gc_options[0]) for t in tps]
    result.strategies += [estimate_model_parallel(inp, "pp", p, gc_options[0]) for p in pps]
    for c in inp.cp or []:
        check_cp(inp.model, c, world)
        result.strategies.append(estimate_model_parallel(inp, "cp", c, gc_options[0]))
    cap = -(-inp.global_batch // world) if inp.global_batch else 256  # never past the target
    best = choose([largest_micro_batch(inp, r, cap) if r.fits else r for r in rows])
    if not best.fits:
        result.advice = nothing_fits(inp, names)
        return result
    target = inp.global_batch or best.micro_batch * world
    result.chosen, result.chosen_detail = best.name, best
    result.grad_accum = max(1, -(-target // (best.micro_batch * world)))
    result.flags = flags_for(best.name, best.checkpointing, best.micro_batch, result.grad_accum, inp.method)
    return result


def nothing_fits(inp: PlanInput, names: list[str]) -> str:
    """Name the resource that is short: GPU memory for the smallest plan that fits in host RAM, and
    host RAM for the plans (CPU offload) that would fit on the GPU."""
    gc = inp.checkpointing is not False
    how = "gradient checkpointing" if gc else "no checkpointing"
    smallest = [estimate(inp, STRATEGIES[n], gc, 1) for n in names]
    fitting = sorted((c for c in smallest if c.fits), key=rank_key)
    if fitting:  # only the requested micro-batch is too large
        return (f"nothing fits at --micro-batch-size {inp.micro_batch}; at micro-batch 1 {fitting[0].name} ({how}) "
                f"fits in {fitting[0].bytes['total'] / GiB:.1f} GiB per GPU: lower --micro-batch-size and raise "
                "--grad-accum")
    gpu, cpu = inp.gpu_memory, inp.cpu_memory
    in_ram = [c for c in smallest if cpu is None or c.cpu_bytes_per_node <= cpu]
    parts = []
    if in_ram:
        c = min(in_ram, key=lambda c: c.bytes["total"])
        parts.append(f"the smallest plan in GPU memory ({c.name}, {how}, micro-batch 1) needs "
                     f"{c.bytes['total'] / GiB:.1f} GiB per GPU, {(c.bytes['total'] - gpu) / GiB:.1f} GiB more than "
                     f"the {gpu / GiB:.0f} GiB GPU")
    on_gpu = [c for c in smallest if c.bytes["total"] <= gpu and cpu is not None and c.cpu_bytes_per_node > cpu]
    if on_gpu:
        c = min(on_gpu, key=lambda c: c.cpu_bytes_per_node)
        parts.append(f"{c.name} ({how}, micro-batch 1) would fit the GPU ({c.bytes['total'] / GiB:.1f} of "
                     f"{gpu / GiB:.0f} GiB) but needs {c.cpu_bytes_per_node / GiB:.0f} GiB of host RAM per node, "
                     f"{(c.cpu_bytes_per_node - cpu) / GiB:.0f} GiB more than the {cpu / GiB:.0f} GiB there")
    helps = ["more GPUs", "more host RAM for CPU offload", "--method qlora", "a shorter --seq-len"]
    if not gc:
        helps.insert(0, "--gradient-checkpointing")
    return "nothing fits: " + "; ".join(parts) + "; " + ", ".join(helps[:-1]) + f" or {helps[-1]} would reduce it"


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


def render_table(p: Plan) -> str:
    cols = ["weights", "grads", "optimizer", "activations", "logits", "buffers", "total"]
    ram = "not checked" if p.cpu_memory is None else f"{p.cpu_memory / GiB:.0f} GiB"
    lines = [f"params {p.params:,}  trainable {p.trainable_params:,}  world {p.world} GPUs  "
             f"GPU memory {p.gpu_memory / GiB:.0f} GiB  host RAM per node {ram}  (GiB per GPU below)", *p.notes,
             f"{'strategy':<22}" + "".join(f"{c:>12}" for c in cols) + f"{'cpu/node':>10}{'step s':>8}{'fits':>6}"]
    for c in p.strategies:
        step = "-" if c.step_seconds is None else f"{c.step_seconds:.2f}"
        lines.append(f"{c.name + (' +gc' if c.checkpointing else ''):<22}"
                     + "".join(f"{c.bytes[k] / GiB:>12.2f}" for k in cols)
                     + f"{c.cpu_bytes_per_node / GiB:>10.1f}{step:>8}{'yes' if c.fits else 'no':>6}")
    lines.append("step s: predicted seconds per micro-batch step (H100-class node), used to rank what fits")
    if any(c.name.startswith(("tp", "pp", "cp")) for c in p.strategies):
        lines.append("tp/pp/cp rows run with --tp N / --pp N / --cp N (torchrun, world = N x data-parallel; --pp also "
                     "in one process over N GPUs); auto picks among DDP/ZeRO/FSDP")
    if p.chosen:
        d = p.chosen_detail
        lines.append(f"chosen: {p.chosen}{' with gradient checkpointing' if d.checkpointing else ''}, micro-batch "
                     f"{d.micro_batch}, grad-accum {p.grad_accum}: {d.bytes['total'] / GiB:.1f} GiB per GPU"
                     + (f", {d.cpu_bytes_per_node / GiB:.1f} GiB host RAM per node" if d.cpu_bytes_per_node else "")
                     + f", {d.step_seconds:.2f} s per micro-batch step predicted")
        lines.append("flags: " + " ".join(p.flags))
    else:
        lines.append(p.advice)
    return "\n".join(lines)
