"""Fault tolerance: a run killed (SIGKILL) at a step or in the middle of a checkpoint write and
resumed with `--resume auto` continues exactly; SIGTERM; the NaN guard; refusals.

Exactness: bitwise for one process (fp32, CPU), 1e-6 for 2 ranks (DDP, ZeRO-1/2/3, FSDP2, TP, PP). Kills are
injected with TOOLKIT_FAULT (toolkit/train/faults.py), at steps drawn from a seeded RNG.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from distributed import ROOT, batched_runs, free_port, launch, launch_layouts
from helpers import losses, records


def args(model, data, out, method="lora", steps=8, extra=()) -> list[str]:
    """Dropout on (LoRA): the RNG state must be restored too."""
    return ["--model", str(model), "--dataset", str(data), "--output-dir", str(out), "--method", method,
            "--seq-len", "64", "--max-steps", str(steps), "--log-every", "1", "--lr", "1e-3", "--warmup-steps", "2",
            "--lr-schedule", "cosine", "--mixed-precision", "no", "--lora-dropout", "0.1", "--seed", "7",
            "--micro-batch-size", "4", "--save-every", "2", *extra]


def weights(out, method="lora") -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(out / "final" / ("adapter_model.safetensors" if method == "lora" else "model.safetensors"))


def assert_matches(out, ref, method="lora", steps=8) -> None:
    """Every step logged once, losses and final weights within 1e-6 of the reference run."""
    assert [s for s, _ in losses(out, steps=True)] == list(range(1, steps + 1))
    assert losses(out) == pytest.approx(losses(ref), abs=1e-6, rel=1e-6)
    got, want = weights(out, method), weights(ref, method)
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=1e-6, rtol=1e-6)


def run(argv, nproc=1, env=None, **kw):
    return launch(argv, nproc=nproc, env=env, **kw)  # forked ranks; torchrun's own restarts: below


@pytest.fixture(scope="module")
def data(data_files):
    return data_files["alpaca"]


def flags(model, data, method="lora", steps=8, extra=()) -> list[str]:
    """`args` without the output folder, for runs launched together (launch_layouts)."""
    argv = args(model, data, "unused", method, steps, extra)
    i = argv.index("--output-dir")
    return argv[:i] + argv[i + 2:]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_model, data):
    """Uninterrupted runs, by (method, processes): one launch per process count."""
    get = batched_runs(tmp_path_factory, [], {(m, n): (n, flags(tiny_model, data, m)) for m, n in
                                              (("lora", 1), ("full", 1), ("lora", 2))})
    return lambda method="lora", nproc=1: get(method, nproc)


KILL_STEPS = random.Random(0).sample([3, 4, 5, 6, 7], 1)


@pytest.mark.parametrize("fault", [f"step:{s}" for s in KILL_STEPS] + ["save:4"])
def test_killed_and_resumed_run_is_bitwise_identical(tmp_path, tiny_model, data, reference, fault):
    """SIGKILL after a step, or while checkpoint-4 is being written (the sharded weights and optimizer
    state are on disk, the rank files and trainer_state.json are not): --resume auto picks the newest complete
    checkpoint and the per-step losses and final weights equal the uninterrupted run bit for bit."""
    out = tmp_path / "out"
    p = run(args(tiny_model, data, out), env={"TOOLKIT_FAULT": fault})
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
    if fault == "save:4":
        assert (out / "checkpoint-4.tmp").is_dir() and not (out / "checkpoint-4").exists()
    p = run(args(tiny_model, data, out, extra=["--resume", "auto"]))
    assert p.returncode == 0, p.stderr[-3000:]
    expected_from = 2 if fault == "save:4" else 2 * (int(fault.split(":")[1]) // 2)
    assert f"checkpoint-{expected_from}: continuing at step {expected_from + 1}" in p.stdout
    ref = reference("lora")
    assert losses(out, steps=True) == losses(ref, steps=True)
    got, want = weights(out), weights(ref)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_full_finetune_resume_is_bitwise_identical(tmp_path, tiny_model, data, reference):
    out = tmp_path / "out"
    p = run(args(tiny_model, data, out, "full"), env={"TOOLKIT_FAULT": "step:5"})
    assert p.returncode == -signal.SIGKILL
    p = run(args(tiny_model, data, out, "full", extra=["--resume", "auto"]))
    assert p.returncode == 0, p.stderr[-3000:]
    # the bar starts at the checkpoint (its rate counts only the steps run); the end line says what ran
    bar = [line for line in p.stderr.splitlines() if line.strip()]
    assert bar[0].startswith("train:  50%|") and " 4/8 [" in bar[0]
    assert "done: 4 steps (5-8, resumed at step 5) in" in p.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps_this_run"] == 4
    # elapsed_s and train_seconds count the whole run: the killed run's steps, then the resumed ones
    elapsed = [r["elapsed_s"] for r in records(out, "loss")]
    assert elapsed == sorted(elapsed) and summary["train_seconds"] > summary["train_seconds_this_run"]
    ref = reference("full")
    assert losses(out, steps=True) == losses(ref, steps=True)
    got, want = weights(out, "full"), weights(ref, "full")
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_ddp_two_ranks_resume_matches(tmp_path, tiny_model, data, reference):
    out = tmp_path / "out"
    p = run(args(tiny_model, data, out), nproc=2, env={"TOOLKIT_FAULT": "step:5:rank=1"})
    assert p.returncode != 0
    p = run(args(tiny_model, data, out, extra=["--resume", "auto"]), nproc=2)
    assert p.returncode == 0, p.stderr[-3000:]
    assert_matches(out, reference("lora", 2))


@pytest.mark.parametrize("rendezvous", ["static", "standalone"])
def test_elastic_restart_survives_a_killed_worker(tmp_path, tiny_model, data, reference, rendezvous):
    """torchrun --max-restarts 2: rank 1 is killed after step 5 (once); the group restarts with the
    same command, joins a fresh process group (toolkit/parallel/elastic.py), `--resume auto` finds
    checkpoint-4, and the losses and final weights match the uninterrupted run within 1e-6."""
    out, marker = tmp_path / "out", tmp_path / "fired"
    where = ["--master_port", str(free_port())] if rendezvous == "static" else ["--standalone"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--max-restarts", "2", *where,
           str(ROOT / "finetune.py"), *args(tiny_model, data, out, extra=["--resume", "auto"])]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOOLKIT_FAULT": f"step:5:rank=1:once={marker}"}
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert marker.exists() and "checkpoint-4: continuing at step 5" in p.stdout
    assert f"--resume auto: no checkpoint in {out}; starting from step 0" in p.stdout  # the first attempt
    assert_matches(out, reference("lora", 2))


def test_sigterm_saves_a_checkpoint_and_exits_within_a_bound(tmp_path, tiny_model, data):
    out = tmp_path / "out"
    cmd = [sys.executable, str(ROOT / "finetune.py"), *args(tiny_model, data, out, steps=100000,
                                                           extra=["--save-every", "0"])]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not ((out / "metrics.jsonl").exists() and len(records(out)) >= 2):
        time.sleep(0.2)
    sent = time.time()
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 143, stderr[-2000:]
    assert time.time() - sent < 30
    saved = sorted(out.glob("checkpoint-*"))
    assert len(saved) == 1 and (saved[0] / "trainer_state.json").is_file()
    assert "preempted at step" in stdout + stderr and "Traceback" not in stderr


def test_nproc_per_node_ends_in_the_ranks_words(tmp_path, tiny_model, data):
    """Issue 64: `python finetune.py --nproc-per-node 2` starts the ranks itself, so a SIGTERM to it (a
    scheduler's preemption) ends it as it ends the ranks: each saves, one line says so, and it exits 143,
    with no launcher traceback (torchrun and accelerate launch raise SignalException and exit 1). A rank's
    refusal is its one line and its exit code, 2."""
    out = tmp_path / "out"
    cmd = [sys.executable, str(ROOT / "finetune.py"), "--nproc-per-node", "2",
           *args(tiny_model, data, out, steps=100000, extra=["--save-every", "0", "--report-to", "none"])]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.time() + 180
    while time.time() < deadline and not ((out / "metrics.jsonl").exists() and len(records(out)) >= 2):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 143, stderr[-2000:]
    saved = sorted(out.glob("checkpoint-*"))
    assert len(saved) == 1 and (saved[0] / "trainer_state.json").is_file()
    assert stdout.count("preempted at step") == 1 and "Traceback" not in stderr, stderr[-2000:]
    assert not [x for x in stderr.splitlines() if x.strip() and not x.startswith("train:")], stderr[-2000:]
    p = run(args(tiny_model, data, tmp_path / "bad", extra=["--nproc-per-node", "2", "--tp", "4"]))
    lines = [x for x in p.stderr.splitlines() if x.strip() and not x.startswith("train:")]
    assert p.returncode == 2 and len(lines) == 1 and lines[0].startswith("finetune.py: error: --tp 4"), p.stderr[-2000:]


def test_keep_last(tmp_path, tiny_model, data):
    out = tmp_path / "out"
    p = run(args(tiny_model, data, out, extra=["--save-every", "1", "--keep-last", "2"]))
    assert p.returncode == 0, p.stderr[-2000:]
    assert sorted(x.name for x in out.glob("checkpoint-*")) == ["checkpoint-7", "checkpoint-8"]  # the last step too


def test_nan_guard_skips_updates_then_saves_and_stops(tmp_path, tiny_model, data):
    """A huge learning rate blows the weights up after step 1: non-finite steps are skipped and
    logged; the third in a row saves a checkpoint and stops with one line."""
    out = tmp_path / "out"
    argv = args(tiny_model, data, out, "full", extra=["--lr", "1e30", "--warmup-steps", "0", "--max-grad-norm", "0"])
    p = run(argv)
    assert p.returncode == 2, p.stderr[-2000:]
    lines = [x for x in p.stderr.splitlines() if x.startswith("finetune.py: error:")]
    assert len(lines) == 1 and "not finite for 3 steps in a row" in lines[0] and "Traceback" not in p.stderr
    skipped = [r for r in records(out) if r.get("skipped_update")]
    assert len(skipped) == 3
    assert (out / f"checkpoint-{skipped[-1]['step']}" / "trainer_state.json").is_file()


def killed_after_checkpoint_6(ref, tmp_path):
    """A copy of a finished 8-step run as a kill after checkpoint-6 would leave it: no final/, no summary,
    no checkpoint-8 (its last step's)."""
    out = tmp_path / "out"
    shutil.copytree(ref, out)
    shutil.rmtree(out / "final")
    shutil.rmtree(out / "checkpoint-8")
    (out / "summary.json").unlink()
    return out


def test_a_finished_run_survives_resume_auto_and_is_continued_only_when_asked(tmp_path, tiny_model, data, reference):
    """--resume auto in a finished run's folder stops in one line and changes no file; the message without
    --resume offers only what works; --continue-finished --max-steps 10 trains on from checkpoint-8, the
    checkpoint of its last step (steps 1-8 kept, not re-trained; 9-10 run on the stretched schedule) and
    replaces final/; asked again, it is finished at 10."""
    out = tmp_path / "out"
    shutil.copytree(reference(), out)
    files = {f: f.read_bytes() for f in out.rglob("*") if f.is_file()}
    p = run(args(tiny_model, data, out, extra=["--resume", "auto"]))
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert (f"--resume auto: {out} holds a finished run (final/ at step 8) and no later checkpoint: there is nothing "
            "to resume. --continue-finished --max-steps N (N > 8) trains it further from checkpoint-8") in p.stderr
    p = run(args(tiny_model, data, out))
    assert p.returncode == 2 and f"--output-dir {out} holds a finished run (final/ at step 8); --resume auto " \
        "--continue-finished --max-steps N (N > 8) trains it further, --overwrite-output-dir replaces it" in p.stderr
    p = run(args(tiny_model, data, out, steps=8, extra=["--resume", "auto", "--continue-finished"]))
    assert p.returncode == 2 and "pass --max-steps beyond them (got 8)" in p.stderr
    assert {f: f.read_bytes() for f in out.rglob("*") if f.is_file()} == files  # nothing touched
    p = run(args(tiny_model, data, out, steps=10, extra=["--resume", "auto", "--continue-finished"]))
    assert p.returncode == 0, p.stderr[-3000:]
    assert "checkpoint-8: continuing at step 9 of 10" in p.stdout and "the run finished at step 8" in p.stdout
    assert [s for s, _ in losses(out, steps=True)] == list(range(1, 11))
    assert losses(out, steps=True)[:8] == losses(reference(), steps=True)[:8]
    assert json.loads((out / "summary.json").read_text())["steps"] == 10
    assert not torch.equal(weights(out)[k := next(iter(weights(out)))], weights(reference())[k])  # final/ replaced
    p = run(args(tiny_model, data, out, steps=10, extra=["--resume", "auto", "--continue-finished"]))
    assert p.returncode == 2 and "the run finished 10 steps; pass --max-steps beyond them" in p.stderr


def test_a_finished_run_saves_its_last_step_and_continues_after_it(tmp_path, tiny_model, data, capsys):
    """In one process: --save-every 2 over 3 steps saves checkpoint-2 and checkpoint-3, its last step, so
    --continue-finished --max-steps 4 goes on at step 4 without training step 3 again (issue 57: it
    re-trained the steps after checkpoint-2)."""
    import finetune
    from toolkit.config.output_dir import complete_checkpoints

    out = tmp_path / "out"
    finetune.main(args(tiny_model, data, out, steps=3, extra=["--report-to", "none"]))
    assert [c.name for c in complete_checkpoints(out)] == ["checkpoint-2", "checkpoint-3"]
    before = losses(out, steps=True)
    finetune.main(args(tiny_model, data, out, steps=4, extra=["--report-to", "none", "--resume", "auto",
                                                                 "--continue-finished"]))
    assert f"resumed from {out / 'checkpoint-3'}: continuing at step 4 of 4" in capsys.readouterr().out
    assert losses(out, steps=True)[:3] == before and [s for s, _ in losses(out, steps=True)] == [1, 2, 3, 4]


def test_resume_refuses_a_changed_run(tmp_path, tiny_model, data, reference):
    """A copy of the uninterrupted reference run (its checkpoint-6 is what --resume auto finds), resumed
    with another learning rate and seed: both changes named in the one refusal."""
    change = ["--lr", "2e-3", "--seed", "8"]
    out = killed_after_checkpoint_6(reference(), tmp_path)
    before = sorted(str(x) for x in out.rglob("*"))
    p = run(args(tiny_model, data, out, extra=["--resume", "auto", *change]))
    assert p.returncode == 2
    assert "this is not the run that wrote it" in p.stderr
    assert "--lr was 0.001, now 0.002" in p.stderr and "--seed was 7, now 8" in p.stderr
    assert sorted(str(x) for x in out.rglob("*")) == before  # nothing touched
    p = run(args(tiny_model, data, out, extra=["--resume", "auto", "--resume-ignore-mismatch", *change]))
    assert p.returncode == 0, p.stderr[-2000:]
    assert "checkpoint-6: continuing at step 7" in p.stdout


def test_resume_refuses_another_dataset_and_deepspeed(tmp_path, tiny_model, data, reference):
    """Another dataset is refused; so is DeepSpeed ZeRO, which cannot read a sharded checkpoint (any
    other layout reads it: tests/test_reshard.py)."""
    out = killed_after_checkpoint_6(reference(), tmp_path)
    other = tmp_path / "other.json"
    other.write_text(json.dumps(json.loads(data.read_text())[:-1]) if data.suffix == ".json" else
                     "\n".join(data.read_text().splitlines()[:-1]) + "\n")
    p = run(args(tiny_model, other, out, extra=["--resume", "auto"]))
    assert p.returncode == 2 and "the dataset changed" in p.stderr
    p = run(args(tiny_model, data, out, extra=["--resume", "auto", "--zero-stage", "2"]))
    assert p.returncode == 2, p.stderr[-2000:]
    assert "a sharded checkpoint, which DeepSpeed ZeRO cannot read; resume it without --zero-stage" in p.stderr


@pytest.mark.parametrize("nproc", [2])  # one process takes the same path, without the agreement
def test_disk_full_during_a_checkpoint(tmp_path, tiny_model, data, nproc):
    """ENOSPC while writing checkpoint-4 (simulated; with 2 processes on rank 1 only): one message
    (every rank that prints it prints the same line: they agree after the writes), a non-zero exit
    within the timeout, checkpoint-2 intact and resumable, no half-written folder left."""
    out = tmp_path / "out"
    p = run(args(tiny_model, data, out), nproc, env={"TOOLKIT_FAULT": f"save:4:rank={nproc - 1}:error=enospc"},
            timeout=300)
    assert p.returncode != 0, p.stderr[-2000:]
    lines = {x for x in p.stderr.splitlines() if x.startswith("finetune.py: error:")}
    assert len(lines) == 1, p.stderr[-3000:]
    assert "no space left on the device" in min(lines) and "checkpoint-2 intact" in min(lines)
    assert "Traceback" not in p.stderr  # the ranks' own stderr (forked: no launcher's summary beside it)
    assert sorted(x.name for x in out.glob("checkpoint-*")) == ["checkpoint-2"]
    p = run(args(tiny_model, data, out, extra=["--resume", "auto"]), nproc)
    assert p.returncode == 0 and "checkpoint-2: continuing at step 3" in p.stdout


LAYOUTS = {"pp2": ["--pp", "2", "--pp-microbatches", "2"], "tp2": ["--tp", "2"], "zero1": ["--zero-stage", "1"],
           "zero2": ["--zero-stage", "2"], "zero3": ["--zero-stage", "3"],
           "zero2_offload": ["--zero-stage", "2", "--offload", "optimizer"], "fsdp": ["--fsdp"]}


PARALLEL = [("zero3", "full"), ("zero3", "lora"), ("zero2_offload", "lora")]


@pytest.fixture(scope="module")
def parallel_resumed(tmp_path_factory, tiny_model, data):
    """(name, method) -> (uninterrupted run, resumed run), 2 ranks, 6 steps, in three launches: the
    uninterrupted runs together; ZeRO-3 full killed at step 3 (rank 1); then every resume together.
    The others resume from a copy of their uninterrupted run with the steps after checkpoint-2 taken
    away (what a kill leaves is the same checkpoint; the kill itself is tested once, and for DDP above)."""
    def key(name, method):
        return f"{name}_{method}"

    refs = launch_layouts(tmp_path_factory.mktemp("parallel_ref"), [],
                          {key(n, m): flags(tiny_model, data, m, 6, LAYOUTS[n]) for n, m in PARALLEL}, nproc=2)
    assert all(r["exit"] == 0 for r in refs.values()), refs
    root = tmp_path_factory.mktemp("parallel_resumed")
    killed = root / key("zero3", "full")
    p = run(args(tiny_model, data, killed, "full", steps=6, extra=LAYOUTS["zero3"]), nproc=2,
            env={"TOOLKIT_FAULT": "step:3:rank=1"})
    assert p.returncode != 0
    for n, m in PARALLEL[1:]:
        shutil.copytree(refs[key(n, m)]["out"], root / key(n, m))
        for later in ("checkpoint-4", "checkpoint-6", "final"):  # checkpoint-6: its last step's
            shutil.rmtree(root / key(n, m) / later)
    resumed = launch_layouts(root, [], {key(n, m): flags(tiny_model, data, m, 6, [*LAYOUTS[n], "--resume", "auto"])
                                        for n, m in PARALLEL}, nproc=2)
    return {(n, m): (refs[key(n, m)]["out"], resumed[key(n, m)]) for n, m in PARALLEL}


@pytest.mark.parametrize("name, method", PARALLEL)
def test_parallel_runs_resume(parallel_resumed, name, method):
    """DeepSpeed's own format: ZeRO partitions (fp32 masters and Adam moments per rank), weights
    restored before the split: the group resumed from checkpoint-2 matches the uninterrupted run of
    the same strategy within 1e-6 (losses and final weights). The sharded layouts (TP, PP, FSDP2)
    resume on their own and other layouts in tests/test_reshard.py. A ZeRO-3 LoRA checkpoint holds
    the adapter, not the frozen base, and its rank files the adapter's fp32 masters and Adam moments
    once (at most 1.05x)."""
    ref, resumed = parallel_resumed[(name, method)]
    assert resumed["exit"] == 0, (resumed["out"].parent / "stderr.txt").read_text()[-3000:]
    out = resumed["out"]
    assert "checkpoint-2: continuing at step 3" in resumed["stdout"].read_text()
    assert_matches(out, ref, method, steps=6)
    if (name, method) == ("zero3", "lora"):
        adapter = sum(v.numel() * 4 for v in weights(ref).values())
        saved = ref / "checkpoint-2"
        assert (saved / "adapter_model.safetensors").stat().st_size <= 1.05 * adapter
        held = [torch.load(f, weights_only=True)["optimizer"] for f in saved.glob("rank*.pt")]
        assert sum(tensor_bytes(h) for h in held) <= 1.05 * 3 * adapter


def tensor_bytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v) for v in value)
    return 0


SHORT_EPOCH = {"fsdp": ["--fsdp"], "zero2": ["--zero-stage", "2"]}
TERM_AT = 2  # the real SIGTERM: the step before the epoch's short last one


@pytest.fixture(scope="module")
def short_epoch(tmp_path_factory, tiny_model):
    """10 records, micro-batch 2 on 2 ranks: 3 steps an epoch, the third reading 2 examples, which
    accelerate's even_batches fills on rank 1 with the epoch's first; 4 steps (into epoch 2), a checkpoint
    at each. Per layout: the uninterrupted run, one SIGTERMed at step 2 (a real preemption: checkpoint,
    exit 143), in one launch; then a resume from every step of the epoch (1 and 3 from copies of the
    uninterrupted run's folder with the later checkpoints taken away, 2 the preempted run's) in another."""
    from conftest import make_records

    data = tmp_path_factory.mktemp("short") / "ten.json"
    data.write_text(json.dumps(make_records("alpaca", 10)))

    def argv(layout, extra=()):
        return flags(tiny_model, data, "full", 4, ["--micro-batch-size", "2", "--save-every", "1", "--report-to",
                                                    "none", "--verify", "none", *SHORT_EPOCH[layout], *extra])

    first = launch_layouts(tmp_path_factory.mktemp("short_first"), [],
                           {f"{kind}_{layout}": argv(layout) for layout in SHORT_EPOCH for kind in ("ref", "term")},
                           nproc=2, run_env={f"term_{layout}": {"TOOLKIT_FAULT": f"step:{TERM_AT}:signal=term"}
                                             for layout in SHORT_EPOCH})
    root = tmp_path_factory.mktemp("short_resumed")
    for layout in SHORT_EPOCH:
        for k in (1, 3):
            shutil.copytree(first[f"ref_{layout}"]["out"], root / f"{layout}_{k}")
            for later in [f"checkpoint-{s}" for s in range(k + 1, 5)] + ["final"]:
                shutil.rmtree(root / f"{layout}_{k}" / later)
        shutil.copytree(first[f"term_{layout}"]["out"], root / f"{layout}_{TERM_AT}")
    resumed = launch_layouts(root, [], {f"{layout}_{k}": argv(layout, ["--resume", "auto"])
                                        for layout in SHORT_EPOCH for k in (1, 2, 3)}, nproc=2)
    return first, resumed


@pytest.mark.parametrize("layout", list(SHORT_EPOCH))
def test_resume_at_every_step_of_a_short_epoch(short_epoch, layout):
    """Issue 64: a resume at any step of an epoch whose last global batch is short (2 ranks, FSDP2 and
    ZeRO-2) reads the uninterrupted run's examples at every later step, the short one included (before,
    the short batch was filled from the resume point's examples: other tokens, another loss), and its
    losses equal that run's within 1e-6; the SIGTERMed run saved its step and exited with 143."""
    first, resumed = short_epoch
    assert first[f"term_{layout}"]["exit"] == 143, first
    assert "preempted at step 2" in first[f"term_{layout}"]["stdout"].read_text()
    ref = records(first[f"ref_{layout}"]["out"])
    assert [r["epoch"] for r in ref] == [0, 0, 0, 1]  # step 3 is the epoch's short last one
    for k in (1, 2, 3):
        run = resumed[f"{layout}_{k}"]
        assert run["exit"] == 0, run["stderr"].read_text()[-3000:]
        assert f"checkpoint-{k}: continuing at step {k + 1}" in run["stdout"].read_text()
        got = records(run["out"])
        assert [r["step"] for r in got] == [1, 2, 3, 4]
        assert [r["tokens"] for r in got] == [r["tokens"] for r in ref], k  # the same examples at every step
        assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in ref], abs=1e-6, rel=1e-6), k


# A LoRA SFT run and a GRPO run (a round of two steps) written by the toolkit before its modules moved into
# packages (commit ae6db66), with the records of their uninterrupted four steps: tests/data/checkpoints_v1.
V1 = ROOT / "tests" / "data" / "checkpoints_v1"
V1_SFT = ["--model", "model", "--dataset", "sft.jsonl", "--output-dir", "sft-run", "--max-steps", "4", "--save-every",
          "2", "--keep-last", "5", "--micro-batch-size", "2", "--grad-accum", "2", "--lr", "1e-3", "--seed", "3"]
V1_GRPO = ["--model", "model", "--dataset", "prompts.jsonl", "--objective", "grpo", "--reward", "builtin:regex:[aeiou]",
           "--num-generations", "4", "--max-completion-length", "6", "--steps-per-generation", "2", "--output-dir",
           "grpo-run", "--max-steps", "4", "--save-every", "1", "--keep-last", "5", "--micro-batch-size", "4", "--lr",
           "1e-2", "--seed", "3", "--log-completions-every", "1"]


def test_checkpoints_of_the_earlier_layout_resume_exactly(tmp_path):
    """The checkpoint format, the data cache key and the batches' saved state are unchanged: an SFT run resumed
    from its step-2 checkpoint, and a GRPO run from a checkpoint written inside a sampling round (the round's rest
    saved with it), continue as the uninterrupted runs did: the same losses and gradient norms (fp32, relative
    1e-5) and the same completions."""
    work = tmp_path / "v1"
    shutil.copytree(V1, work)
    before = {run: records(work / run) for run in ("sft-run", "grpo-run")}
    completions = (work / "grpo-run" / "completions.jsonl").read_text().splitlines()

    from toolkit.config import parse_config
    from toolkit.data.prepare import data_key
    from toolkit.data.tokenize import ensure_chat_template
    from toolkit.model.load import load_tokenizer

    tokenizer = load_tokenizer(str(work / "model"))
    ensure_chat_template(tokenizer)
    os.chdir(work)  # the runs' paths are relative, as they were written
    try:
        key = data_key(parse_config([*V1_SFT, "--resume", "auto"]).data_settings, tokenizer)
    finally:
        os.chdir(ROOT)
    assert key == json.loads((work / "keys.json").read_text())["sft_data_key"]
    for run, flags, checkpoint in (("sft-run", V1_SFT, "checkpoint-2"), ("grpo-run", V1_GRPO, "checkpoint-1")):
        done = subprocess.run([sys.executable, str(ROOT / "finetune.py"), *flags, "--resume", f"{run}/{checkpoint}"],
                              cwd=work, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        after = records(work / run)
        resumed = int(checkpoint.split("-")[1])
        for old in before[run]:
            if old["step"] <= resumed or "grad_norm" not in old:
                continue
            new = next(r for r in after if r["step"] == old["step"] and "grad_norm" in r)
            for key in ("loss", "grad_norm", "reward"):
                if old.get(key) is not None:
                    assert new[key] == pytest.approx(old[key], rel=1e-5, abs=1e-7), (run, old["step"], key)
    # the round sampled after the resume: steps 3 and 4, as the uninterrupted run sampled them
    want = [json.loads(c) for c in completions if json.loads(c)["step"] >= 3]
    resampled = [json.loads(c) for c in (work / "grpo-run" / "completions.jsonl").read_text().splitlines()]
    assert resampled[-len(want):] == want
