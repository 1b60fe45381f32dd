"""Read a dataset (file, hub id or built-in) and turn each record into chat messages or plain text.

Every format ends up as one of two shapes, so tokenization has one path per shape:
- a conversation: `[{"role": "system"|"user"|"assistant", "content": str}, ...]`
- a plain text: `str`, trained on every token.
"""

from __future__ import annotations

import json
import logging
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Iterator

from toolkit.errors import UserError
from toolkit.data.images import content_parts
from toolkit.config.columns import SAME_JOB, TURN_FIELDS, Turns, parse_columns, record_columns, turn_mapping
from toolkit.config.paths import DATA_SUFFIXES

# format -> the columns that identify it, in detection order.
FORMAT_COLUMNS: dict[str, tuple[str, ...]] = {
    "chat": ("messages",),
    "sharegpt": ("conversations",),
    "alpaca": ("instruction", "output"),
    "text": ("text",),
}
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "bing": "assistant", "bard": "assistant", "model": "assistant",
                  "system": "system"}
# a turn's speaker and text keys
TURN_KEYS = {"chat": ("role", "content"), "sharegpt": ("from", "value")}
# what each format reads beyond its FORMAT_COLUMNS (toolkit.data.pairs adds the preference formats')
# `images`/`image`: examples with images (`toolkit.data.images`)
OPTIONAL_COLUMNS = {"alpaca": ("input", "system", "images", "image"), "chat": ("images", "image"),
                    "sharegpt": ("images", "image")}
# formats whose records hold no list of turns for role=, content=, ..._role= to map
NO_TURNS = ("alpaca", "text")


@dataclass(frozen=True)
class DataSource:
    """One file, folder or hub id a run reads, with the column mapping in force for it: its own (given in
    `--dataset a.json:instruction=prompt`) or else `--columns`."""

    path: str
    # OURS=YOURS,...
    columns: str = ""
    # or --eval-dataset
    flag: str = "--dataset"
    # `columns` came with the source, not from --columns
    own: bool = False

    def named(self, entry: str) -> str:
        """How the user wrote mapping `entry`, for a message."""
        return f"{self.flag} {self.path}:{entry}" if self.own else f"--columns {entry}"

    @cached_property
    def turns(self) -> Turns:
        return turn_mapping(self.columns)


def load_records(spec: str, flag: str = "--dataset"):
    """A `datasets.Dataset` from a local file, a `builtin:NAME`, or a hub id."""
    import datasets

    if spec.startswith("builtin:"):
        from toolkit.data.builtin import builtin_dataset

        return builtin_dataset(spec.split(":", 1)[1], split="train")
    local = data_files(spec, flag)
    if local:
        kind, files = local
        # a bar per small file is noise in front of our own report
        datasets.disable_progress_bars()
        try:
            with datasets_log_silenced():
                ds = datasets.load_dataset(kind, data_files=[str(f) for f in files], split="train")
        except Exception as e:  # noqa: BLE001 - datasets wraps parser errors in many types
            # our own reading names the line (not done up front: GBs as Python)
            not_utf8 = utf8_problem(files)
            if not_utf8:
                raise UserError(f"{flag} {not_utf8}") from None
            if kind == "json":
                for f in files:
                    _check_json_file(f, flag)
            # datasets < 5.0 has no Json feature: a field that is a list in one place and a string in another (an
            # image part list beside plain text content) fails its Arrow schema
            mixed = kind == "json" and int(datasets.__version__.split(".")[0]) < 5
            raise UserError(f"{flag} {spec}: could not be read as {kind} ({_short(e)})"
                            + (f"; if a field holds a list in some records and a string in others (content parts "
                               f"beside plain content), datasets {datasets.__version__} cannot read it: pip install "
                               "'datasets>=5' (or write every content the same way)" if mixed else "")) from None
        if len(ds) == 0 and kind == "json":
            for f in files:
                _check_json_file(f, flag)
    else:
        try:
            ds = datasets.load_dataset(spec, split="train")
        except Exception as e:  # noqa: BLE001
            raise UserError(f"{flag} {spec}: not a local file and could not be loaded from the hub "
                            f"({_short(e)}); pass a local .json/.jsonl/.csv/.parquet file") from None
    if len(ds) == 0:
        raise UserError(f"{flag} {spec}: holds no records")
    return ds


@contextmanager
def datasets_log_silenced() -> Iterator[None]:
    """datasets logs a parse error (with its traceback) before raising it: the error is ours to word."""
    library_log = logging.getLogger("datasets")
    level, library_log.level = library_log.level, logging.CRITICAL
    try:
        yield
    finally:
        library_log.setLevel(level)


def data_files(spec: str, flag: str = "--dataset") -> tuple[str, list[Path]] | None:
    """(datasets' loader name, the files) of a local file or folder; None for a hub id."""
    path = Path(spec)
    if not path.exists():
        return None
    files = sorted(p for p in path.iterdir() if p.suffix.lower() in DATA_SUFFIXES) if path.is_dir() else [path]
    if not files:
        raise UserError(f"{flag} {spec}: folder holds no .json/.jsonl/.csv/.parquet file")
    kinds = {DATA_SUFFIXES[p.suffix.lower()] for p in files}
    if len(kinds) > 1:
        raise UserError(f"{flag} {spec}: mixes file types {sorted(kinds)}; keep one type per folder")
    return kinds.pop(), files


def map_columns(ds, source: DataSource):
    """Rename the dataset's own column names to the fields the formats read (`--columns`)."""
    renames = column_renames(list(ds.column_names), source)
    return ds.rename_columns(renames) if renames else ds


def column_renames(cols: list[str], source: DataSource) -> dict[str, str]:
    """{yours: ours} for the record columns of the source's mapping, checking each named column exists and
    that no field would be taken twice (the turn keys and role values are read in the turns: `read_turns`)."""
    import difflib

    mapping = record_columns(source.columns)
    for ours, yours in mapping.items():
        if yours not in cols:
            hint = difflib.get_close_matches(yours, cols, n=1)
            raise UserError(f"{source.named(f'{ours}={yours}')}: {source.flag} {source.path} has no column '{yours}'"
                            + (f" (did you mean '{hint[0]}'?)" if hint else "")
                            + f"; its columns are {', '.join(cols)}")
        if ours in cols and ours not in mapping.values():
            raise UserError(f"{source.named(f'{ours}={yours}')}: {source.flag} {source.path} already has a column "
                            f"'{ours}'; map that one elsewhere too, or drop {ours}={yours}")
    return {yours: ours for ours, yours in mapping.items() if yours != ours}


def unread_mapping(fmt: str, reads: tuple[str, ...], source: DataSource) -> None:
    """One line where the mapping names a field the source's format does not read, which would be
    ignored: the format's own fields named, so the fix is in sight."""
    for ours, yours in parse_columns(source.columns).items():
        turn = ours in TURN_FIELDS
        if (turn and fmt in NO_TURNS) or (not turn and ours not in reads):
            fields = ", ".join(reads) + ("" if fmt in NO_TURNS else f"; in its turns {', '.join(TURN_FIELDS)}")
            raise UserError(f"{source.named(f'{ours}={yours}')}: {source.flag} {source.path} was read as {fmt}, "
                            f"which does not read '{ours}'" + (" (its records hold no turns)" if turn else "")
                            + f"; {fmt} reads {fields}")


def _short(e: Exception) -> str:
    return " ".join(str(e).split())[:300] or type(e).__name__


def record_place(spec: str, index: int) -> str:
    """Where record `index` (0-based, as the readers count) of `--dataset spec` is, for an error: its
    file, its number counted from 1 as line numbers are (so the first record of a file without blank
    lines is "record 1 (line 1)"), and in JSON Lines its line (blank lines skipped as the readers skip
    them). Scans the files: for error paths only."""
    local = data_files(spec) if not spec.startswith("builtin:") else None
    if not local:
        return f"{spec}: record {index + 1}"
    kind, files = local
    if kind != "json" or not all(_is_json_lines(f) for f in files):
        return f"{files[0] if len(files) == 1 else spec}: record {index + 1}"
    left = index
    for f in files:
        with open(f, "rb") as fh:
            for lineno, line in enumerate(fh, 1):
                if line.strip():
                    if left == 0:
                        return f"{f}: record {index + 1} (line {lineno})"
                    left -= 1
    return f"{spec}: record {index + 1}"


def _is_json_lines(path: Path) -> bool:
    with open(path, "rb") as f:
        return not f.read(4096).lstrip().startswith(b"[")


def utf8_problem(files: list[Path]) -> str | None:
    """The first place in `files` that is not UTF-8, as `FILE: line N ...` (None: all of it is)."""
    import codecs

    for path in files:
        decoder, lineno = codecs.getincrementaldecoder("utf-8")(), 1
        with open(path, "rb") as f:
            while chunk := f.read(16 << 20):
                try:
                    decoder.decode(chunk)
                except UnicodeDecodeError as e:
                    line = lineno + chunk[:max(e.start, 0)].count(b"\n")
                    return (f"{path}: line {line} is not UTF-8 text (byte 0x{e.object[e.start]:02x}); save the file "
                            "as UTF-8")
                lineno += chunk.count(b"\n")
    return None


def json_lines_problem(path: Path) -> str | None:
    """The first line of a JSON Lines file that is not one JSON object (read line by line: the
    file may be larger than RAM)."""
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                return (f"{path}: invalid JSON on line {lineno} ({e.msg}); each line of a .jsonl file must be one "
                        "JSON object")
            if not isinstance(row, dict):
                return f"{path}: line {lineno} is a {type(row).__name__}, expected an object"
    return None


def read_problem(spec: str, e: Exception, flag: str = "--dataset") -> UserError:
    """One line for a failure while reading `--dataset spec`: the file and line where it is found
    (bytes that are not UTF-8, a JSON line that does not parse), else the reader's own words."""
    local = data_files(spec, flag) if not spec.startswith("builtin:") else None
    if local:
        kind, files = local
        problem = utf8_problem(files)
        if problem is None and kind == "json":
            problem = next((p for f in files if _is_json_lines(f) and (p := json_lines_problem(f))), None)
        if problem:
            return UserError(f"{flag} {problem}")
    return UserError(f"{flag} {spec}: could not be read ({_short(e)})")


def _check_json_file(path: Path, flag: str = "--dataset") -> None:
    """Parse JSON / JSON Lines ourselves first so a bad file is reported with its line number."""
    text = path.read_text(encoding="utf-8", errors="replace")
    if not text.strip():
        raise UserError(f"{flag} {path}: file is empty")
    stripped = text.lstrip()
    if stripped.startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise UserError(f"{flag} {path}: invalid JSON at line {e.lineno} column {e.colno} ({e.msg})") from None
        bad = next((i for i, r in enumerate(rows) if not isinstance(r, dict)), None)
        if bad is not None:
            raise UserError(f"{flag} {path}: record {bad + 1} is a {type(rows[bad]).__name__}, expected an object")
        if not any(rows):
            raise UserError(f"{flag} {path}: holds no records" + (EMPTY_OBJECTS if rows else ""))
        return
    fields = False
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{flag} {path}: invalid JSON on line {lineno} ({e.msg}); each line of a "
                            ".jsonl file must be one JSON object") from None
        if not isinstance(row, dict):
            raise UserError(f"{flag} {path}: line {lineno} is a {type(row).__name__}, expected an object")
        fields = fields or bool(row)
    # `{}`: datasets reads no column, and says 'Instruction "train" corresponds to no data!'
    if not fields:
        raise UserError(f"{flag} {path}: holds no records{EMPTY_OBJECTS}")


EMPTY_OBJECTS = " (only {}, an object without fields); write one object per record, e.g. {\"text\": \"...\"}"


def detect_format(columns: list[str], requested: str, source: str, sample: dict | None = None,
                  flag: str = "--dataset") -> str:
    """Check the columns fit `requested`, or pick the format they fit when `requested` is auto. `sample`
    (a record) shapes the hint: the mapping this file's columns would need."""
    cols = set(columns)
    if requested != "auto":
        need = FORMAT_COLUMNS[requested]
        missing = [c for c in need if c not in cols]
        if missing:
            raise UserError(f"{flag} {source}: --format {requested} needs column(s) {', '.join(missing)}; "
                            f"found {', '.join(sorted(cols))}{mapping_hint(columns, sample, requested)}")
        return requested
    for fmt, need in FORMAT_COLUMNS.items():
        if all(c in cols for c in need):
            return fmt
    expected = "; ".join(f"{f}: {'+'.join(c)}" for f, c in FORMAT_COLUMNS.items())
    raise UserError(f"{flag} {source}: cannot tell the format from columns {', '.join(sorted(cols))} "
                    f"(expected {expected}){mapping_hint(columns, sample)}")


def mapping_hint(columns: list[str], sample: dict | None, fmt: str = "auto") -> str:
    """"; name yours with --columns ..." for what this file holds: a column of turns as conversations (with
    its turns' keys, where they are not ShareGPT's or chat's), string columns as the fields people name
    them for (`SAME_JOB`: question -> instruction), else the fields of `fmt` (alpaca's for auto)."""
    sample = sample or {}
    listed = [c for c in columns if isinstance(sample.get(c), list) and sample[c] and isinstance(sample[c][0], dict)]
    if fmt in ("chat", "sharegpt") or (fmt == "auto" and listed):
        field = "messages" if fmt == "chat" else "conversations"
        yours = listed[0] if listed else "YOURS"
        entries = [f"{field}={yours}"] + (_turn_hint(sample[yours], fmt) if listed else [])
        return f"; name yours with --columns, e.g. --columns {','.join(entries)}"
    if fmt == "text" or (fmt == "auto" and len(columns) == 1 and isinstance(sample.get(columns[0]), str)):
        return f"; name yours with --columns, e.g. --columns text={columns[0] if len(columns) == 1 else 'YOURS'}"
    named = {ALPACA_NAMES[c]: c for c in columns if c in ALPACA_NAMES}
    if fmt == "auto" and "output" in named and "instruction" in named:
        return f"; name yours with --columns, e.g. --columns {','.join(f'{k}={v}' for k, v in named.items())}"
    return "; name yours with --columns, e.g. --columns instruction=YOUR_PROMPT_COLUMN,output=YOUR_ANSWER_COLUMN"


# for `_turn_hint`
SPEAKER_KEYS = ("role", "from", "speaker", "who", "author", "sender", "name", "user", "type")
# what people name alpaca's fields, for the hint on a file no format fits (SFT: prompt and completion are
# TRL's prompt-completion form)
ALPACA_NAMES = {**{k: v for k, v in SAME_JOB.items() if v in ("instruction", "input", "output")},
                "prompt": "instruction", "completion": "output"}


def _turn_hint(turns: list, fmt: str) -> list[str]:
    """role=/content= (and user_role=, assistant_role=) for turns whose keys or speakers are not `fmt`'s own.
    The speaker's key: the one whose values are all ShareGPT's speaker names, else one named as speakers'
    keys are (`SPEAKER_KEYS`), else the one with the fewest different values; the text's: the longest other.
    Speakers are named in the order they first speak (the first a user, the next an assistant)."""
    keys = [k for k in turns[0] if all(isinstance(t, dict) and isinstance(t.get(k), str) for t in turns)]
    if len(keys) < 2:
        return []
    formats = ("chat", "sharegpt") if fmt == "auto" else (fmt,)
    if any(set(TURN_KEYS[f]) <= set(keys) for f in formats):
        return []

    def speaker_rank(k: str) -> tuple:
        values = [t[k] for t in turns]
        return (not all(v.lower() in SHAREGPT_ROLES for v in values), k.lower() not in SPEAKER_KEYS,
                len(set(values)), sum(map(len, values)))

    role = min(keys, key=speaker_rank)
    content = max((k for k in keys if k != role), key=lambda k: sum(len(t[k]) for t in turns))
    speakers = [v for v in dict.fromkeys(t[role] for t in turns) if v.lower() not in SHAREGPT_ROLES]
    return [f"role={role}", f"content={content}"] + [f"{r}_role={v}" for r, v in zip(("user", "assistant"), speakers)]


def with_system_prompt(conv: list[dict], system: str) -> list[dict]:
    """`--system-prompt`: prepended where the conversation has no system message of its own."""
    if not system or any(m["role"] == "system" for m in conv):
        return conv
    return [{"role": "system", "content": system}, *conv]


def read_turns(turns: Any, fmt: str, where: str, mapping: Turns = Turns()) -> list[dict[str, str]]:
    """A list of turns (chat's {role, content}, ShareGPT's {from, value}, or the keys `mapping` names) as
    our messages; a speaker `mapping` names is read as its role, else ShareGPT's names (chat's roles as
    they are)."""
    role_key, text_key = mapping.keys(*TURN_KEYS[fmt])
    field = "messages" if fmt == "chat" else "conversations"
    if not isinstance(turns, list) or not all(isinstance(t, dict) and role_key in t and text_key in t for t in turns):
        keys = next((list(t) for t in turns if isinstance(t, dict)), []) if isinstance(turns, list) else []
        named = ",".join(_turn_hint(turns, fmt)[:2]) if isinstance(turns, list) and turns else ""
        hint = (f" (its turns' keys are {', '.join(map(str, keys))}: map them with --columns "
                f"{named or 'role=YOURS,content=YOURS'})" if keys and not {role_key, text_key} <= set(keys) else "")
        raise UserError(f"{where}'{field}' must be a list of {{{role_key}, {text_key}}} objects{hint}")
    out = []
    for t in turns:
        speaker = str(t[role_key])
        role = mapping.role_of(speaker) or (SHAREGPT_ROLES.get(speaker.lower()) if fmt == "sharegpt" else speaker)
        if role is None:
            raise UserError(f"{where}unknown ShareGPT speaker '{speaker}' (expected one of "
                            f"{', '.join(sorted(SHAREGPT_ROLES))}; or name its role with --columns "
                            f"user_role={speaker}, assistant_role={speaker} or system_role={speaker})")
        # a list of content parts: kept as parts where it holds an image (`toolkit.data.images`)
        out.append({"role": role, "content": content_parts(t[text_key], where)})
    return out


def to_conversation(row: dict[str, Any], fmt: str, index: int = -1,
                    turns: Turns = Turns()) -> list[dict[str, str]] | str:
    """One record as chat messages (alpaca, chat, sharegpt) or as plain text (text); `turns`: the turn
    keys and speakers a column mapping names."""
    # `index` 0-based; said from 1 (`record_place`)
    where = f"record {index + 1}: " if index >= 0 else ""
    if fmt == "text":
        if not isinstance(row["text"], str):
            raise UserError(f"{where}'text' must be a string")
        return row["text"]
    if fmt == "alpaca":
        instruction, inp, output = row.get("instruction"), row.get("input") or "", row.get("output")
        if not isinstance(instruction, str) or not isinstance(output, str):
            raise UserError(f"{where}alpaca 'instruction' and 'output' must be strings")
        prompt = f"{instruction}\n\n{inp}" if str(inp).strip() else instruction
        msgs = [{"role": "user", "content": prompt}, {"role": "assistant", "content": output}]
        if isinstance(row.get("system"), str) and row["system"].strip():
            msgs.insert(0, {"role": "system", "content": row["system"]})
        return msgs
    if fmt in TURN_KEYS:
        return read_turns(row["messages" if fmt == "chat" else "conversations"], fmt, where, turns)
    raise ValueError(fmt)
