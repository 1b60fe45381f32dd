"""Tokenized examples as an Arrow table: tokenized once by `datasets.map` (batched, `--data-workers`
processes), written to a cache file named by a hash of everything that decides the tokens, and
memory-mapped from there by every later run and every rank (the first process builds it under a
file lock, the others wait and read it).

The table is saved with `save_to_disk` into a folder named by the hash (renamed into place when
complete) and memory-mapped by `open_table` with pyarrow alone: a warm run does not import `datasets`
(0.8 s of a tiny run's start-up, pandas included). Columns: `input_ids`, `labels` (int32), `length`,
`targets` (trained tokens), `truncated`. `Rows` gives the rest of the toolkit the list-of-dicts view
it reads (`rows[i]`, slices, iteration, `len`), one row at a time from the mapped file.
Token ids and labels come from the same `encode` as before, so they are identical.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

# bump when encode() or the tables' layout changes (3: preference rows' `empty`; 4: SFT's
CACHE_VERSION = "4"
# empty answers untrained and counted, `empty` and `blank_turns`)


@dataclass
class DataStats:
    examples: int = 0
    truncated: int = 0
    # nothing left to train: after truncation, or `empty`
    dropped: int = 0
    # of `dropped`: rows whose answers (a pair: a completion) are empty or whitespace-only (`blank`)
    empty: int = 0
    # empty assistant turns left untrained in the rows kept (`tokenize.Encoded.blank_turns`)
    blank_turns: int = 0
    tokens: int = 0
    target_tokens: int = 0
    # read from the tokenized-data cache (this module)
    cached: bool = False


def _encode_batch(batch: dict, tokenizer, seq_len: int, train_on_prompt: bool) -> dict:
    from toolkit.data.tokenize import encode_batch

    encs = encode_batch(tokenizer, [json.loads(t) for t in batch["example"]], seq_len, train_on_prompt)
    return {**token_columns(encs), **answer_columns(encs)}


def tokenizer_digest(tokenizer) -> str:
    """What in a tokenizer decides the ids: its vocabulary and rules, specials and chat template."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    parts = [backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True),
             str(getattr(tokenizer, "chat_template", "")), str(tokenizer.eos_token_id), str(tokenizer.bos_token_id),
             type(tokenizer).__name__]
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()


def cache_key(texts: list[str], tokenizer, seq_len: int, train_on_prompt: bool) -> str:
    h = hashlib.sha256(f"{CACHE_VERSION}\x00{tokenizer_digest(tokenizer)}\x00{seq_len}\x00{train_on_prompt}".encode())
    for t in texts:
        h.update(t.encode())
        h.update(b"\x00")
    return h.hexdigest()


def default_workers() -> int:
    """The node's cores: one process per node builds while its other ranks wait on the lock."""
    return os.cpu_count() or 1


def map_processes(rows: int, workers: int) -> int | None:
    """`Dataset.map`'s num_proc: `workers` (0: `default_workers()`), in process below 1024 rows
    (starting processes costs more than it saves)."""
    n = workers or default_workers()
    return n if n > 1 and rows >= 1024 else None


FEATURES = {"input_ids": ("int32",), "labels": ("int32",), "length": "int32", "targets": "int32", "truncated": "bool"}
# SFT's: `answer_columns`
ANSWER_COLUMNS = {"empty": "bool", "blank_turns": "int32"}


def features(extra: dict | None = None):
    """The tokenized columns (`FEATURES`), plus `extra` {name: dtype}."""
    from datasets import Features, Sequence, Value

    spec = {**FEATURES, **(extra or {})}
    return Features({k: Sequence(Value(v[0])) if isinstance(v, tuple) else Value(v) for k, v in spec.items()})


def token_columns(encs: list) -> dict[str, list]:
    """`encode_batch`'s results as the table's columns."""
    from toolkit.data.tokenize import IGNORE_INDEX

    return {"input_ids": [e.input_ids for e in encs], "labels": [e.labels for e in encs],
            "length": [len(e.input_ids) for e in encs],
            "targets": [sum(1 for x in e.labels[1:] if x != IGNORE_INDEX) for e in encs],
            "truncated": [e.truncated for e in encs]}


def answer_columns(encs: list) -> dict[str, list]:
    """SFT's empty answers, for the data line: `empty` (the row has no label, `table_stats` drops it) and
    `blank_turns`."""
    return {"empty": [e.empty for e in encs], "blank_turns": [e.blank_turns for e in encs]}


def built_once(path: Path, build) -> bool:
    """Run `build(tmp)` unless `path` exists, under a file lock (one process builds, the others
    wait, then read), publishing `tmp` as `path` by rename; whether `path` was there already."""
    from filelock import FileLock

    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):
        if path.is_dir():
            return True
        tmp = Path(str(path) + ".tmp")
        # left by a build that was killed
        if tmp.exists():
            import shutil

            shutil.rmtree(tmp)
        try:
            build(tmp)
        except Exception as e:
            from toolkit.errors import UserError, disk_error

            disk = disk_error(e)
            if disk is None:
                raise
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
            raise UserError(f"could not write the tokenized data cache in {path.parent}: "
                            f"{(disk.strerror or str(disk)).lower()}; free space there, or set TOOLKIT_CACHE to a "
                            "folder on a roomier disk") from None
        os.replace(tmp, path)
    return False


def tokenized_table(convs: list, tokenizer, seq_len: int, train_on_prompt: bool, cache: Path, workers: int = 0):
    """(the table for `convs` (conversations or texts), whether the cache already held it)."""
    import datasets

    texts = [json.dumps(c, ensure_ascii=False) for c in convs]
    path = cache / cache_key(texts, tokenizer, seq_len, train_on_prompt)
    datasets.disable_progress_bars()

    def build(tmp: Path) -> None:
        # map's per-process files, then one table
        with tempfile.TemporaryDirectory(dir=cache) as work:
            table = datasets.Dataset.from_dict({"example": texts}).map(
                _encode_batch, batched=True, batch_size=256, remove_columns=["example"],
                features=features(ANSWER_COLUMNS),
                num_proc=map_processes(len(texts), workers),
                fn_kwargs={"tokenizer": tokenizer, "seq_len": seq_len, "train_on_prompt": train_on_prompt},
                cache_file_name=str(Path(work) / "part.arrow"), new_fingerprint=path.name[:32])
            table.save_to_disk(str(tmp))

    hit = built_once(path, build)
    return open_table(path), hit


def open_table(path: Path):
    """The `pyarrow.Table` that `save_to_disk` wrote to `path`, memory-mapped: its Arrow stream files
    in the order `state.json` lists them."""
    import pyarrow as pa

    files = [path / f["filename"] for f in json.loads((path / "state.json").read_text())["_data_files"]]
    return pa.concat_tables([pa.ipc.open_stream(pa.memory_map(str(f))).read_all() for f in files])


def table_stats(table):
    """(DataStats, the indices of the rows with a target token, or None when that is every row),
    from whole columns."""
    targets, lengths, truncated = (column(table, c) for c in ("targets", "length", "truncated"))
    kept = (targets > 0).nonzero()[0]
    names = table.column_names
    empty = int(column(table, "empty").sum()) if "empty" in names else 0
    blanks = int(column(table, "blank_turns")[kept].sum()) if "blank_turns" in names else 0
    stats = DataStats(examples=table.num_rows, truncated=int(truncated.sum()), dropped=table.num_rows - len(kept),
                      tokens=int(lengths[kept].sum()), target_tokens=int(targets[kept].sum()), empty=empty,
                      blank_turns=blanks)
    return stats, (kept if len(kept) < table.num_rows else None)


def _view(array, buffer: int = 1, length: int | None = None):
    """A primitive Arrow array's data (or a list array's offsets) as a numpy view of the mapped file.
    pyarrow's own `to_numpy` imports pandas (0.7 s) to check for it; the tables hold no nulls."""
    import numpy as np
    import pyarrow as pa

    kind = array.type if buffer == 1 and not pa.types.is_list(array.type) else None
    dtype = {pa.int32(): np.int32, pa.int64(): np.int64, pa.int8(): np.int8}[kind] if kind else np.int32
    count = len(array) + (0 if kind else 1)
    return np.frombuffer(array.buffers()[buffer], dtype=dtype, count=count,
                         offset=array.offset * np.dtype(dtype).itemsize)


def column(table, name: str):
    """A numeric or bool column of `table` as one numpy array (bools as int8)."""
    import numpy as np
    import pyarrow as pa

    chunks = [_view(c.cast(pa.int8()) if pa.types.is_boolean(c.type) else c) for c in table.column(name).chunks]
    return chunks[0] if len(chunks) == 1 else np.concatenate(chunks) if chunks else np.zeros(0, np.int32)


class _ListColumn:
    """A list<int32> column of a mapped table as (offsets, values) numpy views per chunk: row i is
    `values[offsets[i]:offsets[i + 1]]`, read without a copy of the column."""

    def __init__(self, col):
        import numpy as np

        self.chunks = [(_view(c), _view(c.values)) for c in col.chunks]
        self.starts = np.cumsum([0] + [len(o) - 1 for o, _ in self.chunks])

    def __getitem__(self, i: int) -> list[int]:
        k = int(self.starts.searchsorted(i, side="right")) - 1
        offsets, values = self.chunks[k]
        j = i - int(self.starts[k])
        return values[offsets[j]:offsets[j + 1]].tolist()


class Rows:
    """The trainable rows of a table (those with a target token, `keep`), read as a list of dicts;
    `lengths` without reading the rows (packing)."""

    def __init__(self, table, keep=None):
        lengths = column(table, "length")
        self.keep = keep
        self.lengths = lengths if keep is None else lengths[keep]
        self._ids, self._labels = _ListColumn(table.column("input_ids")), _ListColumn(table.column("labels"))
        # preference pairs: the rejected sequence beside the chosen one
        names = table.column_names
        self._beside = [(c, _ListColumn(table.column(c))) for c in ("rejected_input_ids", "rejected_labels",
                                                                     "kl_input_ids", "kl_labels") if c in names]
        # KTO's labels
        self._desirable = table.column("desirable").to_pylist() if "desirable" in names else None
        # preference data: each row's (N, 2) reference log-probabilities (`toolkit.objectives.preference.reference`): a
        # pair's (chosen, rejected), a KTO example's (its sequence, its KL sequence)
        self.reference = None

    def desirable(self) -> list[bool]:
        """KTO's labels of the kept rows (empty for other data)."""
        if self._desirable is None:
            return []
        return self._desirable if self.keep is None else [self._desirable[int(r)] for r in self.keep]

    def digest(self) -> str:
        """sha256 of the rows' tokens (every id and label column, the kept rows)."""
        h = hashlib.sha256(b"" if self.keep is None else self.keep.data)
        for col in [self._ids, self._labels, *(c for _, c in self._beside)]:
            # views of the mapped file: hashed without a copy
            for offsets, values in col.chunks:
                h.update(offsets.data)
                h.update(values.data)
        return h.hexdigest()

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        i = int(i) % len(self)
        r = i if self.keep is None else int(self.keep[i])
        row = {"input_ids": self._ids[r], "labels": self._labels[r]}
        if not self._beside:
            return row
        row.update({c: col[r] for c, col in self._beside})
        if self._desirable is not None:
            row["desirable"] = self._desirable[r]
        if self.reference is not None:
            # NaN where the reference pass did not score the row: a batch the loader fetches past the run's last
            # step holds such rows; the loss refuses one (`PreferenceLoss.reference_logps`)
            row["ref_logps"] = self.reference[i].tolist()
        return row

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]

    def __bool__(self) -> bool:
        return len(self) > 0
