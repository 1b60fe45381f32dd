"""A resolved `Config` checked as a whole (`validate`: cross-field and range checks, every problem
collected and returned together, the torchtitan/litgpt habit; which layouts may run is
`toolkit.layout.rules`' to say), and why a run's micro-batches cannot reach the model padding-free
(`padding_free_blocked`).
"""

from __future__ import annotations

import os

from toolkit.config.chat_template import template_problems
from toolkit.config.columns import column_problems
from toolkit.config.hub import repo_problems
from toolkit.config.objectives import generates, objective_problems
from toolkit.config.output_dir import output_dir_problems
from toolkit.config.paths import (dataset_problems, eval_dataset_problems, sample_problems, streaming_problems,
                                  unused_columns_problems)
from toolkit.config.schema import Config
from toolkit.config.trackers import spec_problems as tracker_problems
from toolkit.layout.rules import layout_problems


def validate(cfg: Config) -> list[str]:
    """Cross-field and range checks; returns every problem found (empty list = fine). Which layouts
    may run is `toolkit.layout.rules`' to say."""
    p: list[str] = []
    m, d, t, o = cfg.model, cfg.data, cfg.train, cfg.output

    def need(cond: bool, msg: str) -> None:
        if not cond:
            p.append(msg)

    need(m.lora_r > 0, f"--lora-r must be > 0 (got {m.lora_r})")
    need(m.lora_alpha > 0, f"--lora-alpha must be > 0 (got {m.lora_alpha})")
    need(0.0 <= m.lora_dropout < 1.0, f"--lora-dropout must be in [0, 1) (got {m.lora_dropout})")
    need(bool(m.lora_targets.strip(", ")), "--lora-targets is empty (use 'all-linear' or module names)")
    need(d.seq_len >= 8, f"--seq-len must be >= 8 (got {d.seq_len})")
    need(0.0 <= d.eval_split < 1.0, f"--eval-split must be in [0, 1) (got {d.eval_split})")
    need(t.micro_batch_size >= 1, f"--micro-batch-size must be >= 1 (got {t.micro_batch_size})")
    need(t.grad_accum >= 1, f"--grad-accum must be >= 1 (got {t.grad_accum})")
    need(t.lr is None or t.lr > 0, f"--lr must be > 0 (got {t.lr})")
    need(t.warmup_steps >= 0, f"--warmup-steps must be >= 0 (got {t.warmup_steps})")
    need(t.weight_decay >= 0, f"--weight-decay must be >= 0 (got {t.weight_decay})")
    need(t.max_grad_norm >= 0, f"--max-grad-norm must be >= 0 (got {t.max_grad_norm})")
    need(t.epochs >= 1 or t.max_steps > 0, f"--epochs must be >= 1 (got {t.epochs})")
    need(t.max_steps != 0, "--max-steps must be > 0, or -1 to use --epochs")
    need(o.log_every >= 0, f"--log-every must be >= 0 (got {o.log_every}; 0 = about 50 records per run)")
    need(o.sample_every >= 0, f"--sample-every must be >= 0 (got {o.sample_every})")
    need(o.sample_max_new_tokens >= 1, f"--sample-max-new-tokens must be >= 1 (got {o.sample_max_new_tokens})")
    held_out = d.eval_split > 0 or bool(d.eval_dataset)
    need(not (o.eval_on_start and not held_out),
         "--eval-on-start needs held-out data: set --eval-split (for example 0.05) or --eval-dataset FILE")
    p.extend(tracker_problems(o.report_to))
    p.extend(sample_problems(o.sample_prompts, cfg.parallel.pp, cfg.parallel.cp))
    need(o.eval_every >= 0, f"--eval-every must be >= 0 (got {o.eval_every})")
    need(o.save_every >= 0, f"--save-every must be >= 0 (got {o.save_every})")
    need(o.keep_last >= 0, f"--keep-last must be >= 0 (got {o.keep_last})")
    need(t.max_bad_steps >= 1, f"--max-bad-steps must be >= 1 (got {t.max_bad_steps})")
    need(not (o.resume and o.overwrite_output_dir),
         "--resume and --overwrite-output-dir contradict each other (overwriting deletes the checkpoints); drop one")
    need(not (o.eval_every > 0 and not held_out),
         "--eval-every needs held-out data: set --eval-split (for example 0.05) or --eval-dataset FILE")
    from toolkit.layout.launcher import nproc_problem

    p.extend(x for x in [nproc_problem(cfg.parallel.nproc_per_node, os.environ)] if x)
    p.extend(layout_problems(cfg.parallel, m.method, t.mixed_precision, t.loss, t.micro_batch_size, t.compile is True,
                             m.attn, t.objective if generates(t.objective) else None))
    p.extend(objective_problems(cfg))
    blocked = padding_free_blocked(cfg)
    need(not (d.padding_free and blocked), f"--padding-free: {blocked}; drop it (the batches are padded there)")
    if d.data_workers < 0:
        p.append(f"--data-workers must be >= 0 (0 = the node's cores; got {d.data_workers})")
    if d.streaming:
        p.extend(streaming_problems(d.dataset, d.eval_split, t.max_steps))
    p.extend(column_problems(d.columns))
    p.extend(template_problems(m.chat_template))
    p.extend(repo_problems(o.push_to_hub))
    need(not (o.hub_private and not o.push_to_hub), "--hub-private goes with --push-to-hub REPO")
    p.extend(unused_columns_problems(d.columns, d.dataset, d.eval_dataset))
    p.extend(dataset_problems(d.dataset))
    p.extend(eval_dataset_problems(d.eval_dataset, d.eval_split))
    p.extend(output_dir_problems(o.output_dir, o.overwrite_output_dir, o.resume, o.continue_finished, t.max_steps))
    return p


def padding_free_blocked(cfg: Config) -> str | None:
    """Why this run's micro-batches cannot reach the model padding-free (None: they can): a layout that cuts
    the collated rows (a row of a micro-batch's examples end to end cannot be split into pipeline micro-batches,
    and context parallel's slices run the model's own attention), or batches the loader does not make."""
    p = cfg.parallel
    if p.pp > 1:
        return f"--pp {p.pp} splits each micro-batch's rows into pipeline micro-batches"
    if p.cp > 1:
        return f"--cp {p.cp} cuts each row into slices, attended by the model's own attention"
    if cfg.train.objective == "grpo":
        return "--objective grpo trains on sampled completions, not on the loader's batches"
    return None
