"""scripts/gpu_acceptance.py end to end on this CPU (`--smoke`: tiny shapes), so the GPU run cannot rot
before a GPU is lent: every part runs, the correctness checks it can judge here hold in fp32, and
nothing is written to benchmarks/gpu/."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_acceptance.py"
BENCH = ROOT / "benchmarks" / "gpu"
PARTS = ("throughput_135m", "throughput_1b", "memory", "chunked_loss", "packing", "pipeline", "deepspeed", "launchers")


def snapshot() -> dict[str, bytes]:
    return {str(p.relative_to(BENCH)): p.read_bytes() for p in BENCH.rglob("*") if p.is_file()} if BENCH.is_dir() else {}


def test_smoke_runs_every_part(tmp_path):
    before = snapshot()
    p = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--smoke", "--out", str(tmp_path / "out"),
                        "--work", str(tmp_path / "work")], capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert snapshot() == before  # a smoke run's figures never reach benchmarks/gpu/
    parts = {name: json.loads((tmp_path / "out" / f"{name}.json").read_text()) for name in PARTS}
    for name, d in parts.items():
        assert d["smoke"] and d["env"]["device"] == "cpu"
        assert not [c for c in d["cases"] if "error" in c], name
        # on the CPU only correctness is judged (fp32: losses agree to 1e-4); speed and memory are not
        assert all(c["passed"] is not False for c in d["checks"]), (name, d["checks"])
    judged = {c["what"] for d in parts.values() for c in d["checks"] if c["passed"]}
    assert {"sdpa: packed vs unpacked loss (relative diff)", "pp2 vs one stage, per-step losses (max relative diff)",
            "losses, chunked vs full (max relative diff)", "zero2: saved model passes the integrity gate",
            "zero3_offload: saved model passes the integrity gate",
            "python finetune.py --zero-stage 3: trains, saved folder passes the integrity gate",
            "accelerate launch --use_fsdp: trains, saved folder passes the integrity gate"} <= judged
    assert all(c["passed"] is None for c in parts["memory"]["checks"]) and len(parts["memory"]["checks"]) == 4
    assert parts["memory"]["skipped"] and parts["packing"]["skipped"]  # qlora and flash-attn need a GPU: said so
    for d in (parts["throughput_135m"], parts["throughput_1b"]):
        assert {"toolkit/raw", "toolkit/trainer"} <= set(d["cases"][0]["ratios"]) and d["cases"][0]["mfu"]["toolkit"] > 0
    readme = (tmp_path / "out" / "README.md").read_text()
    assert all(f"| {name} |" in readme for name in PARTS) and "(smoke)" in readme


def test_smoke_refuses_the_benchmarks_folder_and_cpu_without_smoke():
    for args, words in ((["--smoke", "--device", "cpu", "--out", str(BENCH)], "never writes to benchmarks/gpu"),
                        (["--device", "cpu"], "need a CUDA GPU"), (["--parts", "speed"], "unknown speed")):
        p = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=ROOT)
        assert p.returncode != 0 and words in p.stderr and "Traceback" not in p.stderr, p.stderr
