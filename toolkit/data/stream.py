"""`--streaming`: records read from the files as the run goes, tokenized per micro-batch; nothing is
prepared or cached first, so the data may be larger than the disk cache or RAM.

Order: the records in file order, epoch after epoch (no shuffle: shuffle the file if it needs it).
Global example g of the run is record g mod N. A map-style run over the same records in the order
its sampler draws them (epoch 0's `torch.randperm(N, seed)`) sees the same examples in every step, so
its losses match a streamed run over a file written in that order (tested), as long as no example
is dropped: the map-style path drops examples left with no answer token after truncation, the
stream keeps them with every label -100 (they add nothing to the loss).

Sharding: accelerate's `IterableDatasetShard` over data-parallel ranks: of every `micro-batch x
ranks` records, rank r takes the r-th micro-batch, which is what the map-style loader gives each
rank of a global batch. Every rank reads every record (JSON decoding only); each tokenizes its own
micro-batches, in the loader's `collate_fn`.

Resume: a step consumes exactly the global batch, so a checkpoint at step s is s x global batch
records into the stream; a resumed run skips that many without tokenizing them (exact, on any
layout that keeps the global batch). Packing: each micro-batch's examples are packed together
(first-fit decreasing within the micro-batch), so a step trains the same examples as unpacked, in
fewer rows.

Needs --max-steps (a stream has no length to count epochs by); no --eval-split, mixture or
built-in data (use the map-style path for those). `--eval-dataset FILE` is prepared map-style
(`toolkit.data.prepare`) and evaluated as in any run.
"""

from __future__ import annotations

from typing import Iterator

import torch

from toolkit.config.schema import DataSettings
from toolkit.data import as_example, collate, data_sources, source_format
from toolkit.data.tokenize import encode_batch
from toolkit.errors import UserError


class RecordStream(torch.utils.data.IterableDataset):
    """(record index, record) of one source in file order, forever; `start` records skipped."""

    def __init__(self, settings: DataSettings, tokenizer):
        from datasets import load_dataset

        from toolkit.data.formats import column_renames, data_files, datasets_log_silenced, read_problem

        source = data_sources(settings.data)[0]
        spec = source.path
        # the map-style reader's files and checks
        local = data_files(spec)
        try:
            with datasets_log_silenced():
                records = load_dataset(local[0], data_files=[str(f) for f in local[1]], split="train",
                                       streaming=True) if local else load_dataset(spec, split="train", streaming=True)
                first = next(iter(records), None)
        except Exception as e:  # noqa: BLE001 - datasets wraps parser errors in many types
            raise read_problem(spec, e) from None
        if first is None:
            raise UserError(f"--dataset {spec}: holds no records")
        self.renames = column_renames(list(first), source)
        self.format = source_format([self.renames.get(c, c) for c in first], settings, source, self._renamed(first))
        self.records, self.data, self.source, self.spec = records, settings.data, source, spec
        self.tokenizer, self.start = tokenizer, 0

    def __iter__(self) -> Iterator[tuple[int, dict]]:
        skip = self.start
        # epoch after epoch, the same order
        while True:
            for i, row in self._records():
                if skip:
                    skip -= 1
                    continue
                yield i, self._renamed(row)

    def tokenize(self, batch: list[tuple[int, dict]]) -> list[dict]:
        pairs = [as_example(row, self.format, i, self.data, self.source) for i, row in batch]
        encs = encode_batch(self.tokenizer, [ex for ex, _ in pairs], self.data.seq_len, self.data.train_on_prompt)
        return [{"input_ids": e.input_ids, "labels": e.labels} for e in encs]

    def __getitem__(self, part: slice) -> list[dict]:
        """`stream[:n]`: the file's first n examples, tokenized (the integrity check's sample)."""
        if not isinstance(part, slice) or part.start or part.stop is None:
            raise TypeError("a stream is read from its start: stream[:n]")
        first = []
        for i, row in self._records():
            if i == part.stop:
                break
            first.append((i, self._renamed(row)))
        return self.tokenize(first)

    def _records(self) -> Iterator[tuple[int, dict]]:
        """The records with their index; a file that breaks mid-stream is one line naming the file
        and line (the run stops: see docs/data.md, bad records)."""
        from toolkit.data.formats import datasets_log_silenced, read_problem

        try:
            with datasets_log_silenced():
                yield from enumerate(self.records)
        except Exception as e:  # noqa: BLE001 - pyarrow and datasets raise many types
            raise read_problem(self.spec, e) from None

    def _renamed(self, row: dict) -> dict:
        return {self.renames.get(k, k): v for k, v in row.items()} if self.renames else row


class StreamCollate:
    """The loader's collate_fn: this rank's micro-batch of records -> tokens -> a padded (or, with
    --packing, packed; `padding_free`, its examples end to end in one row) batch."""

    def __init__(self, stream: RecordStream, pad_id: int, packing: bool, whole: bool = False,
                 padding_free: bool = False):
        self.stream, self.pad_id, self.packing, self.whole = stream, pad_id, packing, whole
        self.padding_free = padding_free and not packing

    def __call__(self, batch: list[tuple[int, dict]]) -> dict[str, torch.Tensor]:
        rows = self.stream.tokenize(batch)
        if self.padding_free:
            from toolkit.data.packing import collate_padding_free

            return collate_padding_free(rows, self.pad_id, self.whole, restart=self.stream.data.seq_len)
        if not self.packing:
            return collate(rows, self.pad_id, self.whole)
        from toolkit.data.packing import PackedRows, collate_packed, pack_bins

        packed = PackedRows(rows, pack_bins([len(r["input_ids"]) for r in rows], self.stream.data.seq_len))
        return collate_packed([packed[k] for k in range(len(packed))], self.pad_id, self.whole)
