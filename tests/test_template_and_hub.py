"""`--chat-template` (the template that renders the data, is part of the token cache's key and is saved in
final/) and `--push-to-hub` (refused at start where it cannot upload; final/ uploaded once saved and checked),
issue 64. The hub is never reached: huggingface_hub's HfApi is replaced by a recording fake."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import finetune
from conftest import CHATML
from toolkit.errors import UserError


def one_error(capsys, argv) -> str:
    """finetune.py's one error line (exit status 2, no traceback)."""
    with pytest.raises(SystemExit) as e:
        finetune.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and "Traceback" not in err, err[-2000:]
    return lines[0]


def test_the_chat_template_renders_the_data_and_keys_its_cache(tmp_path, tiny_model, data_files):
    """The tokenizer gets the template once, where it is loaded: the rows are rendered with it, and the
    cache's key (the tokenizer's digest hashes its template) changes with it, so a new template re-tokenizes;
    a checkpoint trained with another template is not resumed unasked."""
    from toolkit.config import parse_config
    from toolkit.data.prepare import data_key, prepare_data
    from toolkit.data.tokenize import ensure_chat_template
    from toolkit.model.load import load_tokenizer
    from toolkit.train.resume import ResumePoint, fingerprint, mismatch

    template = tmp_path / "chatml.jinja"
    template.write_text(CHATML)
    argv = ["--model", str(tiny_model), "--dataset", str(data_files["chat"]), "--seq-len", "64", "--output-dir",
            str(tmp_path / "o")]
    cfg = parse_config([*argv, "--chat-template", str(template)])
    point = ResumePoint(tmp_path / "checkpoint-2", 2, {"fingerprint": fingerprint(cfg.flat(), 1)})
    assert mismatch(point, parse_config(argv).flat(), 1) == [f"--chat-template was {str(template)!r}, now ''"]
    chatml = load_tokenizer(str(tiny_model), chat_template=cfg.model.chat_template)
    plain = load_tokenizer(str(tiny_model))
    ensure_chat_template(plain)
    assert chatml.chat_template == CHATML and data_key(cfg.data_settings, chatml) != data_key(cfg.data_settings, plain)
    rows = prepare_data(cfg.data_settings, chatml, cache=tmp_path / "cache").train
    assert chatml.decode(rows[0]["input_ids"]).startswith("<|im_start|>user\n")


def test_a_template_name_the_tokenizer_lacks_is_one_line_before_the_model_loads(tmp_path, tiny_model, data_files,
                                                                                 capsys, monkeypatch):
    """A tokenizer may carry several named templates (transformers' chat_template dict): --chat-template NAME
    picks one; a name it lacks, or a file that is not there, is one line naming what it has, before any
    model or data is read."""
    from transformers import AutoTokenizer

    from toolkit.model.load import load_tokenizer

    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    tok = AutoTokenizer.from_pretrained(model)
    rag = CHATML.replace("<|im_start|>", "<|rag|>")
    tok.chat_template = {"default": CHATML, "rag": rag}
    tok.save_pretrained(model)
    assert load_tokenizer(str(model), chat_template="rag").chat_template == rag
    monkeypatch.setattr("toolkit.model.load.load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    monkeypatch.setattr("toolkit.data.prepare.prepare_data", lambda *a, **k: pytest.fail("the data was read"))
    argv = ["--model", str(model), "--dataset", str(data_files["chat"]), "--output-dir", str(tmp_path / "o")]
    line = one_error(capsys, [*argv, "--chat-template", "chatml"])
    assert line.endswith(f"--chat-template chatml: not a file, and the tokenizer of {model} has no template of that "
                         "name (its templates are default, rag); give a Jinja file, or leave it out for the "
                         "tokenizer's own (other tools' built-in names, such as chatml, are not read here; the "
                         "built-in here: chatml-tools)")
    line = one_error(capsys, [*argv, "--chat-template", "templates/chatml.jinja"])
    assert line.endswith("--chat-template templates/chatml.jinja: file not found (a Jinja template file, or the name "
                         "of a template the tokenizer carries)")
    assert not (tmp_path / "o").exists()


class FakeHub:
    """huggingface_hub.HfApi as the run calls it, recording each call (and what final/ held at the upload)."""
    calls: list = []

    def whoami(self, token=None):
        FakeHub.calls.append(("whoami", token))
        return {"name": "me"}

    def create_repo(self, **kw):
        from huggingface_hub.hf_api import RepoUrl

        FakeHub.calls.append(("create_repo", kw))
        return RepoUrl(f"https://huggingface.co/{kw['repo_id']}")

    def upload_folder(self, **kw):
        folder = Path(kw["folder_path"])
        checked = json.loads((folder.parent / "integrity.json").read_text())["ok"]
        files = sorted(p.name for p in folder.iterdir())
        FakeHub.calls.append(("upload_folder", kw["repo_id"], folder, files, checked))


def test_a_run_saves_its_template_in_final_and_pushes_final_once_checked(tmp_path, tiny_model, data_files,
                                                                         monkeypatch, capsys):
    """--chat-template: final/'s tokenizer carries the template the run trained with. --push-to-hub: the token
    is checked before training, and final/ is uploaded after it is saved and its integrity check passed, by
    HfApi's create_repo (private with --hub-private) and upload_folder."""
    import huggingface_hub

    template = tmp_path / "chatml.jinja"
    template.write_text(CHATML)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: "hf_test")
    monkeypatch.setattr(huggingface_hub, "HfApi", FakeHub)
    monkeypatch.setattr("toolkit.config.hub.hub_unreachable", lambda: None)
    FakeHub.calls = []
    out = tmp_path / "out"
    finetune.main(["--model", str(tiny_model), "--dataset", str(data_files["chat"]), "--output-dir", str(out),
                   "--seq-len", "64", "--max-steps", "1", "--chat-template", str(template), "--push-to-hub",
                   "me/run", "--hub-private", "--verify", "files", "--report-to", "none"])
    assert (out / "final" / "chat_template.jinja").read_text() == CHATML
    (whoami, token), (create, created), (upload, repo, folder, files, checked) = FakeHub.calls
    assert (whoami, token, create, created) == ("whoami", "hf_test", "create_repo",
                                                {"repo_id": "me/run", "private": True, "exist_ok": True})
    assert (upload, repo, folder, checked) == ("upload_folder", "me/run", out / "final", True)
    assert {"adapter_model.safetensors", "chat_template.jinja", "tokenizer.json"} <= set(files)
    assert f"hub: {out / 'final'} uploaded to https://huggingface.co/me/run" in capsys.readouterr().out


def test_push_to_hub_is_refused_at_start_where_it_cannot_upload(tmp_path, monkeypatch, capsys):
    """Offline (HF_HUB_OFFLINE) or without a token, --push-to-hub is one line before anything loads (nothing
    written); the hub out of reach or a rejected token likewise (`push_problem`, given the network's answers)."""
    import huggingface_hub

    from toolkit.config.hub import push_problem

    argv = ["--push-to-hub", "me/run", "--output-dir", str(tmp_path / "o")]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert one_error(capsys, argv).endswith("--push-to-hub me/run: HF_HUB_OFFLINE is set, so nothing can be "
                                            "uploaded; unset it, or leave --push-to-hub out and upload "
                                            "OUTPUT_DIR/final later (hf upload me/run OUTPUT_DIR/final)")
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    assert one_error(capsys, argv).endswith("--push-to-hub me/run needs a Hugging Face token with write access: log "
                                            "in with `hf auth login` or set HF_TOKEN")
    assert not (tmp_path / "o").exists()

    class Rejected(Exception):
        response = type("R", (), {"status_code": 401})()

    def rejected():
        raise Rejected()

    def check(unreachable=None, whoami=lambda: {"name": "me"}):
        return push_problem("me/run", {}, "hf_x", lambda: unreachable, whoami)

    assert check("huggingface.co:443: Network is unreachable") == (
        "--push-to-hub me/run: the hub cannot be reached from here (huggingface.co:443: Network is unreachable); "
        "leave --push-to-hub out and upload OUTPUT_DIR/final later (hf upload me/run OUTPUT_DIR/final)")
    assert check(whoami=rejected) == ("--push-to-hub me/run: the hub rejected the token; log in again with `hf auth "
                                      "login` or set HF_TOKEN")
    assert check() is None


def test_a_bad_repo_id_and_a_failed_upload_are_one_line(tmp_path):
    """The repo id's shape is checked with the config; an upload that fails says where the saved run is and
    how to upload it by hand."""
    from toolkit.config import parse_config
    from toolkit.config.hub import push_final

    with pytest.raises(UserError) as e:
        parse_config(["--push-to-hub", "me/run/x", "--output-dir", str(tmp_path / "o")])
    assert str(e.value) == ("--push-to-hub 'me/run/x' is not a repo id: USER/NAME or NAME (letters, digits, '-', '_', "
                            "'.'; at most 96 each)")
    with pytest.raises(UserError, match="--hub-private goes with --push-to-hub REPO"):
        parse_config(["--hub-private", "--output-dir", str(tmp_path / "o")])

    class Down(FakeHub):
        def upload_folder(self, **kw):
            raise ConnectionError("connection reset")

    with pytest.raises(UserError) as e:
        push_final(Down(), tmp_path / "final", "me/run", private=False)
    assert str(e.value) == (f"--push-to-hub me/run: the upload failed (ConnectionError: connection reset); the run is "
                            f"saved in {tmp_path / 'final'}: upload it with `hf upload me/run {tmp_path / 'final'}`")
