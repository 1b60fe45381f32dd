"""Shared fixtures: a tiny Llama (GQA) + a BPE tokenizer trained here, saved to disk and loaded
through the real `from_pretrained` path; small datasets in every supported format."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from toolkit.model.synthetic import build_model_dir, corpus  # noqa: E402

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """No chat template: exercises the toolkit's fallback template."""
    return build_model_dir(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def tiny_chatml_model(tmp_path_factory) -> Path:
    return build_model_dir(tmp_path_factory.mktemp("tinychatml") / "model", chat_template=CHATML)


def make_records(fmt: str, n: int = 32, seed: int = 0) -> list[dict]:
    texts = corpus(n * 3, seed)
    rows = []
    for i in range(n):
        q, a, b = texts[3 * i], texts[3 * i + 1], texts[3 * i + 2]
        if fmt == "alpaca":
            rows.append({"instruction": q, "input": b if i % 2 else "", "output": a})
        elif fmt == "chat":
            rows.append({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a},
                                      {"role": "user", "content": b}, {"role": "assistant", "content": q}]})
        elif fmt == "sharegpt":
            rows.append({"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]})
        elif fmt == "text":
            rows.append({"text": f"{q} {a} {b}"})
    return rows


@pytest.fixture(scope="session")
def data_files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("data")
    out = {}
    for fmt in ("alpaca", "chat", "sharegpt", "text"):
        p = d / f"{fmt}.jsonl" if fmt != "alpaca" else d / f"{fmt}.json"
        rows = make_records(fmt)
        p.write_text(json.dumps(rows) if p.suffix == ".json" else "\n".join(json.dumps(r) for r in rows) + "\n")
        out[fmt] = p
    return out


@pytest.fixture(autouse=True)
def _reset_accelerate():
    """accelerate keeps process-wide singletons; each in-process run starts from a clean state. A run's
    SIGTERM handler must not outlive it: processes forked later (datasets' map workers) inherit it."""
    import signal

    handler = signal.getsignal(signal.SIGTERM)
    yield
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()
    left = signal.getsignal(signal.SIGTERM)
    # put back first: one leak fails this test, not every later one in the process
    signal.signal(signal.SIGTERM, handler)
    assert left is handler, "a run left its SIGTERM handler installed"


# Longest first: under pytest-xdist (`--dist loadfile`, each file on one worker; `--no-loadscope-reorder`, in
# pyproject's addopts, or xdist orders the files by their count of tests instead) the files are handed out in
# collection order, so the longest ones start first and the short ones fill in. Measured 2026-11-29 (seconds
# of test time in a whole run, 2 workers): launchers 472, gpu_acceptance 431, resume 219, train 162, zoo 138,
# bad_input 137, preference 103, strategies 99, expert_parallel 88, compositions 82, reshard 81, grpo 69,
# pipeline 61, default_model 57, tensor_parallel 47, distributed 40. A file missing from this list only runs
# later; nothing else changes.
HEAVY_FIRST = ("test_launchers.py", "test_gpu_acceptance.py", "test_resume.py", "test_train.py", "test_zoo.py",
               "test_bad_input.py", "test_preference.py", "test_strategies.py", "test_expert_parallel.py",
               "test_compositions.py", "test_reshard.py", "test_grpo.py", "test_pipeline.py", "test_default_model.py",
               "test_tensor_parallel.py", "test_distributed.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(HEAVY_FIRST)))  # stable: a file's own order kept
