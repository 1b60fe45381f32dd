"""`python -m toolkit convert-checkpoint` and `verify`: a step checkpoint written out as a standard
folder, and a saved folder's loss on a batch in a fresh process; `checkpoint_as_folder`, how merge and
generate read a step checkpoint."""

from __future__ import annotations

import sys
from pathlib import Path

from toolkit.errors import UserError


def checkpoint_as_folder(path: str, work: str) -> str:
    """A step checkpoint (`checkpoint-N`) written out as a standard folder in `work` (what
    `convert-checkpoint` does); any other path as it is."""
    from toolkit.train.checkpoint import TRAINER_STATE, convert_checkpoint

    if not (Path(path) / TRAINER_STATE).is_file():
        return path
    folder = Path(work) / "model"
    convert_checkpoint(Path(path), folder)
    print(f"{path}: a step checkpoint, read as a standard folder (`python -m toolkit convert-checkpoint` writes "
          "one to keep)", file=sys.stderr)
    return str(folder)


def cmd_convert_checkpoint(args) -> None:
    from toolkit.train.checkpoint import convert_checkpoint

    out = Path(args.output)
    # the nearest that exists
    above = next((a for a in [out, *out.parents] if a.exists()), None)
    if above is not None and not above.is_dir():
        raise UserError(f"--output {args.output}: {'it' if above == out else above} is a file; choose a folder "
                        "(empty or absent)")
    print(convert_checkpoint(Path(args.checkpoint), out))


def cmd_verify(args) -> None:
    import json

    from toolkit.train.integrity import reload_loss

    print(json.dumps({"loss": reload_loss(args.folder, args.base, args.batch, args.pad_id, args.load_4bit)}))
