"""`--report-to`: which trackers a run asked for (pure parsing, standard library only: config
validation reads it before anything heavy loads; `toolkit.train.trackers` runs them)."""

from __future__ import annotations

import importlib.util

TRACKERS = ("tensorboard", "wandb", "mlflow", "trackio")
PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow", "trackio": "trackio"}
# the tracking client alone; the full package adds a server and UI
INSTALL = {"mlflow": "mlflow-skinny"}


def requested(spec: str) -> list[str]:
    """`--report-to` as tracker names: 'none' -> [], 'all' -> every installed one."""
    names = [n.strip() for n in spec.split(",") if n.strip()]
    if names == ["none"]:
        return []
    if names == ["all"]:
        return [n for n in TRACKERS if importlib.util.find_spec(PACKAGES[n]) is not None]
    return list(dict.fromkeys(names))


def spec_problems(spec: str) -> list[str]:
    """Unknown names and trackers whose package is not installed (no import: config validation)."""
    names = [n.strip() for n in spec.split(",") if n.strip()]
    if not names or (len(names) > 1 and {"none", "all"} & set(names)):
        return [f"--report-to {spec!r}: give none, all, or one or more of {', '.join(TRACKERS)} separated by commas"]
    if names in (["none"], ["all"]):
        return []
    unknown = [n for n in names if n not in TRACKERS]
    if unknown:
        return [f"--report-to: unknown tracker {', '.join(unknown)} (known: {', '.join(TRACKERS)}, none, all)"]
    missing = [n for n in names if importlib.util.find_spec(PACKAGES[n]) is None]
    return [f"--report-to {n} needs the {PACKAGES[n]} package, which is not installed: "
            f"pip install {INSTALL.get(n, PACKAGES[n])}" for n in missing]
