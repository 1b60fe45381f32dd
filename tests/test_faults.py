"""Faults at the edges (issue 36): a damaged or planted checkpoint, a full disk, an output folder that
cannot be written, broken data, a model that asks to run its own code, generate/merge on a step
checkpoint, a model replaced under its path, wrong-shaped config values, and one error line however
many ranks run. Each failing case: exit status 2, exactly one `error:` line naming the file (and
line) and the fix, no traceback, and what was written before is still there and loadable.

Runs are `finetune.main` in-process (one rank) except the multi-rank case, one launch of forked ranks
(tests/distributed.py).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import finetune
from distributed import launch_layouts
from helpers import losses
from toolkit.errors import UserError

FLAGS = ["--seq-len", "64", "--micro-batch-size", "4", "--max-steps", "6", "--save-every", "2", "--keep-last", "3",
         "--log-every", "1", "--lr", "1e-3", "--warmup-steps", "1", "--lora-dropout", "0.1", "--seed", "7",
         "--mixed-precision", "no", "--verify", "files"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_model, data_files):
    """One LoRA run of 6 steps with checkpoint-2, checkpoint-4 and its last step's checkpoint-6 (each with
    its manifest), on a copy of the tiny model of its own (a test replaces weights under its path)."""
    root = tmp_path_factory.mktemp("faults")
    model = root / "model"
    shutil.copytree(tiny_model, model)
    common = ["--model", str(model), "--dataset", str(data_files["alpaca"]), *FLAGS]
    finetune.main([*common, "--output-dir", str(root / "run")])
    return {"out": root / "run", "common": common, "model": model}


def one_error(capsys, argv, prog=finetune.main, name="finetune.py") -> str:
    """Run a CLI main that must fail: its one error line (status 2, no traceback)."""
    with pytest.raises(SystemExit) as e:
        prog(argv)
    assert e.value.code == 2
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if "error:" in line]
    assert len(lines) == 1 and lines[0].startswith(f"{name}: error: "), captured.err[-3000:]
    assert "Traceback" not in captured.err
    return lines[0]


def copy_run(trained, tmp_path):
    """The run as a kill after checkpoint-4 leaves it: no final/, nor the checkpoint of its last step."""
    out = tmp_path / "run"
    shutil.copytree(trained["out"], out)
    shutil.rmtree(out / "final")
    shutil.rmtree(out / "checkpoint-6")
    return out


def truncate(path, keep: int = 100) -> None:
    path.write_bytes(path.read_bytes()[:keep])


def test_manifest_finds_each_kind_of_damage(tmp_path):
    from toolkit.train.manifest import MANIFEST, damage, write_manifest

    ckpt = tmp_path / "checkpoint-2"
    (ckpt / "state").mkdir(parents=True)
    (ckpt / "state" / "shard.safetensors").write_bytes(os.urandom(4096))
    (ckpt / "rank0.pt").write_bytes(os.urandom(512))
    write_manifest(ckpt)
    assert damage(ckpt) is None
    data = (ckpt / "rank0.pt").read_bytes()
    (ckpt / "rank0.pt").write_bytes(bytes([data[0] ^ 1]) + data[1:])  # same size, one bit
    assert "rank0.pt differs from what was saved (checksum mismatch)" in damage(ckpt)
    (ckpt / "rank0.pt").write_bytes(data)
    truncate(ckpt / "state" / "shard.safetensors")
    assert "shard.safetensors is 100 bytes, 4096 when saved" in damage(ckpt)
    (ckpt / "state" / "shard.safetensors").unlink()
    assert "shard.safetensors is missing" in damage(ckpt)
    (ckpt / MANIFEST).write_text("{not json")
    assert "is unreadable" in damage(ckpt)
    (ckpt / MANIFEST).unlink()
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": 2}))
    assert damage(ckpt) is None  # a checkpoint from before manifests: nothing to check against
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": 2, "manifest": MANIFEST}))
    assert f"{ckpt / MANIFEST} is missing" in damage(ckpt)  # one that had it has lost it


def test_resume_auto_passes_over_a_damaged_checkpoint_and_resumes_exactly(trained, tmp_path, capsys):
    """A truncated shard in the newest checkpoint: named explicitly it is one line naming the file;
    `--resume auto` says which file was damaged, resumes from checkpoint-2, and the losses of steps
    3-6 equal the uninterrupted run's (1e-6; one process, fp32)."""
    out = copy_run(trained, tmp_path)
    shard = out / "checkpoint-4" / "state" / "shard-00001.safetensors"
    truncate(shard)
    argv = [*trained["common"], "--output-dir", str(out)]
    line = one_error(capsys, [*argv, "--resume", str(out / "checkpoint-4")])
    assert (f"the checkpoint is damaged: {shard} is 100 bytes" in line
            and "--resume auto picks the newest intact" in line)
    finetune.main([*argv, "--resume", "auto"])
    said = capsys.readouterr().out
    assert f"--resume auto: skipped checkpoint-4, damaged: {shard} is 100 bytes" in said
    assert f"resumed from {out / 'checkpoint-2'}: continuing at step 3" in said
    got, want = dict(losses(out, steps=True)), dict(losses(trained["out"], steps=True))
    assert got == pytest.approx(want, abs=1e-6) and sorted(got) == list(range(1, 7))


def test_every_checkpoint_damaged_is_one_line_and_nothing_is_removed(trained, tmp_path, capsys):
    out = copy_run(trained, tmp_path)
    for step in (2, 4):
        truncate(out / f"checkpoint-{step}" / "rank0.pt")
    line = one_error(capsys, [*trained["common"], "--output-dir", str(out), "--resume", "auto"])
    assert f"--resume auto: every checkpoint in {out} is damaged (checkpoint-4: " in line and "checkpoint-2: " in line
    assert (out / "checkpoint-2" / "rank0.pt").stat().st_size == 100  # left as found, for the user to restore


def test_a_rank_file_holding_code_is_refused_unread(trained, tmp_path, capsys):
    """A rank file replaced by a pickle that would run a command: with the manifest it is a checksum
    mismatch; in a checkpoint without one (an older version's) `weights_only` refuses it, said in our
    words: no advice to turn safety off. The command never runs."""
    out = copy_run(trained, tmp_path)
    planted = tmp_path / "planted-code-ran"
    script = ("import os, sys, torch\n"
              "class Planted:\n"
              "    def __reduce__(self):\n"
              f"        return (os.system, ('touch {planted}',))\n"
              "torch.save({'scheduler': Planted()}, sys.argv[1])\n")
    subprocess.run([sys.executable, "-c", script, str(out / "checkpoint-4" / "rank0.pt")], check=True)
    argv = [*trained["common"], "--output-dir", str(out), "--resume", str(out / "checkpoint-4")]
    assert f"the checkpoint is damaged: {out / 'checkpoint-4' / 'rank0.pt'} is " in one_error(capsys, argv)
    (out / "checkpoint-4" / "manifest.json").unlink()
    assert "manifest.json is missing" in one_error(capsys, argv)  # its trainer_state.json says it had one
    state = json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())
    del state["manifest"]  # as an earlier version wrote it: no manifest to check against
    (out / "checkpoint-4" / "trainer_state.json").write_text(json.dumps(state))
    line = one_error(capsys, argv)
    assert "rank0.pt holds objects other than tensors and plain values" in line and "refused unread" in line
    assert "weights_only" not in line and not planted.exists()


def test_write_failure_reads_each_library_s_error(tmp_path):
    from torch.distributed.checkpoint.api import CheckpointException

    from toolkit.train.checkpoint import NO_SPACE, write_failure

    assert write_failure(OSError(errno.ENOSPC, "No space left on device"), tmp_path) == NO_SPACE
    assert write_failure(OSError(errno.EIO, "Input/output error"), tmp_path) == "input/output error"
    wrapped = CheckpointException("save failed", {1: (OSError(errno.ENOSPC, "No space left on device"), None)})
    assert write_failure(wrapped, tmp_path) == NO_SPACE  # DCP's wrapper, a BaseException
    assert write_failure(RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534"),
                         tmp_path) in (NO_SPACE, "the write failed (an I/O error)")  # torch.save's only word for it
    assert write_failure(ValueError("a bug, not a disk"), tmp_path) is None


@pytest.fixture
def tmpfs(tmp_path):
    """mount(size) -> a fresh tmpfs of that many KB (needs root and CAP_SYS_ADMIN: skipped elsewhere)."""
    mounted = []

    def mount(kb: int, *options: str):
        where = tmp_path / f"tmpfs{len(mounted)}"
        where.mkdir()
        p = subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join([f"size={kb}k", *options]), "tmpfs", str(where)],
                           capture_output=True, text=True)
        if p.returncode:
            pytest.skip(f"cannot mount a tmpfs here ({p.stderr.strip() or p.returncode}): a real ENOSPC needs one")
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        # lazy: a process still holding a file there must not leave the mount behind
        subprocess.run(["umount", "-l", str(where)], check=False)


def folder_kb(path) -> int:
    return sum(-(-f.stat().st_size // 4096) * 4 for f in path.rglob("*") if f.is_file())


@pytest.mark.parametrize("where", ["checkpoint-4", "final"])
def test_a_real_full_disk_is_one_line_and_the_last_checkpoint_resumes(trained, tmp_path, tmpfs, capsys, where):
    """A tmpfs with room for checkpoint-2 but not checkpoint-4 (or for no final folder): the line
    names the folder, what it needs and what is free; no partial folder is left; the run then
    resumes from checkpoint-2 elsewhere and matches the uninterrupted run."""
    ckpt = folder_kb(trained["out"] / "checkpoint-2")
    if where == "checkpoint-4":
        disk = tmpfs(ckpt + ckpt // 2 + 64)
        argv = [*trained["common"], "--output-dir", str(disk / "out")]
    else:
        disk = tmpfs(folder_kb(trained["out"] / "final") // 2)
        argv = [*trained["common"], "--output-dir", str(disk / "out"), "--save-every", "0"]
    line = one_error(capsys, argv)
    assert f"could not write {disk / 'out' / where}: no space left on the device (it needs about" in line
    assert "free there); it was not saved" in line
    assert not list((disk / "out").glob(f"{where}*"))
    if where == "final":
        assert "then run again" in line
        return
    assert ("(checkpoint-2 intact). Free space (or keep fewer with --keep-last), "
            "then continue with --resume auto" in line)
    moved = tmp_path / "moved"
    shutil.copytree(disk / "out", moved)
    finetune.main([*trained["common"], "--output-dir", str(moved), "--resume", "auto"])
    assert dict(losses(moved, steps=True)) == pytest.approx(dict(losses(trained["out"], steps=True)), abs=1e-6)


def test_an_output_folder_that_cannot_be_written_stops_before_the_model_loads(trained, tmp_path, tmpfs, capsys):
    (tmp_path / "a-file").write_text("x")
    line = one_error(capsys, [*trained["common"], "--output-dir", str(tmp_path / "a-file" / "out")])
    assert f"{tmp_path / 'a-file'} is a file, so no folder can be made under it" in line
    read_only = tmpfs(64, "ro")  # root writes through permission bits: a read-only mount stops it
    line = one_error(capsys, [*trained["common"], "--output-dir", str(read_only / "out")])
    assert f"--output-dir {read_only / 'out'}: {read_only} cannot be written (a read-only file system)" in line


def _bad_data(tmp_path, data_files, name):
    """(flags, the file, what the line must say) for one kind of broken data, broken at line 3."""
    good = data_files["alpaca"].read_text()
    rows = [json.dumps(r) for r in json.loads(good)] if good.lstrip().startswith("[") else good.splitlines()
    bad = tmp_path / f"{name}.jsonl"
    broken = {"not_utf8": b'{"instruction": "caf\xe9", "output": "x"}',
              "bad_json": b'{"instruction": oops}',
              "wrong_type": json.dumps({"instruction": 5, "output": "x"}).encode(),
              "missing_field": json.dumps({"instruction": "q"}).encode()}[name.split("-")[0]]
    bad.write_bytes(b"\n".join([r.encode() for r in rows[:2]] + [broken] + [r.encode() for r in rows[2:]]) + b"\n")
    said = {"not_utf8": f"{bad}: line 3 is not UTF-8 text (byte 0xe9); save the file as UTF-8",
            "bad_json": f"{bad}: invalid JSON on line 3",
            "wrong_type": f"{bad}: record 3 (line 3): alpaca 'instruction' and 'output' must be strings",
            "missing_field": f"{bad}: record 3 (line 3): alpaca 'instruction' and 'output' must be strings"}
    return bad, said[name.split("-")[0]]


@pytest.mark.parametrize("name", ["not_utf8", "not_utf8-streaming", "not_utf8-mixture", "bad_json-streaming",
                                  "wrong_type-streaming", "missing_field"])
def test_broken_data_is_one_line_naming_the_file_and_line(trained, tmp_path, data_files, capsys, name):
    """Map-style, streamed, and one source of a mixture (the bad JSON line of a map-style file, and a
    record missing its fields in a mixture: tests/test_bad_input.py). A bad record stops the run."""
    bad, said = _bad_data(tmp_path, data_files, name)
    spec = f"{data_files['alpaca']}:0.5,{bad}:0.5" if name.endswith("mixture") else str(bad)
    extra = ["--streaming"] if name.endswith("streaming") else []
    line = one_error(capsys, [*trained["common"], "--dataset", spec, *extra, "--output-dir", str(tmp_path / "out")])
    assert f"--dataset {said}" in line
    assert "model:" not in capsys.readouterr().out


def test_a_stream_that_breaks_past_its_first_block_names_the_line(tmp_path):
    """A failure while the stream is read mid-run (past what the first read parsed) is one line
    naming the file and line, found by scanning the file on that path only."""
    from toolkit.data.stream import RecordStream

    bad = tmp_path / "big.jsonl"
    bad.write_text("".join(json.dumps({"text": f"row {i}"}) + "\n" for i in range(5000)) + "{oops\n")

    def rows():
        yield {"text": "row 0"}
        raise ValueError("JSON parse error: Missing a name for object member. in row 0")  # pyarrow's words

    stream = RecordStream.__new__(RecordStream)
    stream.records, stream.spec, stream.renames, stream.start = rows(), str(bad), {}, 0
    with pytest.raises(UserError, match=rf"--dataset {bad}: invalid JSON on line 5001"):
        list(zip(range(10), stream))


def test_remote_code_is_refused_in_generate_and_merge(trained, tmp_path, capsys):
    from toolkit.cli.main import main as cli

    custom = tmp_path / "custom"
    shutil.copytree(trained["model"], custom)
    config = json.loads((custom / "config.json").read_text())
    config.update(model_type="toolkit-test-custom", auto_map={"AutoConfig": "configuration_custom.CustomConfig",
                                                              "AutoModelForCausalLM": "modeling_custom.CustomLM"})
    (custom / "config.json").write_text(json.dumps(config))
    line = one_error(capsys, ["generate", "--model", str(custom), "--prompt", "hi"], cli, "python -m toolkit")
    assert f"--model {custom} needs its own code to run; pass --trust-remote-code" in line
    line = one_error(capsys, ["merge", "--adapter", str(trained["out"] / "checkpoint-4"), "--base", str(custom),
                              "--output", str(tmp_path / "merged")], cli, "python -m toolkit")
    assert f"the base model {custom} needs its own code to run; pass --trust-remote-code" in line


@pytest.mark.parametrize("argv, said", [(["--max-new-tokens", "0"], "--max-new-tokens must be at least 1 (got 0)"),
                                        (["--temperature", "-1"], "--temperature must be > 0 (got -1)"),
                                        (["--prompt", " "], "--prompt is empty")])
def test_generate_refuses_impossible_numbers(trained, capsys, argv, said):
    from toolkit.cli.main import main as cli

    line = one_error(capsys, ["generate", "--model", str(trained["out"] / "final"), "--prompt", "hi", *argv], cli,
                     "python -m toolkit")
    assert said in line


def test_generate_and_merge_read_a_step_checkpoint(trained, tmp_path, capsys):
    """checkpoint-4 (sharded state, no adapter file) works as an adapter folder: merged, it equals the
    base with the checkpoint's adapter applied (peft on the converted folder), in plain transformers."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from toolkit.cli.main import main as cli
    from toolkit.train.checkpoint import convert_checkpoint

    ckpt = trained["out"] / "checkpoint-4"
    cli(["generate", "--model", str(ckpt), "--prompt", "hi", "--max-new-tokens", "3"])
    assert "a step checkpoint, read as a standard folder" in capsys.readouterr().err
    cli(["merge", "--adapter", str(ckpt), "--output", str(tmp_path / "merged")])
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    convert_checkpoint(ckpt, tmp_path / "adapter")
    want = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(trained["model"]), tmp_path / "adapter")
    ids = torch.arange(1, 17).view(1, -1)
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, want.eval()(ids).logits, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(merged(ids).logits,
                                  AutoModelForCausalLM.from_pretrained(trained["model"])(ids).logits)


def test_a_model_replaced_under_its_path_is_refused_at_resume(trained, tmp_path, data_files):
    """The fingerprint holds config.json's hash and each weight file's size and end hashes: a model
    folder rewritten under the same path (new config, or same-size weights with other values) is
    named at resume; the path alone did not tell."""
    from toolkit.config import parse_config
    from toolkit.train.resume import ResumePoint, fingerprint, mismatch

    model = tmp_path / "model"
    shutil.copytree(trained["model"], model)
    cfg = parse_config(["--model", str(model), "--dataset", str(data_files["alpaca"]),
                        "--output-dir", str(tmp_path / "o")])
    point = ResumePoint(tmp_path / "checkpoint-2", 2, {"fingerprint": fingerprint(cfg.flat(), 1)})
    assert mismatch(point, cfg.flat(), 1) == []
    from safetensors.torch import load_file, save_file

    weights = load_file(model / "model.safetensors")
    save_file({k: v + 0.01 for k, v in weights.items()}, model / "model.safetensors", metadata={"format": "pt"})
    (problem,) = mismatch(point, cfg.flat(), 1)
    assert problem.startswith(f"the model at {model} changed since the checkpoint (model.safetensors was ")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-3}))
    assert "its config.json differs" in mismatch(point, cfg.flat(), 1)[0]


@pytest.mark.parametrize("yaml_text, said", [
    ("columns: [prompt, response]\n", "'columns' in {} must be a mapping of ours: yours (instruction: prompt) or a "
                                      "string OURS=YOURS,..., got a list (['prompt', 'response'])"),
    ("lora_targets: {q_proj: 1}\n", "'lora_targets' in {} must be a list of module names, a comma-separated string, "
                                    "or all-linear, got a mapping ({'q_proj': 1})"),
    ("seq_len: [1024]\n", "'seq_len' in {} must be an integer, got a list ([1024])")])
def test_a_wrong_shaped_config_value_names_the_key_the_shape_and_what_was_given(tmp_path, yaml_text, said):
    from toolkit.config import parse_config

    path = tmp_path / "run.yaml"
    path.write_text(yaml_text)
    with pytest.raises(UserError) as e:
        parse_config(["--config", str(path)])
    assert str(e.value) == said.replace("{}", str(path), 1)


def test_with_two_ranks_each_error_is_printed_once(trained, tmp_path, data_files):
    """Both ranks hit the same bad data line, and both refuse the same damaged checkpoint (the main
    process verifies it and tells the other): one line each, never two copies glued together."""
    bad, said = _bad_data(tmp_path, data_files, "bad_json")
    damaged = copy_run(trained, tmp_path)
    truncate(damaged / "checkpoint-4" / "state" / "shard-00001.safetensors")
    runs = {"bad_data": ["--dataset", str(bad)],
            "damaged": ["--resume", str(damaged / "checkpoint-4")]}
    results = launch_layouts(tmp_path / "ranks", trained["common"], runs, nproc=2)
    assert all(r["exit"] == 2 for r in results.values()), results
    stderr = (tmp_path / "ranks" / "stderr.txt").read_text()
    lines = [line for line in stderr.splitlines() if "error:" in line]
    assert len(lines) == 2 and all(line.count("error:") == 1 for line in lines), stderr[-3000:]
    assert any(f"--dataset {said}" in line for line in lines)
    assert any("the checkpoint is damaged" in line and "shard-00001.safetensors is 100 bytes" in line for line in lines)


def test_a_damaged_model_folder_is_one_line_before_any_weight_is_read(trained, tmp_path, capsys):
    """A weight file cut short (found from the safetensors header, no tensor read) and a tokenizer
    file that does not parse."""
    model = tmp_path / "model"
    shutil.copytree(trained["model"], model)
    argv = [*trained["common"], "--model", str(model), "--output-dir", str(tmp_path / "out")]
    weights = (model / "model.safetensors").read_bytes()
    (model / "model.safetensors").write_bytes(weights[:len(weights) // 2])
    line = one_error(capsys, argv)
    assert f"--model {model}: {model / 'model.safetensors'} is damaged or incomplete" in line
    assert "copy or download the model again" in line
    (model / "model.safetensors").write_bytes(weights)
    (model / "tokenizer.json").write_text('{"version": "1.0", "trunc')
    assert "the tokenizer could not be loaded" in one_error(capsys, argv)


def test_a_full_disk_at_the_data_cache_or_before_the_first_step_is_one_line(trained, tmp_path, tmpfs, monkeypatch,
                                                                            capsys):
    """The tokenized-data cache on a full disk names the cache folder and TOOLKIT_CACHE; a full output
    disk at the run's first write names the file. Nothing half-built is left in the cache."""
    from conftest import make_records

    data = tmp_path / "more.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in make_records("alpaca", 2000)))
    cache = tmpfs(64) / "cache"
    monkeypatch.setenv("TOOLKIT_CACHE", str(cache))
    # one tokenizing process: datasets' map with workers rebinds os.environ to a copy, and monkeypatch
    # would then restore the copy it no longer sees
    line = one_error(capsys, [*trained["common"], "--dataset", str(data), "--data-workers", "1",
                              "--output-dir", str(tmp_path / "out")])
    assert "could not write the tokenized data cache in" in line and "set TOOLKIT_CACHE to a folder" in line
    assert not [p for p in (cache / "data").iterdir() if p.is_dir()]  # the lock file only
    monkeypatch.undo()
    full = tmpfs(64)
    (full / "filler").write_bytes(b"\0" * 60_000)
    with pytest.raises(OSError):
        (full / "filler2").write_bytes(b"\0" * 100_000)
    line = one_error(capsys, [*trained["common"], "--output-dir", str(full / "out")])
    assert f"could not write {full / 'out' / 'config.yaml'}: no space left on device; free space on that disk" in line


def test_the_preemption_handler_is_put_back_when_set_up_fails_and_a_forked_worker_still_dies(trained, tmp_path,
                                                                                             monkeypatch):
    """A run that fails between installing its SIGTERM handler and its first step puts the old handler back;
    a process forked under the handler (a `datasets` map worker) dies on SIGTERM, as a pool's `terminate`
    needs: it had kept only a flag, and the pool waited on it for ever."""
    import signal
    import time

    from toolkit.train import loop
    from toolkit.train.faults import Preemption

    before = signal.getsignal(signal.SIGTERM)

    def broken(*args, **kwargs):
        raise RuntimeError("metrics could not start")

    monkeypatch.setattr(loop, "MetricsLogger", broken)
    with pytest.raises(RuntimeError, match="metrics could not start"):
        finetune.main([*trained["common"], "--max-steps", "1", "--output-dir", str(tmp_path / "out")])
    assert signal.getsignal(signal.SIGTERM) is before
    preemption = Preemption()
    try:
        pid = os.fork()
        if pid == 0:
            time.sleep(20)
            os._exit(0)
        time.sleep(0.2)
        os.kill(pid, signal.SIGTERM)
        _, status = os.waitpid(pid, 0)
    finally:
        preemption.restore()
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM
    assert preemption.signal is None
