"""The `user` part of gpu_acceptance.py: `finetune.py` as users run it, a subprocess each, on a
real data file, with default flags but for the model, the case's own and a step cap.

A user runs `python finetune.py --dataset data.json --packing` and reads what it prints; the published
figures came from library calls on fixed batches instead, and one H100 found what they missed (no run
started with scikit-learn installed, packing refused in bf16, cce crashing in fp32). Each case
records whether it started (a first step in metrics.jsonl), the seconds from launch to that step, steady
tokens/s and the spread of step times after the first WARMUP steps (one record a step: a run this short
logs every step by default), the allocator's peak over the steps (summary.json), the start-up checks'
gaps (the loss trained against the model's own, packed documents against each alone) and whether the
saved folder passed the integrity check; or the error line it stopped with.

Images (issue 73): the `vlm` case trains the Qwen2.5-VL-3B shape (random weights, Qwen2.5-VL's own image
processor settings, the tests' tokenizer: no hub files reach the GPU machine) with LoRA on the language model, the
toolkit's defaults (padding-free image rows), on VLM_RECORDS chat records, each a GSM8K record with a drawn
448 x 448 picture (256 image tokens) before its question; the yardstick part runs TRL's SFTTrainer on the same
file and model (sft_trainer_user.py: padded batches, which TRL's SFTTrainer keeps for vision datasets).

Data: the first RECORDS records of GSM8K in alpaca form (`../shared/data/gsm8k_train_alpaca.json`, or the
copy `benchmarks/gpu/gpu_wheels.sh` puts in `.whl/` for the GPU machine, which has no ../shared); synthetic
records where neither exists (a fresh checkout's smoke run). DPO reads pairs made from them: the
record's answer chosen, the next record's rejected. Models (random weights: speed and memory need no
trained ones): the Llama-3.2-1B shape, a 0.73B Qwen3-MoE (every layer routed, as Qwen3-30B-A3B) and a
0.29B Gemma-2 (logit softcaps, sliding windows), all at 2048 tokens x micro-batch 4.

GRPO: `--objective grpo` on the Llama-1B shape (LoRA, bf16), GRPO_SETTINGS' G 8 completions of
256 tokens a step, prompts from the same GSM8K records (`{"prompt", "answer"}` JSONL) scored by
builtin:math_answer (cheap: a regex); its generation tokens/s, training tokens/s (the round left out)
and whole-step seconds from metrics.jsonl, and the decode path its log names. The yardstick part runs
TRL's GRPOTrainer on the same file and reward (grpo_trainer_user.py: its default `generate`, and
use_transformers_continuous_batching) beside it.

Time on one H100 (unmeasured: a guess from the first H100 runs, h100-2026-11-24/, 30-80 s of
start-up per process there): ~40 s a case, ~8 minutes for the 11 (the VLM case builds a 3.75B model first), and
the GRPO case ~100 s (start-up,
compiling the decode step, 6 steps); cases run in CASES' order (the figures the README quotes first),
and one that would end past the budget is left out and listed. GPU_USER_CASES (a regex on case names)
runs only the cases it matches, in this part and the yardstick: `GPU_USER_CASES=grpo` is the GRPO
comparison alone.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RECORDS = 1000
WARMUP = 3  # steps left out of the steady figures: compile, the allocator's first growth
DATA = (ROOT.parent / "shared" / "data" / "gsm8k_train_alpaca.json", ROOT / ".whl" / "gsm8k_train_alpaca.json")

# A 0.73B Qwen3-MoE (every layer routed: Qwen3-30B-A3B's decoder_sparse_step 1, mlp_only_layers []) and a
# 0.29B Gemma-2 (gemma-2-2b's softcaps and alternating sliding windows, fewer and narrower blocks).
QWEN3_MOE = dict(model_type="qwen3_moe", hidden_size=1024, intermediate_size=3072, num_hidden_layers=8,
                 num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_experts=32, num_experts_per_tok=4,
                 moe_intermediate_size=512, decoder_sparse_step=1, mlp_only_layers=[], vocab_size=151936,
                 max_position_embeddings=8192, output_router_logits=True, router_aux_loss_coef=0.001)
GEMMA2 = dict(model_type="gemma2", hidden_size=1024, intermediate_size=4096, num_hidden_layers=2, num_attention_heads=8,
              num_key_value_heads=4, head_dim=128, query_pre_attn_scalar=128, vocab_size=256000,
              final_logit_softcapping=30.0, attn_logit_softcapping=50.0, sliding_window=1024,
              layer_types=["sliding_attention", "full_attention"], max_position_embeddings=8192)
# Qwen/Qwen2.5-VL-3B-Instruct's config.json (text and vision_config) and preprocessor_config.json (min/max pixels),
# saved in bf16 as published; the vocabulary at its size (the head's cost); the tokenizer a BPE of 16384 trained on
# GSM8K itself (`tokenizer_texts`): 3.9 characters a token on its records (the tests' 384-token one makes 1.2, three
# times the tokens, and a padded batch's waste with them)
QWEN2_5_VL_3B = {"vlm": "qwen2_5_vl", "dtype": "bfloat16", "pixels": [3136, 12845056], "tokenizer_vocab": 16384,
                 "text": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                              num_key_value_heads=2, vocab_size=151936, max_position_embeddings=128000,
                              tie_word_embeddings=True, rope_parameters={"rope_type": "default",
                                                                         "mrope_section": [16, 24, 24],
                                                                         "rope_theta": 1000000.0}),
                 "vision": dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048,
                                patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                                fullatt_block_indexes=[7, 15, 23, 31], tokens_per_second=2, hidden_act="silu")}
VLM = "qwen2.5-vl-3b"
SHAPES = {"qwen3-moe-0.7b": QWEN3_MOE, "gemma2-0.3b": GEMMA2, VLM: QWEN2_5_VL_3B}
SMOKE_SHAPES = {"qwen3-moe-0.7b": {"model_type": "qwen3_moe", "mlp_only_layers": []},  # toolkit.model.synthetic.ZOO's
                "gemma2-0.3b": {"model_type": "gemma2"},
                VLM: {"vlm": "qwen2_5_vl"}}  # toolkit.model.synthetic.build_qwen_vl_dir's tiny one: 4-16 image tokens
VLM_RECORDS = 160  # the drawn pictures: enough for 30 steps of 4
VLM_SECONDS = 120  # a VLM case on one H100: a 3.75B model loaded (and built, the first time), 30 steps (a guess)
PICTURE = {False: 448, True: 112}  # a drawn picture's side (smoke: True): 448 px is 16 x 16 merged 28 px patches

PACKED = ["--packing"]
# (name, model, flags): in the order they run
CASES = [("lora", "llama-1b", [*PACKED, "--profile"]), ("full", "llama-1b", [*PACKED, "--method", "full"]),
         ("lora_compile", "llama-1b", [*PACKED, "--compile"]),
         ("full_compile", "llama-1b", [*PACKED, "--method", "full", "--compile"]),
         ("lora_unpacked", "llama-1b", ["--profile"]), ("lora_fp32", "llama-1b", [*PACKED, "--mixed-precision", "no"]),
         ("qlora", "llama-1b", [*PACKED, "--method", "qlora"]), ("dpo", "llama-1b", ["--objective", "dpo"]),
         ("qwen3_moe", "qwen3-moe-0.7b", PACKED), ("gemma2", "gemma2-0.3b", PACKED), ("vlm", VLM, [])]
GPU_ONLY = {"qlora": "QLoRA's 4-bit base needs bitsandbytes' CUDA kernels"}
SECONDS = 40  # a case on one H100, start-up included (a guess until measured)
# --objective grpo against TRL's GRPOTrainer (issue 65): G completions of `completion` tokens a step, `micro`
# completions a step (one prompt: TRL's default per_device_train_batch_size 8), `warmup` steps left out
# (the first compiles the decode step); --seq-len bounds the prompts (GSM8K's fit: none dropped, so both
# trainers read the same file)
GRPO_SETTINGS = {"generations": 8, "completion": 256, "micro": 8, "steps": 6, "warmup": 2, "seq_len": 1024}
GRPO_SMOKE = {**GRPO_SETTINGS, "completion": 16, "steps": 3, "warmup": 1}
GRPO_SECONDS = 100  # a GRPO run on one H100, start-up and compile included (a guess until measured)


def selected(name: str) -> bool:
    """Whether GPU_USER_CASES (a regex; unset: every case) picks case `name`."""
    pattern = os.environ.get("GPU_USER_CASES")
    return not pattern or re.search(pattern, name) is not None


def data_files(work: Path, smoke: bool) -> tuple[Path, Path, str]:
    """(alpaca file, pairs file, where the records came from)."""
    src = next((p for p in DATA if p.exists()), None)
    n = 64 if smoke else RECORDS
    if src is not None:
        rows, origin = json.loads(src.read_text())[:n], f"{src.name}, first {n} records"
    else:
        from toolkit.model.synthetic import corpus

        texts = corpus(3 * n, seed=5)
        rows = [{"instruction": texts[3 * i], "input": texts[3 * i + 1], "output": texts[3 * i + 2]} for i in range(n)]
        origin = f"synthetic ({n} records: {DATA[0].name} not found)"
    work.mkdir(parents=True, exist_ok=True)
    alpaca, pairs = work / "alpaca.json", work / "pairs.json"
    alpaca.write_text(json.dumps(rows))
    (work / "prompts.jsonl").write_text("".join(  # --objective grpo's and TRL's GRPOTrainer's form; a synthetic
        json.dumps({"prompt": "\n\n".join(x for x in (r["instruction"], r.get("input")) if x),  # record's answer: 0
                    "answer": r["output"] if re.search(r"\d", r["output"]) else "0"}) + "\n" for r in rows))
    pairs.write_text(json.dumps([{"prompt": "\n\n".join(x for x in (r["instruction"], r.get("input")) if x),
                                  "chosen": r["output"], "rejected": rows[(i + 1) % len(rows)]["output"]}
                                 for i, r in enumerate(rows)]))
    return alpaca, pairs, origin


def tokenizer_texts() -> list[str]:
    """The text a benchmark model's tokenizer is trained on: the GSM8K records (instruction and answer), or the
    synthetic corpus where the file is absent (a fresh checkout's smoke run)."""
    src = next((p for p in DATA if p.exists()), None)
    if src is None:
        from toolkit.model.synthetic import corpus

        return corpus(2000, seed=5)
    return ["\n\n".join(x for x in (r["instruction"], r.get("input"), r["output"]) if x)
            for r in json.loads(src.read_text())]


def drawn_picture(index: int, side: int):
    """A `side` px picture of a few shapes in colours drawn from `index` (deterministic)."""
    import random

    from PIL import Image, ImageDraw

    rng = random.Random(index)
    img = Image.new("RGB", (side, side), tuple(rng.randrange(256) for _ in range(3)))
    pen = ImageDraw.Draw(img)
    for _ in range(6):
        x, y, d = rng.randrange(side), rng.randrange(side), rng.randrange(side // 8, side // 2)
        draw = pen.ellipse if rng.random() < 0.5 else pen.rectangle
        draw([x - d // 2, y - d // 2, x + d // 2, y + d // 2], fill=tuple(rng.randrange(256) for _ in range(3)))
    return img


def vlm_file(work: Path, smoke: bool) -> Path:
    """VLM_RECORDS of the user part's records as chat records with a drawn picture each (PICTURE's side: a few
    shapes in colours drawn from the record's index), its path relative to the file, before the question."""
    alpaca = work / "alpaca.json"
    rows = json.loads(alpaca.read_text())
    side, images = PICTURE[smoke], work / "images"
    images.mkdir(parents=True, exist_ok=True)
    records = []
    for i in range(VLM_RECORDS):
        r = rows[i % len(rows)]
        drawn_picture(i, side).save(images / f"{i}.png")
        question = "\n\n".join(x for x in (r["instruction"], r.get("input")) if x)
        records.append({"messages": [
            {"role": "user", "content": [{"type": "image", "image": f"images/{i}.png"},
                                         {"type": "text", "text": question}]},
            {"role": "assistant", "content": r["output"]}]})
    path = work / "vlm.json"
    path.write_text(json.dumps(records))
    return path


def steady(records: list[dict]) -> dict:
    """Tokens/s over the steps after WARMUP (their tokens over their seconds, from the cumulative
    `tokens` and `elapsed_s` of one record a step), the step times' coefficient of variation, and the
    logged MFU's mean over the same steps."""
    steps = [r for r in records if "loss" in r and "tokens" in r and "elapsed_s" in r]
    pairs = [(b["tokens"] - a["tokens"], b["elapsed_s"] - a["elapsed_s"]) for a, b in zip(steps, steps[1:])
             if b["step"] == a["step"] + 1 and b["step"] > WARMUP and not b.get("profiled")]  # --profile's steps
    if len(pairs) < 2:
        return {"tokens_per_s": None, "step_time_cv": None, "logged_mfu": None, "steady_steps": len(pairs)}
    times = [t for _, t in pairs]
    mfu = [r["mfu"] for r in steps if r["step"] > WARMUP + 1 and r.get("mfu") is not None]
    return {"tokens_per_s": sum(n for n, _ in pairs) / sum(times),
            "step_time_cv": statistics.pstdev(times) / statistics.mean(times),
            "logged_mfu": statistics.mean(mfu) if mfu else None, "steady_steps": len(pairs)}


def grpo_figures(records: list[dict], warmup: int) -> dict:
    """--objective grpo's figures over the steps after `warmup` (one record a step): generation tokens/s (the
    rounds' completion tokens over their seconds), training tokens/s (the steps' tokens over their seconds
    outside the rounds: the logged tokens_per_sec's window) and the whole step's mean seconds."""
    steps = [r for r in records if "loss" in r and "tokens" in r and "elapsed_s" in r]
    gen_tokens = gen_s = trained = train_s = 0.0
    step_s = []
    for a, b in zip([None, *steps], steps):
        if b["step"] <= warmup or (a is not None and b["step"] != a["step"] + 1):
            continue
        tokens = b["tokens"] - (a["tokens"] if a else 0)
        trained, train_s = trained + tokens, train_s + tokens / b["tokens_per_sec"]
        step_s.append(b["elapsed_s"] - (a["elapsed_s"] if a else 0))
        if b.get("time/generate_s"):
            gen_tokens += b["generation_tokens_per_sec"] * b["time/generate_s"]
            gen_s += b["time/generate_s"]
    return {"generation_tokens_per_s": gen_tokens / gen_s if gen_s else None,
            "training_tokens_per_s": trained / train_s if train_s else None,
            "step_s": statistics.mean(step_s) if step_s else None, "grpo_steady_steps": len(step_s)}


def grpo_case(run, name: str, model: str, prompts: Path, out: Path, env: dict) -> dict:
    """finetune.py --objective grpo (GRPO_SETTINGS) on `prompts`, a subprocess: run_case's record plus
    grpo_figures and the decode path its log names."""
    g = GRPO_SMOKE if run.smoke else GRPO_SETTINGS
    cmd = [sys.executable, str(ROOT / "finetune.py"), "--model", model, "--dataset", str(prompts), "--output-dir",
           str(out), "--overwrite-output-dir", "--objective", "grpo", "--reward", "builtin:math_answer",
           "--num-generations", str(g["generations"]), "--max-completion-length", str(g["completion"]),
           "--seq-len", str(g["seq_len"]), "--micro-batch-size", str(g["micro"]), "--max-steps", str(g["steps"])]
    print(f"  {name}", flush=True)
    case = run_case(name, cmd, out, env, run.timeout() if run.deadline else None)
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()] \
        if (out / "metrics.jsonl").exists() else []
    text = (out.parent / f"{name}.log").read_text()
    case.update(grpo_figures(records, g["warmup"]), settings=g,
                decode=next((ln for ln in text.splitlines() if ln.startswith("decode: ")), None))
    print(f"    {'ok' if not case['error'] else 'FAILED: ' + case['error']} ({case['seconds']} s)", flush=True)
    return case


def error_line(text: str) -> str:
    """The line a failed run stopped with: the toolkit's one-line refusal, else a traceback's last line."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    said = [ln for ln in lines if ln.startswith("finetune.py: error:")]
    return (said or [ln for ln in lines if "Error" in ln or "error" in ln] or lines or ["no output"])[-1][:500]


def run_case(name: str, cmd: list[str], out: Path, env: dict, timeout: float | None) -> dict:
    """One finetune.py process: its figures from metrics.jsonl, summary.json and integrity.json."""
    t0 = time.perf_counter()
    metrics, first = out / "metrics.jsonl", None
    log = out.parent / f"{name}.log"
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
        while p.poll() is None:
            if first is None and metrics.exists() and metrics.read_text().strip():
                first = time.perf_counter() - t0
            if timeout is not None and time.perf_counter() - t0 > timeout:
                p.kill()
            time.sleep(0.2)
    text = log.read_text()
    records = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
    integrity = json.loads((out / "integrity.json").read_text()) if (out / "integrity.json").exists() else {}
    step1 = next((r for r in records if r.get("step") == 1), {})
    peak = summary.get("peak_allocated_bytes")
    case = {"name": name, "command": " ".join(cmd[1:]), "started": bool(step1), "exit": p.returncode,
            "seconds": round(time.perf_counter() - t0, 1),
            "seconds_to_step1": round(first, 1) if first is not None and step1 else None, **steady(records),
            "peak_gib": round(peak / 2**30, 2) if peak else None, "loss_check_gap": step1.get("loss_check_gap"),
            "packing_check_gap": step1.get("packing_check_gap"),
            "integrity": bool(integrity.get("ok")) if integrity else False,
            "attention": next((ln.split("; ", 1)[1] for ln in text.splitlines() if ln.startswith("model: ")), None),
            "loss": next((ln for ln in text.splitlines() if ln.startswith("loss: ")), None), "error": None}
    if (out / "profile.json").exists():  # --profile: what a step spends, by op (issue 66: the fixed cost per step)
        profile = json.loads((out / "profile.json").read_text())
        case["profile"] = {"steps": profile["steps"], "per_step_top": profile["per_step_top"][:12]}
    if p.returncode != 0 or not case["integrity"]:
        case["error"] = "timed out" if timeout is not None and case["seconds"] > timeout else error_line(text)
    return case


def part_user(run, check) -> dict:
    """Every case in CASES (`run`: gpu_acceptance's Run: device, smoke, work, budget, the Llama shape;
    `check`: its figure-against-target record)."""
    work = Path(run.work) / "user"
    alpaca, pairs, origin = data_files(work, run.smoke)
    vlm = vlm_file(work, run.smoke) if selected("vlm") else None
    seq, mb, steps = (256, 2, 6) if run.smoke else (2048, 4, 30)  # smoke: GSM8K prompts pass 64 tokens
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_"))}
    env.update(PYTHONUNBUFFERED="1", TQDM_DISABLE="1")
    shapes = SMOKE_SHAPES if run.smoke else SHAPES
    run.shapes = {**run.shapes, **shapes}
    cases, skipped = [], []
    for name, model, flags in CASES:
        if not selected(name):
            continue
        if name in GPU_ONLY and not run.gpu:
            skipped.append(f"{name}: {GPU_ONLY[name]}")
            continue
        if model == VLM and not run.out_of_time(VLM_SECONDS):
            run.model(VLM)  # built (minutes for 3.75B weights) before the budget is asked whether its run fits
        late = run.out_of_time(VLM_SECONDS if model == VLM else SECONDS)
        if late:
            skipped.append(f"{name}: {late}")
            continue
        out = work / name
        data = vlm if model == VLM else pairs if "--objective" in flags else alpaca
        n = steps + 2 if run.smoke and "--profile" in flags else steps  # smoke: steady steps 7-8 after profiled 4-6
        cmd = [sys.executable, str(ROOT / "finetune.py"), "--model", run.model(model), "--dataset", str(data),
               "--output-dir", str(out), "--overwrite-output-dir", "--seq-len", str(seq), "--micro-batch-size",
               str(mb), "--max-steps", str(n), *flags]
        print(f"  {name}", flush=True)
        case = run_case(name, cmd, out, env, run.timeout() if run.deadline else None)
        print(f"    {'ok' if not case['error'] else 'FAILED: ' + case['error']} ({case['seconds']} s)", flush=True)
        cases.append(case)
        if name == "vlm":  # kept on `run`: the yardstick part compares it with TRL's SFTTrainer
            run.vlm_case = case
    if selected("grpo"):
        late = run.out_of_time(GRPO_SECONDS)
        if late:
            skipped.append(f"grpo: {late}")
        else:  # kept on `run`: the yardstick part compares it with TRL's GRPOTrainer
            run.grpo_case = grpo_case(run, "grpo", run.model("llama-1b"), work / "prompts.jsonl", work / "grpo", env)
            cases.append(run.grpo_case)
    checks = [check(f"{c['name']}: started, trained, saved folder passes the integrity check",
                    float(c["error"] is None), ">=", 1.0) for c in cases]
    by = {c["name"]: c for c in cases}
    for method in ("lora", "full"):  # the default against its compiled arm (issue 59: >= 0.97x the fastest)
        eager, compiled = by.get(method, {}), by.get(f"{method}_compile", {})
        if eager.get("tokens_per_s") and compiled.get("tokens_per_s"):
            fastest = max(eager["tokens_per_s"], compiled["tokens_per_s"])
            checks.append(check(f"{method}: default / fastest arm", eager["tokens_per_s"] / fastest, ">=", 0.97,
                                judged=run.gpu))
    if by.get("full", {}).get("logged_mfu") is not None:
        checks.append(check("full: logged MFU", by["full"]["logged_mfu"], ">=", 0.40, judged=run.gpu))
    return {"data": origin, "seq_len": seq, "micro_batch": mb, "max_steps": steps, "cases": cases, "checks": checks,
            "skipped": skipped}


def part_epoch(run, check, method: str) -> dict:
    """Issue 66's runs as long as a user's: one epoch of the GSM8K file (every record: ~380 packed steps at 2048 x
    4) with the default (--compile auto), --compile and --no-compile, and 30 steps with the default and
    --no-compile, `method` LoRA or full; wall seconds from launch to exit, start-up and compile included. Checks:
    the default within 1.03x the fastest arm, one epoch and 30 steps; a full finetune's epoch at logged MFU 0.45."""
    work = Path(run.work) / f"epoch_{method}"
    src = next((p for p in DATA if p.exists()), None)
    alpaca, _, origin = data_files(work, run.smoke)
    if src is not None and not run.smoke:  # the whole file, not the user part's first RECORDS
        alpaca.write_text(src.read_text())
        origin = f"{src.name}, every record"
    seq, mb, short = (256, 2, 6) if run.smoke else (2048, 4, 30)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_"))}
    env.update(PYTHONUNBUFFERED="1", TQDM_DISABLE="1")
    arms = [("epoch_default", []), ("epoch_compile", ["--compile"]), ("epoch_eager", ["--no-compile"]),
            (f"steps{short}_default", ["--max-steps", str(short)]),
            (f"steps{short}_eager", ["--max-steps", str(short), "--no-compile"])]
    cases, skipped = [], []
    if run.smoke:  # the CPU smoke (tests/test_gpu_acceptance.py): one arm of each kind, LoRA's; the rest on a GPU
        skipped = [f"{name}: a GPU run's" for name, _ in arms if method == "full" or name.endswith("compile")
                   or name.startswith(f"steps{short}_eager")]
        arms = [] if method == "full" else [a for a in arms if a[0] in ("epoch_default", "epoch_eager",
                                                                          f"steps{short}_default")]
    for name, flags in arms:
        late = run.out_of_time(SECONDS * (4 if name.startswith("epoch") else 1))
        if late:
            skipped.append(f"{name}: {late}")
            continue
        out = work / name
        cmd = [sys.executable, str(ROOT / "finetune.py"), "--model", run.model("llama-1b"), "--dataset", str(alpaca),
               "--output-dir", str(out), "--overwrite-output-dir", "--seq-len", str(seq), "--micro-batch-size", str(mb),
               "--method", method, *PACKED, *flags]
        print(f"  {method} {name}", flush=True)
        case = run_case(f"{method}_{name}", cmd, out, env, run.timeout() if run.deadline else None)
        print(f"    {'ok' if not case['error'] else 'FAILED: ' + case['error']} ({case['seconds']} s)", flush=True)
        cases.append(case)
    by = {c["name"].removeprefix(f"{method}_"): c for c in cases}
    checks = [check(f"{c['name']}: started, trained, saved", float(c["error"] is None), ">=", 1.0)
              for c in cases]
    arms_of = {"epoch": ("epoch_default", "epoch_compile", "epoch_eager"),
               f"{short} steps": (f"steps{short}_default", f"steps{short}_eager")}
    for what, names in arms_of.items():
        if all(n in by and by[n]["error"] is None for n in names):
            fastest = min(by[n]["seconds"] for n in names)
            checks.append(check(f"{method}, {what}: default wall / fastest arm's", by[names[0]]["seconds"] / fastest,
                                "<=", 1.03, judged=run.gpu))
    if method == "full" and by.get("epoch_default", {}).get("logged_mfu") is not None:
        checks.append(check("full, epoch, default: logged MFU", by["epoch_default"]["logged_mfu"], ">=", 0.45,
                            judged=run.gpu))
    return {"data": origin, "seq_len": seq, "micro_batch": mb, "max_steps": f"one epoch, and {short}", "cases": cases,
            "checks": checks, "skipped": skipped}


def table(d: dict) -> list[str]:
    """The user (or yardstick) part's cases side by side, for gpu_acceptance's README."""
    def f(x, spec: str) -> str:
        return "-" if x is None else format(x, spec)

    def yes(x) -> str:
        return "-" if x is None else "yes" if x else "**no**"

    lines = ["", f"{d['part']}: on {d['data']}, {d['micro_batch']} x {d['seq_len']} tokens, --max-steps "
             f"{d['max_steps']}, steady figures after step {WARMUP}", "",
             "| case | started | s to step 1 | wall s | tokens/s | step time cv | logged MFU | peak GiB | loss check | "
             "packing check | integrity | error |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in d["cases"]:
        lines.append(f"| {c['name']} | {yes(c.get('started'))} | {f(c.get('seconds_to_step1'), '.0f')} | "
                     f"{f(c.get('seconds'), '.0f')} | {f(c.get('tokens_per_s'), '.0f')} | "
                     f"{f(c.get('step_time_cv'), '.2f')} | {f(c.get('logged_mfu'), '.3f')} | "
                     f"{f(c.get('peak_gib'), '.1f')} | {f(c.get('loss_check_gap'), '.1e')} | "
                     f"{f(c.get('packing_check_gap'), '.1e')} | {yes(c.get('integrity'))} | "
                     f"{(c.get('error') or '')[:120]} |")
    grpo = [c for c in d["cases"] if c["name"].startswith("grpo")]
    if grpo:
        g = grpo[0].get("settings") or GRPO_SETTINGS
        lines += ["", f"{d['part']}, GRPO: {g['generations']} completions of up to {g['completion']} tokens a step, "
                  f"micro-batch {g['micro']}, steady figures after step {g['warmup']}", "",
                  "| case | generation tokens/s | training tokens/s | step s | peak GiB | generation |",
                  "|---|---|---|---|---|---|"]
        for c in grpo:
            how = c.get("decode") or c.get("generation") or "-"
            lines.append(f"| {c['name']} | {f(c.get('generation_tokens_per_s'), '.0f')} | "
                         f"{f(c.get('training_tokens_per_s'), '.0f')} | {f(c.get('step_s'), '.2f')} | "
                         f"{f(c.get('peak_gib'), '.1f')} | {how[:150]} |")
    return lines


# ----------------------------------------------------------------------------- the yardstick (issue 59)

YARDSTICK_STEPS = 200  # the end-to-end comparison: wall time, compile included


def sft_case(name: str, model: str, data: Path, out: Path, flags: list[str], seq: int, mb: int, steps: int, env: dict,
             timeout: float | None) -> dict:
    """TRL's SFTTrainer as its users run it (benchmarks/gpu/sft_trainer_user.py), a subprocess."""
    cmd = [sys.executable, "-m", "benchmarks.gpu.sft_trainer_user", "--model", model, "--dataset", str(data),
           "--output-dir", str(out), "--seq-len", str(seq), "--micro-batch-size", str(mb), "--max-steps", str(steps),
           *flags]
    return trainer_case(name, cmd, env, timeout, out, "sft_metrics.json")


def trainer_case(name: str, cmd: list[str], env: dict, timeout: float | None, out: Path, metrics: str) -> dict:
    """A TRL trainer's script as a subprocess: its log beside `out`, its metrics file's figures, its seconds."""
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        code, text = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        code, text = "timeout", f"{e.stdout or ''}{e.stderr or ''}"
    text = text if isinstance(text, str) else str(text)
    (out.parent / f"{name}.log").write_text(text)
    got = json.loads((out / metrics).read_text()) if (out / metrics).exists() else {}
    return {"name": name, "command": " ".join(cmd[1:]), "started": bool(got.get("steps")), "exit": code,
            "seconds": round(time.perf_counter() - t0, 1), **got,
            "error": None if code == 0 and got else error_line(text)}


def trl_grpo_case(run, name: str, model: str, prompts: Path, out: Path, flags: list[str], env: dict) -> dict:
    """TRL's GRPOTrainer as its users run it (benchmarks/gpu/grpo_trainer_user.py) with GRPO_SETTINGS, a subprocess."""
    g = GRPO_SMOKE if run.smoke else GRPO_SETTINGS
    cmd = [sys.executable, "-m", "benchmarks.gpu.grpo_trainer_user", "--model", model, "--dataset", str(prompts),
           "--output-dir", str(out), "--num-generations", str(g["generations"]), "--max-completion-length",
           str(g["completion"]), "--micro-batch-size", str(g["micro"]), "--max-steps", str(g["steps"]), "--warmup",
           str(g["warmup"]), *flags]
    if not run.gpu and "--continuous-batching" in flags:  # on a CPU its default cache is half the machine's RAM
        cmd += ["--cb-config", json.dumps({"num_blocks": 16, "max_batch_tokens": 512})]
    print(f"  {name}", flush=True)
    return trainer_case(name, cmd, env, run.timeout() if run.deadline else None, out, "grpo_metrics.json")


def part_yardstick(run, check) -> dict:
    """The toolkit's default against TRL's SFTTrainer on the same file, GPU and steps (its defaults with
    packing, and its best documented flags), LoRA and full; then YARDSTICK_STEPS steps of the toolkit's
    default (--compile auto) against --no-compile, wall time with start-up and compile; the VLM case (the user
    part's, when it ran in this command) against SFTTrainer on its image records (TRL's defaults, and its best).
    Its checks are also written into OUT/user.json's, under the names issues 59 and 73 give them."""
    work = Path(run.work) / "yardstick"
    alpaca, _, origin = data_files(work, run.smoke)
    run.shapes = {**run.shapes, VLM: (SMOKE_SHAPES if run.smoke else SHAPES)[VLM]}
    seq, mb, steps = (256, 2, 6) if run.smoke else (2048, 4, 30)
    long_steps = 8 if run.smoke else YARDSTICK_STEPS
    everything = work / "all.json"  # the long runs need more than RECORDS records
    src = next((p for p in DATA if p.exists()), None)
    everything.write_text(src.read_text() if src is not None else alpaca.read_text())
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_"))}
    env.update(PYTHONUNBUFFERED="1", TQDM_DISABLE="1")
    backend = ["--compile-backend", "aot_eager"] if not run.gpu else []
    model = run.model("llama-1b")
    cases = []

    def toolkit(name: str, flags: list[str], data: Path = alpaca, n: int = steps, on: str | None = None,
                packed: bool = True) -> None:
        out = work / name
        cmd = [sys.executable, str(ROOT / "finetune.py"), "--model", on or model, "--dataset", str(data),
               "--output-dir", str(out), "--overwrite-output-dir", "--seq-len", str(seq), "--micro-batch-size", str(mb),
               "--max-steps", str(n), *(["--packing"] if packed else []), *flags]
        print(f"  {name}", flush=True)
        cases.append(run_case(name, cmd, out, env, run.timeout() if run.deadline else None))

    def sft(name: str, flags: list[str], on: tuple[str, Path] | None = None) -> None:
        print(f"  {name}", flush=True)
        m, data = on or (model, alpaca)
        cases.append(sft_case(name, m, data, work / name, flags, seq, mb, steps, env,
                              run.timeout() if run.deadline else None))

    def vlm_toolkit() -> None:  # the user part's run when it ran in this command, else its own
        mine = getattr(run, "vlm_case", None)
        if mine:
            cases.append({**mine, "from": "the user part"})
        else:  # the user part's flags: the defaults (padding-free image rows)
            toolkit("vlm", [], vlm_data, on=run.model(VLM), packed=False)

    plan = [("lora", lambda: toolkit("lora", [])), ("sft_lora", lambda: sft("sft_lora", [])),
            ("sft_lora_best", lambda: sft("sft_lora_best", ["--best", *backend])),
            ("full", lambda: toolkit("full", ["--method", "full"])),
            ("sft_full", lambda: sft("sft_full", ["--method", "full"])),
            ("lora_200_default", lambda: toolkit("lora_200_default", [], everything, long_steps)),
            ("lora_200_eager", lambda: toolkit("lora_200_eager", ["--no-compile"], everything, long_steps))]

    def grpo(name: str, flags: list[str]) -> None:
        cases.append(trl_grpo_case(run, name, model, work / "prompts.jsonl", work / name, flags, env))

    def grpo_toolkit() -> None:  # the user part's run when it ran in this command, else its own
        mine = getattr(run, "grpo_case", None)
        cases.append({**mine, "from": "the user part"} if mine else
                     grpo_case(run, "grpo", model, work / "prompts.jsonl", work / "grpo", env))

    plan += [("grpo", grpo_toolkit), ("grpo_trl", lambda: grpo("grpo_trl", [])),
             ("grpo_trl_cb", lambda: grpo("grpo_trl_cb", ["--continuous-batching"]))]
    vlm_data = vlm_file(work, run.smoke) if selected("vlm") else None
    # TRL's best on images: padded batches, no checkpointing, Liger where it imports; torch.compile as a second arm
    # (a VLM's forward breaks its graph on the images' shapes: it may be slower), the faster of the two judged
    plan += [("vlm", vlm_toolkit), ("sft_vlm", lambda: sft("sft_vlm", [], (run.model(VLM), vlm_data))),
             ("sft_vlm_best", lambda: sft("sft_vlm_best", ["--best", "--no-compile"], (run.model(VLM), vlm_data))),
             ("sft_vlm_best_compile", lambda: sft("sft_vlm_best_compile", ["--best", *backend],
                                                  (run.model(VLM), vlm_data)))]
    skipped = []
    for name, go in plan:
        if not selected(name):
            continue
        if run.smoke and name == "sft_vlm_best_compile":  # minutes of compiling on 2 cores; the text arm compiles
            skipped.append(f"{name}: a GPU run's (the smoke compiles TRL's text arm, sft_lora_best)")
            continue
        late = run.out_of_time(GRPO_SECONDS if name.startswith("grpo") else VLM_SECONDS if "vlm" in name else SECONDS)
        if late:
            skipped.append(f"{name}: {late}")
            continue
        go()
    by = {c["name"]: c for c in cases}

    def ratio(a: str, b: str, key: str = "tokens_per_s") -> float | None:
        x, y = by.get(a, {}).get(key), by.get(b, {}).get(key)
        return x / y if x and y else None

    # TRL's best on images: its faster arm
    arms = [n for n in ("sft_vlm_best", "sft_vlm_best_compile") if by.get(n, {}).get("tokens_per_s")]
    best_vlm = max(arms, key=lambda n: by[n]["tokens_per_s"]) if arms else "sft_vlm_best"

    checks = [check(what, value, op, target, judged=run.gpu) for what, value, op, target in (
        ("lora: default / SFTTrainer", ratio("lora", "sft_lora"), ">=", 1.5),
        ("lora: default / SFTTrainer best", ratio("lora", "sft_lora_best"), ">=", 1.1),
        ("full: default / SFTTrainer", ratio("full", "sft_full"), ">=", 1.25),
        ("200 steps: default wall / eager wall", ratio("lora_200_default", "lora_200_eager", "seconds"), "<=", 1.0),
        ("grpo: generation tokens/s / GRPOTrainer's (generate)",
         ratio("grpo", "grpo_trl", "generation_tokens_per_s"), ">=", 2.0),
        ("grpo: generation tokens/s / GRPOTrainer's (continuous batching)",
         ratio("grpo", "grpo_trl_cb", "generation_tokens_per_s"), ">=", 1.0),
        ("vlm: default / SFTTrainer", ratio("vlm", "sft_vlm"), ">=", 1.5),
        ("vlm: default / SFTTrainer best", ratio("vlm", best_vlm), ">=", 1.1))
        if value is not None]
    # a case that ran and failed fails its comparison (on a GPU), rather than leaving it out
    failed = {c["name"] for c in cases if c.get("error")}
    for what, pair, target in (("vlm: default / SFTTrainer", ("vlm", "sft_vlm"), 1.5),
                               ("vlm: default / SFTTrainer best", ("vlm", "sft_vlm_best"), 1.1)):
        if run.gpu and failed & set(pair) and what not in {c["what"] for c in checks}:
            checks.append({**check(what, None, ">=", target), "passed": False,
                           "error": f"{', '.join(sorted(failed & set(pair)))} failed"})
    merge_checks(run.out, checks)
    return {"data": origin, "seq_len": seq, "micro_batch": mb, "max_steps": steps, "cases": cases, "checks": checks,
            "skipped": skipped}


def merge_checks(out: Path | None, checks: list[dict]) -> None:
    """`checks` into OUT/user.json's (same names replaced): issue 59 reads them there."""
    path = out / "user.json" if out is not None else None
    if path is None or not path.exists():
        return
    d = json.loads(path.read_text())
    names = {c["what"] for c in checks}
    d["checks"] = [c for c in d["checks"] if c["what"] not in names] + checks
    path.write_text(json.dumps(d, indent=2))
