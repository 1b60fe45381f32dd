"""What a run reads, checked before anything heavy loads: the dataset's path, or each source of a
mixture with its own columns (`dataset_problems`), `--eval-dataset`, what `--streaming` allows, and
`--sample-prompts` (read by `sample_prompts`). Standard library only: config validation calls these,
and the data and train layers read the file suffixes and the prompts here."""

from __future__ import annotations

import os
from pathlib import Path

from toolkit.config.columns import column_problems
from toolkit.config.datasets import is_mixture, parse_sources, spec_problems
from toolkit.errors import UserError


DATA_SUFFIXES = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


def streaming_problems(dataset: str, eval_split: float, max_steps: int) -> list[str]:
    """What `--streaming` cannot do: count epochs, hold data out, or read a mixture or built-in data."""
    why = "a stream has no length to count epochs by"
    p = [] if max_steps > 0 else [f"--streaming needs --max-steps ({why})"]
    if eval_split > 0:
        p.append("--streaming with --eval-split is not supported (a stream holds nothing out); drop one")
    if is_mixture(dataset) or dataset.startswith("builtin:"):
        p.append(f"--streaming reads one dataset file, folder or hub id (got --dataset {dataset}); "
                 "drop --streaming for mixtures and built-in data")
    return p


def dataset_problems(spec: str, flag: str = "--dataset") -> list[str]:
    """One source, or each source of a mixture (`toolkit.config.datasets`): its path, and its own columns."""
    problems = spec_problems(spec, flag)
    if problems:
        return problems
    sources = parse_sources(spec)
    return [p for s in sources for p in column_problems(s.columns, f"{flag} {s.spec}:")] + \
        [p for s in sources for p in _dataset_path_problems(s.spec, flag)]


def unused_columns_problems(columns: str, dataset: str, eval_dataset: str) -> list[str]:
    """--columns where every source gives its own columns (which are used instead): it would be ignored."""
    sources = parse_sources(dataset) + (parse_sources(eval_dataset) if eval_dataset else [])
    if not columns or not all(s.columns for s in sources):
        return []
    both = " and --eval-dataset" if eval_dataset else ""
    return [f"--columns {columns} applies to no source: each source of --dataset{both} gives its own columns, "
            "used instead; drop --columns, or add its entries to a source's own"]


def eval_dataset_problems(spec: str, eval_split: float) -> list[str]:
    """`--eval-dataset`: one file, folder or hub id, held out as --eval-split's rows are, never both."""
    if not spec:
        return []
    if eval_split > 0:
        return [f"--eval-dataset and --eval-split {eval_split:g} both give the held-out data; drop one"]
    if is_mixture(spec):
        return [f"--eval-dataset {spec}: give one file, folder or hub id (a mixture's weights draw training "
                "examples; held-out data is evaluated whole)"]
    if spec.startswith("builtin:"):
        return [f"--eval-dataset {spec}: built-in data holds out its own eval split; use --eval-split with "
                "--dataset builtin:NAME"]
    return dataset_problems(spec, "--eval-dataset")


def _dataset_path_problems(spec: str, flag: str = "--dataset") -> list[str]:
    if spec.startswith("builtin:"):
        return []
    path = Path(spec)
    if path.suffix.lower() in DATA_SUFFIXES or os.sep in spec and not _looks_like_hub_id(spec):
        if not path.exists():
            return [f"{flag} {spec}: file not found"]
        if path.is_file() and path.suffix.lower() not in DATA_SUFFIXES:
            return [f"{flag} {spec}: unsupported file type '{path.suffix}' (use .json, .jsonl, .csv or .parquet)"]
        if not os.access(path, os.R_OK | (os.X_OK if path.is_dir() else 0)):
            return [f"{flag} {spec}: cannot be read (permission denied); make it readable, or copy it somewhere "
                    "you can read it"]
    return []


def sample_prompts(spec: str) -> list[str]:
    """`--sample-prompts`: a file (a prompt per line, or JSON Lines of {"prompt": ...}) or "p1;p2"."""
    import json

    path = Path(spec)
    if not path.is_file():
        return [p.strip() for p in spec.split(";") if p.strip()]
    lines = [line for line in path.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]
    if path.suffix == ".jsonl":
        out = []
        for n, line in enumerate(lines, 1):
            try:
                out.append(str(json.loads(line)["prompt"]))
            except (ValueError, KeyError, TypeError):
                raise UserError(f"--sample-prompts {spec}: line {n} is not a JSON object with a \"prompt\"") from None
        return out
    return [line.strip() for line in lines]


def sample_problems(spec: str, pp: int, cp: int) -> list[str]:
    if not spec:
        return []
    if not sample_prompts(spec):
        return [f"--sample-prompts {spec!r} holds no prompt"]
    if pp > 1 or cp > 1:
        return [f"--sample-prompts does not run under {'--pp' if pp > 1 else '--cp'} (generation needs the whole "
                "model on each rank, or its TP/ZeRO/FSDP shards); leave it out, or sample from the saved folder "
                "with python -m toolkit generate"]
    return []


def _looks_like_hub_id(spec: str) -> bool:
    parts = spec.split("/")
    return len(parts) == 2 and all(parts) and not spec.startswith((".", "/", "~"))
