"""Bytes the layouts' collectives carry, counted only while a benchmark or a test asks (`counting`): the
training path pays one empty-list check per collective, nothing else.

    with counting("tp") as sent:      # "tp": the TP layers' all-reduces; "ep": expert parallel's all-to-alls
        loss.backward()
    sent["forward"], sent["backward"], sent["forward_calls"]
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from typing import Iterator

_COUNTERS: dict[str, list[Counter]] = {"tp": [], "ep": []}


def wanted(kind: str) -> bool:
    """Whether anything counts `kind` now (the caller skips computing the bytes otherwise)."""
    return bool(_COUNTERS[kind])


def add(kind: str, phase: str, nbytes: int) -> None:
    for c in _COUNTERS[kind]:
        c[phase] += nbytes
        c[phase + "_calls"] += 1


@contextmanager
def counting(kind: str) -> Iterator[Counter]:
    """A Counter of `kind`'s bytes by phase ("forward", "backward", ...) and calls ("<phase>_calls")."""
    c: Counter = Counter()
    _COUNTERS[kind].append(c)
    try:
        yield c
    finally:
        _COUNTERS[kind].remove(c)
