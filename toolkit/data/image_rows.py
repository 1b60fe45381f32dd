"""Rows and batches of examples with images (`toolkit.data.images` reads them into conversations).

Tokens and labels (`encode`): the chat is rendered by the processor's template and tokenized with offsets, and the
answers' tokens found as for text (`toolkit.data.tokenize`); the processor then expands each image's placeholder
into the image's tokens. The labels follow the unexpanded ids into the expanded ones through their matching blocks
(difflib): any processor expands its own way (LLaVA repeats one token, Idefics3 writes rows and columns, Gemma 3
wraps them), and an answer's tokens are untouched by it (checked: a label that finds no match is an error). Image
tokens are never labels. A row is cut at --seq-len only after its last image token; a longer one is dropped.

The collate (`MediaCollate`) runs the processor on each micro-batch's rendered texts and images: the model's own
inputs (pixel_values, image_grid_thw, pixel_attention_mask, ...) as it expects them, the ids checked equal to the
prepared ones, and passed to the model under `MEDIA` keys (`toolkit.data.packing.model_inputs`).
"""

from __future__ import annotations

import hashlib
import os

from toolkit.data.images import (MEDIA, OF_IDS, answer_texts, image_refs, image_token_id, of_ids, open_image,
                                 open_images, template_messages, within_bounds)
from toolkit.errors import UserError


def encode(processor, conv: list[dict], seq_len: int, train_on_prompt: bool, where: str,
           last_turn: bool = False) -> dict | None:
    """One conversation with images as a row: {input_ids, labels} expanded as the processor expands them, the
    rendered `text` and the `images` it takes, and `text_labels`, every token's id but the processor's (ORPO's NLL
    labels; see the module's docstring); None where --seq-len would cut an image. `last_turn`: labels on the last
    message alone (a preference pair's completion)."""
    from toolkit.data.tokenize import IGNORE_INDEX, _answer_labels, blank

    tokenizer = processor.tokenizer
    text = processor.apply_chat_template(template_messages(conv), tokenize=False)
    spans, cursor = [], 0
    specials = sorted({t for t in tokenizer.all_special_tokens if t}, key=len, reverse=True)
    # every token trains: no answer to find
    for m in [] if train_on_prompt else conv:
        for piece in answer_texts(m):
            if not piece.strip() or (m["role"] == "assistant" and blank(piece)):
                continue
            # templates that trim a part's text (Gemma 3's) keep it without the spaces around
            start = text.find(piece, cursor)
            if start < 0:
                piece = piece.strip()
                start = text.find(piece, cursor)
            if start < 0:
                raise UserError(f"{where}the processor's chat template dropped or rewrote a message's text, so prompt "
                                "and answer cannot be told apart; use --train-on-prompt or another --chat-template")
            cursor = start + len(piece)
            if m["role"] == "assistant" and (not last_turn or m is conv[-1]):
                end = cursor + next((len(t) for t in specials if text.startswith(t, cursor)), 0)
                spans.append((start, end))
    plain = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids0 = plain["input_ids"]
    labels0 = list(ids0) if train_on_prompt else _answer_labels(ids0, plain["offset_mapping"], spans)
    refs = image_refs(conv)
    images = within_bounds(processor, open_images(refs, where), refs, where)
    parts = prefix_suffix(processor, text, spans[0][0] if spans else 0, where, len(images))
    ids = processor(**texts_of([parts]), images=[images] if images else None,
                    add_special_tokens=False)["input_ids"][0]
    ids = list(ids.tolist() if hasattr(ids, "tolist") else ids)
    labels, inserted = expanded_labels(ids0, labels0, ids, where)
    token = image_token_id(processor)
    inserted |= {k for k, t in enumerate(ids) if t == token}
    # every text token; the image tokens never
    text_labels = [IGNORE_INDEX if k in inserted else t for k, t in enumerate(ids)]
    if train_on_prompt:
        labels = text_labels
    truncated = len(ids) > seq_len
    if truncated and max(inserted, default=-1) >= seq_len:
        return None
    return {"input_ids": ids[:seq_len], "labels": labels[:seq_len], **parts, "images": refs,
            "truncated": truncated, "text_labels": text_labels[:seq_len]}


def prefix_suffix(processor, text: str, start: int, where: str = "", images: int = 1) -> dict:
    """The rendered `text` as the processor takes it: {"text": text}, or, for a processor whose call takes a
    `suffix` (PaliGemma's prefix-LM, whose token_type_ids mark the suffix: the prefix attends both ways, the suffix
    causally), {"text": the prefix, "suffix": the rest} split at `start`, where the first answer begins (0 where
    every token trains). Such a processor puts every image before the prefix: an example without one (`images`: how
    many it has), or with one after its first answer, is one line (`where`: the record)."""
    if not _takes_suffix(processor):
        return {"text": text}
    token = getattr(processor, "image_token", None)
    # transformers 5.4's PaliGemmaProcessor has no image_token: the images' count alone
    if not images or (token and (token not in text[:start] or token in text[start:])):
        raise UserError(f"{where}{type(processor).__name__} takes an example's images before its prompt: give each "
                        "example an image, in the turns before its first answer")
    return {"text": text[:start], "suffix": text[start:]}


def _takes_suffix(processor) -> bool:
    """The processor's call takes a `suffix`: a parameter of it (transformers 5.24), or a text keyword its module
    declares (5.4's `PaliGemmaTextKwargs`, read through `**kwargs`)."""
    import inspect
    import sys

    call = type(processor).__call__
    if "suffix" in inspect.signature(call).parameters:
        return True
    module = sys.modules.get(call.__module__)
    declared = (v for v in vars(module).values() if isinstance(v, type) and v.__name__.endswith("TextKwargs"))
    return any("suffix" in getattr(v, "__annotations__", {}) for v in declared) if module else False


def texts_of(sequences: list[dict]) -> dict:
    """The processor's text arguments for `sequences` (`prefix_suffix`'s parts)."""
    out = {"text": [x["text"] for x in sequences]}
    if "suffix" in sequences[0]:
        out["suffix"] = [x["suffix"] for x in sequences]
    return out


def encode_pair(processor, prompt: list[dict], chosen: str, rejected: str, seq_len: int,
                where: str) -> dict | None:
    """A preference pair with images as one row: prompt + chosen `encode`d (labels on the completion) in
    `input_ids`/`labels`/`text`, prompt + rejected beside it (`rejected_*`), the prompt's `images` shared, and the
    chosen sequence's `orpo_labels` (its text tokens, ORPO's NLL); None where --seq-len would cut an image."""
    sides = [encode(processor, prompt + [{"role": "assistant", "content": c}], seq_len, False, where, last_turn=True)
             for c in (chosen, rejected)]
    if sides[0] is None or sides[1] is None:
        return None
    a, b = sides
    suffixes = {"suffix": a["suffix"], "rejected_suffix": b["suffix"]} if "suffix" in a else {}
    return {"input_ids": a["input_ids"], "labels": a["labels"], "text": a["text"], "images": a["images"],
            "rejected_input_ids": b["input_ids"], "rejected_labels": b["labels"], "rejected_text": b["text"],
            "orpo_labels": a["text_labels"], "truncated": a["truncated"] or b["truncated"], **suffixes}


def pair_sequences(batch: list[dict]) -> list[dict]:
    """A micro-batch of image pairs as 2 x len(batch) sequences, chosen at even rows and rejected at odd ones, each
    with the pair's images (`toolkit.data.pairs.pair_rows`' order)."""
    return [seq for x in batch for seq in (
        {"input_ids": x["input_ids"], "labels": x["labels"], "text": x["text"], "images": x["images"],
         **({"suffix": x["suffix"]} if "suffix" in x else {})},
        {"input_ids": x["rejected_input_ids"], "labels": x["rejected_labels"], "text": x["rejected_text"],
         "images": x["images"], **({"suffix": x["rejected_suffix"]} if "suffix" in x else {})})]


def expanded_labels(ids0: list[int], labels0: list[int], ids: list[int], where: str) -> tuple[list[int], set[int]]:
    """(labels over the processor's expanded `ids`, the positions it inserted or rewrote): each label of `ids0` carried
    to its token's place in `ids` through the two sequences' matching blocks."""
    import difflib

    from toolkit.data.tokenize import IGNORE_INDEX

    labels = [IGNORE_INDEX] * len(ids)
    matched: set[int] = set()
    place = {}
    for a, b, n in difflib.SequenceMatcher(None, ids0, ids, autojunk=False).get_matching_blocks():
        for k in range(n):
            place[a + k] = b + k
            matched.add(b + k)
    for k, label in enumerate(labels0):
        if label == IGNORE_INDEX:
            continue
        if k not in place:
            raise UserError(f"{where}the processor changed an answer's tokens while placing the images, so its labels "
                            "cannot be found; report the model and its processor")
        labels[place[k]] = label
    return labels, set(range(len(ids))) - matched


class ImageRows:
    """Rows of examples with images (`encode`'s or `encode_pair`'s dicts), with the processor that collates them
    (`MediaCollate`): a list of dicts while they are built, a memory-mapped table once read back from the cache
    (`_cached`: a large dataset's rows are not held in memory; `key`, the cache's, names what they were made of). A
    pair's row also gives its `reference` log-probabilities once they are attached
    (`toolkit.objectives.preference.reference`), as `toolkit.data.table.Rows` does."""

    def __init__(self, rows, processor, key: str | None = None):
        self.rows, self.processor, self.key = rows, processor, key
        self.lengths = [a + b for a, b in zip(self._lengths("input_ids"), self._lengths("rejected_input_ids"))]
        self.reference = None

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        row = self.rows[i]
        if self.reference is None:
            return row
        # NaN where the reference pass did not score the row: a batch the loader fetches past the run's last step
        # holds such rows; the loss refuses one (`PreferenceLoss.reference_logps`)
        return {**row, "ref_logps": self.reference[i].tolist()}

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]

    def names(self) -> list[str]:
        """The rows' fields."""
        if isinstance(self.rows, list):
            return list(self.rows[0]) if self.rows else []
        return list(self.rows.column_names)

    def column(self, name: str) -> list:
        """Every row's `name` (their images, ...), without reading the rest of the rows."""
        return [r[name] for r in self.rows] if isinstance(self.rows, list) else list(self.rows[name])

    def _lengths(self, name: str) -> list[int]:
        """Each row's number of `name` tokens (0 where the rows have none): a table's counted by Arrow."""
        if name not in self.names():
            return [0] * len(self)
        if isinstance(self.rows, list):
            return [len(r[name]) for r in self.rows]
        import pyarrow.compute as pc

        return pc.list_value_length(self.rows.data.column(name)).to_pylist()

    def desirable(self) -> list[bool]:
        """KTO's labels of the rows (empty for other rows), as `toolkit.data.table.Rows.desirable`."""
        return self.column("desirable") if "desirable" in self.names() else []

    def digest(self) -> str:
        """sha256 of the rows' tokens, texts and image references (a file's size and modification time too); rows
        read back from the cache: of its key, which holds all of that."""
        h = hashlib.sha256()
        if self.key is not None:
            h.update(self.key.encode())
            return h.hexdigest()
        for r in self.rows:
            # an image file replaced in place is another example (a data URL is its bytes already)
            files = [(os.stat(ref).st_size, os.stat(ref).st_mtime_ns) for ref in r["images"]
                     if not ref.startswith("data:")]
            h.update(repr((r["input_ids"], r["labels"], r["images"], files, r.get("rejected_input_ids"),
                           r.get("rejected_labels"), r.get("kl_input_ids"), r.get("desirable"))).encode())
        return h.hexdigest()


class ImageBins:
    """--packing on an image-text model: `rows`' examples in first-fit-decreasing bins of at most `width` tokens
    (`toolkit.data.packing.pack_bins`, by each example's tokens, its images' included). A bin reads as its examples,
    which `MediaCollate` lays end to end with the micro-batch's other bins' (padding-free), so a micro-batch is its
    examples' padded batch without the padding; `bins` tells `toolkit.data.loader.rows_read` which examples a step
    reads, as `toolkit.data.packing.PackedRows` does."""

    def __init__(self, rows: ImageRows, width: int):
        from toolkit.data.packing import pack_bins

        self.rows, self.processor = rows, rows.processor
        self.bins = pack_bins(rows.lengths, width)
        self.lengths = [sum(rows.lengths[i] for i in b) for b in self.bins]

    def __len__(self) -> int:
        return len(self.bins)

    def __getitem__(self, k: int) -> list[dict]:
        return [self.rows[i] for i in self.bins[k]]


# the processors' outputs that hold a value per token (B, T, ...): cut with the ids
PER_TOKEN = ("token_type_ids", "mm_token_type_ids", "cross_attention_mask")


class MediaCollate:
    """A micro-batch of `ImageRows` right-padded, or (`padding_free`) its examples end to end in one row as
    `toolkit.data.packing.collate_padding_free` lays text (`whole`: with the documents' boundaries), with the
    processor's image inputs (its ids checked equal to the prepared ones) under `MEDIA` keys; a tensor of the
    processor's that is per token (B, T, ...) cut as the ids are (padded rows only). End to end, the image features
    go to their tokens in the row in the order the padded batch places them (`toolkit.model.vision.end_to_end_problem`:
    models that need more are padded)."""

    def __init__(self, processor, pad_id: int, padding_free: bool = False, whole: bool = False,
                 ranks: int | None = None):
        self.processor, self.pad_id, self.padding_free, self.whole = processor, pad_id, padding_free, whole
        # several ranks reading different micro-batches (`ranks`, `Config.data_ranks`; default
        # WORLD_SIZE): a padding-free micro-batch without an image runs one anyway
        self.idle = (int(os.environ.get("WORLD_SIZE", "1")) if ranks is None else ranks) > 1 and padding_free
        self._blank: dict | None = None

    def __call__(self, batch: list[dict] | list[list[dict]]) -> dict:
        import torch

        # packed (`ImageBins`): each bin's examples, in order
        batch = [x for b in batch for x in b] if batch and isinstance(batch[0], list) else batch
        sequences = pair_sequences(batch) if "rejected_input_ids" in batch[0] else batch
        blank = self.idle and sequences is batch and "kl_input_ids" not in batch[0] and \
            not any(x["images"] for x in batch)
        if blank:
            batch = sequences = [*batch, self.blank()]
        out = self._rows(batch)
        if blank:
            # the blank example is no example: out of the examples and tokens counted (the model gets no mask)
            start = sum(len(x["input_ids"]) for x in batch[:-1])
            out["attention_mask"][0, start:start + len(batch[-1]["input_ids"])] = 0
        images = [[open_image(r) for r in x["images"]] for x in sequences]
        if not any(images):
            return out
        enc = self.processor(**texts_of(sequences), images=images, add_special_tokens=False,
                             padding=True, padding_side="right", return_tensors="pt")
        width = out["input_ids"].shape[1]
        for i, x in enumerate(sequences):
            n = len(x["input_ids"])
            if enc["input_ids"][i, :n].tolist() != x["input_ids"]:
                raise RuntimeError(f"the processor tokenized example {i} of a batch unlike when it was prepared")
        for k, v in enc.items():
            # labels: a processor's own (PaliGemma's, with a suffix): the rows carry theirs
            if k in ("input_ids", "attention_mask", "labels") or not torch.is_tensor(v):
                continue
            if k in PER_TOKEN and self.padding_free:
                # modality types: multi-axis positions read the ids (`toolkit.model.vision.packed_mrope`); a mask
                # between tokens would need the kernel to follow it (such models are padded: `end_to_end_problem`)
                if k == "mm_token_type_ids":
                    continue
                raise RuntimeError(f"the processor gives {k} per token, which padding-free rows do not lay out")
            out[MEDIA + k] = v[:, :width] if k in PER_TOKEN else v
        if "kl_input_ids" in out:
            # KTO's KL rows (each its example's prompt, so its images, with another's completion) are as wide as
            # their own longest: their per-token inputs made of their ids as the processor makes them (Gemma 3's
            # token_type_ids are each token's modality: `toolkit.data.images.refuse_prefix_types`)
            made = of_ids(self.processor, enc, [k for k in OF_IDS if MEDIA + k in out])
            out.update({"kl_" + MEDIA + k: f(out["kl_input_ids"]) for k, f in made.items()})
        return out

    def blank(self) -> dict:
        """An example of one blank 28 px image and nothing to learn, added to a padding-free micro-batch without an
        image on several ranks, so the vision tower runs there as on the other ranks (ZeRO-3 and FSDP gather its
        weights in step with them; DDP finds the projector used): its own document, so no example attends to it,
        and no labels, so its gradient is zero."""
        if self._blank is None:
            from PIL import Image

            from toolkit.data.images import image_value

            ref = image_value(Image.new("RGB", (28, 28)), "")
            # a user turn alone: no answer, so no labels
            row = encode(self.processor, [{"role": "user", "content": [{"type": "image", "image": ref}]}],
                         2**31, False, "the blank image: ")
            self._blank = {k: row[k] for k in ("input_ids", "labels", "text", "images")}
        return self._blank

    def _rows(self, batch: list[dict]) -> dict:
        """The tokens: padded rows, or one row end to end; a preference pair's two sequences each (chosen, then
        rejected), with the pairs' count and reference and ORPO's NLL labels (`orpo_labels`: a padded batch's per
        pair, an end-to-end row's laid out as its documents, each one's first unset)."""
        import torch

        from toolkit.data import collate_sequences
        from toolkit.data.packing import collate_padding_free
        from toolkit.data.tokenize import IGNORE_INDEX

        if self.padding_free:
            out = collate_padding_free(batch, self.pad_id, self.whole)
        elif "kl_input_ids" in batch[0]:
            from toolkit.data import collate

            # KTO's examples and, as their own rows, their KL sequences (the batch's images again, in order)
            return collate(batch, self.pad_id)
        else:
            pairs = "rejected_input_ids" in batch[0]
            out = collate_sequences(pair_sequences(batch) if pairs else batch, self.pad_id)
        if "rejected_input_ids" not in batch[0]:
            return out
        if self.padding_free:
            nll = [[t for x in batch for t in [IGNORE_INDEX, *x["orpo_labels"][1:]]
                    + [IGNORE_INDEX] * len(x["rejected_input_ids"])]]
        else:
            from toolkit.data.pairs import pair_extras

            out.update(pair_extras(batch))
            nll = [x["orpo_labels"] for x in batch]
        out["orpo_labels"] = torch.full((len(nll), out["input_ids"].shape[1]), IGNORE_INDEX, dtype=torch.long)
        for i, labels in enumerate(nll):
            out["orpo_labels"][i, :len(labels)] = torch.tensor(labels)
        return out
