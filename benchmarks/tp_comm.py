"""Tensor-parallel communication per training step: bytes all-reduced, measured vs expected.

Megatron's count for a transformer block split over t ranks: two all-reduces of b*s*h in forward
(after the attention and MLP row-parallel layers) and two in backward (at the attention and MLP
inputs), each of b*s*h elements (Shoeybi et al. 2019, "Megatron-LM", section 3, figure 4). Per step:
    expected = 2 * L * b * s * h * bytes_per_element   forward, and the same in backward
With gradient checkpointing the forward all-reduces run again during backward's recompute.
Measured: `toolkit.parallel.traffic.counting("tp")`, which every all-reduce adds its bytes to.

    python -m benchmarks.tp_comm            # writes benchmarks/tp_comm.{json,md}

Also times one step on this machine at tp=1 and tp=2 (same per-rank batch): on a 2-core CPU that
ratio says little about GPUs; it is recorded, not claimed.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch

from benchmarks.common import BENCH, median_seconds, save_llama, spawn_ranks, write_pair

SHAPES = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
              num_key_value_heads=4, vocab_size=1024)
CASES = [  # (name, micro-batch, seq, method, checkpointing)
    ("full b2 s128", 2, 128, "full", False),
    ("full b4 s256", 4, 256, "full", False),
    ("lora b4 s256", 4, 256, "lora", False),
    ("full b4 s256 +gc", 4, 256, "full", True),
]
STEPS = 3


def megatron_bytes(layers: int, b: int, s: int, h: int, elem: int = 4) -> int:
    """Megatron-LM: 2 all-reduces of b*s*h per block in one direction (forward or backward)."""
    return 2 * layers * b * s * h * elem


def expected_bytes(layers: int, b: int, s: int, h: int, method: str, checkpointing: bool, r: int = 16,
                   elem: int = 4) -> dict[str, int]:
    """The base count plus what this toolkit's plan adds or saves, term by term:
    - checkpointing (non-reentrant) recomputes each block in backward but stops early once the
      saved tensors exist again, so the attention's all-reduce repeats and the MLP's (the block's
      last op) does not: + L * b*s*h in forward;
    - LoRA on o/down (row-parallel): lora_A's r-dim output is all-reduced: + 2 * L * b*s*r forward;
    - LoRA leaves the embeddings frozen, so no gradient is needed below block 0's attention input
      and autograd skips that one backward all-reduce: - b*s*h;
    - LoRA on q/k/v/gate/up (column-parallel): lora_A (r x h) is replicated with a per-rank partial
      gradient, summed over the TP group: 5 * L * r*h per step ("param" below)."""
    bsh = b * s * h * elem
    lora = method == "lora"
    return {"forward": megatron_bytes(layers, b, s, h, elem) + (layers * bsh if checkpointing else 0)
            + (2 * layers * b * s * r * elem if lora else 0),
            "backward": megatron_bytes(layers, b, s, h, elem) - (bsh if lora else 0),
            "param": 5 * layers * r * h * elem if lora else 0}


def _worker(rank: int, world: int, folder: str) -> list[dict]:
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    import torch.distributed as dist
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from toolkit.parallel.parallelize import apply_checkpointing
    from toolkit.parallel.tp import apply_tensor_parallel, make_layout
    from toolkit.parallel.traffic import counting
    from toolkit.objectives.sft.loss import token_loss_sum

    layout = make_layout(world)
    rows = []
    for name, b, s, method, gc in CASES:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        if gc:
            apply_checkpointing(model)
        if method == "lora":
            model = get_peft_model(model, LoraConfig(r=16, target_modules="all-linear", lora_dropout=0.0))
        model = apply_tensor_parallel(model, layout.tp_group)
        model.train()
        ids = torch.randint(0, SHAPES["vocab_size"], (b, s), generator=torch.Generator().manual_seed(1))

        def step() -> None:
            token_loss_sum(model(input_ids=ids).logits, ids).backward()
            dist.barrier()

        step()  # warms up; neither its time nor its traffic is counted
        with counting("tp") as sent:
            step_s = median_seconds(step, STEPS)
        rows.append({"case": name, "micro_batch": b, "seq": s, "method": method, "checkpointing": gc,
                     "forward_bytes": sent["forward"] // STEPS, "backward_bytes": sent["backward"] // STEPS,
                     "backward_param_bytes": sent["backward_param"] // STEPS,
                     "forward_calls": sent["forward_calls"] // STEPS, "backward_calls": sent["backward_calls"] // STEPS,
                     "step_s": step_s})
    return rows


def main() -> None:
    # no options: --help says what it measures
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        save_llama(tmp, **SHAPES, max_position_embeddings=512)
        single, tp2 = spawn_ranks(_worker, 1, tmp)[0], spawn_ranks(_worker, 2, tmp)[0]
    L, h = SHAPES["num_hidden_layers"], SHAPES["hidden_size"]
    rows = []
    for one, two in zip(single, tp2):
        exp = expected_bytes(L, two["micro_batch"], two["seq"], h, two["method"], two["checkpointing"])
        rows.append({**two, "megatron_bytes": megatron_bytes(L, two["micro_batch"], two["seq"], h),
                     **{f"expected_{k}_bytes": v for k, v in exp.items()},
                     "forward_ratio": two["forward_bytes"] / exp["forward"],
                     "backward_ratio": two["backward_bytes"] / exp["backward"],
                     "tp1_step_s": one["step_s"], "tp1_bytes": one["forward_bytes"] + one["backward_bytes"],
                     "tp2_over_tp1_time": two["step_s"] / one["step_s"]})
    meta = {"model": SHAPES, "dtype": "float32", "tp": 2, "backend": "gloo", "steps": STEPS,
            "machine": f"{os.cpu_count()} CPU cores", "torch": torch.__version__}
    lines = ["# Tensor-parallel all-reduce bytes per step (tp=2, fp32, gloo)", "",
             f"Model: Llama {SHAPES}. Reproduce: `python -m benchmarks.tp_comm`. Megatron's count is "
             "2 x L x b x s x h x 4 bytes per direction (Megatron-LM section 3); `expected` adds the terms in "
             "`expected_bytes` (checkpointing recompute, LoRA's r-dim and adapter-gradient all-reduces).", "",
             "| case | Megatron count | fwd bytes | expected | ratio | bwd bytes | expected | ratio | "
             "LoRA grad bytes (expected) | all-reduces fwd/bwd | step s tp1 | step s tp2 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['megatron_bytes']:,} | {r['forward_bytes']:,} | "
                     f"{r['expected_forward_bytes']:,} | "
                     f"{r['forward_ratio']:.3f} | {r['backward_bytes']:,} | {r['expected_backward_bytes']:,} | "
                     f"{r['backward_ratio']:.3f} | {r['backward_param_bytes']:,} ({r['expected_param_bytes']:,}) | "
                     f"{r['forward_calls']}/{r['backward_calls']} | {r['tp1_step_s']:.3f} | {r['step_s']:.3f} |")
    lines += ["", f"tp1 runs moved {sum(r['tp1_bytes'] for r in rows)} bytes (no TP group). "
              f"Machine: {meta['machine']}, torch {meta['torch']}. Step time = median of {STEPS} forward+backward "
              "passes after one warm-up; on 2 CPU cores with gloo, tp2 is slower than tp1 (two ranks share the cores "
              "and add all-reduces): recorded, not a claim about GPUs."]
    write_pair(BENCH / "tp_comm", {"meta": meta, "rows": rows}, lines)


if __name__ == "__main__":
    main()
