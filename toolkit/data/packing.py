"""Packing: several tokenized examples per sequence, trained exactly as if unpacked.

Each packed row concatenates whole examples (first-fit decreasing: longest first, each into the
first row with room, so little is left to pad). Per example, `position_ids` restart at 0 and the
first token's label is dropped (it would be "predicted" from the previous example's last token; an
unpacked example never trains its first token either). The model gets `position_ids` and no 2-D
attention mask, from which transformers builds a block-diagonal causal mask (`masking_utils.
find_packed_sequence_indices`: a new block wherever positions do not step by 1) for eager and SDPA
attention, and the padding-free kernels of `toolkit.model.attention` find the documents' boundaries:
attention never crosses examples. (transformers' own `flash_attention_2` does so only for a batch of
one row, unless given the boundaries: `collate_packed(..., bounds=True)`.)
"""

from __future__ import annotations

import torch

from toolkit.data import collate
from toolkit.data.tokenize import IGNORE_INDEX
from toolkit.data.images import MEDIA


def pack_bins(lengths, seq_len: int) -> list[list[int]]:
    """First-fit decreasing: example indices, longest first, each into the first bin with room for
    it (ties in input order). The first fitting bin is found in a max-tree of the bins' free space,
    O(log n) per example; bins not opened yet hold `seq_len`, so the leftmost fitting one is an open
    bin where one fits, else the next new one."""
    lengths = [int(x) for x in lengths]
    size = 1
    while size < max(1, len(lengths)):
        size *= 2
    # free[1] is the root; leaves size..2*size-1 are the bins
    free = [seq_len] * (2 * size)
    bins: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lengths.__getitem__, reverse=True):
        n, node = lengths[i], 1
        while node < size:
            node = 2 * node if free[2 * node] >= n else 2 * node + 1
        slot = node - size
        if slot == len(bins):
            bins.append([])
        bins[slot].append(i)
        free[node] -= n
        while node > 1:
            node //= 2
            free[node] = max(free[2 * node], free[2 * node + 1])
    return bins


class PackedRows:
    """The packed rows of `rows` (a list or `toolkit.data.table.Rows`), built one at a time when read:
    each concatenates its bin's examples, position_ids restarting at 0 and the first token of each
    unlabelled."""

    def __init__(self, rows, bins: list[list[int]], lengths=None):
        self.rows, self.bins = rows, bins
        self.lengths = None if lengths is None else [sum(int(lengths[i]) for i in b) for b in self.bins]

    def __len__(self) -> int:
        return len(self.bins)

    def __getitem__(self, k: int) -> dict:
        ids, labels, positions, refs = [], [], [], []
        for i in self.bins[k]:
            r = self.rows[i]
            sequences = [(r["input_ids"], r["labels"])]
            # a preference pair: its two sequences, documents side by side
            if "rejected_input_ids" in r:
                sequences.append((r["rejected_input_ids"], r["rejected_labels"]))
                refs += r.get("ref_logps", [])
            for seq_ids, seq_labels in sequences:
                ids += seq_ids
                labels += [IGNORE_INDEX] + list(seq_labels[1:])
                positions += list(range(len(seq_ids)))
        row = {"input_ids": ids, "labels": labels, "position_ids": positions, "examples": len(self.bins[k])}
        if "rejected_input_ids" in self.rows[self.bins[k][0]]:
            row["pairs"] = len(self.bins[k])
            if refs:
                row["ref_logps"] = refs
        return row


def pack_rows(rows: list[dict], seq_len: int) -> list[dict]:
    """First-fit decreasing bins of at most `seq_len` tokens -> packed rows with position_ids."""
    packed = PackedRows(rows, pack_bins([len(r["input_ids"]) for r in rows], seq_len))
    return [packed[k] for k in range(len(packed))]


def collate_packed(batch: list[dict], pad_id: int, bounds: bool = False, multiple: int = 1, cap: int | None = None,
                   restart: int | None = None, compiled: bool = False) -> dict[str, torch.Tensor | int]:
    """`collate` plus position_ids: the padding is a block of its own (positions restart at 0) with
    label -100. `attention_mask` marks real tokens for counting; it is not given to the model.
    `bounds`: also the documents' boundaries for padding-free attention, computed here on the CPU so
    the forward needs no device-to-host copy (`toolkit.model.attention.document_bounds`): `cu_seq_lens`,
    over the rows laid end to end, and `max_length` (an int). Only for a batch that reaches the model
    whole: splitting its rows (pipeline micro-batches) would leave them describing the whole.
    `multiple`/`cap`: the width (`bucket_width`); `restart`: the padding's positions restart every
    `restart` tokens (a pair's row is 2 x --seq-len wide: one pad block could pass the model's positions).
    `compiled` (the blocks compile): the boundaries take shapes a compiled graph keeps from step to step, so
    step 2 does not compile the blocks again (it did: 8 more graphs for the tiny model, 6.7 s of an H200's
    LoRA run): `cu_seq_lens` marked dynamic in its length (the documents a row holds vary), `max_length` the
    row's width (a bound, as the varlen kernels read it, where the longest document's length changes)."""
    out = collate(batch, pad_id, bounds, multiple, cap)
    # packed preference pairs (`toolkit.data.pairs`): documents chosen, rejected, ...
    if "pairs" in batch[0]:
        out["pairs"] = torch.tensor(sum(x["pairs"] for x in batch))
        # an int: the loss needs no read-back for it
        out["documents"] = 2 * sum(x["pairs"] for x in batch)
        if "ref_logps" in batch[0]:
            out["ref_logps"] = torch.tensor([v for x in batch for v in x["ref_logps"]], dtype=torch.float32)
    width = out["input_ids"].shape[1]
    positions = torch.zeros_like(out["input_ids"])
    for i, x in enumerate(batch):
        n = len(x["input_ids"])
        positions[i, :n] = torch.tensor(x["position_ids"])
        pad = torch.arange(width - n)
        # `restart`: pad documents below --seq-len
        positions[i, n:] = pad % restart if restart else pad
    if not bounds:
        return {**out, "position_ids": positions}
    from toolkit.model.attention import document_bounds

    docs = document_bounds(positions)
    cu, longest = docs["cu_seq_lens_q"], docs["max_length_q"]
    if compiled:
        torch._dynamo.maybe_mark_dynamic(cu, 0)
        longest = width
    return {**out, "position_ids": positions, "cu_seq_lens": cu, "max_length": longest}


def end_to_end(batch: list[dict]) -> dict:
    """A micro-batch's examples (a preference pair's two sequences, chosen then rejected) end to end in one
    packed row, in the micro-batch's order: `PackedRows` of one bin holding them all."""
    return PackedRows(batch, [list(range(len(batch)))])[0]


def collate_padding_free(batch: list[dict], pad_id: int, whole: bool = False, multiple: int = 1,
                         cap: int | None = None, restart: int | None = None,
                         compiled: bool = False) -> dict[str, torch.Tensor | int]:
    """A padding-free micro-batch (TRL's `padding_free`): its examples end to end in one row, as `collate_packed`
    gives packed rows (positions restarting per example, each one's first label unset, no 2-D mask for the
    model; `whole`: the documents' boundaries too, with `compiled` the shapes a compiled graph keeps). The
    examples, their order, their targets and so the loss are the padded batch's; only the padding is gone (to
    `bucket_width(tokens, multiple, cap)` where blocks compile). KTO's examples are one row and their KL
    sequences another (`kl_*`, counted in `kl_documents`)."""
    args = (pad_id, whole, multiple, cap, restart, compiled)
    if "kl_input_ids" in batch[0]:
        from toolkit.data.pairs import kl_rows, kto_extras

        n = len(batch)
        rows = [{"input_ids": x["input_ids"], "labels": x["labels"]} for x in batch]
        kl = collate_packed([end_to_end(kl_rows(batch))], *args)
        return {**collate_packed([end_to_end(rows)], *args), "documents": n,
                **kto_extras(batch, {**kl, "documents": n})}
    return collate_packed([end_to_end(batch)], *args)


def model_inputs(batch: dict[str, torch.Tensor | int]) -> dict[str, torch.Tensor | int | bool]:
    """What the model is called with: packed batches give position_ids instead of the 2-D mask, and
    the documents' boundaries where the collate computed them (transformers' FlashAttentionKwargs,
    which every attention function is handed and only the varlen ones read)."""
    if "position_ids" not in batch:
        # an image-text batch's pixel_values, image_grid_thw, ... (`toolkit.data.image_rows.MediaCollate`)
        media = {k[len(MEDIA):]: v for k, v in batch.items() if k.startswith(MEDIA)}
        return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], **media}
    # no KV cache either: transformers only looks for packing without one; an image-text row's image inputs
    media = {k[len(MEDIA):]: v for k, v in batch.items() if k.startswith(MEDIA)}
    inputs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"], "use_cache": False, **media}
    if "cu_seq_lens" in batch:
        cu, longest = batch["cu_seq_lens"], batch["max_length"]
        inputs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)
    return inputs


def count_examples(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Examples in a (packed or padded) batch: real tokens at position 0."""
    if "position_ids" in batch:
        return ((batch["position_ids"] == 0) & (batch["attention_mask"] == 1)).sum()
    # a fill, not a copy from the host: no sync on a GPU
    ids = batch["input_ids"]
    return torch.full((), ids.shape[0], dtype=torch.long, device=ids.device)


class Collate:
    """The training loader's collate_fn: `collate` (or `collate_packed` for packed rows) padding each
    micro-batch to its longest row, or `collate_padding_free` (`padding_free`: the micro-batch's examples end
    to end in one row, no padding), or, once `bucket` is set (the decoder blocks compile:
    `toolkit.train.compiling`), to few widths (`toolkit.data.bucket_width`), so a compiled graph serves many
    steps: packed rows to the packing width `width`, unpacked batches and padding-free rows to a multiple of
    BUCKET tokens up to `width` (--seq-len; a padding-free row: the micro-batch's examples x --seq-len). A
    padding-free row's length is the sum of its examples', which varies step to step as a padded batch's
    longest row does: rounding it to BUCKET keeps at most BUCKET - 1 padding tokens a row, where the packing
    width would pad it to micro-batch x --seq-len; the blocks compile a new width once, with dynamic shapes
    (`toolkit.parallel.parallelize.apply_compile`), and later widths reuse that graph.
    `seq_len`: packed padding's positions restart below it (a pair's row is two --seq-len wide)."""

    BUCKET = 64

    def __init__(self, pad_id: int, whole: bool, packed: bool, width: int, seq_len: int, padding_free: bool = False):
        self.pad_id, self.whole, self.packed, self.width, self.seq_len = pad_id, whole, packed, width, seq_len
        self.padding_free = padding_free and not packed
        self.bucket = False

    def __call__(self, batch: list[dict]) -> dict:
        multiple = (self.width if self.packed else self.BUCKET) if self.bucket else 1
        cap = self.width if self.bucket else None
        if self.packed:
            return collate_packed(batch, self.pad_id, self.whole, multiple, cap, self.seq_len, compiled=self.bucket)
        if self.padding_free:
            return collate_padding_free(batch, self.pad_id, self.whole, multiple, cap, self.seq_len,
                                        compiled=self.bucket)
        return collate(batch, self.pad_id, self.whole, multiple, cap)
