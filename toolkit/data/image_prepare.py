"""A run's image data prepared (`toolkit.data.prepare.prepare_data` hands an image-text model's over): the records
read and checked (`toolkit.data.images`), each source's eval split held out, a mixture drawn, every example encoded
into its row (`toolkit.data.image_rows.encode`, `encode_pair`; in forked processes from 1,024 examples), and the rows
kept in the token cache and read back memory-mapped by later runs.
"""

from __future__ import annotations

import hashlib
import json
import os
from functools import partial
from pathlib import Path

from toolkit.data.image_rows import ImageRows, encode, encode_pair, texts_of
from toolkit.data.images import image_refs, open_image, refuse_prefix_types
from toolkit.errors import UserError


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
    # as drawn: a cycled source's rows count again
    stats.examples, stats.tokens, stats.target_tokens = len(rows) + stats.dropped, 0, 0
    for r in rows:
        _count(r, stats)
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


def _count(row: dict, stats) -> None:
    """A kept row's tokens and trained tokens into `stats` (`DataStats`): a pair's both sequences, and the fewer of
    its completions' trained tokens, as the text pairs' table counts them."""
    from toolkit.data.tokenize import IGNORE_INDEX

    trained = lambda labels: sum(t != IGNORE_INDEX for t in labels)  # noqa: E731
    if "rejected_input_ids" in row:
        stats.tokens += len(row["input_ids"]) + len(row["rejected_input_ids"])
        stats.target_tokens += min(trained(row["labels"]), trained(row["rejected_labels"]))
    else:
        stats.tokens += len(row["input_ids"])
        stats.target_tokens += trained(row["labels"])


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
        _count(row, stats)
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
    _count(row, stats)
    return row
