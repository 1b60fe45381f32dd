"""How a decoder's blocks are cut into pipeline stages: shared by the planner's pp rows and the
runtime (`toolkit.parallel.pp`), so the prediction describes the split that runs. Pure Python."""

from __future__ import annotations


def balance(block_costs: list[float], stages: int, first_extra: float = 0.0, last_extra: float = 0.0) -> list[int]:
    """Blocks per stage: a contiguous split of the blocks into `stages` non-empty stages that
    minimises the largest stage cost, where stage 0 also pays `first_extra` (embeddings) and the
    last stage `last_extra` (norm + LM head). Exact (dynamic programme over prefixes, O(p n^2))."""
    n = len(block_costs)
    if not 1 <= stages <= n:
        raise ValueError(f"cannot split {n} blocks into {stages} non-empty stages")
    prefix = [0.0]
    for c in block_costs:
        prefix.append(prefix[-1] + c)

    # stage s holds blocks i..j-1
    def cost(s: int, i: int, j: int) -> float:
        return prefix[j] - prefix[i] + (first_extra if s == 0 else 0.0) + (last_extra if s == stages - 1 else 0.0)

    inf = float("inf")
    # best[s][j]: first j blocks in s stages
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for j in range(s, n - (stages - s) + 1):
            for i in range(s - 1, j):
                v = max(best[s - 1][i], cost(s - 1, i, j))
                if v < best[s][j]:
                    best[s][j], cut[s][j] = v, i
    sizes, j = [], n
    for s in range(stages, 0, -1):
        i = cut[s][j]
        sizes.append(j - i)
        j = i
    return sizes[::-1]


def stage_bounds(sizes: list[int]) -> list[tuple[int, int]]:
    """[(start, stop)] block ranges from blocks-per-stage."""
    out, start = [], 0
    for k in sizes:
        out.append((start, start + k))
        start += k
    return out
