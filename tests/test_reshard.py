"""Checkpoints that move between layouts (gloo, tiny Llama, fp32, dropout 0).

One 8-step run per method is stopped after each step (a preemption: SIGTERM, checkpoint, exit 143)
and resumed on another layout, the last layout running to the end: full finetune crosses 7 layout
changes in 8 launches, LoRA 4 in 5;
its per-step losses must equal the uninterrupted one-process run's within 1e-5 and its final
weights within 1e-5. Each step's loss is the first thing computed from the weights the previous
segment loaded and updated, so a wrong piece of a weight or of an Adam moment shows at the step
after the change that broke it. The global batch (8) is set by the first segment and kept by every
later one, which asks for micro-batch 2 x accumulation 4 and is re-split.

Transitions the issue names: 2-rank DDP -> 1 process, 1 process -> FSDP2 2 ranks, tp2 -> dp2,
pp2 x dp2 -> tp2 x dp2, FSDP2 4 -> 2 ranks. Full finetune runs accelerate's FSDP2 plugin and plain
pipeline stages; LoRA runs the device mesh's FSDP2 (dp_shard), also on pipeline stages and around
the TP layers.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from distributed import ROOT, launch
from helpers import losses
from safetensors.torch import load_file

STEPS = 8
TOL = 1e-5
PP = ["--pp", "2", "--pp-microbatches", "2"]

# (name, flags, processes), one segment per step, the last one to the end (saving checkpoint-7 on the
# way); the first sets the global batch to 8. LoRA leaves out the dp2 and one-process segments the
# full chain runs.
CHAINS = {
    "full": [("pp2_dp2", PP, 4), ("tp2_dp2", ["--tp", "2"], 4), ("tp2", ["--tp", "2"], 2), ("dp2", [], 2),
             ("one", [], 1), ("fsdp2", ["--fsdp"], 2), ("fsdp4", ["--fsdp"], 4), ("fsdp2_again", ["--fsdp"], 2)],
    "lora": [("pp2_dp_shard2", [*PP, "--dp-shard", "2"], 4), ("tp2_dp_shard2", ["--tp", "2", "--dp-shard", "2"], 4),
             ("tp2", ["--tp", "2"], 2), ("dp_shard4", ["--dp-shard", "4"], 4), ("dp_shard2", ["--dp-shard", "2"], 2)],
}


def args(model, data, out, method: str, extra=()) -> list[str]:
    return ["--model", str(model), "--dataset", str(data), "--output-dir", str(out), "--method", method,
            "--seq-len", "64", "--max-steps", str(STEPS), "--log-every", "1", "--lr", "1e-3", "--warmup-steps", "2",
            "--lr-schedule", "linear", "--mixed-precision", "no", "--lora-dropout", "0", "--seed", "7",
            "--micro-batch-size", "2", "--grad-accum", "4", "--lora-r", "128", *extra]


def run_chain(model, data, out, method: str) -> list[subprocess.CompletedProcess]:
    """Segment i runs on its layout until a preemption after step i (the last one to the end)."""
    done, last = [], len(CHAINS[method])
    for i, (name, flags, nproc) in enumerate(CHAINS[method], start=1):
        extra = [*flags, *(["--grad-accum", "2"] if i == 1 else ["--resume", "auto"])]  # mb 2 x 2 x dp 2 = 8
        extra += ["--save-every", "7"] if i == last else []
        env = {"TOOLKIT_FAULT": f"step:{i}:signal=term"} if i < last else None
        p = launch(args(model, data, out, method, extra), nproc=nproc, env=env,
                   launcher="fork")
        # preempted: exit 143 (torchrun reports its ranks' 143 as 1), checkpoint-i published
        ok = p.returncode == 0 if i == last else p.returncode in (143, 1) and (out / f"checkpoint-{i}").is_dir()
        assert ok, f"segment {i} ({name}): exit {p.returncode}\n{p.stderr[-3000:]}"
        done.append(p)
    return done


@pytest.fixture(scope="module")
def chains(tmp_path_factory, tiny_model, data_files):
    """{method: (reference out, chain out, [each segment's process])}, run once for the module."""
    cache = {}

    def get(method: str):
        if method not in cache:
            ref, out = tmp_path_factory.mktemp(f"ref_{method}"), tmp_path_factory.mktemp(f"chain_{method}")
            p = launch(args(tiny_model, data_files["alpaca"], ref, method, ["--save-every", "7"]), launcher="fork")
            assert p.returncode == 0, p.stderr[-3000:]
            cache[method] = ref, out, run_chain(tiny_model, data_files["alpaca"], out, method)
        return cache[method]

    return get


@pytest.mark.parametrize("method", ["full", "lora"])
def test_resume_on_another_layout_matches_the_uninterrupted_run(chains, method):
    ref, out, segments = chains(method)
    names = [name for name, _, _ in CHAINS[method]]
    for i, p in enumerate(segments[1:], start=2):  # each later segment says how it continues
        assert f"continuing at step {i} of {STEPS}" in p.stdout, (names[i - 1], p.stdout[-2000:])
        assert "resharding: the checkpoint was written by" in p.stdout, names[i - 1]
        dp = {"one": 1, "tp2": 1, "fsdp4": 4, "dp_shard4": 4}.get(names[i - 1], 2)
        assert (f"global batch 8 kept: micro-batch 2 x accumulation {4 // dp} x {dp} data-parallel ranks"
                in p.stdout) == (dp != 1), (names[i - 1], p.stdout[-2000:])
    got, want = dict(losses(out, steps=True)), dict(losses(ref, steps=True))
    assert sorted(got) == list(range(1, STEPS + 1))  # every step logged once
    for step in want:
        on = min(step, len(names)) - 1
        assert got[step] == pytest.approx(want[step], abs=TOL), \
            f"step {step}, on {names[on]}" + (f", the first after {names[on - 1]}" if on == step - 1 > 0 else "")
    file = "adapter_model.safetensors" if method == "lora" else "model.safetensors"
    a, b = load_file(out / "final" / file), load_file(ref / "final" / file)
    assert a.keys() == b.keys()
    for k in b:
        torch.testing.assert_close(a[k], b[k], atol=TOL, rtol=0, msg=k)


@pytest.mark.parametrize("method", ["full", "lora"])
def test_convert_checkpoint_writes_a_folder_plain_transformers_loads(chains, tiny_model, tmp_path, method):
    """checkpoint-7, written by FSDP2 over 4 ranks (full) or 2 (LoRA), converted on one process,
    equals the one-process run's checkpoint-7 converted, and loads in plain transformers / peft with
    every key used."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ref, out, _ = chains(method)
    for src, dst in ((out / "checkpoint-7", tmp_path / "chain"), (ref / "checkpoint-7", tmp_path / "ref")):
        p = subprocess.run([sys.executable, "-m", "toolkit", "convert-checkpoint", str(src), "--output", str(dst)],
                           cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-2000:]
    file = "adapter_model.safetensors" if method == "lora" else "model.safetensors"
    a, b = load_file(tmp_path / "chain" / file), load_file(tmp_path / "ref" / file)
    assert a.keys() == b.keys() and a
    for k in b:
        torch.testing.assert_close(a[k], b[k], atol=TOL, rtol=0, msg=k)
    if method == "full":
        model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "chain", output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], info
        loaded = dict(model.named_parameters())
    else:
        base = AutoModelForCausalLM.from_pretrained(tiny_model)
        loaded = {k.replace(".default.", "."): v for k, v in
                  PeftModel.from_pretrained(base, tmp_path / "chain").named_parameters() if "lora_" in k}
    for k, v in a.items():  # what the file holds is what the model got (a misnamed key would stay at its init)
        assert torch.equal(loaded[k], v), k


def test_a_lora_checkpoint_holds_the_adapter_and_its_optimizer_state_only(chains):
    """The sharded state of a LoRA checkpoint (its safetensors files) is at most 1.05x the adapter plus
    Adam's two moments, from one process and from FSDP2 over 2 and 4 ranks: the frozen base is never
    written, and replicas write their pieces once. (Rank 128 on hidden 64 keeps each FSDP2 piece at
    about 8 KB, so safetensors' per-tensor header, about 200 bytes, stays a few percent, as it is for a
    real adapter's pieces; the per-rank RNG files and tokenizer are fixed-size and not counted.)"""
    ref, out, _ = chains("lora")
    adapter = sum(v.numel() * v.element_size() for v in load_file(ref / "final" / "adapter_model.safetensors").values())
    sizes = {}
    for folder, layout in ((ref / "checkpoint-7", "one rank"), (out / "checkpoint-7", "dp_shard 2"),
                           (out / "checkpoint-4", "dp_shard 4")):
        state = json.loads((folder / "trainer_state.json").read_text())
        assert state["format"] == "sharded" and state["layout"] == layout, state["layout"]
        sizes[layout] = sum(f.stat().st_size for f in (folder / "state").glob("*.safetensors"))
    assert all(size <= 1.05 * 3 * adapter for size in sizes.values()), (sizes, 3 * adapter)
