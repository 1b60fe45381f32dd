"""The parallelism planner: pure functions over numbers (no torch.distributed, no GPU).

`params` counts parameters from a config, `memory` holds the per-strategy byte formulas, `estimate`
predicts every layout and chooses one, `explain` says why in words and prints the table, `auto` wires
the choice into a run, `presets` holds public configs.
"""
