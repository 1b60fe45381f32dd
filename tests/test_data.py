import re
from collections import Counter

import pytest
from conftest import CHATML, make_records
from helpers import build_tokenizer

from toolkit.config import parse_config
from toolkit.data import collate, load_examples, tokenize_examples
from toolkit.data.formats import detect_format, to_conversation
from toolkit.data.tokenize import IGNORE_INDEX, encode, ensure_chat_template
from toolkit.errors import UserError


@pytest.fixture(scope="module", params=["fallback", "chatml"])
def tokenizer(request):
    tok = build_tokenizer(CHATML if request.param == "chatml" else None)
    ensure_chat_template(tok)
    return tok


def trained_text(tok, enc) -> str:
    return tok.decode([i for i, label in zip(enc.input_ids, enc.labels) if label != IGNORE_INDEX])


@pytest.mark.parametrize("fmt", ["alpaca", "chat", "sharegpt", "text"])
def test_auto_detects_each_format(fmt):
    rows = make_records(fmt, 2)
    assert detect_format(list(rows[0]), "auto", "x") == fmt


def test_unknown_columns_are_one_clear_error():
    with pytest.raises(UserError, match="cannot tell the format from columns answer, question"):
        detect_format(["question", "answer"], "auto", "data.json")
    with pytest.raises(UserError, match="--format alpaca needs column.* instruction"):
        detect_format(["text"], "alpaca", "data.json")


def test_prompt_tokens_masked_every_assistant_turn_trained(tokenizer):
    conv = [{"role": "system", "content": "be brief"},
            {"role": "user", "content": "the quick fox"}, {"role": "assistant", "content": "lazy dog"},
            {"role": "user", "content": "seven wizards"}, {"role": "assistant", "content": "purple dragons"}]
    enc = encode(tokenizer, conv, seq_len=512, train_on_prompt=False)
    got = trained_text(tokenizer, enc)
    eot = "<|im_end|>" if tokenizer.chat_template == CHATML else "</s>"
    assert got == f"lazy dog{eot}purple dragons{eot}"
    for word in ("be brief", "quick fox", "seven wizards", "user", "assistant"):
        assert word not in got
    full = encode(tokenizer, conv, seq_len=512, train_on_prompt=True)
    assert full.labels == full.input_ids


def test_text_format_trains_every_token_and_ends_with_eos(tokenizer):
    enc = encode(tokenizer, "the lazy dog", seq_len=512, train_on_prompt=False)
    assert enc.labels == enc.input_ids and enc.input_ids[-1] == tokenizer.eos_token_id


def test_sharegpt_and_alpaca_become_chats():
    sg = to_conversation({"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}]},
                         "sharegpt")
    assert sg == [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    al = to_conversation({"instruction": "do", "input": "this", "output": "done"}, "alpaca")
    assert al == [{"role": "user", "content": "do\n\nthis"}, {"role": "assistant", "content": "done"}]
    with pytest.raises(UserError, match="unknown ShareGPT speaker 'robot'"):
        to_conversation({"conversations": [{"from": "robot", "value": "a"}]}, "sharegpt", 3)


def test_truncation_is_counted_and_fully_masked_examples_dropped(tokenizer, tmp_path):
    cfg = parse_config(["--seq-len", "32", "--output-dir", str(tmp_path / "o")])
    long_prompt = [{"role": "user", "content": " ".join(["dragons"] * 40)}, {"role": "assistant", "content": "ok"}]
    short = [{"role": "user", "content": "fox"}, {"role": "assistant", "content": "dog"}]
    rows, stats = tokenize_examples([long_prompt, short, "the quick brown fox jumps over a lazy dog " * 6],
                                    tokenizer, cfg.data_settings)
    assert stats.truncated == 2 and stats.dropped == 1 and len(rows) == 2
    assert all(len(r["input_ids"]) <= 32 for r in rows)
    with pytest.raises(UserError, match="every training example is left with no answer tokens after truncation to "
                                        "--seq-len 32"):
        tokenize_examples([long_prompt], tokenizer, cfg.data_settings)


def test_collate_pads_right_with_masked_labels(tokenizer):
    batch = collate([{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [8], "labels": [8]}], pad_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 6, 7], [8, -100, -100]]


def test_eval_split_holds_out_a_fraction(data_files, tmp_path):
    cfg = parse_config(["--dataset", str(data_files["chat"]), "--eval-split", "0.25",
                        "--output-dir", str(tmp_path / "o")])
    ex = load_examples(cfg.data_settings)
    assert (len(ex.train), len(ex.eval)) == (24, 8)
    assert not any(c in ex.eval for c in ex.train)


def test_builtin_dates_train_and_eval_are_disjoint(tmp_path):
    from toolkit.data.builtin import builtin_records

    train = {r["answer"] for r in builtin_records("dates", "train")}
    held = {r["answer"] for r in builtin_records("dates", "eval")}
    assert len(train) == 1000 and len(held) == 64 and not train & held


def test_builtin_arithmetic_is_graded_by_math_answer_and_holds_out_its_own_products():
    """builtin:arithmetic (the GRPO quickstart's task): each record's prompt asks for a product of two operands
    2-12 and `builtin:math_answer` gives its answer 1.0 (also as a sentence) and a wrong one 0.0; SFT reads its
    messages; no pair of operands is in both splits, in any order or phrasing; eval is 64, the phrasings in turn."""
    from toolkit.data.builtin import ARITHMETIC_PROMPTS, builtin_records
    from toolkit.data.formats import detect_format
    from toolkit.objectives.grpo.rewards import math_answer

    def operands(row):
        a, b = (int(x) for x in re.findall(r"\d+", row["prompt"]))
        return a, b

    splits = {split: builtin_records("arithmetic", split) for split in ("train", "eval")}
    for rows in splits.values():
        for row in rows:
            a, b = operands(row)
            assert 2 <= a <= 12 and 2 <= b <= 12 and row["answer"] == str(a * b)
            assert row["messages"] == [{"role": "user", "content": row["prompt"]},
                                       {"role": "assistant", "content": row["answer"]}]
        prompts = [r["prompt"] for r in rows]
        answers = [r["answer"] for r in rows]
        assert math_answer(prompts, answers, answer=answers) == [1.0] * len(rows)
        assert math_answer(prompts, [f"{a} * {b} = {a * b}" for a, b in map(operands, rows)],
                           answer=answers) == [1.0] * len(rows)
        assert math_answer(prompts, [str(int(x) + 1) for x in answers], answer=answers) == [0.0] * len(rows)
        assert math_answer(prompts, ["To solve this problem, we need to"] * len(rows),
                           answer=answers) == [0.0] * len(rows)
        assert detect_format(list(rows[0]), "auto", "builtin:arithmetic") == "chat"
    train, held = ({frozenset(operands(r)) for r in rows} for rows in splits.values())
    assert len(splits["train"]) == 534 and len(splits["eval"]) == 64 and len(train) == 50 and not train & held
    assert len({r["prompt"] for r in splits["eval"]}) == 64
    counts = Counter(q for r in splits["eval"] for q in ARITHMETIC_PROMPTS
                     if re.fullmatch(re.escape(q).replace(r"\{a\}", r"\d+").replace(r"\{b\}", r"\d+"), r["prompt"]))
    assert sorted(counts.values()) == [10, 10, 11, 11, 11, 11] and sum(counts.values()) == 64
    assert builtin_records("arithmetic", "eval") == splits["eval"]  # the same every time


def test_grpo_on_a_builtin_holds_out_its_own_eval_split(tokenizer, tmp_path):
    """--objective grpo on builtin:NAME trains on all of its training prompts and, with --eval-split > 0, holds
    out the built-in's own eval split (disjoint products, the 64 the GRPO quickstart prints), as SFT does; not a
    share of its training prompts."""
    from toolkit.data.builtin import builtin_records
    from toolkit.data.prepare import prepare_prompts

    def run(*flags):
        cfg = parse_config(["--dataset", "builtin:arithmetic", "--objective", "grpo", "--reward", "builtin:math_answer",
                            "--num-generations", "4", "--output-dir", str(tmp_path / "o"), *flags])
        return prepare_prompts(cfg.data_settings, tokenizer)

    train, held = builtin_records("arithmetic", "train"), builtin_records("arithmetic", "eval")
    data = run("--eval-split", "0.05")
    assert data.train.prompts == [r["prompt"] for r in train] and data.eval.prompts == [r["prompt"] for r in held]
    assert data.eval.columns["answer"] == [r["answer"] for r in held] and data.stats.examples == len(train)
    assert not set(data.train.prompts) & set(data.eval.prompts)
    assert run().train.prompts == data.train.prompts and not run().eval  # no --eval-split: no eval


def _jsonl(path, rows):
    import json

    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _cfg(tmp_path, data, *flags):
    return parse_config(["--dataset", str(data), "--output-dir", str(tmp_path / "o"), *flags])


def _settings(tmp_path, data, *flags):
    """What the data package reads of that run."""
    return _cfg(tmp_path, data, *flags).data_settings


def test_column_mapping_reads_your_own_names(tmp_path):
    data = _jsonl(tmp_path / "qa.jsonl", [{"prompt": "Say hi", "response": "hi"},
                                          {"prompt": "Say no", "response": "no"}])
    with pytest.raises(UserError, match="cannot tell the format .* name yours with --columns"):
        load_examples(_settings(tmp_path, data))
    ex = load_examples(_settings(tmp_path, data, "--columns", "instruction=prompt,output=response"))
    assert ex.format == "alpaca"
    assert ex.train[0] == [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "hi"}]
    with pytest.raises(UserError, match="has no column 'respons' \\(did you mean 'response'\\?\\); "
                                        "its columns are prompt, response"):
        load_examples(_settings(tmp_path, data, "--columns", "instruction=prompt,output=respons"))


def test_column_mapping_refuses_to_shadow_a_column_and_allows_a_swap(tmp_path):
    data = _jsonl(tmp_path / "a.jsonl", [{"instruction": "question?", "output": "answer", "prompt": "other"}])
    with pytest.raises(UserError, match="already has a column 'instruction'"):
        load_examples(_settings(tmp_path, data, "--columns", "instruction=prompt"))
    swapped = load_examples(_settings(tmp_path, data, "--columns", "instruction=output,output=instruction"))
    assert swapped.train[0] == [{"role": "user", "content": "answer"}, {"role": "assistant", "content": "question?"}]


def test_system_prompt_goes_where_there_is_none(tmp_path, tokenizer):
    data = _jsonl(tmp_path / "s.jsonl", [
        {"conversations": [{"from": "human", "value": "the quick fox"}, {"from": "gpt", "value": "lazy dog"}]},
        {"conversations": [{"from": "system", "value": "be brief"}, {"from": "human", "value": "seven wizards"},
                           {"from": "gpt", "value": "purple dragons"}]}])
    cfg = _cfg(tmp_path, data, "--system-prompt", "cold northern skies")
    ex = load_examples(cfg.data_settings)
    assert ex.system_added == 1
    assert ex.train[0][0] == {"role": "system", "content": "cold northern skies"}
    assert ([m["role"] for m in ex.train[1]] == ["system", "user", "assistant"]
            and ex.train[1][0]["content"] == "be brief")
    rows, _ = tokenize_examples(ex.train, tokenizer, cfg.data_settings)
    assert "cold northern skies" in tokenizer.decode(rows[0]["input_ids"])  # in the prompt ...
    enc = [i for i, label in zip(rows[0]["input_ids"], rows[0]["labels"]) if label != IGNORE_INDEX]
    assert "cold northern" not in tokenizer.decode(enc)  # ... and not trained on
    text = _jsonl(tmp_path / "t.jsonl", [{"text": "a plain document"}])
    with pytest.raises(UserError, match="--system-prompt applies to conversations"):
        load_examples(_settings(tmp_path, text, "--system-prompt", "x"))


def test_mixture_draws_each_source_by_its_weight():
    """Over the first 10k draws each source's share is within 2% of its weight; the draw follows
    the seed; every source is used whole ("all_exhausted": smaller ones are cycled, none cut short)."""
    from toolkit.data.mixture import mixture_order

    weights = [0.5, 0.3, 0.2]
    order = mixture_order([10000, 6000, 500], weights, seed=7)
    share = Counter(s for s, _ in order[:10000])
    for s, w in enumerate(weights):
        assert abs(share[s] / 10000 - w) <= 0.02, (s, share)
    for s, n in enumerate([10000, 6000, 500]):
        assert {i for src, i in order if src == s} == set(range(n))
    assert order[:50] == mixture_order([10000, 6000, 500], weights, seed=7)[:50]
    assert order[:50] != mixture_order([10000, 6000, 500], weights, seed=8)[:50]


def test_mixture_reads_each_source_in_its_own_format(data_files, tmp_path):
    """alpaca (.json) + ShareGPT (.jsonl) + text: each detected on its own columns, each source's
    --eval-split held out before drawing, every training example one of its source's records."""
    spec = f"{data_files['alpaca']}:0.5,{data_files['sharegpt']}:0.3,{data_files['text']}:0.2"
    ex = load_examples(_settings(tmp_path, spec, "--eval-split", "0.25"))
    assert ex.format == "alpaca+sharegpt+text"
    assert [(f, n) for _, f, _, n in ex.sources] == [("alpaca", 24), ("sharegpt", 24), ("text", 24)]
    assert len(ex.eval) == 3 * 8 and not any(c in ex.eval for c in ex.train)
    alone = {k: load_examples(_settings(tmp_path, data_files[k])).train for k in ("alpaca", "sharegpt", "text")}
    assert all(any(c in alone[k] for k in alone) for c in ex.train)
    kinds = Counter("text" if isinstance(c, str) else "chat" for c in ex.train)
    assert kinds["text"] > 0 and kinds["chat"] > 0


@pytest.mark.parametrize("spec, message", [
    ("{a}:0.7,{b}", "give a weight to every source or to none"),
    ("{a}:0.7,{b}:0", "weights must be > 0 (got 0)"),
    ("{a}:0.7,{missing}:0.3", "missing.jsonl: file not found"),
])
def test_bad_mixture_is_one_clear_error(data_files, tmp_path, spec, message):
    spec = spec.format(a=data_files["alpaca"], b=data_files["chat"], missing=tmp_path / "missing.jsonl")
    with pytest.raises(UserError, match=re.escape(message)):
        _cfg(tmp_path, spec)


@pytest.mark.parametrize("fmt", ["alpaca", "chat", "sharegpt", "text"])
def test_table_tokens_equal_encode_on_every_format(fmt, tokenizer, tmp_path, monkeypatch):
    """The cached Arrow table holds exactly what `encode` gives each example (multi-turn chats
    included: every assistant turn trained), in order; statistics from its columns; a second call
    reads the cache file (same rows) and 2 tokenizing processes give the same table."""
    from toolkit.data.table import tokenized_table

    monkeypatch.setenv("TOOLKIT_CACHE", str(tmp_path / "cache"))
    records = make_records(fmt, n=40)
    convs = [to_conversation(r, fmt, i) for i, r in enumerate(records)]
    cfg = parse_config(["--output-dir", str(tmp_path / "o"), "--seq-len", "48"])
    rows, stats = tokenize_examples(convs, tokenizer, cfg.data_settings)
    want = [encode(tokenizer, c, 48, False) for c in convs]
    kept = [w for w in want if any(x != IGNORE_INDEX for x in w.labels[1:])]
    assert [(r["input_ids"], r["labels"]) for r in rows] == [(w.input_ids, w.labels) for w in kept]
    assert (stats.examples, stats.truncated, stats.dropped) == (40, sum(w.truncated for w in want), 40 - len(kept))
    assert stats.tokens == sum(len(w.input_ids) for w in kept)
    assert rows[3] == {"input_ids": kept[3].input_ids, "labels": kept[3].labels} and len(rows[1:5]) == 4
    assert len([p for p in (tmp_path / "cache" / "data").iterdir() if p.is_dir()]) == 1
    again, cached = tokenize_examples(convs, tokenizer, cfg.data_settings)
    assert list(again) == list(rows) and cached.cached and not stats.cached
    two, hit = tokenized_table(convs * 30, tokenizer, 48, False, tmp_path / "two", workers=2)
    assert not hit and two.column("input_ids").to_pylist()[:40] == [w.input_ids for w in want] and two.num_rows == 1200


def test_no_examples_tokenize_to_no_rows(tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("TOOLKIT_CACHE", str(tmp_path / "cache"))
    settings = parse_config(["--output-dir", str(tmp_path / "o")]).data_settings
    rows, stats = tokenize_examples([], tokenizer, settings, what="eval")
    assert len(rows) == 0 and stats.examples == 0


def _per_example(cfg, tokenizer):
    """Today's path, one example at a time: load_examples' conversations through `encode`."""
    ex = load_examples(cfg.data_settings)

    def rows(convs):
        encs = [encode(tokenizer, c, cfg.data.seq_len, cfg.data.train_on_prompt) for c in convs]
        return [(e.input_ids, e.labels) for e in encs if any(x != IGNORE_INDEX for x in e.labels[1:])]

    return ex, rows(ex.train), rows(ex.eval)


@pytest.mark.parametrize("case", ["alpaca", "chat", "sharegpt", "text", "mixture"])
def test_prepared_data_equals_the_per_example_path(case, tokenizer, tmp_path, monkeypatch):
    """`prepare_data` (records rendered and tokenized inside `Dataset.map`, 2 worker processes,
    eval split and mixture drawn by index) gives exactly today's rows: load_examples' conversations
    tokenized one by one (multi-turn chats, --system-prompt and truncation included).
    A second call reads the cache without opening the dataset."""
    import toolkit.data.formats as formats
    from toolkit.data.prepare import prepare_data

    monkeypatch.setenv("TOOLKIT_CACHE", str(tmp_path / "cache"))
    files = {}
    for fmt in ("alpaca", "chat", "sharegpt", "text"):
        files[fmt] = _jsonl(tmp_path / f"{fmt}.jsonl", make_records(fmt, n=1100 if fmt == case else 300, seed=3))
    spec = f"{files['alpaca']}:0.5,{files['sharegpt']}:0.3,{files['text']}:0.2" if case == "mixture" else files[case]
    flags = ["--seq-len", "72", "--eval-split", "0.1", "--data-workers", "2"]
    flags += ["--system-prompt", "be brief"] if case in ("alpaca", "chat") else []
    cfg = _cfg(tmp_path, spec, *flags)
    ex, want_train, want_eval = _per_example(cfg, tokenizer)
    got = prepare_data(cfg.data_settings, tokenizer)
    assert [(r["input_ids"], r["labels"]) for r in got.train] == want_train
    assert [(r["input_ids"], r["labels"]) for r in got.eval] == want_eval
    assert (got.format, got.system_added, got.sources) == (ex.format, ex.system_added, ex.sources)
    assert not got.stats.cached and got.stats.examples == len(ex.train)
    assert list(got.train.lengths) == [len(ids) for ids, _ in want_train]
    if case == "chat":
        assert got.stats.truncated > 0  # and both paths cut them the same way (above)

    def unread(*a, **k):
        raise AssertionError("a warm run read the dataset")

    monkeypatch.setattr(formats, "load_records", unread)
    again = prepare_data(cfg.data_settings, tokenizer)
    assert again.stats.cached and [r["input_ids"] for r in again.train] == [ids for ids, _ in want_train]


def test_bad_record_in_a_worker_is_one_line_naming_its_index(tokenizer, tmp_path, monkeypatch):
    from toolkit.data.prepare import prepare_data

    monkeypatch.setenv("TOOLKIT_CACHE", str(tmp_path / "cache"))
    records = make_records("chat", n=1100)
    records[1057] = {"messages": [{"role": "user", "content": "no answer here"}]}
    cfg = _cfg(tmp_path, _jsonl(tmp_path / "bad.jsonl", records), "--data-workers", "2")
    with pytest.raises(UserError, match=r"bad.jsonl: record 1058 \(line 1058\) has no assistant turn"):
        prepare_data(cfg.data_settings, tokenizer)
    assert not [p for p in (tmp_path / "cache" / "data").iterdir() if p.is_dir()]  # nothing half-built is kept


def test_rows_read_the_mapped_table_as_pyarrow_does_across_chunks_and_slices():
    """`Rows` reads list columns through numpy views of Arrow's buffers (not pyarrow's to_numpy, which
    imports pandas): the same rows as pyarrow's own `to_pylist`, over several chunks and sliced ones."""
    import numpy as np
    import pyarrow as pa

    from toolkit.data.table import Rows, column, table_stats

    def part(seed, n):
        rng = np.random.default_rng(seed)
        ids = [rng.integers(0, 100, rng.integers(1, 9)).tolist() for _ in range(n)]
        return pa.table({"input_ids": pa.array(ids, pa.list_(pa.int32())),
                         "labels": pa.array([[-100] + x[1:] for x in ids], pa.list_(pa.int32())),
                         "length": pa.array([len(x) for x in ids], pa.int32()),
                         "targets": pa.array([len(x) - 1 for x in ids], pa.int32()),
                         "truncated": pa.array([i % 3 == 0 for i in range(n)])})

    table = pa.concat_tables([part(0, 7), part(1, 12).slice(3, 6), part(2, 5)])
    assert table.column("input_ids").num_chunks == 3
    want = table.to_pylist()
    keep = np.array([0, 2, 8, 9, 17])
    for rows, idx in ((Rows(table), range(len(want))), (Rows(table, keep), keep)):
        assert [dict(r) for r in rows] == [{"input_ids": want[i]["input_ids"], "labels": want[i]["labels"]}
                                           for i in idx]
        assert rows[-1] == rows[len(rows) - 1] and list(rows.lengths) == [want[i]["length"] for i in idx]
    assert column(table, "truncated").tolist() == [int(r["truncated"]) for r in want]
    stats, kept = table_stats(table)
    assert stats.examples == 18 and stats.tokens == sum(r["length"] for r in want if r["targets"] > 0)
    assert kept is None or list(kept) == [i for i, r in enumerate(want) if r["targets"] > 0]


# --- preference data: empty completions, the data line, record numbers (issue 57)
def _pair_data(tmp_path, monkeypatch, rows, *flags):
    """(prepare_data's result, its data lines) for preference records under --objective dpo (or `flags`')."""
    from toolkit.data.prepare import prepare_data
    from toolkit.train.output import report_data

    monkeypatch.setenv("TOOLKIT_CACHE", str(tmp_path / "cache"))
    tok = build_tokenizer(CHATML)
    cfg = _cfg(tmp_path, _jsonl(tmp_path / "pairs.jsonl", rows), "--seq-len", "64", *(flags or ("--objective", "dpo")))
    data = prepare_data(cfg.data_settings, tok)
    said = []
    report_data(said.append, cfg.data, cfg.train, cfg.model.chat_template, data, False)
    return data, said


def test_empty_chosen_or_rejected_is_dropped_and_counted_and_nothing_left_is_one_error(tmp_path, monkeypatch):
    """An empty or whitespace-only side would train its end-of-turn token alone as the answer: the pair
    is dropped and counted in its own line; the data line says what its token counts are; a file with
    no pair left is one error naming the file, before any model loads (prepare_data runs first)."""
    rows = [{"prompt": f"Name colour {i}.", "chosen": "Blue.", "rejected": "Loud."} for i in range(5)]
    rows[1]["chosen"], rows[3]["rejected"] = "", " \n\t"
    data, said = _pair_data(tmp_path, monkeypatch, rows)
    assert len(data.train) == 3 and (data.stats.examples, data.stats.dropped, data.stats.empty) == (5, 2, 2)
    assert "data: 2 more pair(s) dropped, not counted above: an empty or whitespace-only 'chosen' or 'rejected'" in said
    assert not any("truncation" in line for line in said)
    line = said[0]
    assert "3 training pairs, 0 eval;" in line and f"{data.stats.tokens} tokens (prompt + chosen and prompt + " \
        f"rejected), {data.stats.target_tokens} completion tokens on the shorter side (per pair" in line, line
    for row in rows:
        row["chosen"] = " "
    (tmp_path / "all").mkdir()
    with pytest.raises(UserError, match=r"pairs.jsonl: no training pair is left: 5 of 5 have an empty or "
                                        r"whitespace-only 'chosen' or 'rejected'; fill in"):
        _pair_data(tmp_path / "all", monkeypatch, rows)


def test_kto_drops_an_empty_completion_and_never_takes_it_as_a_kl_partner(tmp_path, monkeypatch):
    rows = [{"prompt": f"Q{i}?", "completion": f"A{i}.", "label": i % 2 == 0} for i in range(4)]
    rows[1]["completion"] = ""
    tok = build_tokenizer(CHATML)
    data, said = _pair_data(tmp_path, monkeypatch, rows, "--objective", "kto")
    assert len(data.train) == 3 and data.stats.empty == 1
    assert "data: 1 more example(s) dropped, not counted above: an empty or whitespace-only completion" in said
    partners = [tok.decode([t for t in r["kl_labels"] if t != IGNORE_INDEX]) for r in data.train]
    assert partners == ["A3.<|im_end|>", "A0.<|im_end|>", "A2.<|im_end|>"]  # A1 (empty) passed over


def test_record_numbers_count_from_1_as_lines_do(tmp_path, monkeypatch):
    """`rejected: null` in the second record of a file with a blank line before it: record 2, line 3 (it
    said record 1: 0-based records beside 1-based lines)."""
    import json

    from toolkit.data.formats import _check_json_file
    from toolkit.data.prepare import prepare_data

    monkeypatch.setenv("TOOLKIT_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "pairs.jsonl"
    good = {"prompt": "Name a colour.", "chosen": "Blue.", "rejected": "Loud."}
    path.write_text(json.dumps(good) + "\n\n" + json.dumps({**good, "rejected": None}) + "\n")
    with pytest.raises(UserError, match=r"pairs.jsonl: record 2 \(line 3\): 'rejected' must be a string"):
        prepare_data(_settings(tmp_path, path, "--objective", "dpo"), build_tokenizer(CHATML))
    (tmp_path / "a.json").write_text(json.dumps([good, [1]]))
    with pytest.raises(UserError, match=r"a.json: record 2 is a list"):
        _check_json_file(tmp_path / "a.json")
    with pytest.raises(UserError, match="^record 4: unknown ShareGPT speaker"):
        to_conversation({"conversations": [{"from": "robot", "value": "a"}]}, "sharegpt", 3)


def test_loss_png_shows_a_reward_accuracy_of_1(tmp_path, monkeypatch):
    """The accuracy axis reaches past 1.0, so a line at 1.0 is drawn whole, and 1.0 is a tick (it
    stopped at 1.0: the line ran along the frame, half cut off)."""
    from matplotlib.figure import Figure

    from toolkit.train.metrics import plot_loss

    drawn = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: drawn.append(fig))
    plot_loss([{"step": s, "loss": 0.5, "rewards/accuracies": 1.0} for s in (1, 2, 3)], tmp_path / "loss.png")
    right = drawn[0].axes[1]
    low, high = right.get_ylim()
    assert low == 0 and 1.0 < high <= 1.1 and 1.0 in list(right.get_yticks())


# --- what a newcomer hit (issue 64): empty answers, other key names, an eval file, errors before the model
def _data_lines(tmp_path, monkeypatch, rows, *flags, tok=None):
    """(prepare_data's result, its data lines) for SFT records (`flags` added)."""
    from toolkit.data.prepare import prepare_data
    from toolkit.train.output import report_data

    monkeypatch.setenv("TOOLKIT_CACHE", str(tmp_path / "cache"))
    tmp_path.mkdir(exist_ok=True)
    cfg = _cfg(tmp_path, _jsonl(tmp_path / "sft.jsonl", rows), "--seq-len", "256", *flags)
    data = prepare_data(cfg.data_settings, tok or build_tokenizer(CHATML))
    said = []
    report_data(said.append, cfg.data, cfg.train, cfg.model.chat_template, data, False)
    return data, said


def test_empty_answers_are_dropped_and_counted_and_a_file_of_them_is_one_error(tmp_path, monkeypatch):
    """`output: ""` trained the end-of-turn token alone (and that the user turn's: "" is found anywhere), 50 of
    50 records trained and no line said so. Now: a record whose answers are all empty is dropped and counted
    in the data line, under --train-on-prompt too; an empty turn among others is left untrained and counted; a
    file left with none is one error naming it, before the model loads (prepare_data runs first)."""
    tok = build_tokenizer(CHATML)
    chat = [{"role": "user", "content": "first question"}, {"role": "assistant", "content": "  "},
            {"role": "user", "content": "second question"}, {"role": "assistant", "content": "second answer"}]
    rows = [{"messages": [{"role": "user", "content": f"question {i}"},
                          {"role": "assistant", "content": f"answer {i}"}]}
            for i in range(4)]
    rows += [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}]},
             {"messages": chat}]
    data, said = _data_lines(tmp_path, monkeypatch, rows, tok=tok)
    assert (data.stats.examples, data.stats.dropped, data.stats.empty, data.stats.blank_turns) == (6, 1, 1, 1)
    assert len(data.train) == 5 and "5 training examples" in said[0]
    assert "data: 1 more example(s) dropped, not counted above: an empty or whitespace-only answer" in said
    assert "data: 1 empty or whitespace-only assistant turn(s) left untrained in the conversations kept (their " \
           "other answers train)" in said
    trained = [tok.decode([t for t in r["labels"] if t != IGNORE_INDEX]) for r in data.train]
    assert trained[-1] == "second answer<|im_end|>"  # the empty turn's end-of-turn (or its user's) untrained
    whole, said = _data_lines(tmp_path / "p", monkeypatch, rows, "--train-on-prompt", tok=tok)
    assert (whole.stats.dropped, whole.stats.empty, len(whole.train)) == (1, 1, 5)  # an empty answer still teaches one
    alpaca = [{"instruction": f"q{i}", "output": "" if i % 2 else f"a{i}"} for i in range(50)]
    data, said = _data_lines(tmp_path / "a", monkeypatch, alpaca, tok=tok)
    assert len(data.train) == 25 and "data: 25 more example(s) dropped, not counted above: an empty or " \
                                      "whitespace-only answer" in said
    for row in alpaca:
        row["output"] = " \n"
    with pytest.raises(UserError, match=r"sft.jsonl: no training example is left: 50 of 50 have an empty or "
                                        r"whitespace-only answer; fill in"):
        _data_lines(tmp_path / "e", monkeypatch, alpaca, tok=tok)


def test_your_turn_keys_and_speakers_map_as_llama_factorys_tags_do(tmp_path):
    """ShareGPT with other key names, a dialogue with its own speakers, chat messages alike: `role=`,
    `content=` name a turn's keys, `user_role=` ... its speakers (LLaMA-Factory's role_tag, content_tag,
    user_tag ...); without them the hint names the mapping this file needs."""
    turns = _jsonl(tmp_path / "turns.jsonl", [{"turns": [{"speaker": "human", "text": "hi"},
                                                         {"speaker": "gpt", "text": "hello"}]}])
    with pytest.raises(UserError, match=r"name yours with --columns, e.g. --columns conversations=turns,role=speaker,"
                                        r"content=text$"):
        load_examples(_settings(tmp_path, turns))
    ex = load_examples(_settings(tmp_path, turns, "--columns", "conversations=turns,role=speaker,content=text"))
    assert ex.format == "sharegpt" and ex.train == [[{"role": "user", "content": "hi"},
                                                     {"role": "assistant", "content": "hello"}]]
    dialog = _jsonl(tmp_path / "dialog.jsonl", [{"dialog": [{"who": "customer", "says": "late"},
                                                            {"who": "agent", "says": "sorry"}]}])
    with pytest.raises(UserError, match="e.g. --columns conversations=dialog,role=who,content=says,user_role=customer,"
                                        "assistant_role=agent"):
        load_examples(_settings(tmp_path, dialog))
    with pytest.raises(UserError, match=r"record 1 \(line 1\): 'conversations' must be a list of \{from, value\} "
                                        r"objects \(its turns' keys are who, says: map them with --columns role=who,"
                                        r"content=says\)"):
        load_examples(_settings(tmp_path, dialog, "--columns", "conversations=dialog"))
    with pytest.raises(UserError, match="unknown ShareGPT speaker 'customer' .* user_role=customer"):
        load_examples(_settings(tmp_path, dialog, "--columns", "conversations=dialog,role=who,content=says"))
    mapped = "conversations=dialog,role=who,content=says,user_role=customer,assistant_role=agent"
    assert load_examples(_settings(tmp_path, dialog, "--columns", mapped)).train == [
        [{"role": "user", "content": "late"}, {"role": "assistant", "content": "sorry"}]]
    chat = _jsonl(tmp_path / "chat.jsonl", [{"messages": [{"who": "customer", "says": "late"},
                                                          {"who": "agent", "says": "sorry"}]}])
    mapped = "role=who,content=says,user_role=customer,assistant_role=agent"
    assert load_examples(_settings(tmp_path, chat, "--columns", mapped)).train == [
        [{"role": "user", "content": "late"}, {"role": "assistant", "content": "sorry"}]]
    with pytest.raises(UserError, match=r"--columns role=who: --dataset .*qa.jsonl was read as alpaca, which does not "
                                        r"read 'role' \(its records hold no turns\); alpaca reads instruction, output, "
                                        r"input, system"):
        load_examples(_settings(tmp_path, _jsonl(tmp_path / "qa.jsonl", [{"instruction": "q", "output": "a"}]),
                                "--columns", "role=who"))


def test_a_name_that_does_not_fit_gets_a_hint_that_does_the_same_job():
    """'completion' was "not a field the formats read (did you mean 'conversations'?)": KTO's completion and
    label are fields now, and a hint names only a field doing the same job ('from' offered 'prompt')."""
    from toolkit.config.columns import column_problems

    assert column_problems("completion=response,label=ok,role=speaker,content=text,user_role=customer") == []
    (from_,) = column_problems("from=speaker")
    assert "'from' is not a field the formats read (did you mean 'role'?)" in from_
    assert "(did you mean 'input'?)" in column_problems("context=ctx")[0]  # not 'content'
    assert "(did you mean 'output'?)" in column_problems("response=r")[0]
    assert "did you mean" not in column_problems("target_text=t")[0]  # not 'text': nothing that does its job


def test_kto_reads_your_completion_and_label_columns(tmp_path, monkeypatch):
    rows = [{"question": f"Q{i}?", "reply": f"A{i}.", "ok": i % 2 == 0} for i in range(4)]
    data, said = _pair_data(tmp_path, monkeypatch, rows, "--objective", "kto", "--columns",
                            "prompt=question,completion=reply,label=ok")
    assert len(data.train) == 4 and data.train.desirable() == [True, False, True, False]


def test_each_mixture_source_maps_its_own_columns(data_files, tmp_path):
    """One --columns applied to every source, so a source that needed a mapping made the others fail: each
    source's own columns follow it (';' between them), in YAML a list of {path, weight, columns}."""
    qa = _jsonl(tmp_path / "qa.jsonl", [{"q": f"question {i}", "a": f"answer {i}"} for i in range(8)])
    spec = f"{qa}:0.5:instruction=q;output=a,{data_files['sharegpt']}:0.5"
    with pytest.raises(UserError, match="sharegpt.jsonl has no column 'q'"):
        load_examples(_settings(tmp_path, f"{qa}:0.5,{data_files['sharegpt']}:0.5", "--columns",
                                "instruction=q,output=a"))
    ex = load_examples(_settings(tmp_path, spec))
    assert [(f, n) for _, f, _, n in ex.sources] == [("alpaca", 8), ("sharegpt", 32)]
    assert [{"role": "user", "content": "question 0"}, {"role": "assistant", "content": "answer 0"}] in ex.train
    yaml = tmp_path / "run.yaml"
    yaml.write_text(f"dataset:\n  - {{path: {qa}, weight: 0.5, columns: {{instruction: q, output: a}}}}\n"
                    f"  - {{path: {data_files['sharegpt']}, weight: 0.5}}\noutput_dir: {tmp_path / 'o'}\n")
    assert parse_config(["--config", str(yaml)]).data.dataset == spec
    with pytest.raises(UserError, match="'output=a' reads as a source of its own; "
                                        "separate a source's columns with ';'"):
        _cfg(tmp_path, f"{qa}:0.5:instruction=q,output=a,{data_files['sharegpt']}:0.5")
    with pytest.raises(UserError, match="--columns text=body applies to no source"):
        _cfg(tmp_path, f"{spec}:conversations=conversations", "--columns", "text=body")


def test_eval_dataset_is_its_own_file_detected_mapped_and_cached_on_its_own(data_files, tmp_path, monkeypatch):
    """--eval-dataset: held-out rows from a file read as --dataset is (its own format, its own columns), the
    rows tokenizing it would give, in a cache entry of its own (a new eval file leaves the training table
    as it was); with --eval-split one line; a missing file one line before anything loads."""
    from toolkit.data.prepare import prepare_data

    monkeypatch.setenv("TOOLKIT_CACHE", str(tmp_path / "cache"))
    tok = build_tokenizer(CHATML)
    held = _jsonl(tmp_path / "held.jsonl", [{"q": f"held question {i}", "a": f"held answer {i}"} for i in range(5)])
    cfg = _cfg(tmp_path, data_files["chat"], "--seq-len", "64", "--eval-dataset", f"{held}:instruction=q;output=a")
    data = prepare_data(cfg.data_settings, tok)
    want = [encode(tok, [{"role": "user", "content": f"held question {i}"},
                         {"role": "assistant", "content": f"held answer {i}"}], 64, False) for i in range(5)]
    assert [(r["input_ids"], r["labels"]) for r in data.eval] == [(w.input_ids, w.labels) for w in want]
    assert (data.format, data.eval_format, len(data.train)) == ("chat", "alpaca", 32)
    other = _jsonl(tmp_path / "other.jsonl", make_records("text", 3))
    again = prepare_data(_settings(tmp_path, data_files["chat"], "--seq-len", "64", "--eval-dataset", str(other)), tok)
    assert again.stats.cached and not again.eval_stats.cached and again.eval_format == "text" and len(again.eval) == 3
    with pytest.raises(UserError, match="--eval-dataset and --eval-split 0.1 both give the held-out data; drop one"):
        _cfg(tmp_path, data_files["chat"], "--eval-dataset", str(held), "--eval-split", "0.1")
    with pytest.raises(UserError, match="--eval-dataset .*nope.jsonl: file not found"):
        _cfg(tmp_path, data_files["chat"], "--eval-dataset", str(tmp_path / "nope.jsonl"))
    assert _cfg(tmp_path, data_files["chat"], "--eval-dataset", str(held), "--eval-on-start").output.eval_on_start
    pairs = _jsonl(tmp_path / "pairs.jsonl", [{"prompt": "Name a colour.", "chosen": "Blue.", "rejected": "Loud."}] * 3)
    good = _jsonl(tmp_path / "good.jsonl", [{"question": "Name a shape.", "good": "Round.", "bad": "Sad."}] * 2)
    dpo = prepare_data(_settings(tmp_path, pairs, "--objective", "dpo", "--eval-dataset",
                                 f"{good}:prompt=question;chosen=good;rejected=bad"), tok)
    assert len(dpo.eval) == 2 and dpo.eval_format == "pairs" and "rejected_input_ids" in dpo.eval[0]  # pairs to score


def test_a_resume_may_change_the_eval_file_but_not_the_training_data(data_files, tmp_path):
    from toolkit.train.resume import fingerprint

    one = _cfg(tmp_path, data_files["chat"], "--eval-dataset", str(data_files["alpaca"])).flat()
    other = _cfg(tmp_path, data_files["chat"], "--eval-dataset", str(data_files["text"])).flat()
    assert fingerprint(one, 1) == fingerprint(other, 1) == fingerprint(_cfg(tmp_path, data_files["chat"]).flat(), 1)
    assert fingerprint(one, 1) != fingerprint(_cfg(tmp_path, data_files["chat"], "--eval-split", "0.1").flat(), 1)


@pytest.mark.parametrize("case", ["no_format", "mapped_missing", "turn_keys", "speaker", "all_empty",
                                  "own_columns_all_empty", "empty_object", "kto_columns"])
def test_the_early_check_says_what_the_full_read_says(case, tmp_path, monkeypatch):
    """`toolkit.data.peek` reads the columns (and a small JSON file whole) before torch loads, and says
    exactly what reading the file with datasets says later, word for word."""
    from toolkit.data.peek import check_data
    from toolkit.data.prepare import prepare_data

    monkeypatch.setenv("TOOLKIT_CACHE", str(tmp_path / "cache"))
    dialog = [{"dialog": [{"who": "customer", "says": f"late {i}"}, {"who": "agent", "says": "sorry"}]}
              for i in range(3)]
    rows, flags = {
        "no_format": ([{"question": "q", "answer": "a"}], []),
        "mapped_missing": ([{"prompt": "q", "response": "a"}], ["--columns", "instruction=prompt,output=reply"]),
        "turn_keys": (dialog, ["--columns", "conversations=dialog"]),
        "speaker": (dialog, ["--columns", "conversations=dialog,role=who,content=says,user_role=customer"]),
        "all_empty": ([{"instruction": f"q{i}", "output": " "} for i in range(3)], []),
        "own_columns_all_empty": ([{"instruction": "q", "reply": ""}], []),
        "empty_object": ([{}], []),
        "kto_columns": ([{"prompt": "q", "reply": "a", "ok": True}],
                        ["--objective", "kto", "--columns", "completion=reply"]),
    }[case]
    spec = f"{_jsonl(tmp_path / 'd.jsonl', rows)}" + (":output=reply" if case.startswith("own") else "")
    cfg = _cfg(tmp_path, spec, *flags)
    with pytest.raises(UserError) as early:
        check_data(cfg.data_settings)
    with pytest.raises(UserError) as full:
        prepare_data(cfg.data_settings, build_tokenizer(CHATML))
    assert str(early.value) == str(full.value)
