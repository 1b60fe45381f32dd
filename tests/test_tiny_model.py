"""`python -m toolkit prepare-model --tiny ARCH --output DIR`: the documented offline way to try an
architecture (MoE and --ep with qwen3_moe) writes a folder that plain transformers loads and runs, and
says bad input in one line (issue 57)."""

from __future__ import annotations

import pytest
import torch


def test_prepare_model_tiny_writes_a_loadable_moe(tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from toolkit.cli.main import main as cli
    from toolkit.model.router_load import experts_modules

    out = tmp_path / "tiny-moe"
    cli(["prepare-model", "--tiny", "qwen3_moe", "--output", str(out)])
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    assert model.config.model_type == "qwen3_moe" and model.config.num_experts == 4
    assert len(experts_modules(model)) >= 1  # routed experts, which --ep 2 splits over 2 ranks
    ids = tok("the quick brown fox", return_tensors="pt").input_ids
    assert torch.isfinite(model(input_ids=ids, labels=ids).loss)


@pytest.mark.parametrize("argv,expected", [
    (["--tiny", "nope", "--output", "OUT"],
     "--tiny nope: not an architecture toolkit/model/synthetic.py builds; one of "),
    (["--tiny", "qwen3_moe"], "--tiny qwen3_moe needs --output DIR"),
    (["--output", "OUT"], "--output goes with --tiny"),
    (["--tiny", "qwen3_moe", "--output", "FULL"], "--output FULL exists and is not an empty folder; pass --force"),
])
def test_prepare_model_tiny_says_bad_input_in_one_line(tmp_path, monkeypatch, capsys, argv, expected):
    from toolkit.cli.main import main as cli

    monkeypatch.chdir(tmp_path)
    (tmp_path / "FULL").mkdir()
    (tmp_path / "FULL" / "keep").write_text("keep me")
    with pytest.raises(SystemExit) as e:
        cli(["prepare-model", *argv])
    lines = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert e.value.code == 2 and len(lines) == 1 and expected in lines[0], lines
    assert not (tmp_path / "OUT").exists() and (tmp_path / "FULL" / "keep").read_text() == "keep me"
