"""Around the run (issue 38): trackers (--report-to), an eval at step 0, sample generations, the
logging cadence, the flag names people bring from Trainer/TRL, generate's sampling flags, and the
example recipes, each planned."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import losses, records

import finetune
from toolkit.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = "Write 2001-02-03 in ledger style.;Say hello."


@pytest.fixture(scope="module")
def tracked(tmp_path_factory, tiny_model, data_files):
    """One LoRA run of 6 steps reporting to tensorboard and mlflow, with an eval split, an eval at step
    0 and samples every 3 steps; the default --log-every (0: every step in a run this short)."""
    out = tmp_path_factory.mktemp("tracked") / "run"
    finetune.main(["--model", str(tiny_model), "--dataset", str(data_files["chat"]), "--output-dir", str(out),
                   "--seq-len", "64", "--micro-batch-size", "4", "--max-steps", "6", "--lr", "3e-3",
                   "--warmup-steps", "1", "--eval-split", "0.25", "--eval-every", "3", "--eval-on-start",
                   "--report-to", "tensorboard,mlflow", "--sample-prompts", PROMPTS, "--sample-every", "3",
                   "--sample-max-new-tokens", "8", "--mixed-precision", "no", "--verify", "files"])
    return out


def test_eval_at_step_0_and_every_step_logged_by_default(tracked):
    evals = [r["step"] for r in records(tracked, "eval_loss")]
    assert evals == [0, 3, 6]
    assert [s for s, _ in losses(tracked, steps=True)] == [1, 2, 3, 4, 5, 6]  # --log-every 0, 6 steps


def test_log_interval_gives_about_fifty_records():
    from toolkit.train.metrics import log_interval

    assert [log_interval(0, n) for n in (1, 20, 49, 50, 120, 1000, 10000)] == [1, 1, 1, 1, 2, 20, 200]
    assert log_interval(7, 1000) == 7  # given: kept


def test_loss_png_covers_the_steps_before_a_resume_and_eval_pauses_the_bar(tmp_path, monkeypatch):
    """A resumed run's loss.png is drawn from every record in metrics.jsonl, not only this process's;
    the bar names an eval while it runs and leaves its time out of the rate (tqdm's unpause)."""
    import time

    from toolkit.train import metrics

    drawn = []
    monkeypatch.setattr(metrics, "plot_loss", lambda records, path: drawn.append([r["step"] for r in records]))
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 2, 3)))
    m = metrics.MetricsLogger(tmp_path, 5, True, done=3)
    m.log({"step": 4, "loss": 0.5})
    with m.pause("eval, 4 examples"):
        assert m._bar.desc == "train (eval, 4 examples)"
        time.sleep(0.3)
    assert m._bar.desc == "train" and m._bar.format_dict["elapsed"] < 0.3
    m.log({"step": 5, "loss": 0.5})
    m.close()
    assert drawn == [[1, 2, 3, 4, 5]]


def test_samples_decode_one_token_per_forward_through_the_kv_cache(tiny_model):
    """The prompt batch runs once, then one token per forward; the completions equal `generate`'s greedy ones."""
    from types import SimpleNamespace

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from toolkit.data.tokenize import ensure_chat_template, prompt_text
    from toolkit.objectives.evaluate import sample_completions

    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    tok = AutoTokenizer.from_pretrained(tiny_model)
    ensure_chat_template(tok)
    lengths = []
    model.register_forward_pre_hook(lambda m, a, kw: lengths.append(kw["input_ids"].shape[1]), with_kwargs=True)
    prompts = ["hi", "a much longer prompt than the first one"]
    got = sample_completions(SimpleNamespace(eval_device=lambda m: torch.device("cpu")), model, tok, prompts, 6)
    assert lengths[0] > 1 and lengths[1:] == [1] * 5
    for prompt, completion in zip(prompts, got):
        enc = tok(prompt_text(tok, [{"role": "user", "content": prompt}]), return_tensors="pt",
                  add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)
        assert completion == tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True).strip()


def test_samples_are_the_model_s_greedy_completions_at_their_step(tracked):
    """samples.jsonl holds (step, prompt, completion) at steps 0, 3, 6; step 6's completions equal
    greedy generation from the saved final folder with the run's chat template (fp32, CPU)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from toolkit.data.tokenize import prompt_text

    rows = [json.loads(line) for line in (tracked / "samples.jsonl").read_text().splitlines()]
    prompts = PROMPTS.split(";")
    assert [(r["step"], r["prompt"]) for r in rows] == [(s, p) for s in (0, 3, 6) for p in prompts]
    config = json.loads((tracked / "final" / "adapter_config.json").read_text())
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"]),
                                      tracked / "final").eval()
    tok = AutoTokenizer.from_pretrained(tracked / "final")
    for row in rows[-2:]:
        enc = tok(prompt_text(tok, [{"role": "user", "content": row["prompt"]}]), return_tensors="pt",
                  add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
        assert row["completion"] == tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True).strip()


def test_tensorboard_and_mlflow_get_the_metrics_and_the_config(tracked):
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tracked / "tensorboard"))
    events.Reload()
    assert ({"loss", "eval_loss", "lr", "grad_norm", "tokens_per_sec", "param_bytes/rank0"}
            <= set(events.Tags()["scalars"]))
    assert [e.step for e in events.Scalars("loss")] == [1, 2, 3, 4, 5, 6]
    assert [round(e.value, 4) for e in events.Scalars("loss")] == [round(loss, 4) for loss in losses(tracked)]
    client = MlflowClient(tracking_uri=(tracked / "mlruns").as_uri())
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.data.params["lr"] == "0.003" and run.data.params["method"] == "lora"
    history = client.get_metric_history(run.info.run_id, "eval_loss")
    assert [m.step for m in history] == [0, 3, 6]
    assert run.info.status == "FINISHED"


def test_a_tracker_that_fails_mid_run_is_one_warning_and_the_run_goes_on(tmp_path, tiny_model, data_files,
                                                                         monkeypatch, capsys):
    from accelerate.tracking import TensorBoardTracker

    def broken(self, values, step=None, **kwargs):
        raise ConnectionError("the dashboard went away")

    monkeypatch.setattr(TensorBoardTracker, "log", broken)
    out = tmp_path / "run"
    finetune.main(["--model", str(tiny_model), "--dataset", str(data_files["chat"]), "--output-dir", str(out),
                   "--seq-len", "64", "--max-steps", "3", "--mixed-precision", "no", "--verify", "files"])
    said = capsys.readouterr().out
    assert said.count("--report-to tensorboard: ConnectionError: the dashboard went away; tensorboard is left out "
                      "for the rest of the run") == 1
    assert (out / "final" / "adapter_model.safetensors").is_file() and len(records(out)) == 3


def test_a_tracker_that_cannot_start_stops_the_run_before_the_model_loads(tmp_path, tiny_model, data_files,
                                                                          monkeypatch, capsys):
    """mlflow (3.17 here) refuses a file store named by MLFLOW_TRACKING_URI: one line naming the tracker, what
    refused it and the fix, exit 2, before the weights load; nothing of a run is left but its config."""
    from mlflow.store.tracking.file_store import FileStore

    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "store").as_uri())
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)  # set by a run that wrote OUTPUT_DIR/mlruns
    try:
        FileStore((tmp_path / "probe").as_uri())
        pytest.skip("this mlflow accepts file stores (mlflow >= 3.x in maintenance mode refuses them)")
    except Exception:  # noqa: BLE001 - the refusal the run must turn into one line
        pass
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        finetune.main(["--model", str(tiny_model), "--dataset", str(data_files["chat"]), "--output-dir", str(out),
                       "--seq-len", "64", "--max-steps", "2", "--report-to", "mlflow", "--mixed-precision", "no"])
    said = capsys.readouterr()
    assert e.value.code == 2 and "Traceback" not in said.err
    (line,) = [x for x in said.err.splitlines() if x.startswith("finetune.py: error:")]
    assert "--report-to mlflow could not start (MlflowException: " in line
    assert f"MLFLOW_TRACKING_URI={(tmp_path / 'store').as_uri()} is what it refused" in line
    assert "model:" not in said.out and not (out / "final").exists() and not (out / "metrics.jsonl").exists()


def test_a_tracker_that_is_not_installed_is_refused_at_start(tmp_path, monkeypatch):
    import importlib.util

    from toolkit.config import parse_config

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(UserError, match="--report-to wandb needs the wandb package, which is not installed: "
                                        "pip install wandb"):
        parse_config(["--report-to", "tensorboard,wandb", "--output-dir", str(tmp_path / "o")])
    with pytest.raises(UserError, match="unknown tracker comet"):
        parse_config(["--report-to", "comet", "--output-dir", str(tmp_path / "o")])


def test_wandb_runs_offline_without_network(tmp_path, tiny_model, data_files, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is not installed here (pip install wandb to test its offline mode)")
    monkeypatch.setenv("WANDB_MODE", "offline")
    out = tmp_path / "run"
    finetune.main(["--model", str(tiny_model), "--dataset", str(data_files["chat"]), "--output-dir", str(out),
                   "--seq-len", "64", "--max-steps", "2", "--report-to", "wandb", "--mixed-precision", "no",
                   "--verify", "files"])
    assert list((out / "wandb").glob("offline-run-*"))


def test_trainer_flag_names_are_taken_and_every_unknown_flag_is_said_at_once(tmp_path):
    from toolkit.config import parse_config

    cfg = parse_config(["--learning_rate", "1e-4", "--num_train_epochs", "2", "--per_device_train_batch_size", "2",
                        "--gradient_accumulation_steps", "4", "--output_dir", str(tmp_path / "o"), "--max_steps",
                        "9", "--logging_steps", "3", "--bf16"])
    t = cfg.train
    assert (cfg.lr, t.epochs, t.micro_batch_size, t.grad_accum, t.max_steps, t.mixed_precision) == \
        (1e-4, 2, 2, 4, 9, "bf16")
    assert cfg.output.output_dir == str(tmp_path / "o") and cfg.output.log_every == 3
    assert parse_config(["--learning-rate", "1e-4", "--output-dir", str(tmp_path / "o")]).lr == 1e-4
    yaml = tmp_path / "run.yaml"
    yaml.write_text("learning_rate: 0.001\nbf16: true\nper_device_train_batch_size: 3\n")
    cfg = parse_config(["--config", str(yaml), "--output-dir", str(tmp_path / "o")])
    assert (cfg.lr, cfg.train.mixed_precision, cfg.train.micro_batch_size) == (1e-3, "bf16", 3)
    with pytest.raises(UserError) as e:
        parse_config(["--max-stepz", "3", "--batch-size", "2", "--frobnicate", "1"])
    assert str(e.value) == ("unknown flag --max-stepz (did you mean --max-steps?); unknown flag --batch-size (did "
                            "you mean --micro-batch-size?); unknown flag --frobnicate; see --help")


def test_help_shows_the_toolkit_s_names(capsys):
    with pytest.raises(SystemExit):
        finetune.main(["--help"])
    text = capsys.readouterr().out
    assert "--lr LR" in text and "--report-to" in text and "--learning_rate" not in text


@pytest.mark.parametrize("argv, said", [(["--top-p", "0"], "--top-p must be in (0, 1]"),
                                        (["--top-k", "-1"], "--top-k must be 0 (off) or more"),
                                        (["--repetition-penalty", "0"], "--repetition-penalty must be > 0")])
def test_generate_refuses_impossible_sampling_numbers(tiny_model, capsys, argv, said):
    from toolkit.cli.main import main as cli

    with pytest.raises(SystemExit):
        cli(["generate", "--model", str(tiny_model), "--prompt", "hi", *argv])
    assert said in capsys.readouterr().err


def test_generate_samples_with_top_p_top_k_and_a_repetition_penalty(tiny_model, capsys):
    """Seeded sampling is repeatable; a repetition penalty changes greedy output of a model that
    repeats itself (the tiny random model does)."""
    import torch

    from toolkit.cli.main import main as cli

    def run(*flags):
        torch.manual_seed(0)
        cli(["generate", "--model", str(tiny_model), "--prompt", "hi", "--max-new-tokens", "12", *flags])
        return capsys.readouterr().out

    sampled = ["--do-sample", "--top-p", "0.9", "--top-k", "20", "--temperature", "0.8"]
    assert run(*sampled) == run(*sampled)
    assert run() != run("--repetition-penalty", "5")


EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


def test_there_are_recipes_for_the_jobs_users_come_for():
    names = {p.stem for p in EXAMPLES}
    assert len(names) >= 6 and {"lora-8b-one-24gb-gpu", "qlora-70b-one-80gb-gpu", "full-8b-zero3-8-gpus",
                                "fsdp-70b-two-nodes", "long-context-128k-cp", "sharegpt-chat",
                                "dataset-mixture"} <= names
    # each is planned on the machine its keys name: tests/test_planner_plan.py
