"""Read a dataset (file, hub id or built-in) and turn each record into chat messages or plain text.

Every format ends up as one of two shapes, so tokenization has one path per shape:
- a conversation: `[{"role": "system"|"user"|"assistant", "content": str}, ...]`
- a plain text: `str`, trained on every token.
"""

from __future__ import annotations

import json
import logging
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from toolkit.errors import UserError
from toolkit.inputs import DATA_SUFFIXES, parse_columns

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


def load_records(spec: str):
    """A `datasets.Dataset` from a local file, a `builtin:NAME`, or a hub id."""
    import datasets

    if spec.startswith("builtin:"):
        from toolkit.data.builtin import builtin_dataset

        return builtin_dataset(spec.split(":", 1)[1], split="train")
    local = data_files(spec)
    if local:
        kind, files = local
        datasets.disable_progress_bars()  # a bar per small file is noise in front of our own report
        try:
            with datasets_log_silenced():
                ds = datasets.load_dataset(kind, data_files=[str(f) for f in files], split="train")
        except Exception as e:  # noqa: BLE001 - datasets wraps parser errors in many types
            not_utf8 = utf8_problem(files)  # our own reading names the line (not done up front: GBs as Python)
            if not_utf8:
                raise UserError(f"--dataset {not_utf8}") from None
            if kind == "json":
                for f in files:
                    _check_json_file(f)
            raise UserError(f"--dataset {spec}: could not be read as {kind} ({_short(e)})") from None
        if len(ds) == 0 and kind == "json":
            for f in files:
                _check_json_file(f)
    else:
        try:
            ds = datasets.load_dataset(spec, split="train")
        except Exception as e:  # noqa: BLE001
            raise UserError(f"--dataset {spec}: not a local file and could not be loaded from the hub "
                            f"({_short(e)}); pass a local .json/.jsonl/.csv/.parquet file") from None
    if len(ds) == 0:
        raise UserError(f"--dataset {spec}: holds no records")
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


def data_files(spec: str) -> tuple[str, list[Path]] | None:
    """(datasets' loader name, the files) of a local file or folder; None for a hub id."""
    path = Path(spec)
    if not path.exists():
        return None
    files = sorted(p for p in path.iterdir() if p.suffix.lower() in DATA_SUFFIXES) if path.is_dir() else [path]
    if not files:
        raise UserError(f"--dataset {spec}: folder holds no .json/.jsonl/.csv/.parquet file")
    kinds = {DATA_SUFFIXES[p.suffix.lower()] for p in files}
    if len(kinds) > 1:
        raise UserError(f"--dataset {spec}: mixes file types {sorted(kinds)}; keep one type per folder")
    return kinds.pop(), files


def map_columns(ds, spec: str, source: str):
    """Rename the dataset's own column names to the fields the formats read (`--columns`)."""
    renames = column_renames(list(ds.column_names), spec, source)
    return ds.rename_columns(renames) if renames else ds


def column_renames(cols: list[str], spec: str, source: str) -> dict[str, str]:
    """{yours: ours} for `--columns`, checking each named column exists and that no field would be
    taken twice."""
    import difflib

    mapping = parse_columns(spec)
    for ours, yours in mapping.items():
        if yours not in cols:
            hint = difflib.get_close_matches(yours, cols, n=1)
            raise UserError(f"--columns {ours}={yours}: --dataset {source} has no column '{yours}'"
                            + (f" (did you mean '{hint[0]}'?)" if hint else "") + f"; its columns are {', '.join(cols)}")
        if ours in cols and ours not in mapping.values():
            raise UserError(f"--columns {ours}={yours}: --dataset {source} already has a column '{ours}'; map that "
                            f"one elsewhere too, or drop {ours}={yours}")
    return {yours: ours for ours, yours in mapping.items() if yours != ours}


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
                    return f"{path}: line {line} is not UTF-8 text (byte 0x{e.object[e.start]:02x}); save the file as UTF-8"
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
                return f"{path}: invalid JSON on line {lineno} ({e.msg}); each line of a .jsonl file must be one JSON object"
            if not isinstance(row, dict):
                return f"{path}: line {lineno} is a {type(row).__name__}, expected an object"
    return None


def read_problem(spec: str, e: Exception) -> UserError:
    """One line for a failure while reading `--dataset spec`: the file and line where it is found
    (bytes that are not UTF-8, a JSON line that does not parse), else the reader's own words."""
    local = data_files(spec) if not spec.startswith("builtin:") else None
    if local:
        kind, files = local
        problem = utf8_problem(files)
        if problem is None and kind == "json":
            problem = next((p for f in files if _is_json_lines(f) and (p := json_lines_problem(f))), None)
        if problem:
            return UserError(f"--dataset {problem}")
    return UserError(f"--dataset {spec}: could not be read ({_short(e)})")


def _check_json_file(path: Path) -> None:
    """Parse JSON / JSON Lines ourselves first so a bad file is reported with its line number."""
    text = path.read_text(encoding="utf-8", errors="replace")
    if not text.strip():
        raise UserError(f"--dataset {path}: file is empty")
    stripped = text.lstrip()
    if stripped.startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise UserError(f"--dataset {path}: invalid JSON at line {e.lineno} column {e.colno} ({e.msg})") from None
        bad = next((i for i, r in enumerate(rows) if not isinstance(r, dict)), None)
        if bad is not None:
            raise UserError(f"--dataset {path}: record {bad + 1} is a {type(rows[bad]).__name__}, expected an object")
        if not rows:
            raise UserError(f"--dataset {path}: holds no records")
        return
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"--dataset {path}: invalid JSON on line {lineno} ({e.msg}); each line of a "
                            ".jsonl file must be one JSON object") from None
        if not isinstance(row, dict):
            raise UserError(f"--dataset {path}: line {lineno} is a {type(row).__name__}, expected an object")


def detect_format(columns: list[str], requested: str, source: str) -> str:
    """Check the columns fit `requested`, or pick the format they fit when `requested` is auto."""
    cols = set(columns)
    if requested != "auto":
        need = FORMAT_COLUMNS[requested]
        missing = [c for c in need if c not in cols]
        if missing:
            raise UserError(f"--dataset {source}: --format {requested} needs column(s) {', '.join(missing)}; "
                            f"found {', '.join(sorted(cols))}")
        return requested
    for fmt, need in FORMAT_COLUMNS.items():
        if all(c in cols for c in need):
            return fmt
    expected = "; ".join(f"{f}: {'+'.join(c)}" for f, c in FORMAT_COLUMNS.items())
    raise UserError(f"--dataset {source}: cannot tell the format from columns {', '.join(sorted(cols))} "
                    f"(expected {expected}); name yours with --columns, e.g. --columns instruction=prompt,output=response")


def with_system_prompt(conv: list[dict], system: str) -> list[dict]:
    """`--system-prompt`: prepended where the conversation has no system message of its own."""
    if not system or any(m["role"] == "system" for m in conv):
        return conv
    return [{"role": "system", "content": system}, *conv]


def to_conversation(row: dict[str, Any], fmt: str, index: int = -1) -> list[dict[str, str]] | str:
    """One record as chat messages (alpaca, chat, sharegpt) or as plain text (text)."""
    where = f"record {index + 1}: " if index >= 0 else ""  # `index` 0-based; said from 1 (`record_place`)
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
    if fmt == "chat":
        msgs = row["messages"]
        if not isinstance(msgs, list) or not all(isinstance(m, dict) and "role" in m and "content" in m for m in msgs):
            raise UserError(f"{where}'messages' must be a list of {{role, content}} objects")
        return [{"role": str(m["role"]), "content": str(m["content"] or "")} for m in msgs]
    if fmt == "sharegpt":
        turns = row["conversations"]
        if not isinstance(turns, list) or not all(isinstance(t, dict) and "from" in t and "value" in t for t in turns):
            raise UserError(f"{where}'conversations' must be a list of {{from, value}} objects")
        out = []
        for t in turns:
            role = SHAREGPT_ROLES.get(str(t["from"]).lower())
            if role is None:
                raise UserError(f"{where}unknown ShareGPT speaker '{t['from']}' "
                                f"(expected one of {', '.join(sorted(SHAREGPT_ROLES))})")
            out.append({"role": role, "content": str(t["value"] or "")})
        return out
    raise ValueError(fmt)
