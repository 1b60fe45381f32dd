"""The parallelism planner: pure functions over numbers (no torch.distributed, no GPU).

`params` counts parameters from a config, `memory` holds the per-strategy byte formulas, `plan`
searches the strategies, `auto` wires the choice into a run, `presets` holds public configs.
"""
