"""Where the toolkit keeps what it builds once per machine: the converted default model, tokenized
datasets, the measured matmul peak. `TOOLKIT_CACHE`, else ~/.cache/toolkit. A leaf: no toolkit imports."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("TOOLKIT_CACHE", Path.home() / ".cache" / "toolkit"))
