"""Sampling a dataset mixture: which source each training example comes from.

`datasets.interleave_datasets` with the weights as probabilities and the run's seed, stopping when
every source has been used whole at least once ("all_exhausted": smaller sources are cycled, none is
cut short), over index-only tables so the records stay where they are.
"""

from __future__ import annotations


def mixture_order(sizes: list[int], weights: list[float], seed: int) -> list[tuple[int, int]]:
    """[(source, index within it), ...]: each position's source drawn with probability weight/sum."""
    import datasets

    total = sum(weights)
    tables = [datasets.Dataset.from_dict({"source": [s] * n, "index": list(range(n))}) for s, n in enumerate(sizes)]
    mixed = datasets.interleave_datasets(tables, probabilities=[w / total for w in weights], seed=seed,
                                         stopping_strategy="all_exhausted")
    return list(zip(mixed["source"], mixed["index"]))
