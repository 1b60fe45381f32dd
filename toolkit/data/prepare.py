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

`--eval-dataset FILE` is prepared on its own, into a cache entry of its own keyed the same way: changing
the eval file re-tokenizes only it, and a streamed run evaluates on it too.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

from toolkit.config.schema import DataConfig, DataSettings
from toolkit.data import DataStats, as_example, check_trainable, data_sources, eval_source, source_format, split_indices
from toolkit.data.formats import DataSource
from toolkit.config.objectives import form
from toolkit.errors import UserError
from toolkit.data.table import ANSWER_COLUMNS, CACHE_VERSION, Rows, answer_columns, built_once, features, \
    map_processes, open_table, table_stats, token_columns, tokenizer_digest
from toolkit.config.datasets import dataset_digest, is_mixture, parse_sources
from toolkit.data.pairs import KTO_COLUMNS, PAIR_COLUMNS, PAIR_FORMATS, encode_kto, encode_pairs

# Settings that change the tokens, or which records are trained and which held out.
TOKEN_SETTINGS = ("format", "columns", "system_prompt", "seq_len", "train_on_prompt", "eval_split", "objective")


@dataclass
class PreparedData:
    # "+"-joined for a mixture of formats
    format: str
    detected: bool
    # or a RecordStream
    train: Rows
    eval: Rows | list
    # of the training split
    stats: DataStats
    eval_stats: DataStats
    # training and eval conversations given --system-prompt
    system_added: int = 0
    # a mixture: (spec, format, weight share, training records) per source
    sources: list | None = None
    # built-in data: held-out chats scored by exact match
    em_conversations: list | None = None
    answers: list[str] | None = None
    # `train` is a `toolkit.data.stream.RecordStream`
    streamed: bool = False
    # --eval-dataset's format (None: no eval file)
    eval_format: str | None = None


def data_key(settings: DataSettings, tokenizer) -> str:
    """The cache folder's name: a hash of everything that decides the prepared tables (the training data's;
    --eval-dataset's are keyed apart, `eval_key`)."""
    d, values = settings.data, _token_settings(settings)
    # the seed draws the eval split and the mixture
    seeded = d.eval_split > 0 or is_mixture(d.dataset)
    parts = [CACHE_VERSION, "prepared", _identity(d.dataset), tokenizer_digest(tokenizer),
             *(f"{k}={v!r}" for k, v in values.items()), f"seed={settings.seed if seeded else None}"]
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()


def eval_key(settings: DataSettings, tokenizer) -> str:
    """The cache folder of --eval-dataset's table: the file and every setting that decides its tokens."""
    parts = [CACHE_VERSION, "eval-dataset", _identity(settings.data.eval_dataset), tokenizer_digest(tokenizer),
             *(f"{k}={v!r}" for k, v in _token_settings(settings).items() if k != "eval_split")]
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()


def _token_settings(settings: DataSettings) -> dict[str, object]:
    """`TOKEN_SETTINGS` by name: the data section's, and the objective."""
    return {k: settings.objective if k == "objective" else getattr(settings.data, k) for k in TOKEN_SETTINGS}


def _identity(spec: str) -> str:
    """The data's content: its files' sha256 (`dataset_digest`), a hub dataset's fingerprint."""
    identity = dataset_digest(spec)
    if any(dataset_digest(s.spec).startswith("spec:") and not s.spec.startswith("builtin:")
           # a hub id: its name does not pin its content
           for s in parse_sources(spec)):
        from toolkit.data.formats import load_records

        identity += "".join(load_records(s.spec)._fingerprint for s in parse_sources(spec))
    return identity


def prepare_data(settings: DataSettings, tokenizer, cache: Path | None = None, processor=None) -> PreparedData:
    """The run's training and eval rows, from the cache or built into it (with --streaming, the
    record stream, read as training goes). `processor`: an image-text model's (`toolkit.data.images`)."""
    from toolkit.cache import cache_dir

    # prompts: tokenized as they are read (a prompt file is small); an image-text model's through its processor
    if form(settings.objective) == "prompts":
        return prepare_prompts(settings, tokenizer, processor)
    cache = cache or cache_dir() / "data"
    if processor is not None:
        from toolkit.data.image_prepare import prepare_images

        fmt, train, held, stats, held_stats, added, scored, answers, sources = prepare_images(settings, processor,
                                                                                             cache)
        return PreparedData(fmt, settings.data.format == "auto", train, held, stats, held_stats, system_added=added,
                            sources=sources, em_conversations=scored, answers=answers)

    if settings.data.streaming:
        from toolkit.data.stream import RecordStream

        # reads the first record: format and columns are checked here
        stream = RecordStream(settings, tokenizer)
        held, held_stats, held_format = _prepared_eval(settings, tokenizer, cache)
        return PreparedData(stream.format, settings.data.format == "auto", stream, held, DataStats(), held_stats,
                            streamed=True, eval_format=held_format)

    path = cache / data_key(settings, tokenizer)
    hit = built_once(path, lambda tmp: _build(settings, tokenizer, tmp, cache))
    meta = json.loads((path / "meta.json").read_text())
    # memory-mapped
    train = open_table(path / "train")
    stats, keep = table_stats(train)
    stats.cached = hit
    check_trainable(stats, settings, "training")
    # --eval-dataset's, if any
    eval_rows, held_stats, held_format = _prepared_eval(settings, tokenizer, cache)
    # --eval-split's (never beside an eval file: `inputs.eval_dataset_problems`)
    if (path / "eval").is_dir():
        held = open_table(path / "eval")
        held_stats, held_keep = table_stats(held)
        check_trainable(held_stats, settings, "eval")
        eval_rows = Rows(held, held_keep)
    em, answers = None, None
    if settings.data.dataset.startswith("builtin:") and not is_mixture(settings.data.dataset):
        em, answers = _builtin_scored(settings.data)
    return PreparedData(meta["format"], settings.data.format == "auto", Rows(train, keep), eval_rows, stats, held_stats,
                        meta["system_added"], [tuple(s) for s in meta["sources"]] if meta["sources"] else None,
                        em, answers, eval_format=held_format)


def _prepared_eval(settings: DataSettings, tokenizer, cache: Path) -> tuple[Rows | list, DataStats, str | None]:
    """(--eval-dataset's rows, their stats, its format), from its own cache entry or built into it; no
    eval file: nothing."""
    source = eval_source(settings.data)
    if source is None:
        return [], DataStats(), None
    path = cache / eval_key(settings, tokenizer)

    def build(out: Path) -> None:
        import datasets

        datasets.disable_progress_bars()
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            fmt, table = _tokenized_source(settings, source, tokenizer, Path(tmp))
            out.mkdir(parents=True)
            table.remove_columns("system_added").save_to_disk(str(out / "eval"))
            (out / "meta.json").write_text(json.dumps({"format": fmt}))

    hit = built_once(path, build)
    table = open_table(path / "eval")
    stats, keep = table_stats(table)
    stats.cached = hit
    check_trainable(stats, settings, "eval", f"--eval-dataset {source.path}")
    return Rows(table, keep), stats, json.loads((path / "meta.json").read_text())["format"]


def _builtin_scored(data: DataConfig) -> tuple[list, list[str]]:
    from toolkit.data import with_system_prompt
    from toolkit.data.builtin import builtin_records

    held = builtin_records(data.dataset.split(":", 1)[1], split="eval")
    return [with_system_prompt(r["messages"], data.system_prompt) for r in held], [r["answer"] for r in held]


def table_columns(objective: str, fmt: str) -> dict:
    """The table's columns beside the tokens: labelled completions' (KTO's), a pair's rejected sequence, or
    SFT's empty answers."""
    return KTO_COLUMNS if form(objective) == "labelled" else PAIR_COLUMNS if fmt in PAIR_FORMATS else ANSWER_COLUMNS


def _encode_records(batch: dict, indices: list[int], fmt: str, settings: DataSettings, source: DataSource,
                    tokenizer) -> dict:
    from toolkit.data.tokenize import encode_batch

    names, d = list(batch), settings.data
    if form(settings.objective) == "labelled":
        return encode_kto([{c: batch[c][j] for c in names} for j in range(len(indices))], indices, fmt, d, source,
                          tokenizer)
    if fmt in PAIR_FORMATS:
        return encode_pairs([{c: batch[c][j] for c in names} for j in range(len(indices))], indices, fmt, d, source,
                            tokenizer)
    pairs = [as_example({c: batch[c][j] for c in names}, fmt, i, d, source) for j, i in enumerate(indices)]
    encs = encode_batch(tokenizer, [ex for ex, _ in pairs], d.seq_len, d.train_on_prompt)
    return {**token_columns(encs), **answer_columns(encs), "system_added": [added for _, added in pairs]}


def _tokenized_source(settings: DataSettings, source: DataSource, tokenizer, work: Path):
    """(format, the source's records tokenized in their order, with a `system_added` column)."""
    from toolkit.data.formats import load_records, map_columns, read_problem

    spec = source.path
    records = map_columns(load_records(spec, source.flag), source)
    fmt = source_format(records.column_names, settings, source, records[0])
    try:
        table = records.map(_encode_records, batched=True, batch_size=256, with_indices=True,
                            remove_columns=records.column_names,
                            features=features({"system_added": "bool", **table_columns(settings.objective, fmt)}),
                            num_proc=map_processes(len(records), settings.data.data_workers),
                            fn_kwargs={"fmt": fmt, "settings": settings, "source": source, "tokenizer": tokenizer},
                            cache_file_name=str(work / f"{len(list(work.iterdir()))}.arrow"),
                            new_fingerprint=hashlib.sha256(f"{work}{spec}".encode()).hexdigest()[:32])
    # pyarrow keeps bytes that are not UTF-8 until a row is read
    except UnicodeDecodeError as e:
        raise read_problem(spec, e, source.flag) from None
    return fmt, table


def _build(settings: DataSettings, tokenizer, out: Path, cache: Path) -> None:
    """Write `out/train`, `out/eval` (when there is an eval split) and `out/meta.json`."""
    import datasets

    from toolkit.data.mixture import mixture_order

    datasets.disable_progress_bars()

    spec = settings.data.dataset
    mixed = is_mixture(spec)
    sources = parse_sources(spec)
    # it holds out its own eval split, scored too map's per-process files, until saved
    builtin = spec.startswith("builtin:") and not mixed
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        work = Path(tmp)
        formats, trains, evals, added = [], [], [], 0
        for s, read in zip(sources, data_sources(settings.data)):
            fmt, table = _tokenized_source(settings, read, tokenizer, work)
            added += int(table.data.column("system_added").to_numpy().sum())
            table = table.remove_columns("system_added")
            train_idx, eval_idx = (list(range(len(table))), []) if builtin else \
                split_indices(len(table), settings, s.spec if mixed else "")
            formats.append(fmt)
            trains.append(table.select(train_idx) if eval_idx else table)
            if eval_idx:
                evals.append(table.select(eval_idx))
        # held-out pairs
        if builtin and settings.data.eval_split > 0 and formats[0] in PAIR_FORMATS:
            from toolkit.data.builtin import builtin_records

            held = datasets.Dataset.from_list(builtin_records(spec.split(":", 1)[1], split="eval"))
            evals = [held.map(_encode_records, batched=True, with_indices=True, remove_columns=held.column_names,
                              features=features({"system_added": "bool",
                                                 **table_columns(settings.objective, formats[0])}),
                              fn_kwargs={"fmt": formats[0], "settings": settings, "source": DataSource(spec),
                                         "tokenizer": tokenizer}).remove_columns("system_added")]
        elif builtin and settings.data.eval_split > 0:
            scored, _ = _builtin_scored(settings.data)
            evals = [datasets.Dataset.from_dict({"messages": scored}).map(
                _encode_records, batched=True, with_indices=True, remove_columns=["messages"],
                features=features({"system_added": "bool", **ANSWER_COLUMNS}),
                fn_kwargs={"fmt": "chat", "settings": settings, "source": DataSource(spec), "tokenizer": tokenizer}
            ).remove_columns("system_added")]
        meta_sources = None
        if mixed:
            weights = [s.weight if s.weight is not None else len(t) for s, t in zip(sources, trains)]
            order = mixture_order([len(t) for t in trains], weights, settings.seed)
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


def prepare_prompts(settings: DataSettings, tokenizer, processor=None):
    """The run's training and eval prompts (`toolkit.data.prepare.PreparedData`): --dataset's, less
    --eval-split's held-out share (drawn with the seed, as SFT's; a built-in's own eval split instead), and
    --eval-dataset's. `processor`: an image-text model's (`toolkit.data.prompts.load_prompts`)."""
    from toolkit.data.prompts import PromptRows, builtin_eval_prompts, load_prompts, subset

    sources = data_sources(settings.data)
    if len(sources) > 1:
        raise UserError(f"--objective grpo reads one prompt file (got a mixture of {len(sources)}: "
                        f"{settings.data.dataset}); give one --dataset")
    whole = load_prompts(settings.data, sources[0], tokenizer, processor=processor)
    if not whole:
        raise UserError(f"--dataset {settings.data.dataset}: no prompt is left to sample from"
                        + (f" ({whole.dropped} longer than --seq-len {settings.data.seq_len}: raise it)"
                           if whole.dropped else ""))
    # its own eval split, as SFT's (--eval-split > 0 asks for it)
    if sources[0].path.startswith("builtin:"):
        train, held = list(range(len(whole))), []
        held_rows = PromptRows() if settings.data.eval_split == 0 else \
            builtin_eval_prompts(settings.data, sources[0], tokenizer, processor)
    else:
        train, held = split_indices(len(whole), settings, "")
        held_rows = subset(whole, held) if held else PromptRows()
    if settings.data.eval_dataset:
        held_rows = load_prompts(settings.data, eval_source(settings.data), tokenizer, processor=processor)
    if processor is not None:
        from toolkit.data.image_prepare import every_image

        every_image(whole.images, settings.data.dataset, "prompts", settings.ranks)
    stats = DataStats(examples=len(whole) + whole.dropped - len(held), dropped=whole.dropped)
    return PreparedData(whole.format, settings.data.format == "auto", subset(whole, train), held_rows, stats,
                        DataStats(), eval_format=held_rows.format if settings.data.eval_dataset else None)


def describe_prompts(data: DataConfig, prepared) -> str:
    """The data line of a GRPO run (`prepared`: its `PreparedData`)."""
    rows, stats = prepared.train, prepared.stats
    columns = ", ".join(sorted(rows.columns)) or "none"
    dropped = f"; {stats.dropped} longer than --seq-len {data.seq_len} dropped" if stats.dropped else ""
    return (f"data: {data.dataset}: prompts ({rows.format} form); {len(rows)} training prompts, "
            f"{len(prepared.eval)} eval{dropped}; the reward functions get the columns {columns}")
