"""End-to-end runs of finetune.main on a tiny Llama, in-process (one rank)."""

import json
import os
from pathlib import Path

import pytest
import torch
from helpers import losses, records

import finetune
from toolkit.config import parse_config
from toolkit.data import collate, load_examples, tokenize_examples
from toolkit.data.tokenize import ensure_chat_template


def run(tmp_path, model, dataset, *extra):
    out = tmp_path / "out"
    argv = ["--model", str(model), "--dataset", str(dataset), "--output-dir", str(out), "--seq-len", "64",
            "--micro-batch-size", "4", "--max-steps", "6", "--log-every", "1", "--warmup-steps", "1",
            "--lr", "3e-3", *extra]
    return finetune.main(argv), out


def fixed_batch(model_dir, dataset, tmp_path):
    from transformers import AutoTokenizer

    cfg = parse_config(["--dataset", str(dataset), "--seq-len", "64", "--output-dir", str(tmp_path / "b")])
    tok = AutoTokenizer.from_pretrained(model_dir)
    ensure_chat_template(tok)
    rows, _ = tokenize_examples(load_examples(cfg.data_settings).train[:4], tok, cfg.data_settings)
    return collate(rows, tok.pad_token_id)


@pytest.mark.parametrize("method", ["full", "lora"])
@pytest.mark.parametrize("fmt", ["alpaca", "chat", "sharegpt", "text"])
def test_each_format_and_method_trains_and_saves(tmp_path, tiny_model, data_files, fmt, method):
    result, out = run(tmp_path, tiny_model, data_files[fmt], "--method", method)
    recs = records(out, "loss")
    assert [r["step"] for r in recs] == list(range(1, 7))
    for key in ("loss", "lr", "grad_norm", "tokens", "tokens_per_sec", "elapsed_s"):
        assert all(isinstance(r[key], (int, float)) for r in recs), key
    assert recs[-1]["loss"] < recs[0]["loss"]  # it learns
    assert (out / "config.yaml").is_file() and (out / "loss.png").stat().st_size > 1000
    assert any((out / "tensorboard").iterdir())
    final = out / "final"
    assert (final / "tokenizer_config.json").is_file()
    if method == "lora":
        assert (final / "adapter_model.safetensors").is_file() and not (final / "model.safetensors").exists()
    else:
        assert (final / "model.safetensors").is_file()
    assert result.summary["steps"] == 6


def test_eval_split_records_eval_loss_and_an_eval_file_gives_the_same(tmp_path, tiny_model, data_files):
    """--eval-split's held-out records are evaluated every --eval-every steps (and at step 0 with
    --eval-on-start); the same records given as --eval-dataset beside those it trains on give the same eval
    records and losses."""
    from toolkit.data import split_indices

    quick = ["--eval-every", "3", "--eval-on-start", "--report-to", "none", "--verify", "none"]
    _, split = run(tmp_path / "split", tiny_model, data_files["chat"], "--eval-split", "0.25", *quick)
    lines = data_files["chat"].read_text().splitlines()
    settings = parse_config(["--eval-split", "0.25", "--output-dir", str(tmp_path / "o")]).data_settings
    train, held = split_indices(len(lines), settings, "")
    (tmp_path / "train.jsonl").write_text("".join(lines[i] + "\n" for i in train))
    (tmp_path / "held.jsonl").write_text("".join(lines[i] + "\n" for i in held))
    _, out = run(tmp_path / "file", tiny_model, tmp_path / "train.jsonl",
                 "--eval-dataset", str(tmp_path / "held.jsonl"), *quick)
    evals = [records(o, "eval_loss") for o in (split, out)]
    assert [r["step"] for r in evals[0]] == [0, 3, 6] and evals[0][2]["eval_loss"] < evals[0][1]["eval_loss"]
    assert [r["step"] for r in evals[1]] == [0, 3, 6]
    assert [r["eval_loss"] for r in evals[1]] == pytest.approx([r["eval_loss"] for r in evals[0]], rel=1e-6)
    assert losses(out) == pytest.approx(losses(split), rel=1e-6)


def test_qlora_trains_4bit_base(tmp_path, tiny_model, data_files):
    result, out = run(tmp_path, tiny_model, data_files["alpaca"], "--method", "qlora")
    assert any(type(m).__name__ == "Linear4bit" for m in result.model.modules())
    recs = records(out, "loss")
    assert recs[-1]["loss"] < recs[0]["loss"]
    assert (out / "final" / "adapter_model.safetensors").is_file()


def test_gradient_checkpointing_gives_the_same_losses(tmp_path, tiny_model, data_files):
    """The blocks really recompute (transformers' per-layer flag, set by `toolkit.parallel.parallelize`)."""
    from toolkit.model.kernels import decoder_layers

    plain, a = run(tmp_path / "a", tiny_model, data_files["chat"], "--method", "lora")
    checkpointed, b = run(tmp_path / "b", tiny_model, data_files["chat"], "--method", "lora",
                          "--gradient-checkpointing")
    assert [layer.gradient_checkpointing for layer in decoder_layers(checkpointed.model)] == [True] * 2
    assert not any(layer.gradient_checkpointing for layer in decoder_layers(plain.model))
    la = [r["loss"] for r in records(a)]
    lb = [r["loss"] for r in records(b)]
    assert la == pytest.approx(lb, rel=1e-5)


def test_adapter_and_merged_model_reload_with_plain_libraries(tmp_path, tiny_model, data_files):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from toolkit.cli.main import main as cli

    result, out = run(tmp_path, tiny_model, data_files["chat"], "--method", "lora")
    batch = fixed_batch(tiny_model, data_files["chat"], tmp_path)
    with torch.no_grad():
        trained = result.model.eval()(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        base = AutoModelForCausalLM.from_pretrained(tiny_model)
        adapter = PeftModel.from_pretrained(base, out / "final").eval()
        reloaded = adapter(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        cli(["merge", "--adapter", str(out / "final"), "--output", str(tmp_path / "merged")])
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
        merged_logits = merged(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        untrained = AutoModelForCausalLM.from_pretrained(tiny_model)(input_ids=batch["input_ids"]).logits
    assert not torch.allclose(untrained, trained, atol=1e-3)  # training changed the model
    torch.testing.assert_close(reloaded, trained, atol=1e-5, rtol=0)
    torch.testing.assert_close(merged_logits, trained, atol=1e-5, rtol=0)


def test_full_model_reloads_with_plain_transformers(tmp_path, tiny_model, data_files):
    from transformers import AutoModelForCausalLM

    result, out = run(tmp_path, tiny_model, data_files["alpaca"], "--method", "full")
    batch = fixed_batch(tiny_model, data_files["alpaca"], tmp_path)
    with torch.no_grad():
        trained = result.model.eval()(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        reloaded = AutoModelForCausalLM.from_pretrained(out / "final").eval()(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    torch.testing.assert_close(reloaded, trained, atol=1e-5, rtol=0)


def test_generate_cli_prints_the_greedy_completion(tmp_path, tiny_model, data_files, capsys):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from toolkit.cli.main import main as cli
    from toolkit.data.tokenize import prompt_text

    _, out = run(tmp_path, tiny_model, data_files["chat"], "--method", "lora")
    capsys.readouterr()
    cli(["generate", "--model", str(out / "final"), "--prompt", "the quick fox", "--max-new-tokens", "8"])
    printed = capsys.readouterr().out.strip()
    tok = AutoTokenizer.from_pretrained(out / "final")
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), out / "final").eval()
    enc = tok(prompt_text(tok, [{"role": "user", "content": "the quick fox"}]), return_tensors="pt",
              add_special_tokens=False)
    ids = model.generate(**enc, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
    assert printed == tok.decode(ids[0, enc["input_ids"].shape[1]:], skip_special_tokens=True).strip()


@pytest.mark.parametrize("method", ["lora", "full"])
def test_integrity_check_fails_loudly_on_a_bad_save(tmp_path, tiny_model, data_files, method):
    """Every level catches what it claims to: values that differ (an all-zero adapter, one flipped
    weight), a tensor missing, a truncated file (`files`, from the in-memory tensors); a save whose
    loss differs when reloaded in this process (`load`) and in a fresh one (`full`)."""
    import shutil

    from accelerate import Accelerator
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    from toolkit.parallel.accelerated import AccelerateStrategy
    from toolkit.train.checkpoint import save_final
    from toolkit.train.integrity import verify_saved

    result, out = run(tmp_path, tiny_model, data_files["chat"], "--method", method)
    passed = json.loads((out / "integrity.json").read_text())  # the real run passed its check
    assert passed["ok"] and passed["level"] == "load" and passed["files"]["tensors"] > 0
    assert passed["relative_diff"] <= 1e-4
    tok = AutoTokenizer.from_pretrained(out / "final")
    cfg = parse_config(["--dataset", str(data_files["chat"]), "--seq-len", "64", "--output-dir", str(tmp_path / "x")])
    rows, _ = tokenize_examples(load_examples(cfg.data_settings).train[:4], tok, cfg.data_settings)
    strategy = AccelerateStrategy(Accelerator(cpu=True))
    good = tmp_path / "good"
    expected = save_final(strategy, result.model, tok, good)
    name = "adapter_model.safetensors" if method == "lora" else "model.safetensors"

    def damaged(how) -> Path:
        folder = tmp_path / how
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(good, folder)
        path, state = folder / name, load_file(good / name)
        key = sorted(state)[0]
        if how == "zeros":
            save_file({k: torch.zeros_like(v) for k, v in state.items()}, path)
        elif how == "one_weight":
            state[key] = state[key].clone()
            state[key].view(-1)[0] += 1.0
            save_file(state, path)
        elif how == "missing":
            save_file({k: v for k, v in state.items() if k != key}, path)
        elif how == "truncated":
            path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
        return folder

    def check(folder, level, written):
        return verify_saved(strategy, result.model, tok, rows, folder, str(tiny_model), "no", False, log=lambda m: None,
                            level=level, expected=written)

    assert check(good, "files", expected)["ok"]
    for how, words in (("zeros", "differs from the trained model's"),
                       ("one_weight", "differs from the trained model's"),
                       ("missing", "was not saved"), ("truncated", "cannot be read")):
        with pytest.raises(SystemExit, match=f"integrity check FAILED: .*{words}"):
            check(damaged(how), "files", expected)
    # without the in-memory tensors, the reloaded loss finds the bad save (the fresh-process reload, a
    # second start-up each time, once: for the adapter)
    for level in ("load", "full") if method == "lora" else ("load",):
        assert check(good, level, None)["reloaded_loss"] == pytest.approx(passed["trained_loss"], rel=1e-4)
        with pytest.raises(SystemExit, match="integrity check FAILED: .*reloaded with plain transformers/peft"):
            check(damaged("zeros"), level, None)


def test_strategy_auto_plans_writes_plan_json_and_trains(tmp_path, tiny_model, data_files):
    import yaml

    result, out = run(tmp_path, tiny_model, data_files["chat"], "--method", "full", "--strategy", "auto",
                      "--micro-batch-size", "1", "--grad-accum", "4")
    plan = json.loads((out / "plan.json").read_text())
    assert plan["chosen"] == "ddp"  # one CPU process, fp32: nothing to shard
    cfg = yaml.safe_load((out / "config.yaml").read_text())
    # the planner kept the global batch (1 x 4 x 1 rank) and its split: one process has no per-micro-batch
    # traffic that a larger micro-batch would share, so none is predicted faster
    assert (cfg["micro_batch_size"], cfg["grad_accum"]) == (1, 4)
    assert result.summary["steps"] == 6


def test_strategy_auto_falls_back_after_an_out_of_memory(tmp_path, tiny_model, data_files):
    """--strategy auto on one process: an out-of-memory at step 1 (simulated: torch.OutOfMemoryError,
    as the allocator raises it, once) is one line naming the plan's first fallback, and the same
    command runs again on it (exec) and finishes; the config it ran with is that fallback's, said in
    one line at its start. plan.json lists the fallbacks in order: checkpointing on, then smaller
    micro-batches with the global batch kept, then layouts that hold less per GPU."""
    import os
    import subprocess
    import sys

    import yaml

    out, fired = tmp_path / "out", tmp_path / "fired"
    argv = [sys.executable, str(Path(finetune.__file__)), "--model", str(tiny_model), "--dataset",
            str(data_files["alpaca"]), "--output-dir", str(out), "--seq-len", "64", "--max-steps", "2",
            "--method", "lora", "--strategy", "auto", "--verify", "files", "--report-to", "none"]
    env = {**os.environ, "TOOLKIT_FAULT": f"step:1:error=oom:once={fired}"}
    p = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=Path(finetune.__file__).parent, timeout=300)
    assert p.returncode == 0 and fired.exists(), p.stderr[-3000:]
    plan = json.loads((out / "plan.json").read_text())
    first = plan["fallbacks"][0]
    said = [ln for ln in p.stdout.splitlines() if "under --strategy auto: falling back to" in ln]
    assert len(said) == 1 and said[0].startswith("out of memory at step 1 under --strategy auto: falling back to "
                                                 f"{first['what']}"), p.stdout[-3000:]
    assert f"layout: fallback 1 of the plan after an out-of-memory: {first['what']}" in p.stdout
    assert "Traceback" not in p.stderr
    ran = yaml.safe_load((out / "config.yaml").read_text())
    assert (ran["gradient_checkpointing"], ran["micro_batch_size"], ran["grad_accum"]) == \
        (True, first["micro_batch"], first["grad_accum"])
    assert not plan["chosen_detail"]["checkpointing"] and first["what"] == "gradient checkpointing on"
    whats = [f["what"] for f in plan["fallbacks"]]
    assert any(w.startswith("micro-batch 1 x accumulation") for w in whats[1:])
    assert json.loads((out / "summary.json").read_text())["steps"] == 2


def test_strategy_auto_refuses_manual_sharding_flags(tmp_path):
    from toolkit.errors import UserError

    with pytest.raises(UserError, match="--strategy auto picks the sharding itself"):
        parse_config(["--strategy", "auto", "--zero-stage", "2", "--output-dir", str(tmp_path / "o")])


@pytest.mark.parametrize("method, precision, base, trainable", [
    ("full", "bf16", torch.float32, torch.float32),  # masters stay fp32; autocast computes in bf16
    ("lora", "no", torch.float32, torch.float32),
    ("lora", "bf16", torch.bfloat16, torch.float32),  # the frozen base in half, adapters fp32
    ("lora", "fp16", torch.float16, torch.float32),
])
def test_parameter_dtypes_per_method_and_precision(tmp_path, tiny_model, method, precision, base, trainable):
    from toolkit.model.load import ModelShape, load_model
    from toolkit.parallel.parallelize import Parallelism, parallelize

    cfg = parse_config(["--method", method, "--mixed-precision", precision, "--output-dir", str(tmp_path / "o")])
    model, _ = parallelize(load_model(cfg, str(tiny_model)), Parallelism(ModelShape.of(cfg)))
    frozen = {p.dtype for p in model.parameters() if not p.requires_grad}
    trained = {p.dtype for p in model.parameters() if p.requires_grad}
    assert trained == {trainable} and frozen in (set(), {base})
    assert (method == "full") == (not frozen)


def test_lora_bf16_step_runs_on_cpu_and_holds_the_planned_bytes(tmp_path, tiny_model, data_files):
    """A LoRA run in bf16 on CPU trains and saves, and the weights it holds are what the planner now
    predicts for DDP in bf16 (base 2 bytes, adapters 4), half the fp32 base."""
    from toolkit.planner.memory import STRATEGIES, weights_bytes
    from toolkit.planner.params import count_params, lora_params

    result, out = run(tmp_path, tiny_model, data_files["chat"], "--method", "lora", "--mixed-precision", "bf16",
                      "--lora-r", "8")
    recs = records(out, "loss")
    assert len(recs) == 6 and all(r["loss"] == r["loss"] for r in recs)  # finite
    assert json.loads((out / "integrity.json").read_text())["ok"]
    cfg = json.loads((tiny_model / "config.json").read_text())
    params, adapters = count_params(cfg).total, lora_params(cfg, 8)
    predicted = weights_bytes(STRATEGIES["ddp"], params, adapters, 1, "bf16")
    assert recs[0]["param_bytes"] == [predicted]
    assert predicted < weights_bytes(STRATEGIES["ddp"], params, adapters, 1, "no")


@pytest.mark.parametrize("arch", ["MixtralForCausalLM", "Qwen2MoeForCausalLM", "LlamaForCausalLM"])
def test_integrity_files_check_passes_a_good_save_whatever_transformers_renames(tmp_path, arch):
    """transformers 5 fuses MoE experts in memory and writes them one entry per expert (and drops tied
    copies): the files check compares against what save_pretrained writes, so a good save passes and a
    changed expert does not."""
    import transformers
    from safetensors.torch import load_file, save_file

    from toolkit.train.integrity import check_files, saved_state

    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=128, tie_word_embeddings=True)
    if arch != "LlamaForCausalLM":
        small.update(num_local_experts=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                     shared_expert_intermediate_size=16)
    cls = getattr(transformers, arch)
    model = cls(cls.config_class(**small))
    state = model.state_dict()
    model.save_pretrained(tmp_path, state_dict=dict(state), safe_serialization=True)  # it empties the dict it gets
    n, problems = check_files(tmp_path, saved_state(model, state))
    assert problems == [] and n == len(load_file(tmp_path / "model.safetensors"))
    saved = load_file(tmp_path / "model.safetensors")
    key = next(k for k in sorted(saved) if "experts" in k or "mlp" in k)
    saved[key] = saved[key] + 1
    save_file(saved, tmp_path / "model.safetensors", metadata={"format": "pt"})
    assert any(key in p and "differs" in p for p in check_files(tmp_path, saved_state(model, state))[1])


def test_command_line_run_imports_only_what_it_uses(tmp_path, tiny_model, data_files):
    """A LoRA run from the command line, its data already cached, imports peft but not datasets or
    pandas (the cached table is read with pyarrow), bitsandbytes (QLoRA only), DeepSpeed (no ZeRO
    layout), scipy or boto3 (toolkit.cli.startup): together 2-3 s of a tiny run's start-up on 2 cores
    (benchmarks/startup.md). A package that another installed distribution requires stays importable:
    here a stand-in for scikit-learn (a distribution requiring scipy, importing scipy.sparse when
    imported) and a stand-in scipy, on the path; transformers 4.47-5.20 import scikit-learn at module
    level, so hiding scipy stopped every run (issue 56)."""
    import subprocess
    import sys

    from toolkit.data.prepare import prepare_data
    from toolkit.model.load import load_tokenizer

    argv = ["--model", str(tiny_model), "--dataset", str(data_files["alpaca"]), "--output-dir", str(tmp_path / "o"),
            "--seq-len", "64", "--max-steps", "1", "--method", "lora"]
    tokenizer = load_tokenizer(str(tiny_model), False)
    ensure_chat_template(tokenizer)
    prepare_data(parse_config(argv).data_settings, tokenizer)  # the cache the run reads, as finetune.main builds it
    site = tmp_path / "site"
    (site / "scipy").mkdir(parents=True)
    (site / "scipy" / "__init__.py").write_text("")
    (site / "scipy" / "sparse.py").write_text("")
    (site / "scipy" / "optimize.py").write_text("def linear_sum_assignment(cost): ...\n")  # transformers' DETR loss
    (site / "sklearnish").mkdir()
    (site / "sklearnish" / "__init__.py").write_text("import scipy.sparse  # as sklearn's __init__ does\n")
    (site / "sklearnish-1.0.dist-info").mkdir()
    (site / "sklearnish-1.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: sklearnish\nVersion: 1.0\nRequires-Dist: scipy>=1.0\n"
        "Requires-Dist: boto3; extra == 's3'\n")  # an extra's requirement does not count: boto3 stays out
    script = ("import json, sys; sys.argv = ['finetune.py', *sys.argv[1:]]; import finetune; finetune.main(); "
              "print(json.dumps(sorted(m for m, v in sys.modules.items() if v is not None and '.' not in m))); "
              "print('boto3 hidden:', sys.modules.get('boto3', 1) is None); import sklearnish; "
              "print('sklearnish imports')")
    p = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, timeout=300,
                       cwd=Path(finetune.__file__).parent, env={**os.environ, "PYTHONPATH": str(site)})
    assert p.returncode == 0, p.stderr[-3000:]
    lines = p.stdout.strip().splitlines()
    assert lines[-2:] == ["boto3 hidden: True", "sklearnish imports"]
    imported = set(json.loads(lines[-3]))  # main() as the command line calls it (no argv)
    assert "peft" in imported and "pyarrow" in imported
    assert not imported & {"datasets", "pandas", "bitsandbytes", "deepspeed", "boto3"}  # scipy: required here


def test_a_package_is_left_out_only_where_no_installed_distribution_requires_it(tmp_path, monkeypatch):
    """The toolkit's own requirements do not count; another distribution's do, unless they are an
    extra's, another platform's, or a longer name (the installed set stood in for, whatever this
    machine has installed)."""
    from importlib import metadata

    from toolkit.cli import startup

    def dist(name: str, *requires: str):
        info = tmp_path / f"{name}-1.0.dist-info"
        info.mkdir()
        info.joinpath("METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n"
                                             + "".join(f"Requires-Dist: {r}\n" for r in requires))
        return metadata.PathDistribution(info)

    ours = dist("toolkit", "scipy", "deepspeed>=0.17", "bitsandbytes")
    other = dist("sklearnish", "scipy>=1.0", "boto3; extra == 's3'", "deepspeed; sys_platform == 'nonexistent'",
                 "scipy-stubs")
    names = ["scipy", "boto3", "deepspeed", "bitsandbytes"]
    monkeypatch.setattr(startup.metadata, "distributions", lambda: [ours])
    assert startup.required_elsewhere(names) == set()
    monkeypatch.setattr(startup.metadata, "distributions", lambda: [ours, other])
    assert startup.required_elsewhere(names) == {"scipy"}


def test_out_of_memory_is_one_line_and_keeps_the_last_checkpoint(tmp_path, tiny_model, data_files, monkeypatch, capsys):
    """A CUDA out-of-memory (simulated: torch.OutOfMemoryError from the step, as the allocator raises
    it) at step 3 becomes one line naming the step, the layout, the planner's figures and a layout
    that fits, with exit status 2 and no traceback; checkpoint-2 stays complete and resumable."""
    from toolkit.parallel.accelerated import AccelerateStrategy
    from toolkit.train.checkpoint import complete_checkpoints

    real, calls = AccelerateStrategy.forward_backward, []

    def forward_backward(self, *a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(self, *a, **k)

    monkeypatch.setattr(AccelerateStrategy, "forward_backward", forward_backward)
    with pytest.raises(SystemExit) as e:
        run(tmp_path, tiny_model, data_files["alpaca"], "--save-every", "2", "--method", "lora")
    assert e.value.code == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip() and "%|" not in ln]
    assert len(err) == 1 and err[0].startswith("finetune.py: error: out of memory at step 3 ("), err
    assert ("(layout ddp on 1 process(es), micro-batch 4, seq-len 64" in err[0] and "a layout that fits: " in err[0]
            and "Traceback" not in err[0])
    assert f"The last checkpoint, {tmp_path / 'out' / 'checkpoint-2'}, is intact" in err[0]
    assert [p.name for p in complete_checkpoints(tmp_path / "out")] == ["checkpoint-2"]


def test_first_step_peak_is_logged_beside_the_prediction_and_a_high_one_warns(tmp_path, tiny_model, data_files,
                                                                              monkeypatch, capsys):
    """On a GPU (its allocator statistic stood in for here: `device_peak`, the one CUDA-only read),
    step 1's record holds the measured peak and the planner's prediction for the layout; a peak over
    1.1x the prediction is one warning line. On the CPU neither field is written."""
    from toolkit.planner.auto import predicted_peak

    monkeypatch.setattr("toolkit.train.loop.device_peak", lambda device: 10 * 2**30)
    result, out = run(tmp_path, tiny_model, data_files["alpaca"], "--method", "lora", "--max-steps", "2")
    first = records(out, "loss")[0]
    cfg = parse_config(["--model", str(tiny_model), "--dataset", str(data_files["alpaca"]), "--output-dir",
                        str(out), "--overwrite-output-dir", "--seq-len", "64", "--micro-batch-size", "4",
                        "--method", "lora"])
    assert first["peak_allocated_bytes"] == 10 * 2**30
    assert first["predicted_peak_bytes"] == predicted_peak(cfg, json.loads((tiny_model / "config.json").read_text()),
                                                           "no") > 0
    said = [ln for ln in capsys.readouterr().out.splitlines() if "of device memory" in ln]
    assert len(said) == 1 and said[0].startswith("warning: step 1 peaked at 10.00 GiB")
    monkeypatch.undo()
    _, cpu = run(tmp_path / "cpu", tiny_model, data_files["alpaca"], "--method", "lora", "--max-steps", "1")
    assert "peak_allocated_bytes" not in records(cpu, "loss")[0]


def test_a_step_reads_nothing_back_except_for_its_record(tmp_path, tiny_model, data_files, monkeypatch):
    """On a GPU every read-back (`.item()`, `float(t)`, `.tolist()`, `nonzero`) waits for all the work
    queued before it. Counted around each step through two seams: the loop's own reads
    (`toolkit.train.step.host`) and torch's scalar reads (aten._local_scalar_dense and nonzero, seen by
    a dispatch mode, with `Tensor.tolist`) inside `one_step`. With a record every 3rd step, steps 2,
    4 and 5 read nothing; 3 and 6 read once, in `log_window`. (Step 1 also records the run's memory
    figures, once per run; transformers' mask preparation inside the forward is counted apart.) The
    records are the window's: the losses of a run logged every step, averaged."""
    import traceback

    from torch.utils._python_dispatch import TorchDispatchMode

    import toolkit.train.loop as loop
    import toolkit.train.step as step_module

    class Reads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.__name__.split(".")[0] in ("_local_scalar_dense", "nonzero"):
                count()
            return func(*args, **(kwargs or {}))

    def count():
        # transformers' own mask preparation reads the padding mask back once or twice per forward
        # (masking_utils: `fast_all` of the mask for SDPA's causal shortcut, packed-sequence
        # detection), and on the CPU varlen's reference (padding-free rows, the default there) reads its
        # documents' lengths once per forward (torch's CUDA kernel takes them on the device): the model's,
        # not the loop's, and counted apart
        stack = traceback.extract_stack()
        model = any("transformers/masking_utils" in f.filename or f.name == "reference_varlen" for f in stack)
        where = "model" if model else current[0]
        counts[where] = counts.get(where, 0) + 1

    counts, current, inside = {}, [0], [False]
    real_step, real_host, real_tolist = loop.one_step, step_module.host, torch.Tensor.tolist

    def one_step(run, micro, first=False):
        current[0] += 1
        with Reads():
            return real_step(run, micro, first)

    def host(t):
        counts[current[0]] = counts.get(current[0], 0) + 100  # the loop's own read-back: counted apart
        inside[0] = True
        try:
            return real_host(t)
        finally:
            inside[0] = False

    def tolist(t):
        if not inside[0]:
            count()
        return real_tolist(t)

    monkeypatch.setattr(loop, "one_step", one_step)
    monkeypatch.setattr(loop, "host", host, raising=False)
    monkeypatch.setattr(step_module, "host", host)
    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "tolist", tolist)
        _, out = run(tmp_path, tiny_model, data_files["alpaca"], "--log-every", "3", "--method", "full")
    assert {s: counts.get(s, 0) for s in range(2, 7)} == {2: 0, 3: 100, 4: 0, 5: 0, 6: 100}, counts
    every = run(tmp_path / "every", tiny_model, data_files["alpaca"], "--method", "full")[1]
    logged = dict(losses(out, steps=True))
    assert sorted(logged) == [3, 6]
    by_step = dict(losses(every, steps=True))
    assert logged[6] == pytest.approx((by_step[4] + by_step[5] + by_step[6]) / 3, rel=0.05)


def test_compile_auto_times_eager_steps_then_compiles_where_it_pays(tmp_path, tiny_model, data_files, monkeypatch,
                                                                    capsys):
    """--compile auto, the default: on this CPU eager, said in one line, its batches unpadded. Where auto
    compiles (a GPU; here the seam lets it, with aot_eager), it times steps 2-3 eager and compiles from step
    4 when the steps left repay the compile: the losses are the eager run's (1e-4 relative), step 4's record
    is the warm-up, later records count the compiled graphs, and the compile's measured seconds are kept,
    so the next run of this shape weighs them, not the H200's cold figure (and stays eager when they do not pay)."""
    from toolkit.data.packing import Collate
    from toolkit.model.kernels import COMPILE_BACKEND_ENV, decoder_layers
    from toolkit.train import compiling

    monkeypatch.setenv(COMPILE_BACKEND_ENV, "aot_eager")
    monkeypatch.setenv("TOOLKIT_CACHE", str(tmp_path / "cache"))
    bucketed, collate = [], Collate.__call__
    monkeypatch.setattr(Collate, "__call__", lambda self, batch: bucketed.append(self.bucket) or collate(self, batch))
    args = (tiny_model, data_files["chat"], "--method", "full")
    eager = losses(run(tmp_path / "cpu", *args)[1])
    said = capsys.readouterr().out
    assert said.count("compile: auto: eager on cpu (inductor's C++ build takes minutes") == 1
    assert bucketed and not any(bucketed)  # eager: each batch as wide as its longest row
    bucketed.clear()
    monkeypatch.setenv(compiling.AUTO_DEVICES_ENV, "cpu,cuda")  # as auto runs on a GPU
    monkeypatch.setattr(compiling, "MEASURED", {"lora": compiling.Measured(0.4, 1e-6),  # any compile pays
                                                "full": compiling.Measured(0.24, 1e-6)})
    result, out = run(tmp_path / "auto", *args)
    said = capsys.readouterr().out
    assert "compile: auto: compiling the decoder blocks from step 4: eager steps take" in said
    assert "an H200's cold compile of the 1B shape" in said and "compile: step 4 compiled the blocks in" in said
    got = records(out, "loss")
    assert [r["loss"] for r in got] == pytest.approx(eager, rel=1e-4)
    assert [r["step"] for r in got if r.get("compile_warmup")] == [4]
    assert all(r["compiled_graphs"] >= 1 for r in got if r["step"] > 4) and "compiled_graphs" not in got[0]
    assert all(b._compiled_call_impl is not None for b in decoder_layers(result.model))
    assert not any(bucketed[:3]) and bucketed[-1]  # padded to few widths once the blocks compile
    kept = json.loads((tmp_path / "cache" / "compile_seconds.json").read_text())
    assert len(kept) == 1 and list(kept.values())[0] > 0
    monkeypatch.setattr(compiling, "MEASURED", {"full": compiling.Measured(1e-9, 1e-6)})  # nothing repays it
    result, out = run(tmp_path / "again", *args)
    said = capsys.readouterr().out
    assert "compile: auto: eager: eager steps take" in said and "(measured on the last run of this shape)" in said
    assert not any(r.get("compile_warmup") for r in records(out))
    assert all(b._compiled_call_impl is None for b in decoder_layers(result.model))


def test_compile_auto_says_why_a_layout_runs_eager_and_buckets_what_compiles():
    """Layouts that refuse --compile run eager under auto, in the refusal's words; batches that may
    compile are padded to few widths: a multiple of 64 unpacked, the packing width packed."""
    from toolkit.data import bucket_width
    from toolkit.train import compiling

    for flags, words in ((["--zero-stage", "3"],
                          "compile: auto: eager: --compile with --zero-stage 3 is not supported"),
                         (["--pp", "2"], "compile: auto: eager: --compile with --pp 2 is not supported yet")):
        cfg, said = parse_config(["--dataset", "x.json", *flags], check_dataset=False), []
        assert compiling.plan(cfg, "cuda", None, 2, Path("."), said.append).mode == "off"
        assert len(said) == 1 and said[0].startswith(words), (flags, said)
    assert [bucket_width(n, 64) for n in (1, 64, 65, 200)] == [64, 64, 128, 256] and bucket_width(37, 1) == 37
    assert bucket_width(65, 64, cap=100) == 100 and bucket_width(120, 64, cap=100) == 120  # never past --seq-len
    assert compiling.pays(100, 0.5, 12.0, 0.25) and not compiling.pays(100, 0.5, 12.6, 0.25)  # 100 x 0.5 s x 25%


@pytest.mark.parametrize("method, eager_step_s", [("lora", 0.172), ("full", 0.185)])
def test_compile_auto_compiles_an_epoch_and_leaves_a_short_run_eager(method, eager_step_s):
    """Issue 66, by the H200's measured figures (`compiling.MEASURED`: each method's gain a step and cold
    compile, and its eager step on the 1B shape at 2048 x 4 packed): one epoch of GSM8K's 7,473 records (~380
    packed steps; 377 left when auto decides after step 3) compiles; the 30-step run stays eager (the old rule, a
    60 s guess at 25% a step, left the epoch eager too)."""
    from toolkit.train import compiling

    m = compiling.measured(method)
    assert compiling.pays(380 - 3, eager_step_s, m.cold_s, m.gain)
    assert not compiling.pays(30 - 3, eager_step_s, m.cold_s, m.gain)
    assert not compiling.pays(380 - 3, eager_step_s, 60.0, 0.25)  # the rule it replaced
    assert compiling.measured("qlora") == compiling.measured("lora")


def test_batches_bucket_to_few_widths_once_blocks_compile():
    """The loader's collate pads to its longest row until the blocks compile, then SFT, pair and KTO
    batches to a multiple of 64 up to --seq-len, packed rows (a pair's: 2 x --seq-len) to the packing
    width, their padding's positions below --seq-len; the real tokens and labels are the same."""
    from toolkit.data.packing import Collate

    def rows(*lengths):
        return [{"input_ids": list(range(5, 5 + n)), "labels": [-100] + list(range(6, 5 + n))} for n in lengths]

    def widths(collate, batch):
        out = collate(batch)
        return out["input_ids"].shape[1], out

    sft = Collate(0, whole=True, packed=False, width=100, seq_len=100)
    assert widths(sft, rows(3, 7))[0] == 7
    sft.bucket = True
    (w, out), (w2, _) = widths(sft, rows(3, 7)), widths(sft, rows(70, 90))
    assert (w, w2) == (64, 100) and out["labels"][1, :7].tolist() == rows(7)[0]["labels"]
    assert (out["attention_mask"].sum(1) == torch.tensor([3, 7])).all()
    pairs = [{"input_ids": r["input_ids"], "labels": r["labels"], "rejected_input_ids": q["input_ids"],
              "rejected_labels": q["labels"]} for r, q in zip(rows(3, 9), rows(5, 4))]
    kto = [{"input_ids": r["input_ids"], "labels": r["labels"], "kl_input_ids": r["input_ids"][:2],
            "kl_labels": r["labels"][:2], "desirable": True} for r in rows(3, 9)]
    assert widths(sft, pairs)[0] == 64 and widths(sft, kto)[1]["kl_input_ids"].shape[1] == 64
    packed = Collate(0, whole=True, packed=True, width=200, seq_len=100)  # a pair's row: 2 x --seq-len
    docs = [{"input_ids": r["input_ids"], "labels": r["labels"], "position_ids": list(range(len(r["input_ids"])))}
            for r in rows(30)]
    assert widths(packed, docs)[0] == 30
    packed.bucket = True
    w, out = widths(packed, docs)
    assert w == 200 and out["position_ids"].max() < 100 and out["position_ids"][0, :30].tolist() == list(range(30))


@pytest.mark.parametrize("extra", [["--method", "lora", "--packing", "--seq-len", "128"],
                                   ["--method", "full", "--gradient-checkpointing"]],
                         ids=["lora-packing", "full-gc"])
def test_compiled_blocks_train_as_eager_ones(tmp_path, tiny_model, data_files, monkeypatch, extra):
    """--compile compiles each decoder block (regional); LoRA with packing, and a full finetune with
    checkpointing, give the eager run's losses (1e-4 relative) and the first step's record says it was the
    compile warm-up; packed rows compile nothing after step 1 (issue 66: step 2 compiled the blocks again, the
    documents a row holds and the longest's length having changed). (Checkpointed blocks with packed rows
    compile nothing on a CPU: the per-document attention there is left out of graphs, and a checkpointed
    region must trace whole; on a GPU it is the varlen kernel.) Compiled with the aot_eager backend (dynamo
    + AOTAutograd, the graphs a GPU run compiles, without inductor's C++ build: minutes on 2 cores); the
    block is really compiled (its compiled call is set)."""
    from toolkit.model.kernels import COMPILE_BACKEND_ENV, decoder_layers

    monkeypatch.setenv(COMPILE_BACKEND_ENV, "aot_eager")
    data = data_files["alpaca" if "--packing" in extra else "chat"]  # alpaca's: a row packs several, their count varies
    eager = losses(run(tmp_path / "eager", tiny_model, data, *extra)[1])
    result, out = run(tmp_path / "compiled", tiny_model, data, *extra, "--compile")
    compiled = records(out, "loss")
    assert [r["loss"] for r in compiled] == pytest.approx(eager, rel=1e-4)
    assert compiled[0].get("compile_warmup") and not any(r.get("compile_warmup") for r in compiled[1:])
    assert all(b._compiled_call_impl is not None for b in decoder_layers(result.model))
    assert compiled[0]["compiled_graphs"] > 0
    if "--packing" in extra:  # packed rows: no graph compiled after step 1 (issue 66: step 2 compiled them again)
        assert len({r["compiled_graphs"] for r in compiled}) == 1, [r["compiled_graphs"] for r in compiled]


def test_profile_names_what_a_step_spends(tmp_path, tiny_model, data_files, capsys):
    """--profile (issue 66): steps 4-6 under torch.profiler, their costliest ops per step in profile.json (what
    the GPU user part reports), torch's table in profile.txt, a chrome trace, and one line; the training is the
    unprofiled run's."""
    _, plain = run(tmp_path / "plain", tiny_model, data_files["alpaca"])
    _, out = run(tmp_path / "profiled", tiny_model, data_files["alpaca"], "--profile")
    said = capsys.readouterr().out
    profile = json.loads((out / "profile.json").read_text())
    assert profile["steps"] == [4, 6] and len(profile["per_step_top"]) > 5
    assert any(e["name"] == "aten::mm" and e["self_ms"] > 0 for e in profile["per_step_top"])
    assert (out / "profile.txt").read_text().startswith("steps 4-6") and (out / "profile_trace.json").stat().st_size
    assert "profile: steps 4-6 in" in said
    assert losses(out) == losses(plain)
