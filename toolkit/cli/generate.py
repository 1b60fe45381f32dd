"""`python -m toolkit generate`: completions from a model or adapter folder of one prompt, a file of
them or a chat on stdin; its decoding settings (`SAMPLING`, `sampling_options`), the prompts read and
checked before the model loads, and the batched generation."""

from __future__ import annotations

import sys
from pathlib import Path

from toolkit.cli.checkpoints import checkpoint_as_folder
from toolkit.errors import UserError

# generate's defaults under --do-sample
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "seed": 42}


def sampling_options(args) -> dict:
    """`generate`'s decoding settings for transformers' `generate`, checked: greedy unless --do-sample;
    a sampling setting given without it is refused (greedy decoding would ignore it)."""
    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be at least 1 (got {args.max_new_tokens})")
    if args.temperature is not None and args.temperature <= 0:
        raise UserError(f"--temperature must be > 0 (got {args.temperature:g}); leave out --do-sample and "
                        "--temperature to decode greedily")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise UserError(f"--top-p must be in (0, 1] (got {args.top_p:g})")
    if args.top_k is not None and args.top_k < 0:
        raise UserError(f"--top-k must be 0 (off) or more (got {args.top_k})")
    if args.repetition_penalty <= 0:
        raise UserError(f"--repetition-penalty must be > 0 (1 = off; got {args.repetition_penalty:g})")
    given = [f"--{k.replace('_', '-')}" for k in SAMPLING if getattr(args, k) is not None]
    if given and not args.do_sample:
        raise UserError(f"{' and '.join(given)} {'set' if len(given) > 1 else 'sets'} sampling, and decoding is greedy "
                        "without --do-sample; add --do-sample to sample, or leave "
                        f"{'them' if len(given) > 1 else 'it'} out")
    options = {"do_sample": args.do_sample, "repetition_penalty": args.repetition_penalty}
    # what greedy decoding ignores (transformers warns when given them)
    if args.do_sample:
        options.update({k: default if getattr(args, k) is None else getattr(args, k)
                        for k, default in SAMPLING.items()})
    return options


def read_prompts(path: str, system: str) -> list[tuple[object, list[dict[str, str]]]]:
    """`generate --prompt-file`: (what the line gave, the conversation to answer) for each prompt of a
    file of one prompt per line, or JSON Lines of {"prompt": ...} or {"messages": [...]} (ending with
    the user's turn). `system` is added where a conversation has no system message, as in training."""
    import json

    file = Path(path)
    if not file.is_file():
        raise UserError(f"--prompt-file {path}: file not found")
    lines = [(n, line) for n, line in enumerate(file.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
             if line.strip()]
    out = []
    for n, line in lines:
        if file.suffix != ".jsonl":
            given, messages = line.strip(), [{"role": "user", "content": line.strip()}]
        else:
            try:
                record = json.loads(line)
                given = record["prompt"] if "prompt" in record else record["messages"]
                messages = [{"role": "user", "content": str(given)}] if "prompt" in record else \
                    [{"role": str(m["role"]), "content": str(m["content"])} for m in given]
            except (ValueError, KeyError, TypeError):
                raise UserError(f"--prompt-file {path}: line {n} is not a JSON object with a \"prompt\" or "
                                "\"messages\" ([{\"role\": ..., \"content\": ...}, ...])") from None
            if not messages or messages[-1]["role"] != "user":
                last = f"the {messages[-1]['role']}'s turn" if messages else "nothing"
                raise UserError(f"--prompt-file {path}: line {n}'s messages end with {last}; end them with the "
                                "user's turn, the one to answer")
        out.append((given, with_system(messages, system)))
    if not out:
        raise UserError(f"--prompt-file {path} holds no prompt")
    return out


def with_system(messages: list[dict[str, str]], system: str) -> list[dict[str, str]]:
    """The conversation with `system` first, unless it has a system message of its own (as training adds
    --system-prompt)."""
    if not system or any(m["role"] == "system" for m in messages):
        return messages
    return [{"role": "system", "content": system}, *messages]


def generate_checks(args) -> None:
    """What `generate` is asked, checked before any model loads: one source of prompts, and no chat
    setting beside --raw (which continues plain text, no template)."""
    from toolkit.config.chat_template import template_problems

    sources = [flag for flag, given in (("--prompt", args.prompt is not None), ("--prompt-file", args.prompt_file),
                                        ("--chat", args.chat)) if given]
    if len(sources) != 1:
        raise UserError(f"{' and '.join(sources)} both give prompts; use one" if sources else
                        "give the prompt: --prompt TEXT, --prompt-file FILE (one per line, or .jsonl), or --chat "
                        "(turns read from stdin)")
    if args.prompt is not None and not args.prompt.strip():
        raise UserError("--prompt is empty; give the text to continue or answer")
    if args.batch_size < 1:
        raise UserError(f"--batch-size must be at least 1 (got {args.batch_size})")
    if args.image and (args.prompt is None or args.raw):
        raise UserError("--image goes with --prompt (and the chat template: not --raw)")
    missing = [p for p in args.image or [] if not Path(p).is_file()]
    if missing:
        raise UserError(f"--image {missing[0]}: file not found")
    if args.raw:
        chat = [f for f, given in (("--chat", args.chat), ("--system-prompt", args.system_prompt),
                                   ("--chat-template", args.chat_template)) if given]
        if chat:
            raise UserError(f"--raw continues the text as it is, with no chat template; {' and '.join(chat)} "
                            f"{'need' if len(chat) > 1 else 'needs'} one: leave out --raw")
    problems = template_problems(args.chat_template or "")
    if problems:
        raise UserError(problems[0])


def complete(model, tok, texts: list[str], options: dict, raw: bool, max_new_tokens: int,
             batch_size: int) -> list[str]:
    """Completions of `texts` (rendered prompts, or plain text with `raw`), `batch_size` at a time,
    left-padded so every row's completion starts at the same position."""
    import torch

    out, side = [], tok.padding_side
    tok.padding_side = "left"
    try:
        for start in range(0, len(texts), batch_size):
            enc = tok(texts[start:start + batch_size], return_tensors="pt", padding=True, add_special_tokens=raw)
            with torch.no_grad():
                ids = model.generate(**enc, max_new_tokens=max_new_tokens, pad_token_id=tok.pad_token_id, **options)
            out += [t.strip() for t in tok.batch_decode(ids[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)]
    finally:
        tok.padding_side = side
    return out


def images_processor(model, folder: str, trust_remote_code: bool):
    """The processor saved in `folder`, for --image; a text-only model is one line."""
    from toolkit.model.vision import image_text, load_processor

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not image_text(base.config):
        raise UserError("--image: the model is a text-only model (no vision_config in its config.json); leave it out")
    return load_processor(folder, trust_remote_code)


def complete_with_images(model, processor, messages: list[dict], images: list[str], options: dict,
                         max_new_tokens: int) -> str:
    """The completion of `messages` whose last user turn is preceded by `images`, through the model's processor (the
    one saved with it: final/ of a run that trained an image-text model holds its run's)."""
    import torch

    from toolkit.data.images import open_image, template_messages

    parts = [{"type": "image", "image": p} for p in images] + [{"type": "text", "text": messages[-1]["content"]}]
    messages = [*messages[:-1], {**messages[-1], "content": parts}]
    text = processor.apply_chat_template(template_messages(messages), tokenize=False, add_generation_prompt=True)
    enc = processor(text=[text], images=[[open_image(p) for p in images]], add_special_tokens=False,
                    return_tensors="pt")
    with torch.no_grad():
        ids = model.generate(**enc, max_new_tokens=max_new_tokens, pad_token_id=processor.tokenizer.pad_token_id,
                             **options)
    return processor.batch_decode(ids[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)[0].strip()


def cmd_generate(args) -> None:
    """Completions from a model or adapter folder of one --prompt, each prompt of a --prompt-file
    (batched; JSON Lines out), or a --chat read from stdin turn by turn, its history kept; each
    conversation rendered with the chat template, as training renders its data. The prompts and the
    template are read and checked before the model loads."""
    import json
    import tempfile

    from toolkit.data.tokenize import ensure_chat_template, prompt_text
    from toolkit.model.load import load_for_inference, load_tokenizer
    from toolkit.model.source import resolve_model

    options = sampling_options(args)
    generate_checks(args)
    system = args.system_prompt or ""
    if args.prompt is not None:
        prompts = [(args.prompt, with_system([{"role": "user", "content": args.prompt}], system))]
    else:
        prompts = read_prompts(args.prompt_file, system) if args.prompt_file else []
    if args.raw and not all(isinstance(given, str) for given, _ in prompts):
        raise UserError(f"--raw continues plain text; --prompt-file {args.prompt_file} holds messages, which need the "
                        "chat template: leave out --raw")

    def render(messages: list[dict[str, str]]) -> str:
        try:
            return prompt_text(tok, messages)
        except Exception as e:  # noqa: BLE001 - a template that refuses the conversation (a system role, say)
            raise UserError(f"the chat template refused the conversation ({type(e).__name__}: "
                            f"{' '.join(str(e).split())[:200]})") from None

    with tempfile.TemporaryDirectory() as work:
        src = args.model if Path(args.model).exists() else resolve_model(args.model)
        src = checkpoint_as_folder(src, work)
        tok = load_tokenizer(src, args.trust_remote_code, args.chat_template or "")
        ensure_chat_template(tok)
        texts = [given if args.raw else render(messages) for given, messages in prompts]
        model = load_for_inference(src, trust_remote_code=args.trust_remote_code).eval()
        processor = images_processor(model, src, args.trust_remote_code) if args.image else None
    if args.do_sample:
        from transformers import set_seed

        set_seed(options.pop("seed"))

    def answer(texts: list[str]) -> list[str]:
        return complete(model, tok, texts, options, args.raw, args.max_new_tokens, args.batch_size)

    if args.image:
        print(complete_with_images(model, processor, prompts[0][1], [str(Path(p).resolve()) for p in args.image],
                                   options, args.max_new_tokens))
    elif args.prompt is not None:
        print(answer(texts)[0])
    elif args.prompt_file:
        for (given, _), text in zip(prompts, answer(texts)):
            print(json.dumps({"prompt" if isinstance(given, str) else "messages": given, "completion": text},
                             ensure_ascii=False), flush=True)
    else:
        history = with_system([], system)
        while True:
            if sys.stdin.isatty():
                print("> ", end="", file=sys.stderr, flush=True)
            line = sys.stdin.readline()
            if not line:
                break
            if not line.strip():
                continue
            history.append({"role": "user", "content": line.strip()})
            reply = answer([render(history)])[0]
            history.append({"role": "assistant", "content": reply})
            print(reply, flush=True)
