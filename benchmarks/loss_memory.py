"""Peak memory of the loss step, full logits vs `--loss chunked`, at SmolLM2-135M's head shape.

The loss step is LM head + cross-entropy + backward from the final hidden states: hidden (b, s, 576)
-> logits (b, s, 49,152). Weights are random (memory does not depend on their values), fp32, CPU.
Method: each case runs in a fresh process; after the inputs exist, the kernel's peak-RSS mark is
reset (`echo 5 > /proc/self/clear_refs`, Linux >= 4.0), the step runs, and the peak is
VmHWM - VmRSS(before). PyTorch's CPU allocator returns large blocks to the OS at once, so RSS follows
live tensors. Head trainable (full finetune: its gradient, 113 MB, is part of both peaks) and frozen (LoRA).

    python -m benchmarks.loss_memory      # writes benchmarks/loss_memory.{json,md}
"""

from __future__ import annotations

import argparse
import sys

from benchmarks.common import BENCH, child_result, peak_rss_mib, print_result, reset_peak_rss, write_pair

H, V = 576, 49152  # SmolLM2-135M hidden size and vocabulary
CASES = [(1, 1024, True), (4, 1024, True), (1, 1024, False), (4, 1024, False)]


def child(b: int, s: int, trainable: bool, loss: str) -> dict:
    import torch

    from toolkit.objectives.sft.loss import chunked_loss_sum, token_loss_sum

    torch.set_num_threads(2)
    torch.manual_seed(0)
    head = torch.nn.Linear(H, V, bias=False).requires_grad_(trainable)
    hidden = torch.randn(b, s, H, requires_grad=True)
    labels = torch.randint(0, V, (b, s))
    before = reset_peak_rss()
    value = chunked_loss_sum(hidden, head, labels) if loss == "chunked" else token_loss_sum(head(hidden), labels)
    value.backward()
    return {"peak_mib": peak_rss_mib(before), "loss": value.item()}


def main() -> None:
    # no options: --help says what it measures
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    rows = []
    for b, s, trainable in CASES:
        row = {"batch": b, "seq": s, "head_trainable": trainable,
               "full_logits_mib": b * s * V * 4 / 2**20}
        for loss in ("full", "chunked"):
            got = child_result(["-m", "benchmarks.loss_memory", "--child", str(b), str(s), str(int(trainable)), loss],
                               what=f"{b} x {s} {loss}")
            row[f"{loss}_peak_mib"], row[f"{loss}_loss"] = got["peak_mib"], got["loss"]
        row["reduction"] = row["full_peak_mib"] / row["chunked_peak_mib"]
        rows.append(row)
        print(row)
    lines = ["# Loss-step peak memory: full logits vs `--loss chunked` (SmolLM2-135M head: h 576, vocab 49,152, "
             "fp32, CPU)",
             "", "Reproduce: `python -m benchmarks.loss_memory`. Method (peak RSS per fresh process) in its docstring.",
             "",
             "| batch x seq | LM head | fp32 logits alone | full peak MiB | chunked peak MiB | reduction | "
             "loss (full / chunked) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['batch']} x {r['seq']} | {'trainable' if r['head_trainable'] else 'frozen (LoRA)'} | "
                     f"{r['full_logits_mib']:.0f} MiB | {r['full_peak_mib']:.0f} | {r['chunked_peak_mib']:.0f} | "
                     f"{r['reduction']:.1f}x | {r['full_loss']:.2f} / {r['chunked_loss']:.2f} |")
    write_pair(BENCH / "loss_memory", {"hidden": H, "vocab": V, "dtype": "float32", "rows": rows}, lines)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print_result(child(int(sys.argv[2]), int(sys.argv[3]), bool(int(sys.argv[4])), sys.argv[5]))
    else:
        main()
