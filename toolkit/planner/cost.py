"""Predicted seconds per step of a candidate, to rank the candidates that fit.

step = compute + GPU-to-GPU traffic + PCIe traffic (offload) + the host's optimizer step (offload),
added as if nothing overlapped. The figures are a DGX H100-class node's datasheet numbers; the
planner uses the seconds only to order the candidates of one plan (gradient checkpointing's extra
forward against offload's PCIe traffic against ZeRO-3's all-gathers), and they are not yet
validated against measured step times.
"""

from __future__ import annotations

from toolkit.hardware import DATASHEETS

REFERENCE = next(d for d in DATASHEETS if d.name == "NVIDIA H100 SXM")
ACHIEVED = 0.40  # fraction of the dense peak that training reaches: PaLM (Chowdhery et al. 2022, table 3)
#                  reports 30-46% MFU for the large models of its time
NVLINK_BW = 450e9  # bytes/s per GPU per direction: NVLink 4, 900 GB/s bidirectional (H100 SXM datasheet)
NETWORK_BW = 50e9  # bytes/s per GPU between nodes: one 400 Gb/s NDR InfiniBand port per GPU (DGX H100 datasheet)
PCIE_BW = 64e9  # bytes/s per GPU per direction: PCIe Gen5 x16, 128 GB/s bidirectional (H100 SXM datasheet)
HOST_BW = 77e9  # bytes/s of host memory per GPU: 2 sockets x 8 channels of DDR5-4800 (DGX H100) over 8 GPUs
ADAM_HOST_BYTES = 28  # bytes moved per parameter by a CPU Adam step: fp32 weight, m and v read and written, grad read


def flops_per_token(params: int, trainable: int, layers: int, hidden: int, seq_len: int, checkpointing: bool) -> float:
    """Forward 2P + 4Lhs; backward 2P (activation gradients through every weight) + 2T (weight
    gradients of the trainable ones) + 8Lhs; full checkpointing runs the forward once more.
    For a full finetune (T = P) this is PaLM's 6N + 12LhT (appendix B) and checkpointing adds 1/3;
    for LoRA (T << P) it is ~4N and checkpointing adds 1/2."""
    forward = 2.0 * params + 4.0 * layers * hidden * seq_len
    backward = 2.0 * params + 2.0 * trainable + 8.0 * layers * hidden * seq_len
    return forward + backward + (forward if checkpointing else 0.0)


def step_seconds(flops: float, precision: str, gpu_bytes: int, nodes: int, pcie_bytes: int, host_bytes: int) -> float:
    """Seconds for one micro-batch step on one GPU, nothing overlapped (an upper bound)."""
    peak = REFERENCE.tflops["fp32" if precision == "no" else precision] * 1e12
    link = NVLINK_BW if nodes == 1 else NETWORK_BW  # a ring over nodes runs at its slowest link
    return flops / (peak * ACHIEVED) + gpu_bytes / link + pcie_bytes / PCIE_BW + host_bytes / HOST_BW
