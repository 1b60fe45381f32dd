"""`python -m toolkit generate`: greedy unless --do-sample, sampling settings only with it (their
refusals: tests/test_bad_input.py), a seed that makes sampling repeatable, every default in --help; a
prompt file in batches, a chat on stdin, a system prompt and a chat template, rendered as training does."""

import argparse

import pytest

from toolkit.cli.main import build_parser
from toolkit.cli.main import main as cli


def test_sampling_is_seeded_by_seed_and_greedy_is_the_default(tiny_model, capsys):
    """Issue 45: there was no --seed (sampling followed whatever torch's global seed was). The same
    --seed gives the same text whatever that global seed, another seed another text; without
    --do-sample decoding is greedy, the same as --do-sample never given."""
    import torch

    def run(*flags: str, global_seed: int = 0) -> str:
        torch.manual_seed(global_seed)
        cli(["generate", "--model", str(tiny_model), "--prompt", "hi", "--max-new-tokens", "16", *flags])
        return capsys.readouterr().out

    one = run("--do-sample", "--seed", "1", global_seed=0)
    assert one == run("--do-sample", "--seed", "1", global_seed=7) != run("--do-sample", "--seed", "2")
    assert run("--do-sample", global_seed=0) == run("--do-sample", global_seed=7)  # the default seed
    assert run() != one  # greedy


def test_help_shows_every_default():
    """Issue 45: `generate --help` did not show the --max-new-tokens default. Each flag that has one
    says it; the sampling ones say theirs although they are unset until --do-sample."""
    parser = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["generate"]
    text = " ".join(parser.format_help().split())
    for want in ("tokens to generate at most (default: 128)", "softmax temperature, > 0 (default: 1.0)",
                 "(default: 1.0, off)", "(default: 0, off)", "the same seed gives the same text (default: 42)",
                 "greedy too (default: 1.0)", "sample instead of greedy decoding (default: greedy)"):
        assert want in text, want
    valued = [a for a in parser._actions if a.option_strings and a.nargs is None and not a.required
              and a.dest not in ("prompt", "prompt_file", "image")]  # the prompt itself (and its images) has no default
    assert len(valued) == 9 and all("default" in (a.help or "") or a.default is not None for a in valued)
    assert "(default: None)" not in text and "(default: False)" not in text


def greedy(model_dir, template: str | None, conversations: list, new_tokens: int) -> list[str]:
    """Each conversation's greedy completion, one at a time, rendered as training renders its data."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from toolkit.data.tokenize import ensure_chat_template, prompt_text

    tok = AutoTokenizer.from_pretrained(model_dir)
    if template:
        tok.chat_template = template
    ensure_chat_template(tok)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    out = []
    for messages in conversations:
        enc = tok(prompt_text(tok, messages), return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            ids = model.generate(**enc, max_new_tokens=new_tokens, do_sample=False, pad_token_id=tok.eos_token_id)
        out.append(tok.decode(ids[0, enc["input_ids"].shape[1]:], skip_special_tokens=True).strip())
    return out


def test_a_prompt_file_with_a_system_prompt_and_a_chat_template(tiny_model, tmp_path, capsys):
    """Issue 64: generate took one prompt. --prompt-file answers every prompt of a file (plain lines, or JSON
    Lines of prompts or of message lists) in left-padded batches, a JSON line each; --system-prompt is added
    where a conversation has no system message (as training adds it); --chat-template renders them. Each
    completion equals that conversation's own greedy one, and --prompt gives the same."""
    import json

    from conftest import CHATML

    template = tmp_path / "chatml.jinja"
    template.write_text(CHATML)
    file = tmp_path / "prompts.jsonl"
    own = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the quick brown fox jumps"}]
    records = [{"prompt": "hi"}, {"messages": own}, {"prompt": "over the lazy"}]
    file.write_text("\n".join(json.dumps(r) for r in records))
    system = {"role": "system", "content": "you answer"}
    want = greedy(tiny_model, CHATML, [[system, {"role": "user", "content": "hi"}], own,
                                       [system, {"role": "user", "content": "over the lazy"}]], 6)
    flags = ["--system-prompt", "you answer", "--chat-template", str(template), "--max-new-tokens", "6"]
    cli(["generate", "--model", str(tiny_model), "--prompt-file", str(file), "--batch-size", "2", *flags])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert lines == [{"prompt": "hi", "completion": want[0]}, {"messages": own, "completion": want[1]},
                     {"prompt": "over the lazy", "completion": want[2]}]
    cli(["generate", "--model", str(tiny_model), "--prompt", "hi", *flags])
    assert capsys.readouterr().out.strip() == want[0]


def test_chat_reads_turns_from_stdin_and_keeps_the_conversation(tiny_model, monkeypatch, capsys):
    """--chat: each line of stdin is the user's next turn, answered with the conversation so far (its own
    earlier answers included), until end of input."""
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO("hi there\n\nover the lazy dog\n"))
    cli(["generate", "--model", str(tiny_model), "--chat", "--max-new-tokens", "5"])
    replies = capsys.readouterr().out.splitlines()
    first = greedy(tiny_model, None, [[{"role": "user", "content": "hi there"}]], 5)[0]
    second = greedy(tiny_model, None, [[{"role": "user", "content": "hi there"},
                                        {"role": "assistant", "content": first},
                                        {"role": "user", "content": "over the lazy dog"}]], 5)[0]
    assert replies == [first, second]


@pytest.mark.parametrize("argv, said", [
    ([], "give the prompt: --prompt TEXT, --prompt-file FILE (one per line, or .jsonl), or --chat"),
    (["--prompt", "hi", "--chat"], "--prompt and --chat both give prompts; use one"),
    (["--chat", "--raw"], "--raw continues the text as it is, with no chat template; --chat needs one"),
    (["--prompt-file", "missing.txt"], "--prompt-file missing.txt: file not found"),
    (["--prompt", "hi", "--chat-template", "missing.jinja"], "--chat-template missing.jinja: file not found"),
])
def test_generate_refuses_what_it_cannot_do_in_one_line(tiny_model, capsys, argv, said):
    with pytest.raises(SystemExit):
        cli(["generate", "--model", str(tiny_model), *argv])
    assert said in capsys.readouterr().err
