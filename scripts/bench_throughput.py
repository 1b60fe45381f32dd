"""Training throughput: (a) a minimal hand-written PyTorch loop, (b) this toolkit's loop as users
run it (`--loss auto`, the chunked loss on these models) and (b') with `--loss full` (full logits,
as (a) and (c) compute them), (c) transformers.Trainer, on the same model, data, micro-batch,
precision and steps.

Each run is a fresh process. Runs alternate a, b, c, a, b, c, ... (`--repeats` rounds) so drift in
the machine's speed hits all three alike. A run trains `--warmup` steps, then times `--steps` more;
its figure is non-padding tokens / seconds over the timed steps. Every arm steps the fused AdamW
kernel: the toolkit's and Trainer's default (`adamw_torch_fused`), and the raw loop is given
`fused=True` so that toolkit / raw measures the loop around the same kernels. All arms read the same batches in
the same order (the toolkit's epoch-0 permutation), so they do the same work. The table gives
medians, min-max spread and ratios; MFU uses one FLOP count (toolkit.train.flops, PaLM's 6N + 12LhT;
the default arm's head counted on target tokens only, as it logs) and one peak: the best of the
matmul probes taken by the parent before the runs and by each run after its timed steps. (d) TRL's SFTTrainer joins when `trl` imports
(it is not a toolkit dependency: `pip install --no-deps --target /tmp/trlpkg trl` and run with
PYTHONPATH=/tmp/trlpkg); it gets the same pre-tokenized rows and collator, so it skips its own
tokenization, and keeps its per-step extras (token accuracy, entropy) as users get them.

    python scripts/bench_throughput.py --model tiny --method full
    python scripts/bench_throughput.py --model smollm2-135m-instruct --method lora
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

from _bench_common import BENCH, child_result, cpu_device, print_result, read_metrics, save_llama, sync

VARIANTS = ("raw", "toolkit", "full", "trainer", "sft")  # full: the toolkit with --loss full (logits like raw/Trainer)
LABELS = {"raw": "raw loop", "toolkit": "toolkit", "full": "toolkit --loss full", "trainer": "Trainer",
          "sft": "SFTTrainer"}
TINY = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
            num_key_value_heads=4, max_position_embeddings=512)


def tiny_model_dir(path: Path) -> str:
    """A Llama of TINY shape with SmolLM2's tokenizer, saved and loaded through from_pretrained."""
    from transformers import AutoTokenizer

    from toolkit.models import resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m-instruct"))
    return str(save_llama(path, tok, **TINY, vocab_size=len(tok)))


def setup(args, loss: str = "auto"):
    """The shared work: toolkit config, model (LoRA if asked), tokenized rows in epoch-0 order. `args.rows`
    (a JSON file of token rows) replaces the built-in data; `args.precision` is the toolkit's
    --mixed-precision (default no: fp32, as on this CPU)."""
    import torch

    from toolkit.config import parse_config
    from toolkit.data import load_examples, tokenize_examples
    from toolkit.data.tokenize import ensure_chat_template
    from toolkit.models import load_model, load_tokenizer, resolve_model
    from toolkit.train.loop import EpochShuffleSampler

    out = tempfile.mkdtemp()
    cfg = parse_config(["--model", args.model_path, "--method", args.method, "--micro-batch-size", str(args.micro_batch),
                        "--max-steps", str(args.warmup + args.steps), "--log-every", str(args.warmup),
                        "--mixed-precision", precision(args), "--lr-schedule", "constant", "--warmup-steps", "0",
                        "--output-dir", out, "--overwrite-output-dir", "--seq-len", str(getattr(args, "seq_len", 256)),
                        "--loss", loss])
    path = resolve_model(cfg.model.model)
    tok = load_tokenizer(path)
    ensure_chat_template(tok)
    if getattr(args, "rows", None):
        rows = json.loads(Path(args.rows).read_text())
    else:
        rows, _ = tokenize_examples(load_examples(cfg).train, tok, cfg)
    order = list(EpochShuffleSampler(len(rows), cfg.train.seed))
    torch.manual_seed(cfg.train.seed)
    return cfg, load_model(cfg, path), tok, [rows[i] for i in order], rows, out


def precision(args) -> str:
    return getattr(args, "precision", "no")


def run_raw(args) -> dict:
    import torch

    from toolkit.data import collate
    from toolkit.loss import count_targets, token_loss_sum

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


def run_toolkit(args, loss: str = "auto") -> dict:
    from toolkit.parallel.build import make_accelerator
    from toolkit.parallel.build import make_strategy
    from toolkit.train.loop import train

    cfg, model, tok, _, rows, out = setup(args, loss)
    train(cfg, make_strategy(cfg, make_accelerator(cfg)), model, tok, rows, [], Path(out), log=lambda *a, **k: None)
    recs = read_metrics(out)
    first, last = recs[0], recs[-1]  # the first record closes the warm-up window
    assert first["step"] == args.warmup and last["step"] == args.warmup + args.steps
    return {"tokens": last["tokens"] - first["tokens"], "seconds": last["elapsed_s"] - first["elapsed_s"],
            "toolkit_mfu": statistics.mean(r["mfu"] for r in recs[1:]),
            "flops_per_token": statistics.mean(r["flops_per_token"] for r in recs[1:])}


def run_hf_trainer(args, sft: bool = False) -> dict:
    """transformers.Trainer, or TRL's SFTTrainer (`sft`), on the same batches in the same order."""
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
                  disable_tqdm=True)
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


def trl_available() -> bool:
    try:
        import trl  # noqa: F401
    except ImportError:
        return False
    return True


def child_main(argv: list[str]) -> None:
    args = json.loads(argv[0])
    args = argparse.Namespace(**args)
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(os.cpu_count() or 1)
    run = {"raw": run_raw, "toolkit": run_toolkit, "full": lambda a: run_toolkit(a, "full"), "trainer": run_hf_trainer,
           "sft": lambda a: run_hf_trainer(a, sft=True)}[args.variant]
    result = run(args)
    from toolkit.train.flops import measure_peak_flops

    result["peak_flops"] = measure_peak_flops(device, compute_dtype(args))  # after the timed steps
    print_result(result)


def compute_dtype(args):
    import torch

    return torch.bfloat16 if precision(args) == "bf16" else torch.float32


def measure(a: argparse.Namespace, path: str, log=print) -> dict:
    """Run the arms in alternating rounds of fresh processes on model folder `path` and return the
    benchmark entry: medians, spreads, ratios and MFU against the best peak probe of the run. `a`
    holds main()'s options, plus `precision` and `rows` when the caller sets them (the GPU run)."""
    import torch
    from transformers import AutoConfig

    from toolkit.train.flops import flops_per_token, matmul_params_from_config, measure_peak_flops

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if not cuda:
        torch.set_num_threads(os.cpu_count() or 1)
    peak = measure_peak_flops(device, compute_dtype(a))
    variants = [v for v in a.variants.split(",") if v != "sft" or trl_available()]
    if not {"raw", "toolkit", "trainer"} <= set(variants) or set(variants) - set(VARIANTS):
        raise SystemExit(f"--variants: raw, toolkit and trainer are needed; choose from {', '.join(VARIANTS)}")
    results: dict[str, list[dict]] = {v: [] for v in variants}
    for rep in range(a.repeats):
        for v in variants:
            spec = {**vars(a), "variant": v, "model_path": path}
            r = child_result([__file__, "--child", json.dumps(spec)], env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
                             what=v)
            r["tokens_per_sec"] = r["tokens"] / r["seconds"]
            results[v].append(r)
            log(f"round {rep + 1} {v}: {r['tokens_per_sec']:.1f} tokens/s")
    # the device's peak: the best of every probe in this benchmark (one here, one after each run's
    # timed steps); a probe can only read low (a neighbour's load, clocks), never high
    probes = [peak] + [r["peak_flops"] for v in variants for r in results[v]]
    peak = max(probes)
    cfg = AutoConfig.from_pretrained(path)
    n = matmul_params_from_config(cfg.to_dict())
    context = statistics.mean(r["tokens"] for r in results["raw"]) / (a.steps * a.micro_batch)
    per_token = flops_per_token(n, cfg.num_hidden_layers, cfg.hidden_size, context)
    # the default's chunked loss skips the head on prompt tokens: credit the FLOPs it logged it ran
    fpt = {v: statistics.median(r["flops_per_token"] for r in results[v]) if v == "toolkit" else per_token
           for v in variants}
    med = {v: statistics.median(r["tokens_per_sec"] for r in results[v]) for v in variants}
    pairs = [(x, y) for x in ("toolkit", "full") for y in ("raw", "trainer", "sft") if x in med and y in med]
    return {"model": a.model, "method": a.method, "micro_batch": a.micro_batch, "steps": a.steps, "warmup": a.warmup,
            "repeats": a.repeats, "dtype": str(compute_dtype(a)).removeprefix("torch."),
            "device": torch.cuda.get_device_name(0) if cuda else cpu_device(),
            "torch": torch.__version__,
            "peak_flops": peak, "peak_probes": [min(probes), statistics.median(probes), max(probes), len(probes)],
            "flops_per_token": per_token,
            "median_tokens_per_sec": med,
            "spread_tokens_per_sec": {v: [min(r["tokens_per_sec"] for r in results[v]),
                                          max(r["tokens_per_sec"] for r in results[v])] for v in variants},
            "flops_per_token_by_arm": fpt,
            "mfu": {v: med[v] * fpt[v] / peak for v in variants},
            "reported_mfu": {v: statistics.median(r["toolkit_mfu"] for r in results[v])
                             for v in ("toolkit", "full") if v in results},
            # ratio of the medians (the acceptance figure) and, less sensitive to drift between rounds,
            # the median of each round's own ratio (the two runs of a round ran minutes apart)
            "ratios": {f"{x}/{y}": med[x] / med[y] for x, y in pairs},
            "round_ratios": {f"{x}/{y}": statistics.median(rx["tokens_per_sec"] / ry["tokens_per_sec"]
                                                           for rx, ry in zip(results[x], results[y])) for x, y in pairs},
            "runs": results}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny", help="'tiny' or a toolkit --model value")
    ap.add_argument("--method", default="full", choices=("full", "lora"))
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated; sft runs only when trl imports")
    a = ap.parse_args()
    from toolkit.models import resolve_model

    tmp = tempfile.mkdtemp()
    path = tiny_model_dir(Path(tmp) / "tiny") if a.model == "tiny" else resolve_model(a.model)
    try:
        entry = measure(a, path, log=lambda m: print(m, flush=True))
    except RuntimeError as e:
        raise SystemExit(str(e)) from None
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
             "Reproduce: `python scripts/bench_throughput.py --model tiny --method full` (and the other rows). "
             "Method in the script's docstring: fresh process per run, alternating order, same batches, "
             "non-padding tokens/s over the timed steps, median of the rounds (min-max in brackets). "
             "'toolkit' is its default (`--loss auto`: here the chunked loss, the LM head on target tokens only); "
             "'toolkit --loss full' computes full logits as the raw loop and Trainer do. "
             "Ratios are of the medians; the median of each round's own ratio follows in brackets. "
             "SFTTrainer: TRL 1.16 installed with --no-deps beside this environment; '-' where a row did not run it.", "",
             "| model | method | micro-batch x steps | rounds | " + " | ".join(f"{LABELS[v]} tokens/s" for v in VARIANTS)
             + " | " + " | ".join(ratio_keys) + " | MFU " + " / ".join(VARIANTS[:4]) + " | MFU the toolkit logged (default / --loss full) |",
             "|" + "---|" * (4 + len(VARIANTS) + len(ratio_keys) + 2)]
    for d in data:
        m, s = d["median_tokens_per_sec"], d["spread_tokens_per_sec"]
        cell = lambda v: f"{m[v]:.0f} [{s[v][0]:.0f}-{s[v][1]:.0f}]" if v in m else "-"  # noqa: E731
        ratio = lambda k: f"{d['ratios'][k]:.3f} ({d['round_ratios'][k]:.3f})" if k in d.get("ratios", {}) else "-"  # noqa: E731
        mfu = " / ".join(f"{d['mfu'][v]:.3f}" if v in d["mfu"] else "-" for v in VARIANTS[:4])
        logged = " / ".join(f"{d['reported_mfu'][v]:.3f}" if v in d.get("reported_mfu", {}) else "-" for v in ("toolkit", "full"))
        lines.append(f"| {d['model']} | {d['method']} | {d['micro_batch']} x {d['steps']} | {d['repeats']} | "
                     + " | ".join(cell(v) for v in VARIANTS) + " | " + " | ".join(ratio(k) for k in ratio_keys)
                     + f" | {mfu} | {logged} |")
    probes = "; ".join(f"{d['model']} {d['method']} {d['peak_flops'] / 1e9:.0f} (probes {d['peak_probes'][0] / 1e9:.0f} / "
                       f"{d['peak_probes'][1] / 1e9:.0f} / {d['peak_probes'][2] / 1e9:.0f}, min / median / max of "
                       f"{d['peak_probes'][3]})" for d in data)
    lines += ["", f"Device: {data[-1]['device']}, fp32, torch {data[-1]['torch']}. Peak for MFU, GFLOP/s, per row: the best "
              f"fp32 1024^3 matmul probe of the benchmark: {probes}. The toolkit's logged MFU divides by the "
              "one probe its run took at start-up, so it reads higher where that probe read low. "
              "MFU counts model FLOPs (6N + 12LhT per token); for the default toolkit arm the LM head's 6 N_head counts "
              "on target tokens only, where its chunked loss runs the head (the FLOPs per token it logs). "
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
