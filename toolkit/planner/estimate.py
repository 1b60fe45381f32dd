"""Predict per-GPU memory and step time for every layout the toolkit runs, and pick the one to run:
the numbers only (the words that say why, and the table, are `toolkit.planner.explain`'s).

The candidates: the 1-D strategies (DDP, ZeRO-1/2/3 and offloads, FSDP; `memory.STRATEGIES`, `estimate`)
and every device-mesh layout pp x dp_replicate x dp_shard x cp x tp, an MoE model's also with each
expert-parallel degree (`layouts.mesh_layouts`, `estimate_layout`), each with and without gradient
checkpointing, each at the split of the global batch it runs best (`split_batch`: the batch asked for is
kept, only its division into micro-batch x accumulation x data-parallel ranks changes). Order
(docs/planner.md, `rank_key`, `choose`): runnable and fits (GPU memory and host RAM) > keeps the global
batch > no CPU offload > the least predicted time per example (`cost.step_terms`) > the simpler layout.
On one GPU nothing is sharded: only DDP and the offload variants are planned. `search` runs it all.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from toolkit.errors import UserError
from toolkit.layout.dims import MESH_DIMS, ParallelDims, layout_name
from toolkit.layout.rules import (cp_divisibility_problems, dims_for, model_problems,
                                  ep_problems, not_runnable, strategy_name, tp_divisibility_problems)
from toolkit.planner.cost import (ADAM_STEP_BYTES, Hardware, Traffic, flops_per_token, forward_flops_per_token,
                                  load_hardware, optimizer_step_seconds, optimizer_step_terms, ring_factor,
                                  step_seconds, step_terms)
from toolkit.planner.layouts import (gathered_block, loss_bytes, mesh_step_terms, stage_bytes,
                                     traffic)
from toolkit.planner.memory import (STRATEGIES, Sharding, cpu_bytes, vision_split,
                                    frozen_bytes_per_param, gathered_bytes_per_param, generation_bytes, grads_bytes,
                                    optimizer_bytes,
                                    weight_bytes_per_param, weights_bytes)
from toolkit.hardware import PROBE_MATMUL_GPU
from toolkit.planner import saved
from toolkit.planner.params import (cast_weights, count_params, head_dim, lora_params)

GiB = 1024**3
# CUDA context, cuBLAS/cuDNN workspaces, allocator pools (typical H100 run)
FRAMEWORK_CONTEXT = 1 * GiB
# torch DDP bucket_cap_mb default
DDP_BUCKET = 25 * 1024**2
# caching-allocator slack, as a fraction of everything else
FRAGMENTATION = 0.10
# NF4 + double-quantized constants (QLoRA paper, sec. 3: 0.127 bits/param)
QLORA_BITS = 4.127


def parse_size(text: str, what: str) -> int:
    """'80', '80GB', '80GiB', '512MB', '1.5TB' -> bytes. A bare number is GB, and GB = GiB here, as
    vendors quote GPU memory ("80GB" H100: 80 GiB). Under 1 GB is no GPU or host this plans for:
    refused, most likely a unit slip."""
    m = re.fullmatch(r"\s*(-?[0-9]*\.?[0-9]+)\s*([KMGT]i?B|[KMGT])?\s*", str(text), re.IGNORECASE)
    if not m:
        raise UserError(f"--{what} {text!r} is not a size; use a number of GB, or one with MB/GB/TB, e.g. 80GB")
    unit = (m.group(2) or "G")[:1].upper()
    value = float(m.group(1)) * 1024 ** {"K": 1, "M": 2, "G": 3, "T": 4}[unit]
    if value <= 0:
        raise UserError(f"--{what} must be positive, got {text!r}")
    if value < GiB:
        raise UserError(f"--{what} {text.strip()} is under 1 GB, smaller than any GPU or host this plans for; "
                        f"give the memory in GB, e.g. 80GB")
    return int(value)


@dataclass(frozen=True)
class Asked:
    """The layout a run's settings ask for (`plan --config RUN.yaml`): its parallel flags (a
    `toolkit.layout.flags.ParallelConfig`, a Config's parallel section) and its gradient
    checkpointing. It is predicted as it is, at the run's micro-batch and accumulation, beside the
    search, and chosen where it fits and runs: the plan says what the run will meet."""
    layout: Any
    checkpointing: bool


@dataclass
class PlanInput:
    model: dict[str, Any]
    gpu_memory: int
    gpus_per_node: int = 8
    nodes: int = 1
    # host RAM per node; None: not checked
    cpu_memory: int | None = None
    # cpu_memory is None because nobody said: the plan is for another machine
    cpu_memory_unknown: bool = False
    method: str = "lora"
    lora_r: int = 16
    lora_targets: str = "all-linear"
    # finetune.py's default; > 0 saves a mask per adapted input
    lora_dropout: float = 0.0
    seq_len: int = 2048
    micro_batch: int = 1
    # with micro_batch and the GPUs, the global batch asked for (`target_batch`)
    grad_accum: int = 1
    precision: str = "bf16"
    # None: try without first
    checkpointing: bool | None = None
    # examples per optimizer step (None: micro_batch x grad_accum x GPUs)
    global_batch: int | None = None
    # TP degrees to predict (default: every valid one) pipeline degrees to predict (default: 2 and 4 where they fit the
    # blocks) context-parallel degrees to predict (default: none) expert-parallel degrees to predict (default: every
    # valid one; MoE models only)
    tp: list[int] | None = None
    pp: list[int] | None = None
    cp: list[int] | None = None
    ep: list[int] | None = None
    # the runtime's --loss: auto and chunked never hold (b, s, V) logits, except under pp
    loss: str = "auto"
    # the time model's figures (None: the H100 SXM preset)
    hardware: Hardware | None = None
    # the run's own layout (plan --config), evaluated as it is what each rank runs on: "GPU", or "CPU" (a run without
    # one: memory per process)
    asked: Asked | None = None
    device: str = "GPU"
    # sequences per example: 2 for a preference pair (chosen and rejected, one micro-batch)
    sequences: int = 1
    # no-grad forwards per sequence (`toolkit.config.objectives.extra_forwards`): LoRA DPO's
    extra_forwards: int = 0
    # reference (the base model's forward before each policy forward), KTO's KL estimate
    # --objective grpo: (completions a rank samples at once, prompt + completion tokens): the KV cache and what
    # sampling holds (`memory.generation_bytes`), at its own peak beside the training step's
    generation: tuple[int, int] | None = None
    # an image-text model's vision side beside its language model (`model` is the language model's config): the
    # (vision tower's, projector's) parameters (`toolkit.model.vision.vision_params`), and --train-vision
    # (`memory.vision_split`)
    vision: tuple[int, int] = (0, 0)
    train_vision: str = "none"
    # what the run refuses of --tp ("tp") or --pp ("pp") on the config's module tree, '' where it runs
    # (`toolkit.parallel.tree.tree_problem`, handed in by the caller: the planner stays below the parallel layer)
    tree_check: Callable[[dict[str, Any], str], str] | None = None

    @property
    def hw(self) -> Hardware:
        return self.hardware or load_hardware(None)

    @property
    def per(self) -> str:
        """What a per-rank figure is per, in words."""
        return "GPU" if self.device == "GPU" else "process"


def activation_terms(inp: PlanInput, micro_batch: int, checkpointing: bool, weight_bytes: int,
                     trainable: int, fsdp: bool = False) -> tuple[int, int, int]:
    """`toolkit.planner.saved`'s terms for one micro-batch: (what the forward saves: every block, or
    with checkpointing each block's input, plus what lies outside the blocks; what backward adds: one
    block's recomputed activations under checkpointing, and the gradients alive in one block's
    backward; the autocast copies of trainable fp32 weights, none under FSDP2's policy (`fsdp`))."""
    cfg, h = inp.model, inp.model["hidden_size"]
    d = saved.dtypes(inp.method, inp.precision, fsdp=fsdp)
    per = saved.layers(cfg, d, None if inp.method == "full" else inp.lora_targets, inp.lora_r, inp.lora_dropout)
    tokens = micro_batch * inp.seq_len
    kept, backward = saved.stack(per, tokens, h, d, checkpointing)
    matmul = cast_weights(cfg) if inp.method == "full" else trainable
    casts = 0 if fsdp else saved.autocast_copies(matmul, weight_bytes, d)
    return kept + tokens * saved.outside_blocks(h, head_dim(cfg), d), backward, casts


def total_bytes(allocated: int) -> int:
    """What nvidia-smi shows: the allocator's peak, the allocator's reserve over it (fragmentation and
    rounding of cached blocks) and the CUDA context."""
    return allocated + int(FRAGMENTATION * allocated) + FRAMEWORK_CONTEXT


def check_cp(cfg: dict[str, Any], c: int, world: int) -> None:
    """The runtime's rule (`toolkit.layout.rules.cp_divisibility_problems`), and cp must divide the world."""
    problems = cp_divisibility_problems(cfg, 1, c) if c > 1 else [f"--cp {c}: must be >= 2"]
    if problems:
        raise UserError(problems[0])
    if world % c:
        raise UserError(f"--cp {c}: must divide the world size ({world})")


def check_tp(cfg: dict[str, Any], t: int, gpus_per_node: int, world: int) -> None:
    problems = tp_divisibility_problems(cfg, t)
    if problems:
        raise UserError(problems[0])
    if t > gpus_per_node or world % t:
        raise UserError(f"--tp {t}: must be <= GPUs per node ({gpus_per_node}) and divide the world size ({world})")


def check_ep(cfg: dict[str, Any], e: int, world: int) -> None:
    """The run's rule (`toolkit.layout.rules.ep_problems`: the model has routed experts and e divides
    them), and e must divide the world: ep borrows its ranks from dp_shard, so a degree no layout can
    hold is refused here rather than planned as nothing."""
    problems = ep_problems(cfg, e) if e > 1 else [f"--ep {e}: must be >= 2"]
    if problems:
        raise UserError(problems[0])
    if world % e:
        raise UserError(f"--ep {e}: must divide the world size ({world})")


def shortfall(gpu_bytes: int, cpu_bytes: int, inp: PlanInput) -> list[str]:
    """What memory a row is short of, empty where it fits: "gpu" (the GPU's, or a process's on a run
    without one), "host_ram" (the node's RAM that CPU offload fills; unchecked where `cpu_memory` is
    None). The table's fits column prints it, so an offload row's "no" carries its reason."""
    return ["gpu"] * (gpu_bytes > inp.gpu_memory) + ["host_ram"] * (inp.cpu_memory is not None
                                                                     and cpu_bytes > inp.cpu_memory)


@dataclass
class Candidate:
    name: str
    checkpointing: bool
    micro_batch: int
    bytes: dict[str, int]
    cpu_bytes_per_node: int
    comm_bytes: int
    fits: bool
    # seconds of one micro-batch step that ends an optimizer step, by `cost.TERMS`
    terms: dict[str, float]
    # examples one micro-batch step processes over the whole world
    examples_per_step: int
    # micro-batch steps per optimizer step (set by `split_batch`)
    grad_accum: int = 1
    # the mesh degrees of a composed layout (None: a 1-D strategy)
    dims: dict[str, int] | None = None
    runnable: bool = True
    # why the runtime refuses it
    why_not: str = ""
    # the layout the run's settings ask for (`Asked`), at their batch split
    asked: bool = False
    # where it does not fit, what memory is short (`shortfall`)
    short: list[str] = field(default_factory=list)
    # the sum of `terms` its part paid once per optimizer step (`cost.ONCE_TERMS`)
    step_seconds: float = field(init=False)
    once_seconds: float = field(init=False)
    # examples per optimizer step: examples_per_step x grad_accum
    global_batch: int = field(init=False)
    # predicted seconds per optimizer step at grad_accum
    step_time_s: float = field(init=False)
    # step_time_s term by term (`cost.optimizer_step_terms`)
    seconds: dict[str, float] = field(init=False)

    def __post_init__(self) -> None:
        self.step_seconds, self.once_seconds = step_seconds(self.terms)
        self.set_accumulation(self.grad_accum)

    def set_accumulation(self, grad_accum: int) -> None:
        """Run `grad_accum` micro-batch steps per optimizer step: the global batch and the optimizer
        step's predicted seconds follow."""
        self.grad_accum = grad_accum
        self.global_batch = self.examples_per_step * grad_accum
        self.seconds = optimizer_step_terms(self.terms, grad_accum)
        self.step_time_s = optimizer_step_seconds(self.step_seconds, self.once_seconds, grad_accum)

    @property
    def data_ranks(self) -> int:
        """Ranks that read different examples (cp, tp and pp ranks share theirs)."""
        return self.examples_per_step // self.micro_batch

    @property
    def seconds_per_example(self) -> float:
        """Predicted time per example at `grad_accum`: the quantity candidates are ranked by."""
        return self.step_time_s / self.global_batch


@dataclass
class Plan:
    """The planner's answer: `search` fills its numbers, `toolkit.planner.explain.plan` its words."""
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
    # `listed`'s rows, each with why it lost
    ranking: list[dict[str, Any]] = field(default_factory=list)
    # the time model's figures (`cost.Hardware.name`)
    hardware: str = ""
    # examples per optimizer step asked for (`target_batch`)
    global_batch: int = 0
    # how the chosen layout splits the global batch, in one line (`explain.batch_line`)
    batch: str = ""
    # what decided the choice, by rival (`explain.why_chosen`)
    why: list[dict[str, Any]] = field(default_factory=list)
    # `--strategy auto` after an out-of-memory (`fallbacks`)
    fallbacks: list[dict[str, Any]] = field(default_factory=list)
    # the run's own layout (`Asked`) as predicted; None: none asked, or not predictable
    asked: Candidate | None = None
    # one line on it: chosen, does not fit (and why), or cannot run on this machine
    asked_verdict: str = ""
    # `PlanInput.device`
    device: str = "GPU"
    # an MoE model's best layout with ep against the best without, in one line
    expert_parallel: str = ""
    # trainable parameters by part (`params.PARTS`)
    trainable_parts: dict[str, int] = field(default_factory=dict)
    # the chosen's memory near a limit, or its host RAM unchecked (`explain.memory_line`)
    memory: str = ""
    # `PlanInput.cpu_memory_unknown`
    cpu_memory_unknown: bool = False

    def to_json(self) -> dict[str, Any]:
        """Every field; a row's `terms` (one micro-batch step) is left out: `seconds` gives the same
        terms for an optimizer step."""
        out = asdict(self)
        for row in [*out["strategies"], out["chosen_detail"] or {}, out["asked"] or {}]:
            row.pop("terms", None)
        return out


def _dims(cfg: dict[str, Any]) -> tuple[int, int, int, int, int]:
    nkv = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    return (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"], nkv * head_dim(cfg),
            cfg["vocab_size"])


def offloads(s: Sharding) -> bool:
    return s.offload_optimizer or s.offload_params


def estimate(inp: PlanInput, s: Sharding, checkpointing: bool, micro_batch: int) -> Candidate:
    cfg = inp.model
    counts = count_params(cfg)
    v_frozen, v_trained = vision_split(inp.vision, inp.method, inp.train_vision)
    # LoRA holds peft's trained copies beside the frozen originals
    params = counts.total + v_frozen + v_trained
    trainable = (counts.total if inp.method == "full" else lora_params(cfg, inp.lora_r, inp.lora_targets)) + v_trained
    frozen = (0 if inp.method == "full" else counts.total) + v_frozen
    n = inp.gpus_per_node * inp.nodes
    layers, h, i, kv, vocab = _dims(cfg)
    act = 2 if inp.precision in ("bf16", "fp16") else 4
    # peft's prepare_model_for_kbit_training keeps the unquantized rest in fp32
    if inp.method == "qlora":
        # bitsandbytes quantizes the nn.Linear weights, not stacked experts
        linear = counts.linear
        weights = int(linear * QLORA_BITS / 8) + 4 * (params - linear) + 4 * trainable
    elif inp.method == "full":
        # a full finetune loads every weight at the trained width, a frozen tower's too
        weights = weights_bytes(s, 0, trainable + frozen, n, inp.precision)
    else:
        weights = weights_bytes(s, frozen, trainable, n, inp.precision)
    wb = weight_bytes_per_param(s, inp.precision)
    # the sequences a forward holds (a pair is two)
    rows = micro_batch * inp.sequences
    forward, backward, casts = activation_terms(inp, rows, checkpointing, wb, trainable, s.fsdp)
    b = {
        "weights": weights,
        "grads": grads_bytes(s, trainable, n, inp.precision),
        "optimizer": optimizer_bytes(s, trainable, n),
        "autocast_copies": casts,
        "activations": forward + backward,
        "logits": loss_bytes(inp, rows, vocab, h, act),
    }
    # the whole model, once
    model_bytes = wb * (frozen + trainable) if inp.method == "full" else \
        frozen_bytes_per_param(inp.precision) * frozen + wb * trainable
    # what a sharded layout all-gathers: FSDP2 in its policy's compute dtype, ZeRO-3 as DeepSpeed holds it
    gathered = gathered_bytes_per_param(inp.precision) * params if s.fsdp else model_bytes
    block = gathered * counts.per_block // max(params, 1)
    # one process: no DDP
    buckets = DDP_BUCKET * 2 if not s.deepspeed and not s.shard_params and n > 1 else 0
    if s.deepspeed:
        # reduce bucket (h*h, fp32) double-buffered every block stays gathered from its forward until its backward
        buckets += 2 * 4 * h * h
    if s.name == "fsdp_grad_op":
        buckets += gathered - gathered // n
    elif s.shard_params:
        # the gathered block in use + the next one prefetched
        buckets += 2 * block
    # one process (no DDP buckets) frees its gradients after each step; DDP's buckets and DeepSpeed's
    # partitions keep gradient-sized buffers through the next forward
    resident = s.deepspeed or n > 1
    embedding_grad = 4 * vocab * h if inp.method == "full" else 0
    b["buffers"] = buckets
    b["allocated"] = saved.allocated_peak(b["weights"], b["grads"], b["optimizer"], casts, forward, backward,
                                          b["logits"], checkpointing, resident, embedding_grad,
                                          3 * PROBE_MATMUL_GPU ** 2 * act) + buckets
    # sampling's own peak: weights, optimizer state, resident gradients, the KV cache
    if inp.generation:
        rows_g, tokens_g = inp.generation
        b["generation"] = generation_bytes(layers, kv, vocab, rows_g, tokens_g, act,
                                           gathered - gathered // n if s.shard_params else 0)
        b["allocated"] = max(b["allocated"], b["weights"] + b["optimizer"] + (b["grads"] if resident else 0)
                             + b["generation"] + buckets)
    b["total"] = total_bytes(b["allocated"])
    cpu = cpu_bytes(s, params, trainable, n, inp.precision) * inp.gpus_per_node
    # ZeRO-3 / FSDP full gather the parameters in forward and backward, and once more to recompute
    # a checkpointed forward; FSDP grad_op keeps them gathered from forward to the end of backward.
    gathers = (1 if s.name == "fsdp_grad_op" else 2 + checkpointing) if s.shard_params else 0
    # a ring all-reduce of the gradients (or reduce-scatter + all-gather: the same bytes, ZeRO paper
    # sec. 7), and each all-gather of the parameters: a rank sends (n-1)/n of the buffer per pass
    grads_sent = int(ring_factor(n) * trainable * wb)
    comm = grads_sent + int(ring_factor(n) / 2 * gathers * gathered)
    # gradients down, updated weights up
    pcie = 2 * wb * trainable // n if s.offload_optimizer else 0
    # each rank fetches its partition before every gather (DeepSpeed's)
    if s.offload_params:
        pcie += (2 + checkpointing) * model_bytes // n
    # a token's compute: an MoE layer's top-k experts (memory holds them all)
    active = counts.active
    per_token = flops_per_token(active, active if inp.method == "full" else trainable, layers, h, inp.seq_len, False)
    recompute = flops_per_token(active, active if inp.method == "full" else trainable, layers, h, inp.seq_len,
                                True) - per_token if checkpointing else 0
    host = ADAM_STEP_BYTES * trainable // n if s.offload_optimizer else 0
    on_device = 0 if s.offload_optimizer else ADAM_STEP_BYTES * trainable // (n if s.shard_optimizer else 1)
    hw, link = inp.hw, inp.hw.link(n, inp.gpus_per_node)
    # collective calls: DDP's 25 MiB buckets (and its 1 MiB first); DeepSpeed's h*h-element reduce and
    # gather buckets; ZeRO-3 gathers each linear (7 per block), FSDP each block, per pass
    if s.deepspeed:
        grad_calls = 2 * -(-trainable // (h * h))
    elif s.shard_grads:
        grad_calls = layers
    else:
        grad_calls = 1 + -(-grads_sent // DDP_BUCKET)
    # DDP's all-reduce waits for the last accumulated micro-batch; DeepSpeed reduces every one
    traffic = [
        Traffic(grads_sent, link, grad_calls if n > 1 else 0, *(("overlapped_once", "dp_sync") if s.name == "ddp"
                                                                else ("overlapped", "dp"))),
        Traffic(comm - grads_sent, link, layers * gathers * (7 if s.deepspeed else 1) if n > 1 else 0,
                "overlapped", "dp")]
    tokens = rows * inp.seq_len
    per_token += inp.extra_forwards * forward_flops_per_token(active, layers, h, inp.seq_len)
    terms = step_terms(tokens * per_token, inp.precision, traffic, hw, pcie, host, optimizer_bytes=on_device,
                       recompute_flops=tokens * recompute)
    short = shortfall(b["total"], cpu, inp)
    return Candidate(s.name, checkpointing, micro_batch, b, cpu, comm, not short, terms, micro_batch * n, short=short)


def estimate_layout(inp: PlanInput, d: ParallelDims, checkpointing: bool, micro_batch: int) -> Candidate:
    """A composed mesh layout (`toolkit.planner.layouts`): its heaviest pipeline stage's bytes per
    rank, plus buffers (DDP buckets, or FSDP2's gathered block and the next prefetched) and the
    allocator's fragmentation; its slowest rank's step; whether the runtime runs it."""
    # the sequences a forward holds (a pair is two)
    rows = micro_batch * inp.sequences
    stages = [stage_bytes(inp, d, s, checkpointing, rows) for s in range(d.pp)]
    b = max(stages, key=lambda x: sum(x.values()))
    if d.dp_shard > 1:
        # the gathered block in use and the next one prefetched, in the policy's compute dtype (under ep
        # with the rank's E/ep experts)
        buffers = 2 * gathered_bytes_per_param(inp.precision) * gathered_block(inp.model, d)
    else:
        buffers = 2 * DDP_BUCKET
    b["buffers"] = buffers
    b["allocated"] = sum(b.values())
    # sampling's own peak (TP's blocks sampled as cut; FSDP2's parameters gathered once)
    if inp.generation:
        layers, _, _, kv, vocab = _dims(inp.model)
        act = 2 if inp.precision in ("bf16", "fp16") else 4
        whole = gathered_bytes_per_param(inp.precision) * count_params(inp.model).total // (d.tp * d.pp)
        b["generation"] = generation_bytes(layers // d.pp, kv // d.tp, vocab, *inp.generation, act,
                                           whole - whole // d.dp_shard if d.dp_shard > 1 else 0)
        b["allocated"] = max(b["allocated"], b["weights"] + b["optimizer"] + b["grads"] + b["generation"] + buffers)
    b["total"] = total_bytes(b["allocated"])
    hw = inp.hw
    comm = int(sum(t.bytes for t in traffic(inp, d, checkpointing, rows, hw)))
    why = not_runnable(d, inp.method, inp.precision, inp.loss) \
        or next(iter(model_problems(inp.model, d.tp, d.pp, d.cp, d.world_size, inp.method, ep=d.ep)), "") \
        or tree_problems(inp, d)
    terms = mesh_step_terms(inp, d, checkpointing, rows, hw)
    short = shortfall(b["total"], 0, inp)
    return Candidate(layout_name(d), checkpointing, micro_batch, b, 0, comm, not short, terms,
                     micro_batch * d.dp, dims={k: getattr(d, k) for k in (*MESH_DIMS, "ep")}, runnable=not why,
                     why_not=why, short=short)


def tree_problems(inp: PlanInput, d: ParallelDims) -> str:
    """What the run refuses of this layout on the model's module tree (`inp.tree_check`, the run's own
    check handed in by the caller: `toolkit.parallel.tree.tree_problem`), and of an image-text model's (pp, cp and
    ep are one line there: `toolkit.cli.startup`), '' where it runs or nobody asked."""
    if any(inp.vision) and max(d.pp, d.cp, d.ep) > 1:
        return "not yet for image-text models (their layouts are data-parallel and --tp)"
    if inp.tree_check is None:
        return ""
    return ((inp.tree_check(inp.model, "tp") if d.tp > 1 else "")
            or (inp.tree_check(inp.model, "pp") if d.pp > 1 else ""))


def asked_candidate(inp: PlanInput) -> tuple[Candidate | None, str]:
    """The layout the run asks for (`inp.asked`) at its own micro-batch and accumulation, not re-split;
    or None and why it cannot be predicted on this machine (the degrees do not fit its GPUs, the model
    refuses them, or the planner has no model of it)."""
    par, world, gc = inp.asked.layout, inp.gpus_per_node * inp.nodes, inp.asked.checkpointing
    name = strategy_name(par)
    if name is not None:
        if name not in STRATEGIES:
            return None, (f"the planner has no memory model for {name} (--zero-stage {par.zero_stage} "
                          f"--offload {par.offload})")
        c = estimate(inp, STRATEGIES[name], gc, inp.micro_batch)
    elif world == 1 and par.pp > 1:
        return None, (f"--pp {par.pp} in one process (the naive pipeline over --pp-devices) is not predicted; "
                      f"plan it as {par.pp} GPUs with --gpus-per-node {par.pp}")
    else:
        dims, problems = dims_for(par, world, inp.gpus_per_node)
        problems = problems or model_problems(inp.model, dims.tp, dims.pp, dims.cp, world, inp.method, ep=dims.ep)
        if problems:
            return None, f"cannot run on {world} {inp.per}{'s' if world > 1 else ''}: {problems[0]}"
        c = estimate_layout(inp, dims, gc, inp.micro_batch)
    c.set_accumulation(inp.grad_accum)
    c.asked = True
    return c, ""


def reestimate(inp: PlanInput, c: Candidate, micro_batch: int) -> Candidate:
    if c.dims is None:
        return estimate(inp, STRATEGIES[c.name], c.checkpointing, micro_batch)
    return estimate_layout(inp, ParallelDims(inp.gpus_per_node * inp.nodes, **c.dims), c.checkpointing, micro_batch)


def asked_data_ranks(inp: PlanInput) -> int:
    """The ranks that read different examples under the layout asked for: every GPU where none is
    asked or it is a 1-D one, the mesh's data-parallel degree otherwise."""
    world = inp.gpus_per_node * inp.nodes
    if inp.asked is None or strategy_name(inp.asked.layout) is not None:
        return world
    dims, problems = dims_for(inp.asked.layout, world, inp.gpus_per_node)
    return world if problems else dims.dp


