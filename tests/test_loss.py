"""`--loss` (toolkit.objectives.sft.loss): the chunked loss gives full logits' loss and gradients (eager, compiled,
fp32 and bf16 autocast, all rows or the target rows), never syncs the host, and `auto`/`liger`/`cce`
resolve as documented. The eager chunked loss against full logits, unshifted, per bias and chunk
size, is in test_performance.py."""

from __future__ import annotations

import importlib.machinery
import sys
import types
from contextlib import contextmanager
from typing import Iterator

import pytest
import torch
import torch.nn.functional as F
from helpers import records
from torch.utils._python_dispatch import TorchDispatchMode

import toolkit.objectives.sft.loss as loss_mod
from toolkit.errors import UserError
from toolkit.objectives.sft.loss import (FusedLossHead, choose_loss, chunked_loss_sum, loss_head_for, target_loss_sum,
                                         target_rows, token_loss_sum)

FP32 = dict(atol=1e-5, rtol=1e-5)


def case(bias: bool = True, seed: int = 0, vocab: int = 50):
    """A head, hidden states and labels with a masked prompt, a row with no target, and 33 rows, so a
    chunk of 7 ends mid-row."""
    torch.manual_seed(seed)
    head = torch.nn.Linear(16, vocab, bias=bias)
    hidden = torch.randn(3, 11, 16, requires_grad=True)
    labels = torch.randint(0, vocab, (3, 11))
    labels[0, :4] = -100
    labels[2, :] = -100
    return head, hidden, labels


def loss_and_grads(fn, head, hidden) -> list[torch.Tensor]:
    hidden.grad = None
    head.zero_grad(set_to_none=True)
    loss = fn()
    (2.5 * loss).backward()  # an incoming gradient other than 1
    return [loss.detach(), *(t.grad / 2.5 for t in (hidden, head.weight, head.bias) if t is not None)]


def reference(head, hidden, labels, shifted: bool) -> list[torch.Tensor]:
    return loss_and_grads(lambda: (target_loss_sum if shifted else token_loss_sum)(head(hidden), labels), head, hidden)


def assert_all_close(got, want, **tol):
    for name, g, w in zip(["loss", "hidden", "weight", "bias"], got, want):
        torch.testing.assert_close(g, w, msg=name, **tol)


@pytest.mark.parametrize("shifted", [False, True])
@pytest.mark.parametrize("rows", [False, True], ids=["all_rows", "target_rows"])
def test_chunked_equals_full_logits(shifted, rows):
    head, hidden, labels = case()
    want = reference(head, hidden, labels, shifted)
    index = target_rows(labels, shifted) if rows else None
    got = loss_and_grads(lambda: chunked_loss_sum(hidden, head, labels, chunk=7, shifted=shifted, rows=index),
                         head, hidden)
    assert_all_close(got, want, **FP32)


def assert_bf16_close(got, want):
    """Both multiply in bf16 and take the softmax in fp32, so the losses agree to fp32 rounding; the
    gradients pass through bf16 in different groupings (chunked sums dW per chunk in fp32, full
    rounds it once), so they agree to bf16 rounding: max |diff| <= 1e-2 x max |grad| (measured up
    to 5.8e-3 over 3 seeds x 2 vocabularies, as large as full bf16's own difference from fp32, 3-6e-3)."""
    torch.testing.assert_close(got[0], want[0], **FP32)
    for name, g, w in zip(["hidden", "weight", "bias"], got[1:], want[1:]):
        assert g.dtype == torch.float32 and (g - w).abs().max() <= 1e-2 * w.abs().max(), name


def test_chunked_under_bf16_autocast_matches_full_logits():
    head, hidden, labels = case(vocab=300)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = reference(head, hidden, labels, False)
        got = loss_and_grads(lambda: chunked_loss_sum(hidden, head, labels, chunk=7), head, hidden)
    assert_bf16_close(got, want)


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated")  # inductor's own import
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16_autocast"])
def test_compiled_chunked_equals_full_logits(bf16):
    """Inductor compiles the per-chunk softmax once per dtype ((7, 300) here: 14 s cold on 2 CPU
    cores, 4 s from inductor's disk cache), shared by the all-rows and target-rows calls (both run
    full chunks). bf16 is what a GPU runs by default."""
    head, hidden, labels = case(vocab=300)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        want = reference(head, hidden, labels, False)
        for index in (None, target_rows(labels)):
            got = loss_and_grads(lambda: chunked_loss_sum(hidden, head, labels, chunk=7, rows=index, compiled=True),
                                 head, hidden)
            assert_bf16_close(got, want) if bf16 else assert_all_close(got, want, **FP32)


SYNCING = {"aten.nonzero", "aten._local_scalar_dense", "aten.masked_select", "aten.equal", "aten.is_nonzero",
           "aten._unique2", "aten.unique_consecutive", "aten.repeat_interleave"}


class _Syncs(TorchDispatchMode):
    """Ops whose output size or value the host must read from the device: on CUDA each waits for the
    GPU (`torch.cuda.set_sync_debug_mode` sees them only on a GPU)."""

    def __init__(self, seen: list[str]):
        super().__init__()
        self.seen = seen

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket._qualified_op_name.replace("::", ".")
        indices = args[1] if name in ("aten.index", "aten.index_put", "aten.index_put_") else ()
        if name in SYNCING or any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices):
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


@contextmanager
def host_syncs() -> Iterator[list[str]]:
    """Every device-to-host read inside: the syncing ops above plus `.tolist()`, `.cpu()` and `.numpy()`
    (no-ops for the dispatcher on a CPU tensor, copies from a GPU)."""
    seen: list[str] = []
    originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "cpu", "numpy")}

    def spy(name):
        def call(self, *a, **k):
            seen.append(name)
            return originals[name](self, *a, **k)
        return call

    try:
        for name in originals:
            setattr(torch.Tensor, name, spy(name))
        with _Syncs(seen):
            yield seen
    finally:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)


def test_the_sync_seam_sees_every_read_back():
    x = torch.randn(6)
    with host_syncs() as seen:
        (x > 0).nonzero()
        x[x > 0]
        x.sum().item()
        bool(x.sum() > 0)
        x.tolist()
        x.cpu()
    assert len(seen) == 6, seen


@pytest.mark.parametrize("rows", [False, True], ids=["all_rows", "target_rows"])
def test_chunked_loss_never_syncs_the_host(rows):
    """No `nonzero`/`.item()`/boolean indexing per micro-batch: the host keeps queueing GPU work."""
    head, hidden, labels = case()
    index = target_rows(labels) if rows else None  # made in the collate, on CPU labels
    with host_syncs() as seen:
        chunked_loss_sum(hidden, head, labels, chunk=7, rows=index).backward()
    assert seen == []


@pytest.mark.parametrize("choice, device, linear, fit, want", [
    ("auto", "cpu", True, None, "chunked"),
    ("auto", "cpu", True, True, "chunked"),
    ("auto", "cpu", False, False, "full"),
    ("auto", "cuda", True, True, "full"),
    ("auto", "cuda", True, False, "chunked"),  # not cce, even installed: slower on the user's path, no fp32
    ("auto", "cuda", True, None, "chunked"),
    ("auto", "cuda", False, False, "full"),
    ("liger", "cuda", True, True, "liger"),
    ("cce", "cuda", True, False, "cce"),
    ("full", "cuda", True, False, "full"),
])
def test_auto_picks_by_device_and_memory(choice, device, linear, fit, want):
    assert choose_loss(choice, device, linear, fit) == want


class TinyLM(torch.nn.Module):
    def __init__(self, bias: bool = False):
        super().__init__()
        self.body = torch.nn.Linear(16, 16)
        self.lm_head = torch.nn.Linear(16, 50, bias=bias)

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, x):
        return self.lm_head(self.body(x))


def test_head_finds_the_target_rows_itself_on_cpu(monkeypatch):
    """On the CPU `nonzero` waits for nothing, so the head runs on target rows without being given
    them (the CPU speed-up of benchmarks/throughput.md needs no collate support)."""
    seen = []
    real = loss_mod.linear_cross_entropy_sum
    monkeypatch.setattr(loss_mod, "linear_cross_entropy_sum", lambda h, *a: seen.append(len(h)) or real(h, *a))
    model = TinyLM()
    wrapped = loss_head_for(model, "chunked", "cpu")
    _, _, labels = case()
    with wrapped.labels(labels):
        model(torch.randn(3, 11, 16))
    assert seen == [int((labels[:, 1:] != -100).sum())]


@pytest.mark.parametrize("kind, package", [("liger", "liger-kernel"), ("cce", "cut-cross-entropy")])
def test_fused_loss_refused_in_one_line(monkeypatch, kind, package):
    with pytest.raises(UserError, match=rf"{package}.*CUDA GPU; this run is on cpu"):
        loss_head_for(TinyLM(), kind, "cpu")
    monkeypatch.setattr(loss_mod.importlib.util, "find_spec", lambda name, *a: None)  # not installed
    with pytest.raises(UserError, match=rf"needs the {package} package.*pip install 'toolkit\[gpu\]'"):
        loss_head_for(TinyLM(), kind, "cuda", precision="bf16")


def fake_package(monkeypatch, kind: str, with_bias: bool = True) -> list[dict]:
    """The `--loss kind` package as a module whose fused linear cross-entropy is PyTorch's, recording
    how it was called (the real ones need Triton and a CUDA GPU)."""
    _, module, name = loss_mod.FUSED[kind]
    calls: list[dict] = []

    def kernel(h, w, y, bias=None, ignore_index=-100, reduction="mean", softcap=None):
        calls.append({"ignore_index": ignore_index, "reduction": reduction, "rows": len(y)})
        logits = F.linear(h, w, bias).float()
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        return F.cross_entropy(logits, y, ignore_index=ignore_index, reduction=reduction)

    def kernel_without_bias(h, w, y, ignore_index=-100, reduction="mean"):
        return kernel(h, w, y, None, ignore_index, reduction)

    parts = module.split(".")
    for i in range(len(parts)):
        mod = types.ModuleType(".".join(parts[:i + 1]))
        mod.__spec__ = importlib.machinery.ModuleSpec(mod.__name__, None)  # find_spec reads it
        monkeypatch.setitem(sys.modules, mod.__name__, mod)
    setattr(mod, name, kernel if with_bias else kernel_without_bias)
    return calls


@pytest.mark.parametrize("kind", ["liger", "cce"])
def test_fused_loss_runs_the_package_inside_the_head(monkeypatch, kind):
    """The package's kernel gets the flattened, shifted targets, -100 and reduction="sum", inside the
    head's forward under `labels(...)`; outside it the head gives logits."""
    calls = fake_package(monkeypatch, kind)
    model = TinyLM(bias=True)
    wrapped = loss_head_for(model, kind, "cuda", precision="bf16")
    assert isinstance(wrapped, FusedLossHead) and wrapped.kind == kind
    x = torch.randn(3, 11, 16)
    _, _, labels = case()
    want = token_loss_sum(model(x), labels)
    with wrapped.labels(labels, rows=target_rows(labels)):
        got = model(x)
    torch.testing.assert_close(got, want, **FP32)
    assert calls == [{"ignore_index": -100, "reduction": "sum", "rows": int((labels[:, 1:] != -100).sum())}]
    assert model(x).shape == (3, 11, 50)


def test_cce_without_bias_refuses_a_biased_head(monkeypatch):
    fake_package(monkeypatch, "cce", with_bias=False)
    assert loss_head_for(TinyLM(bias=False), "cce", "cuda", precision="bf16") is not None
    with pytest.raises(UserError, match="has a bias"):
        loss_head_for(TinyLM(bias=True), "cce", "cuda", precision="bf16")


def test_cce_refuses_fp32_in_one_line_and_auto_never_picks_it(monkeypatch):
    """Cut Cross-Entropy's backward asserts bf16 or fp16 inputs (a traceback at step 1 on a GPU under
    --mixed-precision no, issue 56): asked for, it is refused before training; auto runs chunked, which
    takes every dtype; a bf16 head (a LoRA base loaded in bf16) passes without autocast."""
    fake_package(monkeypatch, "cce")
    with pytest.raises(UserError, match=r"--loss cce: .*bf16 or fp16 only.*float32.*use --loss chunked"):
        loss_head_for(TinyLM(), "cce", "cuda", precision="no")
    assert loss_head_for(TinyLM().to(torch.bfloat16), "cce", "cuda", precision="no").kind == "cce"
    assert loss_head_for(TinyLM(), "cce", "cuda", precision="fp16").kind == "cce"
    for precision in ("no", "bf16"):
        assert loss_head_for(TinyLM(), "auto", "cuda", logits_fit=False, precision=precision).kind == "chunked"


def test_failed_compile_falls_back_to_eager_and_says_why(monkeypatch):
    def broken(logits, targets):
        raise torch._dynamo.exc.TorchDynamoException("inductor: no working C++ compiler")

    monkeypatch.setattr(loss_mod, "compiled_softmax_grad", lambda: broken)
    model = TinyLM()
    wrapped = loss_head_for(model, "chunked", "cpu", compiled=True)
    x = torch.randn(3, 11, 16)
    _, _, labels = case()
    with wrapped.labels(labels), pytest.warns(RuntimeWarning, match="torch.compile failed .*no working C"):
        got = model(x)
    torch.testing.assert_close(got, token_loss_sum(model(x), labels), **FP32)
    assert not wrapped.compiled and "torch.compile failed" in wrapped.describe()


def zoo_model(model_type: str, **overrides):
    """`toolkit.model.synthetic.ZOO`'s tiny config, in memory, with a small vocabulary."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from toolkit.model.synthetic import ZOO

    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **{**ZOO[model_type], "vocab_size": 96, "tie_word_embeddings": False,
                                                 **overrides})
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager").float()


def zoo_batch(seed: int = 0):
    torch.manual_seed(seed)
    ids = torch.randint(4, 96, (2, 20))
    labels = ids.clone()
    labels[0, :6] = -100
    return ids, labels


@pytest.mark.parametrize("kind", ["chunked", "liger", "cce"])
@pytest.mark.parametrize("model_type, transform", [("cohere", "logits x 0.25"), ("granite", "logits x 0.125"),
                                                   ("gemma2", "logits softcap 5")])
def test_each_head_trains_the_model_s_own_loss_through_its_logit_transform(monkeypatch, kind, model_type, transform):
    """Cohere's logit_scale, Granite's logits_scaling and Gemma 2's final softcapping, read from the config:
    each head's loss sum equals `model(input_ids, labels=...)`'s mean times the targets, and every gradient
    equals full logits' (fp32); the model's own transform is back on afterwards (generation sees it)."""
    if kind != "chunked":
        fake_package(monkeypatch, kind)
    model = zoo_model(model_type)
    ids, labels = zoo_batch()
    n = int((labels[:, 1:] != -100).sum())
    own = model(input_ids=ids, labels=labels)
    model.zero_grad()
    token_loss_sum(model(input_ids=ids).logits, labels).backward()
    want = {k: p.grad.clone() for k, p in model.named_parameters()}
    head = loss_head_for(model, kind, "cuda" if kind != "chunked" else "cpu", precision="bf16")  # the fakes run fp32
    assert head.transform.describe() == transform and transform in head.describe()
    model.zero_grad()
    with head.labels(labels):
        got = model(input_ids=ids).logits
    got.backward()
    torch.testing.assert_close(got / n, own.loss, **FP32)
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[k], atol=1e-5, rtol=1e-4, msg=k)
    torch.testing.assert_close(model(input_ids=ids).logits, own.logits)  # transform on again outside the head


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_the_router_load_balancing_loss_is_trained_and_reported(model_type):
    """With output_router_logits (the zoo's coefficient 0.5), the micro-batch loss is the model's own:
    cross-entropy sum + coef x aux_loss x targets, so divided by the targets it is `model(labels=...)`'s
    loss; `take_aux` reports the aux loss x targets once. At coefficient 0 none is added."""
    from toolkit.objectives.head import LossHead

    model = zoo_model(model_type)
    ids, labels = zoo_batch()
    n = int((labels[:, 1:] != -100).sum())
    own = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels)
    for choice in ("full", "chunked"):
        head = LossHead(device_type="cpu")
        head.choose(model, choice)
        assert head.aux_coef == 0.5 and "load-balancing loss x 0.5" in head.describe()
        got = head(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels})
        torch.testing.assert_close(got / n, own.loss, **FP32)
        torch.testing.assert_close(head.take_aux() / n, own.aux_loss.double(), **FP32)
        assert head.take_aux() is None
        head.full_logits()
    off = zoo_model(model_type, router_aux_loss_coef=0.0)
    head = LossHead(device_type="cpu")
    head.choose(off, "full")
    assert head.aux_coef == 0.0 and "load-balancing" not in head.describe()


def test_the_loss_check_falls_back_or_stops_where_a_head_would_train_another_objective(tmp_path, data_files,
                                                                                         monkeypatch, capsys):
    """A logit transform the heads do not know (simulated by emptying their table, as a model with an
    unlisted transform would be): under --loss auto the check before step 1 falls back to full logits,
    whose losses then equal --loss full's; under --loss chunked the run stops with one line naming the
    model type and the head, before any step or file of a model."""
    import finetune
    from toolkit.model.synthetic import build_zoo_model_dir

    model = build_zoo_model_dir(tmp_path / "cohere", "cohere")

    def run(loss: str) -> list[float]:
        out = tmp_path / loss
        finetune.main(["--model", str(model), "--dataset", str(data_files["alpaca"]), "--output-dir", str(out),
                       "--seq-len", "64", "--max-steps", "2", "--mixed-precision", "no", "--method", "full",
                       "--report-to", "none", "--verify", "files", "--loss", loss])
        return [r["loss"] for r in records(out)]

    full = run("full")
    monkeypatch.setattr(loss_mod.LogitTransform, "KNOWN", {})
    capsys.readouterr()
    assert run("auto") == pytest.approx(full, rel=1e-6)
    said = capsys.readouterr().out
    assert "on model type cohere" in said and "--loss auto falls back to full logits" in said
    with pytest.raises(SystemExit) as e:
        run("chunked")
    err = capsys.readouterr().err
    (line,) = [x for x in err.splitlines() if x.startswith("finetune.py: error:")]
    assert e.value.code == 2 and "Traceback" not in err
    assert "is not model type cohere's own" in line and "chunked LM head" in line and "use --loss full" in line
    assert not (tmp_path / "chunked" / "metrics.jsonl").read_text().strip()


def test_the_loss_checks_window_holds_targets_and_bounds_the_logits_it_makes():
    """`check_window`: rows with targets first, each cut to one window that starts just before its first
    target (so a long masked prompt leaves targets in it), and short enough that the model's own
    loss on it stays within the byte budget (10 bytes a token per vocabulary entry); whole rows where
    they fit. The window's head loss still equals the model's own on it."""
    from toolkit.data.labels import CHECK_BYTES, check_window, count_targets
    from toolkit.data.packing import model_inputs
    from toolkit.objectives.head import LossHead

    torch.manual_seed(0)
    ids = torch.randint(0, 96, (3, 300))
    labels = ids.clone()
    labels[0] = -100  # no target: not checked
    labels[1, :150] = -100  # a long prompt
    labels[2, :10] = -100
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels,
             "target_rows": torch.arange(5)}
    whole = check_window(batch, vocab_size=96)
    assert torch.equal(whole["input_ids"], ids[1:]) and "target_rows" not in whole
    few = check_window(batch, vocab_size=128_256)
    length = CHECK_BYTES // (10 * 128_256 * 2)
    assert few["labels"].shape == (2, length) == few["input_ids"].shape == few["attention_mask"].shape
    assert torch.equal(few["input_ids"][0], ids[1, 149:149 + length])  # token 149 predicts label 150
    assert torch.equal(few["input_ids"][1], ids[2, 9:9 + length])
    assert count_targets(few["labels"][:1]) == length - 1
    late = labels[1:2].clone()
    late[0, :290] = -100  # the first target near the end: the window ends with the row
    end = check_window({"input_ids": ids[1:2], "labels": late}, vocab_size=10**9)
    assert end["labels"].shape == (1, 64) and torch.equal(end["input_ids"][0], ids[1, -64:])
    model = zoo_model("llama")
    head = LossHead(device_type="cpu")
    head.choose(model, "chunked")
    ours, own = head.check(model, few)
    assert ours == pytest.approx(own, rel=1e-5)
    assert own == pytest.approx(model(**model_inputs(few), labels=few["labels"]).loss.item(), rel=1e-6)
    head.full_logits()
