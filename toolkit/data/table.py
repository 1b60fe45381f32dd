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

CACHE_VERSION = "1"  # bump when encode() changes what it produces


def _encode_batch(batch: dict, tokenizer, seq_len: int, train_on_prompt: bool) -> dict:
    from toolkit.data.tokenize import IGNORE_INDEX, encode

    out: dict[str, list] = {"input_ids": [], "labels": [], "length": [], "targets": [], "truncated": []}
    for text in batch["example"]:
        enc = encode(tokenizer, json.loads(text), seq_len, train_on_prompt)
        out["input_ids"].append(enc.input_ids)
        out["labels"].append(enc.labels)
        out["length"].append(len(enc.input_ids))
        out["targets"].append(sum(1 for x in enc.labels[1:] if x != IGNORE_INDEX))
        out["truncated"].append(enc.truncated)
    return out


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
    """The node's cores shared by its ranks; 1 (in process) below 2 cores each."""
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    return max(1, (os.cpu_count() or 1) // ranks)


def tokenized_table(convs: list, tokenizer, seq_len: int, train_on_prompt: bool, cache: Path, workers: int = 0):
    """(the table for `convs` (conversations or texts), whether the cache already held it)."""
    import datasets
    from datasets import Features, Sequence, Value
    from filelock import FileLock

    texts = [json.dumps(c, ensure_ascii=False) for c in convs]
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / cache_key(texts, tokenizer, seq_len, train_on_prompt)
    features = Features({"input_ids": Sequence(Value("int32")), "labels": Sequence(Value("int32")),
                         "length": Value("int32"), "targets": Value("int32"), "truncated": Value("bool")})
    datasets.disable_progress_bars()
    with FileLock(str(path) + ".lock"):
        hit = path.is_dir()
        if not hit:
            with tempfile.TemporaryDirectory(dir=cache) as work:  # map's per-process files, then one table
                workers = workers or default_workers()
                table = datasets.Dataset.from_dict({"example": texts}).map(
                    _encode_batch, batched=True, batch_size=256, remove_columns=["example"], features=features,
                    num_proc=workers if workers > 1 and len(texts) >= 1024 else None,
                    fn_kwargs={"tokenizer": tokenizer, "seq_len": seq_len, "train_on_prompt": train_on_prompt},
                    cache_file_name=str(Path(work) / "part.arrow"), new_fingerprint=path.name[:32])
                table.save_to_disk(str(path) + ".tmp")
                del table
            os.replace(str(path) + ".tmp", path)
    return datasets.load_from_disk(str(path)), hit  # memory-mapped


class Rows:
    """The trainable rows of a table (those with a target token), read as a list of dicts."""

    def __init__(self, table, keep: list[int] | None = None):
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
