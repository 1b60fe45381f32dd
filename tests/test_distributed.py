"""Multi-process behaviour on 2 gloo ranks: the global batch, not its split, defines the update."""

import pytest
import torch
from distributed import launch, run_distributed
from helpers import losses
from safetensors.torch import load_file


def args(tiny_model, dataset, out, mb, ga):
    return ["--model", str(tiny_model), "--dataset", str(dataset), "--output-dir", str(out), "--method", "full",
            "--seq-len", "64", "--micro-batch-size", str(mb), "--grad-accum", str(ga), "--max-steps", "5",
            "--log-every", "1", "--lr", "1e-3", "--warmup-steps", "0", "--lr-schedule", "linear",
            "--mixed-precision", "no"]


def test_global_batch_invariance(tmp_path, tiny_model, data_files):
    """1 process x micro-batch 8 == 2 processes x micro-batch 2 x accumulation 2 (torchrun and
    accelerate launch), per-step losses and final weights within 1e-5 in fp32. 5 steps over 32
    examples cross an epoch boundary."""
    runs = {"single": (1, 8, 1, "python"), "torchrun": (2, 2, 2, "torchrun"), "accelerate": (2, 4, 1, "accelerate")}
    out = {}
    for name, (nproc, mb, ga, launcher) in runs.items():
        out[name] = tmp_path / name
        p = launch(args(tiny_model, data_files["chat"], out[name], mb, ga), nproc=nproc, launcher=launcher)
        assert p.returncode == 0, p.stderr[-3000:]
    ref = losses(out["single"])
    ref_w = load_file(out["single"] / "final" / "model.safetensors")
    assert len(ref) == 5 and ref[-1] < ref[0]
    for name in ("torchrun", "accelerate"):
        assert losses(out[name]) == pytest.approx(ref, abs=1e-5, rel=1e-5), name
        w = load_file(out[name] / "final" / "model.safetensors")
        assert w.keys() == ref_w.keys()
        for k in ref_w:
            torch.testing.assert_close(w[k], ref_w[k], atol=1e-5, rtol=0, msg=f"{name}: {k}")


def _rank_examples(n: int, mb: int, epochs: int) -> list[list[int]]:
    from toolkit.config import parse_config
    from toolkit.parallel.build import make_accelerator
    from toolkit.data.loader import make_loader

    cfg = parse_config(["--micro-batch-size", str(mb), "--output-dir", "/nonexistent-out"])
    accelerator = make_accelerator(cfg)
    loader = accelerator.prepare(make_loader([{"input_ids": [i, i], "labels": [i, i]} for i in range(n)], cfg, 0))
    seen = []
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        seen.append([i for b in loader for i in b["input_ids"][:, 0].tolist()])
    return seen


def test_ddp_ranks_see_disjoint_data_covering_the_epoch():
    r0, r1 = run_distributed(_rank_examples, 2, 24, 3, 2)
    for epoch in range(2):
        assert not set(r0[epoch]) & set(r1[epoch])
        assert sorted(r0[epoch] + r1[epoch]) == list(range(24))
    assert r0[0] != r0[1]  # reshuffled each epoch
