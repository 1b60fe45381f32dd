"""Chunked loss (`--loss chunked`) and MFU in the metrics: same numbers as the plain path, and the
FLOP count written out by hand; freed CPU tensors give their memory back to the OS."""

from __future__ import annotations

import json
import math
import os
import platform
import time

import pytest
import torch
from distributed import batched_runs, common_args, parity_args, run_stdout
from helpers import random_model, records

from toolkit.train.flops import flops_per_token, head_params, matmul_params, measure_peak_flops, step_flops
from toolkit.objectives.sft.loss import chunked_loss_sum, token_loss_sum


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("chunk", [7, 1024])
def test_chunked_loss_and_gradients_equal_full_logits(bias, chunk):
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=bias)
    hidden = torch.randn(3, 11, 16, requires_grad=True)
    labels = torch.randint(0, 50, (3, 11))
    labels[0, :4] = -100  # a masked prompt
    labels[2, :] = -100  # a row with no targets at all
    ref = token_loss_sum(head(hidden), labels)
    ref.backward()
    want = [hidden.grad.clone(), head.weight.grad.clone()] + ([head.bias.grad.clone()] if bias else [])
    hidden.grad = None
    head.zero_grad()
    got = chunked_loss_sum(hidden, head, labels, chunk=chunk)
    (2.5 * got).backward()  # the incoming gradient is applied in backward
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    have = [hidden.grad, head.weight.grad] + ([head.bias.grad] if bias else [])
    for g, w in zip(have, want):
        torch.testing.assert_close(g, 2.5 * w, atol=1e-5, rtol=1e-5)


def test_frozen_head_gets_no_gradient_and_input_still_does():
    head = torch.nn.Linear(8, 20, bias=False).requires_grad_(False)
    hidden = torch.randn(2, 5, 8, requires_grad=True)
    labels = torch.randint(0, 20, (2, 5))
    chunked_loss_sum(hidden, head, labels, chunk=3).backward()
    assert head.weight.grad is None and hidden.grad is not None and hidden.grad[:, -1].abs().sum() == 0


def test_flops_per_token_is_palm_formula(tiny_model):
    """6N + 12 L h T with N the matmul weights: untied tiny Llama = everything but the input embedding."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    n_all = sum(p.numel() for p in model.parameters())
    n = n_all - model.get_input_embeddings().weight.numel()
    assert matmul_params(model) == n
    assert flops_per_token(n, 2, 64, 30.0) == 6 * n + 12 * 2 * 64 * 30.0
    head = model.get_output_embeddings().weight.numel()
    assert head_params(model) == head
    assert step_flops(10, 10, n, head, 2, 64, 30.0) == pytest.approx(10 * flops_per_token(n, 2, 64, 30.0))
    # the chunked loss runs the head on target tokens only: 3 of the 10 here
    assert step_flops(10, 3, n, head, 2, 64, 30.0) == pytest.approx(10 * flops_per_token(n, 2, 64, 30.0) - 7 * 6 * head)


def test_peak_probe_is_positive_finite_and_warmed_up():
    t0 = time.perf_counter()
    peak = measure_peak_flops(torch.device("cpu"), torch.float32, n=256, seconds=0.05)
    assert math.isfinite(peak) and peak > 1e6
    assert time.perf_counter() - t0 >= 0.1  # warm-up and timing are time-bounded, not a fixed few calls


def test_peak_probe_leaves_the_run_s_random_stream_alone():
    """Whether the probe runs depends on a cache (and a re-probe on load): it must not draw from the
    global generator, or dropout masks, and so a resumed run's losses, would depend on it (seen: a
    resume test failed only when the suite ran beside other tests)."""
    before = torch.get_rng_state()
    measure_peak_flops(torch.device("cpu"), torch.float32, n=64, seconds=0.01)
    assert torch.equal(torch.get_rng_state(), before)


MB8, SHARDED = ["--micro-batch-size", "8"], ["--micro-batch-size", "2", "--grad-accum", "2"]
WHOLE = ["--micro-batch-size", "64", "--max-steps", "3"]  # the whole dataset in one step
# (name, method, loss) -> (ranks, flags)
RUNS = {**{("single", m, loss): (1, MB8) for m in ("full", "lora") for loss in ("full", "chunked")},
        ("whole", "full", "full"): (1, WHOLE), ("whole_packed", "full", "full"): (1, [*WHOLE, "--packing"]),
        **{(name, "full", "full"): (1, [*MB8, "--seq-len", "256", *flags])  # examples whole: lengths that differ
           for name, flags in (("free", []), ("padded", ["--no-padding-free"]))},
        ("zero3", "full", "chunked"): (2, [*SHARDED, "--zero-stage", "3"]),
        ("fsdp", "full", "chunked"): (2, [*SHARDED, "--fsdp"])}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model, data_files):
    """(name, method, loss) -> output dir: the one-process runs in one launch, the 2-rank ones in another."""
    return batched_runs(tmp_path_factory, common_args(tiny_model, data_files["chat"]),
                        {k: (ranks, ["--method", k[1], "--loss", k[2], *flags]) for k, (ranks, flags) in RUNS.items()})


@pytest.mark.parametrize("method", ["full", "lora"])
def test_chunked_loss_trains_like_full_logits(runs, method):
    ref = [r["loss"] for r in records(runs("single", method, "full"))]
    got = [r["loss"] for r in records(runs("single", method, "chunked"))]
    assert len(got) == 5 and got == pytest.approx(ref, abs=1e-5, rel=1e-5)


@pytest.mark.parametrize("name, flags", [("zero3", ["--zero-stage", "3"]), ("fsdp", ["--fsdp"])])
def test_chunked_loss_under_sharded_weights(runs, name, flags):
    """The loss runs inside the LM head's forward, where ZeRO-3/FSDP have gathered its weight."""
    ref = [r["loss"] for r in records(runs("single", "full", "full"))]
    got = [r["loss"] for r in records(runs(name, "full", "chunked"))]
    assert len(got) == 5 and got == pytest.approx(ref, rel=1e-4)


def test_zero3_run_prints_no_library_noise_and_counts_the_whole_model(runs, tiny_model):
    """Two ZeRO-3 ranks: no DeepSpeed accelerator/op-build lines, no deprecation warnings per
    collective, and the model line counts the parameters before partitioning (not 0.0M)."""
    from toolkit.model.load import human
    from toolkit.planner.params import count_params

    out = runs("zero3", "full", "chunked")
    text = run_stdout(out) + (out.parent / "stderr.txt").read_text()  # the launch's stderr: every run's
    for noise in ("Setting accelerator to CPU", "built successfully", "is deprecated", "gemm_4bit", "Warning"):
        assert noise not in text, noise
    total = count_params(json.loads((tiny_model / "config.json").read_text())).total
    assert f"({human(total)} params, {human(total)} trainable, method full)" in text


def test_datasheet_peaks_are_matched_by_device_name():
    from toolkit.hardware import datasheet_peak

    assert datasheet_peak("NVIDIA H100 80GB HBM3", "bf16")[0] == 989.5e12  # the SXM part's name
    assert datasheet_peak("NVIDIA H100 PCIe", "bf16")[0] == 756.5e12
    assert datasheet_peak("NVIDIA H100 NVL", "fp16")[0] == 835.5e12
    assert datasheet_peak("NVIDIA A100-SXM4-80GB", "fp32")[0] == 19.5e12
    assert datasheet_peak("NVIDIA A10", "bf16")[0] == 125e12 and datasheet_peak("NVIDIA L4", "bf16")[0] == 121e12
    assert datasheet_peak("Tesla V100-SXM2-16GB", "bf16") is None  # no bf16 tensor cores: measure
    assert datasheet_peak("NVIDIA A10G", "bf16") is None and datasheet_peak("cpu", "fp32") is None


def test_mfu_divides_by_the_datasheet_peak_of_a_known_device(tmp_path, tiny_model, data_files, monkeypatch):
    """With the device reported as an H100 SXM (fp32 run: 67 TFLOP/s), MFU is against the datasheet;
    the CPU probe is logged beside it."""
    import finetune

    monkeypatch.setattr("toolkit.train.flops.device_name", lambda device: "NVIDIA H100 80GB HBM3")
    out = tmp_path / "out"
    finetune.main(parity_args(tiny_model, data_files["chat"], out, "full") + ["--max-steps", "2"])
    recs = records(out, "loss")
    assert recs and all(r["peak_flops"] == 67e12 and r["peak_source"].startswith("datasheet: NVIDIA H100 SXM fp32")
                        for r in recs)
    for r in recs:
        assert 0 < r["measured_peak_flops"] < r["peak_flops"]  # this 2-core CPU is no H100
        assert r["mfu"] == pytest.approx(r["flops_per_token"] * r["tokens_per_sec"] / 67e12)


def test_mfu_above_one_comes_with_a_warning(tmp_path, tiny_model, data_files, monkeypatch, capsys):
    """A probe that read absurdly low (another job on the device) gives MFU > 1: said once, not logged
    silently. A figure cached that low is probed again first, once, and the better one kept: a quiet
    probe clears the warning and replaces the cached figure."""
    import finetune
    from toolkit.train.flops import probe_key

    figures = iter([1e3, 1e3, 1e15])  # run 1 probes; runs 2 and 3 read the cache, then probe again
    monkeypatch.setattr("toolkit.train.flops.measure_peak_flops", lambda device, dtype: next(figures))
    monkeypatch.setenv("TOOLKIT_CACHE", str(tmp_path / "cache"))
    for run, warned in (("probed", 1), ("cached_then_probed_low", 1), ("cached_then_probed_quiet", 0)):
        out = tmp_path / run
        finetune.main(parity_args(tiny_model, data_files["chat"], out, "full") + ["--max-steps", "2"])
        recs = records(out, "loss")
        assert all((r["mfu"] > 1) == bool(warned) and r["peak_source"] == "measured" for r in recs), run
        said = [ln for ln in capsys.readouterr().out.splitlines() if "> 1: the peak was measured low" in ln]
        assert len(said) == warned, run
    cached = json.loads((tmp_path / "cache" / "peaks.json").read_text())
    assert cached == {probe_key(torch.device("cpu"), torch.float32): 1e15}


def test_peak_probe_runs_once_per_device_and_a_damaged_cache_is_probed_over(tmp_path, monkeypatch):
    """The probe's figure is kept per device key; a second call reads it; a file that does not parse,
    or holds no figure for this key, is probed again and rewritten."""
    from toolkit.train.flops import cached_peak

    calls = []
    monkeypatch.setattr("toolkit.train.flops.measure_peak_flops", lambda d, t: calls.append(t) or 5e10)
    path, cpu = tmp_path / "peaks.json", torch.device("cpu")
    assert cached_peak(cpu, torch.float32, path) == (5e10, False)
    assert cached_peak(cpu, torch.float32, path) == (5e10, True) and len(calls) == 1
    assert cached_peak(cpu, torch.bfloat16, path) == (5e10, False) and len(calls) == 2  # another key
    assert len(json.loads(path.read_text())) == 2
    path.write_text("{not json")
    assert cached_peak(cpu, torch.float32, path) == (5e10, False) and len(calls) == 3
    assert cached_peak(cpu, torch.float32, path)[1]


def test_mfu_is_in_every_training_record(runs):
    recs = records(runs("single", "full", "full"), "loss")
    assert recs and all(0 < r["mfu"] < 1 and r["peak_flops"] > 0 for r in recs)
    for r in recs:
        assert r["mfu"] == pytest.approx(r["flops_per_token"] * r["tokens_per_sec"] / r["peak_flops"])



def test_mfu_counts_the_head_only_where_the_chunked_loss_runs_it(runs, tiny_model):
    """Prompt tokens skip the LM head under the chunked loss, so their head FLOPs are not credited."""
    from transformers import AutoModelForCausalLM

    head = head_params(AutoModelForCausalLM.from_pretrained(tiny_model))
    full = records(runs("single", "full", "full"), "loss")
    chunked = records(runs("single", "full", "chunked"), "loss")
    assert len(full) == len(chunked)
    for f, c in zip(full, chunked):
        assert f["flops_per_token"] - 6 * head < c["flops_per_token"] < f["flops_per_token"]


# ---------------------------------------------------------------- packing


def _rows(n=9, seed=0):
    import random

    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        k = rng.randint(5, 20)
        ids = [rng.randint(5, 300) for _ in range(k)]
        rows.append({"input_ids": ids, "labels": [-100 if j < k // 3 else t for j, t in enumerate(ids)]})
    return rows


def test_pack_rows_keeps_every_example_whole_and_restarts_positions():
    from toolkit.data.packing import pack_rows

    rows = _rows()
    packed = pack_rows(rows, 40)
    assert all(len(p["input_ids"]) <= 40 for p in packed)
    assert sum(p["examples"] for p in packed) == len(rows)
    assert len(packed) == -(-sum(len(r["input_ids"]) for r in rows) // 40)  # first-fit decreasing: no spare row here
    pieces = []
    for p in packed:
        starts = [i for i, pos in enumerate(p["position_ids"]) if pos == 0] + [len(p["input_ids"])]
        for a, b in zip(starts, starts[1:]):
            assert p["position_ids"][a:b] == list(range(b - a)) and p["labels"][a] == -100
            pieces.append(tuple(p["input_ids"][a:b]))
    assert sorted(pieces) == sorted(tuple(r["input_ids"]) for r in rows)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_batch_gives_the_unpacked_loss_and_gradients(tiny_model, attn):
    """Block-diagonal attention and restarted positions: no example sees another."""
    from transformers import AutoModelForCausalLM

    from toolkit.data import collate
    from toolkit.data.packing import collate_packed, model_inputs, pack_rows

    model = AutoModelForCausalLM.from_pretrained(tiny_model, attn_implementation=attn)
    model.config.use_cache = False
    rows = _rows()
    plain = collate(rows, 0)
    ref = token_loss_sum(model(**model_inputs(plain)).logits, plain["labels"])
    ref.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    packed = collate_packed(pack_rows(rows, 40), 0)
    assert packed["input_ids"].shape[0] < len(rows)
    got = token_loss_sum(model(**model_inputs(packed)).logits, packed["labels"])
    got.backward()
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n], atol=1e-5, rtol=1e-5, msg=n)


def test_unpacked_batches_go_padding_free_and_train_as_padded_ones(runs):
    """Issue 66: by default an unpacked run on the CPU lays each micro-batch's 8 examples end to end in one row
    (varlen attention), so the tokens it computes are its real ones (`padding_ratio` at most 1.05; the padded
    run's is above it, over examples of 63 to 91 tokens); the packing check runs on its rows, and it trains the
    padded run's per-step losses (1e-5) on the same tokens."""
    free, padded = (records(runs(name, "full", "full"), "loss") for name in ("free", "padded"))
    assert len(free) == len(padded) == 5
    assert all(r["padding_ratio"] <= 1.05 for r in free) and max(r["padding_ratio"] for r in padded) > 1.05
    assert [r["loss"] for r in free] == pytest.approx([r["loss"] for r in padded], abs=1e-5, rel=1e-5)
    assert [r["tokens"] for r in free] == [r["tokens"] for r in padded]
    assert "packing_check_gap" in free[0] and "packing_check_gap" not in padded[0]
    said = run_stdout(runs("free", "full", "full"))
    assert "attention: varlen (padding-free rows: each example attends within itself)" in said
    assert "batches: padding-free: each micro-batch's 8 examples end to end in one row" in said
    assert "batches: padded to each micro-batch's longest row (--no-padding-free)" in run_stdout(runs("padded", "full",
                                                                                                   "full"))


def test_packed_run_trains_like_unpacked_when_a_step_sees_the_whole_data(runs):
    """Global batch = the whole dataset (32 examples), so packing changes only the layout: the same
    per-step losses (3 steps, full finetune)."""
    ref = [r["loss"] for r in records(runs("whole", "full", "full"))]
    got = [r["loss"] for r in records(runs("whole_packed", "full", "full"))]
    assert len(got) == 3 and got == pytest.approx(ref, abs=1e-5, rel=1e-5)


def test_chunked_loss_refuses_a_second_backward():
    """Backward hands over (and scales in place) the gradients formed in forward: a second backward
    through the same graph would reuse scaled buffers, so it is an error, not a silent wrong value."""
    from toolkit.objectives.sft.loss import chunked_loss_sum

    head = torch.nn.Linear(8, 32, bias=False)
    hidden = torch.randn(2, 5, 8, requires_grad=True)
    loss = chunked_loss_sum(hidden, head, torch.randint(0, 32, (2, 5)), chunk=3)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()


@pytest.mark.parametrize("given", [True, False], ids=["target_rows", "all_rows"])
def test_chunked_loss_runs_the_head_on_target_tokens_only(monkeypatch, given):
    """Prompt and padding rows contribute nothing: given their indices (`target_rows`, made on the CPU
    labels in the collate) the head's matmuls see only the target rows (the speed-up in
    benchmarks/throughput.md); without them every row goes through, weighted 0. Either way the masked
    rows' input gradient is exactly zero."""
    import toolkit.objectives.sft.loss as loss_mod

    rows = []
    real = loss_mod.linear_cross_entropy_sum
    monkeypatch.setattr(loss_mod, "linear_cross_entropy_sum", lambda h, *a: rows.append(h.shape[0]) or real(h, *a))
    head = torch.nn.Linear(8, 32, bias=False)
    hidden = torch.randn(2, 6, 8, requires_grad=True)
    labels = torch.full((2, 6), -100)
    labels[0, 4:], labels[1, 2:4] = 3, 5  # targets at positions (0, 4), (0, 5), (1, 2), (1, 3)
    chunked_loss_sum(hidden, head, labels, chunk=3, rows=loss_mod.target_rows(labels) if given else None).backward()
    # position t predicts label t + 1, so rows (0, 3), (0, 4), (1, 1), (1, 2) go through the head
    assert rows == ([4] if given else [12])
    used = torch.zeros(2, 6, dtype=torch.bool)
    used[0, 3:5] = used[1, 1:3] = True
    assert hidden.grad[~used].abs().sum() == 0 and (hidden.grad[used].abs().sum(-1) > 0).all()


def test_adamw_uses_the_fused_kernel_where_torch_has_one():
    """Fused AdamW on CPU/GPU parameters (the default per-tensor loop is 9x slower on CPU, see
    benchmarks/adamw.md); parameters the kernel cannot take get the plain loop, not an error at step 1."""
    from toolkit.config import parse_config
    from toolkit.train.loop import make_optimizer

    cfg = parse_config(["--output-dir", "unused"])
    assert make_optimizer(torch.nn.Linear(4, 4), cfg).defaults["fused"] is True
    meta = torch.nn.Linear(4, 4, device="meta")
    assert not make_optimizer(meta, cfg).defaults["fused"]


def test_auto_loss_is_chunked_where_the_lm_head_is_linear():
    """`--loss auto` (the default) takes the chunked path on a linear head and falls back to full
    logits on any other head; `--loss chunked` on such a head is a clear error."""
    from toolkit.config import Config
    from toolkit.errors import UserError
    from toolkit.objectives.sft.loss import FusedLossHead, loss_head_for

    assert Config().train.loss == "auto"
    model = random_model("llama", hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                         vocab_size=64)
    assert loss_head_for(model, "full", "cpu") is None
    head = loss_head_for(model, "auto", "cpu")
    assert isinstance(head, FusedLossHead) and head.kind == "chunked" and head.head is model.lm_head
    model.lm_head = torch.nn.Sequential(torch.nn.Linear(16, 64))  # some other head
    assert loss_head_for(model, "auto", "cpu") is None
    with pytest.raises(UserError, match="--loss chunked needs a linear LM head"):
        loss_head_for(model, "chunked", "cpu")


FREES = """
import sys
from pathlib import Path

import torch


def rss_mib():
    status = Path("/proc/self/status").read_text().splitlines()
    return int(next(line for line in status if line.startswith("VmRSS:")).split()[1]) // 1024


if sys.argv[1] == "mapped":
    from toolkit.parallel.build import map_large_allocations

    assert map_large_allocations()
big = torch.ones(2 ** 21)  # 8 MiB, mapped, then freed: glibc's own threshold rises to 8 MiB
del big
held = [torch.ones(2 ** 20) for _ in range(100)]  # 100 x 4 MiB: activations' sizes
last = torch.ones(2 ** 20)  # allocated after them, still alive
before = rss_mib()
del held
print(before - rss_mib())
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_freed_cpu_tensors_give_their_memory_back():
    """`map_large_allocations` (a CPU run's accelerator sets it): 400 MiB of 4 MiB tensors freed below one still
    alive go back to the OS; with glibc's own dynamic threshold they stay resident in the heap's holes."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"} | {"PYTHONPATH": str(root)}
    freed = {how: int(subprocess.run([sys.executable, "-c", FREES, how], capture_output=True, text=True, env=env,
                                     check=True, timeout=120).stdout.split()[-1]) for how in ("default", "mapped")}
    assert freed["mapped"] >= 380 and freed["default"] < 100, freed
