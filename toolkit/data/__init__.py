"""Data pipeline: records -> conversations -> token ids with label masks -> padded batches.

The pieces every path shares live here (a record as an example, the eval split, statistics,
collate). A run reads its data through `toolkit.data.prepare` (tokenized once into the cache) or
`toolkit.data.stream` (--streaming); `load_examples` + `tokenize_examples` do the same for records
held in memory, one example at a time (the reference the prepared path is tested against).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from toolkit.config.datasets import first_source, is_mixture, parse_sources
from toolkit.config.schema import DataConfig, DataSettings
from toolkit.data.table import DataStats
from toolkit.data.formats import (OPTIONAL_COLUMNS, DataSource, detect_format, load_records, map_columns, record_place,
                                  to_conversation, unread_mapping, with_system_prompt)
from toolkit.data.images import IMAGE_COLUMNS, has_images, with_images, without_images
from toolkit.data.tokenize import IGNORE_INDEX
from toolkit.config.objectives import form
from toolkit.errors import UserError

# imported inside the functions that make tensors: `toolkit.data.peek` checks a run's
if TYPE_CHECKING:
    # records before torch (and transformers, datasets) load, and importing it runs this module
    import torch


@dataclass
class Examples:
    """Records in a common shape, before tokenization."""

    format: str
    detected: bool
    # conversations (list of messages) or plain strings
    train: list
    eval: list
    # built-in data: held-out chats scored by exact match
    em_conversations: list | None = None
    # ... and their expected answers
    answers: list[str] | None = None
    # training conversations given --system-prompt
    system_added: int = 0
    # a mixture: (spec, format, weight, training records) per source
    sources: list | None = None


def data_sources(data: DataConfig) -> list[DataSource]:
    """The training sources, each with the column mapping in force for it: its own, else --columns."""
    return [DataSource(s.spec, s.columns or data.columns, "--dataset", bool(s.columns))
            for s in parse_sources(data.dataset)]


def eval_source(data: DataConfig) -> DataSource | None:
    """`--eval-dataset`'s file (None: none given), read as a training source is."""
    if not data.eval_dataset:
        return None
    s = first_source(data.eval_dataset)
    return DataSource(s.spec, s.columns or data.columns, "--eval-dataset", bool(s.columns))


def as_example(row: dict, fmt: str, index: int, data: DataConfig, source: DataSource) -> tuple[list[dict] | str, bool]:
    """(one record as a conversation or text, whether --system-prompt was added to it); a record
    with nothing to train on is an error naming its index."""
    try:
        conv = to_conversation(row, fmt, turns=source.turns)
    except UserError as e:
        raise UserError(f"{source.flag} {record_place(source.path, index)}: {e}") from None
    if fmt == "text":
        return conv, False
    # the resolved --images (`toolkit.cli.startup.resolve_images`; still auto when the columns are first checked)
    if data.images == "on" and (any(c in row for c in IMAGE_COLUMNS) or has_images(conv)):
        conv = with_images(conv, row, source.path, f"{source.flag} {record_place(source.path, index)}: ")
    elif data.images == "off" and has_images(conv):
        conv = without_images(conv)
    given = with_system_prompt(conv, data.system_prompt)
    if not data.train_on_prompt and not any(m["role"] == "assistant" for m in given):
        raise UserError(f"{source.flag} {record_place(source.path, index)} has no assistant turn, so it has nothing "
                        "to train on (pass --train-on-prompt to train on whole conversations)")
    return given, given is not conv


def source_format(columns: list[str], settings: DataSettings, source: DataSource, sample: dict | None = None) -> str:
    """The source's format, from its columns or --format (text takes no --system-prompt); under a
    preference objective the pairs' format (`toolkit.data.pairs.PAIR_FORMATS`). Pairs where no SFT
    format fits are refused under SFT in one line, SFT data under a preference objective, and a
    mapping that names a field the format does not read (it would be ignored). `sample`: a record, for
    the hint on columns no format fits."""
    from toolkit.data.formats import FORMAT_COLUMNS
    from toolkit.data.pairs import PREFERENCE_READS, check_data_fits

    spec, flag = source.path, source.flag
    wants = form(settings.objective)
    # prompts: their completions are sampled in the loop (`toolkit.data.prompts`)
    if wants == "prompts":
        from toolkit.data.prompts import prompt_format

        return prompt_format(columns, source)
    if wants != "conversations":
        fmt = check_data_fits(columns, settings.objective, spec, flag)
        unread_mapping(fmt, PREFERENCE_READS[fmt], source)
        return fmt
    try:
        fmt = detect_format(columns, settings.data.format, spec, sample, flag)
    except UserError:
        # pairs: say so, rather than that the format is unknown
        check_data_fits(columns, "sft", spec, flag)
        raise
    unread_mapping(fmt, FORMAT_COLUMNS[fmt] + OPTIONAL_COLUMNS.get(fmt, ()), source)
    if fmt == "text" and settings.data.system_prompt:
        raise UserError(f"--system-prompt applies to conversations; {flag} {spec} is plain text (format text), "
                        "which has no turns to put it in front of")
    return fmt


def _conversations(settings: DataSettings, source: DataSource) -> tuple[str, list, int]:
    """(format, each record as a conversation or text, how many got --system-prompt) of one source,
    its format detected on its own columns."""
    records = map_columns(load_records(source.path, source.flag), source)
    fmt = source_format(records.column_names, settings, source, records[0])
    pairs = [as_example(r, fmt, i, settings.data, source) for i, r in enumerate(records)]
    return fmt, [c for c, _ in pairs], sum(added for _, added in pairs)


def split_indices(n: int, settings: DataSettings, what: str) -> tuple[list[int], list[int]]:
    """(train, held out) record indices: --eval-split of `n` records, drawn with the run's seed,
    order kept."""
    import torch

    if settings.data.eval_split <= 0:
        return list(range(n)), []
    n_eval = max(1, round(n * settings.data.eval_split))
    if n_eval >= n:
        raise UserError(f"--eval-split {settings.data.eval_split} leaves no training data from {n} records"
                        + (f" of {what}" if what else ""))
    g = torch.Generator().manual_seed(settings.seed)
    order = torch.randperm(n, generator=g).tolist()
    return sorted(order[n_eval:]), sorted(order[:n_eval])


def _split_eval(convs: list, settings: DataSettings, what: str) -> tuple[list, list]:
    train, held = split_indices(len(convs), settings, what)
    return [convs[i] for i in train], [convs[i] for i in held]


def load_examples(settings: DataSettings) -> Examples:
    spec, system = settings.data.dataset, settings.data.system_prompt
    if is_mixture(spec):
        return _load_mixture(settings)
    fmt, convs, added = _conversations(settings, data_sources(settings.data)[0])
    if spec.startswith("builtin:"):
        from toolkit.data.builtin import builtin_records

        held = builtin_records(spec.split(":", 1)[1], split="eval")
        scored = [with_system_prompt(r["messages"], system) for r in held]
        eval_convs = scored if settings.data.eval_split > 0 else _eval_file(settings)
        return Examples(fmt, settings.data.format == "auto", convs, eval_convs, scored, [r["answer"] for r in held],
                        added)
    train, held_out = _split_eval(convs, settings, "")
    return Examples(fmt, settings.data.format == "auto", train, held_out or _eval_file(settings), system_added=added)


def _eval_file(settings: DataSettings) -> list:
    """`--eval-dataset`'s records as conversations or texts (none without it)."""
    source = eval_source(settings.data)
    return _conversations(settings, source)[1] if source else []


def _load_mixture(settings: DataSettings) -> Examples:
    """`--dataset a.jsonl:0.7,b.json:0.3`: each source read and format-detected on its own, its
    --eval-split held out first, then the training examples drawn by weight with the run's seed
    (`toolkit.data.mixture`); without weights each source counts by its size."""
    from toolkit.data.mixture import mixture_order

    sources = parse_sources(settings.data.dataset)
    formats, trains, held, added = [], [], [], 0
    for source, read in zip(sources, data_sources(settings.data)):
        fmt, convs, n = _conversations(settings, read)
        train, held_out = _split_eval(convs, settings, source.spec)
        formats.append(fmt)
        trains.append(train)
        held += held_out
        added += n
    weights = [s.weight if s.weight is not None else len(t) for s, t in zip(sources, trains)]
    order = mixture_order([len(t) for t in trains], weights, settings.seed)
    fmt = "+".join(dict.fromkeys(formats))
    return Examples(fmt, settings.data.format == "auto", [trains[s][i] for s, i in order],
                    held or _eval_file(settings), system_added=added,
                    sources=[(s.spec, f, w / sum(weights), len(t))
                             for s, f, w, t in zip(sources, formats, weights, trains)])


def tokenize_examples(convs: list, tokenizer, settings: DataSettings, what: str = "training"):
    """(rows, stats) of in-memory conversations or texts: tokenized into a cached Arrow table
    (`toolkit.data.table`), the rows left with a target token as a list-like `Rows`. A run's own
    data goes through `toolkit.data.prepare`, which starts from the files."""
    from toolkit.data.table import Rows, table_stats, tokenized_table
    from toolkit.cache import cache_dir

    # no eval split: nothing to tokenize or cache
    if not convs:
        return [], DataStats()
    d = settings.data
    table, cached = tokenized_table(convs, tokenizer, d.seq_len, d.train_on_prompt, cache_dir() / "data",
                                    d.data_workers)
    stats, keep = table_stats(table)
    stats.cached = cached
    check_trainable(stats, settings, what)
    return Rows(table, keep), stats


def check_trainable(stats: DataStats, settings: DataSettings, what: str, named: str = "") -> None:
    """One line, before the model loads, where nothing is left to train: a run that trained on no
    example would exit 0 having learnt nothing. Empty answers (`stats.empty`: SFT's answers or text,
    preference completions) name the file (`named`: "--dataset FILE", the default, or "--eval-dataset FILE")
    and the columns to fill; otherwise every example was cut to no answer by --seq-len."""
    if not stats.examples or stats.dropped < stats.examples:
        return
    if stats.empty:
        wants = form(settings.objective)
        unit, sides = {"conversations": ("example", "answer"), "labelled": ("example", "completion")}.get(
            wants, ("pair", "'chosen' or 'rejected'"))
        cut = stats.dropped - stats.empty
        raise UserError(f"{named or '--dataset ' + settings.data.dataset}: no {what} {unit} is left: {stats.empty} of "
                        f"{stats.examples} have an empty or whitespace-only {sides}"
                        + (f", the other {cut} no {'answer' if wants == 'conversations' else 'completion'} "
                           f"tokens after truncation to --seq-len {settings.data.seq_len}" if cut else "")
                        + f"; fill in the {sides} text (or point --columns at the columns that hold it)")
    raise UserError(f"every {what} example is left with no answer tokens after truncation to "
                    f"--seq-len {settings.data.seq_len}; raise --seq-len (longest prompt is longer)")


def longest_row(rows, seq_len: int) -> int:
    """Tokens in the longest row: from `lengths` where the rows carry them (a table, packed rows),
    --seq-len for a stream (not read ahead)."""
    import torch

    lengths = getattr(rows, "lengths", None)
    if lengths is not None:
        return int(max(lengths))
    if isinstance(rows, torch.utils.data.IterableDataset):
        return seq_len
    return max(len(r["input_ids"]) for r in rows)


def collate(batch: list[dict], pad_id: int, whole: bool = False, multiple: int = 1,
            cap: int | None = None) -> dict[str, torch.Tensor]:
    """`collate_sequences`; a micro-batch of preference pairs (`toolkit.data.pairs`) as its two sequences
    each, with the pairs' count and reference log-probabilities; KTO's examples with their KL sequences.
    Each sequence's width is `bucket_width(longest, multiple, cap)`."""
    if "rejected_input_ids" in batch[0]:
        from toolkit.data.pairs import pair_extras, pair_rows

        return {**collate_sequences(pair_rows(batch), pad_id, whole, multiple, cap), **pair_extras(batch)}
    # KTO's examples, each with its KL estimate's sequence
    if "kl_input_ids" in batch[0]:
        from toolkit.data.pairs import kl_rows, kto_extras

        rows = [{"input_ids": x["input_ids"], "labels": x["labels"]} for x in batch]
        return {**collate_sequences(rows, pad_id, whole, multiple, cap),
                **kto_extras(batch, collate_sequences(kl_rows(batch), pad_id, False, multiple, cap))}
    return collate_sequences(batch, pad_id, whole, multiple, cap)


def bucket_width(longest: int, multiple: int, cap: int | None = None) -> int:
    """`longest` rounded up to a multiple of `multiple` (1: itself), so compiled graphs see few widths;
    at most `cap` (--seq-len, the packing width), never below `longest`."""
    width = -(-longest // multiple) * multiple
    return max(longest, min(width, cap)) if cap else width


def collate_sequences(batch: list[dict], pad_id: int, whole: bool = False, multiple: int = 1,
                      cap: int | None = None) -> dict[str, torch.Tensor]:
    """Right-pad to the longest example (to `bucket_width`); padding gets attention 0 and label -100. `whole`: the batch
    reaches the model as it is (not split into pipeline micro-batches or context-parallel slices),
    so `target_rows` are added, the positions with a target found here on the CPU: the loss head
    then needs no read-back from the GPU to skip the others (`toolkit.objectives.sft.loss.target_rows`)."""
    import torch

    width = bucket_width(max(len(x["input_ids"]) for x in batch), multiple, cap)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, x in enumerate(batch):
        n = len(x["input_ids"])
        ids[i, :n] = torch.tensor(x["input_ids"])
        labels[i, :n] = torch.tensor(x["labels"])
        mask[i, :n] = 1
    if not whole:
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}
    from toolkit.data.labels import target_rows

    return {"input_ids": ids, "attention_mask": mask, "labels": labels, "target_rows": target_rows(labels)}
