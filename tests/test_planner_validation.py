"""Planner predictions vs bytes measured per rank (metrics.jsonl, first record) on 2 gloo ranks."""

import json

import pytest
from distributed import launch

from toolkit.planner.memory import STRATEGIES, grads_bytes, optimizer_bytes, weights_bytes
from toolkit.planner.params import count_params, lora_params

FLAGS = {"ddp": [], "zero1": ["--zero-stage", "1"], "zero2": ["--zero-stage", "2"], "zero3": ["--zero-stage", "3"],
         "fsdp_full": ["--fsdp"]}


@pytest.mark.parametrize("method", ["full", "lora"])
@pytest.mark.parametrize("name", list(FLAGS))
def test_model_state_bytes_within_5_percent_of_measured(tmp_path, tiny_model, data_files, name, method):
    out = tmp_path / "run"
    p = launch(["--model", str(tiny_model), "--dataset", str(data_files["chat"]), "--output-dir", str(out),
                "--method", method, "--lora-r", "8", "--seq-len", "64", "--max-steps", "1", "--micro-batch-size", "2",
                "--mixed-precision", "no", *FLAGS[name]], nproc=2)
    assert p.returncode == 0, p.stderr[-3000:]
    measured = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    cfg = json.loads((tiny_model / "config.json").read_text())
    params = count_params(cfg).total
    trainable = params if method == "full" else lora_params(cfg, 8, "all-linear")
    frozen = 0 if method == "full" else params  # LoRA: the base is frozen, the adapters are weights too
    s = STRATEGIES[name]
    for rank in range(2):
        assert measured["param_bytes"][rank] == pytest.approx(weights_bytes(s, frozen, trainable, 2, "no"), rel=0.05)
        optim = measured["optim_bytes"][rank] + measured["master_bytes"][rank]
        assert optim == pytest.approx(optimizer_bytes(s, trainable, 2), rel=0.05)
        if measured["grad_bytes"] is not None:  # null under DeepSpeed (freed inside its step)
            assert measured["grad_bytes"][rank] == pytest.approx(grads_bytes(s, trainable, 2, "no"), rel=0.05)
