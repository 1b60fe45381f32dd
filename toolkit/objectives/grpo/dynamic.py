"""`--dynamic-sampling`: DAPO's dynamic sampling (Yu et al. 2025, "DAPO", Algorithm 1). A step's prompt groups whose
rewards all agree carry no advantage (each is 0); they are dropped and the step's batch refilled from the next
prompts, sampled and scored as the first ones were, until it holds the P groups a step trains or
`--dynamic-sampling-rounds` extra rounds have been sampled; a batch still short is filled with the first agreeing
groups (they train nothing: their advantages are 0), and the run says so once.

The same on every layout: each attempt samples a whole prompt batch, each rank its share (`Rollouts.sample`),
the rewards are gathered, every rank keeps the same groups (`informative_groups`), and the kept completions are
gathered too (their tokens, tool masks, prompts), so the step's batch is the kept groups in (attempt, prompt,
generation) order and each rank takes its share of it, as without the filter. Which prompts come next is a
cursor over the epochs' seeded permutations (prompt batches), kept in every checkpoint (`Rollouts.state_dict`).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch

from toolkit.objectives.grpo.functions import informative_groups, weighted_rewards


def attempt(r, batch: int, step: int, n: int) -> tuple[list[dict], torch.Tensor]:
    """(every rank's completions of prompt batch `batch`, in (prompt, generation) order, each a dict of what the
    step's micro-batches and log need; their rewards (P x G, functions)), sampled with `step`'s seeds, the `n`-th
    attempt's (0: the step's own; a prompt the next epoch brings back within the step draws anew)."""
    from toolkit.objectives.grpo.sampling import turn_seed

    rows, prompt_ids, seeds, _ = r.rows_of([batch], step)
    seeds = [turn_seed(s, -n) for s in seeds]
    envs, tools = None, None
    if r.toolbox is not None:
        r.toolbox.begin_round()
        prompt_ids, envs, tools = r.toolbox.open(r.prompts, rows)
    t0 = time.perf_counter()
    completions, paths = r.sample(prompt_ids, seeds, rows, tools)
    sampled = time.perf_counter()
    texts, rewards = r.score(rows, completions, step, paths, envs)
    r.metrics.generate_s += sampled - t0
    r.metrics.score_s += time.perf_counter() - sampled
    mask = completions.mask if completions.tool_mask is None else completions.mask * completions.tool_mask
    r.metrics.generated_tokens += int(mask.sum())
    ids = completions.token_lists()
    tools_mask = None if completions.tool_mask is None else \
        [m[:len(x)].tolist() for m, x in zip(completions.tool_mask.cpu(), ids)]
    mine = [{"row": row, "prompt_ids": list(p), "ids": x, "tool_mask": None if tools_mask is None else tools_mask[i],
             "truncated": bool(t), "logged": (paths or texts)[i]}
            for i, (row, p, x, t) in enumerate(zip(rows, prompt_ids, ids, completions.truncated.tolist()))]
    every = dict(r.run.strategy.gather_objects((r.data.rank, mine)))
    return [c for rank in range(r.data.ranks) for c in every[rank]], rewards


def step_batch(r, step: int) -> tuple[list[dict], torch.Tensor, int]:
    """(the step's P x G completions, their rewards, the last prompt batch sampled): informative groups from as
    many prompt batches as it takes, within the cap."""
    P, G = r.P, r.G
    kept, agreed, dropped, rounds, last = [], [], 0, 0, r.cursor
    while len(kept) < P and rounds <= r.dynamic_rounds:
        last, r.cursor = r.cursor, r.cursor + 1
        rounds += 1
        completions, rewards = attempt(r, last, step, rounds - 1)
        keep = informative_groups(weighted_rewards(rewards, r.weights), G)
        for g in range(P):
            group = (completions[g * G:(g + 1) * G], rewards[g * G:(g + 1) * G])
            (kept if keep[g] else agreed).append(group)
        dropped += int((~keep).sum())
    m = r.metrics
    m.dropped_groups += dropped
    m.sampling_rounds.append(rounds)
    if len(kept) < P:
        m.filled_groups += P - len(kept)
        if not r.said_filled:
            r.said_filled = True
            r.run.warn(f"warning: --dynamic-sampling: step {step} found {len(kept)} of its {P} prompt groups with "
                       f"rewards that differ in {rounds} sampling rounds (--dynamic-sampling-rounds "
                       f"{r.dynamic_rounds} extra); the rest of its batch is groups whose rewards agree, which train "
                       "nothing (said once; dynamic_sampling/filled_groups counts them)")
        kept += agreed[:P - len(kept)]
    kept = kept[:P]
    return [c for group, _ in kept for c in group], torch.cat([rw for _, rw in kept]), last


def dynamic_round(r, first: int) -> list[tuple[int, list[dict]]]:
    """`Rollouts.round` under --dynamic-sampling: the K x mu steps from `first`, each step's batch from
    `step_batch`, this rank's share of it cut into micro-batches."""
    t0 = time.perf_counter()
    out, epochs = [], []
    pad = r.run.tokenizer.pad_token_id
    # a round abandoned part-way (a stop while it samples) is sampled again from its start on resume
    cursor = r.cursor
    try:
        out, epochs = steps_of(r, first, pad)
    except BaseException:
        r.cursor = cursor
        raise
    r.seconds += time.perf_counter() - t0
    return [(epoch, micro) for _ in range(r.mu) for epoch, micro in zip(epochs, out)]


def steps_of(r, first: int, pad: int) -> tuple[list, list[int]]:
    """(each of the round's K steps' micro-batches on this rank, its epoch)."""
    from toolkit.objectives.grpo.sampling import Completions

    out, epochs = [], []
    for k in range(r.K):
        step = first + k
        completions, rewards, last = step_batch(r, step)
        share = [completions[i] for i in r.mine()]
        tools = [c["tool_mask"] for c in share] if share[0]["tool_mask"] is not None else None
        batch = Completions.from_lists([c["ids"] for c in share], [c["truncated"] for c in share], tools, pad,
                                       r.run.strategy.accelerator.device)
        advantages = r.advantages(rewards, 1)
        out += r.micro_batches([last], [c["row"] for c in share], [c["prompt_ids"] for c in share], batch,
                               advantages)
        epochs.append(r.epoch_of(last))
        log_kept(r, step, completions, rewards)
    return out, epochs


def log_kept(r, step: int, completions: list[dict], rewards: torch.Tensor) -> None:
    """The step's trained completions and their rewards into completions.jsonl, on its cadence (main process)."""
    run = r.run
    every = run.cfg.rl.log_completions_every or run.log_every
    if not (step % every == 0 or step == 1) or not run.strategy.accelerator.is_main_process:
        return
    names = [w.name for w in r.rewards]
    with open(Path(run.out_dir) / "completions.jsonl", "a") as f:
        for c, scores in zip(completions, rewards.tolist()):
            f.write(json.dumps({"step": step, "prompt": r.prompts.prompts[c["row"]], "completion": c["logged"],
                                "rewards": {n: (None if math.isnan(v) else v) for n, v in zip(names, scores)}},
                               default=str) + "\n")
