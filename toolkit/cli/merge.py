"""`python -m toolkit merge`: a LoRA adapter folded into its base model, written as a plain
transformers folder."""

from __future__ import annotations

from pathlib import Path

from toolkit.cli.checkpoints import checkpoint_as_folder
from toolkit.errors import UserError


def cmd_merge(args) -> None:
    """Fold a LoRA adapter into its base model and write a plain transformers folder."""
    import tempfile

    from transformers import AutoTokenizer

    from toolkit.model.load import load_for_inference
    from toolkit.model.source import is_adapter_dir

    out = Path(args.output)
    if out.exists() and not out.is_dir():
        raise UserError(f"--output {out} is a file; choose a folder")
    if out.exists() and any(out.iterdir()) and not args.overwrite:
        raise UserError(f"--output {out} is not empty; pass --overwrite or choose another folder")
    with tempfile.TemporaryDirectory() as work:
        adapter = checkpoint_as_folder(args.adapter, work)
        if not is_adapter_dir(adapter):
            raise UserError(f"--adapter {args.adapter}: no adapter_config.json there (is it a LoRA output folder?)")
        model = load_for_inference(adapter, base=args.base, trust_remote_code=args.trust_remote_code,
                                   flag="--adapter").merge_and_unload()
        model.save_pretrained(out, safe_serialization=True)
        AutoTokenizer.from_pretrained(adapter).save_pretrained(out)
    print(f"merged model written to {out}")
