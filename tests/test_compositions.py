"""Composed layouts on one device mesh (4 or 8 gloo ranks, tiny Llama, fp32): each gives the
single-process per-step losses and gradient norms within 1e-4 (relative), its saved `final/`
within 1e-5 of the single-process one, passes the integrity reload, and holds the bytes the
planner predicts on every rank; hsdp, 3d and cp2 x dp_shard2 also resume from
their own checkpoint exactly (1e-6: losses of the remaining steps and final weights).

Global batch 8 everywhere: one process x micro-batch 8; tp2 x dp_shard2 x mb 2 x accum 2;
dp_replicate2 x dp_shard2 x mb 2; pp2 x tp2 x mb 8, pp2 x dp_shard2 x mb 4 and
pp2 x dp_shard2 x tp2 x mb 4, each in 2 pipeline micro-batches. Context parallel (each cp rank
holds half of every sequence): cp2 x dp2 x mb 4 on packed rows (against one process on the same
packed rows), cp2 x dp_shard2 x mb 4 with gradient checkpointing, cp2 x tp2 x mb 8 (a model with
4 key/value heads, so they split over tp x cp).
"""

import json

import pytest
import torch
from distributed import launch_layouts, parity_args, run_stdout
from helpers import build_model_dir, losses, records
from safetensors.torch import load_file

PACKED = ["--packing", "--seq-len", "160"]  # 16 rows of about two documents: 2 global batches of 8

SHARDED = "parameters, gradients and optimizer state sharded; parameters resharded after each block's forward " \
    "(ZeRO-3-like))"
LAYOUTS = {
    "tp2_dp_shard2": (["--tp", "2", "--dp-shard", "2", "--micro-batch-size", "2", "--grad-accum", "2"],
                      f"layout: device mesh dp_shard 2 x tp 2 (FSDP2 over ('dp_shard',), TP layers inside: {SHARDED}"),
    "hsdp": (["--dp-replicate", "2", "--dp-shard", "2", "--micro-batch-size", "2"],
             f"layout: device mesh dp_replicate 2 x dp_shard 2 (FSDP2 over ('dp_replicate', 'dp_shard'): {SHARDED}"),
    "pp2_tp2": (["--pp", "2", "--tp", "2", "--pp-microbatches", "2", "--micro-batch-size", "8"],
                "layout: device mesh pp 2 x tp 2\npipeline: 2 stages x 1 data-parallel"),
    "pp2_dp_shard2": (["--pp", "2", "--dp-shard", "2", "--pp-microbatches", "2", "--micro-batch-size", "4"],
                      "layout: device mesh pp 2 x dp_shard 2\npipeline: 2 stages x 2 data-parallel"),
    "3d": (["--pp", "2", "--dp-shard", "2", "--tp", "2", "--pp-microbatches", "2", "--micro-batch-size", "4"],
           "layout: device mesh pp 2 x dp_shard 2 x tp 2\npipeline: 2 stages x 2 data-parallel"),
}
CP = "context parallel: 2 ranks per sequence (Ulysses all-to-all attention)"
LAYOUTS.update({  # context parallel, one method each (4-rank runs are dear on 2 cores)
    "cp2_dp2_packed": (["--cp", "2", "--micro-batch-size", "4", *PACKED],
                       f"layout: device mesh dp_replicate 2 x cp 2 (DDP over dp x cp)\n{CP}"),
    "cp2_dp_shard2": (["--cp", "2", "--dp-shard", "2", "--micro-batch-size", "4", "--gradient-checkpointing"],
                      f"layout: device mesh dp_shard 2 x cp 2 (FSDP2 over ('dp_shard_cp',): {SHARDED}\n{CP}"),
    "cp2_tp2": (["--cp", "2", "--tp", "2", "--micro-batch-size", "8"],
                f"layout: device mesh cp 2 x tp 2 (TP layers, DDP over dp x cp)\n{CP}"),
})
METHODS = {"cp2_dp2_packed": ["full"], "cp2_dp_shard2": ["lora"], "cp2_tp2": ["full"],
           "3d": ["lora"]}  # 8 ranks on 2 cores: one method (each pair of its dimensions runs both)
# The one-process run each layout is held to: packed rows, or a model whose 4 key/value heads split over tp x cp.
REFERENCE = {"cp2_dp2_packed": ("single_packed", ["--micro-batch-size", "8", *PACKED]),
             "cp2_tp2": ("single_mha", ["--micro-batch-size", "8"])}
RANKS = {"3d": 8}
# Resumed once each, full finetune or LoRA: 3d's sharded optimizer state of TP slices on pipeline
# stages covers tp2_dp_shard2's and pp2_tp2's (4- and 8-rank runs are dear on 2 cores).
# pp2 x dp_shard2 writes and reads sharded checkpoints in tests/test_reshard.py's LoRA chain.
RESUMED = {"hsdp": "full", "cp2_dp_shard2": "lora"}  # 3d's pieces (pp x tp x dp_shard): test_reshard's chains


@pytest.fixture(scope="module")
def mha_model(tmp_path_factory):
    return build_model_dir(tmp_path_factory.mktemp("mha") / "model", num_key_value_heads=4)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model, mha_model, data_files):
    """(layout, method) -> output dir, and (layout, method, "resumed") for the resumed runs; 'single'
    (and 'single_packed', 'single_mha') the one-process references. One launch per world size
    (tests/layouts.py): the references in one process, every 4-rank layout (and the resumes from their
    checkpoint-2, after the run that wrote it) in one 4-rank launch, 3d in one 8-rank launch. Every
    run saves checkpoint-2 and checkpoint-4."""
    args = parity_args(tiny_model, data_files["chat"], "unused", "full")
    i = args.index("--output-dir")
    common = args[:i] + args[i + 2:] + ["--save-every", "2"]
    pairs = [(lay, m) for lay in LAYOUTS for m in METHODS.get(lay, ["full", "lora"])]
    references = {"single": ["--micro-batch-size", "8"], **dict(REFERENCE.values())}

    def flags(layout, method):
        model = ["--model", str(mha_model)] if layout in ("cp2_tp2", "single_mha") else []
        extra = references[layout] if layout in references else LAYOUTS[layout][0]
        return ["--method", method, *model, *extra]

    def name(*key):
        return "_".join(key)

    groups = {1: {name(REFERENCE.get(lay, ("single",))[0], m): flags(REFERENCE.get(lay, ("single",))[0], m)
                  for lay, m in pairs}, 4: {}, 8: {}}
    roots = {n: tmp_path_factory.mktemp(f"ranks{n}") for n in groups}
    for lay, m in pairs:
        n = RANKS.get(lay, 4)
        groups[n][name(lay, m)] = flags(lay, m)
        if RESUMED.get(lay) == m:
            groups[n][name(lay, m, "resumed")] = flags(lay, m) + ["--resume",
                                                                  str(roots[n] / name(lay, m) / "checkpoint-2")]
    outs = {}
    for n, group in groups.items():
        for key, r in launch_layouts(roots[n], common, group, nproc=n, launcher="fork").items():
            assert r["exit"] == 0, f"{key}:\n{(roots[n] / 'stderr.txt').read_text()[-4000:]}"
            outs[key] = r["out"]
    return lambda *key: outs[name(*key)]


def final_weights(out, method):
    return load_file(out / "final" / ("adapter_model.safetensors" if method == "lora" else "model.safetensors"))


@pytest.mark.parametrize("layout, method", [(lay, m) for lay in LAYOUTS for m in METHODS.get(lay, ["full", "lora"])])
def test_composed_layout_matches_one_process(runs, layout, method):
    ref, out = runs(REFERENCE.get(layout, ("single",))[0], method), runs(layout, method)
    want = records(ref, "loss")
    got = records(out, "loss")
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5]
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], rel=1e-4)
    assert [r["grad_norm"] for r in got] == pytest.approx([r["grad_norm"] for r in want], rel=1e-4)
    got_w, want_w = final_weights(out, method), final_weights(ref, method)
    assert got_w.keys() == want_w.keys()  # the standard HF / peft names, full (unsharded) shapes
    for k in want_w:
        torch.testing.assert_close(got_w[k], want_w[k], atol=1e-5, rtol=0, msg=f"{layout}/{method}: {k}")
    assert json.loads((out / "integrity.json").read_text())["ok"]
    said = run_stdout(out)
    assert all(line in said for line in LAYOUTS[layout][1].splitlines()), said  # the TP line may sit between


@pytest.mark.parametrize("layout, method", [(lay, m) for lay in LAYOUTS for m in METHODS.get(lay, ["full", "lora"])])
def test_planner_predicts_every_ranks_model_state(runs, tiny_model, mha_model, layout, method):
    """The planner's bytes for the layout that ran (`toolkit.planner.layouts.stage_bytes`, for the
    rank's pipeline stage) against each rank's weights, gradients and Adam state measured at step 1
    (`metrics.jsonl`): within 5%. The runs are the parity test's, not launched again."""
    from toolkit.layout.dims import infer_dims
    from toolkit.planner.layouts import stage_bytes
    from toolkit.planner.estimate import PlanInput

    argv = LAYOUTS[layout][0]

    def flag(name, default):
        return int(argv[argv.index(name) + 1]) if name in argv else default

    world = RANKS.get(layout, 4)
    dims, problems = infer_dims(world, tp=flag("--tp", 1), pp=flag("--pp", 1), cp=flag("--cp", 1),
                                dp_shard=flag("--dp-shard", 0), dp_replicate=flag("--dp-replicate", 0))
    assert not problems
    model = mha_model if layout == "cp2_tp2" else tiny_model
    inp = PlanInput(model=json.loads((model / "config.json").read_text()), gpu_memory=2**40, gpus_per_node=world,
                    method=method, lora_r=16, seq_len=64, micro_batch=flag("--micro-batch-size", 1), precision="no")
    measured = records(runs(layout, method))[0]
    for rank in range(world):
        want = stage_bytes(inp, dims, rank // (world // dims.pp), False, inp.micro_batch)  # pp is the outermost dim
        assert measured["param_bytes"][rank] == pytest.approx(want["weights"], rel=0.05), rank
        assert measured["grad_bytes"][rank] == pytest.approx(want["grads"], rel=0.05), rank
        assert measured["optim_bytes"][rank] == pytest.approx(want["optimizer"], rel=0.05), rank


@pytest.mark.parametrize("layout", list(RESUMED))
def test_composed_layout_resumes_exactly(runs, layout):
    """Per-rank optimizer state of FSDP2 shards of TP slices / pipeline stages of TP slices: continuing
    from checkpoint-2 in the same layout reproduces the uninterrupted run's steps 3-5 and weights."""
    method = RESUMED[layout]
    full, out = runs(layout, method), runs(layout, method, "resumed")
    assert "continuing at step 3" in run_stdout(out)
    got = losses(out, steps=True)
    want = [(s, v) for s, v in losses(full, steps=True) if s >= 3]
    assert [s for s, _ in got] == [3, 4, 5]
    assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-6, abs=1e-6)
    got_w, want_w = final_weights(out, method), final_weights(full, method)
    for k in want_w:
        torch.testing.assert_close(got_w[k], want_w[k], atol=1e-6, rtol=1e-6, msg=f"{layout}: {k}")
