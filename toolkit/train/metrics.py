"""Run metrics: one JSON object per logged step in metrics.jsonl, the `--report-to` trackers
(`toolkit.train.trackers`), a progress bar on rank 0 and loss.png at the end. Only the main process
writes."""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator


# --log-every 0: about this many records, whatever the run's length
RECORDS_PER_RUN = 50


def log_interval(log_every: int, total_steps: int) -> int:
    """Steps between metrics records: --log-every, or for 0 about `RECORDS_PER_RUN` per run (every step
    in a run shorter than that)."""
    return log_every or max(1, total_steps // RECORDS_PER_RUN)


class MetricsLogger:
    def __init__(self, out_dir: Path, total_steps: int, enabled: bool, done: int = 0, trackers=None):
        """`done`: steps a resumed run starts past; the bar starts there and its rate counts only
        the steps this run takes. `trackers`: the run's `toolkit.train.trackers.Trackers`, started
        before the model loaded (`start_trackers`)."""
        self.enabled = enabled
        self.path = out_dir / "metrics.jsonl"
        self.records: list[dict[str, Any]] = []
        self._bar = self.trackers = None
        # False once a write failed
        self._writing = enabled
        if not enabled:
            return
        from tqdm.auto import tqdm

        from toolkit.train.trackers import Trackers

        self._file = self.path.open("a", buffering=1)
        self._bar = tqdm(total=total_steps, initial=done, desc="train", unit="step", dynamic_ncols=True)
        self.trackers = trackers if trackers is not None else Trackers([], out_dir, {}, self.write)
        # a tracker dropped mid-run: a line above the bar
        self.trackers.say = self.write

    def log(self, record: dict[str, Any]) -> None:
        """Append a record (must hold `step`); its numbers also go to the trackers under their keys."""
        if not self.enabled:
            return
        self.records.append(record)
        if self._writing:
            try:
                self._file.write(json.dumps(record) + "\n")
            # a full disk: said once, training goes on (the next checkpoint stops it cleanly)
            except OSError as e:
                self._writing = False
                self.write(f"{self.path}: could not write ({(e.strerror or str(e)).lower()}); metrics are not "
                           f"recorded from step {record['step']} on")
        self.trackers.log(record, record["step"])
        if "loss" in record:
            self._bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record.get('tokens_per_sec', 0):.0f}")

    def samples(self, step: int, prompts: list[str], completions: list[str]) -> None:
        """Sample generations: samples.jsonl (step, prompt, completion) and a table in the trackers."""
        if not self.enabled:
            return
        with open(self.path.parent / "samples.jsonl", "a") as f:
            f.writelines(json.dumps({"step": step, "prompt": p, "completion": c}) + "\n"
                         for p, c in zip(prompts, completions))
        self.trackers.table("samples", ["step", "prompt", "completion"],
                            [[step, p, c] for p, c in zip(prompts, completions)], step)

    @contextmanager
    def pause(self, what: str) -> Iterator[None]:
        """The bar names `what` (eval, samples) while it runs, and its time is kept out of the bar's rate
        and ETA (tqdm's `unpause`), so the estimate does not jump after it."""
        if self._bar is None:
            yield
            return
        self._bar.set_description_str(f"train ({what})", refresh=True)
        try:
            yield
        finally:
            self._bar.set_description_str("train", refresh=False)
            self._bar.unpause()
            self._bar.refresh()

    def advance(self, steps: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(steps)

    def write(self, message: str) -> None:
        """Print without breaking the progress bar."""
        if self.enabled:
            (self._bar.write if self._bar is not None else print)(message)

    def close(self) -> None:
        if not self.enabled or self._file.closed:
            return
        self._bar.close()
        self.trackers.finish()
        # a full disk was said when it was met (or is said by the save that met it): not again here
        try:
            self._file.close()
            plot_loss(read_records(self.path) if self._writing else self.records, self.path.parent / "loss.png")
        except OSError:
            pass


def read_records(path: Path) -> list[dict[str, Any]]:
    """Every record in metrics.jsonl: after a resume, the steps before it too (loss.png covers the run)."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# The reward-accuracy axis: headroom above 1.0, so a line at 1.0 (every pair ranked right) is drawn whole
# rather than along the frame, half cut off, and 1.0 is a tick.
ACCURACY_LIMITS = (0.0, 1.05)


def plot_loss(records: list[dict[str, Any]], path: Path) -> None:
    """loss.png through matplotlib's object API and its Agg canvas: no pyplot, whose import (backend
    selection, ~0.5 s on 2 cores) a run would otherwise pay for one figure."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
    # stopped before the first logged step: nothing to draw
    if not (train or evals):
        return
    fig = Figure(figsize=(6, 4))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    if train:
        ax.plot(*zip(*train), label="train loss")
    if evals:
        ax.plot(*zip(*evals), "o-", label="eval loss")
    ax.set_xlabel("step")
    accuracy = [(r["step"], r["rewards/accuracies"]) for r in records if "rewards/accuracies" in r]
    eval_accuracy = [(r["step"], r["eval_rewards/accuracies"]) for r in records if "eval_rewards/accuracies" in r]
    reward = [(r["step"], r["reward"]) for r in records if isinstance(r.get("reward"), (int, float))]
    eval_reward = [(r["step"], r["eval_reward"]) for r in records if "eval_reward" in r]
    ax.set_ylabel("loss (nats/token)" if not (accuracy or reward) else "loss (per pair)" if accuracy else "loss")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    # a preference objective: the reward accuracy beside the loss
    if accuracy:
        right = ax.twinx()
        right.plot(*zip(*accuracy), color="tab:green", alpha=0.7, label="reward accuracy")
        if eval_accuracy:
            right.plot(*zip(*eval_accuracy), "s-", color="tab:red", label="eval reward accuracy")
        right.set_ylim(*ACCURACY_LIMITS)
        right.set_ylabel("reward accuracy (chosen > rejected)")
        right.legend(loc="upper right")
    # --objective grpo: the sampled completions' mean reward (and the held-out prompts' greedy ones)
    if reward:
        right = ax.twinx()
        right.plot(*zip(*reward), ".-", color="tab:green", alpha=0.7, label="reward")
        if eval_reward:
            right.plot(*zip(*eval_reward), "s-", color="tab:red", label="eval reward (greedy)")
        right.set_ylabel("reward")
        right.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
