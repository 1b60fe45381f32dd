"""`python -m toolkit plan --calibrate`: measure this machine's figures for the planner's time model
(`toolkit.planner.cost.Hardware`) over the launcher's ranks, and write them to a JSON file that
`plan --hardware FILE` and `--strategy auto` (TOOLKIT_HARDWARE=FILE) read.

Every rank measures at the same time, as they would train: on a shared host (a CPU, or GPUs behind
one PCIe switch) ranks compete, and the slowest rank's figure is kept. Measured:
- matmul peak: the MFU probe's (`train.flops.measure_peak_flops`: the best call of an n x n matmul);
- efficiency: the fraction of that peak one Llama decoder block's forward + backward reaches
  (FLOPs counted by `planner.cost.flops_per_token`), at a fixed shape that is not the model planned;
- collective bandwidth: bytes a rank sends per second in an all-reduce (ring: 2(n-1)/n of the
  buffer) and an all-to-all ((n-1)/n of it), and the latency of an 8-float all-reduce;
- overlap: how much of an all-reduce hides behind matmuls running at the same time;
- memory bandwidth (a large copy: host memory, and on a GPU device memory and host -> device, the
  optimizer step's and offload's PCIe figures).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import torch

from toolkit.planner.cost import Hardware, flops_per_token, ring_factor
from toolkit.train.flops import measure_peak_flops

# bytes/s of a link no rank crossed
UNMEASURED = 1e18
BLOCK = dict(hidden_size=512, intermediate_size=1536, num_attention_heads=8, num_key_value_heads=4)


def _timed(fn, repeats: int, sync) -> float:
    """Median seconds of `fn` after one warm-up call."""
    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def block_efficiency(device: torch.device, dtype: torch.dtype, peak: float, tokens: int, sync) -> float:
    """Measured FLOP/s of a decoder block's forward + backward over `peak`."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    cfg = LlamaConfig(**BLOCK, num_hidden_layers=1, vocab_size=256, attn_implementation="sdpa")
    block = LlamaDecoderLayer(cfg, 0).to(device=device, dtype=dtype)
    x = torch.randn(1, tokens, cfg.hidden_size, device=device, dtype=dtype, requires_grad=True)
    pos = torch.arange(tokens, device=device)[None]
    rope = LlamaRotaryEmbedding(cfg).to(device)(x, pos)
    mask = torch.ones(tokens, tokens, dtype=torch.bool, device=device).tril()[None, None]

    def step():
        out = block(x, attention_mask=mask, position_ids=pos, position_embeddings=rope)
        (out[0] if isinstance(out, tuple) else out).float().sum().backward()

    params = sum(p.numel() for p in block.parameters())
    flops = tokens * flops_per_token(params, params, 1, cfg.hidden_size, tokens, False)
    return flops / _timed(step, 3, sync) / peak


def copy_bandwidth(src: torch.Tensor, dst: torch.Tensor, sync) -> float:
    """Bytes per second of one copy (read once, written once; counted once, as the time model's)."""
    return src.numel() * src.element_size() / _timed(lambda: dst.copy_(src), 5, sync)


def collective_figures(device: torch.device, nbytes: int, sync, group=None) -> dict[str, float]:
    import torch.distributed as dist

    n = dist.get_world_size(group)
    small = torch.ones(8, device=device)
    big = torch.ones(nbytes // 4, device=device)
    out = torch.empty_like(big)
    latency = _timed(lambda: dist.all_reduce(small, group=group), 20, sync)
    all_reduce = ring_factor(n) * nbytes / _timed(lambda: dist.all_reduce(big, group=group), 5, sync)
    all_to_all = (n - 1) / n * nbytes / _timed(lambda: dist.all_to_all_single(out, big, group=group), 5, sync)
    return {"latency": latency, "all_reduce": all_reduce, "all_to_all": all_to_all}


def overlap_fraction(device: torch.device, nbytes: int, sync) -> float:
    """How much of an all-reduce hides behind matmuls running at the same time: (compute + comm -
    both) / the shorter of the two, the compute sized to last about as long as the all-reduce."""
    import torch.distributed as dist

    buf = torch.ones(nbytes // 4, device=device)
    comm = _timed(lambda: dist.all_reduce(buf), 5, sync)
    a = torch.randn(512, 512, device=device)
    one = _timed(lambda: a @ a, 5, sync)
    reps = max(1, round(comm / one))

    def compute():
        for _ in range(reps):
            a @ a

    def both():
        work = dist.all_reduce(buf, async_op=True)
        compute()
        work.wait()

    alone = _timed(compute, 5, sync)
    together = _timed(both, 5, sync)
    return max(0.0, min(1.0, (alone + comm - together) / min(alone, comm)))


def slowest(value: float, device: torch.device) -> float:
    """The smallest value over ranks (the slowest rank governs a synchronous step)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return t.item()


def calibrate(output: Path, log=print) -> Hardware | None:
    """Measure, and on rank 0 write `output`; returns the figures (on every rank)."""
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    device = torch.device("cuda" if cuda else "cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    name = torch.cuda.get_device_name() if cuda else f"CPU ({os.cpu_count()} cores)"
    # the MFU probe's, time-bounded
    peaks = {"fp32": slowest(measure_peak_flops(device, torch.float32), device)}
    peaks["bf16"] = slowest(measure_peak_flops(device, torch.bfloat16, None if cuda else 256), device)
    # fp16 is refused on the CPU anyway
    peaks["fp16"] = peaks["bf16"] if cuda else peaks["fp32"] / 100
    dtype, key = (torch.bfloat16, "bf16") if cuda else (torch.float32, "fp32")
    efficiency = min(1.0, slowest(block_efficiency(device, dtype, peaks[key], 2048 if cuda else 256, sync), device))
    host = torch.empty(64 * 1024**2 // 4)
    host_bw = slowest(copy_bandwidth(torch.ones_like(host), host, lambda: None), device)
    pcie_bw = host_bw
    if cuda:
        pinned = torch.ones(256 * 1024**2 // 4).pin_memory()
        pcie_bw = slowest(copy_bandwidth(pinned, torch.empty_like(pinned, device=device), sync), device)
    memory_bw = host_bw
    if cuda:
        block = torch.ones(1024**3 // 4, device=device)
        memory_bw = slowest(copy_bandwidth(block, torch.empty_like(block), sync), device)
        del block
    measured: dict = {"world_size": world, "ranks_per_node": local, "block": {**BLOCK, "tokens": 2048 if cuda else 256}}
    intra = inter = None
    latency, overlap = 0.0, 0.0
    if world > 1:
        nbytes = (256 if cuda else 16) * 1024**2
        figures = {k: slowest(v, device) for k, v in collective_figures(device, nbytes, sync).items()}
        measured["world"] = figures
        latency, inter = figures["latency"], figures["all_reduce"]
        overlap = slowest(overlap_fraction(device, nbytes, sync), device)
        # several nodes: the node-local groups give the intra-node figure
        if world > local:
            group, _ = dist.new_subgroups(group_size=local)
            measured["node"] = {k: slowest(v, device)
                                for k, v in collective_figures(device, nbytes, sync, group).items()}
            intra = measured["node"]["all_reduce"]
        else:
            intra = inter
    hw = Hardware(
        name=f"calibrated: {name} x {world} rank(s)", peak_flops=peaks, efficiency=efficiency,
        intra_node_bw=intra or 0.0, inter_node_bw=inter or 0.0, pcie_bw=pcie_bw, host_bw=host_bw,
        collective_latency=latency, memory_bw=memory_bw, overlap=overlap,
        sources={"all": f"measured by `python -m toolkit plan --calibrate` on {world} rank(s), "
                        f"{time.strftime('%Y-%m-%d %H:%M')}",
                 "intra_node_bw": "ring all-reduce, bytes a rank sends per second" if world > 1 else
                 "not measured (one rank): launch with torchrun --nproc_per_node N",
                 "inter_node_bw": "measured across nodes" if world > local else "not measured (one node): as intra"})
    # no link was measured: links cost nothing rather than infinite time (plan on one rank)
    if world == 1:
        hw = Hardware(**{**hw.to_json(), "intra_node_bw": UNMEASURED, "inter_node_bw": UNMEASURED})
    if rank == 0:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(json.dumps({**hw.to_json(), "measured": measured}, indent=2) + "\n")
        log(f"wrote {output}: fp32 {peaks['fp32'] / 1e9:.1f} GFLOP/s, bf16 {peaks['bf16'] / 1e9:.1f} GFLOP/s, "
            f"block efficiency {efficiency:.2f}, all-reduce {(intra or 0) / 1e9:.2f} GB/s per rank, "
            f"latency {latency * 1e6:.0f} us, overlap {overlap:.2f}, host copy {host_bw / 1e9:.1f} GB/s")
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return hw
