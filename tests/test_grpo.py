"""--objective grpo end to end (issue 65): on the tiny model, every data-parallel layout and TP 2 sample one
process's completions exactly and give its per-step losses (fp32, CPU: within 1e-5), LoRA, QLoRA and full, with
old log-probabilities (2 steps a round, 2 iterations), the KL to the reference (beta > 0) and clipping all at work;
a resume in the middle of a round continues exactly; bad input is one line. The loss and advantages are
tested against TRL's own code in tests/test_grpo_functions.py."""

from __future__ import annotations

import json
import time
import random
import shutil

import pytest
from helpers import records

REWARD = '''
def vowels(prompts, completions, completion_ids, **columns):
    """A reward with spread on a random tiny model: the share of vowels."""
    return [sum(c in "aeiou" for c in text) / (1 + len(text)) for text in completions]


def fails_in_round_2(prompts, completions, completion_ids, trainer_state, **columns):
    if trainer_state.global_step >= 5:  # the second round (steps 5-8)
        raise ValueError("no score for this one")
    return [1.0] * len(completions)


def wrong_length(prompts, completions, completion_ids, **columns):
    return [1.0]


def not_a_number(prompts, completions, completion_ids, **columns):
    return ["high"] * len(completions)


def constant(prompts, completions, completion_ids, **columns):
    return [1.0] * len(completions)


def mostly_none(prompts, completions, completion_ids, **columns):
    return [None if i % 4 else 0.0 for i in range(len(completions))]


def hangs_at_step_3(prompts, completions, completion_ids, trainer_state, **columns):
    """Step 3's scoring on rank 0: SIGTERM to itself, then an hour's sleep that swallows any Exception."""
    import os, pathlib, signal, time

    if trainer_state.global_step == 3 and os.environ.get("RANK", "0") == "0":
        pathlib.Path(__file__).with_name("hung.fired").touch()
        os.kill(os.getpid(), signal.SIGTERM)
        try:
            time.sleep(3600)
        except Exception:
            pass
    return [0.0] * len(completions)
'''


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("grpo")
    rng = random.Random(0)
    rows = []
    for _ in range(24):
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        rows.append({"prompt": f"What is {a} + {b}?", "answer": str(a + b)})
    (d / "add.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "rewards.py").write_text(REWARD)
    (d / "questions.jsonl").write_text("".join(json.dumps({"question": r["prompt"]}) + "\n" for r in rows))
    return d


def common(model, files, rewards: tuple = ()) -> list[str]:
    """The flags every run takes; `rewards` in place of the two weighted reward functions."""
    rewards = [x for r in rewards for x in ("--reward", r)] or [
        "--reward", f"{files / 'rewards.py'}:vowels", "--reward", "builtin:math_answer", "--reward-weights", "1,0.5"]
    return ["--model", str(model), "--dataset", str(files / "add.jsonl"), "--objective", "grpo", *rewards,
            "--num-generations", "4", "--max-completion-length", "8", "--max-steps", "4", "--steps-per-generation", "2",
            "--num-iterations", "2", "--epsilon-high", "0.28", "--lr", "1e-2", "--warmup-steps", "0", "--seed", "3",
            "--mixed-precision", "no", "--log-every", "1", "--report-to", "none", "--save-every", "1"]


ONE = ["--micro-batch-size", "8"]
TWO = ["--micro-batch-size", "2", "--grad-accum", "2"]  # the same 8 completions a step: 2 ranks x 2 x 2
BETA = ["--beta", "0.05"]
RUNS = {  # name -> (ranks, flags, the one-process run it must equal)
    "one_lora": (1, ["--method", "lora", *BETA, *ONE], None),
    "one_qlora": (1, ["--method", "qlora", *BETA, *ONE], None),
    "one_full": (1, ["--method", "full", *BETA, *ONE], None),
    "one_full_b0": (1, ["--method", "full", "--loss-type", "grpo", *ONE], None),
    "ddp_lora": (2, ["--method", "lora", *BETA, *TWO], "one_lora"),
    "zero2_lora": (2, ["--method", "lora", *BETA, *TWO, "--zero-stage", "2"], "one_lora"),
    "zero3_lora": (2, ["--method", "lora", *BETA, *TWO, "--zero-stage", "3"], "one_lora"),
    "fsdp_lora": (2, ["--method", "lora", *BETA, *TWO, "--fsdp"], "one_lora"),
    "ddp_qlora": (2, ["--method", "qlora", *BETA, *TWO], "one_qlora"),
    "ddp_full": (2, ["--method", "full", *BETA, *TWO], "one_full"),
    "zero3_full": (2, ["--method", "full", "--loss-type", "grpo", *TWO, "--zero-stage", "3"], "one_full_b0"),
    "fsdp_full": (2, ["--method", "full", "--loss-type", "grpo", *TWO, "--fsdp"], "one_full_b0"),
    "tp2_lora": (2, ["--method", "lora", *BETA, *ONE, "--tp", "2"], "one_lora"),  # both ranks sample the 8
    "overlong": (1, ["--method", "lora", *ONE, "--overlong-buffer", "4", "--overlong-penalty", "0.5"], None),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model, files):
    from distributed import batched_runs

    get = batched_runs(tmp_path_factory, common(tiny_model, files), {(n,): (r, f) for n, (r, f, _) in RUNS.items()})
    return lambda name: get(name)


def completions(out) -> list[tuple]:
    return [(c["step"], json.dumps(c["prompt"]), c["completion"], json.dumps(c["rewards"]))
            for c in map(json.loads, (out / "completions.jsonl").read_text().splitlines())]


@pytest.mark.parametrize("name", [n for n, (_, _, ref) in RUNS.items() if ref])
def test_every_layout_samples_and_trains_as_one_process(runs, name):
    """Each layout's completions (every step's, every rank's) equal one process's exactly, and its per-step
    losses, gradient norms, rewards, KL and clip fractions within 1e-5 (QLoRA: 1e-3): the batch's completions
    depend only on (seed, step, prompt, generation), and each loss on the global batch's counts."""
    from distributed import assert_metric_close

    ref = runs(RUNS[name][2])
    got = runs(name)
    assert completions(got) == completions(ref)
    a, b = records(got, "loss"), records(ref, "loss")
    assert [r["step"] for r in a] == [1, 2, 3, 4]
    # QLoRA: bitsandbytes' 4-bit matmul on the CPU rounds differently for another number of rows (2 a
    # micro-batch here, 8 in one process): 1.4e-4 relative by step 3, measured; its completions are still equal
    rel = 1e-3 if "qlora" in name else 1e-5
    for key in ("loss", "grad_norm", "reward", "kl", "entropy", "clip_ratio/region_mean", "rewards/vowels/mean",
                "completions/mean_length"):
        assert_metric_close(a, b, key, rel=rel, abs=1e-6, what=name)


def test_the_overlong_penalty_is_a_reward_beside_the_users(runs):
    """--overlong-buffer 4 --overlong-penalty 0.5 on 8-token completions: each completion's `overlong` reward in
    completions.jsonl is between 0 and -0.5, and each round's mean lies between the penalties of its shortest and
    its longest completion (DAPO's penalty falls with length); it adds to the reward with weight 1."""
    from toolkit.objectives.grpo.functions import overlong_penalty

    logged = [json.loads(line)["rewards"] for line in (runs("overlong") / "completions.jsonl").read_text().splitlines()]
    assert logged and all(-0.5 <= r["overlong"] <= 0 for r in logged)
    rounds = [r for r in records(runs("overlong"), "loss") if "rewards/overlong/mean" in r]
    assert rounds
    for r in rounds:
        low, high = overlong_penalty([r["completions/max_length"], r["completions/min_length"]], 8, 4, 0.5)
        assert low - 1e-9 <= r["rewards/overlong/mean"] <= high + 1e-9
        assert r["reward"] == pytest.approx(r["rewards/vowels/mean"] + 0.5 * r["rewards/math_answer/mean"]
                                            + r["rewards/overlong/mean"], abs=1e-6)


def test_a_run_says_what_it_trains_and_logs_trls_metrics(runs):
    """The record has TRL's names (rewards, KL, entropy, clip fractions, lengths) and the step's split into
    generation, scoring and training; the old log-probabilities make later steps' ratios move (clipping
    fires); the run says once that a loss near 0 is expected; completions.jsonl holds each prompt's completions
    and their rewards."""
    from distributed import run_stdout

    first, *rest = records(runs("one_lora"), "loss")
    for key in ("reward", "reward_std", "rewards/vowels/mean", "rewards/math_answer/mean", "frac_reward_zero_std",
                "kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "completions/mean_length",
                "completions/clipped_ratio", "generation_tokens_per_sec", "time/generate_s", "time/score_s"):
        assert key in first, key
    assert first["kl"] == pytest.approx(0.0, abs=1e-7)  # the policy is the reference at step 1
    assert any(r["clip_ratio/region_mean"] > 0 for r in rest) and any(r["kl"] > 0 for r in rest)
    said = run_stdout(runs("one_lora"))
    assert "2 prompts x 4 generations); a loss near 0 is expected" in said
    assert "objective: grpo, loss type dapo" in said and "reference: the base, adapters disabled" in said
    logged = [json.loads(x) for x in (runs("one_lora") / "completions.jsonl").read_text().splitlines()]
    # the steps that sampled (2 a round; steps 3-4 train the round again), each prompt's 4 completions
    assert [r["step"] for r in logged] == [1] * 8 + [2] * 8 and set(logged[0]["rewards"]) == {"vowels", "math_answer"}


def test_the_static_decode_path_samples_and_trains_as_the_dynamic_one(runs, tmp_path_factory, tiny_model, files):
    """CUDA's decode path (a StaticCache, each step compiled; here aot_eager, the CPU's test backend) in a whole
    run: the same completions, bitwise the same losses as the CPU default's, and each run's log names its path."""
    from distributed import launch_layouts, run_stdout

    root = tmp_path_factory.mktemp("static_decode")
    got = launch_layouts(root, common(tiny_model, files), {"one_lora": RUNS["one_lora"][1]},
                         env={"TOOLKIT_DECODE": "static", "TOOLKIT_COMPILE_BACKEND": "aot_eager"})["one_lora"]
    assert got["exit"] == 0, got["stderr"].read_text()[-3000:]
    ref = runs("one_lora")
    assert completions(got["out"]) == completions(ref)
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in records(got["out"], "loss")] == \
        [(r["step"], r["loss"], r["grad_norm"]) for r in records(ref, "loss")]
    said = got["stdout"].read_text()
    assert "decode: static KV cache (prompt + completion length), the prompt's forward eager, each decode step " \
           "compiled (torch.compile backend aot_eager)" in said and "the static path failed" not in said
    assert "decode: dynamic KV cache, eager steps (the CPU default" in run_stdout(ref)


@pytest.fixture(scope="module")
def resumed(tmp_path_factory, tiny_model, files, runs):
    """From copies of one process's full run and 2 ranks' FSDP LoRA run with the checkpoints after step 1
    taken away: step 1 is in the middle of a round (2 steps x 2 iterations), whose rest the checkpoint keeps."""
    from distributed import launch_layouts

    out = {}
    for name in ("one_full", "fsdp_lora"):
        ranks, flags, _ = RUNS[name]
        root = tmp_path_factory.mktemp(f"resumed_{name}")
        shutil.copytree(runs(name), root / name)
        for later in ("checkpoint-2", "checkpoint-3", "checkpoint-4", "final"):
            shutil.rmtree(root / name / later)
        result = launch_layouts(root, common(tiny_model, files), {name: [*flags, "--resume", "auto"]}, nproc=ranks,
                                launcher="fork")
        out[name] = result[name]
    return out


@pytest.mark.parametrize("name", ["one_full", "fsdp_lora"])
def test_a_resume_in_the_middle_of_a_round_continues_exactly(runs, resumed, name):
    """The round's remaining micro-batches (sampled, scored, their old and reference log-probabilities) are in
    the checkpoint's rank files: the resumed steps equal the uninterrupted run's (one process: bitwise)."""
    from distributed import assert_metric_close

    run = resumed[name]
    assert run["exit"] == 0, run["stderr"].read_text()[-3000:]
    assert "checkpoint-1: continuing at step 2" in run["stdout"].read_text()
    got, ref = records(run["out"], "loss"), records(runs(name), "loss")
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    tol = 0 if name.startswith("one") else 1e-6
    for key in ("loss", "grad_norm", "kl", "reward"):
        assert_metric_close(got, ref, key, rel=tol, abs=tol, what=name)


# a round every step, so that a stop inside step 3's sampling has steps 1-2 finished behind it
EACH_STEP = ["--method", "lora", "--steps-per-generation", "1", "--num-iterations", "1", "--max-steps", "3"]


@pytest.fixture(scope="module")
def stopped(tmp_path_factory, tiny_model, files):
    """One process uninterrupted; then one process and 2 ranks sent SIGTERM inside step 3's sampling (the fault
    hook signals rank 0 alone, at its first decode step), and resumed with --resume auto."""
    from distributed import launch_layouts

    root = tmp_path_factory.mktemp("stopped")
    flags = [*common(tiny_model, files), *EACH_STEP]
    ref = launch_layouts(root / "ref", flags, {"one": ONE})["one"]
    out = {"ref": ref}
    for name, ranks, split in (("one", 1, ONE), ("two", 2, TWO)):
        fired = root / f"{name}.fired"
        fault = {"TOOLKIT_FAULT": f"sampling:3:signal=term:once={fired}"}
        stop = launch_layouts(root / name, flags, {name: [*split, "--log-every", "5", "--save-every", "0"]},
                              nproc=ranks, run_env={name: fault})[name]
        stop["checkpoints"] = sorted(p.name for p in stop["out"].glob("checkpoint-*"))
        stop["seconds"] = time.time() - fired.stat().st_mtime if fired.exists() else None
        stop["records"] = records(stop["out"], "loss") if (stop["out"] / "metrics.jsonl").exists() else []
        stop["stdout_text"] = stop["stdout"].read_text()
        again = launch_layouts(root / name, flags, {name: [*split, "--resume", "auto"]}, nproc=ranks)[name]
        out[name] = {"stop": stop, "again": again}
    # a reward function that would not return for an hour, on rank 0 of 2, signalled inside it
    rewards = (f"{files / 'rewards.py'}:vowels", f"{files / 'rewards.py'}:hangs_at_step_3")
    flags = [*common(tiny_model, files, rewards), *EACH_STEP, *TWO, "--save-every", "0"]
    hung = launch_layouts(root / "hung", flags, {"hung": []}, nproc=2)["hung"]
    fired = files / "hung.fired"
    hung["seconds"] = time.time() - fired.stat().st_mtime if fired.exists() else None
    hung["checkpoints"] = sorted(p.name for p in hung["out"].glob("checkpoint-*"))
    out["hung"] = hung
    return out


@pytest.mark.parametrize("name", ["one", "two"])
def test_a_stop_inside_a_sampling_round_saves_the_last_step_and_resumes_exactly(stopped, name):
    """SIGTERM while step 3 samples: the round is abandoned within seconds (every rank at the same token, one
    all-reduce per decode step), checkpoint-2 is saved with the metrics of steps 1-2 (--log-every 5: the pending
    window is written at the stop), the run exits 143; resumed, it samples step 3 again as the uninterrupted run
    did, and trains it the same (one process's losses and completions; 2 ranks within 1e-5)."""
    from distributed import assert_metric_close

    stop, again, ref = stopped[name]["stop"], stopped[name]["again"], stopped["ref"]
    assert stop["exit"] == 143, stop["stderr"].read_text()[-3000:]
    assert stop["seconds"] is not None and stop["seconds"] < 30
    assert "preempted while sampling step 3: checkpoint saved to" in stop["stdout_text"]
    assert stop["checkpoints"] == ["checkpoint-2"]
    assert [r["step"] for r in stop["records"]] == [2]  # the window of steps 1-2
    assert again["exit"] == 0, again["stderr"].read_text()[-3000:]
    assert [c for c in completions(again["out"]) if c[0] == 3] == [c for c in completions(ref["out"]) if c[0] == 3]
    got, want = records(again["out"], "loss"), records(ref["out"], "loss")
    assert [r["step"] for r in got] == [2, 3] and [r["step"] for r in want] == [1, 2, 3]
    for key in ("loss", "grad_norm", "reward"):
        assert_metric_close(got[-1:], want[-1:], key, rel=1e-5, abs=1e-6, what=name)


def test_a_stop_inside_a_reward_function_ends_it_at_once(stopped):
    """SIGTERM while a reward function runs (one that would sleep an hour, and catches Exception): the call is
    ended at once (the handler raises a BaseException there), both ranks abandon step 3's round, and the run
    saves checkpoint-2 and exits 143 well within a scheduler's 30 s grace."""
    hung = stopped["hung"]
    assert hung["exit"] == 143, hung["stderr"].read_text()[-3000:]
    assert hung["seconds"] is not None and hung["seconds"] < 30
    assert "preempted while scoring step 3: checkpoint saved to" in hung["stdout"].read_text()
    assert hung["checkpoints"] == ["checkpoint-2"]


def test_a_run_that_cannot_learn_says_so(tmp_path, tiny_model, files):
    """Rewards that never differ within a group (advantages 0) for 3 steps in a row: one warning naming the usual
    causes; a reward that returns None for most completions: one warning naming it. Each said once."""
    from distributed import launch_layouts

    rewards = (f"{files / 'rewards.py'}:constant", f"{files / 'rewards.py'}:mostly_none")
    flags = [*common(tiny_model, files, rewards), *EACH_STEP, "--max-steps", "4"]
    run = launch_layouts(tmp_path, flags, {"one": ONE})["one"]
    assert run["exit"] == 0, run["stderr"].read_text()[-3000:]
    said = run["stdout"].read_text()
    assert said.count("warning: every group's completions got the same reward for 3 steps in a row") == 1, said
    assert "were cut at --max-completion-length 8), or a reward never fires (mean per function: constant 1, " \
           "mostly_none 0)" in said
    assert said.count("warning: reward mostly_none returned None for 75% of the completions sampled at step 1") == 1


BAD = [  # flags, the reward functions, the line (its start), whether training started (a checkpoint is kept)
    (["--num-generations", "1"], (), "--num-generations must be >= 2", False),
    (["--num-generations", "3"], (), "--objective grpo: the global batch (8 micro-batch x 1 accumulation x 1 "
                                     "data-parallel rank(s) = 8 completions) is not a multiple of --num-generations 3",
     False),
    (["--dataset", "questions.jsonl"], (), "--objective grpo samples completions to prompts, and --dataset", False),
    ([], ("rewards.py:nowhere",), "--reward rewards.py:nowhere", False),
    (["--max-steps", "8"], ("rewards.py:fails_in_round_2",), "reward rewards.py:fails_in_round_2 failed on prompt 0 "
                                                                 "completion 0 (record", True),
    ([], ("rewards.py:wrong_length",), "reward rewards.py:wrong_length returned 1 rewards for 16 completions", False),
    ([], ("rewards.py:not_a_number",), "reward rewards.py:not_a_number returned a str for prompt 0 "
                                       "completion 0", False),
]


EARLY = [  # refused by the config's checks: the line (its start)
    (["--reward", "nowhere.py:vowels"], "--reward nowhere.py:vowels: no file nowhere.py"),
    (["--reward", "rewards.py:nowhere"], "--reward rewards.py:nowhere: rewards.py has no 'nowhere' (its functions: "
                                         "constant, fails_in_round_2, hangs_at_step_3, mostly_none, not_a_number, "
                                         "vowels, wrong_length)"),
    (["--reward", "broken.py:f"], "--reward broken.py:f: broken.py is not Python that parses (SyntaxError"),
    (["--reward", "builtin:regex:("], "--reward builtin:regex:(: not a regular expression"),
    (["--reward", "builtin:math_answer", "--num-generations", "3"], "--objective grpo: the global batch (8 micro-batch "
                                                                   "x 1 accumulation x 1 data-parallel rank(s) = 8"),
]


def test_refusals_that_need_no_model_come_before_torch_is_imported(files, tiny_model):
    """A reward file that is not there or does not parse, a function it does not define, a pattern that does not
    compile, a batch that --num-generations does not divide: one line each, said by the config's checks, in a
    process that has not imported torch when it says it (each in under a second, not after the imports)."""
    import subprocess
    import sys

    from distributed import ROOT

    (files / "broken.py").write_text("def f(:\n")
    script = (f"import json, sys; sys.path.insert(0, {str(ROOT)!r}); sys.argv = ['finetune.py']; import finetune\n"
              "out = []\n"
              f"for flags in {[f for f, _ in EARLY]!r}:\n"
              "    try:\n"
              f"        finetune.main(['--model', {str(tiny_model)!r}, '--dataset', 'add.jsonl', "
              "'--objective', 'grpo', '--micro-batch-size', '8', '--num-generations', '4', *flags])\n"
              "    except SystemExit as e:\n"
              "        out.append([e.code, 'torch' in sys.modules])\n"
              "print(json.dumps(out))\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=files, capture_output=True, text=True, timeout=300)
    assert json.loads(done.stdout.splitlines()[-1]) == [[2, False]] * len(EARLY), done.stderr[-2000:]
    said = [x for x in done.stderr.splitlines() if x.startswith("finetune.py: error:")]
    assert len(said) == len(EARLY)
    for line, (_, says) in zip(said, EARLY):
        assert line.startswith(f"finetune.py: error: {says}"), line


@pytest.mark.parametrize("flags, rewards, says, trained", BAD, ids=[b[2][:30] for b in BAD])
def test_bad_input_is_one_line(tmp_path, monkeypatch, tiny_model, files, capsys, flags, rewards, says, trained):
    """No prompt column, G of 1, a batch G does not divide, a reward function that cannot be found, raises,
    returns the wrong length or a non-number: one line naming the function and the completion's record, no
    traceback, exit 2; what was saved stays (the run whose reward failed in its second round kept checkpoint-4)."""
    import finetune

    monkeypatch.chdir(files)
    argv = [*common(tiny_model, files, rewards), "--method", "lora", *ONE, "--output-dir", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as e:
        finetune.main([*argv, *flags])
    assert e.value.code == 2
    err = [x for x in capsys.readouterr().err.splitlines() if x.startswith("finetune.py: error:")]
    assert len(err) == 1 and err[0].startswith(f"finetune.py: error: {says}"), err
    assert (tmp_path / "out" / "checkpoint-4").is_dir() == trained  # the run stopped at step 5 kept step 4's
