"""The output folder and what the run tells the user about its data and its result."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from toolkit.config.chat_template import is_inline
from toolkit.config.columns import parse_columns
from toolkit.config.objectives import EXAMPLES, form
from toolkit.config.schema import DataConfig, OutputConfig, TrainConfig

if TYPE_CHECKING:
    from toolkit.data.table import DataStats

ARTIFACTS = ("metrics.jsonl", "tensorboard", "final", "final.tmp", "loss.png", "config.yaml", "summary.json",
             "integrity.json", "ds_config.json", "plan.json", "samples.jsonl", "mlruns", "wandb",
             "reference_logps.safetensors", "completions.jsonl")


def prepare_output_dir(output: OutputConfig, accelerator) -> Path:
    """Create the folder; with --overwrite-output-dir remove this toolkit's own earlier artifacts
    (never other files) so metrics of two runs do not mix."""
    out = Path(output.output_dir)
    if accelerator.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        if output.overwrite_output_dir:
            for name in ARTIFACTS:
                p = out / name
                shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
            for p in out.glob("checkpoint-*"):
                shutil.rmtree(p, ignore_errors=True)
    accelerator.wait_for_everyone()
    return out


def report_data(log, data_cfg: DataConfig, train: TrainConfig, chat_template: str, data,
                added_template: bool) -> None:
    """`data`: a `toolkit.data.prepare.PreparedData`, prepared with `data_cfg`."""
    example = EXAMPLES[train.objective]
    if example.form == "prompts":
        from toolkit.data.prepare import describe_prompts

        log(describe_prompts(data_cfg, data))
        return
    examples, stats, n_eval = data, data.stats, len(data.eval)
    how = "detected from columns" if examples.detected else "from --format"
    if data_cfg.columns:
        how += ", columns " + ", ".join(f"{yours} -> {ours}" for ours, yours in parse_columns(data_cfg.columns).items())
    unit = example.unit
    if data.streamed:
        log(f"data: {data_cfg.dataset}: format {examples.format} ({how}); streamed in file order, tokenized as "
            "training reads it")
        _eval_file_line(log, data_cfg.eval_dataset, data, unit)
        return
    log(f"data: {data_cfg.dataset}: format {examples.format} ({how}); {stats.examples - stats.dropped} training "
        f"{unit}, {n_eval} eval; {token_counts(stats, train.objective)}"
        + (" (tokenized data read from the cache)" if stats.cached else ""))
    for spec, fmt, weight, n in examples.sources or []:
        log(f"data: mixture source {spec}: format {fmt}, weight {weight:.3f}, {n} training records")
    _eval_file_line(log, data_cfg.eval_dataset, data, unit)
    if example.form == "labelled":
        from toolkit.data.pairs import kto_balance

        log(kto_balance(data.train.desirable(), train.desirable_weight, train.undesirable_weight))
    if examples.system_added:
        log(f"data: --system-prompt added to {examples.system_added} conversation(s) without a system message")
    if stats.truncated:
        log(f"data: {stats.truncated} example(s) longer than --seq-len {data_cfg.seq_len} were truncated")
    empty = stats.empty + data.eval_stats.empty
    if empty:
        texts = "text" if examples.format == "text" else "answer or text" if "text" in examples.format else "answer"
        sides = {"conversations": texts, "labelled": "completion"}.get(example.form, "'chosen' or 'rejected'")
        held = f" ({data.eval_stats.empty} of them from the eval data)" if data.eval_stats.empty else ""
        log(f"data: {empty} more {unit[:-1]}(s) dropped, not counted above: an empty or whitespace-only {sides}{held}")
    blanks = stats.blank_turns + data.eval_stats.blank_turns
    if blanks:
        log(f"data: {blanks} empty or whitespace-only assistant turn(s) left untrained in the conversations kept "
            "(their other answers train)")
    if stats.dropped - stats.empty:
        log(f"data: {stats.dropped - stats.empty} more {unit[:-1]}(s) dropped, not counted above: no answer tokens "
            "left after truncation")
    if chat_template:
        said = "written out in the config" if is_inline(chat_template) else chat_template
        log(f"data: chat template {said} (--chat-template), "
            "saved with the tokenizer")
    elif added_template:
        log("data: the tokenizer has no chat template; using the toolkit's fallback "
            "(<|role|>\\ncontent<eos>), saved with the tokenizer")


def _eval_file_line(log, eval_dataset: str, data, unit: str) -> None:
    if data.eval_format:
        held = data.eval_stats
        log(f"data: eval from --eval-dataset {eval_dataset}: format {data.eval_format}; "
            f"{held.examples - held.dropped} {unit}, {held.tokens} tokens"
            + (" (tokenized data read from the cache)" if held.cached else ""))


def token_counts(stats: DataStats, objective: str) -> str:
    """The data line's token counts, saying what they count: SFT's trained tokens are its answers'; a
    pair trains both completions, but its `targets` are the smaller side's completion tokens (the fewer
    of chosen and rejected: `toolkit.data.pairs.encode_pairs`), which "trained" alone would not say."""
    kind = form(objective)
    if kind == "pairs":
        return (f"{stats.tokens} tokens (prompt + chosen and prompt + rejected), {stats.target_tokens} completion "
                "tokens on the shorter side (per pair, the fewer of chosen's and rejected's)")
    if kind == "labelled":
        return f"{stats.tokens} tokens, {stats.target_tokens} trained (completions; the KL sequences not counted)"
    return f"{stats.tokens} tokens, {stats.target_tokens} trained"


@dataclass
class RunResult:
    summary: dict[str, Any]
    # the trained model, unwrapped (what final/ holds)
    model: Any


def summarize(log, objective: str, out: Path, result, scores: dict, accelerator, model) -> RunResult:
    summary = {"objective": objective, "steps": result.steps, "steps_this_run": result.steps_run,
               "final_loss": result.final_loss,
               "eval_loss": result.eval_loss, "tokens": result.tokens,
               "train_seconds": round(result.elapsed_before + result.elapsed_s, 1),
               "train_seconds_this_run": round(result.elapsed_s, 1), "final_dir": str(out / "final"),
               # this rank's, over the steps
               "peak_allocated_bytes": result.peak_allocated_bytes}
    for when, (correct, total, samples) in scores.items():
        summary[f"exact_match_{when}"] = correct / total
        if when == "after":
            for s in samples:
                log(f"  sample: {s}")
    if accelerator.is_main_process:
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
    ran = f"{result.steps} steps" if result.first_step == 1 else \
        f"{result.steps_run} steps ({result.first_step}-{result.steps}, resumed at step {result.first_step})"
    log(f"done: {ran} in {result.elapsed_s:.0f}s, final loss {result.final_loss:.4f}; saved {out / 'final'}")
    if "before" in scores and "after" in scores:
        (b, n, _), (a, _, _) = scores["before"], scores["after"]
        log(f"exact match on {n} held-out examples: before {b}/{n} ({b / n:.0%}) -> after {a}/{n} ({a / n:.0%})")
    return RunResult(summary, accelerator.unwrap_model(model))
