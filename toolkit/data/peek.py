"""A run's data checked before anything heavy loads: each source's columns read cheaply (a JSON or JSON
Lines file of up to `PEEK_BYTES` parsed whole, a CSV file's header, a Parquet file's schema) and put
through the same functions the full read puts them through (`column_renames`, `source_format`), so a
file no format fits, a mapping naming a column the file lacks or a field its format does not read, data
that does not fit --objective, an empty file or one of `{}` is one line half a second after the command,
not after torch, transformers, the model's skeleton and the tokenizer have loaded (a median 14.6 s on 2
shared cores, docs/data.md#bad-records).

Only what the full read would say too is said here: a file this reader cannot parse the way `datasets`
does (a larger file, a pretty-printed object, a CSV header with an empty or repeated name, a hub or
built-in dataset) is left to the full read, which names the problem, if any, with its line.
"""

from __future__ import annotations

import json
from pathlib import Path

from toolkit.config.schema import DataSettings
from toolkit.data import as_example, check_trainable, data_sources, eval_source, source_format
from toolkit.data.formats import EMPTY_OBJECTS, DataSource, column_renames, data_files
from toolkit.data.table import DataStats
from toolkit.data.tokenize import empty_answers
from toolkit.config.objectives import form
from toolkit.errors import UserError

# JSON read whole up to this (0.19 s for 8 MiB of alpaca records, 2 shared cores): more
PEEK_BYTES = 8 << 20
# is the full read's


def check_data(settings: DataSettings) -> None:
    """Every source of --dataset and --eval-dataset: its columns mapped and matched to a format; where its
    records were read whole (JSON), each of them as SFT reads it (the turns' keys and speakers, an answer
    to train on), and a file whose answers are all empty."""
    sources = data_sources(settings.data) + ([eval_source(settings.data)] if settings.data.eval_dataset else [])
    for source in sources:
        peeked = peek(source)
        if peeked is None:
            continue
        columns, rows = peeked
        renames = column_renames(columns, source)
        rows = [{renames.get(k, k): v for k, v in r.items()} for r in rows]
        fmt = source_format([renames.get(c, c) for c in columns], settings, source, rows[0] if rows else None)
        if rows and form(settings.objective) == "conversations":
            _check_records(rows, fmt, settings, source, alone=len(sources) == 1 or source.flag == "--eval-dataset")


def _check_records(rows: list[dict], fmt: str, settings: DataSettings, source: DataSource, alone: bool) -> None:
    """Each record as the full read converts it (`as_example`); `alone` (the run's only training source, or
    the eval file, and no --eval-split to divide it): every answer empty is the error it would be after
    tokenizing (`check_trainable`)."""
    empty = sum(empty_answers(as_example(r, fmt, i, settings.data, source)[0])[0] for i, r in enumerate(rows))
    if alone and empty == len(rows) and settings.data.eval_split == 0:
        # named as the full read names it (`prepare_data`)
        held = source.flag == "--eval-dataset"
        check_trainable(DataStats(examples=empty, dropped=empty, empty=empty), settings, "eval" if held else "training",
                        f"{source.flag} {source.path}" if held else "")


def peek(source: DataSource) -> tuple[list[str], list[dict]] | None:
    """(the source's columns as `datasets` would read them, its records as it would give them (JSON; none
    for CSV and Parquet, whose columns alone are read)) where that is cheap and certain; None: left to
    the full read."""
    if source.path.startswith("builtin:"):
        return None
    # None: a hub id
    local = data_files(source.path, source.flag)
    if local is None:
        return None
    kind, files = local
    if kind == "json" and sum(f.stat().st_size for f in files) > PEEK_BYTES:
        return None
    read = {"json": _json_columns, "csv": _csv_columns, "parquet": _parquet_columns}[kind]
    columns: dict[str, None] = {}
    rows: list[dict] = []
    for f in files:
        got = read(f, source.flag)
        if got is None:
            return None
        columns.update(dict.fromkeys(got[0]))
        rows += got[1]
    return list(columns), _as_datasets_gives(rows, list(columns)) if kind == "json" else []


def _as_datasets_gives(rows: list[dict], columns: list[str]) -> list[dict]:
    """Records as `datasets` gives them: every column in each (None where a record lacks it), and in a
    column of objects (a list of turns, or one turn) every key any of them has."""
    keys: dict[str, dict[str, None]] = {}
    for r in rows:
        for c, v in r.items():
            for item in v if isinstance(v, list) else [v]:
                if isinstance(item, dict):
                    keys.setdefault(c, {}).update(dict.fromkeys(item))

    def fill(c: str, v):
        if c not in keys:
            return v
        whole = lambda d: {k: d.get(k) for k in keys[c]} if isinstance(d, dict) else d  # noqa: E731
        return [whole(x) for x in v] if isinstance(v, list) else whole(v)

    return [{c: fill(c, r.get(c)) for c in columns} for r in rows]


def _json_columns(path: Path, flag: str) -> tuple[list[str], list[dict]] | None:
    """A JSON array or JSON Lines file of objects: the keys of all its records, in the order first met."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    if not text.strip():
        raise UserError(f"{flag} {path}: file is empty")
    try:
        rows = json.loads(text) if text.lstrip().startswith("[") else \
            [json.loads(line) for line in text.splitlines() if line.strip()]
    # a pretty-printed object, a broken line: the full read says which
    except ValueError:
        return None
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        return None
    # `{}`: datasets says 'Instruction "train" corresponds to no data!'
    if not any(rows):
        raise UserError(f"{flag} {path}: holds no records" + (EMPTY_OBJECTS if rows else ""))
    return list(dict.fromkeys(k for r in rows for k in r)), rows


def _csv_columns(path: Path, flag: str) -> tuple[list[str], list[dict]] | None:
    """A CSV file's header (pandas names an empty or repeated one itself: left to the full read)."""
    import csv

    try:
        with open(path, newline="", encoding="utf-8") as f:
            header = next(csv.reader(f), None)
    except (OSError, UnicodeDecodeError, csv.Error):
        return None
    if not header or any(not h for h in header) or len(set(header)) < len(header):
        return None
    return header, []


def _parquet_columns(path: Path, flag: str) -> tuple[list[str], list[dict]] | None:
    import pyarrow.parquet as pq

    try:
        return pq.read_schema(path).names, []
    except Exception:  # noqa: BLE001 - a damaged file: the full read says so
        return None


def data_images(settings: DataSettings, full: bool = True) -> bool:
    """The training data holds images: an image column (the mapping applied) with a value, or a turn whose content
    lists an image part. Read from the peeked records, else (`full`) from the first 100 of the full read, whose own
    errors are left to the data's preparation to say; a built-in says."""
    from toolkit.data.builtin import IMAGE_BUILTINS
    from toolkit.data.formats import load_records, map_columns
    from toolkit.data.images import IMAGE_COLUMNS, reference

    def pictured(turns) -> bool:
        return isinstance(turns, list) and any(
            isinstance(value, list) and any(isinstance(p, dict) and reference(p) is not None for p in value)
            for t in turns if isinstance(t, dict) for value in t.values())

    for source in data_sources(settings.data):
        if source.path.startswith("builtin:"):
            if source.path.split(":", 1)[1] in IMAGE_BUILTINS:
                return True
            continue
        peeked = peek(source)
        if peeked is not None and peeked[1]:
            renames = column_renames(peeked[0], source)
            rows = [{renames.get(k, k): v for k, v in r.items()} for r in peeked[1]]
        elif not full:
            continue
        else:
            try:
                records = map_columns(load_records(source.path, source.flag), source)
                rows = [records[i] for i in range(min(100, len(records)))]
            # a file the full read refuses (not UTF-8, ...): `prepare_data` says so in one line
            except Exception:  # noqa: BLE001
                continue
        if any(row.get(c) not in (None, [], "") for row in rows for c in IMAGE_COLUMNS) or \
                any(pictured(v) for row in rows for v in row.values()):
            return True
    return False
