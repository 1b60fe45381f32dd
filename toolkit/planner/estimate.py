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
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable

from toolkit.errors import UserError
from toolkit.layout.dims import MESH_DIMS, ParallelDims, layout_name
from toolkit.layout.rules import (cp_divisibility_problems, dims_for, flags_of, layout_problems, model_problems,
                                  ep_problems, not_runnable, strategy_name, tp_divisibility_problems)
from toolkit.planner.cost import (ADAM_STEP_BYTES, Hardware, Traffic, flops_per_token, forward_flops_per_token,
                                  load_hardware, optimizer_step_seconds, optimizer_step_terms, ring_factor, step_seconds,
                                  step_terms)
from toolkit.planner.layouts import (divisors, gathered_block, loss_bytes, mesh_layouts, mesh_step_terms, stage_bytes,
                                     traffic)
from toolkit.planner.layouts import flags as mesh_flags
from toolkit.planner.memory import (STRATEGIES, Sharding, cpu_bytes,
                                    frozen_bytes_per_param, gathered_bytes_per_param, generation_bytes, grads_bytes,
                                    optimizer_bytes,
                                    weight_bytes_per_param, weights_bytes)
from toolkit.hardware import PROBE_MATMUL_GPU
from toolkit.planner import saved
from toolkit.planner.params import (cast_weights, count_params, head_dim, lora_params, trainable_parts,
                                    with_tp_plan)

GiB = 1024**3
FRAMEWORK_CONTEXT = 1 * GiB  # CUDA context, cuBLAS/cuDNN workspaces, allocator pools (typical H100 run)
DDP_BUCKET = 25 * 1024**2  # torch DDP bucket_cap_mb default
FRAGMENTATION = 0.10  # caching-allocator slack, as a fraction of everything else
TIE = 0.05  # predicted times closer than this are treated as equal
EQUAL = 0.0005  # times closer than this print as +0.0% (`explain.time_against`): the top list keeps them together
TOP = 5  # rows in the top list (`listed`), more where rows as fast as the last one shown follow it
QLORA_BITS = 4.127  # NF4 + double-quantized constants (QLoRA paper, sec. 3: 0.127 bits/param)
ORDER = ["ddp", "zero1", "zero2", "fsdp_grad_op", "zero3", "fsdp_full", "zero2_offload", "zero3_offload",
         "zero3_offload_param"]


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
    cpu_memory: int | None = None  # host RAM per node; None: not checked
    cpu_memory_unknown: bool = False  # cpu_memory is None because nobody said: the plan is for another machine
    method: str = "lora"
    lora_r: int = 16
    lora_targets: str = "all-linear"
    lora_dropout: float = 0.0  # finetune.py's default; > 0 saves a mask per adapted input
    seq_len: int = 2048
    micro_batch: int = 1
    grad_accum: int = 1  # with micro_batch and the GPUs, the global batch asked for (`target_batch`)
    precision: str = "bf16"
    checkpointing: bool | None = None  # None: try without first
    global_batch: int | None = None  # examples per optimizer step (None: micro_batch x grad_accum x GPUs)
    tp: list[int] | None = None  # TP degrees to predict (default: every valid one)
    pp: list[int] | None = None  # pipeline degrees to predict (default: 2 and 4 where they fit the blocks)
    cp: list[int] | None = None  # context-parallel degrees to predict (default: none)
    ep: list[int] | None = None  # expert-parallel degrees to predict (default: every valid one; MoE models only)
    loss: str = "auto"  # the runtime's --loss: auto and chunked never hold (b, s, V) logits, except under pp
    hardware: Hardware | None = None  # the time model's figures (None: the H100 SXM preset)
    asked: Asked | None = None  # the run's own layout (plan --config), evaluated as it is
    device: str = "GPU"  # what each rank runs on: "GPU", or "CPU" (a run without one: memory per process)
    sequences: int = 1  # sequences per example: 2 for a preference pair (chosen and rejected, one micro-batch)
    extra_forwards: int = 0  # no-grad forwards per sequence (`toolkit.config.objectives.extra_forwards`): LoRA DPO's
    # reference (the base model's forward before each policy forward), KTO's KL estimate
    # --objective grpo: (completions a rank samples at once, prompt + completion tokens): the KV cache and what
    # sampling holds (`memory.generation_bytes`), at its own peak beside the training step's
    generation: tuple[int, int] | None = None
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
    terms: dict[str, float]  # seconds of one micro-batch step that ends an optimizer step, by `cost.TERMS`
    examples_per_step: int  # examples one micro-batch step processes over the whole world
    grad_accum: int = 1  # micro-batch steps per optimizer step (set by `split_batch`)
    dims: dict[str, int] | None = None  # the mesh degrees of a composed layout (None: a 1-D strategy)
    runnable: bool = True
    why_not: str = ""  # why the runtime refuses it
    asked: bool = False  # the layout the run's settings ask for (`Asked`), at their batch split
    short: list[str] = field(default_factory=list)  # where it does not fit, what memory is short (`shortfall`)
    step_seconds: float = field(init=False)  # the sum of `terms`
    once_seconds: float = field(init=False)  # its part paid once per optimizer step (`cost.ONCE_TERMS`)
    global_batch: int = field(init=False)  # examples per optimizer step: examples_per_step x grad_accum
    step_time_s: float = field(init=False)  # predicted seconds per optimizer step at grad_accum
    seconds: dict[str, float] = field(init=False)  # step_time_s term by term (`cost.optimizer_step_terms`)

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
    ranking: list[dict[str, Any]] = field(default_factory=list)  # `listed`'s rows, each with why it lost
    hardware: str = ""  # the time model's figures (`cost.Hardware.name`)
    global_batch: int = 0  # examples per optimizer step asked for (`target_batch`)
    batch: str = ""  # how the chosen layout splits the global batch, in one line (`explain.batch_line`)
    why: list[dict[str, Any]] = field(default_factory=list)  # what decided the choice, by rival (`explain.why_chosen`)
    fallbacks: list[dict[str, Any]] = field(default_factory=list)  # `--strategy auto` after an out-of-memory (`fallbacks`)
    asked: Candidate | None = None  # the run's own layout (`Asked`) as predicted; None: none asked, or not predictable
    asked_verdict: str = ""  # one line on it: chosen, does not fit (and why), or cannot run on this machine
    device: str = "GPU"  # `PlanInput.device`
    expert_parallel: str = ""  # an MoE model's best layout with ep against the best without, in one line
    trainable_parts: dict[str, int] = field(default_factory=dict)  # trainable parameters by part (`params.PARTS`)
    memory: str = ""  # the chosen's memory near a limit, or its host RAM unchecked (`explain.memory_line`)
    cpu_memory_unknown: bool = False  # `PlanInput.cpu_memory_unknown`

    def to_json(self) -> dict[str, Any]:
        """Every field; a row's `terms` (one micro-batch step) is left out: `seconds` gives the same
        terms for an optimizer step."""
        out = asdict(self)
        for row in [*out["strategies"], out["chosen_detail"] or {}, out["asked"] or {}]:
            row.pop("terms", None)
        return out


def _dims(cfg: dict[str, Any]) -> tuple[int, int, int, int, int]:
    nkv = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    return cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"], nkv * head_dim(cfg), cfg["vocab_size"]


def offloads(s: Sharding) -> bool:
    return s.offload_optimizer or s.offload_params


def estimate(inp: PlanInput, s: Sharding, checkpointing: bool, micro_batch: int) -> Candidate:
    cfg = inp.model
    counts = count_params(cfg)
    params = counts.total
    trainable = params if inp.method == "full" else lora_params(cfg, inp.lora_r, inp.lora_targets)
    frozen = 0 if inp.method == "full" else params
    n = inp.gpus_per_node * inp.nodes
    layers, h, i, kv, vocab = _dims(cfg)
    act = 2 if inp.precision in ("bf16", "fp16") else 4
    if inp.method == "qlora":  # peft's prepare_model_for_kbit_training keeps the unquantized rest in fp32
        linear = counts.linear  # bitsandbytes quantizes the nn.Linear weights, not stacked experts
        weights = int(linear * QLORA_BITS / 8) + 4 * (params - linear) + 4 * trainable
    else:
        weights = weights_bytes(s, frozen, trainable, n, inp.precision)
    wb = weight_bytes_per_param(s, inp.precision)
    rows = micro_batch * inp.sequences  # the sequences a forward holds (a pair is two)
    forward, backward, casts = activation_terms(inp, rows, checkpointing, wb, trainable, s.fsdp)
    b = {
        "weights": weights,
        "grads": grads_bytes(s, trainable, n, inp.precision),
        "optimizer": optimizer_bytes(s, trainable, n),
        "autocast_copies": casts,
        "activations": forward + backward,
        "logits": loss_bytes(inp, rows, vocab, h, act),
    }
    model_bytes = frozen_bytes_per_param(inp.precision) * frozen + wb * trainable  # the whole model, once
    # what a sharded layout all-gathers: FSDP2 in its policy's compute dtype, ZeRO-3 as DeepSpeed holds it
    gathered = gathered_bytes_per_param(inp.precision) * params if s.fsdp else model_bytes
    block = gathered * counts.per_block // max(params, 1)
    buckets = DDP_BUCKET * 2 if not s.deepspeed and not s.shard_params and n > 1 else 0  # one process: no DDP
    if s.deepspeed:
        buckets += 2 * 4 * h * h  # reduce bucket (h*h, fp32) double-buffered
    if s.name == "fsdp_grad_op":  # every block stays gathered from its forward until its backward
        buckets += gathered - gathered // n
    elif s.shard_params:
        buckets += 2 * block  # the gathered block in use + the next one prefetched
    # one process (no DDP buckets) frees its gradients after each step; DDP's buckets and DeepSpeed's
    # partitions keep gradient-sized buffers through the next forward
    resident = s.deepspeed or n > 1
    embedding_grad = 4 * vocab * h if inp.method == "full" else 0
    b["buffers"] = buckets
    b["allocated"] = saved.allocated_peak(b["weights"], b["grads"], b["optimizer"], casts, forward, backward, b["logits"],
                                          checkpointing, resident, embedding_grad, 3 * PROBE_MATMUL_GPU ** 2 * act) + buckets
    if inp.generation:  # sampling's own peak: weights, optimizer state, resident gradients, the KV cache
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
    pcie = 2 * wb * trainable // n if s.offload_optimizer else 0  # gradients down, updated weights up
    if s.offload_params:  # each rank fetches its partition before every gather (DeepSpeed's)
        pcie += (2 + checkpointing) * model_bytes // n
    active = counts.active  # a token's compute: an MoE layer's top-k experts (memory holds them all)
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
    traffic = [  # DDP's all-reduce waits for the last accumulated micro-batch; DeepSpeed reduces every one
        Traffic(grads_sent, link, grad_calls if n > 1 else 0, *(("overlapped_once", "dp_sync") if s.name == "ddp"
                                                                else ("overlapped", "dp"))),
        Traffic(comm - grads_sent, link, layers * gathers * (7 if s.deepspeed else 1) if n > 1 else 0, "overlapped", "dp")]
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
    rows = micro_batch * inp.sequences  # the sequences a forward holds (a pair is two)
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
    if inp.generation:  # sampling's own peak (TP's blocks sampled as cut; FSDP2's parameters gathered once)
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
    check handed in by the caller: `toolkit.parallel.tree.tree_problem`), '' where it runs or nobody asked."""
    if inp.tree_check is None:
        return ""
    return (inp.tree_check(inp.model, "tp") if d.tp > 1 else "") or (inp.tree_check(inp.model, "pp") if d.pp > 1 else "")


def asked_candidate(inp: PlanInput) -> tuple[Candidate | None, str]:
    """The layout the run asks for (`inp.asked`) at its own micro-batch and accumulation, not re-split;
    or None and why it cannot be predicted on this machine (the degrees do not fit its GPUs, the model
    refuses them, or the planner has no model of it)."""
    par, world, gc = inp.asked.layout, inp.gpus_per_node * inp.nodes, inp.asked.checkpointing
    name = strategy_name(par)
    if name is not None:
        if name not in STRATEGIES:
            return None, f"the planner has no memory model for {name} (--zero-stage {par.zero_stage} --offload {par.offload})"
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


def planned_strategies(inp: PlanInput) -> list[str]:
    """The strategies worth predicting: those the runtime runs with this method and precision
    (`toolkit.layout.rules`: QLoRA's 4-bit base can be neither sharded by parameter nor offloaded);
    on one GPU ZeRO and FSDP shard over a single rank (nothing saved, DeepSpeed's or FSDP's overhead
    paid), so only DDP and the CPU-offload variants remain."""
    world = inp.gpus_per_node * inp.nodes
    out = []
    for name in ORDER:
        s = STRATEGIES[name]
        if layout_problems(flags_of(name), inp.method, inp.precision, inp.loss, inp.micro_batch):
            continue
        if world == 1 and s.shard_optimizer and not offloads(s):
            continue
        out.append(name)
    return out


def simplicity(c: Candidate) -> tuple[int, ...]:
    """Which of two equally fast candidates to prefer: the 1-D strategies in ORDER, then mesh
    layouts with fewer and smaller model-parallel degrees, ep among them and, at equal degrees, the
    one without ep (its predicted time assumes a balanced router)."""
    if c.dims is None:
        return (0, ORDER.index(c.name))
    d = c.dims
    return (1 + sum(v > 1 for v in d.values()), d["pp"] * d["cp"] * d["tp"] * d.get("ep", 1), d.get("ep", 1))


def offloads_row(c: Candidate) -> bool:
    return c.dims is None and offloads(STRATEGIES[c.name])


def rank_key(c: Candidate, target: int) -> tuple:
    """Runnable and fits first, then the global batch asked for (`target`), then no CPU offload, then
    the least predicted time per example; ties go to the simpler layout (`simplicity`)."""
    return (not (c.fits and c.runnable), c.global_batch != target, offloads_row(c), c.seconds_per_example,
            simplicity(c))


def tie_key(c: Candidate) -> tuple:
    """Which of the rows within `TIE` of the fastest `choose` prefers: the simpler (`simplicity`),
    then the one without checkpointing, then the faster. The last decides between equally simple
    layouts (cp2_dp_shard4 and tp2_dp_shard4), which the order the search listed them in once did:
    a 1.6% slower row was chosen for coming first, which told the reader nothing."""
    return simplicity(c), c.checkpointing, c.seconds_per_example


def choose(rows: list[Candidate], target: int) -> Candidate:
    """The first by `rank_key`, except that predictions within `TIE` of the fastest count as equal
    (the time model is not that accurate) and the first among them by `tie_key` wins."""
    best = min(rows, key=lambda c: rank_key(c, target))
    near = [c for c in rows if rank_key(c, target)[:3] == rank_key(best, target)[:3]
            and c.seconds_per_example <= (1 + TIE) * best.seconds_per_example]
    return min(near, key=tie_key)


def time_ratio(c: Candidate, chosen: Candidate) -> float:
    """`c`'s predicted time per example over the chosen's, less 1: + where `c` is slower. Every line
    that compares two rows (the ranking, why:, ep:, asked:) takes it from here, in this direction, and
    prints it with `time_against`: a plan once said +16% on one line and -14.0% on the next for the
    same two rows (each right, from either side), which read as two comparisons."""
    return c.seconds_per_example / chosen.seconds_per_example - 1


def same_time(c: Candidate, other: Candidate) -> bool:
    """Predicted times per example the plan prints as equal: `time_against` reads +0.0% or -0.0%."""
    return abs(time_ratio(c, other)) < EQUAL


def listed(best: Candidate, ranked: list[Candidate]) -> list[Candidate]:
    """The rows of the top list, in its order. Where a layout is chosen: it first (the plan's answer
    is the line a reader looks for); then the other rows that run and fit, those as fast as it
    (`same_time`) next to it, then the rest in the plan's order (`ranked`, by `rank_key`), to `TOP`
    rows, a row as fast as the last one shown kept with it. Issue 64: the chosen stood fifth under
    faster rows it did not choose, fsdp_full, as fast as the chosen zero3, was cut off below them,
    and a row that does not fit filled a place the table already says it cannot have. Where nothing
    fits: the first `TOP` in the plan's order, the nearest to a choice among them."""
    if not (best.fits and best.runnable):
        rest = [c for c in ranked if c is not best][:TOP - 1]
        return [c for c in ranked if c is best or any(c is x for x in rest)]
    others = [c for c in ranked if c is not best and c.fits and c.runnable]
    top = [best] + [c for c in others if same_time(c, best)]
    for c in others:
        if any(c is x for x in top):
            continue
        if len(top) >= TOP and not same_time(c, top[-1]):
            break
        top.append(c)
    return top


def target_batch(inp: PlanInput) -> int:
    """Examples per optimizer step the user asked for: `--global-batch`, else what their flags give
    under plain data parallelism over every GPU (micro-batch x accumulation x GPUs), which is what
    finetune.py runs with those flags and no layout flags, or under the layout a run's settings ask
    for (`asked_data_ranks`). Always set (the flags have defaults), so the plan never invents a batch
    size."""
    return inp.global_batch or inp.micro_batch * inp.grad_accum * asked_data_ranks(inp)


def rank_share(target: int, ranks: int) -> int:
    """Examples each of `ranks` data-parallel ranks takes per optimizer step: target / ranks, or,
    where the ranks do not divide the target (only a `--global-batch` can do that), the share of the
    nearest multiple of `ranks` (halfway rounds up), and at least one example each."""
    return max(1, (2 * target + ranks) // (2 * ranks))


def split_batch(inp: PlanInput, c: Candidate, target: int) -> Candidate:
    """`c` at the split of the global batch it runs best: micro-batch m x accumulation share / m on
    each of its data-parallel ranks (`rank_share`), m a divisor of the share, so the examples per
    optimizer step stay the target. A layout with fewer data-parallel ranks (tp, pp, cp) gets a
    larger share. It starts from the micro-batch asked for (the largest divisor of the share not
    above it); a larger m is taken where it fits and is predicted more than `TIE` faster per example
    (per-micro-batch costs shared by more examples: DeepSpeed's reductions, ZeRO-3/FSDP gathers,
    offload traffic, the pipeline bubble), a smaller one where the one asked for does not fit. A
    pipeline runs one pipeline micro-batch per example (`layouts.pipeline_schedule`), so
    `--pp-microbatches` always divides the micro-batch. A layout that fits at no split is returned at
    micro-batch 1, where it is smallest; one the runtime refuses, at the micro-batch asked for."""
    share = rank_share(target, c.data_ranks)
    options = divisors(share)
    asked = max(m for m in options if m <= inp.micro_batch)

    def at(m: int) -> Candidate:
        x = c if m == c.micro_batch else reestimate(inp, c, m)
        x.set_accumulation(share // m)
        return x

    if not c.runnable:
        return at(asked)
    fitting = []
    for m in options:  # memory grows with the micro-batch
        x = at(m)
        if not x.fits:
            if not fitting:
                return x  # micro-batch 1
            break
        fitting.append(x)
    start = next((x for x in fitting if x.micro_batch == asked), fitting[-1])
    fastest = min(fitting, key=lambda x: x.seconds_per_example)
    return fastest if fastest.seconds_per_example * (1 + TIE) < start.seconds_per_example else start


def fallbacks(inp: PlanInput, chosen: Candidate, rows: list[Candidate], target: int) -> list[Candidate]:
    """What `--strategy auto` runs after an out-of-memory in its first steps, in order: the
    chosen layout with gradient checkpointing on; then its micro-batch made smaller, the accumulation
    larger (the global batch kept), down to 1; then the layouts of the plan that hold less per GPU in
    weights, gradients and optimizer state (sharded or offloaded), at their smallest (checkpointing,
    micro-batch 1), best first."""
    world = inp.gpus_per_node * inp.nodes

    def at(c: Candidate, m: int) -> Candidate:
        x = estimate(inp, STRATEGIES[c.name], True, m) if c.dims is None else \
            estimate_layout(inp, ParallelDims(world, **c.dims), True, m)
        x.set_accumulation(rank_share(target, c.data_ranks) // m)
        return x

    out = [] if chosen.checkpointing else [at(chosen, chosen.micro_batch)]
    share = rank_share(target, chosen.data_ranks)
    out += [at(chosen, m) for m in sorted(divisors(share), reverse=True) if m < chosen.micro_batch]

    def states(c: Candidate) -> int:
        return c.bytes["weights"] + c.bytes["grads"] + c.bytes["optimizer"]

    smaller = [at(r, 1) for r in rows if r.checkpointing and r.runnable and states(r) < states(chosen)]
    return out + sorted(smaller, key=lambda c: rank_key(c, target))


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


@dataclass
class Search:
    """What `search` found, before a word is said about it (`toolkit.planner.explain.plan` says them)."""
    result: Plan  # its numbers: every row and, where one fits, the chosen, its split and its flags; no words yet
    inp: PlanInput  # as planned: the model with its config class's TP plan (`with_tp_plan`)
    names: list[str]  # the 1-D strategies predicted (`planned_strategies`)
    rows: list[Candidate]  # every row at its split of the global batch, the layout asked for among them
    best: Candidate  # the choice (`choose`, or the layout asked for where it fits); where nothing fits, the nearest
    ranked: list[Candidate]  # the rows by `rank_key`
    unpredicted: str  # why the layout asked for was not predicted ('' where it was, or none was asked)
    fallbacks: list[Candidate] = field(default_factory=list)  # what --strategy auto runs after an out-of-memory


def search(inp: PlanInput) -> Search:
    """Predict every layout (`estimate`, `estimate_layout`), each at its split of the global batch
    (`split_batch`), and choose one (`choose`; the layout a run asks for where it fits and runs): the
    Plan's numbers, its flags and its fallbacks. Raises UserError on input no layout can take."""
    problems = []
    if inp.gpus_per_node < 1 or inp.nodes < 1:
        problems.append("--gpus-per-node and --nodes must be >= 1")
    if inp.seq_len < 1 or inp.micro_batch < 1 or inp.grad_accum < 1:
        problems.append("--seq-len, --micro-batch-size and --grad-accum must be >= 1")
    if inp.global_batch is not None and inp.global_batch < 1:
        problems.append(f"--global-batch must be >= 1 (got {inp.global_batch})")
    if inp.method not in ("full", "lora", "qlora"):
        problems.append(f"--method must be full, lora or qlora (got {inp.method})")
    if problems:
        raise UserError("; ".join(problems))
    world = inp.gpus_per_node * inp.nodes
    if world > 1:  # --tp may be planned: the run's rules read the config class's TP plan (`with_tp_plan`)
        inp = replace(inp, model=with_tp_plan(inp.model))
    for t in inp.tp or []:
        check_tp(inp.model, t, inp.gpus_per_node, world)
    for p in inp.pp or []:
        if p < 2 or p > inp.model["num_hidden_layers"] or world % p:
            raise UserError(f"--pp {p}: needs 2 <= stages <= blocks ({inp.model['num_hidden_layers']}) and "
                            f"to divide the world size ({world})")
    for c in inp.cp or []:
        check_cp(inp.model, c, world)
    for e in inp.ep or []:
        check_ep(inp.model, e, world)
    names = planned_strategies(inp)
    gc_options = [inp.checkpointing] if inp.checkpointing is not None else [False, True]
    rows = [estimate(inp, STRATEGIES[n], gc, inp.micro_batch) for gc in gc_options for n in names]
    layouts = [] if inp.method == "qlora" else mesh_layouts(inp.model, world, inp.gpus_per_node, inp.tp, inp.pp, inp.cp,
                                                             inp.ep)
    rows += [estimate_layout(inp, d, gc, inp.micro_batch) for gc in gc_options for d in layouts]
    target = target_batch(inp)
    rows = [split_batch(inp, r, target) for r in rows]
    asked, unpredicted = asked_candidate(inp) if inp.asked else (None, "")
    if asked is not None:  # the search's row of the same layout at the same split is this one
        same = (asked.name, asked.dims, asked.checkpointing, asked.micro_batch, asked.grad_accum)
        rows = [r for r in rows if (r.name, r.dims, r.checkpointing, r.micro_batch, r.grad_accum) != same] + [asked]
    counts = count_params(inp.model)
    trainable = counts.total if inp.method == "full" else lora_params(inp.model, inp.lora_r, inp.lora_targets)
    result = Plan(counts.total, trainable, world, rows, None, gpu_memory=inp.gpu_memory, cpu_memory=inp.cpu_memory,
                  hardware=inp.hw.name, global_batch=target, asked=asked, device=inp.device,
                  trainable_parts=trainable_parts(inp.model, inp.method, inp.lora_r, inp.lora_targets),
                  cpu_memory_unknown=inp.cpu_memory_unknown)
    best = choose([r for r in rows if r is not asked], target)
    if asked is not None and asked.fits and asked.runnable:
        best = asked
    ranked = sorted(rows, key=lambda c: rank_key(c, target))
    if not (best.fits and best.runnable):
        return Search(result, inp, names, rows, best, ranked, unpredicted)
    result.chosen, result.chosen_detail, result.grad_accum = best.name, best, best.grad_accum
    if best.dims is None:
        result.flags = flags_for(best.name, best.checkpointing, best.micro_batch, result.grad_accum, inp.method)
    else:
        result.flags = (["--method", inp.method] + mesh_flags(ParallelDims(world, **best.dims), best.micro_batch)
                        + (["--gradient-checkpointing"] if best.checkpointing else [])
                        + ["--micro-batch-size", str(best.micro_batch), "--grad-accum", str(result.grad_accum)])
    return Search(result, inp, names, rows, best, ranked, unpredicted, fallbacks(inp, best, rows, target))
