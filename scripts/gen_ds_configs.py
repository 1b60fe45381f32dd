#!/usr/bin/env python
"""Regenerate ds_configs/ from toolkit.layout.deepspeed (never edit those files by hand).

    python scripts/gen_ds_configs.py           # write
    python scripts/gen_ds_configs.py --check   # exit 1 if the files drifted from the generator
"""

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from toolkit.layout.deepspeed import standard_variants  # noqa: E402

OUT = ROOT / "ds_configs"


def render(cfg: dict) -> str:
    return json.dumps(cfg, indent=2) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    want = {name: render(cfg) for name, cfg in standard_variants().items()}
    have = {p.name: p.read_text() for p in OUT.glob("*.json")}
    if args.check:
        drift = sorted(n for n in set(want) | set(have) if want.get(n) != have.get(n))
        if drift:
            print(f"ds_configs/ drifted from the generator: {', '.join(drift)}; run scripts/gen_ds_configs.py")
            return 1
        print(f"ds_configs/ matches the generator ({len(want)} files)")
        return 0
    OUT.mkdir(exist_ok=True)
    for stale in set(have) - set(want):
        (OUT / stale).unlink()
    for name, text in want.items():
        (OUT / name).write_text(text)
    print(f"wrote {len(want)} files to {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
