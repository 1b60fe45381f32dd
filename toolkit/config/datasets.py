"""`--dataset`: one source, or a weighted mixture `a.jsonl:0.7,b.json:0.3` (pure parsing, no imports
beyond the standard library: config validation reads it before anything heavy loads).

A source is a file, folder, hub id or `builtin:NAME`; a trailing `:WEIGHT` that parses as a number
is its weight (so `builtin:gsm8k` is a source, `builtin:gsm8k:0.5` a weighted one). Weights are
given for every source of a mixture or for none (then each source counts by its size). A source may
end with its own column mapping, `:OURS=YOURS;OURS=YOURS` (`;` inside a source, as `,` separates the
sources): `a.json:0.5:instruction=prompt;output=response,b.json:0.5`. It is used instead of
`--columns` for that source. In YAML the same is a list of `{path, weight, columns}` mappings
(`toolkit.config`), written back in this form.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path


@dataclass(frozen=True)
class Source:
    # the file, folder, hub id or builtin:NAME
    spec: str
    weight: float | None = None
    # its own mapping, as --columns writes it ("a=b,c=d"); "": --columns applies
    columns: str = ""


# between a source's own OURS=YOURS entries
MAPPING_SEPARATOR = ";"


def _weight(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def parse_sources(spec: str) -> list[Source]:
    sources = []
    for part in (p.strip() for p in spec.split(",")):
        head, sep, tail = part.rpartition(":")
        columns = ""
        # its own mapping (a path may hold '=', but not after its last ':')
        if sep and "=" in tail:
            part, columns = head, ",".join(e.strip() for e in tail.split(MAPPING_SEPARATOR) if e.strip())
            head, sep, tail = part.rpartition(":")
        weight = _weight(tail) if sep else None
        sources.append(Source(head, weight, columns) if weight is not None else Source(part, None, columns))
    return sources


def source_spec(path: str, weight: float | None = None, columns: dict[str, str] | None = None) -> str:
    """One source as `parse_sources` reads it (YAML's `{path, weight, columns}`)."""
    mapping = MAPPING_SEPARATOR.join(f"{ours}={yours}" for ours, yours in (columns or {}).items())
    return path + (f":{weight}" if weight is not None else "") + (f":{mapping}" if mapping else "")


def is_mixture(spec: str) -> bool:
    sources = parse_sources(spec)
    return len(sources) > 1 or sources[0].weight is not None


def first_source(spec: str) -> Source:
    """The source of a dataset that is not a mixture (its path, and its own columns if it gives any)."""
    return parse_sources(spec)[0]


def spec_problems(spec: str, flag: str = "--dataset") -> list[str]:
    """What is wrong with a mixture's syntax (the sources' paths and columns are checked one by one
    elsewhere, `toolkit.config.paths.dataset_problems`)."""
    sources = parse_sources(spec)
    if not is_mixture(spec):
        return [] if sources[0].spec else [f"{flag} {spec}: no file before its columns; write FILE:OURS=YOURS"]
    problems = []
    stray = [s.spec for s in sources if "=" in s.spec and not Path(s.spec).exists()]
    # `a.json:0.5:instruction=prompt,output=response`: the comma ended the source
    if stray:
        problems.append(f"{flag} {spec}: {stray[0]!r} reads as a source of its own; separate a source's columns "
                        f"with ';' (e.g. a.json:0.5:instruction=prompt;output=response,b.json:0.5)")
        return problems
    if any(not s.spec for s in sources):
        problems.append(f"{flag} {spec}: an empty source; write a.jsonl:0.7,b.json:0.3")
    weighted = [s.weight is not None for s in sources]
    if any(weighted) and not all(weighted):
        problems.append(f"{flag} {spec}: give a weight to every source or to none (e.g. a.jsonl:0.7,b.json:0.3)")
    bad = [s for s in sources if s.weight is not None and not s.weight > 0]
    if bad:
        problems.append(f"{flag} {spec}: weights must be > 0 (got {', '.join(f'{s.weight:g}' for s in bad)})")
    return problems


def dataset_digest(spec: str) -> str:
    """sha256 of the dataset's bytes: a file's, a folder's data files' (names and contents), or of a
    mixture, each source's digest with its weight; "spec:NAME" for a built-in or hub dataset (which
    a name identifies). Memoized on each file's size and mtime: a run checkpoints many times."""
    sources = parse_sources(spec)
    # a source's own columns decide its tokens, as --columns does
    if is_mixture(spec) or sources[0].columns:
        parts = [f"{dataset_digest(s.spec)}:{s.weight}" + (f":{s.columns}" if s.columns else "") for s in sources]
        return hashlib.sha256(",".join(parts).encode()).hexdigest()
    path = Path(spec)
    if path.is_dir():
        h = hashlib.sha256()
        for f in sorted(p for p in path.iterdir() if p.is_file()):
            h.update(f"{f.name}\x00{_file_digest(f, *_stamp(f))}\x00".encode())
        return h.hexdigest()
    if path.is_file():
        return _file_digest(path, *_stamp(path))
    return "spec:" + spec


def _stamp(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_size, st.st_mtime_ns


@lru_cache(maxsize=64)
def _file_digest(path: Path, size: int, mtime_ns: int) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
