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

`products`: multi-digit products (a 3-digit number times a 2-digit one: 347 * 29) for `--objective grpo` with a
calculator tool (`configs/calculator.py`): a `prompt` column, the product as `answer`, and `messages`, a
demonstration of the tool's use (the call in the assistant's text, the `tool` message with the product, the
answer), which SFT reads (`configs/tools_sft.yaml`). SmolLM2-135M-Instruct cannot multiply such numbers alone; the
quickstart teaches it to call the tool (`configs/tools_quickstart.yaml`). Train and eval are disjoint pairs.

`shapes`: pictures the toolkit draws itself (56 px, a circle, square or triangle on a light background, one of six
colors, big or small, anywhere), asked "What size and color is the shape?" and answered "big red", for an image-text
model (`configs/vlm_quickstart.yaml`). The answer is in the pixels alone, so a model that has not learnt to read
them cannot answer better than chance (1 in 12): exact match on the 64 held-out pictures is the metric. The PNGs are
drawn once into the toolkit cache (`shapes-v1/`), deterministically from the seed; held-out pictures are drawn from
their own random stream.
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
BUILTIN = ("dates", "date-pairs", "arithmetic", "products", "shapes")
# the built-ins whose records hold images
IMAGE_BUILTINS = ("shapes",)
SHAPE_COLORS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (230, 210, 40),
                "purple": (140, 60, 180), "orange": (240, 140, 30)}
SHAPE_QUESTION = "What size and color is the shape?"
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


PRODUCT_PROMPTS = ["What is {a} * {b}?", "Compute {a} x {b}.", "What is the product of {a} and {b}?",
                   "Multiply {a} by {b}."]
PRODUCTS = {"train": 512, "eval": 64}


def tool_call_text(name: str, arguments: dict) -> str:
    """A call in the `<tool_call>` form (Hermes, Qwen2.5, `--chat-template chatml-tools`), as an assistant writes it."""
    import json

    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def _products(split: str, seed: int) -> list[dict]:
    """The split's questions: distinct (a, b) pairs, a in 100-999, b in 11-99, from one seeded stream (the eval
    pairs drawn first, so no train pair is one), phrased in turn."""
    rng = random.Random(f"{seed}-products")
    pairs: dict[tuple[int, int], None] = {}
    while len(pairs) < PRODUCTS["eval"] + PRODUCTS["train"]:
        pairs.setdefault((rng.randint(100, 999), rng.randint(11, 99)))
    ordered = list(pairs)
    chosen = ordered[:PRODUCTS["eval"]] if split == "eval" else ordered[PRODUCTS["eval"]:]
    rows = []
    for i, (a, b) in enumerate(chosen):
        prompt, answer = PRODUCT_PROMPTS[i % len(PRODUCT_PROMPTS)].format(a=a, b=b), str(a * b)
        rows.append({"prompt": prompt, "answer": answer, "messages": [
            {"role": "user", "content": prompt},
            {"role": "assistant", "content": tool_call_text("multiply", {"a": a, "b": b})},
            {"role": "tool", "content": answer},
            {"role": "assistant", "content": f"{a} * {b} = {answer}"}]})
    return rows


def builtin_records(name: str, split: str = "train", seed: int = 0) -> list[dict]:
    if name not in BUILTIN:
        raise UserError(f"--dataset builtin:{name}: unknown built-in dataset (available: "
                        f"{', '.join('builtin:' + b for b in BUILTIN)})")
    if name == "arithmetic":
        return _arithmetic(split, seed)
    if name == "products":
        return _products(split, seed)
    if name == "shapes":
        return _shapes(split, seed)
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


def _shapes(split: str, seed: int, size: int = 56) -> list[dict]:
    """The split's pictures, drawn into the toolkit cache the first time (a finished folder is renamed into place, so
    ranks started together draw the same files; a half-drawn one is never read), as chat records with an image part."""
    import os
    import shutil

    from filelock import FileLock

    from toolkit.cache import cache_dir

    folder = cache_dir() / "builtin" / "shapes-v1" / f"{split}-{seed}"
    rng = random.Random(f"{seed}-{split}-shapes")
    drawn = [(rng.choice(list(SHAPE_COLORS)), rng.choice(("circle", "square", "triangle")), rng.random() < 0.5,
              rng.random(), rng.random(), rng.random()) for _ in range(SIZES[split])]
    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder) + ".lock"):
        if not folder.is_dir():
            tmp = folder.with_name(folder.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            for i, picture in enumerate(drawn):
                _draw(size, *picture).save(tmp / f"{i}.png")
            os.replace(tmp, folder)
    return [{"messages": [{"role": "user", "content": [{"type": "image", "image": str(folder / f"{i}.png")},
                                                       {"type": "text", "text": SHAPE_QUESTION}]},
                          # parts too: one Arrow type for every turn's content
                          {"role": "assistant", "content": [{"type": "text",
                                                             "text": f"{'big' if big else 'small'} {color}"}]}],
             "answer": f"{'big' if big else 'small'} {color}"}
            for i, (color, _, big, *_) in enumerate(drawn)]


def _draw(size: int, color: str, shape: str, big: bool, u: float, v: float, w: float):
    """One picture: the shape of radius 16-22 px (big) or 5-8 px (small) at a place drawn from (u, v)."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (size, size), (245, 245, 245))
    pen = ImageDraw.Draw(img)
    r = int(16 + 7 * w) if big else int(5 + 4 * w)
    cx, cy = r + int(u * (size - 2 * r)), r + int(v * (size - 2 * r))
    fill = SHAPE_COLORS[color]
    if shape == "circle":
        pen.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
    elif shape == "square":
        pen.rectangle([cx - r, cy - r, cx + r, cy + r], fill=fill)
    else:
        pen.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill)
    return img
