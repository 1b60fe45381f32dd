"""Padding-free batches (issue 66, item 3): an unpacked micro-batch's examples end to end in one row, positions
restarting at each, where the attention keeps them apart without a dense mask. The collation keeps every
example, label and target; the loss and gradients are the padded batch's, for SFT and for each preference
objective (DPO, ORPO, SimPO, KTO); which runs take it by default is a pure rule; compiled blocks give the eager
result on rows whose width stays while their documents change."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
import torch

from toolkit.config import parse_config
from toolkit.data import collate
from toolkit.data.labels import count_targets
from toolkit.data.packing import Collate, collate_padding_free, count_examples, model_inputs
from toolkit.errors import UserError

TOL = dict(atol=1e-5, rtol=1e-5)  # fp32, the packing tests' (tests/test_performance.py, tests/test_preference.py)


def rows(lengths, seed: int = 0, prompt: int = 3) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for n in lengths:
        ids = [rng.randint(5, 300) for _ in range(n)]
        out.append({"input_ids": ids, "labels": [-100 if j < min(prompt, n - 1) else t for j, t in enumerate(ids)]})
    return out


# ---------------------------------------------------------------- the collation
def test_a_micro_batch_lies_end_to_end_in_one_row_with_every_example_and_target():
    """One row as long as the examples together (no padding), each example whole and in order, positions
    restarting at 0 at each, its first label unset (no example is predicted from the one before it), the
    targets, real tokens and examples the padded batch counts; the boundaries for the varlen kernels."""
    batch = rows([5, 9, 3, 7])
    padded, free = collate(batch, 0), collate_padding_free(batch, 0, whole=True)
    assert free["input_ids"].shape == (1, 24) and free["attention_mask"].all()
    assert free["input_ids"][0].tolist() == [t for r in batch for t in r["input_ids"]]
    assert free["position_ids"][0].tolist() == [p for n in (5, 9, 3, 7) for p in range(n)]
    assert free["labels"][0].tolist() == [t for r in batch for t in [-100] + r["labels"][1:]]
    assert free["cu_seq_lens"].tolist() == [0, 5, 14, 17, 24] and free["max_length"] == 9
    assert int(count_targets(free["labels"])) == int(count_targets(padded["labels"]))
    assert int(free["attention_mask"].sum()) == int(padded["attention_mask"].sum()) == 24
    assert int(count_examples(free)) == 4
    assert free["target_rows"].tolist() == (free["labels"][0, 1:] != -100).nonzero().flatten().tolist()
    assert "position_ids" not in padded and padded["input_ids"].numel() == 4 * 9  # what padding-free saves


def test_pairs_and_kto_examples_lie_end_to_end_as_documents():
    """A pair's chosen then rejected sequence, pair after pair, with `pairs`, `documents` and the precomputed
    reference carried in order; KTO's examples in one row and their KL sequences in another, each counted."""
    chosen, rejected = rows([4, 6], 1), rows([5, 3], 2)
    pairs = [{"input_ids": c["input_ids"], "labels": c["labels"], "rejected_input_ids": r["input_ids"],
              "rejected_labels": r["labels"], "ref_logps": [-1.0 - i, -2.0 - i]}
             for i, (c, r) in enumerate(zip(chosen, rejected))]
    free = collate_padding_free(pairs, 0, whole=True)
    laid = [t for c, r in zip(chosen, rejected) for t in c["input_ids"] + r["input_ids"]]
    assert free["input_ids"][0].tolist() == laid
    assert free["cu_seq_lens"].tolist() == [0, 4, 9, 15, 18] and int(free["pairs"]) == 2 and free["documents"] == 4
    assert free["ref_logps"].tolist() == [-1.0, -2.0, -2.0, -3.0]
    kto = [{"input_ids": r["input_ids"], "labels": r["labels"], "kl_input_ids": r["input_ids"][:3] + [7],
            "kl_labels": [-100, -100, -100, 7], "desirable": i == 0, "ref_logps": [-1.0 - i, -5.0 - i]}
           for i, r in enumerate(rows([4, 6, 5], 3))]
    free = collate_padding_free(kto, 0, whole=True)
    assert free["input_ids"].shape == (1, 15) and free["documents"] == 3 and int(free["pairs"]) == 3
    assert free["kl_input_ids"].shape == (1, 12) and free["kl_documents"] == 3
    assert free["kl_cu_seq_lens"].tolist() == [0, 4, 8, 12] and free["kl_position_ids"][0].tolist() == [0, 1, 2, 3] * 3
    assert free["desirable"].tolist() == [True, False, False]
    assert free["ref_logps"].tolist() == [-1.0, -2.0, -3.0] and free["ref_kl_logps"].tolist() == [-5.0, -6.0, -7.0]


def test_compiled_blocks_get_few_widths_and_their_padding_is_its_own_document():
    """The loader's collate, padding-free: as wide as the examples until the blocks compile, then a multiple of
    64 up to micro-batch x --seq-len (not to that width: a row of 4 x 16 tokens is 64 wide, not 4 x 100); the
    padding a block of its own, positions restarting below --seq-len, label -100, mask 0."""
    collate_fn = Collate(0, whole=True, packed=False, width=400, seq_len=100, padding_free=True)
    assert collate_fn(rows([16, 9]))["input_ids"].shape == (1, 25)
    collate_fn.bucket = True
    out = collate_fn(rows([16, 9]))
    assert out["input_ids"].shape == (1, 64) and out["cu_seq_lens"].tolist() == [0, 16, 25, 64]
    assert out["labels"][0, 25:].eq(-100).all() and not out["attention_mask"][0, 25:].any()
    assert collate_fn(rows([90, 90, 90]))["input_ids"].shape == (1, 320)
    assert collate_fn(rows([100, 100, 100, 99]))["input_ids"].shape == (1, 400)  # the cap, never below the tokens
    assert collate_fn(rows([100, 100, 100, 99]))["position_ids"].max() < 100
    assert Collate(0, True, True, 400, 100, padding_free=True).padding_free is False  # packed rows stay packed


# ---------------------------------------------------------------- which runs take it
def cfg(*flags: str):
    return parse_config(["--dataset", "x.jsonl", *flags], check_dataset=False)


def test_padding_free_is_on_where_the_attention_keeps_examples_apart_without_a_dense_mask():
    """The default: on where the model runs a padding-free kernel (varlen, flex, flash), off with sdpa or eager
    (a dense mask over the micro-batch's tokens costs more than the padding); --padding-free: on with any
    attention; --no-padding-free, --packing (already packed), --pp and --cp (they cut the rows) and grpo
    (sampled batches): off."""
    from toolkit.model.attention import end_to_end, padding_free_on

    default = cfg()
    assert [padding_free_on(default, a) for a in ("packed_varlen", "packed_flex", "packed_fa", "sdpa", "eager")] == \
           [True, True, True, False, False]
    assert padding_free_on(cfg("--padding-free"), "sdpa") and padding_free_on(cfg("--padding-free"), "eager")
    assert not padding_free_on(cfg("--no-padding-free"), "packed_varlen")
    assert not padding_free_on(cfg("--packing"), "packed_varlen")
    assert not padding_free_on(cfg("--packing", "--padding-free"), "sdpa")
    for section, change in (("parallel", {"pp": 2}), ("parallel", {"cp": 2}), ("train", {"objective": "grpo"})):
        run = dataclasses.replace(default, **{section: dataclasses.replace(getattr(default, section), **change)})
        assert not padding_free_on(run, "packed_varlen") and end_to_end(run) == (False, None), change
    assert [end_to_end(c) for c in (default, cfg("--padding-free"), cfg("--no-padding-free"), cfg("--packing"))] == \
           [(False, "auto"), (False, "on"), (False, None), (True, None)]


def test_the_attention_line_says_whether_batches_go_padding_free():
    """`choose_attention` with padding-free's auto picks the padding-free kernel where one implements the
    model (llama: varlen on the CPU), else keeps the model's own attention and pads (gpt-oss: its sinks and
    windows), saying why; --padding-free there takes the model's attention with a block-diagonal mask."""
    from test_attention import skeleton

    from toolkit.model.attention import choose_attention

    llama, gpt_oss = skeleton("llama"), skeleton("gpt_oss")
    assert choose_attention("auto", "cpu", False, llama, 64, "auto") == (
        "packed_varlen", "attention: varlen (padding-free rows: each example attends within itself)")
    assert choose_attention("auto", "cpu", False, gpt_oss, 64, "auto") == (
        None, "attention: eager (transformers' for GptOssForCausalLM); batches padded (the padding-free kernels here "
              "do not implement GptOssForCausalLM's attention sinks, sliding windows)")
    assert choose_attention("auto", "cpu", False, gpt_oss, 64, "on")[1].startswith(
        "attention: eager with a block-diagonal mask for padding-free rows")
    assert choose_attention("sdpa", "cpu", False, llama, 64, "auto") == (
        None, "attention: sdpa (transformers' for LlamaForCausalLM)")
    assert choose_attention("auto", "cpu", False, llama, 64) == (None, "attention: sdpa (transformers' for "
                                                                       "LlamaForCausalLM)")


@pytest.mark.parametrize("flags, says", [(["--pp", "2"], "--pp 2 splits each micro-batch's rows"),
                                         (["--cp", "2"], "--cp 2 cuts each row into slices")])
def test_padding_free_where_the_layout_cuts_rows_is_one_line(flags, says):
    with pytest.raises(UserError) as e:
        cfg("--padding-free", *flags)
    said = str(e.value)
    assert said.count("--padding-free") == 1 and f"--padding-free: {says}" in said and "\n" not in said
    assert cfg(*flags).data.padding_free is None  # unset: padded there, no error


# ---------------------------------------------------------------- the padded loss
@pytest.mark.parametrize("attn", ["varlen", "sdpa", "eager"])
def test_sft_gives_the_padded_loss_and_gradients(tiny_model, attn):
    """varlen (on the CPU one SDPA call per example), and sdpa or eager with transformers' block-diagonal mask
    from the positions (--padding-free): the padded batch's summed loss and gradients within 1e-5."""
    from transformers import AutoModelForCausalLM

    from toolkit.model.attention import register
    from toolkit.objectives.sft.loss import token_loss_sum

    model = AutoModelForCausalLM.from_pretrained(tiny_model, attn_implementation=register(attn) if attn == "varlen"
                                                 else attn)
    batch = rows([11, 30, 4, 19, 25], seed=4)

    def loss_and_grads(b):
        model.zero_grad(set_to_none=True)
        loss = token_loss_sum(model(**model_inputs(b)).logits, b["labels"])
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    padded, free = collate(batch, 0), collate_padding_free(batch, 0, whole=attn == "varlen")
    if attn != "varlen":
        model.set_attn_implementation("sdpa" if attn == "sdpa" else "eager")
    (want, gw), (got, gg) = loss_and_grads(padded), loss_and_grads(free)
    torch.testing.assert_close(got, want, **TOL)
    for name in gw:
        torch.testing.assert_close(gg[name], gw[name], **TOL, msg=name)


def write(path, records: list[dict]):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture(scope="module")
def preference_rows(tmp_path_factory, tiny_model):
    """{"pairs": prepared pair rows, "kto": prepared KTO rows} of small synthetic files."""
    from transformers import AutoTokenizer

    from toolkit.data.prepare import prepare_data
    from toolkit.data.tokenize import ensure_chat_template
    from toolkit.model.synthetic import corpus

    d = tmp_path_factory.mktemp("padfree")
    t = corpus(3 * 12, 5)
    pairs = write(d / "pairs.jsonl", [{"prompt": t[3 * i], "chosen": t[3 * i + 1], "rejected": t[3 * i + 2]}
                                      for i in range(12)])
    kto = write(d / "kto.jsonl", [{"prompt": t[3 * i], "completion": t[3 * i + 1], "label": i % 3 != 0}
                                  for i in range(12)])
    tok = AutoTokenizer.from_pretrained(tiny_model)
    ensure_chat_template(tok)
    with pytest.MonkeyPatch.context() as m:
        m.setenv("TOOLKIT_CACHE", str(d / "cache"))
        return {name: prepare_data(parse_config(["--dataset", str(path), "--objective", objective, "--seq-len", "48",
                                                 "--output-dir", str(d / "o")]).data_settings, tok).train
                for name, path, objective in (("pairs", pairs, "dpo"), ("kto", kto, "kto"))}


@pytest.mark.parametrize("objective, method", [("dpo", "lora"), ("dpo", "full"), ("orpo", "full"), ("simpo", "lora"),
                                               ("kto", "lora"), ("kto", "full")])
def test_each_preference_objective_gives_its_padded_loss(tiny_model, preference_rows, objective, method):
    """Pairs (chosen, rejected, chosen, ...) or KTO's examples and their KL sequences end to end: the micro-
    batch's summed objective, its metrics, ORPO's NLL scale and KTO's KL estimate (`begin_step`) and the
    gradients equal the padded batch's within 1e-5; the reference LoRA's base (adapters disabled) or each
    sequence's precomputed log-probabilities carried along."""
    from transformers import AutoModelForCausalLM

    from toolkit.model.attention import register
    from toolkit.objectives.preference.loss import PreferenceLoss

    data = preference_rows["kto" if objective == "kto" else "pairs"]
    torch.manual_seed(0)  # the LoRA init draws from it: the same weights whichever tests ran before
    model = AutoModelForCausalLM.from_pretrained(tiny_model, attn_implementation=register("varlen")).float()
    if method == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
        reference, data.reference = "adapters" if objective in ("dpo", "kto") else None, None
    else:
        torch.manual_seed(0)
        data.reference = torch.randn(len(data), 2) - 40.0
        reference = "precomputed" if objective in ("dpo", "kto") else None
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # off the reference, so it matters
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn(p.shape, generator=g))
    batch = [data[i] for i in range(5)]
    free, padded = collate_padding_free(batch, 0, whole=True), collate(batch, 0)
    assert free["input_ids"].shape[0] == 1 and free["documents"] == (5 if objective == "kto" else 10)

    def run(b):
        model.zero_grad(set_to_none=True)
        loss = PreferenceLoss(objective, 0.5, reference=reference)
        loss.begin_step(model, [b], lambda t: t, 1, b["pairs"].double())
        total, _ = loss(model, b, model_inputs(b))
        total.backward()
        state = torch.stack([torch.as_tensor(loss.nll_scale, dtype=torch.float64),
                             torch.as_tensor(loss.kl, dtype=torch.float64)])
        return total.detach(), loss.take_metrics(), state, {n: p.grad.clone() for n, p in model.named_parameters()
                                                             if p.grad is not None}

    (a, ma, sa, ga), (b, mb, sb, gb) = run(free), run(padded)
    torch.testing.assert_close(a, b, **TOL)
    # the rewards and margins are differences of the log-probability sums beside them: fp32 rounds them at
    # the sums' scale (a margin of 0.06 came out 1.1e-5 apart in a suite run; 2 of 6 LoRA inits failed 1e-5)
    torch.testing.assert_close(ma, mb, rtol=TOL["rtol"], atol=TOL["atol"] * max(1.0, float(mb.abs().max())))
    torch.testing.assert_close(sa, sb, **TOL)
    assert ga.keys() == gb.keys()
    for name in gb:
        torch.testing.assert_close(ga[name], gb[name], **TOL, msg=name)
    if objective == "orpo":
        assert float(sa[0]) != 1.0  # the NLL scale was set: pairs / the chosen sequences' tokens
    if objective == "kto":  # the estimate may be the clamp's 0: its sequences' log-probabilities themselves
        from toolkit.objectives.preference.functions import kl_batch
        from toolkit.objectives.logps import whole_row_logps

        kl_free, kl_padded = (whole_row_logps(model, kl_batch(x)) for x in (free, padded))
        assert kl_free.shape == (5,) and kl_free.abs().min() > 1
        torch.testing.assert_close(kl_free, kl_padded, **TOL)


# ---------------------------------------------------------------- compiled blocks
def test_compiled_blocks_give_the_eager_loss_as_widths_and_documents_change(tiny_model):
    """Padding-free rows under --compile (each block compiled, aot_eager: dynamo and AOTAutograd without
    inductor's C++ build), as the loader gives them once blocks compile (widths rounded to 64, the boundaries'
    shapes kept: `collate_packed(compiled=True)`): rows of one width whose documents differ, wider and
    narrower ones, and one of fewer examples give the eager losses and gradients; a row of the first width
    with other documents compiles nothing, a second width compiles the blocks once more (dynamic shapes) and
    nothing compiles after it. (A memo of the documents' lengths that dynamo traced kept the first row's
    lengths for the next: a silent wrong loss from step 2, `toolkit.model.attention._lengths`.)"""
    from transformers import AutoModelForCausalLM

    from toolkit.model.attention import register
    from toolkit.objectives.sft.loss import token_loss_sum
    from toolkit.model.kernels import decoder_layers
    from toolkit.train.compiling import compiled_graphs

    model = AutoModelForCausalLM.from_pretrained(tiny_model, attn_implementation=register("varlen"))
    collate_fn = Collate(0, whole=True, packed=False, width=4 * 64, seq_len=64, padding_free=True)
    collate_fn.bucket = True
    batches = [collate_fn(rows(lengths, seed)) for seed, lengths in enumerate(
        [(20, 30, 25, 21), (29, 22, 24, 20), (40, 45, 38, 41), (27, 23, 26, 24), (60, 50, 55, 40), (10, 12)])]
    assert [b["input_ids"].shape[1] for b in batches] == [128, 128, 192, 128, 256, 64]
    assert batches[0]["cu_seq_lens"].tolist() != batches[1]["cu_seq_lens"].tolist()

    def loss_and_grad(b):
        model.zero_grad(set_to_none=True)
        loss = token_loss_sum(model(**model_inputs(b)).logits, b["labels"])
        loss.backward()
        return loss.detach(), model.model.layers[-1].self_attn.q_proj.weight.grad.clone()

    eager = [loss_and_grad(b) for b in batches]
    torch._dynamo.reset()
    for block in decoder_layers(model):
        block.compile(backend="aot_eager")
    compiled, graphs = [], []
    for b in batches:
        compiled.append(loss_and_grad(b))
        graphs.append(compiled_graphs())
    for (want, gw), (got, gg) in zip(eager, compiled):
        torch.testing.assert_close(got, want, **TOL)
        torch.testing.assert_close(gg, gw, **TOL)
    assert graphs[1] == graphs[0] and graphs[2] > graphs[1] and graphs[-1] == graphs[2], graphs
