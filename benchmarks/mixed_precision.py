"""What FSDP2's mixed-precision policy changes in the numerics, against autocast.

The embedded default model (SmolLM2-135M, real weights: its first --layers blocks, embedding, final norm
and head; bf16 matmuls are slow on a CPU), one batch of the builtin data, full finetune: the loss and the gradients of
one forward/backward in fp32 (the reference), under bf16
autocast with fp32 weights (DDP and one process), and under FSDP2's policy (`toolkit.parallel.fsdp`:
bf16 gathers, fp32 reductions, no autocast; one gloo rank). Reports each one's loss error and the
relative L2 error of the gradients against fp32, and the dtype each variant computes the residual
stream, the norms' outputs and the logits in. Also the bytes saved for backward (what a forward leaves
alive: autocast's bf16 weight copies) and the forward+backward time, side by side.

    python -m benchmarks.mixed_precision [--layers 4] [--seq-len 128] [--rows 2] [--out benchmarks/mixed_precision]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch


def batch(tokenizer, rows: int, seq: int) -> torch.Tensor:
    from toolkit.data.builtin import builtin_records

    text = " ".join(str(r) for r in builtin_records("dates")[: rows * 40])
    ids = tokenizer(text, return_tensors="pt").input_ids[0]
    return ids[: rows * seq].reshape(rows, seq)


def dtypes_seen(model, ids) -> dict[str, str]:
    """The dtypes of the first block's input (the residual stream), its input norm's output and the logits."""
    seen = {}
    norm = model.model.layers[1].input_layernorm  # its input: the residual stream after a block

    def record(module, args, out):
        seen.setdefault("residual stream", str(args[0].dtype))
        seen.setdefault("norm output", str(out.dtype))

    hooks = [norm.register_forward_hook(record)]
    out = model(input_ids=ids)
    seen["logits"] = str(out.logits.dtype)
    for h in hooks:
        h.remove()
    return seen


def step(model, ids, autocast: bool):
    kept = []

    def pack(t):
        kept.append(t)
        return t

    params = {getattr(p, "_local_tensor", p).untyped_storage().data_ptr() for p in model.parameters()}
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model(input_ids=ids, labels=ids).loss
    saved = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in kept
                 if t.untyped_storage().data_ptr() not in params}.values())
    kept.clear()
    loss.backward()
    seconds = time.perf_counter() - t0
    grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).float().clone()
             for n, p in model.named_parameters()}
    return loss.item(), grads, saved, seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/mixed_precision")
    args = ap.parse_args()
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from toolkit.config import DEFAULT_MODEL
    from toolkit.model.source import resolve_model
    from toolkit.parallel.fsdp import apply_fsdp

    path = resolve_model(DEFAULT_MODEL)
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = batch(tokenizer, args.rows, args.seq_len)

    def load():
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, num_hidden_layers=args.layers).train()

    dist.init_process_group("gloo", store=dist.FileStore(tempfile.mktemp(), 1), rank=0, world_size=1)
    ref, autocast, policy = load(), load(), load()
    apply_fsdp(policy, list(policy.model.layers), init_device_mesh("cpu", (1,)), True, torch.bfloat16)
    variants = {"fp32": (ref, False), "bf16 autocast (DDP, one process)": (autocast, True),
                "bf16 FSDP2 policy": (policy, False)}
    results, base = {}, None
    for name, (model, use_autocast) in variants.items():
        runs = [step(model, ids, use_autocast) for _ in range(args.repeats)]
        loss, grads, saved, _ = runs[0]
        base = base or (loss, grads)
        num = sum(((grads[n] - base[1][n]) ** 2).sum() for n in grads)
        den = sum((base[1][n] ** 2).sum() for n in grads)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=use_autocast):
            seen = dtypes_seen(model, ids[:1])
        results[name] = {"loss": loss, "loss_error": abs(loss - base[0]) / base[0],
                         "grad_rel_l2_error": float((num / den) ** 0.5), "saved_bytes": saved,
                         "seconds_median": sorted(r[3] for r in runs)[len(runs) // 2], **seen}
    dist.destroy_process_group()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"model": f"SmolLM2-135M (embedded default), its first {args.layers} blocks",
            "tokens": f"{args.rows} x {args.seq_len}",
            "device": "cpu", "torch": torch.__version__, "threads": torch.get_num_threads(),
            "date": time.strftime("%Y-%m-%d")}
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    cols = ["loss", "loss_error", "grad_rel_l2_error", "saved_bytes", "seconds_median", "residual stream",
            "norm output", "logits"]
    lines = [f"# Mixed precision: autocast against FSDP2's policy ({meta['model']}, {meta['tokens']} tokens, "
             f"CPU, torch {meta['torch']}, {meta['date']})", "", "| variant | " + " | ".join(cols) + " |",
             "|---" * (len(cols) + 1) + "|"]
    for name, r in results.items():
        cells = [f"{r[c]:.3g}" if isinstance(r[c], float) else f"{r[c]:,}" if isinstance(r[c], int) else str(r[c])
                 for c in cols]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
