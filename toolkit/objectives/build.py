"""The one place an objective is chosen from `--objective`: a new one adds its class here, and neither the
loop nor any strategy changes."""

from __future__ import annotations

from toolkit.objectives.base import Objective


def build_objective(cfg) -> Objective:
    """The run's objective (`toolkit.objectives.base.Objective`), from its config. Built before any model
    loads: what it reads of its own (GRPO's reward files) fails here, in one line."""
    name = cfg.train.objective
    if name == "grpo":
        from toolkit.objectives.grpo.objective import GRPO

        return GRPO(cfg)
    if name == "sft":
        from toolkit.objectives.sft.objective import SFT

        return SFT(cfg)
    from toolkit.objectives.preference.objective import Preference

    return Preference(cfg)
