"""The planner's time model: what each term does to a prediction, and `plan --calibrate`."""

import json
import subprocess
import sys

import pytest
from distributed import ROOT, free_port

from toolkit.cli.main import main as cli
from toolkit.layout.dims import ParallelDims
from toolkit.planner.cost import HARDWARE, Hardware, optimizer_step_seconds
from toolkit.planner.memory import STRATEGIES
from toolkit.planner.estimate import PlanInput, estimate, estimate_layout
from toolkit.planner.presets import PRESETS

GiB = 1024**3


def hardware(**changes) -> Hardware:
    return Hardware(**{**HARDWARE["h100-sxm"].to_json(), **changes})


def inp(hw: Hardware, **kw) -> PlanInput:
    return PlanInput(model=PRESETS["llama-3-8b"], gpu_memory=10**15, gpus_per_node=8, nodes=kw.pop("nodes", 2),
                     method=kw.pop("method", "full"), seq_len=2048, hardware=hw, **kw)


def test_accumulation_pays_ddps_all_reduce_once_and_deepspeeds_every_time():
    """DDP skips the gradient all-reduce until the last accumulated micro-batch; DeepSpeed's ZeRO-2
    reduces every one. Nothing hidden (overlap 0), across nodes: the all-reduce is a real cost."""
    plan_in = inp(hardware(overlap=0.0))
    ddp, zero2 = estimate(plan_in, STRATEGIES["ddp"], False, 1), estimate(plan_in, STRATEGIES["zero2"], False, 1)
    for c in (ddp, zero2):
        assert c.step_seconds > c.once_seconds >= 0
    assert ddp.once_seconds > 0.1 * ddp.step_seconds and zero2.once_seconds < 0.1 * zero2.step_seconds

    def per_example(c, accumulation):
        return optimizer_step_seconds(c.step_seconds, c.once_seconds, accumulation) / accumulation

    assert per_example(ddp, 8) < 0.8 * per_example(ddp, 1)
    assert per_example(zero2, 8) > 0.95 * per_example(zero2, 1)


def test_overlap_hides_data_parallel_traffic_not_tensor_parallel():
    """FSDP's gathers and reduce-scatters run behind compute; TP's all-reduces block the next layer."""
    hidden, exposed = inp(hardware(overlap=1.0), nodes=1), inp(hardware(overlap=0.0), nodes=1)
    fsdp = [estimate(i, STRATEGIES["fsdp_full"], False, 1).step_seconds for i in (hidden, exposed)]
    assert fsdp[0] < 0.9 * fsdp[1]
    tp8 = [estimate_layout(i, ParallelDims(8, tp=8), False, 1).step_seconds for i in (hidden, exposed)]
    assert tp8[0] == pytest.approx(tp8[1], rel=1e-3)  # no data-parallel traffic at tp 8 on 8 GPUs
    cross = estimate_layout(inp(HARDWARE["h100-sxm"], nodes=2), ParallelDims(16, tp=8, dp_replicate=2), False, 1)
    inside = estimate_layout(inp(HARDWARE["h100-sxm"], nodes=1), ParallelDims(8, tp=8), False, 1)
    assert cross.step_seconds > inside.step_seconds  # the data-parallel all-reduce now crosses nodes


def test_pipeline_bubble_shrinks_with_more_micro_batches():
    """(p - 1) / (m + p - 1): 4 stages at 1 example per pipeline micro-batch; 4 -> 32 examples cut
    the time per example by at least the bubble's change, (7/4) / (35/32)."""
    plan_in = inp(HARDWARE["h100-sxm"], nodes=1)
    d = ParallelDims(8, pp=4, dp_replicate=2)
    few, many = (estimate_layout(plan_in, d, False, mb) for mb in (4, 32))
    assert few.step_seconds / 4 > many.step_seconds / 32 * (7 / 4) / (35 / 32) * 0.95


def test_calibrate_writes_a_file_the_plan_reads(tmp_path, capsys):
    """`plan --calibrate` under torchrun (2 gloo ranks) measures this machine; `plan --hardware
    FILE` then predicts with those figures (CPU step times are far above the H100's)."""
    hw = tmp_path / "hw.json"
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                        str(free_port()), "-m", "toolkit", "plan", "--calibrate", "--output", str(hw)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(hw.read_text())
    assert got["peak_flops"]["fp32"] > 1e9 and 0 < got["efficiency"] <= 1 and 0 <= got["overlap"] <= 1
    assert got["intra_node_bw"] > 1e6 and got["collective_latency"] > 0 and got["measured"]["world_size"] == 2
    argv = ["plan", "--model", "smollm2-135m", "--gpus-per-node", "2", "--cpu-memory", "64GB", "--json"]
    cli(argv + ["--hardware", str(hw)])
    cpu = json.loads(capsys.readouterr().out)
    cli(argv)
    h100 = json.loads(capsys.readouterr().out)
    assert cpu["hardware"].startswith("calibrated: CPU") and h100["hardware"] == "h100-sxm"
    assert cpu["chosen_detail"]["step_seconds"] > 100 * h100["chosen_detail"]["step_seconds"]


@pytest.mark.parametrize("content, message", [
    (None, "--hardware {path}: not a preset (h100-sxm, a100-80gb, l40s, cpu) or a file"),
    ("{not json", "--hardware {path}: not a hardware file"),
    ('{"name": "x"}', "--hardware {path}: not a hardware file"),
])
def test_bad_hardware_is_one_clear_error(tmp_path, capsys, content, message):
    path = tmp_path / "hw.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit) as e:
        cli(["plan", "--hardware", str(path)])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message.format(path=path) in err[0]


def test_the_planner_imports_no_torch():
    """Pure Python over numbers (the style guide's rule): a fresh interpreter importing the planner,
    `estimate` and `explain` included, loads neither torch nor torch.distributed."""
    code = ("import sys, toolkit.planner.estimate, toolkit.planner.explain, toolkit.planner.auto, "
            "toolkit.planner.layouts\n"
            "print(sorted(m for m in ('torch', 'torch.distributed') if m in sys.modules))")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip() == "[]"


def test_strategy_auto_runs_the_mesh_layout_it_plans(tmp_path, tiny_model, data_files):
    """`--strategy auto` on 2 gloo ranks with a hardware file whose links are slow (1 MB/s, no
    overlap): any data-parallel layout moves the whole gradient each step, a 2-stage pipeline only
    the activations at its boundary, so the planner picks pp2 and the run trains as a pipeline,
    saves a folder that reloads (integrity gate) and records the layout in config.yaml."""
    import yaml
    from distributed import launch
    from helpers import records

    hw = tmp_path / "slow_links.json"
    hw.write_text(json.dumps({**HARDWARE["cpu"].to_json(), "name": "slow links", "intra_node_bw": 1e6,
                              "inter_node_bw": 1e6, "collective_latency": 0.0, "overlap": 0.0}))
    out = tmp_path / "run"
    p = launch(["--model", str(tiny_model), "--dataset", str(data_files["chat"]), "--output-dir", str(out),
                "--method", "full", "--seq-len", "64", "--max-steps", "3", "--mixed-precision", "no",
                "--strategy", "auto", "--micro-batch-size", "2", "--grad-accum", "2"], nproc=2,
               env={"TOOLKIT_HARDWARE": str(hw)})
    assert p.returncode == 0, p.stderr[-3000:]
    plan = json.loads((out / "plan.json").read_text())
    assert plan["chosen"] == "pp2" and plan["hardware"] == "slow links"
    assert "pipeline: 2 stages" in p.stdout and "time model slow links" in p.stdout
    cfg = yaml.safe_load((out / "config.yaml").read_text())
    assert cfg["pp"] == 2 and cfg["micro_batch_size"] * cfg["grad_accum"] == 2 * 2 * 2  # the global batch kept
    assert cfg["pp_microbatches"] == cfg["micro_batch_size"]
    assert [r["step"] for r in records(out) if "loss" in r][-1] == 3
    assert json.loads((out / "integrity.json").read_text())["ok"]
