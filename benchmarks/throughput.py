"""Training throughput: (a) a minimal hand-written PyTorch loop, (b) this toolkit's loop as users
run it (no flags: `--loss auto`, the chunked loss on these CPU models) and (b') with `--loss full`
(full logits, as (a) and (c) compute them), (c) transformers.Trainer, on the same model, data,
micro-batch, precision and steps. Beside those, arms with each side's own best flags
(`benchmarks/gpu/gpu_acceptance.py` runs them on a GPU): `compile` is the toolkit with `--compile`, `best`
adds the fastest loss and kernels installed (`--loss cce|liger|chunked`, `--kernels liger`), and
`trainer_best` is Trainer with `torch_compile=True` and, where liger_kernel imports,
`use_liger_kernel=True`. An arm whose flag this toolkit does not take, or whose package is missing,
is left out or trimmed with a line saying so (`resolve_arms`).

Each run is a fresh process. Runs alternate a, b, c, a, b, c, ... (`--repeats` rounds) so drift in
the machine's speed hits all arms alike. A run trains `--warmup` steps, then times `--steps` more;
its figure is non-padding tokens / seconds over the timed steps (a compiled arm compiles in its
first step: warm-up, never timed). Every arm steps the fused AdamW
kernel: the toolkit's and Trainer's default (`adamw_torch_fused`), and the raw loop is given
`fused=True` so that toolkit / raw measures the loop around the same kernels. All arms read the same batches in
the same order (the toolkit's epoch-0 permutation), so they do the same work. The table gives
medians, min-max spread and ratios; MFU uses one FLOP count (toolkit.train.flops, PaLM's 6N + 12LhT;
a toolkit arm's head counted as it logs it: on target tokens only where its loss skips the others) and one peak: the
best of the
matmul probes taken by the parent after the runs and by each run after its timed steps. Each run
also reports torch.cuda.max_memory_allocated on a GPU, so arms compare at their memory. (d) TRL's SFTTrainer joins when
`trl` imports
(it is not a toolkit dependency: `pip install --no-deps --target /tmp/trlpkg trl` and run with
PYTHONPATH=/tmp/trlpkg); it gets the same pre-tokenized rows and collator, so it skips its own
tokenization, and keeps its per-step extras (token accuracy, entropy) as users get them.

    python -m benchmarks.throughput --model tiny --method full
    python -m benchmarks.throughput --model smollm2-135m-instruct --method lora
Results append to benchmarks/throughput.json; benchmarks/throughput.md and throughput.png are redrawn.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import BENCH, RESULT, ROOT, cpu_device, print_result, read_metrics, save_llama, sync

VARIANTS = ("raw", "toolkit", "full", "trainer", "sft")  # the CLI's arms and its table's columns
LABELS = {"raw": "raw loop", "toolkit": "toolkit", "full": "toolkit --loss full", "trainer": "Trainer",
          "sft": "SFTTrainer"}
# name -> what it runs (raw | toolkit | trainer | sft) and how; `resolve_arms` completes best and trainer_best
ARMS = {"raw": {"run": "raw"}, "toolkit": {"run": "toolkit", "flags": []},
        "full": {"run": "toolkit", "flags": ["--loss", "full"]}, "compile": {"run": "toolkit", "flags": ["--compile"]},
        "best": {"run": "toolkit", "flags": ["--compile"]}, "trainer": {"run": "trainer", "trainer_args": {}},
        "trainer_best": {"run": "trainer", "trainer_args": {"torch_compile": True}}, "sft": {"run": "sft"}}
BASELINES = ("raw", "trainer", "trainer_best", "sft")  # the arms a toolkit arm is divided by
BEST_LOSSES = ("cce", "liger", "chunked")  # `best`'s loss: the first this toolkit takes and can run here
TINY = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
            num_key_value_heads=4, max_position_embeddings=512)


def tiny_model_dir(path: Path) -> str:
    """A Llama of TINY shape with SmolLM2's tokenizer, saved and loaded through from_pretrained."""
    from transformers import AutoTokenizer

    from toolkit.model.source import resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m-instruct"))
    return str(save_llama(path, tok, **TINY, vocab_size=len(tok)))


def importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def flag_problem(flags: list[str]) -> str | None:
    """Why this toolkit's config refuses `flags` (a flag it does not have yet, a choice it lacks), or None:
    the capability check that lets a newer arm be skipped with a reason instead of failing."""
    from toolkit.config import parse_config
    from toolkit.errors import UserError

    try:
        with tempfile.TemporaryDirectory() as out:
            parse_config(["--model", "capability-check", "--output-dir", out, *flags])
    except (UserError, SystemExit) as e:
        return f"{' '.join(flags)} not available in this toolkit version ({str(e).strip().splitlines()[0][:200]})"
    return None


def resolve_arms(names: list[str], cuda: bool, best_loss: str | None = None) -> tuple[dict[str, dict], list[str]]:
    """The specs of the arms `names` that can run here, and one line for each arm left out or trimmed.
    `best`: --compile, the first of BEST_LOSSES this toolkit takes and this machine runs (`best_loss`
    names one instead), and --kernels liger where liger_kernel imports on CUDA. `trainer_best`:
    torch_compile=True, and use_liger_kernel=True where liger_kernel imports on CUDA."""
    unknown = set(names) - set(ARMS)
    if unknown:
        raise SystemExit(f"--variants: unknown {', '.join(sorted(unknown))}; choose from {', '.join(ARMS)}")
    liger = cuda and importable("liger_kernel")
    no_liger = "liger_kernel does not import" if cuda else "Liger's Triton kernels need CUDA"
    specs, notes = {}, []
    for name in names:
        spec = json.loads(json.dumps(ARMS[name]))  # a copy
        if name == "sft" and not importable("trl"):
            notes.append("sft: left out: trl does not import")
            continue
        if name == "best":
            runnable = [k for k in BEST_LOSSES if k == "chunked" or cuda and importable(
                {"cce": "cut_cross_entropy", "liger": "liger_kernel"}[k])]
            loss = best_loss or next((k for k in runnable if not flag_problem(["--loss", k])), None)
            spec["flags"] += ["--loss", loss] if loss else []
            if loss != BEST_LOSSES[0] and not best_loss:
                notes.append(f"best: --loss {loss or '(none)'}: the losses before it in {'/'.join(BEST_LOSSES)} cannot "
                             "run here (a CUDA GPU and cut-cross-entropy / liger-kernel, and a toolkit that takes "
                             "them)")
            kernels = flag_problem(["--kernels", "liger"]) if liger else no_liger
            spec["flags"] += [] if kernels else ["--kernels", "liger"]
            if kernels:
                notes.append(f"best: --kernels liger left out: {kernels}")
        if name == "trainer_best":
            if liger:
                spec["trainer_args"]["use_liger_kernel"] = True
            else:
                notes.append(f"trainer_best: use_liger_kernel left out: {no_liger}")
        problem = flag_problem(spec["flags"]) if spec["run"] == "toolkit" and spec["flags"] else None
        if problem:
            notes.append(f"{name}: skipped: {problem}")
            continue
        specs[name] = spec
    return specs, notes


def setup(args, flags: list[str] = ()):
    """The shared work: toolkit config, model (LoRA if asked), tokenized rows in epoch-0 order. `args.rows`
    (a JSON file of token rows) replaces the built-in data; `args.precision` is the toolkit's
    --mixed-precision (default no: fp32, as on this CPU); `flags` are a toolkit arm's own."""
    import torch

    from toolkit.config import parse_config
    from toolkit.data import load_examples, tokenize_examples
    from toolkit.data.tokenize import ensure_chat_template
    from toolkit.model.load import load_model, load_tokenizer
    from toolkit.model.source import resolve_model
    from toolkit.data.loader import EpochShuffleSampler

    out = tempfile.mkdtemp()
    cfg = parse_config(["--model", args.model_path, "--method", args.method,
                        "--micro-batch-size", str(args.micro_batch),
                        "--max-steps", str(args.warmup + args.steps), "--log-every", str(args.warmup),
                        "--mixed-precision", precision(args), "--lr-schedule", "constant", "--warmup-steps", "0",
                        "--output-dir", out, "--overwrite-output-dir", "--seq-len", str(getattr(args, "seq_len", 256)),
                        *flags])
    path = resolve_model(cfg.model.model)
    tok = load_tokenizer(path)
    ensure_chat_template(tok)
    if getattr(args, "rows", None):
        rows = json.loads(Path(args.rows).read_text())
    else:
        rows, _ = tokenize_examples(load_examples(cfg.data_settings).train, tok, cfg.data_settings)
    order = list(EpochShuffleSampler(len(rows), cfg.train.seed))
    torch.manual_seed(cfg.train.seed)
    return cfg, load_model(cfg, path), tok, [rows[i] for i in order], rows, out


def precision(args) -> str:
    return getattr(args, "precision", "no")


def run_raw(args) -> dict:
    import torch

    from toolkit.data import collate
    from toolkit.data.labels import count_targets
    from toolkit.objectives.sft.loss import token_loss_sum

    cfg, model, tok, ordered, _, _ = setup(args)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr, fused=True)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision(args) == "bf16")
    model.train()
    mb, tokens, t0 = args.micro_batch, 0, None
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            sync()
            t0 = time.perf_counter()
        batch = {k: v.to(device) for k, v in collate(ordered[step * mb:(step + 1) * mb], tok.pad_token_id).items()}
        with autocast:
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        loss = token_loss_sum(logits, batch["labels"]) / count_targets(batch["labels"])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step >= args.warmup:
            tokens += sum(len(r["input_ids"]) for r in ordered[step * mb:(step + 1) * mb])
    sync()
    return {"tokens": tokens, "seconds": time.perf_counter() - t0}


def run_toolkit(args, flags: list[str] = ()) -> dict:
    """The toolkit's loop with `flags`; the timed window runs from the record at step `warmup` to the
    last (a --compile run's extra step-1 record, marked compile_warmup, falls before it)."""
    from toolkit.parallel.build import make_accelerator
    from toolkit.parallel.build import make_strategy
    from toolkit.train.loop import train

    cfg, model, tok, _, rows, out = setup(args, flags)
    strategy = make_strategy(cfg, make_accelerator(cfg))
    train(cfg, strategy, strategy.shard_model(model), tok, rows, [], Path(out), log=lambda *a, **k: None)
    recs = [r for r in read_metrics(out) if "tokens_per_sec" in r]
    first, last = next(r for r in recs if r["step"] == args.warmup), recs[-1]
    assert last["step"] == args.warmup + args.steps
    timed = [r for r in recs if r["step"] > args.warmup]
    return {"tokens": last["tokens"] - first["tokens"], "seconds": last["elapsed_s"] - first["elapsed_s"],
            "toolkit_mfu": statistics.mean(r["mfu"] for r in timed),
            "flops_per_token": statistics.mean(r["flops_per_token"] for r in timed)}


def run_hf_trainer(args, sft: bool = False, extra: dict | None = None) -> dict:
    """transformers.Trainer, or TRL's SFTTrainer (`sft`), on the same batches in the same order; `extra`:
    more TrainingArguments (torch_compile, use_liger_kernel)."""
    import torch
    from torch.utils.data import SequentialSampler
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from toolkit.data import collate

    cfg, model, tok, ordered, _, out = setup(args)
    counts, stamps = [], []

    def collator(batch):
        b = collate(batch, tok.pad_token_id)
        counts.append(int(b["attention_mask"].sum()))
        return b

    class Stamp(TrainerCallback):
        def on_step_end(self, *a, **k):
            sync()
            stamps.append(time.perf_counter())

    common = dict(output_dir=out, per_device_train_batch_size=args.micro_batch, max_steps=args.warmup + args.steps,
                  learning_rate=cfg.lr, lr_scheduler_type="constant", max_grad_norm=cfg.train.max_grad_norm,
                  logging_strategy="no", save_strategy="no", report_to=[], use_cpu=not torch.cuda.is_available(),
                  bf16=precision(args) == "bf16",
                  dataloader_num_workers=0, remove_unused_columns=False, seed=cfg.train.seed,
                  disable_tqdm=True, **(extra or {}))
    if sft:  # pre-tokenized rows: SFTTrainer skips its own tokenization
        from datasets import Dataset
        from trl import SFTConfig, SFTTrainer

        base, targs = SFTTrainer, SFTConfig(**common, dataset_kwargs={"skip_prepare_dataset": True}, max_length=None,
                                            packing=False)
        data, extra = Dataset.from_list([{"input_ids": r["input_ids"], "labels": r["labels"]} for r in ordered]), \
            {"processing_class": tok}
    else:
        base, targs, data, extra = Trainer, TrainingArguments(**common), ordered, {}

    class InOrder(base):  # the same batches as the others
        def _get_train_sampler(self, *a, **k):
            return SequentialSampler(self.train_dataset)

    InOrder(model=model, args=targs, train_dataset=data, data_collator=collator, callbacks=[Stamp()], **extra).train()
    return {"tokens": sum(counts[args.warmup:args.warmup + args.steps]),
            "seconds": stamps[args.warmup + args.steps - 1] - stamps[args.warmup - 1]}


def run_arm(spec: dict) -> dict:
    """One run of one arm in this (fresh) process: `spec` is measure()'s options plus the arm's own
    ("arm": resolve_arms' spec, "model_path"). `compile_backend` (a CPU smoke run: aot_eager, no C++
    build) reaches the toolkit through TOOLKIT_COMPILE_BACKEND and Trainer through torch_compile_backend."""
    import torch

    from toolkit.model.kernels import COMPILE_BACKEND_ENV
    from toolkit.parallel.build import cpu_threads_per_rank
    from toolkit.train.flops import measure_peak_flops

    args = argparse.Namespace(**spec)
    arm = spec["arm"]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(cpu_threads_per_rank(1))  # TOOLKIT_NUM_THREADS, else every core
    backend = spec.get("compile_backend")
    extra = dict(arm.get("trainer_args", {}))
    if backend:
        os.environ[COMPILE_BACKEND_ENV] = backend
        if extra.get("torch_compile"):
            extra["torch_compile_backend"] = backend
    run = {"raw": run_raw, "toolkit": lambda a: run_toolkit(a, arm["flags"]),
           "trainer": lambda a: run_hf_trainer(a, extra=extra),
           "sft": lambda a: run_hf_trainer(a, sft=True)}[arm["run"]]
    result = run(args)
    result["peak_bytes"] = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
    result["peak_flops"] = measure_peak_flops(device, compute_dtype(args))  # after the timed steps
    return result


def child_main(argv: list[str]) -> None:
    print_result(run_arm(json.loads(argv[0])))


def subprocess_arm(spec: dict) -> dict:
    """run_arm in a fresh Python process (`child_result`'s protocol): imports, CUDA context and
    allocator its own. `spec["timeout_s"]` (measure() sets it under a deadline): the process is killed
    past it, and that is the run's error."""
    import subprocess

    try:
        p = subprocess.run([sys.executable, "-m", "benchmarks.throughput", "--child", json.dumps(spec)],
                           capture_output=True, text=True, cwd=ROOT,
                           env={**os.environ, "TOKENIZERS_PARALLELISM": "false"}, timeout=spec.get("timeout_s"))
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{spec['variant']}: timed out: killed after {spec['timeout_s']:.0f} s, at the end of "
                           "the time budget") from None
    line = next((x for x in p.stdout.splitlines() if x.startswith(RESULT)), None)
    if line is None:
        raise RuntimeError(f"{spec['variant']} failed:\n{p.stderr[-3000:]}")
    return json.loads(line[len(RESULT):])


def compute_dtype(args):
    import torch

    return torch.bfloat16 if precision(args) == "bf16" else torch.float32


def measure(a: argparse.Namespace, path: str, log=print, runner=subprocess_arm, deadline: float | None = None) -> dict:
    """Run the arms in alternating rounds of fresh processes on model folder `path` and return the
    benchmark entry: medians, spreads, ratios, peak memory and MFU against the best peak probe of the
    run. `a` holds main()'s options, plus `precision`, `rows`, `seq_len`, `best_loss` and
    `compile_backend` when the caller sets them (the GPU run). `runner(spec)` runs one arm's run
    (default: a fresh subprocess). `deadline` (time.time()): a run starts only when the arm's last
    run (or, in round 1, the longest run so far) would end before it; the runs left out are listed.
    An arm whose run fails is recorded with its error and not run again; the others go on."""
    import torch
    from transformers import AutoConfig

    from toolkit.parallel.build import cpu_threads_per_rank
    from toolkit.train.flops import flops_per_token, matmul_params_from_config, measure_peak_flops

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if not cuda:
        torch.set_num_threads(cpu_threads_per_rank(1))  # TOOLKIT_NUM_THREADS, else every core
    arms, notes = resolve_arms([v for v in a.variants.split(",") if v], cuda, getattr(a, "best_loss", None))
    for line in notes:
        log(line)
    if not {"raw", "toolkit", "trainer"} <= set(arms):
        raise SystemExit("--variants: raw, toolkit and trainer are needed")
    results: dict[str, list[dict]] = {v: [] for v in arms}
    errors, left_out, took = {}, [], {v: [] for v in arms}
    for rep in range(a.repeats):
        for v, arm in arms.items():
            if v in errors:
                continue
            guess = max(took[v][-1:] or [s for t in took.values() for s in t] or [0.0])
            if deadline is not None and time.time() + guess > deadline:
                left_out.append(f"{v} round {rep + 1}: ~{guess:.0f} s would end past the time budget")
                continue
            spec = {**vars(a), "variant": v, "arm": arm, "model_path": path,
                    "timeout_s": None if deadline is None else max(10.0, deadline + 30 - time.time())}
            t0 = time.time()
            try:
                r = runner(spec)
            except RuntimeError as e:
                errors[v] = str(e)[-2000:]
                log(f"round {rep + 1} {v}: error: {(str(e).strip().splitlines() or ['?'])[-1][:200]}")
                continue
            took[v].append(time.time() - t0)
            r["tokens_per_sec"] = r["tokens"] / r["seconds"]
            results[v].append(r)
            log(f"round {rep + 1} {v}: {r['tokens_per_sec']:.1f} tokens/s ({took[v][-1]:.0f} s)")
    ran = [v for v in arms if results[v]]
    # the device's peak: the best of every probe in this benchmark (one here, after the runs: a CPU
    # process that has run OpenMP work cannot fork a run safely; one after each run's timed steps); a
    # probe can only read low (a neighbour's load, clocks), never high
    probes = [measure_peak_flops(device, compute_dtype(a))] + [r["peak_flops"] for v in ran for r in results[v]]
    peak = max(probes)
    cfg = AutoConfig.from_pretrained(path)
    n = matmul_params_from_config(cfg.to_dict())
    any_run = results[ran[0]] if ran else [{"tokens": a.steps * a.micro_batch}]
    context = statistics.mean(r["tokens"] for r in any_run) / (a.steps * a.micro_batch)
    per_token = flops_per_token(n, cfg.num_hidden_layers, cfg.hidden_size, context)
    # a toolkit arm's fused loss skips the head on prompt tokens: credit the FLOPs it logged it ran
    fpt = {v: statistics.median(r["flops_per_token"] for r in results[v]) if arms[v]["run"] == "toolkit" else per_token
           for v in ran}
    med = {v: statistics.median(r["tokens_per_sec"] for r in results[v]) for v in ran}
    pairs = [(x, y) for x in ran if arms[x]["run"] == "toolkit" for y in BASELINES if y in med]
    pairs += [("trainer_best", "trainer")] if {"trainer_best", "trainer"} <= set(med) else []
    return {"model": a.model, "method": a.method, "micro_batch": a.micro_batch, "steps": a.steps, "warmup": a.warmup,
            "repeats": a.repeats, "dtype": str(compute_dtype(a)).removeprefix("torch."),
            "seq_len": getattr(a, "seq_len", None), "device": torch.cuda.get_device_name(0) if cuda else cpu_device(),
            "torch": torch.__version__, "arms": arms,
            "compile_backend": getattr(a, "compile_backend", None) or "inductor",
            "notes": notes, "errors": errors, "left_out": left_out,
            "rounds": {v: len(results[v]) for v in arms},
            "peak_flops": peak, "peak_probes": [min(probes), statistics.median(probes), max(probes), len(probes)],
            "flops_per_token": per_token,
            "median_tokens_per_sec": med,
            "spread_tokens_per_sec": {v: [min(r["tokens_per_sec"] for r in results[v]),
                                          max(r["tokens_per_sec"] for r in results[v])] for v in ran},
            "peak_bytes": {v: max((r["peak_bytes"] or 0 for r in results[v]), default=0) or None for v in ran},
            "run_seconds": {v: [round(t, 1) for t in took[v]] for v in ran},
            "flops_per_token_by_arm": fpt,
            "mfu": {v: med[v] * fpt[v] / peak for v in ran},
            "reported_mfu": {v: statistics.median(r["toolkit_mfu"] for r in results[v])
                             for v in ran if arms[v]["run"] == "toolkit"},
            # ratio of the medians (the acceptance figure) and, less sensitive to drift between rounds,
            # the median of each round's own ratio (the two runs of a round ran minutes apart)
            "ratios": {f"{x}/{y}": med[x] / med[y] for x, y in pairs},
            "round_ratios": {f"{x}/{y}": statistics.median(rx["tokens_per_sec"] / ry["tokens_per_sec"]
                                                           for rx, ry in zip(results[x], results[y]))
                             for x, y in pairs},
            "runs": results}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny", help="'tiny' or a toolkit --model value")
    ap.add_argument("--method", default="full", choices=("full", "lora"))
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"comma-separated from {', '.join(ARMS)}; sft runs only when trl imports")
    a = ap.parse_args()
    from toolkit.model.source import resolve_model

    tmp = tempfile.mkdtemp()
    path = tiny_model_dir(Path(tmp) / "tiny") if a.model == "tiny" else resolve_model(a.model)
    entry = measure(a, path, log=lambda m: print(m, flush=True))
    if entry["errors"]:
        raise SystemExit("\n".join(f"{v} failed:\n{e}" for v, e in entry["errors"].items()))
    BENCH.mkdir(exist_ok=True)
    store = BENCH / "throughput.json"
    data = json.loads(store.read_text()) if store.exists() else []
    data = [d for d in data if (d["model"], d["method"]) != (a.model, a.method)] + [entry]
    store.write_text(json.dumps(data, indent=2))
    render(data, BENCH)
    print(json.dumps({k: entry[k] for k in ("median_tokens_per_sec", "ratios", "round_ratios", "mfu")}, indent=2))


def render(data: list[dict], bench: Path) -> None:
    ratio_keys = ("toolkit/raw", "toolkit/trainer", "toolkit/sft", "full/raw", "full/trainer")
    lines = ["# Training throughput: raw PyTorch loop vs toolkit vs transformers.Trainer vs TRL SFTTrainer", "",
             "Reproduce: `python -m benchmarks.throughput --model tiny --method full` (and the other rows). "
             "Method in the script's docstring: fresh process per run, alternating order, same batches, "
             "non-padding tokens/s over the timed steps, median of the rounds (min-max in brackets). "
             "'toolkit' is its default (`--loss auto`: here the chunked loss, the LM head on target tokens only); "
             "'toolkit --loss full' computes full logits as the raw loop and Trainer do. "
             "Ratios are of the medians; the median of each round's own ratio follows in brackets. "
             "SFTTrainer: TRL 1.16 installed with --no-deps beside this environment; '-' where a row did not run "
             "it.", "",
             "| model | method | micro-batch x steps | rounds | "
             + " | ".join(f"{LABELS[v]} tokens/s" for v in VARIANTS) + " | " + " | ".join(ratio_keys)
             + " | MFU " + " / ".join(VARIANTS[:4]) + " | MFU the toolkit logged (default / --loss full) |",
             "|" + "---|" * (4 + len(VARIANTS) + len(ratio_keys) + 2)]
    for d in data:
        m, s = d["median_tokens_per_sec"], d["spread_tokens_per_sec"]
        cell = lambda v: f"{m[v]:.0f} [{s[v][0]:.0f}-{s[v][1]:.0f}]" if v in m else "-"  # noqa: E731
        ratio = lambda k: f"{d['ratios'][k]:.3f} ({d['round_ratios'][k]:.3f})" if k in d.get("ratios", {}) else "-"  # noqa: E731
        mfu = " / ".join(f"{d['mfu'][v]:.3f}" if v in d["mfu"] else "-" for v in VARIANTS[:4])
        logged = " / ".join(f"{d['reported_mfu'][v]:.3f}" if v in d.get("reported_mfu", {}) else "-"
                            for v in ("toolkit", "full"))
        lines.append(f"| {d['model']} | {d['method']} | {d['micro_batch']} x {d['steps']} | {d['repeats']} | "
                     + " | ".join(cell(v) for v in VARIANTS) + " | " + " | ".join(ratio(k) for k in ratio_keys)
                     + f" | {mfu} | {logged} |")
    probes = "; ".join(f"{d['model']} {d['method']} {d['peak_flops'] / 1e9:.0f} (probes "
                       f"{d['peak_probes'][0] / 1e9:.0f} / {d['peak_probes'][1] / 1e9:.0f} / "
                       f"{d['peak_probes'][2] / 1e9:.0f}, min / median / max of {d['peak_probes'][3]})"
                       for d in data)
    lines += ["", f"Device: {data[-1]['device']}, fp32, torch {data[-1]['torch']}. Peak for MFU, GFLOP/s, per row: "
              f"the best fp32 1024^3 matmul probe of the benchmark: {probes}. The toolkit's logged MFU divides by the "
              "one probe its run took at start-up, so it reads higher where that probe read low. "
              "MFU counts model FLOPs (6N + 12LhT per token); for the default toolkit arm the LM head's 6 N_head "
              "counts on target tokens only, where its chunked loss runs the head (the FLOPs per token it logs). "
              "The --loss full arm is the like-for-like loop comparison."]
    (bench / "throughput.md").write_text("\n".join(lines) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.5))
    width = 0.16
    for i, v in enumerate(VARIANTS):
        ax.bar([k + (i - 2) * width for k in range(len(data))], [d["median_tokens_per_sec"].get(v, 0) for d in data],
               width, label=LABELS[v])
    ax.set_xticks(range(len(data)), [f"{d['model']}\n{d['method']}" for d in data])
    ax.set_ylabel("tokens/s (median)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(bench / "throughput.png", dpi=100)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child_main(sys.argv[2:])
    else:
        main()
