"""Predicted seconds per step: compute at an achieved fraction of the device's peak, plus the bytes
each collective moves over the link it crosses (data-parallel traffic hidden behind compute up to
the compute time, the rest on the critical path), plus offload's PCIe traffic and host optimizer step.
A step is kept term by term (`TERMS`: compute, recompute, the pipeline bubble, each kind of traffic,
the optimizer), so a plan can say which term decided between two layouts.

The figures come from a `Hardware` description:
a datasheet preset (`HARDWARE`, each figure with its source) or a file written by
`python -m toolkit plan --calibrate`, which measures them on the machine it runs on.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import NamedTuple

from toolkit.errors import UserError

# bytes an Adam step moves per parameter (fp32 weight, m and v read and written, grad read),
ADAM_STEP_BYTES = 28
#                     on the device or, with optimizer offload, on the host


@dataclass(frozen=True)
class Hardware:
    """What the time model needs to know about one device and its links (bytes/s per device, one
    direction). `efficiency` is the fraction of `peak_flops` that training matmuls reach."""
    name: str
    # dense FLOP/s per compute dtype: fp32, bf16, fp16
    peak_flops: dict[str, float]
    efficiency: float
    # between devices of one node (NVLink, or PCIe without it) between nodes (the NIC per device)
    intra_node_bw: float
    inter_node_bw: float
    # device <-> host, for offload host memory bandwidth per device, for the host's optimizer step
    pcie_bw: float
    host_bw: float
    # seconds per collective call, whatever its size
    collective_latency: float = 0.0
    # device memory bytes/s, for the optimizer step on the device (0: not counted)
    memory_bw: float = 0.0
    # fraction of data-parallel traffic hidden behind compute (up to the compute time)
    overlap: float = 0.0
    sources: dict[str, str] = field(default_factory=dict)

    def peak(self, precision: str) -> float:
        key = "fp32" if precision == "no" else precision
        return self.peak_flops.get(key) or self.peak_flops["fp32"]

    def link(self, span: int, gpus_per_node: int) -> float:
        """Bandwidth of a group whose ranks span `span` consecutive ranks: inside a node or across."""
        return self.intra_node_bw if span <= gpus_per_node else self.inter_node_bw

    def to_json(self) -> dict:
        return asdict(self)


PALM = "PaLM (Chowdhery et al. 2022, table 3) reports 30-46% MFU for the large models of its time"
OVERLAP = ("torchtitan's Llama 3.1 8B FSDP runs keep 97% of their 8-GPU tokens/s per GPU on 128 GPUs "
           "(pytorch/torchtitan, benchmarks/llama3_h100_202412_torchtitan.md, tables 1 and 3) where unhidden "
           "inter-node traffic would cost about 30%: 0.9 of it hidden")
HARDWARE: dict[str, Hardware] = {h.name: h for h in [
    Hardware("h100-sxm", {"fp32": 67e12, "bf16": 989.5e12, "fp16": 989.5e12}, 0.40, 450e9, 50e9, 64e9, 77e9, 0.0,
             3.35e12, 0.9, {
        "peak_flops": "NVIDIA H100 SXM datasheet (BF16 1,979 TFLOPS with sparsity, dense half)", "efficiency": PALM,
        "intra_node_bw": "NVLink 4, 900 GB/s bidirectional (H100 SXM datasheet)",
        "inter_node_bw": "one 400 Gb/s NDR InfiniBand port per GPU (DGX H100 datasheet)",
        "pcie_bw": "PCIe Gen5 x16, 128 GB/s bidirectional", "host_bw": "2 sockets x 8 channels DDR5-4800 over 8 GPUs",
        "memory_bw": "HBM3 3.35 TB/s (H100 SXM datasheet)", "overlap": OVERLAP}),
    Hardware("a100-80gb", {"fp32": 19.5e12, "bf16": 312e12, "fp16": 312e12}, 0.40, 300e9, 25e9, 32e9, 51e9, 0.0,
             2.039e12, 0.9, {
        "peak_flops": "NVIDIA A100 datasheet (BF16 312 TFLOPS dense)", "efficiency": PALM,
        "intra_node_bw": "NVLink 3, 600 GB/s bidirectional (A100 SXM datasheet)",
        "inter_node_bw": "one 200 Gb/s HDR InfiniBand port per GPU (DGX A100 datasheet)",
        "pcie_bw": "PCIe Gen4 x16, 64 GB/s bidirectional", "host_bw": "2 sockets x 8 channels DDR4-3200 over 8 GPUs",
        "memory_bw": "HBM2e 2,039 GB/s (A100 80GB SXM datasheet)", "overlap": OVERLAP}),
    Hardware("l40s", {"fp32": 91.6e12, "bf16": 362e12, "fp16": 362e12}, 0.40, 32e9, 25e9, 32e9, 51e9, 0.0,
             864e9, 0.9, {
        "peak_flops": "NVIDIA L40S datasheet (BF16 733 TFLOPS with sparsity, dense half)", "efficiency": PALM,
        "intra_node_bw": "no NVLink: PCIe Gen4 x16 peer to peer, 32 GB/s per direction",
        "inter_node_bw": "assumed 200 Gb/s Ethernet/InfiniBand per GPU (no reference system)",
        "pcie_bw": "PCIe Gen4 x16, 64 GB/s bidirectional", "host_bw": "assumed as a DGX A100-class host",
        "memory_bw": "GDDR6 864 GB/s (L40S datasheet)", "overlap": OVERLAP}),
    Hardware("cpu", {"fp32": 50e9, "bf16": 0.1e9}, 1.0, 2e9, 2e9, 10e9, 10e9, 1e-4, 10e9, 0.0, {
        "all": "placeholders of the right order for a small x86 host: measure with `plan --calibrate`"}),
]}
DEFAULT_HARDWARE = "h100-sxm"


def load_hardware(spec: str | None) -> Hardware:
    """A preset name or a JSON file written by `plan --calibrate` (None: the H100 SXM preset)."""
    spec = spec or DEFAULT_HARDWARE
    if spec.lower() in HARDWARE:
        return HARDWARE[spec.lower()]
    path = Path(spec)
    if not path.is_file():
        raise UserError(f"--hardware {spec}: not a preset ({', '.join(HARDWARE)}) or a file from "
                        "`python -m toolkit plan --calibrate --output FILE`")
    try:
        data = json.loads(path.read_text())
        return Hardware(**{k: data[k] for k in Hardware.__dataclass_fields__ if k in data})
    except (json.JSONDecodeError, TypeError, KeyError) as e:
        raise UserError(f"--hardware {spec}: not a hardware file ({e}); write one with `plan --calibrate`") from None


def flops_per_token(params: int, trainable: int, layers: int, hidden: int, seq_len: int, checkpointing: bool) -> float:
    """Forward 2P + 4Lhs; backward 2P (activation gradients through every weight) + 2T (weight
    gradients of the trainable ones) + 8Lhs; full checkpointing runs the forward once more. P and T
    are the weights one token uses (`params.ParamCounts.active`): in an MoE layer its top-k routed
    experts, not all of them (memory holds them all).
    For a full finetune (T = P) this is PaLM's 6N + 12LhT (appendix B) and checkpointing adds 1/3;
    for LoRA (T << P) it is ~4N and checkpointing adds 1/2."""
    forward = 2.0 * params + 4.0 * layers * hidden * seq_len
    backward = 2.0 * params + 2.0 * trainable + 8.0 * layers * hidden * seq_len
    return forward + backward + (forward if checkpointing else 0.0)


def forward_flops_per_token(params: int, layers: int, hidden: int, seq_len: int) -> float:
    """One forward without gradients, 2P + 4Lhs (`flops_per_token`'s forward): DPO's reference under LoRA,
    the base model with the adapters disabled, run before each policy forward."""
    return 2.0 * params + 4.0 * layers * hidden * seq_len


def pipeline_bubble(stages: int, microbatches: int) -> float:
    """Idle fraction of a GPipe / 1F1B step: (p - 1) / (m + p - 1) (Huang et al. 2019, GPipe sec. 2.2;
    Narayanan et al. 2021, sec. 2.2)."""
    return (stages - 1) / (microbatches + stages - 1)


def ring_factor(n: int) -> float:
    """Bytes a rank sends per byte of buffer in a ring all-reduce: 2(n-1)/n (reduce-scatter then
    all-gather, Patarasuk & Yuan 2009); a reduce-scatter or an all-gather alone sends half of it."""
    return 2 * (n - 1) / n if n > 1 else 0.0


def fsdp_bytes(ranks: int, grads: float, gathered: float, gathers: int) -> float:
    """Bytes a rank sends per micro-batch for FSDP2 units sharded over `ranks`: one reduce-scatter of
    the gradients (`grads` bytes unsharded) and `gathers` all-gathers of the parameters (`gathered`
    bytes unsharded, in the gather's dtype), each (n-1)/n of its buffer (`ring_factor` / 2; ZeRO paper
    sec. 7: reduce-scatter + all-gather move an all-reduce's bytes)."""
    return ring_factor(ranks) / 2 * (grads + gathers * gathered)


def expert_all_to_all_bytes(moe_layers: int, tokens: int, top_k: int, hidden: int, ep: int, act_bytes: int,
                            checkpointing: bool) -> float:
    """Bytes a rank sends per micro-batch under expert parallel degree `ep`: in each MoE layer each of
    its `tokens` (the ones it dispatches: under tp x ep, whose ep group is the TP group, its 1/tp of the
    TP group's) x `top_k` (token, expert) rows, `hidden` wide in the compute dtype, goes to its
    expert's rank (dispatch) and its output comes back (combine), twice per MoE layer in forward and
    again in backward (the conjugate all-to-alls of the gradients), and once more in forward under
    activation checkpointing (the recomputed forward); with balanced routing (ep - 1)/ep of the rows
    leave the rank:

        (4 + 2 checkpointing) x moe_layers x tokens x top_k x hidden x act_bytes x (ep - 1)/ep

    (torchtitan, `distributed/expert_parallel.py` `ExpertParallel` dispatch/combine; Megatron-Core,
    `transformer/moe/token_dispatcher.py` `MoEAlltoAllTokenDispatcher`; this toolkit's
    `toolkit.parallel.ep.comm`, whose bytes `toolkit.parallel.traffic` counts the same way). The per-expert counts'
    all-to-all (E integers per layer and forward) is left out."""
    return (4 + 2 * checkpointing) * moe_layers * tokens * top_k * hidden * act_bytes * (ep - 1) / ep


class Traffic(NamedTuple):
    """One exchange of a micro-batch step: what a rank sends, over which link, in how many calls,
    whether it blocks or runs behind compute (`KINDS`), and which term of the step it is (`TERMS`:
    a blocking exchange adds to its own, tp, cp, ep or pp; overlapped traffic is dp, or dp_sync once
    per optimizer step)."""
    bytes: float
    # link bytes/s
    bandwidth: float
    # collective calls (each pays `Hardware.collective_latency`)
    calls: int
    kind: str
    term: str


KINDS = ("blocking", "overlapped", "overlapped_once")
# The terms a predicted step is the sum of, each a line of `step_terms`; the last two are paid once
# per optimizer step, the rest every micro-batch step.
TERMS = ("compute", "recompute", "pp_bubble", "tp", "cp", "ep", "pp", "dp", "offload", "dp_sync", "optimizer")
ONCE_TERMS = ("dp_sync", "optimizer")


def step_terms(flops: float, precision: str, traffic: list[Traffic], hw: Hardware, pcie_bytes: float = 0,
               host_bytes: float = 0, bubble: float = 0.0, optimizer_bytes: float = 0,
               recompute_flops: float = 0.0) -> dict[str, float]:
    """Seconds of one micro-batch step that ends an optimizer step on one device, term by term
    (`TERMS`; they sum to the step, and `ONCE_TERMS` are its part paid once per optimizer step).

    compute: FLOPs at `hw.efficiency` of the peak; recompute: the forward that gradient checkpointing
    runs again (`recompute_flops`), at the same rate; pp_bubble: both stretched by the pipeline's
    idle fraction, c / (1 - bubble) - c. Exchanges the next layer waits for ("blocking": TP
    all-reduces, Ulysses and expert-parallel all-to-alls, pipeline sends) add under their own term,
    and so does PCIe traffic (offload). Data-parallel traffic that runs behind the backward pass ("overlapped":
    bucketed all-reduces, FSDP/ZeRO gathers and reduce-scatters) is hidden up to `hw.overlap` of the
    compute time: `dp` is what is left. Once per optimizer step: `dp_sync`, the part of
    "overlapped_once" traffic (DDP skips the all-reduce while accumulating) not hidden, and
    `optimizer`, the optimizer's pass over its state (`optimizer_bytes` at device memory bandwidth)
    and the host's optimizer step (offload, `host_bytes`)."""
    rate = hw.peak(precision) * hw.efficiency
    busy = (flops + recompute_flops) / rate
    compute = busy / (1 - bubble)

    def seconds(select) -> float:
        return sum(t.bytes / t.bandwidth + t.calls * hw.collective_latency for t in traffic if select(t))

    def exposed(comm: float) -> float:
        return comm - hw.overlap * min(comm, compute)

    terms = dict.fromkeys(TERMS, 0.0)
    for t in traffic:
        if t.kind == "blocking":
            terms[t.term] += seconds(lambda x: x is t)
    overlapped = seconds(lambda t: t.kind == "overlapped")
    terms |= {"compute": flops / rate, "recompute": recompute_flops / rate, "pp_bubble": compute - busy,
              "dp": exposed(overlapped), "offload": pcie_bytes / hw.pcie_bw,
              "dp_sync": exposed(overlapped + seconds(lambda t: t.kind == "overlapped_once")) - exposed(overlapped),
              "optimizer": host_bytes / hw.host_bw + (optimizer_bytes / hw.memory_bw if hw.memory_bw else 0.0)}
    return terms


def step_seconds(terms: dict[str, float]) -> tuple[float, float]:
    """(seconds of the micro-batch step `terms` describes, the part of it paid once per optimizer step)."""
    return sum(terms.values()), sum(terms[k] for k in ONCE_TERMS)


def optimizer_step_terms(terms: dict[str, float], accumulation: int) -> dict[str, float]:
    """`terms` of an optimizer step of `accumulation` micro-batch steps: the per-micro-batch terms
    each time, `ONCE_TERMS` once. They sum to `optimizer_step_seconds`."""
    return {k: v if k in ONCE_TERMS else accumulation * v for k, v in terms.items()}


def optimizer_step_seconds(step: float, once: float, accumulation: int) -> float:
    """An optimizer step of `accumulation` micro-batch steps: the per-micro-batch part each time,
    the once-per-step part once."""
    return accumulation * (step - once) + once
