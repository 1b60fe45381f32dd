"""`--streaming` (toolkit/data/stream.py): records read and tokenized as training goes, sharded over
data-parallel ranks; the same losses as the map-style run where the orders are defined to match,
exact resume after SIGKILL, packing within each micro-batch.

The map-style run draws its examples in epoch 0's `torch.randperm(N, seed)` order; the stream reads
the file in order. Writing the records in the sampler's order makes the two runs see the same
examples at every step (no example is dropped at this --seq-len: the map-style run would drop
examples left with no answer token; the stream keeps them, untrained). Tolerance 1e-5 (2 ranks,
fp32: the same sums in another order).
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_records
from distributed import launch, run_once
from helpers import build_tokenizer, losses

SEED, N = 7, 64
STEPS = 5  # x global batch 8 = 40 of the 64 records: within epoch 0


def args(model, data, out, *extra) -> list[str]:
    return ["--model", str(model), "--dataset", str(data), "--output-dir", str(out), "--method", "full",
            "--seq-len", "128", "--max-steps", str(STEPS), "--log-every", "1", "--lr", "1e-3", "--warmup-steps", "0",
            "--lr-schedule", "linear", "--mixed-precision", "no", "--seed", str(SEED), "--micro-batch-size", "2",
            "--grad-accum", "2", "--save-every", "2", *extra]


def weights(out) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(out / "final" / "model.safetensors")


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict:
    """The records as written, and the same records in the order the map-style sampler draws them."""
    d = tmp_path_factory.mktemp("stream_data")
    rows = make_records("alpaca", N, seed=5)
    order = torch.randperm(N, generator=torch.Generator().manual_seed(SEED)).tolist()  # EpochShuffleSampler, epoch 0
    written = {}
    for name, recs in (("shuffled", rows), ("in_sampler_order", [rows[i] for i in order])):
        written[name] = d / f"{name}.jsonl"
        written[name].write_text("".join(json.dumps(r) + "\n" for r in recs))
    return written


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model, files):
    once = run_once(tmp_path_factory)

    def get(kind: str):
        data, extra = {"map": (files["shuffled"], ()),
                       "stream": (files["in_sampler_order"], ("--streaming",))}[kind]
        return once((kind,), lambda out: args(tiny_model, data, out, *extra), 2)

    return get


def test_streamed_run_matches_the_map_style_run_over_the_same_order(runs):
    ref, streamed = runs("map"), runs("stream")
    assert "dropped" not in (ref / "stdout.txt").read_text()  # else the two orders would differ
    assert "streamed in file order" in (streamed / "stdout.txt").read_text()
    assert len(losses(streamed)) == STEPS
    assert losses(streamed) == pytest.approx(losses(ref), abs=1e-5, rel=1e-5)
    got, want = weights(streamed), weights(ref)
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=1e-5, rtol=1e-5)


def test_streamed_run_resumes_exactly_after_sigkill(tmp_path, tiny_model, files, runs):
    """Killed on rank 1 after step 3 (checkpoint-2 on disk): the resumed run skips 2 x 8 records of
    the stream and continues with the same losses and final weights as the uninterrupted run."""
    out = tmp_path / "out"
    p = launch(args(tiny_model, files["in_sampler_order"], out, "--streaming"), nproc=2,
               env={"TOOLKIT_FAULT": "step:3:rank=1"})
    assert p.returncode != 0
    p = launch(args(tiny_model, files["in_sampler_order"], out, "--streaming", "--resume", "auto"), nproc=2)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "checkpoint-2: continuing at step 3" in p.stdout
    ref = runs("stream")
    assert losses(out) == pytest.approx(losses(ref), abs=1e-6, rel=1e-6)
    got, want = weights(out), weights(ref)
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=1e-6, rtol=1e-6)


def test_stream_skips_wraps_and_packs_each_micro_batch(files, tmp_path):
    """`start` skips records (a resume), the stream goes on into the next epoch in the same order,
    and --packing puts a micro-batch's examples into fewer rows with the same trained tokens."""
    from toolkit.config import parse_config
    from toolkit.data.packing import count_examples
    from toolkit.data.stream import RecordStream, StreamCollate
    from toolkit.data.tokenize import ensure_chat_template

    tok = build_tokenizer()
    ensure_chat_template(tok)
    cfg = parse_config(["--dataset", str(files["in_sampler_order"]), "--streaming", "--max-steps", "1",
                        "--seq-len", "128", "--output-dir", str(tmp_path / "o")])
    stream = RecordStream(cfg.data_settings, tok)
    stream.start = N - 2
    assert [i for _, (i, _) in zip(range(4), stream)] == [N - 2, N - 1, 0, 1]
    stream.start = 0
    first = [x for _, x in zip(range(4), stream)]
    plain, packed = (StreamCollate(stream, tok.pad_token_id, False)(first),
                     StreamCollate(stream, tok.pad_token_id, True)(first))
    assert plain["input_ids"].shape[0] == 4 and packed["input_ids"].shape[0] < 4 and int(count_examples(packed)) == 4
    assert int((packed["labels"] != -100).sum()) == int((plain["labels"] != -100).sum())
    # so a streamed global batch is its records, packed or not (a map-style packed one is its packed rows)
    from toolkit.objectives.sft.objective import SFT

    streamed = parse_config(["--dataset", str(files["in_sampler_order"]), "--streaming", "--packing", "--max-steps",
                             "1", "--output-dir", str(tmp_path / "o")])
    assert SFT(streamed).batch_words(8) == "8 examples"
    assert SFT(streamed.replace(streaming=False)).batch_words(8) == "8 packed rows of <= 1024 tokens"


def test_stream_of_a_folder_without_data_files_is_one_clear_error(tmp_path):
    from toolkit.config import parse_config
    from toolkit.data.stream import RecordStream
    from toolkit.errors import UserError

    (tmp_path / "empty").mkdir()
    cfg = parse_config(["--dataset", str(tmp_path / "empty"), "--streaming", "--max-steps", "1",
                        "--output-dir", str(tmp_path / "o")])
    with pytest.raises(UserError, match="folder holds no .json/.jsonl/.csv/.parquet file"):
        RecordStream(cfg.data_settings, None)
