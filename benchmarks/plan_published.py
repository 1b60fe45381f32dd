"""What the planner chooses for Llama 3 8B / 70B / 3.1 405B, full and LoRA, on 8, 64 and 512 H100s
(80 GB, 8 per node) at 4k, 32k and 128k tokens, global batch 64 sequences: the table in
docs/planner.md ("Sanity on published setups"), printed as markdown. Nothing is trained: these are the
planner's estimates.

    python -m benchmarks.plan_published > /tmp/table.md
"""

from __future__ import annotations

import argparse

from toolkit.parallel.tree import tree_problem
from toolkit.planner.estimate import GiB, PlanInput
from toolkit.planner.explain import plan
from toolkit.planner.presets import PRESETS

MODELS = ("llama-3-8b", "llama-3-70b", "llama-3.1-405b")
GLOBAL_BATCH = 64


def main() -> None:
    # no options: --help says what it measures
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    print("| model | method | GPUs | seq | chosen | mb x accum | GiB/GPU | predicted tokens/s/GPU | "
          "runner-up (why it lost) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for model in MODELS:
        for method in ("full", "lora"):
            for gpus in (8, 64, 512):
                for seq in (4096, 32768, 131072):
                    r = plan(PlanInput(model=PRESETS[model], gpu_memory=80 * GiB, gpus_per_node=8, nodes=gpus // 8,
                                       cpu_memory=2 * 1024**4, method=method, seq_len=seq, global_batch=GLOBAL_BATCH,
                                       tree_check=tree_problem))
                    head = f"| {model} | {method} | {gpus} | {seq // 1024}k |"
                    if not r.chosen:
                        print(f"{head} nothing fits | | | | {r.advice.split(';')[0]} |")
                        continue
                    d = r.chosen_detail
                    tokens = d.examples_per_step * r.grad_accum * seq / d.step_time_s / r.world
                    # the runner-up: the ranking lists the chosen first, then the rest
                    second = next((x for x in r.ranking
                                   if x["name"] != d.name or x["checkpointing"] != d.checkpointing), None)
                    lost = (f"{second['name']}{' +gc' if second['checkpointing'] else ''}: {second['reason']}"
                            if second else "")
                    print(f"{head} {d.name}{' +gc' if d.checkpointing else ''} | {d.micro_batch} x {r.grad_accum} | "
                          f"{d.bytes['total'] / GiB:.0f} | {tokens:,.0f} | {lost} |")


if __name__ == "__main__":
    main()
