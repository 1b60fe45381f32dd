"""A run's data, prepared once: dataset files -> tokenized Arrow tables in the cache.

The cache key is computed before anything is read: the dataset's sha256 (`dataset_digest`; of a
mixture, every source's with its weight), every setting that changes the tokens or which records
are trained or held out, and the tokenizer. A warm run reads `meta.json` and memory-maps the
tables: no record is parsed, rendered or tokenized (a hub dataset, which a name does not pin, is
loaded to read its fingerprint first).

On a miss, each source is read (`load_records`), its format detected, and every record rendered to
a conversation and tokenized by one `Dataset.map` (batched, `--data-workers` processes: the node's
cores, since one process per node builds while the others wait on the lock). A bad record is one
line naming its index, from whichever worker met it. --eval-split and the mixture draw select rows
by index, exactly as `toolkit.data.load_examples` orders the records, so the rows equal today's
per-example path (tested).
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

from toolkit.config import Config
from toolkit.data import DataStats, as_example, check_trainable, source_format, split_indices
from toolkit.data.table import CACHE_VERSION, Rows, built_once, features, map_processes, open_table, table_stats, \
    token_columns, tokenizer_digest
from toolkit.dataset_spec import Source, dataset_digest, is_mixture, parse_sources
from toolkit.data.pairs import KTO_COLUMNS, PAIR_COLUMNS, PAIR_FORMATS, encode_kto, encode_pairs

# Settings that change the tokens, or which records are trained and which held out.
TOKEN_SETTINGS = ("format", "columns", "system_prompt", "seq_len", "train_on_prompt", "eval_split", "objective")


@dataclass
class PreparedData:
    format: str  # "+"-joined for a mixture of formats
    detected: bool
    train: Rows  # or a RecordStream
    eval: Rows | list
    stats: DataStats  # of the training split
    eval_stats: DataStats
    system_added: int = 0  # training and eval conversations given --system-prompt
    sources: list | None = None  # a mixture: (spec, format, weight share, training records) per source
    em_conversations: list | None = None  # built-in data: held-out chats scored by exact match
    answers: list[str] | None = None
    streamed: bool = False  # `train` is a `toolkit.data.stream.RecordStream`


def data_key(cfg: Config, tokenizer) -> str:
    """The cache folder's name: a hash of everything that decides the prepared tables."""
    d = cfg.data
    spec = d.dataset
    identity = dataset_digest(spec)
    if any(dataset_digest(s.spec).startswith("spec:") and not s.spec.startswith("builtin:")
           for s in parse_sources(spec)):  # a hub id: its name does not pin its content
        from toolkit.data.formats import load_records

        identity += "".join(load_records(s.spec)._fingerprint for s in parse_sources(spec))
    flat = cfg.flat()
    seeded = d.eval_split > 0 or is_mixture(spec)  # the seed draws the eval split and the mixture
    parts = [CACHE_VERSION, "prepared", identity, tokenizer_digest(tokenizer),
             *(f"{k}={flat[k]!r}" for k in TOKEN_SETTINGS), f"seed={cfg.train.seed if seeded else None}"]
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()


def prepare_data(cfg: Config, tokenizer, cache: Path | None = None) -> PreparedData:
    """The run's training and eval rows, from the cache or built into it (with --streaming, the
    record stream, read as training goes)."""
    if cfg.data.streaming:
        from toolkit.data.stream import RecordStream

        stream = RecordStream(cfg, tokenizer)  # reads the first record: format and columns are checked here
        return PreparedData(stream.format, cfg.data.format == "auto", stream, [], DataStats(), DataStats(),
                            streamed=True)

    from toolkit.cache import cache_dir

    cache = cache or cache_dir() / "data"
    path = cache / data_key(cfg, tokenizer)
    hit = built_once(path, lambda tmp: _build(cfg, tokenizer, tmp, cache))
    meta = json.loads((path / "meta.json").read_text())
    train = open_table(path / "train")  # memory-mapped
    stats, keep = table_stats(train)
    stats.cached = hit
    check_trainable(stats, cfg, "training")
    eval_rows: Rows | list = []
    held_stats = DataStats()
    if (path / "eval").is_dir():
        held = open_table(path / "eval")
        held_stats, held_keep = table_stats(held)
        check_trainable(held_stats, cfg, "eval")
        eval_rows = Rows(held, held_keep)
    em, answers = None, None
    if cfg.data.dataset.startswith("builtin:") and not is_mixture(cfg.data.dataset):
        em, answers = _builtin_scored(cfg)
    return PreparedData(meta["format"], cfg.data.format == "auto", Rows(train, keep), eval_rows, stats, held_stats,
                        meta["system_added"], [tuple(s) for s in meta["sources"]] if meta["sources"] else None,
                        em, answers)


def _builtin_scored(cfg: Config) -> tuple[list, list[str]]:
    from toolkit.data import with_system_prompt
    from toolkit.data.builtin import builtin_records

    held = builtin_records(cfg.data.dataset.split(":", 1)[1], split="eval")
    return [with_system_prompt(r["messages"], cfg.data.system_prompt) for r in held], [r["answer"] for r in held]


def preference_columns(cfg: Config, fmt: str) -> dict:
    """The table's columns beside the tokens: KTO's, a pair's rejected sequence, or none (SFT)."""
    return KTO_COLUMNS if cfg.train.objective == "kto" else PAIR_COLUMNS if fmt in PAIR_FORMATS else {}


def _encode_records(batch: dict, indices: list[int], fmt: str, cfg: Config, spec: str, tokenizer) -> dict:
    from toolkit.data.tokenize import encode_batch

    names = list(batch)
    if cfg.train.objective == "kto":
        return encode_kto([{c: batch[c][j] for c in names} for j in range(len(indices))], indices, fmt, cfg, spec,
                          tokenizer)
    if fmt in PAIR_FORMATS:
        return encode_pairs([{c: batch[c][j] for c in names} for j in range(len(indices))], indices, fmt, cfg, spec,
                            tokenizer)
    pairs = [as_example({c: batch[c][j] for c in names}, fmt, i, cfg, spec) for j, i in enumerate(indices)]
    encs = encode_batch(tokenizer, [ex for ex, _ in pairs], cfg.data.seq_len, cfg.data.train_on_prompt)
    return {**token_columns(encs), "system_added": [added for _, added in pairs]}


def _tokenized_source(cfg: Config, spec: str, tokenizer, work: Path):
    """(format, the source's records tokenized in their order, with a `system_added` column)."""
    from toolkit.data.formats import load_records, map_columns, read_problem

    records = map_columns(load_records(spec), cfg.data.columns, spec)
    fmt = source_format(records.column_names, cfg, spec)
    try:
        table = records.map(_encode_records, batched=True, batch_size=256, with_indices=True,
                            remove_columns=records.column_names,
                            features=features({"system_added": "bool", **preference_columns(cfg, fmt)}),
                            num_proc=map_processes(len(records), cfg.data.data_workers),
                            fn_kwargs={"fmt": fmt, "cfg": cfg, "spec": spec, "tokenizer": tokenizer},
                            cache_file_name=str(work / f"{len(list(work.iterdir()))}.arrow"),
                            new_fingerprint=hashlib.sha256(f"{work}{spec}".encode()).hexdigest()[:32])
    except UnicodeDecodeError as e:  # pyarrow keeps bytes that are not UTF-8 until a row is read
        raise read_problem(spec, e) from None
    return fmt, table


def _build(cfg: Config, tokenizer, out: Path, cache: Path) -> None:
    """Write `out/train`, `out/eval` (when there is an eval split) and `out/meta.json`."""
    import datasets

    from toolkit.data.mixture import mixture_order

    datasets.disable_progress_bars()

    spec = cfg.data.dataset
    mixed = is_mixture(spec)
    sources = parse_sources(spec) if mixed else [Source(spec)]
    builtin = spec.startswith("builtin:") and not mixed  # it holds out its own eval split, scored too
    with tempfile.TemporaryDirectory(dir=cache) as tmp:  # map's per-process files, until saved
        work = Path(tmp)
        formats, trains, evals, added = [], [], [], 0
        for s in sources:
            fmt, table = _tokenized_source(cfg, s.spec, tokenizer, work)
            added += int(table.data.column("system_added").to_numpy().sum())
            table = table.remove_columns("system_added")
            train_idx, eval_idx = (list(range(len(table))), []) if builtin else \
                split_indices(len(table), cfg, s.spec if mixed else "")
            formats.append(fmt)
            trains.append(table.select(train_idx) if eval_idx else table)
            if eval_idx:
                evals.append(table.select(eval_idx))
        if builtin and cfg.data.eval_split > 0 and formats[0] in PAIR_FORMATS:  # held-out pairs
            from toolkit.data.builtin import builtin_records

            held = datasets.Dataset.from_list(builtin_records(spec.split(":", 1)[1], split="eval"))
            evals = [held.map(_encode_records, batched=True, with_indices=True, remove_columns=held.column_names,
                              features=features({"system_added": "bool", **preference_columns(cfg, formats[0])}),
                              fn_kwargs={"fmt": formats[0], "cfg": cfg, "spec": spec, "tokenizer": tokenizer}
                              ).remove_columns("system_added")]
        elif builtin and cfg.data.eval_split > 0:
            scored, _ = _builtin_scored(cfg)
            evals = [datasets.Dataset.from_dict({"messages": scored}).map(
                _encode_records, batched=True, with_indices=True, remove_columns=["messages"],
                features=features({"system_added": "bool"}),
                fn_kwargs={"fmt": "chat", "cfg": cfg, "spec": spec, "tokenizer": tokenizer}).remove_columns(
                "system_added")]
        meta_sources = None
        if mixed:
            weights = [s.weight if s.weight is not None else len(t) for s, t in zip(sources, trains)]
            order = mixture_order([len(t) for t in trains], weights, cfg.train.seed)
            offsets = [sum(len(t) for t in trains[:k]) for k in range(len(trains))]
            train = datasets.concatenate_datasets(trains).select([offsets[s] + i for s, i in order])
            meta_sources = [(s.spec, f, w / sum(weights), len(t)) for s, f, w, t in zip(sources, formats, weights,
                                                                                        trains)]
        else:
            train = trains[0]
        out.mkdir(parents=True)
        train.save_to_disk(str(out / "train"))
        held = datasets.concatenate_datasets(evals) if evals else None
        if held is not None and len(held):
            held.save_to_disk(str(out / "eval"))
        (out / "meta.json").write_text(json.dumps({"format": "+".join(dict.fromkeys(formats)),
                                                   "system_added": added, "sources": meta_sources}))
