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
import json
import os
from functools import partial
from pathlib import Path

from toolkit.data.images import (MEDIA, OF_IDS, answer_texts, image_refs, image_token_id, of_ids, open_image,
                                 open_images, refuse_prefix_types, template_messages, within_bounds)
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


def prepare_images(settings, processor, cache: Path | None = None) -> tuple:
    """(format, training `ImageRows`, held-out `ImageRows`, their `DataStats` each, conversations given
    --system-prompt, a built-in's exact-match conversations and answers, a mixture's sources) of a run on an
    image-text model (`toolkit.data.prepare.prepare_data` hands it over): the records read and checked as SFT reads
    them (`toolkit.data.as_example`: the images placed and found; pairs as `_read_pairs` reads them), --eval-split
    held out (a built-in: its own held-out examples), each example `encode`d (`encode_pair`, `_encoded_kto`); a
    mixture's sources drawn as text's (`_encoded_sources`). Encoding opens every image (the processor counts its
    tokens): in `cache`, the rows are kept under a key of what was read, the images' sizes and times, the processor
    and the settings (`_images_key`), and a later run reads them back (a built-in is encoded every run)."""
    from toolkit.config.datasets import is_mixture, parse_sources
    from toolkit.config.objectives import form
    from toolkit.data import check_trainable, data_sources, eval_source
    from toolkit.data.table import DataStats

    d = settings.data
    if d.streaming:
        raise UserError("--streaming: not yet for image-text models, which read their data files whole; leave it out")
    kind = form(settings.objective)
    pairs, kto = kind in ("pairs", "labelled"), kind == "labelled"
    read = _read_pairs if pairs else _read
    # KTO's unpaired records are its examples; pairs are split into two
    encoder = (lambda fmt: partial(_encoded_kto, unpaired=fmt == "unpaired")) if kto else \
        (lambda fmt: _encoded_pairs) if pairs else (lambda fmt: _encoded)
    scored, answers, sources = None, None, None
    if d.dataset.startswith("builtin:") and not is_mixture(d.dataset) and not pairs:
        fmt, train, held, stats, held_stats, added, scored, answers = _builtin_examples(settings, processor)
        if d.eval_dataset and d.eval_split == 0:
            held_fmt, records, _, held_source = read(settings, eval_source(d))
            held, held_stats = encoder(held_fmt)(processor, settings, held_source, list(enumerate(records)))
    else:
        # every file read and its records checked (no image opened: cheap), then encoded or read back from the cache
        reads = [(spec.spec, read(settings, source)) for spec, source in zip(parse_sources(d.dataset),
                                                                              data_sources(d))]
        held_read = read(settings, eval_source(d)) if d.eval_dataset else None
        build = partial(_encoded_sources, settings, processor, reads, held_read, encoder)
        fmt, train, held, stats, held_stats, added, sources = build() if cache is None else \
            _cached(cache / f"images-{_images_key(settings, processor, reads, held_read)}", build, processor)
    check_trainable(stats, settings, "training")
    if pairs:
        every_image(train.column("images") + held.column("images"), d.dataset,
                    "examples" if kto else "pairs", settings.ranks)
    else:
        # padding-free training micro-batches without an image run a blank one (`MediaCollate.blank`); padded ones,
        # and the held-out examples' (evaluated padded), cannot
        if d.padding_free is False:
            every_image(train.column("images"), d.dataset, "examples", settings.ranks, "padded ")
        every_image(held.column("images"), d.eval_dataset or d.dataset, "held-out examples",
                    settings.ranks, "padded ", "give each an image")
    return fmt, train, held, stats, held_stats or DataStats(), added, scored, answers, sources


def _builtin_examples(settings, processor) -> tuple:
    """`prepare_images`' first eight for a built-in image task: all its training examples, and its own held-out
    examples (the eval split, where --eval-split asks for one, and the exact-match questions), as for text."""
    from toolkit.data import as_example, data_sources
    from toolkit.data.builtin import builtin_records
    from toolkit.data.table import DataStats

    d = settings.data
    fmt, convs, added, source = _read(settings, data_sources(d)[0])
    records = builtin_records(d.dataset.split(":", 1)[1], split="eval")
    scored = [as_example(r, fmt, i, d, source)[0] for i, r in enumerate(records)]
    train, stats = _encoded(processor, settings, source, list(enumerate(convs)))
    held, held_stats = _encoded(processor, settings, source, list(enumerate(scored))) if d.eval_split > 0 else \
        (ImageRows([], processor), DataStats())
    return fmt, train, held, stats, held_stats, added, scored, [r["answer"] for r in records]


def _encoded_sources(settings, processor, reads: list, held_read: tuple | None, encoder) -> tuple:
    """(format, training `ImageRows`, held-out `ImageRows`, their `DataStats`, conversations given --system-prompt, a
    mixture's (spec, format, weight share, training examples) per source, else None): each source's records
    (`reads`: (spec, `_read`'s or `_read_pairs`' of it)) with its --eval-split held out (drawn per source, as
    text's), encoded (`encoder(format)`); --eval-dataset's (`held_read`) held out whole. A mixture's training rows
    are drawn from its sources by weight with the seed as text's are (`toolkit.data.mixture.mixture_order`: smaller
    sources cycled, none cut short), over the examples each keeps (text's draw over its records, then drop); its
    examples and tokens counted as drawn, its dropped and truncated records once (text's, as drawn)."""
    import dataclasses

    from toolkit.config.datasets import is_mixture, parse_sources
    from toolkit.data import split_indices
    from toolkit.data.mixture import mixture_order
    from toolkit.data.table import DataStats

    mixed, specs = is_mixture(settings.data.dataset), parse_sources(settings.data.dataset)
    formats, trains, helds, records_of, added = [], [], [], [], 0
    stats, held_stats = DataStats(), DataStats()
    total = lambda a, b: DataStats(**{f.name: getattr(a, f.name) + getattr(b, f.name)  # noqa: E731
                                      for f in dataclasses.fields(DataStats) if f.name != "cached"})
    for spec, (fmt, records, n, source) in reads:
        train_idx, held_idx = split_indices(len(records), settings, spec if mixed else "")
        encode = encoder(fmt)
        train, got = encode(processor, settings, source, [(i, records[i]) for i in train_idx])
        held, held_got = encode(processor, settings, source, [(i, records[i]) for i in held_idx])
        if mixed and not len(train):
            raise UserError(f"--dataset {settings.data.dataset}: source {spec} has nothing left to train (of "
                            f"{got.examples} examples, {got.dropped} dropped); fix it or leave it out of the mixture")
        formats.append(fmt), trains.append(train), helds.append(held), records_of.append(got.examples)
        added += n
        stats, held_stats = total(stats, got), total(held_stats, held_got)
    held = ImageRows([r for h in helds for r in h.rows], processor)
    if held_read is not None:
        held_fmt, records, _, held_source = held_read
        held, held_stats = encoder(held_fmt)(processor, settings, held_source, list(enumerate(records)))
    if not mixed:
        return formats[0], trains[0], held, stats, held_stats, added, None
    # unweighted: each source's share its training records', as text's
    weights = [s.weight if s.weight is not None else n for s, n in zip(specs, records_of)]
    rows = [trains[k].rows[i] for k, i in mixture_order([len(t) for t in trains], weights, settings.seed)]
    counts = [_counts(r) for r in rows]
    stats.examples, stats.tokens = len(rows) + stats.dropped, sum(c[0] for c in counts)
    stats.target_tokens = sum(c[1] for c in counts)
    sources = [(s.spec, f, w / sum(weights), n) for s, f, w, n in zip(specs, formats, weights, records_of)]
    return "+".join(dict.fromkeys(formats)), ImageRows(rows, processor), held, stats, held_stats, added, sources


# what of the data settings decides the encoded rows, beside the records read and the processor
IMAGE_SETTINGS = ("dataset", "eval_dataset", "format", "columns", "system_prompt", "seq_len", "train_on_prompt",
                  "eval_split")


def _images_key(settings, processor, reads: list, held_read: tuple | None) -> str:
    """The cache folder of a run's encoded image rows: sha256 of the records as read (their image references
    resolved), each referenced file's size and modification time (an image replaced in place is another example;
    a data URL is in the record), the processor (its tokenizer, image processor settings, pixel bounds and chat
    template) and transformers' version, `IMAGE_SETTINGS`, the objective's form (SFT's, pairs', KTO's rows) and the
    seed where it draws (the eval split, a mixture)."""
    from toolkit.data.table import CACHE_VERSION, tokenizer_digest

    import transformers

    from toolkit.config.datasets import is_mixture
    from toolkit.config.objectives import form

    d = settings.data
    # the processor's own settings, and transformers' version (its code expands the images into their tokens)
    image_processor = getattr(processor, "image_processor", None)
    seeded = d.eval_split > 0 or is_mixture(d.dataset)
    h = hashlib.sha256()
    for part in (CACHE_VERSION, "images", transformers.__version__, type(processor).__name__,
                 tokenizer_digest(processor.tokenizer), processor.to_json_string(),
                 image_processor.to_json_string() if image_processor is not None else "",
                 str(getattr(processor, "chat_template", None)), form(settings.objective),
                 f"seed={settings.seed if seeded else None}", *(f"{k}={getattr(d, k)!r}" for k in IMAGE_SETTINGS)):
        h.update(part.encode() + b"\x00")
    for spec, (fmt, records, n, _) in [*reads, *([("eval", held_read)] if held_read else [])]:
        h.update(json.dumps([spec, fmt, n, records], default=str).encode())
        # a record: a conversation, a plain text, or a pair's or KTO example's (prompt, ...)
        for record in records:
            for ref in image_refs(record if isinstance(record, list) else record[0] if isinstance(record, tuple)
                                  else []):
                if not ref.startswith("data:"):
                    h.update(repr((ref, os.stat(ref).st_size, os.stat(ref).st_mtime_ns)).encode())
    return h.hexdigest()


def _cached(path: Path, build, processor) -> tuple:
    """`build()`'s (format, training rows, held-out rows, their stats, conversations given --system-prompt, sources),
    written to `path` by one process (`toolkit.data.table.built_once`: the others wait) and read back, the training
    stats marked `cached` where a run before wrote them."""
    import dataclasses

    import datasets

    from toolkit.data.table import DataStats, built_once

    def write(tmp: Path) -> None:
        fmt, train, held, stats, held_stats, added, sources = build()
        tmp.mkdir(parents=True)
        for name, rows in (("train", train), ("eval", held)):
            if len(rows):
                datasets.Dataset.from_list(rows.rows).save_to_disk(str(tmp / name))
        (tmp / "meta.json").write_text(json.dumps({
            "format": fmt, "stats": dataclasses.asdict(stats), "eval_stats": dataclasses.asdict(held_stats),
            "added": added, "sources": sources}))

    datasets.disable_progress_bars()
    hit = built_once(path, write)
    meta = json.loads((path / "meta.json").read_text())
    # memory-mapped, as text's tables; their digest the key's
    rows = {name: ImageRows(datasets.load_from_disk(str(path / name)), processor, f"{path.name}/{name}")
                  if (path / name).is_dir() else ImageRows([], processor) for name in ("train", "eval")}
    stats = DataStats(**{**meta["stats"], "cached": hit})
    sources = [tuple(s) for s in meta["sources"]] if meta["sources"] else None
    return (meta["format"], rows["train"], rows["eval"], stats, DataStats(**meta["eval_stats"]), meta["added"],
            sources)


def _counts(row: dict) -> tuple[int, int]:
    """(tokens, trained tokens) of a row as its `DataStats` count it: a pair's both sequences and the fewer of its
    completions' (`_encoded_pairs`)."""
    from toolkit.data.tokenize import IGNORE_INDEX

    trained = lambda labels: sum(t != IGNORE_INDEX for t in labels)  # noqa: E731
    if "rejected_input_ids" in row:
        return (len(row["input_ids"]) + len(row["rejected_input_ids"]),
                min(trained(row["labels"]), trained(row["rejected_labels"])))
    return len(row["input_ids"]), trained(row["labels"])


def every_image(images: list[list[str]], dataset: str, unit: str, ranks: int, padded: str = "",
                instead: str = "") -> None:
    """One line where examples without an image (`images`: each one's references) would train on several ranks
    in micro-batches that cannot run a blank image in their place (`padded`: "padded " where that is why; `ranks`:
    those reading different micro-batches, `Config.data_ranks`)."""
    plain = sum(not refs for refs in images)
    if plain and ranks > 1:
        instead = instead or ("let SFT batches go padding-free" if padded else "give each one an image")
        raise UserError(f"--dataset {dataset}: {plain} of {len(images)} {unit} have no image; on "
                        f"{ranks} ranks a {padded}micro-batch without one skips the vision tower the other ranks run "
                        f"(ZeRO-3 and FSDP wait on it, DDP finds its projector unused): {instead}, or train on one "
                        "process")


def _read_pairs(settings, source):
    """(format, each record as (prompt messages with its images, chosen, rejected) (KTO's unpaired form: (prompt,
    completion, desirable)), how many got --system-prompt, `source`) of one file."""
    from toolkit.data import source_format
    from toolkit.data.formats import load_records, map_columns, record_place, with_system_prompt
    from toolkit.data.images import with_images
    from toolkit.data.pairs import to_pair, to_unpaired

    records = map_columns(load_records(source.path, source.flag), source)
    fmt = source_format(records.column_names, settings, source, records[0])
    pairs, added = [], 0
    for i, row in enumerate(records):
        where = f"{source.flag} {record_place(source.path, i)}: "
        try:
            prompt, *sides = to_unpaired(row, source.turns) if fmt == "unpaired" else to_pair(row, fmt, source.turns)
        except UserError as e:
            raise UserError(f"{where}{e}") from None
        prompt = with_images(prompt, row, source.path, where)
        given = with_system_prompt(prompt, settings.data.system_prompt)
        added += given is not prompt
        pairs.append((given, *sides))
    return fmt, pairs, added, source


def _encoded_kto(processor, settings, source, indexed: list[tuple[int, tuple]], unpaired: bool):
    """(`ImageRows` of KTO's examples, their `DataStats`), as `toolkit.data.pairs.encode_kto` makes text's: pairs
    split into a desirable and an undesirable example (every chosen, then every rejected: TRL's unpairing), each
    prompt + completion `encode`d with labels on the completion, and beside it its KL sequence (its own prompt's
    tokens, images included, with the previous example's completion: `toolkit.data.pairs.kl_sequences`), whose
    images are its own example's; an example with a `blank` completion is kept out of the rows and counted."""
    from toolkit.data.pairs import kl_sequences
    from toolkit.data.table import DataStats
    from toolkit.data.tokenize import blank

    # (record index, prompt, completion, desirable); pairs split, every chosen example first
    examples = [(i, *e) for i, e in indexed] if unpaired else \
        [(i, e[0], e[1], True) for i, e in indexed] + [(i, e[0], e[2], False) for i, e in indexed]
    rows, stats = [], DataStats()
    convs = [(i, prompt + [{"role": "assistant", "content": completion}]) for i, prompt, completion, _ in examples]
    encoded = _encoded_each(partial(_example, processor, settings.data.seq_len, False, True), convs, source,
                            settings)
    for (i, prompt, completion, good), row in zip(examples, encoded):
        stats.examples += 1
        row = _kept(row, blank(completion), stats)
        if row is not None:
            rows.append({**row, "desirable": good})
    first = next((r for r in rows if r["images"]), None)
    if first is not None:
        refuse_prefix_types(processor, processor(**texts_of([first]), images=[[open_image(x) for x in first["images"]]],
                                                 add_special_tokens=False), "kto")
    kl_ids, kl_labels = kl_sequences([r["input_ids"] for r in rows], [r["labels"] for r in rows], settings.data.seq_len)
    for row, ids, labels in zip(rows, kl_ids, kl_labels):
        row.update(kl_input_ids=ids, kl_labels=labels)
    return ImageRows(rows, processor), stats


def _read(settings, source):
    """(format, the records as conversations, how many got --system-prompt, `source`) of one file."""
    from toolkit.data import as_example, source_format
    from toolkit.data.formats import load_records, map_columns

    records = map_columns(load_records(source.path, source.flag), source)
    fmt = source_format(records.column_names, settings, source, records[0])
    pairs = [as_example(r, fmt, i, settings.data, source) for i, r in enumerate(records)]
    return fmt, [c for c, _ in pairs], sum(a for _, a in pairs), source


def _example(processor, seq_len: int, train_on_prompt: bool, last_turn: bool, conv: list[dict]) -> dict | None:
    """`encode` of one conversation, as `_encoded_each` maps it."""
    return encode(processor, conv, seq_len, train_on_prompt, "", last_turn)


def _pair(processor, seq_len: int, pair: tuple) -> dict | None:
    """`encode_pair` of one (prompt, chosen, rejected), as `_encoded_each` maps it."""
    return encode_pair(processor, *pair, seq_len, "")


# the function the forked encoders run (`_encoded_each`): inherited, not pickled (a processor need not pickle)
_EACH = None


def _each(x):
    """`_EACH(x)`, or the UserError it raised (returned, so the first bad record in order is the one named)."""
    try:
        return _EACH(x)
    except UserError as e:
        return e


def _one_thread() -> None:
    """A forked encoder's torch on one thread, as DataLoader workers are: a thread pool the parent used does not
    survive fork (its first parallel op in the child would never return: a processor that resizes with torch), and
    N workers of N threads would oversubscribe the cores."""
    import torch

    torch.set_num_threads(1)


def _encoded_each(fn, indexed: list[tuple[int, object]], source, settings) -> list:
    """[fn(x) for each (record index, x) of `indexed`], in order: in --data-workers forked processes (0: the node's
    cores) where there are enough to gain (`toolkit.data.table.map_processes`; each example opens its images and
    runs the processor, some 10 ms), else here. A record the processor refuses is one line naming it, the first in
    the file's order whichever process met it; a worker killed (out of memory) fails the run, never hangs it."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    from toolkit.data.formats import record_place
    from toolkit.data.table import map_processes

    global _EACH
    items = [x for _, x in indexed]
    workers = map_processes(len(items), settings.data.data_workers)

    def named(i: int, e: UserError) -> UserError:
        return UserError(f"{source.flag} {record_place(source.path, i)}: {e}")

    if workers is None:
        out = []
        for i, x in indexed:
            try:
                out.append(fn(x))
            except UserError as e:
                raise named(i, e) from None
        return out
    _EACH = fn
    try:
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"),
                                 initializer=_one_thread) as pool:
            out = list(pool.map(_each, items, chunksize=max(1, len(items) // (8 * workers))))
    except BrokenProcessPool:
        raise UserError(f"{source.flag} {source.path}: a process encoding its images was killed (out of memory?); "
                        f"pass fewer --data-workers (it ran {workers})") from None
    finally:
        _EACH = None
    for (i, _), r in zip(indexed, out):
        if isinstance(r, UserError):
            raise named(i, r) from None
    return out


def _encoded_pairs(processor, settings, source, indexed: list[tuple[int, tuple[list[dict], str, str]]]):
    """(`ImageRows` of the pairs that keep a completion token on both sides, their `DataStats`: `tokens` both
    sequences', `target_tokens` the fewer of their completions', as the text pairs' table counts them)."""
    from toolkit.data.table import DataStats
    from toolkit.data.tokenize import IGNORE_INDEX, blank

    rows, stats = [], DataStats()
    encoded = _encoded_each(partial(_pair, processor, settings.data.seq_len), indexed, source, settings)
    for (i, (prompt, chosen, rejected)), row in zip(indexed, encoded):
        stats.examples += 1
        empty = blank(chosen) or blank(rejected)
        sides = () if row is None else (row["labels"], row["rejected_labels"])
        targets = [sum(t != IGNORE_INDEX for t in labels) for labels in sides] or [0]
        if row is None or empty or not min(targets):
            stats.dropped += 1
            stats.empty += int(empty)
            stats.truncated += int(row is None or row["truncated"])
            continue
        stats.truncated += int(row.pop("truncated"))
        stats.tokens += len(row["input_ids"]) + len(row["rejected_input_ids"])
        stats.target_tokens += min(targets)
        rows.append(row)
    return ImageRows(rows, processor), stats


def _encoded(processor, settings, source, indexed: list[tuple[int, list[dict] | str]]):
    """(`ImageRows` of the examples that keep an answer token, their `DataStats`)."""
    from toolkit.data.table import DataStats
    from toolkit.data.tokenize import empty_answers

    d, rows, stats = settings.data, [], DataStats()
    # a plain text: all of it trained, as an answer
    convs = [(i, [{"role": "user", "content": ""}, {"role": "assistant", "content": c}] if isinstance(c, str) else c)
             for i, c in indexed]
    encoded = _encoded_each(partial(_example, processor, d.seq_len, d.train_on_prompt, False), convs, source,
                            settings)
    for (i, conv), row in zip(convs, encoded):
        stats.examples += 1
        row = _kept(row, empty_answers(conv)[0], stats)
        if row is not None:
            rows.append(row)
    return ImageRows(rows, processor), stats


def _kept(row: dict | None, empty: bool, stats) -> dict | None:
    """`row` counted into `stats` (`DataStats`): kept (its tokens and answer tokens), or dropped (None) where --seq-len
    cut it to nothing or its answer is `empty`."""
    from toolkit.data.tokenize import IGNORE_INDEX

    if row is None or empty or all(t == IGNORE_INDEX for t in row["labels"]):
        stats.dropped += 1
        stats.empty += int(empty)
        stats.truncated += int(row is None or row["truncated"])
        return None
    row.pop("text_labels")
    stats.truncated += int(row.pop("truncated"))
    stats.tokens += len(row["input_ids"])
    stats.target_tokens += sum(t != IGNORE_INDEX for t in row["labels"])
    return row
