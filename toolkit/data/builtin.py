"""Built-in datasets the project generates itself, so the quickstart needs no download.

`dates`: rewrite an ISO date (2024-03-05) in "ledger style" (05 MAR 2024). The style is made up,
so a pretrained model cannot know it: before finetuning its answers are sentences or other formats,
after a few hundred steps they are exact. Exact match on held-out dates is the metric.
"""

from __future__ import annotations

import datetime
import random

from toolkit.errors import UserError

MONTHS = ["JAN", "FEB", "MAR", "APR", "MAY", "JUN", "JUL", "AUG", "SEP", "OCT", "NOV", "DEC"]
PROMPTS = [
    "Write {d} in ledger style.",
    "Convert the date {d} to ledger style.",
    "What is {d} in ledger style?",
    "Ledger style for {d}, please.",
]
BUILTIN = ("dates",)
SIZES = {"train": 1000, "eval": 64}


def _dates(split: str, seed: int) -> list[datetime.date]:
    """Train and eval dates are disjoint: odd ordinals go to eval, even to train."""
    rng = random.Random(f"{seed}-{split}")
    base = datetime.date(1950, 1, 1).toordinal()
    want = SIZES[split]
    out: list[datetime.date] = []
    seen: set[int] = set()
    while len(out) < want:
        o = base + rng.randrange(0, 365 * 100)
        if (o % 2 == 1) != (split == "eval") or o in seen:
            continue
        seen.add(o)
        out.append(datetime.date.fromordinal(o))
    return out


def ledger(d: datetime.date) -> str:
    return f"{d.day:02d} {MONTHS[d.month - 1]} {d.year}"


def builtin_records(name: str, split: str = "train", seed: int = 0) -> list[dict]:
    if name not in BUILTIN:
        raise UserError(f"--dataset builtin:{name}: unknown built-in dataset (available: "
                        f"{', '.join('builtin:' + b for b in BUILTIN)})")
    rng = random.Random(f"{seed}-{split}-prompts")
    rows = []
    for d in _dates(split, seed):
        q = rng.choice(PROMPTS).format(d=d.isoformat())
        rows.append({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": ledger(d)}],
                     "answer": ledger(d)})
    return rows


def builtin_dataset(name: str, split: str = "train", seed: int = 0):
    import datasets

    return datasets.Dataset.from_list(builtin_records(name, split, seed))
