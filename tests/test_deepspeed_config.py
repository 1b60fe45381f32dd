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
