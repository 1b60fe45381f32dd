"""Data pipeline: records -> conversations -> token ids with label masks -> padded batches.

Split in two so bad input fails early: `load_examples` needs no tokenizer (runs before anything is
loaded), `tokenize_examples` needs the tokenizer but not the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from toolkit.config import Config
from toolkit.dataset_spec import is_mixture, parse_sources
from toolkit.data.formats import detect_format, load_records, map_columns, to_conversation
from toolkit.data.tokenize import IGNORE_INDEX
from toolkit.errors import UserError


@dataclass
class Examples:
    """Records in a common shape, before tokenization."""

    format: str
    detected: bool
    train: list  # conversations (list of messages) or plain strings
    eval: list
    em_conversations: list | None = None  # built-in data: held-out chats scored by exact match
    answers: list[str] | None = None  # ... and their expected answers
    system_added: int = 0  # training conversations given --system-prompt
    sources: list | None = None  # a mixture: (spec, format, weight, training records) per source


@dataclass
class DataStats:
    examples: int = 0
    truncated: int = 0
    dropped: int = 0  # nothing left to train after truncation
    tokens: int = 0
    target_tokens: int = 0
    lengths: list[int] = field(default_factory=list)
    cached: bool = False  # read from the tokenized-data cache (toolkit.data.table)


def with_system_prompt(conv: list[dict], system: str) -> list[dict]:
    """`--system-prompt`: prepended where the conversation has no system message of its own."""
    if not system or any(m["role"] == "system" for m in conv):
        return conv
    return [{"role": "system", "content": system}, *conv]


def _conversations(cfg: Config, spec: str) -> tuple[str, list, int]:
    """(format, each record as a conversation or text, how many got --system-prompt) of one source,
    its format detected on its own columns."""
    system = cfg.data.system_prompt
    records = map_columns(load_records(spec), cfg.data.columns, spec)
    fmt = detect_format(records.column_names, cfg.data.format, spec)
    if fmt == "text" and system:
        raise UserError(f"--system-prompt applies to conversations; --dataset {spec} is plain text (format text), "
                        "which has no turns to put it in front of")
    convs = [to_conversation(r, fmt, i) for i, r in enumerate(records)]
    added = 0
    if fmt != "text":
        given = [with_system_prompt(c, system) for c in convs]
        added = sum(new is not old for new, old in zip(given, convs))
        convs = given
        for i, c in enumerate(convs):
            if not any(m["role"] == "assistant" for m in c) and not cfg.data.train_on_prompt:
                raise UserError(f"--dataset {spec}: record {i} has no assistant turn, so it has nothing to "
                                "train on (pass --train-on-prompt to train on whole conversations)")
    return fmt, convs, added


def _split_eval(convs: list, cfg: Config, what: str) -> tuple[list, list]:
    """(train, held out): --eval-split of the records, drawn with the run's seed, order kept."""
    if cfg.data.eval_split <= 0:
        return convs, []
    n_eval = max(1, round(len(convs) * cfg.data.eval_split))
    if n_eval >= len(convs):
        raise UserError(f"--eval-split {cfg.data.eval_split} leaves no training data from {len(convs)} records"
                        + (f" of {what}" if what else ""))
    g = torch.Generator().manual_seed(cfg.train.seed)
    order = torch.randperm(len(convs), generator=g).tolist()
    return [convs[i] for i in sorted(order[n_eval:])], [convs[i] for i in sorted(order[:n_eval])]


def load_examples(cfg: Config) -> Examples:
    spec, system = cfg.data.dataset, cfg.data.system_prompt
    if is_mixture(spec):
        return _load_mixture(cfg)
    fmt, convs, added = _conversations(cfg, spec)
    if spec.startswith("builtin:"):
        from toolkit.data.builtin import builtin_records

        held = builtin_records(spec.split(":", 1)[1], split="eval")
        scored = [with_system_prompt(r["messages"], system) for r in held]
        eval_convs = scored if cfg.data.eval_split > 0 else []
        return Examples(fmt, cfg.data.format == "auto", convs, eval_convs, scored, [r["answer"] for r in held], added)
    train, held_out = _split_eval(convs, cfg, "")
    return Examples(fmt, cfg.data.format == "auto", train, held_out, system_added=added)


def _load_mixture(cfg: Config) -> Examples:
    """`--dataset a.jsonl:0.7,b.json:0.3`: each source read and format-detected on its own, its
    --eval-split held out first, then the training examples drawn by weight with the run's seed
    (`toolkit.data.mixture`); without weights each source counts by its size."""
    from toolkit.data.mixture import mixture_order

    sources = parse_sources(cfg.data.dataset)
    formats, trains, held, added = [], [], [], 0
    for source in sources:
        fmt, convs, n = _conversations(cfg, source.spec)
        train, held_out = _split_eval(convs, cfg, source.spec)
        formats.append(fmt)
        trains.append(train)
        held += held_out
        added += n
    weights = [s.weight if s.weight is not None else len(t) for s, t in zip(sources, trains)]
    order = mixture_order([len(t) for t in trains], weights, cfg.train.seed)
    fmt = "+".join(dict.fromkeys(formats))
    return Examples(fmt, cfg.data.format == "auto", [trains[s][i] for s, i in order], held, system_added=added,
                    sources=[(s.spec, f, w / sum(weights), len(t)) for s, f, w, t in zip(sources, formats, weights,
                                                                                         trains)])


def tokenize_examples(convs: list, tokenizer, cfg: Config, what: str = "training"):
    """(rows, stats): the examples tokenized into a cached Arrow table (`toolkit.data.table`), the
    rows left with a target token as a list-like `Rows`; the statistics read from its columns."""
    from toolkit.data.table import Rows, tokenized_table
    from toolkit.models import cache_dir

    if not convs:  # no eval split: nothing to tokenize or cache
        return [], DataStats()
    table, cached = tokenized_table(convs, tokenizer, cfg.data.seq_len, cfg.data.train_on_prompt, cache_dir() / "data",
                            cfg.data.data_workers)
    # whole columns as arrays (indexing a datasets column is a Python call per row)
    targets, lengths, truncated = (table.data.column(c).to_numpy() for c in ("targets", "length", "truncated"))
    kept = (targets > 0).nonzero()[0]
    keep = kept.tolist()
    stats = DataStats(examples=len(table), truncated=int(truncated.sum()), dropped=len(table) - len(keep),
                      tokens=int(lengths[kept].sum()), target_tokens=int(targets[kept].sum()),
                      lengths=lengths[kept].tolist(), cached=cached)
    if not keep and convs:
        raise UserError(f"every {what} example is left with no answer tokens after truncation to "
                        f"--seq-len {cfg.data.seq_len}; raise --seq-len (longest prompt is longer)")
    return Rows(table, keep if len(keep) < len(table) else None), stats


def collate(batch: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest example; padding gets attention 0 and label -100."""
    width = max(len(x["input_ids"]) for x in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, x in enumerate(batch):
        n = len(x["input_ids"])
        ids[i, :n] = torch.tensor(x["input_ids"])
        labels[i, :n] = torch.tensor(x["labels"])
        mask[i, :n] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}
