"""Run metrics: one JSON object per logged step in metrics.jsonl, TensorBoard events, a progress
bar on rank 0 and loss.png at the end. Only the main process writes."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


class MetricsLogger:
    def __init__(self, out_dir: Path, total_steps: int, enabled: bool, done: int = 0):
        """`done`: steps a resumed run starts past; the bar starts there and its rate counts only
        the steps this run takes."""
        self.enabled = enabled
        self.path = out_dir / "metrics.jsonl"
        self.records: list[dict[str, Any]] = []
        self._tb = self._bar = None
        self._writing = enabled  # False once a write failed
        if not enabled:
            return
        from torch.utils.tensorboard import SummaryWriter
        from tqdm.auto import tqdm

        self._file = self.path.open("a", buffering=1)
        self._tb = SummaryWriter(str(out_dir / "tensorboard"))
        self._bar = tqdm(total=total_steps, initial=done, desc="train", unit="step", dynamic_ncols=True)

    def log(self, record: dict[str, Any]) -> None:
        """Append a record (must hold `step`); numbers also go to TensorBoard under their key."""
        if not self.enabled:
            return
        self.records.append(record)
        if self._writing:
            try:
                self._file.write(json.dumps(record) + "\n")
            except OSError as e:  # a full disk: said once, training goes on (the next checkpoint stops it cleanly)
                self._writing = False
                self.write(f"{self.path}: could not write ({(e.strerror or str(e)).lower()}); metrics are not "
                           f"recorded from step {record['step']} on")
        for k, v in record.items():
            if k != "step" and isinstance(v, (int, float)) and math.isfinite(v):
                self._tb.add_scalar(k, v, record["step"])
        if "loss" in record:
            self._bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record.get('tokens_per_sec', 0):.0f}")

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
        try:  # a full disk was said when it was met (or is said by the save that met it): not again here
            self._tb.close()
            self._file.close()
            plot_loss(self.records, self.path.parent / "loss.png")
        except OSError:
            pass


def plot_loss(records: list[dict[str, Any]], path: Path) -> None:
    """loss.png through matplotlib's object API and its Agg canvas: no pyplot, whose import (backend
    selection, ~0.5 s on 2 cores) a run would otherwise pay for one figure."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
    if not (train or evals):  # stopped before the first logged step: nothing to draw
        return
    fig = Figure(figsize=(6, 4))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    if train:
        ax.plot(*zip(*train), label="train loss")
    if evals:
        ax.plot(*zip(*evals), "o-", label="eval loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
