"""Step-checkpoint save and load: the sharded format against the gathered one it replaced.

SmolLM2-135M (the embedded default), full finetune, fp32, AdamW after one step, on 1, 2 and 4 gloo
ranks (FSDP2 `fully_shard` per block over every rank when there are several):

- sharded: `toolkit.train.sharded_state` (each rank writes and reads its own pieces of the weights
  and Adam moments with torch.distributed.checkpoint, safetensors files);
- gathered (what step checkpoints did before): every rank all-gathers the full weights, rank 0
  writes model.safetensors; the optimizer state consolidated on rank 0
  (`get_optimizer_state_dict(full_state_dict=True, cpu_offload=True)`) and `torch.save`d; on load
  every rank reads the whole model file and keeps its shard, rank 0 reads the optimizer file and
  broadcasts it (`set_optimizer_state_dict(broadcast_from_rank0=True)`).

Per process: wall time of the save and of the load (each ends at a barrier), and the peak host RSS
the phase added: the kernel's peak mark is reset before it (`echo 5 > /proc/self/clear_refs`) and
VmHWM - VmRSS(before) read after. Each (ranks, format) runs in its own torchrun launch. The load
goes into zeroed weights and moments, and the weights' and moments' checksums must come back.

    python -m benchmarks.checkpoint_io        # writes benchmarks/checkpoint_io.{json,md}
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import BENCH, ROOT, PeakSampler, peak_rss_mib, reset_peak_rss, status_kib, write_pair

RANKS = (1, 2, 4)
FORMATS = ("sharded", "gathered")


def _phase(fn) -> tuple[float, float, float]:
    """(seconds, MiB of peak RSS above the start, MiB of peak anonymous RSS above the start) of
    `fn()`, ending at a barrier. RSS counts the pages of memory-mapped files read (safetensors maps
    its files), which the kernel can drop; anonymous RSS is the process's own memory, sampled every
    millisecond by a thread."""
    import torch.distributed as dist

    dist.barrier()
    with PeakSampler(lambda: status_kib("RssAnon"), every=0.001) as anon:
        before = reset_peak_rss()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        seconds = time.perf_counter() - t0
    return seconds, peak_rss_mib(before), (anon.peak - anon.start) / 1024


def _checksum(model, optimizer) -> float:
    from toolkit.parallel.grad_norm import local

    total = 0.0
    for p in model.parameters():
        total += local(p).double().abs().sum().item()
        for v in optimizer.state[p].values():
            if v.dim():
                total += local(v).double().abs().sum().item()
    return total


def child(fmt: str, folder: str) -> None:
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from toolkit.model.source import prepare_default_model
    from toolkit.train.sharded_state import load_sharded, save_sharded

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, 2 // world))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(prepare_default_model(log=lambda *_: None), dtype=torch.float32)
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for block in model.model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = torch.randint(0, model.config.vocab_size, (1, 64))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    want = _checksum(model, optimizer)
    named = [(n, p, None) for n, p in model.named_parameters()]
    out = Path(folder)

    def save_sharded_() -> None:
        save_sharded(out / "state", named, optimizer)

    def save_gathered() -> None:
        from safetensors.torch import save_file
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        from toolkit.parallel.grad_norm import full

        state = {k: full(v).detach().contiguous() for k, v in model.state_dict().items()}
        if world > 1:
            optim = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True,
                                                                                        cpu_offload=True))
        else:
            optim = optimizer.state_dict()
        if rank == 0:
            if model.config.tie_word_embeddings:  # one storage, saved once (as save_pretrained does)
                state.pop("lm_head.weight", None)
            save_file(state, out / "model.safetensors")
            torch.save(optim, out / "optimizer.pt")

    def load_sharded_() -> None:
        load_sharded(out / "state", named, optimizer)

    def load_gathered() -> None:
        from safetensors.torch import load_file
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        from toolkit.parallel.grad_norm import local

        state = load_file(out / "model.safetensors")  # every rank: the whole model, then its shard
        with torch.no_grad():
            for n, p in model.named_parameters():
                full_t = state[n]
                if hasattr(p, "to_local"):
                    size = -(-full_t.shape[0] // world)
                    full_t = full_t[rank * size:(rank + 1) * size]
                local(p).copy_(full_t)
        del state
        if world > 1:
            optim = torch.load(out / "optimizer.pt", weights_only=True) if rank == 0 else {}
            set_optimizer_state_dict(model, optimizer, optim, options=StateDictOptions(full_state_dict=True,
                                                                                       broadcast_from_rank0=True))
        else:
            optimizer.load_state_dict(torch.load(out / "optimizer.pt", weights_only=True))

    save_s, save_mib, save_anon = _phase(save_sharded_ if fmt == "sharded" else save_gathered)
    with torch.no_grad():  # load into zeros: the checksum must come back
        for p in model.parameters():
            p.zero_()
            for v in optimizer.state[p].values():
                if v.dim():
                    v.zero_()
    load_s, load_mib, load_anon = _phase(load_sharded_ if fmt == "sharded" else load_gathered)
    got = _checksum(model, optimizer)
    sums = [None] * world
    dist.all_gather_object(sums, (want, got))
    ok = abs(sum(g for _, g in sums) - sum(w for w, _ in sums)) <= 1e-9 * sum(w for w, _ in sums)
    disk = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    result = {"rank": rank, "save_s": save_s, "save_peak_mib": save_mib, "save_peak_anon_mib": save_anon,
              "load_s": load_s, "load_peak_mib": load_mib, "load_peak_anon_mib": load_anon, "restored": ok,
              "disk_mib": disk / 2**20}
    (out.parent / f"result_{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def run(ranks: int, fmt: str) -> list[dict]:
    tmp = Path(tempfile.mkdtemp(prefix="ckpt_io_"))
    (tmp / "ckpt").mkdir()
    (tmp / "ckpt" / "state").mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, 2 // ranks))}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
           "-m", "benchmarks.checkpoint_io", "--child", fmt, str(tmp / "ckpt")]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(f"{ranks} ranks, {fmt}: exit {p.returncode}\n{p.stderr[-3000:]}")
    rows = [json.loads((tmp / f"result_{r}.json").read_text()) for r in range(ranks)]
    shutil.rmtree(tmp)
    return rows


def main() -> None:
    # no options: --help says what it measures
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    results = []
    for ranks in RANKS:
        for fmt in FORMATS:
            rows = run(ranks, fmt)
            assert all(r["restored"] for r in rows), (ranks, fmt, rows)
            results.append({"ranks": ranks, "format": fmt, "per_rank": rows,
                            "save_s": max(r["save_s"] for r in rows), "load_s": max(r["load_s"] for r in rows),
                            "save_peak_mib_rank0": rows[0]["save_peak_mib"],
                            "save_peak_mib_max": max(r["save_peak_mib"] for r in rows),
                            "save_anon_mib_max": max(r["save_peak_anon_mib"] for r in rows),
                            "load_peak_mib_max": max(r["load_peak_mib"] for r in rows),
                            "load_anon_mib_max": max(r["load_peak_anon_mib"] for r in rows),
                            "disk_mib": rows[0]["disk_mib"]})
            print(json.dumps(results[-1] | {"per_rank": None}))
    lines = ["# Step-checkpoint save and load: sharded vs gathered",
             "",
             "SmolLM2-135M full finetune (134.5M parameters, fp32, AdamW state after one step: 1.6 GiB in all), "
             "gloo on the",
             "2-core CPU, FSDP2 over every rank where there are several. Produced by "
             "`python -m benchmarks.checkpoint_io`;",
             "method in its docstring. Times are the slowest rank's; peak RSS is what the phase added to a process",
             "(rank 0: where a gathered save concentrates; max: the worst rank); anonymous RSS leaves out the pages of",
             "memory-mapped files (safetensors maps the files it reads; the kernel can drop those pages). Both formats",
             "of one rank count ran back to back: compare within a rank count (ratios), not absolute times.",
             "",
             "| ranks | format | save s | load s | save peak RSS rank 0 (MiB) | save peak RSS max | "
             "save peak anon max | load peak RSS max | load peak anon max | on disk (MiB) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['ranks']} | {r['format']} | {r['save_s']:.2f} | {r['load_s']:.2f} | "
                     f"{r['save_peak_mib_rank0']:.0f} | {r['save_peak_mib_max']:.0f} | {r['save_anon_mib_max']:.0f} | "
                     f"{r['load_peak_mib_max']:.0f} | {r['load_anon_mib_max']:.0f} | {r['disk_mib']:.0f} |")
    lines += ["", "Ratios (gathered / sharded, same rank count):", ""]
    by = {(r["ranks"], r["format"]): r for r in results}
    for n in RANKS:
        g, s = by[(n, "gathered")], by[(n, "sharded")]
        lines.append(f"- {n} rank(s): save time {g['save_s'] / s['save_s']:.2f}x, load time "
                     f"{g['load_s'] / s['load_s']:.2f}x, rank-0 save peak RSS "
                     f"{g['save_peak_mib_rank0'] / max(s['save_peak_mib_rank0'], 1):.1f}x, load peak anonymous RSS "
                     f"{g['load_anon_mib_max'] / max(s['load_anon_mib_max'], 1):.1f}x")
    write_pair(BENCH / "checkpoint_io", results, lines)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3])
    else:
        main()
