"""`python -m toolkit <command>`: prepare-model, merge, generate."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from toolkit.errors import UserError, exit_on_user_error


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise UserError(message)


def cmd_prepare_model(args) -> None:
    from toolkit.models import prepare_default_model

    print(prepare_default_model(force=args.force))


def cmd_merge(args) -> None:
    """Fold a LoRA adapter into its base model and write a plain transformers folder."""
    from transformers import AutoTokenizer

    from toolkit.models import is_adapter_dir, load_for_inference

    if not is_adapter_dir(args.adapter):
        raise UserError(f"--adapter {args.adapter}: no adapter_config.json there (is it a LoRA output folder?)")
    out = Path(args.output)
    if out.exists() and any(out.iterdir()) and not args.overwrite:
        raise UserError(f"--output {out} is not empty; pass --overwrite or choose another folder")
    model = load_for_inference(args.adapter, base=args.base).merge_and_unload()
    model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(args.adapter).save_pretrained(out)
    print(f"merged model written to {out}")


def cmd_generate(args) -> None:
    import torch
    from transformers import AutoTokenizer

    from toolkit.data.tokenize import ensure_chat_template, prompt_text
    from toolkit.models import load_for_inference, resolve_model

    src = args.model if Path(args.model).exists() else resolve_model(args.model)
    model = load_for_inference(src).eval()
    tok = AutoTokenizer.from_pretrained(src)
    ensure_chat_template(tok)
    text = args.prompt if args.raw else prompt_text(tok, [{"role": "user", "content": args.prompt}])
    enc = tok(text, return_tensors="pt", add_special_tokens=args.raw)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=args.max_new_tokens, do_sample=args.temperature > 0,
                             temperature=args.temperature or None, pad_token_id=tok.pad_token_id or tok.eos_token_id)
    print(tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True).strip())


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m toolkit", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    s = sub.add_parser("prepare-model", help="convert the embedded SmolLM2-135M-Instruct GGUF to safetensors")
    s.add_argument("--force", action="store_true", help="convert again even if the cache holds it")
    s.set_defaults(fn=cmd_prepare_model)
    s = sub.add_parser("merge", help="merge a LoRA adapter into its base model")
    s.add_argument("--adapter", required=True, help="adapter folder (OUTPUT_DIR/final of a LoRA run)")
    s.add_argument("--output", required=True, help="folder for the merged model")
    s.add_argument("--base", help="base model (default: the one recorded in the adapter)")
    s.add_argument("--overwrite", action="store_true")
    s.set_defaults(fn=cmd_merge)
    s = sub.add_parser("generate", help="print a completion from a model or adapter folder")
    s.add_argument("--model", required=True, help="model folder, adapter folder, or the default name")
    s.add_argument("--prompt", required=True)
    s.add_argument("--max-new-tokens", type=int, default=128)
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    s.add_argument("--raw", action="store_true", help="no chat template: continue the prompt text")
    s.set_defaults(fn=cmd_generate)
    return p


@exit_on_user_error("python -m toolkit")
def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    args.fn(args)


if __name__ == "__main__":
    main()
