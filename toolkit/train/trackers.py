"""`--report-to`: experiment trackers beside metrics.jsonl, through accelerate's tracker classes
(`accelerate.tracking`: `start`, `store_init_configuration`, `log`, `finish`), on the main process.

- tensorboard: `OUTPUT_DIR/tensorboard` (the default).
- mlflow: a file store under `OUTPUT_DIR/mlruns` unless `MLFLOW_TRACKING_URI` is set.
- wandb: offline (files under `OUTPUT_DIR/wandb`) when `WANDB_MODE=offline` or api.wandb.ai cannot be
  reached; `wandb sync` uploads such a run later.
- trackio: its local store.

A tracker whose package is missing is refused at start (config validation,
`toolkit.config.trackers.spec_problems`). One that cannot start (a store it refuses, a server it cannot
reach) stops the run before the model loads, in one line (`start_trackers`): a run that was asked to
report somewhere and silently did not is lost to whoever watches that dashboard. One that fails while
the run goes on is said once and dropped: a dashboard never stops training.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Callable

from toolkit.errors import UserError


def _reachable(host: str, port: int = 443, timeout: float = 2.0) -> bool:
    import socket

    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy")):
        # behind a proxy a direct probe proves nothing
        return True
    try:
        socket.create_connection((host, port), timeout=timeout).close()
        return True
    except OSError:
        return False


# the run folder's store this process last pointed mlflow at
_OUR_MLFLOW_URI: str | None = None


def _make(name: str, out_dir: Path, run_name: str):
    from accelerate import tracking

    if name == "tensorboard":
        return tracking.TensorBoardTracker("tensorboard", out_dir)
    if name == "mlflow":
        import mlflow

        global _OUR_MLFLOW_URI
        given = os.environ.get("MLFLOW_TRACKING_URI")
        # mlflow exports the URI it is set to: an earlier run's folder
        if given and given == _OUR_MLFLOW_URI:
            given = None
        # this run's folder
        if not given:
            # mlflow 3 keeps the file store in maintenance and refuses it unless asked: a file store in the
            # run's folder is what an offline machine has (sqlite needs SQLAlchemy, not in mlflow-skinny)
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            _OUR_MLFLOW_URI = (out_dir / "mlruns").absolute().as_uri()
        # set every time: mlflow keeps the last URI set in the process, which an earlier run (batched runs, a
        # notebook) would otherwise leave in place of the user's MLFLOW_TRACKING_URI or this run's folder
        mlflow.set_tracking_uri(given or _OUR_MLFLOW_URI)
        return tracking.MLflowTracker(experiment_name=os.environ.get("MLFLOW_EXPERIMENT_NAME", "toolkit"),
                                      run_name=run_name)
    if name == "wandb":
        if os.environ.get("WANDB_MODE") != "offline" and not _reachable("api.wandb.ai"):
            os.environ["WANDB_MODE"] = "offline"
        os.environ.setdefault("WANDB_DIR", str(out_dir))
        return tracking.WandBTracker(os.environ.get("WANDB_PROJECT", "toolkit"), name=run_name)
    return tracking.TrackioTracker(os.environ.get("TRACKIO_PROJECT", "toolkit"), name=run_name)


def _why(e: Exception) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"


def start_failure(name: str, e: Exception) -> str:
    """One line: the tracker, what refused it, and the fix."""
    fix = f"fix its settings, or leave {name} out of --report-to (metrics.jsonl is always written)"
    if name == "mlflow" and os.environ.get("MLFLOW_TRACKING_URI"):
        fix = (f"MLFLOW_TRACKING_URI={os.environ['MLFLOW_TRACKING_URI']} is what it refused: point it at a tracking "
               "server or a store this mlflow accepts, unset it to write OUTPUT_DIR/mlruns, or "
               f"{fix.split(', or ')[1]}")
    return f"--report-to {name} could not start ({_why(e)}); {fix}"


class Trackers:
    """The run's trackers on the main process (none elsewhere). `say` prints one line (the progress
    bar's write). Raises UserError, after closing the ones already started, when one cannot start."""

    def __init__(self, names: list[str], out_dir: Path, config: dict[str, Any], say: Callable[[str], None]):
        self.say, self.live = say, []
        hparams = {k: v if isinstance(v, (bool, int, float, str)) or v is None else str(v) for k, v in config.items()}
        for name in names:
            try:
                tracker = _make(name, out_dir, out_dir.absolute().name)
                tracker.start()
                tracker.store_init_configuration(hparams)
            except Exception as e:  # noqa: BLE001 - whatever the tracker raises: one line, the run stops
                self.finish()
                raise UserError(start_failure(name, e)) from None
            self.live.append((name, tracker))

    def _drop(self, name: str, e: Exception) -> None:
        self.live = [(n, t) for n, t in self.live if n != name]
        self.say(f"--report-to {name}: {_why(e)}; {name} is left out for the rest of the run")

    def _each(self, fn: Callable[[str, Any], None]) -> None:
        for name, tracker in list(self.live):
            try:
                fn(name, tracker)
            except Exception as e:  # noqa: BLE001
                self._drop(name, e)

    def log(self, values: dict[str, Any], step: int) -> None:
        """A metrics record's numbers; a per-rank list (the memory figures) as `key/rankN`."""
        numbers = {}
        for k, v in values.items():
            for key, x in ([(f"{k}/rank{i}", x) for i, x in enumerate(v)] if isinstance(v, list) else [(k, v)]):
                if k != "step" and isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x):
                    numbers[key] = x
        self._each(lambda name, t: t.log(numbers, step=step))

    def table(self, key: str, columns: list[str], rows: list[list[Any]], step: int) -> None:
        """Samples as a table where the tracker has tables (wandb, mlflow), else as text (tensorboard)."""
        def one(name: str, t) -> None:
            if name == "tensorboard":
                t.writer.add_text(key, "\n\n".join(" | ".join(str(c) for c in row) for row in rows), step)
            elif name == "mlflow":
                import mlflow

                mlflow.log_table({c: [row[i] for row in rows] for i, c in enumerate(columns)},
                                 f"{key}/step_{step}.json")
            elif name == "wandb":
                t.log_table(key, columns=columns, data=rows, step=step)

        self._each(one)

    def finish(self) -> None:
        self._each(lambda name, t: t.finish())
        self.live = []


def start_trackers(names: list[str], out_dir: Path, config: dict[str, Any], accelerator,
                   say: Callable[[str], None] = print) -> Trackers | None:
    """The trackers, started on the main process before the model loads (None elsewhere); when one
    cannot start, every rank stops with its one line (the main process tells the others)."""
    trackers, failed = None, ""
    if accelerator.is_main_process:
        try:
            trackers = Trackers(names, out_dir, config, say)
        except UserError as e:
            failed = str(e)
    if accelerator.num_processes > 1:
        import torch.distributed as dist

        verdict = [failed]
        dist.broadcast_object_list(verdict, src=0)
        failed = verdict[0]
    if failed:
        raise UserError(failed)
    return trackers
