"""What the run refuses of a layout on the model's module tree, asked before any weight loads (and by
the planner, for each row it offers: `toolkit.planner.estimate.PlanInput.tree_check`)."""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any


def tree_problem(cfg: dict[str, Any], dim: str) -> str:
    """What the run refuses of --tp ("tp") or --pp ("pp") on the model's module tree, before its weights
    load (`toolkit.parallel.build`: the TP plan's regions against the blocks, `tp_tree_problems`; the
    pipeline's stages, `pipeline_problems`), asked of a meta-device copy built from the config: ''
    where it runs, or where transformers builds no model of this type (the run then checks alone).
    Once per config and dimension. The planner is handed it (`PlanInput.tree_check`) by its callers."""
    from toolkit.planner.params import MODEL_PLANS

    if not dim or not cfg.get("model_type"):
        return ""
    key = json.dumps({k: v for k, v in cfg.items() if k not in MODEL_PLANS}, sort_keys=True, default=str)
    return _tree_problem(key, dim)


@lru_cache(maxsize=64)
def _tree_problem(key: str, dim: str) -> str:
    try:
        from transformers import AutoConfig

        values = json.loads(key)
        config = AutoConfig.for_model(values.pop("model_type"), **values)
    except (ImportError, KeyError, TypeError, ValueError):
        return ""
    from toolkit.parallel.pp import pipeline_problems
    from toolkit.parallel.tp.plan import tp_tree_problems

    try:
        return next(iter((tp_tree_problems if dim == "tp" else pipeline_problems)(config)), "")
    # no causal LM of this type builds on meta: the run checks
    except (ValueError, KeyError, TypeError, RuntimeError):
        return ""
