"""Every launch form trains: python, accelerate launch (no config, --num_processes N, --use_deepspeed,
--use_fsdp, --config_file with a DeepSpeed or FSDP section, or naming a DeepSpeed JSON), torchrun and
DeepSpeed's own launcher, at 1 and 2 ranks, with ZeRO-2, ZeRO-3 and FSDP; and `--deepspeed FILE`, with the
DeepSpeed JSONs and accelerate configs users copy (tests/data/published/, verbatim: transformers, LLaMA-Factory,
axolotl, DeepSpeed's docs, accelerate's template, TRL's zero3 and fsdp2), and a variant of transformers' ZeRO-3
file in the other spellings DeepSpeed reads (`bfloat16`, unprefixed stage-3 keys; issue 57).

Each form is one launch running several layouts in one process group (`tests/layouts.py`): tiny Llama,
LoRA, fp32, 2 steps. Every run's per-step losses equal the single-process DDP reference of the same
global batch (4 examples: 1 rank x 4 or 2 ranks x 2) within 1e-4 relative (5e-3 for a bf16 run: autocast
against the fp32 reference), and its saved folder
reloads in plain transformers/peft with the trained loss (the run's own integrity check, level
`load`). The one-process runs marked `cuda_path` take the launch set-up's GPU branch on this CPU
(`toolkit.parallel.launch.on_cuda` forced True): before the fix of 2026-11-24 they failed here exactly
as `accelerate launch --num_processes 1 finetune.py --zero-stage 3` failed on one H100.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml
from distributed import common_args, launch, launch_layouts
from helpers import losses, records

from toolkit.config import parse_config
from toolkit.errors import UserError
from toolkit.layout import launcher as L
from toolkit.parallel.launch import RANK_VARS, rank_env
from toolkit.layout.deepspeed import fill_auto, file_settings, read_user_config, user_config_problems

ROOT = Path(__file__).resolve().parents[1]
PUBLISHED = ROOT / "tests" / "data" / "published"  # verbatim, with their sources in its README.md
Z2, Z3, FSDP = ["--zero-stage", "2"], ["--zero-stage", "3"], ["--fsdp"]
# Each published DeepSpeed JSON that runs on a CPU, as its run's name. transformers' ZeRO-3 file first: in a
# launch's first DeepSpeed run, zero.Init inside from_pretrained met DeepSpeed's comm before it had joined the
# process group, read a world of 1, and refused the train_batch_size filled for 2 ranks (issue 45).
PUBLISHED_JSONS = {
    "pub_transformers_zero3": "transformers/ds_config_zero3.json",
    "pub_transformers_zero2": "transformers/ds_config_zero2.json",
    "pub_llama_factory_z2": "llama_factory/ds_z2_config.json",
    "pub_llama_factory_z2_offload": "llama_factory/ds_z2_offload_config.json",
    "pub_llama_factory_z3": "llama_factory/ds_z3_config.json",
    "pub_llama_factory_z3_offload": "llama_factory/ds_z3_offload_config.json",
    "pub_axolotl_zero2": "axolotl/zero2.json",
    "pub_axolotl_zero3": "axolotl/zero3.json",
    "pub_axolotl_zero3_bf16": "axolotl/zero3_bf16.json",
    "pub_axolotl_zero3_bf16_cpuoffload_all": "axolotl/zero3_bf16_cpuoffload_all.json",
    "pub_deepspeed_docs_zero2": "deepspeed_docs/zero_stage2.json",
    "pub_deepspeed_docs_zero_infinity": "deepspeed_docs/zero_infinity.json",
}
PUBLISHED_RUNS = {name: ["--deepspeed", str(PUBLISHED / path)] for name, path in PUBLISHED_JSONS.items()}
# transformers' ZeRO-3 file in DeepSpeed's other spellings (`other_spellings`), as its run's name and file
SPELLINGS_RUN, SPELLINGS_FILE = "variant_transformers_zero3_spellings", "ds_config_zero3_other_spellings.json"
UNPREFIXED = ("stage3_prefetch_bucket_size", "stage3_param_persistence_threshold", "stage3_max_live_parameters",
              "stage3_max_reuse_distance")
SHARDED = {"zero2": Z2, "zero3": Z3, "fsdp": FSDP}
# What each launcher left in a rank's environment, read off them on this machine (toolkit.parallel.launch)
ENVS = {
    "python": {},
    "accelerate launch, one process": {"ACCELERATE_MIXED_PRECISION": "no", "ACCELERATE_USE_CPU": "False"},
    "torchrun": {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "none"},
    "deepspeed": {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_SIZE": "2", "CROSS_RANK": "0",
                  "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"},
}
DS_PLAIN = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
            "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}}
DS_OWN = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "gradient_clipping": 0.5, "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": "auto"},
          "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                      "weight_decay": "auto", "torch_adam": True}},
          "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                             "warmup_num_steps": "auto", "total_num_steps": "auto"}}}


# ----------------------------------------------------------------------------- the rank environment

@pytest.mark.parametrize("name", list(ENVS))
def test_rank_env_completes_every_launchers_environment(name):
    """DeepSpeed and FSDP get a complete env:// rendezvous from every launcher, with no device branch."""
    env = ENVS[name]
    added = rank_env(env, needs_group=True, port=lambda: 12345)
    full = {**env, **added}
    assert all(k in full for k in (*RANK_VARS, "LOCAL_WORLD_SIZE")), full
    if "WORLD_SIZE" not in env:  # nobody launched it: rank 0 of 1 on a free port
        assert added == {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                         "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "12345"}
    else:  # a launcher's values are kept; DeepSpeed's LOCAL_SIZE becomes LOCAL_WORLD_SIZE
        assert all(full[k] == v for k, v in env.items()) and full["LOCAL_WORLD_SIZE"] == "2"
    assert rank_env(env, needs_group=False, port=lambda: 1) == ({} if "WORLD_SIZE" not in env else added)


def test_local_rank_flag_from_deepspeeds_launcher(monkeypatch, tmp_path):
    assert L.pop_local_rank(["--local_rank=1", "--seq-len", "64"]) == (["--seq-len", "64"], 1, None)
    assert L.pop_local_rank(["--seq-len", "64", "--local-rank", "0"]) == (["--seq-len", "64"], 0, None)
    assert L.pop_local_rank(["--local_rank=x"])[2] == "--local_rank must be an integer (got 'x')"
    for k in RANK_VARS:
        monkeypatch.delenv(k, raising=False)
    out = ["--output-dir", str(tmp_path / "o")]
    with pytest.raises(UserError, match="--local_rank 0 was given, but no launcher set LOCAL_RANK and WORLD_SIZE"):
        parse_config(["--local_rank=0", *out])
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(UserError, match="--local_rank 0 disagrees with the launcher's LOCAL_RANK=1"):
        parse_config(["--local_rank=0", *out])
    assert parse_config(["--local_rank=1", *out]).parallel.zero_stage is None


def test_launch_source_names_the_flags_or_the_config(tmp_path):
    env = {"ACCELERATE_USE_DEEPSPEED": "true"}
    argv = ["python", "-m", "accelerate.commands.launch", "--use_deepspeed", "--zero_stage", "3"]
    assert L.launch_source(env, argv) == "accelerate launch --use_deepspeed --zero_stage 3"
    cfg = tmp_path / "ds.yaml"
    assert L.launch_source(env, ["accelerate", "launch", "--config_file", str(cfg)]) == f"accelerate config {cfg}"
    home = tmp_path / "hf"
    (home / "accelerate").mkdir(parents=True)
    (home / "accelerate" / "default_config.yaml").write_text("distributed_type: FSDP\n")
    assert L.launch_source({**env, "HF_HOME": str(home)}, ["accelerate", "launch"]) == \
        f"accelerate config {home / 'accelerate' / 'default_config.yaml'}"



def test_a_single_process_launch_names_its_count_and_accelerates_traceback(monkeypatch, tmp_path):
    """Issue 64: `accelerate launch --num_processes 2 finetune.py` on a machine without a GPU starts one
    process (accelerate's simple launcher); the toolkit refused it in a line that said "N", and then
    accelerate's CalledProcessError traceback followed, which read as a second failure. The line now
    names the count asked for and the two commands that start it, and says the traceback is accelerate's
    report of this exit, except under accelerate's --quiet, which prints none."""
    for k in [k for k in os.environ if k.startswith(("ACCELERATE_", "WORLD_SIZE", "MASTER_"))]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("ACCELERATE_USE_CPU", "False")  # what accelerate's simple launcher exports
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setattr(L, "_parent_cmdline",
                        lambda: ["python", "-m", "accelerate.commands.launch", "--num_processes", "3"])
    with pytest.raises(UserError) as e:
        parse_config(["--output-dir", str(tmp_path / "o")])
    line = str(e.value)
    assert line.startswith("accelerate launch --num_processes 3 started one process, not 3: ")
    assert "accelerate launch --multi_gpu --num_processes 3 finetune.py" in line
    assert "torchrun --nproc_per_node 3 finetune.py" in line
    assert line.endswith("the traceback accelerate prints below (CalledProcessError, exit status 2) is its report of "
                         "this exit, not a second error")
    quiet = L.single_process_refusal(["accelerate", "launch", "-q", "--num-processes=4"])
    assert "not 4:" in quiet and "traceback" not in quiet


# ----------------------------------------------------------------------------- launcher settings vs flags

def _cfg(monkeypatch, env: dict, flags: list[str], tmp_path):
    for k in [k for k in os.environ if k.startswith(("ACCELERATE_", "FSDP_"))]:
        monkeypatch.delenv(k)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(L, "_parent_cmdline", lambda: ["accelerate", "launch", "--config_file", "/x/acc.yaml"])
    return parse_config([*flags, "--output-dir", str(tmp_path / "o")])


def test_accelerate_settings_are_adopted_and_said(monkeypatch, tmp_path):
    ds = _cfg(monkeypatch, {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3",
                            "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "cpu",
                            "ACCELERATE_MIXED_PRECISION": "bf16"},
              [], tmp_path)
    assert (ds.parallel.zero_stage, ds.parallel.offload, ds.train.mixed_precision) == (3, "optimizer", "bf16")
    assert ds.notes == ("layout: ZeRO-3 with optimizer offload from accelerate config /x/acc.yaml; bf16 from it too",)
    # what accelerate exports for the toolkit's own FSDP2 grad_op config (FSDP_SHARDING_STRATEGY is always
    # exported, FULL_SHARD by default), and for FSDP1 configs by name, by number, or in the reshard field
    for env, want in (({"FSDP_VERSION": "2", "FSDP_RESHARD_AFTER_FORWARD": "false",
                        "FSDP_SHARDING_STRATEGY": "FULL_SHARD"},
                       "grad_op"),
                      ({"FSDP_VERSION": "2", "FSDP_RESHARD_AFTER_FORWARD": "true"}, "full"),
                      ({"FSDP_VERSION": "1", "FSDP_SHARDING_STRATEGY": "2", "FSDP_RESHARD_AFTER_FORWARD": "true"},
                       "grad_op"),
                      ({"FSDP_VERSION": "1", "FSDP_RESHARD_AFTER_FORWARD": "HYBRID_SHARD"}, "hybrid")):
        fsdp = _cfg(monkeypatch, {"ACCELERATE_USE_FSDP": "true", **env}, [], tmp_path)
        assert (fsdp.parallel.fsdp, fsdp.parallel.fsdp_sharding) == (True, want), env
        assert fsdp.notes == (f"layout: FSDP2, {want} sharding, from accelerate config /x/acc.yaml",)
    with pytest.raises(UserError, match="says FSDP NO_SHARD, which the toolkit does not run"):
        _cfg(monkeypatch, {"ACCELERATE_USE_FSDP": "true", "FSDP_SHARDING_STRATEGY": "3"}, [], tmp_path)


def test_a_deepspeed_file_beside_a_launcher_that_says_deepspeed(monkeypatch, tmp_path):
    """The file decides the stage: one line, naming the accelerate config that named the file; a stage the
    launcher was explicitly given must agree with the file's."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    cfg = _cfg(monkeypatch, {"ACCELERATE_USE_DEEPSPEED": "true"}, ["--deepspeed", str(path)], tmp_path)
    assert cfg.parallel.zero_stage == 3 and cfg.notes == (f"layout: ZeRO-3 from --deepspeed {path}",)
    cfg = _cfg(monkeypatch, {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(path)}, [],
               tmp_path)
    assert cfg.notes == (f"layout: ZeRO-3 from DeepSpeed config {path}, named by accelerate config /x/acc.yaml",)
    with pytest.raises(UserError, match=f"accelerate config /x/acc.yaml says ZeRO-2, --deepspeed {path} says stage 3"):
        _cfg(monkeypatch, {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2"},
             ["--deepspeed", str(path)], tmp_path)


@pytest.mark.parametrize("env, flags, message", [
    ({"ACCELERATE_USE_FSDP": "true"}, Z3, "accelerate config /x/acc.yaml says FSDP, --zero-stage 3 asks for DeepSpeed"),
    ({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2"}, Z3,
     "accelerate config /x/acc.yaml says ZeRO-2, --zero-stage 3 disagrees"),
    ({"ACCELERATE_USE_DEEPSPEED": "true"}, FSDP, "accelerate config /x/acc.yaml says DeepSpeed, --fsdp asks for FSDP"),
    ({"ACCELERATE_USE_DEEPSPEED": "true"}, ["--strategy", "auto"], "and --strategy auto picks the layout itself"),
])
def test_accelerate_settings_that_disagree_with_a_flag_are_one_line(monkeypatch, tmp_path, env, flags, message):
    with pytest.raises(UserError, match=message):
        _cfg(monkeypatch, env, flags, tmp_path)


# ----------------------------------------------------------------------------- --deepspeed FILE

def test_deepspeed_file_autos_are_filled_and_its_values_win(tmp_path, monkeypatch):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({**DS_OWN, "train_micro_batch_size_per_gpu": 2}))
    cfg = _cfg(monkeypatch, {}, ["--deepspeed", str(path)], tmp_path)
    # the file's values win over the defaults: stage 3, micro batch 2, clipping 0.5
    assert (cfg.parallel.zero_stage, cfg.train.micro_batch_size, cfg.train.max_grad_norm) == (3, 2, 0.5)
    assert cfg.notes == (f"layout: ZeRO-3 from --deepspeed {path}; also from the file: micro batch size 2, "
                         "max grad norm 0.5",)
    filled = fill_auto(read_user_config(str(path)), micro_batch=2, grad_accum=3, data_ranks=4, mixed_precision="bf16",
                       max_grad_norm=0.5, lr=1e-4, weight_decay=0.1, warmup_steps=10, total_steps=5, hidden_size=64)
    assert (filled["train_batch_size"], filled["gradient_accumulation_steps"]) == (24, 3)
    assert filled["optimizer"]["params"] == {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.1,
                                             "torch_adam": True}
    assert filled["scheduler"]["params"] == {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-4, "warmup_num_steps": 5,
                                             "total_num_steps": 5}
    assert filled["zero_optimization"]["stage3_prefetch_bucket_size"] == int(0.9 * 64 * 64)
    assert "auto" not in json.dumps(filled)
    assert file_settings({"bf16": {"enabled": True}})["mixed_precision"] == "bf16"


def test_keys_a_deepspeed_file_leaves_out_are_the_runs(tmp_path, monkeypatch):
    """No accumulation, clipping or zero section in the file: DeepSpeed gets the run's (accelerate would
    put accumulation 1 while the loop scales the loss by --grad-accum, and DeepSpeed would not clip)."""
    from toolkit.parallel.build import run_deepspeed_config

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"bf16": {"enabled": False}}))
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = _cfg(monkeypatch, {}, ["--deepspeed", str(path), "--grad-accum", "4", "--max-grad-norm", "0.3"], tmp_path)
    ran = run_deepspeed_config(cfg)
    assert (ran["gradient_accumulation_steps"], ran["gradient_clipping"], ran["train_micro_batch_size_per_gpu"],
            ran["train_batch_size"], ran["zero_optimization"]) == (4, 0.3, 4, 32, {"stage": 0})


@pytest.mark.parametrize("content, flags, message", [
    (None, [], "--deepspeed {p}: file not found"),
    ("{\n  \"zero_optimization\": {\"stage\": 3,}\n}", [], r"--deepspeed {p}: not valid JSON \(line 2, column 36"),
    ("[1, 2]", [], "--deepspeed {p}: expected a JSON object of DeepSpeed settings, got list"),
    ({"zero_optimization": {"stage": 3, "overlap_com": True}}, [],
     "--deepspeed {p}: zero_optimization.overlap_com: Extra inputs are not permitted"),
    ({"scheduler": {"type": "Cosine"}}, [], "--deepspeed {p}: scheduler.type 'Cosine' is not one of DeepSpeed's"),
    ({"zero_optimization": {"stage": 3}}, Z2, "--deepspeed {p} sets zero_optimization.stage to 3, --zero-stage 2 "
                                              "disagrees"),
    ({"train_micro_batch_size_per_gpu": 2}, ["--micro-batch-size", "4"],
     "--deepspeed {p} sets train_micro_batch_size_per_gpu to 2, --micro-batch-size 4 disagrees"),
    ({}, FSDP, "--deepspeed {p} with --fsdp: both shard the model"),
    ({"train_batch_size": 6}, [], r"--deepspeed {p}: train_batch_size 6 is not micro batch 4 x accumulation 1 x 1 "
                                  "ranks = 4"),
])
def test_bad_deepspeed_files_are_one_line(tmp_path, monkeypatch, content, flags, message):
    path = tmp_path / "ds.json"
    if content is not None:
        path.write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(UserError, match=message.format(p=path)) as e:
        _cfg(monkeypatch, {}, ["--deepspeed", str(path), *flags], tmp_path)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "o").exists()


def test_user_config_problems_accepts_the_shipped_variants():
    from toolkit.layout.deepspeed import standard_variants

    assert all(user_config_problems(ds, name) == [] for name, ds in standard_variants().items())


# ----------------------------------------------------------------------------- every launch form trains

def _common(model, data) -> list[str]:
    """Without --mixed-precision (fp32 on a CPU all the same): a file or launcher config that sets bf16 is
    then run as written, not refused as disagreeing with a flag."""
    args = common_args(model, data)
    i = args.index("--mixed-precision")
    return args[:i] + args[i + 2:] + ["--method", "lora", "--max-steps", "2"]


def _batch(nproc: int) -> list[str]:
    """The same global batch of 4 at any rank count."""
    return ["--micro-batch-size", str(4 // nproc)]


def other_spellings(ds: dict) -> dict:
    """A VARIANT of a published file, not published itself: the same settings in the spellings DeepSpeed also
    reads, as other published files write them (issue 57: each stopped in accelerate at 2 ranks, "`bfloat16.enabled`
    not found in kwargs", "`zero_optimization.prefetch_bucket_size` not found in kwargs"): its stage-3 keys
    without their prefix, and a precision section "auto" under DeepSpeed's older name `bfloat16`."""
    zero = {key.removeprefix("stage3_") if key in UNPREFIXED else key: v for key, v in ds["zero_optimization"].items()}
    return {**ds, "bfloat16": {"enabled": "auto"}, "zero_optimization": zero}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("launch_files")
    (d / "ds_plain.json").write_text(json.dumps(DS_PLAIN))
    (d / "ds_own.json").write_text(json.dumps(DS_OWN))
    from toolkit.cli.main import main as cli

    for name, flags in (("zero2", ["--zero-stage", "2"]), ("zero3", ["--zero-stage", "3"]),
                        ("fsdp_grad_op", ["--fsdp", "--fsdp-sharding", "grad_op"])):
        for n in (1, 2):  # the toolkit's own `python -m toolkit accelerate-config` output
            cli(["accelerate-config", *flags, "--num-processes", str(n), "--output", str(d / f"acc_{name}_{n}.yaml")])
    transformers_z3 = json.loads((PUBLISHED / PUBLISHED_JSONS["pub_transformers_zero3"]).read_text())
    (d / SPELLINGS_FILE).write_text(json.dumps(other_spellings(transformers_z3), indent=2))
    # accelerate's DeepSpeed template, pointed at a JSON as its comment says to (the only edit): transformers'
    # ZeRO-3 file in DeepSpeed's other spellings, as a user's template met them (issue 57)
    template = yaml.safe_load((PUBLISHED / "accelerate" / "config_yaml_templates" / "deepspeed.yaml").read_text())
    template["deepspeed_config"]["deepspeed_config_file"] = str(d / SPELLINGS_FILE)
    (d / "acc_template_2.yaml").write_text(yaml.safe_dump(template))
    return d


def forms(files) -> dict[str, dict]:
    """name -> launcher, its arguments, ranks, runs ({layout: flags}), the runs on the GPU branch, and
    the layout line each launcher-set run must print."""
    f = files
    plain, own = ["--deepspeed", str(f / "ds_plain.json")], ["--deepspeed", str(f / "ds_own.json")]
    spellings = {SPELLINGS_RUN: ["--deepspeed", str(f / SPELLINGS_FILE)]}
    return {
        # a GPU-branch run first in its launch: no process group exists before it, as in a user's launch
        "python": dict(launcher="python", nproc=1, runs={"zero3_gpu_path": Z3, "ddp": [], **SHARDED, "dsfile": plain,
                                                         "dsfile_own": own, **PUBLISHED_RUNS, **spellings}),
        "accelerate_1": dict(launcher="accelerate", nproc=1, runs={"zero2_gpu_path": Z2, **SHARDED}),
        "accelerate_2": dict(launcher="accelerate", nproc=2, runs=SHARDED),
        "torchrun_1": dict(launcher="torchrun", nproc=1, runs=SHARDED),
        "torchrun_2": dict(launcher="torchrun", nproc=2, runs={**PUBLISHED_RUNS, **SHARDED, **spellings}),  # issue 45's
        "deepspeed_1": dict(launcher="deepspeed", nproc=1, runs=SHARDED),
        "deepspeed_2": dict(launcher="deepspeed", nproc=2, runs={**SHARDED, "dsfile_own": own}),
        "use_deepspeed_z3_1": dict(launcher="accelerate", nproc=1, args=["--use_deepspeed", "--zero_stage", "3"],
                                   runs={"zero3": []}, line="layout: ZeRO-3 from accelerate launch --use_deepspeed "
                                                            "--zero_stage 3"),
        "use_deepspeed_z2_2": dict(launcher="accelerate", nproc=2, args=["--use_deepspeed", "--zero_stage", "2"],
                                   runs={"zero2": []}, line="layout: ZeRO-2 from accelerate launch --use_deepspeed "
                                                            "--zero_stage 2"),
        "use_fsdp_1": dict(launcher="accelerate", nproc=1, args=["--use_fsdp"], runs={"fsdp": []},
                           line="layout: FSDP2, full sharding, from accelerate launch --use_fsdp"),
        "use_fsdp_2": dict(launcher="accelerate", nproc=2, args=["--use_fsdp"], runs={"fsdp": []},
                           line="layout: FSDP2, full sharding, from accelerate launch --use_fsdp"),
        "config_zero2_1": dict(launcher="accelerate", nproc=1, args=["--config_file", str(f / "acc_zero2_1.yaml")],
                               runs={"zero2": []},
                               line=f"layout: ZeRO-2 from accelerate config {f / 'acc_zero2_1.yaml'}"),
        "config_zero3_2": dict(launcher="accelerate", nproc=2, args=["--config_file", str(f / "acc_zero3_2.yaml")],
                               runs={"zero3": []},
                               line=f"layout: ZeRO-3 from accelerate config {f / 'acc_zero3_2.yaml'}"),
        "config_fsdp_2": dict(launcher="accelerate", nproc=2,
                              args=["--config_file", str(f / "acc_fsdp_grad_op_2.yaml")],
                              runs={"fsdp": []}, line=f"layout: FSDP2, grad_op sharding, from accelerate config "
                                                      f"{f / 'acc_fsdp_grad_op_2.yaml'}"),
        "config_template_2": dict(launcher="accelerate", nproc=2,
                                  args=["--config_file", str(f / "acc_template_2.yaml")],
                                  runs={"zero3": []},
                                  line=f"layout: ZeRO-3 from DeepSpeed config {f / SPELLINGS_FILE}, named by "
                                       f"accelerate config {f / 'acc_template_2.yaml'}; also from the file: "
                                       "offload optimizer+param"),
        # TRL's own configs as a user on a smaller machine runs them: --num_processes 2 instead of their 8
        "trl_zero3_2": dict(launcher="accelerate", nproc=2,
                            args=["--config_file", str(PUBLISHED / "trl" / "zero3.yaml")],
                            runs={"zero3": []},
                            line=f"layout: ZeRO-3 from accelerate config {PUBLISHED / 'trl' / 'zero3.yaml'}"
                                 "; bf16 from it too"),
        "trl_fsdp2_2": dict(launcher="accelerate", nproc=2,
                            args=["--config_file", str(PUBLISHED / "trl" / "fsdp2.yaml")],
                            runs={"fsdp": []}, line=f"layout: FSDP2, full sharding, from accelerate config "
                                                    f"{PUBLISHED / 'trl' / 'fsdp2.yaml'}; bf16 from it too"),
    }


@pytest.fixture(scope="module")
def launched(tmp_path_factory, tiny_model, data_files, files):
    """Each launch form run once (on first use); several tests read it."""
    done: dict[str, dict] = {}

    def get(name: str) -> dict:
        if name not in done:
            form = forms(files)[name]
            out = tmp_path_factory.mktemp(name)
            runs = launch_layouts(out, _common(tiny_model, data_files["chat"]) + _batch(form["nproc"]), form["runs"],
                                  nproc=form["nproc"], launcher=form["launcher"], launcher_args=form.get("args", []),
                                  cuda_path=tuple(r for r in form["runs"] if r.endswith("_gpu_path")))
            done[name] = {"runs": runs, "stdout": (out / "stdout.txt").read_text(), "form": form}
        return done[name]

    return get


FORM_NAMES = ["python", "accelerate_1", "accelerate_2", "torchrun_1", "torchrun_2", "deepspeed_1", "deepspeed_2",
              "use_deepspeed_z3_1", "use_deepspeed_z2_2", "use_fsdp_1", "use_fsdp_2", "config_zero2_1",
              "config_zero3_2", "config_fsdp_2", "config_template_2", "trl_zero3_2", "trl_fsdp2_2"]


def _precision(run) -> str:
    return yaml.safe_load((run["out"] / "config.yaml").read_text())["mixed_precision"]


def _tolerance(run) -> float:
    """fp32 reproduces to rounding; bf16 autocast against the fp32 reference does not (the FSDP2 run's
    logged loss is also rounded to bf16: 5.9865 where fp32 gives 5.9749 at its first step)."""
    return 5e-3 if _precision(run) == "bf16" else 1e-4


@pytest.mark.parametrize("name", FORM_NAMES)
def test_every_launch_form_trains_with_the_reference_losses_and_reloads(launched, name):
    got = launched(name)
    reference = losses(launched("python")["runs"]["ddp"]["out"])
    assert len(reference) == 2
    for layout, run in got["runs"].items():
        if layout in PUBLISHED_RUNS or layout == SPELLINGS_RUN:  # their own tests, below
            continue
        assert run["exit"] == 0, f"{name}/{layout}:\n{(run['out'].parent / 'stderr.txt').read_text()[-3000:]}"
        if layout.endswith("_gpu_path"):  # it set up the rank environment and process group itself
            assert run["group_before"] is False, f"{name}/{layout}"
        if layout != "dsfile_own":  # its own optimizer and schedule: checked below
            # transformers' ZeRO-3 file (in other spellings) brings its own too: the file as published on one
            # process is the reference
            expected = reference if name != "config_template_2" else \
                losses(launched("python")["runs"]["pub_transformers_zero3"]["out"])
            assert losses(run["out"]) == pytest.approx(expected, rel=_tolerance(run)), f"{name}/{layout}"
        integrity = json.loads((run["out"] / "integrity.json").read_text())
        assert integrity["ok"] and integrity["relative_diff"] <= _tolerance(run), f"{name}/{layout}: {integrity}"
        stage = {"zero2": 2, "zero3": 3, "dsfile": 2, "dsfile_own": 3}.get(layout.removesuffix("_gpu_path"))
        if stage is not None:
            assert json.loads((run["out"] / "ds_config.json").read_text())["zero_optimization"]["stage"] == stage
    if "line" in got["form"]:
        assert got["stdout"].count(got["form"]["line"]) == 1, got["stdout"][-2000:]


def test_deepspeed_file_runs_as_written_with_its_autos_filled(launched, files):
    """`--deepspeed` with its own optimizer and schedule: ds_config.json is the file with every "auto"
    filled (and the schedule DeepSpeed's own, stepped per optimizer step); the loop logs its lr."""
    for name in ("python", "deepspeed_2"):
        run = launched(name)["runs"]["dsfile_own"]["out"]
        ran = json.loads((run / "ds_config.json").read_text())
        assert "auto" not in json.dumps(ran) and ran["gradient_clipping"] == 0.5
        assert ran["optimizer"]["params"]["lr"] == 1e-3 and ran["zero_optimization"]["stage"] == 3
        # --warmup-steps 0: DeepSpeed's warm-up schedules run at least 2 steps, written as they run
        assert ran["scheduler"] == {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3,
                                                                        "warmup_num_steps": 2, "total_num_steps": 2}}
        assert ran["train_batch_size"] == 4 and ran["steps_per_print"] == 2**31 - 1
        lrs = [r["lr"] for r in records(run) if "lr" in r]  # the lr after each step: DeepSpeed's schedule ran
        assert lrs == [0.0, pytest.approx(1e-3)], lrs
    plain = json.loads((launched("python")["runs"]["dsfile"]["out"] / "ds_config.json").read_text())
    assert plain["zero_optimization"] == {"stage": 2, "reduce_bucket_size": 64 * 64}  # the tiny model's h x h


@pytest.mark.parametrize("name", list(PUBLISHED_JSONS))
def test_published_deepspeed_json_runs_on_1_and_2_ranks(launched, name):
    """Each published JSON, verbatim, under python (1 rank x 4) and torchrun (2 ranks x 2): it trains, its
    "auto"s are filled for the world the run has (train_batch_size 4 = micro x ranks), its stage, offload
    and precision are the file's, 2 ranks give 1 rank's losses, and the saved model reloads."""
    ds = json.loads((PUBLISHED / PUBLISHED_JSONS[name]).read_text())
    zero = ds["zero_optimization"]
    runs = {n: launched(form)["runs"][name] for form, n in (("python", 1), ("torchrun_2", 2))}
    by_ranks = {}
    for n, run in runs.items():
        assert run["exit"] == 0, f"{name} on {n} rank(s):\n{(run['out'].parent / 'stderr.txt').read_text()[-3000:]}"
        ran = json.loads((run["out"] / "ds_config.json").read_text())
        assert (ran["train_batch_size"], ran["train_micro_batch_size_per_gpu"]) == (4, 4 // n), name
        assert ran["zero_optimization"]["stage"] == zero["stage"]
        for key in ("offload_optimizer", "offload_param"):
            assert (ran["zero_optimization"].get(key) or {}).get("device") == (zero.get(key) or {}).get("device")
        assert ran.get("bf16", {}).get("enabled", False) is (ds.get("bf16", {}).get("enabled") is True)
        assert '"auto"' not in json.dumps(ran), ran
        integrity = json.loads((run["out"] / "integrity.json").read_text())
        assert integrity["ok"], integrity
        said = run["stdout"].read_text()
        assert said.count(f"layout: ZeRO-{zero['stage']} from --deepspeed {PUBLISHED / PUBLISHED_JSONS[name]}") == 1
        # the file's own AdamW on this CPU: torch's, said once (DeepSpeed's would be compiled first)
        swapped = "optimizer" in ds
        assert said.count("optimizer: the AdamW of --deepspeed") == int(swapped)
        assert ran.get("optimizer", {}).get("params", {}).get("torch_adam", False) is swapped
        # ZeRO-3 says once why its step 2 is slow, unless the file sets the reuse distance to 0 (axolotl)
        walks = zero["stage"] == 3 and zero.get("stage3_max_reuse_distance", zero.get("max_reuse_distance")) != 0
        assert said.count("zero-3: step 2 runs long once") == int(walks), name
        by_ranks[n] = losses(run["out"])
    tolerance = _tolerance(runs[1])
    assert by_ranks[2] == pytest.approx(by_ranks[1], rel=tolerance), name
    if "optimizer" not in ds and "scheduler" not in ds:  # else its own (transformers': WarmupLR from lr 0)
        assert by_ranks[1] == pytest.approx(losses(launched("python")["runs"]["ddp"]["out"]), rel=tolerance), name


def test_a_file_in_deepspeeds_other_spellings_runs_at_1_and_2_ranks_and_under_accelerate(launched):
    """Issue 57: `bfloat16` and the unprefixed stage-3 keys, "auto", under --deepspeed at 1 rank (python) and
    2 (torchrun), and named by accelerate's template (2 ranks): every "auto" filled under the file's own
    spelling (the precision section handed on as `bf16`, the one DeepSpeed reads next to accelerate's), the
    reuse distance read for the ZeRO-3 note, and the losses of transformers' file as published, same ranks."""
    for form, layout, reference in (("python", SPELLINGS_RUN, "python"), ("torchrun_2", SPELLINGS_RUN, "torchrun_2"),
                                    ("config_template_2", "zero3", "torchrun_2")):
        run = launched(form)["runs"][layout]
        assert run["exit"] == 0, f"{form}:\n{(run['out'].parent / 'stderr.txt').read_text()[-3000:]}"
        ran = json.loads((run["out"] / "ds_config.json").read_text())
        assert '"auto"' not in json.dumps(ran), ran
        zero = ran["zero_optimization"]
        assert (zero["prefetch_bucket_size"], zero["param_persistence_threshold"]) == (int(0.9 * 64 * 64), 10 * 64)
        assert not set(UNPREFIXED) & set(zero), zero
        assert ran["bf16"] == {"enabled": False} and "bfloat16" not in ran, ran
        assert run["stdout"].read_text().count("zero-3: step 2 runs long once") == 1, form
        published = launched(reference)["runs"]["pub_transformers_zero3"]
        assert losses(run["out"]) == pytest.approx(losses(published["out"]), rel=_tolerance(run)), form


def test_a_launcher_conflict_is_one_line_and_writes_nothing(tmp_path, tiny_model, data_files):
    out = tmp_path / "out"
    p = launch(_common(tiny_model, data_files["chat"]) + ["--output-dir", str(out), *Z3], launcher="accelerate",
               launcher_args=["--use_fsdp"], timeout=300)
    assert p.returncode != 0
    errors = [ln for ln in (p.stdout + p.stderr).splitlines() if ln.startswith("finetune.py: error:")]
    assert errors == ["finetune.py: error: accelerate launch --use_fsdp says FSDP, --zero-stage 3 asks for "
                      "DeepSpeed; drop one of them"]
    assert not out.exists()
