"""Datasheet peaks of known accelerators, the denominator of published MFU (PaLM, Megatron-LM,
torchtitan all divide by the vendor's dense peak, not by a measured one).

Pure data and string matching, no torch: the planner and the MFU logger both read it. Figures are
dense (no 2:4 sparsity) TFLOP/s per device; "fp32" is the plain FP32 rate (torch runs fp32 matmuls
without TF32 unless asked). Vendors quote sparse tensor rates; the dense rate is half of them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


# The MFU probe's square matmul on a GPU (`toolkit.train.flops.measure_peak_flops`): its two inputs and
# output are allocated at start-up, which the planner's allocator peak counts.
PROBE_MATMUL_GPU = 8192


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    # regex matched against torch.cuda.get_device_name()
    pattern: str
    # dense peak per compute dtype: fp32, bf16, fp16
    tflops: dict[str, float]
    source: str


# more specific names first: the first match wins
DATASHEETS: tuple[DeviceSpec, ...] = (
    DeviceSpec("NVIDIA H100 NVL", r"H100.*NVL", {"fp32": 60.0, "bf16": 835.5, "fp16": 835.5},
               "NVIDIA H100 datasheet (BF16/FP16 1,671 TFLOPS with sparsity)"),
    DeviceSpec("NVIDIA H100 PCIe", r"H100.*PCIe", {"fp32": 51.0, "bf16": 756.5, "fp16": 756.5},
               "NVIDIA H100 datasheet (BF16/FP16 1,513 TFLOPS with sparsity)"),
    DeviceSpec("NVIDIA H100 SXM", r"H100", {"fp32": 67.0, "bf16": 989.5, "fp16": 989.5},
               "NVIDIA H100 datasheet (BF16/FP16 1,979 TFLOPS with sparsity)"),
    DeviceSpec("NVIDIA H200 NVL", r"H200.*NVL", {"fp32": 60.0, "bf16": 835.5, "fp16": 835.5},
               "NVIDIA H200 datasheet (BF16/FP16 1,671 TFLOPS with sparsity)"),
    DeviceSpec("NVIDIA H200 SXM", r"H200", {"fp32": 67.0, "bf16": 989.5, "fp16": 989.5},
               "NVIDIA H200 datasheet (BF16/FP16 1,979 TFLOPS with sparsity)"),
    DeviceSpec("NVIDIA A100", r"A100", {"fp32": 19.5, "bf16": 312.0, "fp16": 312.0},
               "NVIDIA A100 datasheet (BF16/FP16 312 TFLOPS dense; SXM and PCIe alike)"),
    DeviceSpec("NVIDIA L40S", r"L40S", {"fp32": 91.6, "bf16": 362.05, "fp16": 362.05},
               "NVIDIA L40S datasheet (BF16/FP16 733 TFLOPS with sparsity)"),
    DeviceSpec("NVIDIA L4", r"\bL4\b", {"fp32": 30.3, "bf16": 121.0, "fp16": 121.0},
               "NVIDIA L4 datasheet (BF16/FP16 242 TFLOPS with sparsity)"),
    DeviceSpec("NVIDIA A10", r"\bA10\b", {"fp32": 31.2, "bf16": 125.0, "fp16": 125.0},
               "NVIDIA A10 datasheet (BF16/FP16 250 TFLOPS with sparsity)"),
    DeviceSpec("NVIDIA V100 PCIe", r"V100.*PCIE", {"fp32": 14.0, "fp16": 112.0},
               "NVIDIA V100 datasheet (no bf16 tensor cores)"),
    DeviceSpec("NVIDIA V100 SXM2", r"V100", {"fp32": 15.7, "fp16": 125.0},
               "NVIDIA V100 datasheet (no bf16 tensor cores)"),
    DeviceSpec("NVIDIA GeForce RTX 4090", r"RTX 4090", {"fp32": 82.6, "bf16": 165.2, "fp16": 165.2},
               "NVIDIA Ada (AD102) whitepaper, appendix A (tensor FLOPS with FP32 accumulate)"),
    DeviceSpec("AMD Instinct MI300X", r"MI300X", {"fp32": 163.4, "bf16": 1307.4, "fp16": 1307.4},
               "AMD Instinct MI300X datasheet (BF16/FP16 2,614.9 TFLOPS with sparsity)"),
)


def find_device(device_name: str) -> DeviceSpec | None:
    """The datasheet entry for a `torch.cuda.get_device_name()` string, or None if unknown."""
    for spec in DATASHEETS:
        if re.search(spec.pattern, device_name, re.IGNORECASE):
            return spec
    return None


def datasheet_peak(device_name: str, dtype: str) -> tuple[float, str] | None:
    """(peak FLOP/s, where it comes from) for this device and compute dtype (fp32/bf16/fp16), or None
    when the device or the dtype is not in the table (CPUs, unknown GPUs: measure instead)."""
    spec = find_device(device_name)
    if spec is None or dtype not in spec.tflops:
        return None
    return spec.tflops[dtype] * 1e12, f"{spec.name} {dtype} dense, {spec.source}"


def host_memory_bytes() -> int:
    """Physical RAM of the machine running this process."""
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
