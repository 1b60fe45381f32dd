"""`python -m toolkit prepare-model` and `prepare-data`: what is made ready in the cache before a run
(the default model converted to safetensors, or a tiny random model written to a folder; a run's data
tokenized)."""

from __future__ import annotations

from pathlib import Path

from toolkit.errors import UserError


def cmd_prepare_model(args) -> None:
    """The default model converted into the cache; or, with --tiny, a tiny random model of one of
    `toolkit.model.synthetic.ZOO`'s architectures written to --output: an offline model, nothing downloaded,
    to try a layout on (MoE and `--ep` with qwen3_moe, mixtral, deepseek_v3 or gpt_oss)."""
    if args.tiny is None:
        if args.output is not None:
            raise UserError("--output goes with --tiny: the default model is converted into the cache")
        from toolkit.model.source import prepare_default_model

        print(prepare_default_model(force=args.force))
        return
    if args.output is None:
        raise UserError(f"--tiny {args.tiny} needs --output DIR, the folder to write the model to")
    from toolkit.model.synthetic import ZOO, build_zoo_model_dir

    if args.tiny not in ZOO:
        raise UserError(f"--tiny {args.tiny}: not an architecture toolkit/model/synthetic.py builds; one of "
                        f"{', '.join(sorted(ZOO))}")
    out = Path(args.output)
    if out.exists() and not args.force and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--output {out} exists and is not an empty folder; pass --force to write the model over it")
    print(build_zoo_model_dir(out, args.tiny))


def cmd_prepare_data(args) -> None:
    """Tokenize a run's data into the cache its training run will read (no model, no GPU): what a
    login node can do before the job starts. Takes finetune.py's flags or --config."""
    from toolkit.config import parse_config
    from toolkit.data.peek import check_data
    from toolkit.data.prepare import prepare_data
    from toolkit.data.tokenize import ensure_chat_template
    from toolkit.cache import cache_dir
    from toolkit.model.load import load_tokenizer
    from toolkit.model.source import resolve_model, tokenizer_dir

    # the run's own output dir is not touched here: a placeholder keeps its checks out of the way
    cfg = parse_config([*args.flags, "--output-dir", "/nonexistent/prepare-data"],
                       prog="python -m toolkit prepare-data")
    # the data's columns, before the tokenizer loads
    check_data(cfg.data_settings)
    # the tokenizer finetune.py will use (an SFT adapter's own, saved beside it), so the run reads this cache
    tokenizer = load_tokenizer(tokenizer_dir(cfg.model.model, resolve_model(cfg.model.model)),
                               cfg.model.trust_remote_code, cfg.model.chat_template)
    ensure_chat_template(tokenizer)
    data = prepare_data(cfg.data_settings, tokenizer)
    for what, stats in (("training", data.stats), ("eval", data.eval_stats)):
        if stats.examples:
            print(f"{what}: {stats.examples} examples ({stats.dropped} dropped, {stats.truncated} truncated), "
                  f"{stats.tokens} tokens, {stats.target_tokens} trained")
    print(f"{'read from' if data.stats.cached else 'written to'} {cache_dir() / 'data'}; runs with the same data, "
          "tokenizer and settings read it")
