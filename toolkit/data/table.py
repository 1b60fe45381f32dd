"""Tokenized examples as an Arrow table: tokenized once by `datasets.map` (batched, `--data-workers`
processes), written to a cache file named by a hash of everything that decides the tokens, and
memory-mapped from there by every later run and every rank (the first process builds it under a
file lock, the others wait and read it).

The table is saved with `save_to_disk` into a folder named by the hash (renamed into place when
complete) and opened with `load_from_disk`. Columns: `input_ids`, `labels` (int32), `length`, `targets` (trained tokens), `truncated`. `Rows`
gives the rest of the toolkit the list-of-dicts view it reads (`rows[i]`, slices, iteration,
`len`), one row at a time from the mapped file.
Token ids and labels come from the same `encode` as before, so they are identical.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

CACHE_VERSION = "2"  # bump when encode() or the tables' layout changes


def _encode_batch(batch: dict, tokenizer, seq_len: int, train_on_prompt: bool) -> dict:
    from toolkit.data.tokenize import encode_batch

    return token_columns(encode_batch(tokenizer, [json.loads(t) for t in batch["example"]], seq_len, train_on_prompt))


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


def built_once(path: Path, build) -> bool:
    """Run `build(tmp)` unless `path` exists, under a file lock (one process builds, the others
    wait, then read), publishing `tmp` as `path` by rename; whether `path` was there already."""
    from filelock import FileLock

    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):
        if path.is_dir():
            return True
        tmp = Path(str(path) + ".tmp")
        if tmp.exists():  # left by a build that was killed
            import shutil

            shutil.rmtree(tmp)
        build(tmp)
        os.replace(tmp, path)
    return False


def tokenized_table(convs: list, tokenizer, seq_len: int, train_on_prompt: bool, cache: Path, workers: int = 0):
    """(the table for `convs` (conversations or texts), whether the cache already held it)."""
    import datasets

    texts = [json.dumps(c, ensure_ascii=False) for c in convs]
    path = cache / cache_key(texts, tokenizer, seq_len, train_on_prompt)
    datasets.disable_progress_bars()

    def build(tmp: Path) -> None:
        with tempfile.TemporaryDirectory(dir=cache) as work:  # map's per-process files, then one table
            table = datasets.Dataset.from_dict({"example": texts}).map(
                _encode_batch, batched=True, batch_size=256, remove_columns=["example"], features=features(),
                num_proc=map_processes(len(texts), workers),
                fn_kwargs={"tokenizer": tokenizer, "seq_len": seq_len, "train_on_prompt": train_on_prompt},
                cache_file_name=str(Path(work) / "part.arrow"), new_fingerprint=path.name[:32])
            table.save_to_disk(str(tmp))

    hit = built_once(path, build)
    return datasets.load_from_disk(str(path)), hit  # memory-mapped


def table_stats(table):
    """(DataStats, the indices of the rows with a target token, or None when that is every row),
    from whole columns (indexing a datasets column is a Python call per row)."""
    from toolkit.data import DataStats

    targets, lengths, truncated = (table.data.column(c).to_numpy() for c in ("targets", "length", "truncated"))
    kept = (targets > 0).nonzero()[0]
    stats = DataStats(examples=len(table), truncated=int(truncated.sum()), dropped=len(table) - len(kept),
                      tokens=int(lengths[kept].sum()), target_tokens=int(targets[kept].sum()))
    return stats, (kept if len(kept) < len(table) else None)


class Rows:
    """The trainable rows of a table (those with a target token), read as a list of dicts;
    `lengths` without reading the rows (packing)."""

    def __init__(self, table, keep=None):
        lengths = table.data.column("length").to_numpy()
        self.lengths = lengths if keep is None else lengths[keep]
        self.table = table if keep is None else table.select(keep)

    def __len__(self) -> int:
        return len(self.table)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        row = self.table[int(i)]
        return {"input_ids": row["input_ids"], "labels": row["labels"]}

    def __iter__(self):
        for row in self.table.select_columns(["input_ids", "labels"]):
            yield row

    def __bool__(self) -> bool:
        return len(self) > 0
