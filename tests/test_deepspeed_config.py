import subprocess
import sys
from pathlib import Path

import pytest

from toolkit.config import parse_config
from toolkit.errors import UserError
from toolkit.layout.deepspeed import deepspeed_config

ROOT = Path(__file__).resolve().parents[1]


def test_shipped_ds_configs_match_the_generator():
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_ds_configs.py"), "--check"],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr


def test_builder_keeps_auto_where_accelerate_fills_in_and_follows_precision():
    cfg = deepspeed_config(3, "optimizer+param", "bf16", hidden_size=576)
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        assert cfg[key] == "auto"
    assert cfg["bf16"]["enabled"] and not cfg["fp16"]["enabled"]
    z = cfg["zero_optimization"]
    assert z["stage3_gather_16bit_weights_on_model_save"] is True
    assert z["reduce_bucket_size"] == 576 * 576 and z["stage3_param_persistence_threshold"] == 5760
    assert z["offload_param"]["device"] == "cpu" and z["offload_optimizer"]["device"] == "cpu"
    assert deepspeed_config(2)["zero_optimization"]["reduce_bucket_size"] == "auto"
    assert "offload_optimizer" not in deepspeed_config(1)["zero_optimization"]
    with pytest.raises(ValueError, match="needs ZeRO stage 3"):
        deepspeed_config(2, "optimizer+param")


@pytest.mark.parametrize("argv, message", [
    (["--zero-stage", "4"], "--zero-stage must be one of 0, 1, 2, 3; got '4'"),
    (["--zero-stage", "2", "--offload", "optimizer+param"], "--offload optimizer+param needs --zero-stage 3 (got 2)"),
    (["--fsdp", "--zero-stage", "3"], "--fsdp and --zero-stage 3 both shard the model; choose one"),
    (["--method", "qlora", "--zero-stage", "3", "--offload", "optimizer+param"],
     "--method qlora cannot offload its 4-bit base weights"),
    (["--offload", "optimizer"], "--offload optimizer needs --zero-stage 1, 2 or 3"),
    (["--compile", "--zero-stage", "3"], "--compile with --zero-stage 3 is not supported"),
    (["--compile", "--pp", "2"], "--compile with --pp 2 is not supported yet"),
    (["--attn", "varlen", "--cp", "2"], "--attn varlen with --cp 2 is not supported"),
    (["--pp", "2", "--loss", "cce"], "--pp 2 with --loss cce is not supported"),
])
def test_invalid_parallel_combinations(tmp_path, argv, message):
    with pytest.raises(UserError) as e:
        parse_config(argv + ["--output-dir", str(tmp_path / "o")])
    assert message in str(e.value)


# ----------------------------------------------------------------------------- published files refused on a CPU

PUBLISHED = ROOT / "tests" / "data" / "published"  # verbatim; sources in its README.md
ACCELERATE_JSONS = sorted((PUBLISHED / "accelerate" / "deepspeed_config_templates").glob("*.json"))


@pytest.mark.parametrize("path", ACCELERATE_JSONS, ids=lambda p: p.stem)
def test_published_fp16_file_is_refused_in_one_line_where_deepspeed_has_no_fp16(tmp_path, monkeypatch, path):
    """accelerate's templates set "fp16": {"enabled": true}; DeepSpeed's CPU accelerator has no fp16 and
    its engine would stop with a traceback after the model loaded. On a GPU the file is taken as written."""
    import toolkit.layout.deepspeed as D

    argv = ["--deepspeed", str(path), "--output-dir", str(tmp_path / "o")]
    monkeypatch.setattr(D, "deepspeed_accelerator", lambda: ("cpu", False))
    with pytest.raises(UserError) as e:
        parse_config(argv)
    assert str(e.value) == (f"--deepspeed {path} sets fp16.enabled true, and DeepSpeed has no fp16 on this machine "
                            "(accelerator: cpu); set fp16.enabled to \"auto\" (fp32 here, bf16 on a GPU that has it) "
                            "or false, or run on a GPU")
    monkeypatch.setattr(D, "deepspeed_accelerator", lambda: ("cuda", True))
    cfg = parse_config(argv)
    assert cfg.train.mixed_precision == "fp16" and cfg.parallel.zero_stage == int(path.stem.split("_")[1][-1])


def test_deepspeed_docs_zero_offload_example_is_not_json_and_said_so(tmp_path):
    path = PUBLISHED / "deepspeed_docs" / "zero_offload.json"
    with pytest.raises(UserError, match=r"not valid JSON \(line 6, column 9: Expecting property name"):
        parse_config(["--deepspeed", str(path), "--output-dir", str(tmp_path / "o")])


def test_a_files_deepspeed_adam_runs_as_torchs_on_a_cpu_only():
    """DeepSpeed builds a file's Adam/AdamW as a C++ op compiled at first use (CPU Adam under offload,
    FusedAdam otherwise); the toolkit runs torch's on a CPU, unless the file chose."""
    from toolkit.layout.deepspeed import compiles_cpu_adam, with_torch_adam

    adamw = {"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}
    assert compiles_cpu_adam(adamw) and compiles_cpu_adam({"optimizer": {"type": "Adam"}})
    assert with_torch_adam(adamw)["optimizer"]["params"] == {"lr": "auto", "torch_adam": True}
    assert adamw["optimizer"]["params"] == {"lr": "auto"}  # a copy
    for kept in ({"optimizer": {"type": "AdamW", "params": {"torch_adam": False}}},  # the file chose
                 {**adamw, "zero_force_ds_cpu_optimizer": True}, {"optimizer": {"type": "Lamb"}}, {}):
        assert not compiles_cpu_adam(kept), kept


def test_zero3_says_why_its_step_2_is_slow_unless_the_walk_is_off():
    from toolkit.layout.deepspeed import zero3_first_steps_note

    note = zero3_first_steps_note(deepspeed_config(3))
    assert note.startswith("zero-3: step 2 runs long once") and "stage3_max_reuse_distance 1,000,000,000" in note
    assert zero3_first_steps_note(deepspeed_config(2)) is None
    assert zero3_first_steps_note({"zero_optimization": {"stage": 3}}) is not None  # DeepSpeed's default 1e9
    for off in ({"stage3_max_reuse_distance": 0}, {"max_reuse_distance": 0}):
        assert zero3_first_steps_note({"zero_optimization": {"stage": 3, **off}}) is None


# ----------------------------------------------------------------------------- DeepSpeed's other spellings (issue 57)

def _filled(ds: dict, mixed_precision: str = "bf16") -> dict:
    from toolkit.layout.deepspeed import fill_auto

    return fill_auto(ds, micro_batch=2, grad_accum=1, data_ranks=2, mixed_precision=mixed_precision, max_grad_norm=1.0,
                     lr=1e-4, weight_decay=0.0, hidden_size=64)


def test_a_file_in_deepspeeds_other_spellings_gets_every_auto_filled():
    """As published files spell it: the precision section as `bfloat16` (DeepSpeed's older name for bf16)
    and the stage-3 keys without their `stage3_` prefix. accelerate refuses any "auto" left ("`bfloat16.enabled`
    not found in kwargs"), and adds a `bf16` section of its own where there is none, which DeepSpeed
    then reads instead: the file's section is handed on as `bf16`."""
    import json

    ds = {"bfloat16": {"enabled": "auto", "immediate_grad_update": True},
          "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "prefetch_bucket_size": "auto",
                                "param_persistence_threshold": "auto", "max_reuse_distance": 0}}
    filled = _filled(ds)
    assert '"auto"' not in json.dumps(filled), filled
    assert filled["bf16"] == {"enabled": True, "immediate_grad_update": True} and "bfloat16" not in filled
    assert _filled(ds, "no")["bf16"]["enabled"] is False
    assert filled["zero_optimization"] == {"stage": 3, "reduce_bucket_size": 64 * 64,
                                           "prefetch_bucket_size": int(0.9 * 64 * 64),
                                           "param_persistence_threshold": 10 * 64, "max_reuse_distance": 0}
    assert ds["bfloat16"]["enabled"] == "auto"  # a copy


def test_every_spelling_deepspeeds_models_accept_is_filled_alike():
    """The spellings are DeepSpeed's, not a table of ours: each field of its ZeRO model is filled alike under
    its name and its alias, and its bf16 section under both names it reads (`get_bfloat16_config`)."""
    from deepspeed.runtime.constants import BFLOAT16, BFLOAT16_OLD
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    pairs = [(name, field.alias) for name, field in DeepSpeedZeroConfig.model_fields.items() if field.alias]
    assert {("prefetch_bucket_size", "stage3_prefetch_bucket_size"),
            ("param_persistence_threshold", "stage3_param_persistence_threshold")} <= set(pairs)
    for name, alias in pairs:
        by_name, by_alias = (_filled({"zero_optimization": {"stage": 3, key: "auto"}})["zero_optimization"][key]
                             for key in (name, alias))
        assert by_name == by_alias, (name, alias, by_name, by_alias)
    for precision in ("bf16", "fp16", "no"):
        assert len({str(_filled({key: {"enabled": "auto"}}, precision)) for key in (BFLOAT16, BFLOAT16_OLD)}) == 1


def test_a_files_bfloat16_section_is_read_as_deepspeed_reads_it():
    """`bfloat16` sets the run's precision as `bf16` does; where a file has both, DeepSpeed reads `bf16`.
    A problem in it is named with the file's own spelling."""
    from toolkit.layout.deepspeed import file_settings, user_config_problems

    assert file_settings({"bfloat16": {"enabled": True}})["mixed_precision"] == "bf16"
    assert file_settings({"bfloat16": {"enabled": False}, "fp16": {"enabled": False}})["mixed_precision"] == "no"
    assert file_settings({"bf16": {"enabled": False}, "bfloat16": {"enabled": True}})["mixed_precision"] == "no"
    assert user_config_problems({"bfloat16": {"enabeld": True}}, "ds.json") == \
        ["--deepspeed ds.json: bfloat16.enabeld: Extra inputs are not permitted"]
