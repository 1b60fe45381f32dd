"""The training loaders of a run that reads its rows (SFT and the preference objectives): micro-batches in a
seeded per-epoch order that accelerate shards over the ranks, packed or laid end to end (padding-free) by the
collate, or a record stream's; and the optimizer steps' global batches read from them (`global_batches`),
resumable mid-epoch."""

from __future__ import annotations

import math
from typing import Iterator

import torch
from torch.utils.data import DataLoader, Sampler

from toolkit.data.image_rows import MediaCollate
from toolkit.data.packing import Collate, PackedRows, pack_bins


class EpochShuffleSampler(Sampler[int]):
    """A permutation that depends only on (seed, epoch): identical on every rank and for every
    world size, so sharding it gives disjoint, reproducible data per rank."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed, self.epoch = n, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return iter(torch.randperm(self.n, generator=g).tolist())

    def __len__(self) -> int:
        return self.n


def make_loader(rows: list[dict], cfg, pad_id: int, pin: bool = False, whole: bool = False,
                width: int | None = None, padding_free: bool = False) -> DataLoader:
    """Micro-batches in a seeded per-epoch order; accelerate.prepare shards it across ranks.
    With --packing the rows are packed once (deterministically) and the packed rows shuffled. `pin`:
    page-locked batches, so their copy to a GPU does not wait for the work queued before it. `whole`:
    the batches reach the model uncut, so the collate adds what it finds on the CPU (target rows, packed
    documents' boundaries) for the forward to skip its read-backs. `width`: the packing width, the
    widest a batch gets where blocks compile (`toolkit.data.packing.Collate`; default --seq-len).
    `padding_free`: each micro-batch's examples end to end in one row (the same examples, in the same order)."""
    sampler = EpochShuffleSampler(len(rows), cfg.train.seed)
    # Its own generator: a DataLoader iterator otherwise draws its base seed from the global RNG when
    # it starts, which would shift dropout's random stream depending on where a resumed run started.
    return DataLoader(rows, batch_size=cfg.train.micro_batch_size, sampler=sampler, pin_memory=pin,
                      collate_fn=Collate(pad_id, whole, cfg.data.packing, width or cfg.data.seq_len, cfg.data.seq_len,
                                         padding_free),
                      generator=torch.Generator().manual_seed(cfg.train.seed))


def stream_loader(stream, cfg, tokenizer, whole: bool = False, padding_free: bool = False) -> DataLoader:
    """Micro-batches of records in stream order, tokenized (and packed, or laid end to end) by the collate_fn
    on the rank that trains them; accelerate.prepare shards it (`toolkit.data.stream`)."""
    from toolkit.data.stream import StreamCollate

    return DataLoader(stream, batch_size=cfg.train.micro_batch_size,
                      collate_fn=StreamCollate(stream, tokenizer.pad_token_id, cfg.data.packing, whole, padding_free))


def global_batches(loader, grad_accum: int, start: tuple[int, int] = (0, 0)) -> Iterator[tuple[int, list[dict]]]:
    """(epoch, micro-batches of one optimizer step), forever; an epoch's last step may be short.
    `start` = (epoch, micro-batches this rank already read in it) resumes mid-epoch.

    The skip is of this rank's micro-batches, after the epoch is sharded (accelerate's
    `skip_first_batches`, as transformers' Trainer resumes; only index lists are skipped, no example is
    loaded): the shards, and the examples accelerate's `even_batches` repeats from the epoch's start to
    fill the last, short global batch on every rank, are then those of the uninterrupted run. Skipping
    examples before the split instead would fill that batch from the resume point's examples."""
    from accelerate.data_loader import skip_first_batches

    epoch, skip = start
    while True:
        loader.set_epoch(epoch)
        chunk: list[dict] = []
        for batch in skip_first_batches(loader, skip) if skip else loader:
            chunk.append(batch)
            if len(chunk) == grad_accum:
                yield epoch, chunk
                chunk = []
        if chunk:
            yield epoch, chunk
        epoch, skip = epoch + 1, 0


def rows_read(loader, grad_accum: int, steps_per_epoch: int, steps: int) -> set[int]:
    """The indices of the rows this rank's `loader` reads in steps 1..`steps`, as `global_batches` reads
    them, from the index lists alone (no row is loaded); a packed row counts as the examples in it."""
    read: set[int] = set()
    sampler = getattr(loader, "batch_sampler", None) or loader.sampler
    # PackedRows: each packed row's example indices
    bins = getattr(loader.dataset, "bins", None)
    for epoch in range(math.ceil(steps / steps_per_epoch)):
        loader.set_epoch(epoch)
        micro = min(steps - epoch * steps_per_epoch, steps_per_epoch) * grad_accum
        for k, indices in enumerate(sampler):
            if k == micro:
                break
            read.update(j for i in indices for j in (bins[i] if bins is not None else (i,)))
    loader.set_epoch(0)
    return read


def training_loader(cfg, train_rows, tokenizer, log, pin: bool, whole: bool, attn: str | None = None,
                    sequences: int = 1, unit: str = "examples") -> DataLoader:
    """The map-style loader (packed from the lengths column of a table with --packing: no row is read
    to pack), or the stream's: tokenized per micro-batch as it is read. Unpacked micro-batches go
    padding-free where `toolkit.model.attention.padding_free_on` says (`attn`: the model's attention), said in one
    line either way. `sequences`: an example's sequences (a pair's two), each up to --seq-len tokens; `unit`: what
    an example is called."""
    from toolkit.model.attention import padding_free_on

    processor = getattr(train_rows, "processor", None)
    padding_free = padding_free_on(cfg, attn)
    # images: the processor's inputs beside the rows (`toolkit.data.image_rows`)
    if processor is not None and cfg.data.packing:
        from toolkit.data.image_rows import ImageBins

        # bins of examples, laid end to end per micro-batch (a model whose images are tied to their rows was refused:
        # `toolkit.cli.startup.resolve_images`)
        n_examples, width = len(train_rows), cfg.data.seq_len * sequences
        train_rows = ImageBins(train_rows, width)
        fill = sum(train_rows.lengths) / (len(train_rows) * width)
        log(f"packing: {n_examples} {unit} -> {len(train_rows)} rows of <= {width} tokens ({fill:.1%} full), each "
            f"micro-batch's {cfg.train.micro_batch_size} rows end to end in one, with the processor's image inputs")
        return DataLoader(train_rows, batch_size=cfg.train.micro_batch_size,
                          sampler=EpochShuffleSampler(len(train_rows), cfg.train.seed),
                          collate_fn=MediaCollate(processor, tokenizer.pad_token_id, True, whole, cfg.data_ranks),
                          generator=torch.Generator().manual_seed(cfg.train.seed))
    if processor is not None:
        # a model whose images are tied to their rows is padded (`toolkit.cli.startup.resolve_images`)
        why = "--no-padding-free, or the model's images are tied to their rows: its attention line says which" \
            if cfg.data.padding_free is False else None
        log(padding_free_line(cfg, attn, padding_free, unit + (" (chosen, rejected)" if sequences == 2 else ""), why)
            + ", with the processor's image inputs")
        if not padding_free:
            from toolkit.data.image_prepare import every_image

            # padded by the attention picked (--padding-free unset): no blank image takes an image-free batch's place
            every_image(train_rows.column("images"), cfg.data.dataset, unit, cfg.data_ranks,
                        "padded ")
        return DataLoader(train_rows, batch_size=cfg.train.micro_batch_size,
                          sampler=EpochShuffleSampler(len(train_rows), cfg.train.seed),
                          collate_fn=MediaCollate(processor, tokenizer.pad_token_id, padding_free, whole,
                                                  cfg.data_ranks),
                          generator=torch.Generator().manual_seed(cfg.train.seed))
    if not cfg.data.packing:
        log(padding_free_line(cfg, attn, padding_free, unit + (" (chosen, rejected)" if sequences == 2 else "")))
    if cfg.data.streaming:
        return stream_loader(train_rows, cfg, tokenizer, whole, padding_free)
    width = None
    # the widest row: micro-batch x --seq-len tokens x the example's sequences
    if padding_free:
        width = cfg.train.micro_batch_size * cfg.data.seq_len * sequences
    if cfg.data.packing:
        n_examples = len(train_rows)
        lengths = getattr(train_rows, "lengths", None)
        lengths = [len(r["input_ids"]) for r in train_rows] if lengths is None else lengths
        width = cfg.data.seq_len * sequences
        train_rows = PackedRows(train_rows, pack_bins(lengths, width), lengths)
        fill = sum(lengths) / (len(train_rows) * width)
        log(f"packing: {n_examples} {unit} -> {len(train_rows)} rows of <= {width} tokens ({fill:.1%} full)")
    return make_loader(train_rows, cfg, tokenizer.pad_token_id, pin, whole, width, padding_free)


def padding_free_line(cfg, attn: str | None, on: bool, unit: str = "examples", why: str | None = None) -> str:
    """What an unpacked run's batches are: padding-free, or padded and why (`unit`: what an example is called; `why`:
    the reason, where the caller knows it)."""
    from toolkit.model.attention import kernel_of
    from toolkit.config import padding_free_blocked

    attn = kernel_of(attn)
    if on:
        return (f"batches: padding-free: each micro-batch's {cfg.train.micro_batch_size} {unit} end to end in one row, "
                f"positions restarting at each, kept apart by {attn} attention (--no-padding-free pads them)")
    why = why or ("--no-padding-free" if cfg.data.padding_free is False else padding_free_blocked(cfg) or
                  f"{attn} attention would need a dense mask over the row (--padding-free lays them end to end anyway)")
    return f"batches: padded to each micro-batch's longest row ({why})"
