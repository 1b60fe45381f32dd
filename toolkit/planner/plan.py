"""Predict per-GPU memory and step time for every layout the toolkit runs, and pick the one to run.

The candidates: the 1-D strategies (DDP, ZeRO-1/2/3 and offloads, FSDP; `memory.STRATEGIES`, this
module's `estimate`) and every device-mesh layout pp x dp_replicate x dp_shard x cp x tp, an MoE
model's also with each expert-parallel degree (`layouts.mesh_layouts`, `estimate_layout`), each with
and without gradient checkpointing, each at the split of the global batch it runs best
(`split_batch`: the batch the user asked for is kept, only its division into micro-batch x
accumulation x data-parallel ranks changes). Order
(docs/planner.md): runnable and fits (GPU memory and host RAM) > keeps the global batch > no CPU
offload > the least predicted time per example (`cost.step_terms`) > the simpler layout. Each choice
names the term of the time or memory model that decided it (`decision`), and for an MoE model one
line says why expert parallel wins or loses (`expert_parallel_line`). Every line that compares two
rows prints one number in one direction, the other's time per example against the chosen's
(`time_against`); the top list (`listed`) is the chosen, the rows as fast as it, then the others that
fit in the order above; a choice within `HEADROOM` of a memory limit says what it leaves
(`memory_line`). On one GPU nothing is sharded: only DDP and the offload variants are planned.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable

from toolkit.errors import UserError
from toolkit.layout.dims import MESH_DIMS, ParallelDims, layout_name
from toolkit.layout.rules import (cp_divisibility_problems, dims_for, flags_of, layout_problems, model_problems,
                                  ep_problems, not_runnable, num_experts, strategy_name, tp_divisibility_problems)
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
from toolkit.planner.params import (cast_weights, count_params, head_dim, lora_layer_params, lora_params,
                                    trainable_parts, with_tp_plan)

GiB = 1024**3
FRAMEWORK_CONTEXT = 1 * GiB  # CUDA context, cuBLAS/cuDNN workspaces, allocator pools (typical H100 run)
DDP_BUCKET = 25 * 1024**2  # torch DDP bucket_cap_mb default
FRAGMENTATION = 0.10  # caching-allocator slack, as a fraction of everything else
TIE = 0.05  # predicted times closer than this are treated as equal
EQUAL = 0.0005  # times closer than this print as +0.0% (`time_against`): the top list keeps them together
TOP = 5  # rows in the top list (`listed`), more where rows as fast as the last one shown follow it
HEADROOM = 0.05  # a choice that leaves less than this fraction of a memory limit says so (`memory_line`)
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
    batch: str = ""  # how the chosen layout splits the global batch, in one line (`batch_line`)
    why: list[dict[str, Any]] = field(default_factory=list)  # what decided the choice (`decision`), against whom
    fallbacks: list[dict[str, Any]] = field(default_factory=list)  # `--strategy auto` after an out-of-memory (`fallbacks`)
    asked: Candidate | None = None  # the run's own layout (`Asked`) as predicted; None: none asked, or not predictable
    asked_verdict: str = ""  # one line on it: chosen, does not fit (and why), or cannot run on this machine
    device: str = "GPU"  # `PlanInput.device`
    expert_parallel: str = ""  # an MoE model's best layout with ep against the best without, in one line
    trainable_parts: dict[str, int] = field(default_factory=dict)  # trainable parameters by part (`params.PARTS`)
    memory: str = ""  # the chosen's memory within `HEADROOM` of a limit, or its host RAM unchecked (`memory_line`)
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


def reestimate(inp: PlanInput, c: Candidate, micro_batch: int) -> Candidate:
    if c.dims is None:
        return estimate(inp, STRATEGIES[c.name], c.checkpointing, micro_batch)
    return estimate_layout(inp, ParallelDims(inp.gpus_per_node * inp.nodes, **c.dims), c.checkpointing, micro_batch)


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


MEMORY_TERMS = ("weights", "grads", "optimizer", "autocast_copies", "activations", "logits", "buffers")
TERM_TEXT = {  # `cost.TERMS`, as a user reads them
    "compute": "compute (under pp, the largest stage's)",
    "recompute": "recomputing the forward under gradient checkpointing",
    "pp_bubble": "the pipeline bubble",
    "tp": "tensor-parallel all-reduces",
    "cp": "context-parallel all-to-alls",
    "ep": "expert-parallel all-to-alls",
    "pp": "sends between pipeline stages",
    "dp": "data-parallel traffic not hidden behind compute (gradient reduction, parameter gathers)",
    "dp_sync": "the gradient all-reduce at the optimizer step",
    "offload": "PCIe traffic to and from the host (offload)",
    "optimizer": "the optimizer step",
}


def full_logits_fit(inp: PlanInput, c: Candidate) -> bool:
    """Whether `c` still fits with the loss on full (B, T, V) fp32 logits instead of a chunk's: then no
    chunk loop can be faster on a GPU (`toolkit.objectives.sft.loss.choose_loss`). Estimated again, because the loss
    buffers do not add linearly into the allocator peak (`saved.allocated_peak`)."""
    import dataclasses

    return reestimate(dataclasses.replace(inp, loss="full"), c, c.micro_batch).fits


def fallbacks(inp: PlanInput, chosen: Candidate, rows: list[Candidate], target: int) -> list[Candidate]:
    """What `--strategy auto` runs after an out-of-memory in its first steps, in order (issue 34): the
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


def fallback_record(c: Candidate, chosen: Candidate, inp: PlanInput) -> dict[str, Any]:
    """A fallback as plan.json keeps it: what changes, in words and as finetune.py's flags."""
    world = inp.gpus_per_node * inp.nodes
    if (c.name, c.dims) != (chosen.name, chosen.dims):
        what = f"{c.name} with gradient checkpointing (less held per {inp.per})"
    elif not chosen.checkpointing and c.micro_batch == chosen.micro_batch:
        what = "gradient checkpointing on"
    else:
        what = f"micro-batch {c.micro_batch} x accumulation {c.grad_accum} with gradient checkpointing (the global batch kept)"
    flags = flags_for(c.name, True, c.micro_batch, c.grad_accum, inp.method) if c.dims is None else \
        (["--method", inp.method] + mesh_flags(ParallelDims(world, **c.dims), c.micro_batch)
         + ["--gradient-checkpointing", "--micro-batch-size", str(c.micro_batch), "--grad-accum", str(c.grad_accum)])
    return {"what": what, "name": c.name, "dims": c.dims, "checkpointing": True, "micro_batch": c.micro_batch,
            "grad_accum": c.grad_accum, "gib_per_gpu": round(c.bytes["total"] / GiB, 2), "flags": flags}


PART_WORDS = {"attention": "attention", "mlp": "MLP", "experts": "routed experts", "router": "routers",
              "norms": "norms", "embeddings": "embeddings", "lm_head": "LM head"}


def parts_line(p: Plan) -> str:
    """Where the trainable parameters sit (`params.trainable_parts`), each with its share: the
    header's one total says nothing of whether attention or a thousand experts train."""
    total = sum(p.trainable_parts.values()) or 1
    return "trainable by part: " + ", ".join(
        f"{PART_WORDS[k]} {n:,} ({f'{n / total:.1%}' if n >= total / 1000 else 'under 0.1%'})"
        for k, n in p.trainable_parts.items())


def fits_word(c: Candidate, p: Plan) -> str:
    """The table's fits column: yes; no and what is short (`Candidate.short`), so an offload row that
    fits the GPU says it is host RAM; RAM? where it fits the GPU, needs host RAM and none was checked."""
    if not c.fits:
        return "no: " + "+".join({"gpu": "GPU" if p.device == "GPU" else "memory", "host_ram": "RAM"}[k]
                                 for k in c.short)
    return "yes, RAM?" if c.cpu_bytes_per_node and p.cpu_memory is None else "yes"


def label(c: Candidate) -> str:
    return c.name + (" +gc" if c.checkpointing else "") + (" (asked)" if c.asked else "")


def gib(n: int) -> str:
    """Bytes as the plan prints them everywhere (table, reasons, advice): GiB to two decimals, so a
    figure said twice reads the same."""
    return f"{n / GiB:.2f}"


def smaller_because(c: Candidate, term: str, inp: PlanInput) -> str:
    """Why a mesh layout's activations (`term`) are smaller per rank, in its degrees' words ('' otherwise)."""
    if term != "activations" or c.dims is None:
        return ""
    d = c.dims
    parts = [f"cp {d['cp']} gives each rank {-(-inp.seq_len // d['cp']):,} of the {inp.seq_len:,} tokens"] * (d["cp"] > 1)
    parts += [f"tp {d['tp']} splits each block's attention and MLP"] * (d["tp"] > 1)
    parts += [f"each of pp {d['pp']} stages holds 1/{d['pp']} of the blocks"] * (d["pp"] > 1)
    ep, experts = d.get("ep", 1), num_experts(inp.model)
    if ep > 1 and inp.method != "full" and sum(lora_layer_params(inp.model, inp.lora_r, inp.lora_targets,
                                                                 experts_only=True)):
        parts.append(f"ep {ep} merges LoRA into {experts // ep} of the {experts} experts of each layer")
    return "; ".join(parts)


def time_ratio(c: Candidate, chosen: Candidate) -> float:
    """`c`'s predicted time per example over the chosen's, less 1: + where `c` is slower. Every line
    that compares two rows (the ranking, why:, ep:, asked:) takes it from here, in this direction, and
    prints it with `time_against`: a plan once said +16% on one line and -14.0% on the next for the
    same two rows (each right, from either side), which read as two comparisons."""
    return c.seconds_per_example / chosen.seconds_per_example - 1


def time_against(c: Candidate, chosen: Candidate) -> str:
    """`time_ratio` in words, at one rounding wherever it is printed."""
    return f"{time_ratio(c, chosen):+.1%} predicted time per example against the chosen"


def memory_line(inp: PlanInput, chosen: Candidate, ranked: list[Candidate]) -> str:
    """One line where the chosen's memory needs a word ('' otherwise): within `HEADROOM` of the GPU's
    (or the host RAM's) limit, what it leaves, since the memory model is an estimate and a run that
    fits by 1% may not, and the first row of its rank that leaves more with what that costs; its CPU
    offload's host RAM where nothing checked it (`cpu_memory` None)."""
    parts, gpu, total = [], inp.gpu_memory, chosen.bytes["total"]
    if gpu - total < HEADROOM * gpu:
        text = (f"{gib(total)} of {gpu / GiB:.0f} GiB per {inp.per}: {gib(gpu - total)} GiB headroom, within "
                f"{HEADROOM:.0%} of the limit")
        key = rank_key(chosen, target_batch(inp))[:3]
        roomier = next((c for c in ranked if rank_key(c, target_batch(inp))[:3] == key
                        and gpu - c.bytes["total"] >= HEADROOM * gpu), None)
        if roomier is not None:
            text += (f"; {label(roomier)} leaves {gib(gpu - roomier.bytes['total'])} GiB at "
                     f"{time_against(roomier, chosen)}")
        parts.append(text)
    ram, cpu = inp.cpu_memory, chosen.cpu_bytes_per_node
    if cpu and ram is None:
        parts.append(f"CPU offload needs {gib(cpu)} GiB of host RAM per node, not checked"
                     + (" (host RAM unknown: --cpu-memory SIZE)" if inp.cpu_memory_unknown else ""))
    elif cpu and ram - cpu < HEADROOM * ram:
        parts.append(f"host RAM {gib(cpu)} of {ram / GiB:.0f} GiB per node: {gib(ram - cpu)} GiB headroom, "
                     f"within {HEADROOM:.0%} of the limit")
    return "; ".join(parts)


def ep_of(c: Candidate) -> int:
    """The row's expert-parallel degree (1: none, or a 1-D strategy)."""
    return (c.dims or {}).get("ep", 1)


def less_or_more(x: float, text: str) -> str:
    """'`text` less' for x < 0, else '`text` more', `text` formatting |x| ('{:.2f} GiB' -> '1.20 GiB less')."""
    return f"{text.format(abs(x))} {'less' if x < 0 else 'more'}"


def expert_parallel_line(inp: PlanInput, rows: list[Candidate], best: Candidate) -> str:
    """Why the best layout with ep wins or loses against the best without, in one line ('' where no
    row has ep > 1: a dense model): one of the two is the chosen `best`, the other the best of its kind
    (`choose`); their time per example; then what ep itself changes against the same layout, split
    and checkpointing without ep: each block gathers E/ep of the E experts (`layouts.gathered_block`),
    so the gathered transient and LoRA's merged experts (`saved.moe_merged`) shrink, and so does the
    data-parallel traffic (`layouts.traffic`), against the all-to-alls ep adds
    (`cost.expert_all_to_all_bytes`), per optimizer step."""
    with_ep = [c for c in rows if ep_of(c) > 1]
    if not with_ep:
        return ""
    target = target_batch(inp)
    e = best if ep_of(best) > 1 else choose(with_ep, target)
    n = best if ep_of(best) == 1 else choose([c for c in rows if ep_of(c) == 1], target)
    other = n if e is best else e
    tie = (f", within {TIE:.0%}" + (": the simpler layout wins" if simplicity(best) < simplicity(other) else "")
           if abs(time_ratio(other, best)) <= TIE else "")
    if e is best and not (n.fits and n.runnable):
        verdict = f"{label(e)} is chosen: no layout without ep fits"
    elif e is best:
        verdict = f"{label(e)} is chosen; {label(n)}, the best without ep: {time_against(n, e)}{tie}"
    elif not (e.fits and e.runnable):
        verdict = f"no layout with ep fits ({label(e)}: {gib(e.bytes['total'])} GiB per {inp.per})"
    else:
        verdict = f"{label(e)}, the best with ep: {time_against(e, n)}{tie}"
    d = ParallelDims(inp.gpus_per_node * inp.nodes, **e.dims)
    twin = estimate_layout(inp, replace(d, ep=1), e.checkpointing, e.micro_batch)
    twin.set_accumulation(e.grad_accum)
    experts = num_experts(inp.model)
    diff = {k: (e.bytes[k] - twin.bytes[k]) / GiB for k in ("buffers", "activations")}
    changes = [less_or_more(diff["buffers"], "{:.2f} GiB") + " gathered"]
    changes += [less_or_more(diff["activations"], "{:.2f} GiB") + " activations (LoRA's merged experts)"] \
        * (abs(diff["activations"]) >= 0.01)
    changes += [less_or_more(e.seconds["dp"] - twin.seconds["dp"], "{:.2g} s") + " data-parallel traffic",
                f"{e.seconds['ep']:.2g} s of all-to-all added per optimizer step"]
    return (f"{verdict}; against {label(twin)} it gathers {experts // d.ep} of {experts} experts per block: "
            + ", ".join(changes[:-1]) + f" and {changes[-1]}")


def decision(c: Candidate, chosen: Candidate, inp: PlanInput, rows: list[Candidate]) -> tuple[str, str | None]:
    """Why `chosen` ranks before `c`, in a few words, and the term that decided it: a key of `bytes`
    where `c` does not fit, of `seconds` (`cost.TERMS`) where the two differ in time; None where a
    rule decided (runnable, host RAM, the global batch, offload, a tie within `TIE`). `chosen` is
    the fastest within `TIE` unless it is the layout a run asks for (`Candidate.asked`), which is
    kept where it fits: then `c` may be the faster, and the text says by how much and why."""
    ok = chosen.fits and chosen.runnable
    target = target_batch(inp)
    if c is chosen and ok:
        return "chosen" + (", the layout asked for" if c.asked else ""), None
    if not c.runnable:
        return f"not runnable yet: {c.why_not}", None
    if c.bytes["total"] > inp.gpu_memory:
        text = f"does not fit: {gib(c.bytes['total'])} GiB per {inp.per} at micro-batch {c.micro_batch}"
        if not ok:
            return text, None
        term = max(MEMORY_TERMS, key=lambda k: c.bytes[k] - chosen.bytes[k])
        because = smaller_because(chosen, term, inp)
        return (f"{text}, {term} {gib(c.bytes[term])} GiB where the chosen holds {gib(chosen.bytes[term])}"
                + (f" ({because})" if because else "")), term
    if not c.fits:
        return f"needs {gib(c.cpu_bytes_per_node)} GiB of host RAM per node", None
    if c.global_batch != target and chosen.global_batch == target:
        return (f"its {c.data_ranks} data-parallel ranks cannot share the global batch of {target} evenly "
                f"(nearest: {c.global_batch})"), None
    if offloads_row(c) and not offloads_row(chosen):
        return "CPU offload: host RAM and PCIe traffic, only when nothing else fits", None
    ratio = time_ratio(c, chosen)
    if ratio <= TIE and (ratio >= -TIE or not chosen.asked):
        return (f"{time_against(c, chosen)}, within {TIE:.0%}: "
                + ("the layout asked for stays" if chosen.asked else preferred(chosen, c, rows, target))), None
    scale = chosen.global_batch / c.global_batch  # per optimizer step of the chosen's global batch
    diff = {k: c.seconds[k] * scale - chosen.seconds[k] for k in chosen.seconds}
    term = (max if ratio > 0 else min)(diff, key=diff.get)  # what makes it slower, or faster
    text = (f"{time_against(c, chosen)}, mostly {TERM_TEXT[term]} ({diff[term]:+.2g} s per "
            f"optimizer step of {chosen.global_batch} examples)")
    twin = next((x for x in rows if x.name == c.name and not x.checkpointing), None)
    if ratio > 0 and term == "recompute" and not chosen.checkpointing and twin is not None and not twin.fits:
        because = smaller_because(chosen, "activations", inp)
        text += (f", which {c.name} needs to fit ({gib(twin.bytes['total'])} GiB per {inp.per} without it at "
                 f"micro-batch {twin.micro_batch}, activations {gib(twin.bytes['activations'])} GiB) and the "
                 f"chosen does not (activations {gib(chosen.bytes['activations'])} GiB"
                 + (f": {because})" if because else ")"))
    return text, term


def preferred(chosen: Candidate, c: Candidate, rows: list[Candidate], target: int) -> str:
    """Why `choose` took the chosen over `c`, a row within `TIE` of it, in words: what makes the chosen
    first by `tie_key`; or, where `c` is first by it, that `c` is more than `TIE` slower than the
    fastest row and so out of the tie. "The simpler layout wins" once said it for two layouts equally
    simple, and for a faster one that was not simpler."""
    if tie_key(c) < tie_key(chosen):
        fastest = min(rows, key=lambda r: rank_key(r, target))
        return f"{label(c)} is the simpler, but more than {TIE:.0%} slower than the fastest, {label(fastest)}"
    a, b = simplicity(chosen), simplicity(c)
    if a == b:
        if c.checkpointing != chosen.checkpointing:
            return "the chosen needs no gradient checkpointing"
        return "as simple as the chosen" + (", and slower" if time_ratio(c, chosen) > 0 else ": the chosen was found first")
    if a[0] == b[0] == 0:
        return f"{c.name} comes after the chosen in the 1-D order ({', '.join(ORDER[a[1]:b[1] + 1])})"
    if a[0] == 0:
        return f"the chosen is a 1-D strategy, {c.name} a device mesh"
    if a[0] != b[0]:
        return f"the chosen's mesh has {a[0] - 1} dimension{'s' * (a[0] != 2)}, {c.name}'s {b[0] - 1}"
    if a[1] != b[1]:
        return f"the chosen's model-parallel degrees (pp x cp x tp x ep) multiply to {a[1]}, {c.name}'s to {b[1]}"
    return f"the chosen's ep is {a[2]}, {c.name}'s {b[2]} (its predicted time assumes a balanced router)"


def batch_line(inp: PlanInput, c: Candidate) -> str:
    """How `c` splits the global batch, against what was asked, in one line."""
    target, ranks = target_batch(inp), asked_data_ranks(inp)
    asked = f"--global-batch {inp.global_batch}" if inp.global_batch else \
        f"{inp.micro_batch} x {inp.grad_accum} x {ranks}"
    split = (f"micro-batch {c.micro_batch} x accumulation {c.grad_accum} x {c.data_ranks} data-parallel "
             f"rank{'s' if c.data_ranks != 1 else ''}")
    if c.global_batch == target:
        same = (c.micro_batch, c.grad_accum, c.data_ranks) == (inp.micro_batch, inp.grad_accum, ranks)
        return f"global batch {target} kept: {split} ({'as asked' if same and not inp.global_batch else f'asked: {asked}'})"
    return (f"global batch {c.global_batch}, not the {target} asked ({asked}): no layout that fits shares {target} "
            f"evenly over its data-parallel ranks, this is the nearest multiple of its {c.data_ranks}: {split}")


def why_chosen(chosen: Candidate, ranked: list[Candidate], inp: PlanInput) -> list[dict[str, Any]]:
    """What decided the choice: against the runner-up and, for a mesh layout, against the best plain
    data-parallel strategy (the 1-D one finetune.py would otherwise run), each with its deciding term.
    For the layout a run asks for: against the plan's own pick, the best of the others."""
    others = [c for c in ranked if c is not chosen]
    if chosen.asked:
        target = target_batch(inp)
        against, roles = ([choose(others, target)] if others else []), ("the plan's own pick",)
    else:
        against, roles = others[:1], ("the runner-up", "the best 1-D strategy")
        plain = next((c for c in others if c.dims is None), None)
        if chosen.dims is not None and plain is not None and plain is not others[0]:
            against.append(plain)
    out = []
    for c, role in zip(against, roles):
        text, term = decision(c, chosen, inp, ranked)
        out.append({"against": c.name, "checkpointing": c.checkpointing, "role": role, "term": term, "text": text})
    return out


def plan(inp: PlanInput) -> Plan:
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
    if world == 1:
        result.notes.append(f"one {inp.per}: ZeRO-1/2/3 and FSDP would shard over a single rank, so only DDP and the "
                            "CPU-offload variants are planned" + (" besides the layout asked for" if asked else ""))
    if inp.method == "qlora":
        result.notes.append("QLoRA: mesh layouts (--tp/--pp/--cp/--dp-shard) are not planned; its 4-bit base is "
                            "neither sharded nor split")
    best = choose([r for r in rows if r is not asked], target)
    if asked is not None and asked.fits and asked.runnable:
        best = asked
    ranked = sorted(rows, key=lambda c: rank_key(c, target))
    result.ranking = []
    for c in listed(best, ranked):
        reason, term = decision(c, best, inp, rows)
        if c is best and ranked[0] is not best and not best.asked and best.fits and best.runnable:
            reason += f": the simplest of the layouts within {TIE:.0%} of the fastest"
        result.ranking.append({"name": c.name, "checkpointing": c.checkpointing, "micro_batch": c.micro_batch,
                               "grad_accum": c.grad_accum, "gib_per_gpu": round(c.bytes["total"] / GiB, 2),
                               "seconds_per_example": c.seconds_per_example, "reason": reason, "term": term,
                               "asked": c.asked})
    if inp.asked is not None:
        result.asked_verdict = (f"not predicted: {unpredicted}" if asked is None else
                                decision(asked, best, inp, rows)[0] if asked is not best else "fits: chosen")
    if not (best.fits and best.runnable):
        result.advice = nothing_fits(inp, names)
        return result
    result.chosen, result.chosen_detail, result.grad_accum = best.name, best, best.grad_accum
    result.batch = batch_line(inp, best)
    result.why = why_chosen(best, [best] + [c for c in ranked if c is not best], inp)
    result.expert_parallel = expert_parallel_line(inp, rows, best)
    result.memory = memory_line(inp, best, ranked)
    result.fallbacks = [fallback_record(c, best, inp) for c in fallbacks(inp, best, rows, target)]
    if best.dims is None:
        result.flags = flags_for(best.name, best.checkpointing, best.micro_batch, result.grad_accum, inp.method)
    else:
        result.flags = (["--method", inp.method] + mesh_flags(ParallelDims(world, **best.dims), best.micro_batch)
                        + (["--gradient-checkpointing"] if best.checkpointing else [])
                        + ["--micro-batch-size", str(best.micro_batch), "--grad-accum", str(result.grad_accum)])
    return result


def nothing_fits(inp: PlanInput, names: list[str]) -> str:
    """Name the resource that is short: GPU memory for the smallest plan that fits in host RAM, and
    host RAM for the plans (CPU offload) that would fit on the GPU. (Every layout was tried down to
    micro-batch 1, so a smaller micro-batch is no way out.)"""
    gc = inp.checkpointing is not False
    how = "gradient checkpointing" if gc else "no checkpointing"
    smallest = [estimate(inp, STRATEGIES[n], gc, 1) for n in names]
    gpu, cpu = inp.gpu_memory, inp.cpu_memory
    in_ram = [c for c in smallest if cpu is None or c.cpu_bytes_per_node <= cpu]
    parts = []
    per, where = inp.per, "GPU memory" if inp.device == "GPU" else "the memory of a process"
    if in_ram:
        c = min(in_ram, key=lambda c: c.bytes["total"])
        parts.append(f"the smallest plan in {where} ({c.name}, {how}, micro-batch 1) needs "
                     f"{gib(c.bytes['total'])} GiB per {per}, {gib(c.bytes['total'] - gpu)} GiB more than "
                     f"the {gpu / GiB:.0f} GiB " + ("GPU" if inp.device == "GPU" else "a process has"))
    on_gpu = [c for c in smallest if c.bytes["total"] <= gpu and cpu is not None and c.cpu_bytes_per_node > cpu]
    if on_gpu:
        c = min(on_gpu, key=lambda c: c.cpu_bytes_per_node)
        parts.append(f"{c.name} ({how}, micro-batch 1) would fit the {per} ({gib(c.bytes['total'])} of "
                     f"{gpu / GiB:.0f} GiB) but needs {gib(c.cpu_bytes_per_node)} GiB of host RAM per node, "
                     f"{gib(c.cpu_bytes_per_node - cpu)} GiB more than the {cpu / GiB:.0f} GiB there")
    helps = [f"more {per}es" if per == "process" else f"more {per}s", "more host RAM for CPU offload",
             "--method qlora", "a shorter --seq-len"]
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


def table_legend(p: Plan, shown: list[Candidate], mesh: int) -> str:
    """The line under the table that says what its columns mean, the fits column's words included."""
    short = "GPU: its memory" if p.device == "GPU" else "memory: a process's"
    unchecked = any(fits_word(c, p).endswith("RAM?") for c in shown)
    return (f"each row at its split of the global batch of {p.global_batch} (mb x acc: micro-batch x accumulation "
            f"per data-parallel rank; micro-batch 1 where none fits"
            + ("; (asked): the run's own layout at its own split" if p.asked else "")
            + "); step s: predicted seconds per optimizer step; fits: no names what is short "
            f"({short}; RAM: the node's host RAM that CPU offload fills)"
            + ("; RAM?: fits the GPU, host RAM not checked" if unchecked else "")
            + f"; {mesh} mesh layouts (pp x dp x cp x tp) predicted, those in the top list shown (all in --json)")


def top_heading(p: Plan) -> str:
    """The line over the top list, saying the order `listed` gives it."""
    order = "keeps the global batch, no CPU offload, then the least predicted time per example"
    if not p.chosen:
        return f"nothing fits; the first {len(p.ranking)} in the plan's order ({order}), each with what is short:"
    fewer = f" (only {len(p.ranking)} run and fit)" if len(p.ranking) < TOP else ""
    return (f"top {len(p.ranking)}{fewer}: the chosen first, then the other layouts that run and fit, those as fast as "
            f"it (+0.0%) next, then in the plan's order ({order}), each with what decided it against the chosen:")


def render_table(p: Plan) -> str:
    """Where the trainable parameters sit, the 1-D strategies' memory breakdown, the mesh layouts
    among the top list (and the layout a run asks for), each row's fits saying what is short, then the
    top list (`listed`: the chosen first, the rows as fast as it, then the others that run and fit by
    `rank_key`) with why each lost, then the choice: its split of the global batch,
    its headroom where it is tight (`memory_line`), its predicted step term by term, what decided it,
    and its flags. Each figure is printed once, and every GiB figure as `gib` rounds it."""
    cols = ["weights", "grads", "optimizer", "autocast_copies", "activations", "logits", "buffers", "allocated", "total"]
    gpu = p.device == "GPU"
    per = "GPU" if gpu else "process"
    ram = ("unknown, not checked" if p.cpu_memory_unknown else "not checked") if p.cpu_memory is None \
        else f"{p.cpu_memory / GiB:.0f} GiB"
    top = {(r["name"], r["checkpointing"]) for r in p.ranking}
    shown = [c for c in p.strategies if c.dims is None or c.asked or (c.name, c.checkpointing) in top]
    mesh = len([c for c in p.strategies if c.dims is not None and not c.asked])
    world = f"{p.world} GPU{'s' * (p.world != 1)}" if gpu else f"{p.world} CPU process{'es' * (p.world != 1)}"
    lines = [f"params {p.params:,}  trainable {p.trainable_params:,}  world {world}  "
             f"{'GPU memory' if gpu else 'memory per process'} {p.gpu_memory / GiB:.0f} GiB  step times for {p.hardware}  "
             f"host RAM per node {ram}  (GiB per {per} below)", parts_line(p), *p.notes,
             f"{'layout':<26}" + "".join(f"{c:>{max(12, len(c) + 1)}}" for c in cols)
             + f"{'cpu/node':>10}{'mb x acc':>10}{'step s':>8}  {'fits'}"]
    for c in shown:
        lines.append(f"{label(c):<26}" + "".join(f"{gib(c.bytes[k]):>{max(12, len(k) + 1)}}" for k in cols)
                     + f"{gib(c.cpu_bytes_per_node):>10}{f'{c.micro_batch} x {c.grad_accum}':>10}"
                     f"{c.step_time_s:>8.3g}  {fits_word(c, p)}")
    lines.append(table_legend(p, shown, mesh))
    lines.append(top_heading(p))
    for r in p.ranking:
        name = r["name"] + (" +gc" if r["checkpointing"] else "") + (" (asked)" if r.get("asked") else "")
        split = f"{r['micro_batch']} x {r['grad_accum']}"
        lines.append(f"  {name:<26} mb {split:<8} {r['seconds_per_example'] * 1e3:>9.2f} ms/example  {r['reason']}")
    if p.asked_verdict and not (p.chosen_detail is not None and p.chosen_detail is p.asked):
        name = p.asked.name + (" +gc" if p.asked.checkpointing else "") if p.asked else "the layout the run asks for"
        lines.append(f"asked: {name}: {p.asked_verdict}")
    if p.chosen:
        d = p.chosen_detail
        lines.append(f"chosen: {label(d)}" + (", the layout the run asks for: it fits" if d.asked else "")
                     + " (its memory and step time: its row above)")
        lines.append("batch: " + p.batch)
        lines += [f"memory: {p.memory}"] * bool(p.memory)
        terms = [f"{k} {v:.3g}" for k, v in d.seconds.items() if v > 1e-3 * d.step_time_s]
        lines.append(f"time: {' + '.join(terms)} (seconds of its optimizer step, whose sum is its step s; --json: "
                     "seconds)")
        lines += [f"why: against {w['against']}{' +gc' if w['checkpointing'] else ''} ({w['role']}): {w['text']}"
                  for w in p.why if (w["against"], w["checkpointing"]) not in top]
        lines += [f"ep: {p.expert_parallel}"] * bool(p.expert_parallel)
        lines.append("flags: " + " ".join(p.flags))
    else:
        lines.append(p.advice)
    return "\n".join(lines)
