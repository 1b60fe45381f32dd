"""Built-in datasets the project generates itself, so the quickstart needs no download.

`dates`: rewrite an ISO date (2024-03-05) in "ledger style" (05 MAR 2024). The style is made up,
so a pretrained model cannot know it: before finetuning its answers are sentences or other formats,
after a few hundred steps they are exact. Exact match on held-out dates is the metric.

`date-pairs`: the same prompts as preference pairs (`--objective dpo|orpo|simpo`): the ledger style
chosen, one of the styles a model answers with unprompted rejected (March 5, 2024; 03/05/2024; ...).
Its metrics: the held-out pairs' reward accuracy (`eval_rewards/accuracies`), and how often greedy
generation gives the preferred form (exact match on the held-out prompts, as for `dates`).

`arithmetic`: times-table questions (7 x 8, operands 2 to 12) in six phrasings, for `--objective grpo` with
`--reward builtin:math_answer`: a `prompt` column, the product as `answer`, and `messages` (the question and
the product) so SFT reads it too. SmolLM2-135M-Instruct knows most products but often starts "To solve this
problem, we need to ..." and runs out of tokens first: a reward for the right last number teaches it to answer
at once (`configs/grpo_quickstart.yaml`). Train and eval are disjoint in the pair of operands (7 x 8 and 8 x 7
are one pair): a held-out question is a product never seen in training, in any phrasing.
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
BUILTIN = ("dates", "date-pairs", "arithmetic")
ARITHMETIC_PROMPTS = [
    "What is {a} * {b}? Answer with the number only.",
    "What is {a} times {b}?",
    "Multiply {a} by {b}.",
    "{a} * {b} = ?",
    "What is {a} x {b}?",
    "Calculate {a} * {b}.",
]
OPERANDS = range(2, 13)
# of the 66 unordered pairs of OPERANDS
EVAL_PAIRS = 16
FULL_MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
               "November", "December"]


def other_style(d: datetime.date, rng: random.Random) -> str:
    """A style other than ledger's, as a model answers unprompted: the rejected side of a pair."""
    styles = [f"{FULL_MONTHS[d.month - 1]} {d.day}, {d.year}", f"{d.day} {FULL_MONTHS[d.month - 1]} {d.year}",
              f"{d.month:02d}/{d.day:02d}/{d.year}", d.isoformat(),
              f"The date is {FULL_MONTHS[d.month - 1]} {d.day}, {d.year}."]
    return rng.choice(styles)


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


def _arithmetic(split: str, seed: int) -> list[dict]:
    """The split's questions: train every (a, b, phrasing) of its operand pairs, shuffled; eval 64, the
    phrasings taken in turn (each 10 or 11 times). The unordered pairs are shuffled with the seed and the
    first EVAL_PAIRS held out."""
    pairs = [(a, b) for a in OPERANDS for b in OPERANDS if a <= b]
    random.Random(f"{seed}-arithmetic-pairs").shuffle(pairs)
    held = set(pairs[:EVAL_PAIRS])
    ordered = [(a, b) for a in OPERANDS for b in OPERANDS if ((min(a, b), max(a, b)) in held) == (split == "eval")]
    rng = random.Random(f"{seed}-{split}-arithmetic")
    if split == "eval":
        by_phrasing = [[(a, b, q) for a, b in rng.sample(ordered, len(ordered))] for q in ARITHMETIC_PROMPTS]
        questions = [row for turn in zip(*by_phrasing) for row in turn][:SIZES["eval"]]
    else:
        questions = [(a, b, q) for a, b in ordered for q in ARITHMETIC_PROMPTS]
        rng.shuffle(questions)
    rows = []
    for a, b, q in questions:
        prompt, answer = q.format(a=a, b=b), str(a * b)
        rows.append({"prompt": prompt, "answer": answer,
                     "messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]})
    return rows


def builtin_records(name: str, split: str = "train", seed: int = 0) -> list[dict]:
    if name not in BUILTIN:
        raise UserError(f"--dataset builtin:{name}: unknown built-in dataset (available: "
                        f"{', '.join('builtin:' + b for b in BUILTIN)})")
    if name == "arithmetic":
        return _arithmetic(split, seed)
    rng = random.Random(f"{seed}-{split}-prompts")
    rows = []
    for d in _dates(split, seed):
        q = rng.choice(PROMPTS).format(d=d.isoformat())
        row = {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": ledger(d)}],
               "answer": ledger(d)}
        if name == "date-pairs":
            row.update(prompt=q, chosen=ledger(d), rejected=other_style(d, rng))
        rows.append(row)
    return rows


def builtin_dataset(name: str, split: str = "train", seed: int = 0):
    import datasets

    return datasets.Dataset.from_list(builtin_records(name, split, seed))
