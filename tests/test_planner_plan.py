import json

import pytest

from toolkit.__main__ import main as cli
from toolkit.errors import UserError
from toolkit.planner.plan import parse_size


def plan_json(capsys, *argv):
    cli(["plan", *argv, "--json"])
    return json.loads(capsys.readouterr().out)


def test_json_schema(capsys):
    out = plan_json(capsys, "--model", "llama-3-8b", "--gpus-per-node", "8", "--gpu-memory", "80GB", "--method", "lora")
    assert isinstance(out["params"], int) and isinstance(out["trainable_params"], int)
    names = {s["name"] for s in out["strategies"]}
    assert {"ddp", "zero1", "zero2", "zero3", "zero2_offload", "zero3_offload", "zero3_offload_param",
            "fsdp_full", "fsdp_grad_op"} <= names
    for s in out["strategies"]:
        assert set(s["bytes"]) == {"weights", "grads", "optimizer", "activations", "logits", "buffers", "total"}
        assert s["bytes"]["total"] == sum(v for k, v in s["bytes"].items() if k != "total")
        assert isinstance(s["fits"], bool)
    assert out["chosen"] in names


def test_small_model_gets_plain_ddp_and_the_largest_micro_batch(capsys):
    """fp32: DDP and ZeRO-1/2 move the same bytes (ZeRO paper: 2 x params), so the simplest wins.
    (Under bf16 DeepSpeed all-reduces bf16 gradients while DDP under autocast keeps fp32 ones, so
    ZeRO-1 moves half the bytes and is chosen; test_bf16_prefers_deepspeed_traffic.)"""
    out = plan_json(capsys, "--model", "smollm2-135m", "--gpus-per-node", "2", "--gpu-memory", "80GB",
                    "--method", "full", "--seq-len", "1024", "--global-batch", "64", "--mixed-precision", "no")
    assert out["chosen"] == "ddp" and not out["chosen_detail"]["checkpointing"]
    mb = out["chosen_detail"]["micro_batch"]
    assert mb >= 2 and out["grad_accum"] == -(-64 // (mb * 2))


def test_bf16_prefers_deepspeed_traffic(capsys):
    out = plan_json(capsys, "--model", "smollm2-135m", "--gpus-per-node", "2", "--gpu-memory", "80GB", "--method", "full")
    comm = {s["name"]: s["comm_bytes"] for s in out["strategies"]}
    assert comm["zero1"] * 2 == comm["ddp"] and out["chosen"] == "zero1"


def test_more_memory_pressure_picks_more_sharding(capsys):
    roomy = plan_json(capsys, "--model", "llama-3-8b", "--gpus-per-node", "8", "--gpu-memory", "80GB", "--method", "full")
    tight = plan_json(capsys, "--model", "llama-3-8b", "--gpus-per-node", "8", "--gpu-memory", "24GB", "--method", "full")
    order = ["ddp", "zero1", "zero2", "fsdp_grad_op", "zero3", "fsdp_full", "zero2_offload", "zero3_offload",
             "zero3_offload_param"]
    assert order.index(tight["chosen"]) > order.index(roomy["chosen"])


def test_nothing_fits_says_by_how_much(capsys):
    cli(["plan", "--model", "llama-3-70b", "--gpus-per-node", "1", "--gpu-memory", "24GB", "--method", "full",
         "--cpu-memory", "64GB"])
    out = capsys.readouterr().out
    assert "nothing fits" in out and "GiB more than 24 GiB" in out and "qlora" in out


@pytest.mark.parametrize("argv, message", [
    (["--model", "llama-3-9b"], "not a preset, model folder or config file (did you mean 'llama-3-8b'?)"),
    (["--gpu-memory", "80XB"], "--gpu-memory '80XB' is not a size"),
    (["--gpu-memory", "-8GB"], "--gpu-memory must be positive, got '-8GB'"),
    (["--gpu-memory", "0"], "--gpu-memory must be positive"),
    (["--lora-targets", "qkv"], "LoRA targets ['qkv'] are not linears"),
])
def test_bad_input_is_one_clear_error(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        cli(["plan", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_parse_size():
    assert parse_size("80GB", "x") == 80 * 1024**3 and parse_size("1.5TiB", "x") == int(1.5 * 1024**4)
    with pytest.raises(UserError):
        parse_size("lots", "x")


def test_tp_and_pp_rows_follow_divisibility_and_are_never_chosen(capsys):
    """TP and PP rows run (--tp N, --pp N) but auto picks among DDP/ZeRO/FSDP."""
    out = plan_json(capsys, "--model", "llama-3-8b", "--gpus-per-node", "8", "--gpu-memory", "80GB", "--method", "full")
    rows = {s["name"]: s for s in out["strategies"]}
    assert {"tp2_dp4", "tp4_dp2", "tp8", "pp2", "pp4"} <= set(rows)  # 32 heads / 8 kv heads: 2, 4, 8 divide
    assert rows["tp8"]["bytes"]["weights"] < rows["tp2_dp4"]["bytes"]["weights"] < rows["ddp"]["bytes"]["weights"]
    assert rows["pp4"]["bytes"]["weights"] < rows["pp2"]["bytes"]["weights"] < rows["ddp"]["bytes"]["weights"]
    assert not out["chosen"].startswith(("tp", "pp"))
    qwen = plan_json(capsys, "--model", "qwen2.5-7b", "--gpus-per-node", "8", "--gpu-memory", "80GB")
    assert {s["name"] for s in qwen["strategies"] if s["name"].startswith("tp")} == {"tp2_dp4", "tp4_dp2"}  # 28/4 heads


@pytest.mark.parametrize("argv, message", [
    (["--model", "llama-3-8b", "--tp", "3"], "--tp 3: must divide the attention heads (32), kv heads (8), intermediate size (14336)"),
    (["--model", "llama-3-8b", "--tp", "16"], "--tp 16: must divide"),
    (["--model", "llama-3-8b", "--gpus-per-node", "2", "--tp", "4"], "--tp 4: must be <= GPUs per node (2)"),
    (["--model", "smollm2-135m", "--pp", "64"], "--pp 64: needs 2 <= stages <= blocks (30)"),
])
def test_impossible_model_parallel_degrees(capsys, argv, message):
    with pytest.raises(SystemExit):
        cli(["plan", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_logits_term_follows_the_loss_path(capsys):
    """--loss auto/chunked holds one 256-row chunk of logits, the hidden rows and the head's gradient;
    --loss full holds b x s x V logits three times over; pipeline stages always compute full logits."""
    from toolkit.planner.memory import chunked_loss_bytes, logits_bytes

    argv = ["--model", "llama-3-8b", "--gpus-per-node", "8", "--gpu-memory", "80GB", "--method", "full",
            "--seq-len", "2048", "--mixed-precision", "bf16", "--pp", "2"]
    full = {s["name"]: s for s in plan_json(capsys, *argv, "--loss", "full")["strategies"]}
    auto = {s["name"]: s for s in plan_json(capsys, *argv)["strategies"]}
    vocab, h = 128256, 4096
    for name in ("ddp", "zero3"):
        mb = full[name]["micro_batch"]
        assert full[name]["bytes"]["logits"] == logits_bytes(mb, 2048, vocab, 2)
        mb = auto[name]["micro_batch"]
        assert auto[name]["bytes"]["logits"] == chunked_loss_bytes(mb, 2048, vocab, h, 2, head_trainable=True)
        assert auto[name]["bytes"]["logits"] < full[name]["bytes"]["logits"]
    assert auto["pp2"]["bytes"]["logits"] == full["pp2"]["bytes"]["logits"] == logits_bytes(1, 2048, vocab, 2)
