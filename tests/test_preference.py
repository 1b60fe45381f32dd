"""Preference tuning (`--objective dpo|orpo|simpo`, toolkit.objectives.preference.loss): the losses and the first step's
gradients equal TRL's trainers' on the same model, pairs and beta; the data forms read as pairs; step 1
of DPO is ln 2 (LoRA: adapters disabled; full: the reference pass); runs train, resume and reload."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch
from conftest import CHATML
from helpers import build_model_dir, records
from toolkit.model.synthetic import corpus

from toolkit.objectives.preference.loss import PreferenceLoss
from toolkit.objectives.preference.functions import orpo_nll_tokens
from toolkit.objectives.logps import sequence_logps

TOL = dict(atol=1e-5, rtol=1e-5)
trl = pytest.importorskip("trl", reason="trl is in the dev extras: pip install -e '.[dev]'")


@pytest.fixture(scope="module")
def chatml_dir(tmp_path_factory):
    return build_model_dir(tmp_path_factory.mktemp("pref") / "model", chat_template=CHATML)


def conversational_pairs(n: int = 8, seed: int = 3) -> list[dict]:
    t = corpus(3 * n, seed)
    return [{"prompt": [{"role": "user", "content": t[3 * i]}],
             "chosen": [{"role": "assistant", "content": t[3 * i + 1]}],
             "rejected": [{"role": "assistant", "content": t[3 * i + 2]}]} for i in range(n)]


def load(path, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_pretrained(path).float()


def perturb(model, seed: int = 1, scale: float = 0.05) -> None:
    """Move the trainable weights off the reference, so the reference matters."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(scale * torch.randn(p.shape, generator=g))


def policy_and_reference(path, method: str):
    """(the policy, a reference model or None): LoRA's reference is its base with the adapters disabled
    (TRL without a ref_model), a full finetune's a frozen copy."""
    from peft import LoraConfig, get_peft_model

    model = load(path)
    if method == "lora":
        return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")), None
    return model, copy.deepcopy(model).eval()


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def interleaved(chosen_ids, chosen_mask, chosen_labels, rejected_ids, rejected_mask, rejected_labels, pad_id):
    """TRL's separate chosen / rejected tensors as the toolkit's rows: chosen even, rejected odd, right-padded."""
    width = max(chosen_ids.shape[1], rejected_ids.shape[1])

    def pad(t, value):
        return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value)

    def mix(a, b):
        return torch.stack([a, b], 1).reshape(-1, width)

    return {"input_ids": mix(pad(chosen_ids, pad_id), pad(rejected_ids, pad_id)),
            "attention_mask": mix(pad(chosen_mask, 0), pad(rejected_mask, 0)),
            "labels": mix(pad(chosen_labels, -100), pad(rejected_labels, -100))}


def our_loss(model, batch: dict, objective: str, beta: float, **kw) -> torch.Tensor:
    """The toolkit's loss on `batch` as the loop normalises it: the summed pair loss / the pairs."""
    pairs = batch["input_ids"].shape[0] // 2
    loss = PreferenceLoss(objective, beta, **kw)
    if objective == "orpo":
        loss.nll_scale = pairs / orpo_nll_tokens(batch)
    total, _ = loss(model, batch, {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]})
    return total / pairs


def dpo_batch(trainer, n: int = 4) -> tuple[dict, dict]:
    """(TRL's DPO batch of `n` pairs, the same pairs as the toolkit's rows)."""
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(n)])
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
    order = torch.stack([torch.arange(n), torch.arange(n) + n], 1).reshape(-1)
    ours = {"input_ids": batch["input_ids"][order], "attention_mask": batch["attention_mask"][order],
            "labels": labels[order]}
    return batch, ours


@pytest.mark.parametrize("method", ["lora", "full"])
def test_dpo_loss_and_gradients_equal_trls_dpo_trainer(chatml_dir, tmp_path, method):
    """DPO, beta 0.2: LoRA against TRL's reference with the adapters disabled (no ref_model), full
    against a reference model (ours: its log-probabilities precomputed into the batch, as the
    reference pass gives them). The policy is moved off the reference first."""
    import datasets
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    tok = AutoTokenizer.from_pretrained(chatml_dir)
    model, ref = policy_and_reference(chatml_dir, method)
    args = DPOConfig(output_dir=str(tmp_path), report_to=[], per_device_train_batch_size=4, use_cpu=True, beta=0.2)
    trainer = DPOTrainer(model=model, ref_model=ref, args=args, train_dataset=datasets.Dataset.from_list(
        conversational_pairs()), processing_class=tok)
    perturb(model)  # after: TRL keeps a given adapter's initial weights as its reference ("ref")
    batch, ours = dpo_batch(trainer)
    model.train()
    theirs = trainer.compute_loss(model, batch)
    theirs.backward()
    their_grads = grads(model)
    model.zero_grad(set_to_none=True)
    if ref is not None:
        with torch.no_grad():
            ours["ref_logps"] = sequence_logps(ref(input_ids=ours["input_ids"],
                                                   attention_mask=ours["attention_mask"]).logits, ours["labels"])[0]
    mine = our_loss(model, ours, "dpo", 0.2, reference="adapters" if method == "lora" else "precomputed")
    mine.backward()
    torch.testing.assert_close(mine, theirs.float(), **TOL)
    assert mine.item() != pytest.approx(math.log(2), abs=1e-3)  # the reference mattered
    my_grads = grads(model)
    assert my_grads.keys() == their_grads.keys() and my_grads
    for name in my_grads:
        torch.testing.assert_close(my_grads[name], their_grads[name], **TOL, msg=name)


@pytest.mark.parametrize("objective", ["orpo", "simpo"])
def test_orpo_and_simpo_equal_trls_trainers(chatml_dir, tmp_path, objective):
    """ORPO against TRL's ORPOTrainer (beta 0.1: its NLL over the chosen sequence, prompt included, and the
    odds-ratio term); SimPO against CPOTrainer's loss_type 'simpo' with cpo_alpha 0 (beta 2, gamma 1,
    label smoothing 0.1): loss and every gradient, full finetune."""
    import datasets
    from transformers import AutoTokenizer
    from trl.experimental.cpo import CPOConfig, CPOTrainer
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    tok = AutoTokenizer.from_pretrained(chatml_dir)
    model = load(chatml_dir)
    common = dict(output_dir=str(tmp_path), report_to=[], per_device_train_batch_size=4, use_cpu=True)
    data = datasets.Dataset.from_list(conversational_pairs())
    if objective == "orpo":
        trainer, kw = ORPOTrainer(model=model, args=ORPOConfig(**common, beta=0.1), train_dataset=data,
                                  processing_class=tok), {}
        beta = 0.1
    else:
        beta, kw = 2.0, {"simpo_gamma": 1.0, "label_smoothing": 0.1}
        trainer = CPOTrainer(model=model, args=CPOConfig(**common, loss_type="simpo", cpo_alpha=0.0, beta=beta,
                                                         simpo_gamma=1.0, label_smoothing=0.1),
                             train_dataset=data, processing_class=tok)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    model.train()
    theirs = trainer.compute_loss(model, batch)
    theirs.backward()
    their_grads = grads(model)
    model.zero_grad(set_to_none=True)
    ours = interleaved(*(batch[f"{side}_{k}"] for side in ("chosen", "rejected")
                         for k in ("input_ids", "attention_mask", "labels")), tok.pad_token_id)
    mine = our_loss(model, ours, objective, beta, **kw)
    mine.backward()
    torch.testing.assert_close(mine, theirs.float(), **TOL)
    my_grads = grads(model)
    assert my_grads.keys() == their_grads.keys()
    for name in my_grads:
        torch.testing.assert_close(my_grads[name], their_grads[name], **TOL, msg=name)


def conversational_unpaired(n: int = 8, seed: int = 3) -> list[dict]:
    t = corpus(2 * n, seed)
    return [{"prompt": [{"role": "user", "content": t[2 * i]}],
             "completion": [{"role": "assistant", "content": t[2 * i + 1]}],
             "label": i % 3 != 0} for i in range(n)]


@pytest.mark.parametrize("method", ["lora", "full"])
def test_kto_loss_and_gradients_equal_trls_kto_trainer(chatml_dir, tmp_path, method):
    """KTO, beta 0.3, weights 1.2 and 0.7, on 4 examples (3 desirable) with TRL's KL sequences (each
    prompt with the previous example's completion): the KL estimate, loss and every gradient equal
    `KTOTrainer`'s (LoRA: its adapter-disabled reference; full: a reference model, ours precomputed).
    The policy is moved off the reference first, far enough that the estimate is above its clamp at 0."""
    import datasets
    from transformers import AutoTokenizer
    from trl import KTOConfig, KTOTrainer

    tok = AutoTokenizer.from_pretrained(chatml_dir)
    model, ref = policy_and_reference(chatml_dir, method)
    args = KTOConfig(output_dir=str(tmp_path), report_to=[], per_device_train_batch_size=4, use_cpu=True, beta=0.3,
                     desirable_weight=1.2, undesirable_weight=0.7)
    trainer = KTOTrainer(model=model, ref_model=ref, args=args, train_dataset=datasets.Dataset.from_list(
        conversational_unpaired()), processing_class=tok)
    perturb(model, **({"seed": 2, "scale": 0.2} if method == "lora" else {"seed": 8}))  # a KL estimate above 0
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    assert 0 < batch["label"].sum() < 4
    model.train()
    theirs = trainer.compute_loss(model, batch)
    theirs.backward()
    their_grads = grads(model)
    model.zero_grad(set_to_none=True)

    def masked(prefix):
        return batch[f"{prefix}input_ids"].masked_fill(batch[f"{prefix}completion_mask"] == 0, -100)

    ours = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "labels": masked(""),
            "kl_input_ids": batch["KL_input_ids"], "kl_attention_mask": batch["KL_attention_mask"],
            "kl_labels": masked("KL_"), "desirable": batch["label"].bool(), "pairs": torch.tensor(4)}
    if ref is not None:
        with torch.no_grad():
            for side in ("", "kl_"):
                ours[f"ref_{side}logps"] = sequence_logps(ref(input_ids=ours[f"{side}input_ids"], attention_mask=ours[
                    f"{side}attention_mask"]).logits, ours[f"{side}labels"])[0]
    loss = PreferenceLoss("kto", 0.3, reference="adapters" if method == "lora" else "precomputed",
                          desirable_weight=1.2, undesirable_weight=0.7)
    loss.begin_step(model, [ours], lambda x: x, 1, torch.tensor(4.0))
    assert loss.kl.item() == pytest.approx(trainer._metrics["train"]["kl"][-1], rel=1e-5) and loss.kl.item() > 0.01
    total, _ = loss(model, ours, {"input_ids": ours["input_ids"], "attention_mask": ours["attention_mask"]})
    mine = total / 4
    mine.backward()
    torch.testing.assert_close(mine, theirs.float(), **TOL)
    my_grads = grads(model)
    assert my_grads.keys() == their_grads.keys() and my_grads
    for name in my_grads:
        torch.testing.assert_close(my_grads[name], their_grads[name], **TOL, msg=name)
    metrics = loss.metric_values(loss.take_metrics(), 4)
    for name in ("rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected", "rewards/margins"):
        assert metrics[name] == pytest.approx(trainer._metrics["train"][name][-1], rel=1e-4), name  # fp32 sums


# --- runs: data forms, every layout against one process, resume, reload
def write_pairs(path, rows: list[dict]):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def string_pairs(n: int = 48, seed: int = 5) -> list[dict]:
    t = corpus(3 * n, seed)
    return [{"prompt": t[3 * i], "chosen": t[3 * i + 1], "rejected": t[3 * i + 2]} for i in range(n)]


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory):
    return write_pairs(tmp_path_factory.mktemp("pairs") / "pairs.jsonl", string_pairs())


DPO = ["--objective", "dpo"]
LAYOUTS = {"ddp": [], "zero2": ["--zero-stage", "2"], "zero3": ["--zero-stage", "3"], "fsdp": ["--fsdp"],
           "tp": ["--tp", "2", "--micro-batch-size", "2"],  # one data-parallel rank: 2 pairs x 2 steps
           "cp": ["--cp", "2", "--micro-batch-size", "2"],  # each sequence in two slices, summed
           "pp": ["--pp", "2", "--micro-batch-size", "2", "--pp-microbatches", "2"]}  # a pair per pipeline micro-batch


@pytest.fixture(scope="module")
def unpaired_file(tmp_path_factory):
    t = corpus(2 * 48, 7)
    return write_pairs(tmp_path_factory.mktemp("kto") / "kto.jsonl",
                       [{"prompt": t[2 * i], "completion": t[2 * i + 1], "label": i % 3 != 0} for i in range(48)])


KTO_LAYOUTS = {"ddp": ("lora", []), "zero3": ("full", LAYOUTS["zero3"]), "fsdp": ("lora", LAYOUTS["fsdp"]),
               "tp": ("full", LAYOUTS["tp"]), "cp": ("lora", LAYOUTS["cp"]), "pp": ("lora", LAYOUTS["pp"])}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model, pairs_file, unpaired_file):
    """DPO (LoRA and full), ORPO and SimPO in one process with micro-batch 4, and on 2 ranks with
    micro-batch 1 x accumulation 2 (the same 4 pairs a step), every layout, in two launches."""
    from distributed import batched_runs, common_args

    specs = {("one", m, o): (1, ["--method", m, "--objective", o, "--micro-batch-size", "4"])
             for m, o in (("lora", "dpo"), ("full", "dpo"), ("full", "orpo"), ("lora", "simpo"))}
    evals = ["--eval-split", "0.25", "--eval-on-start", "--eval-every", "5"]
    specs.update({  # dropout turned off (as TRL) and checkpointing: one process's losses; held-out pairs
        ("one", "lora", "dpo_gc_dropout"): (1, ["--method", "lora", *DPO, "--micro-batch-size", "4",
                                                "--gradient-checkpointing", "--lora-dropout", "0.1"]),
        ("one", "full", "dpo_eval"): (1, ["--method", "full", *DPO, "--micro-batch-size", "4", *evals]),
        ("one", "full", "orpo_eval"): (1, ["--method", "full", "--objective", "orpo", "--micro-batch-size", "4",
                                           *evals])})
    specs.update({(name, m, "dpo"): (2, ["--method", m, *DPO, "--micro-batch-size", "1", "--grad-accum", "2", *flags])
                  for name, flags in LAYOUTS.items() for m in ("lora", "full")})
    specs.update({("ddp", m, o): (2, ["--method", m, "--objective", o, "--micro-batch-size", "1", "--grad-accum", "2"])
                  for m, o in (("full", "orpo"), ("lora", "simpo"))})
    specs[("cp", "lora", "simpo")] = (2, ["--method", "lora", "--objective", "simpo", "--micro-batch-size", "2",
                                          "--grad-accum", "2", "--cp", "2"])
    specs[("cp", "full", "orpo")] = (2, ["--method", "full", "--objective", "orpo", "--micro-batch-size", "2",
                                         "--grad-accum", "2", "--cp", "2"])
    specs[("pp", "full", "orpo_eval")] = (2, ["--method", "full", "--objective", "orpo", "--micro-batch-size", "1",
                                              "--grad-accum", "2", *evals, *LAYOUTS["pp"]])
    packed = ["--packing", "--seq-len", "48"]  # rows of 96 tokens: two or three pairs each
    specs.update({("one", m, "dpo_packed"): (1, ["--method", m, *DPO, "--micro-batch-size", "2", *packed])
                  for m in ("lora", "full")})
    specs[("ddp", "lora", "dpo_packed")] = (2, ["--method", "lora", *DPO, "--micro-batch-size", "1", *packed])
    kto = ["--objective", "kto", "--dataset", str(unpaired_file), "--desirable-weight", "1.5"]
    specs.update({("one", m, "kto"): (1, ["--method", m, *kto, "--micro-batch-size", "4"]) for m in ("lora", "full")})
    specs[("one", "lora", "kto_eval")] = (1, ["--method", "lora", *kto, "--micro-batch-size", "4", *evals])
    specs.update({(name, m, "kto"): (2, ["--method", m, *kto, "--micro-batch-size", "1", "--grad-accum", "2", *flags])
                  for name, (m, flags) in KTO_LAYOUTS.items()})
    return batched_runs(tmp_path_factory, common_args(tiny_model, pairs_file), specs)


@pytest.mark.parametrize("method", ["lora", "full"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_dpo_on_every_layout_matches_one_process(runs, name, method):
    """Per-step losses and reward accuracies of DPO on 2 ranks (DDP, ZeRO-2, ZeRO-3, FSDP2, TP, CP) within
    1e-4 relative of one process's; step 1 is ln 2 on both (the reference is the model as loaded)."""
    ref, got = records(runs("one", method, "dpo")), records(runs(name, method, "dpo"))
    assert len(got) == len(ref) == 5
    assert (ref[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
            and got[0]["loss"] == pytest.approx(math.log(2), abs=1e-6))
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in ref], rel=1e-4), name
    assert [r["logps/chosen"] for r in got] == pytest.approx([r["logps/chosen"] for r in ref], rel=1e-4)
    # step 1's rewards are all 0 up to rounding (the policy is the reference): ties, which CP's slice sums
    # against the reference's whole rows may break either way; from step 2 the pairs are ranked alike
    assert [r["rewards/accuracies"] for r in got][1:] == [r["rewards/accuracies"] for r in ref][1:]


@pytest.mark.parametrize("method, objective, layout", [("full", "orpo", "ddp"), ("lora", "simpo", "ddp"),
                                                       ("lora", "simpo", "cp"), ("full", "orpo", "cp")])
def test_orpo_and_simpo_normalise_over_the_global_batch(runs, method, objective, layout):
    """ORPO's NLL term (over the global batch's chosen tokens) and SimPO's pairs: 2 ranks x 2
    accumulation steps give one process's losses; under --cp 2 too, SimPO's mean log-probabilities (each
    sequence's sum and token count over its two slices) and ORPO's (its NLL each slice's share)."""
    ref, got = records(runs("one", method, objective)), records(runs(layout, method, objective))
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in ref], rel=1e-4)
    assert ref[0]["loss"] != pytest.approx(ref[-1]["loss"], rel=1e-3)  # it trains


@pytest.mark.parametrize("name", list(KTO_LAYOUTS))
def test_kto_on_every_layout_matches_one_process(runs, name):
    """KTO on 2 ranks x 2 accumulation steps (DDP, ZeRO-3, FSDP2, TP, CP) gives one process's losses, KL
    estimates and rewards within 1e-4: its estimate is the global batch's whatever the split. Step 1 is
    0.5 per example, weighted (policy = reference, estimate 0); TRL's metrics are logged; it trains."""
    from distributed import assert_metric_close

    method = KTO_LAYOUTS[name][0]
    ref, got = records(runs("one", method, "kto")), records(runs(name, method, "kto"))
    assert len(got) == len(ref) == 5
    assert ref[0]["kl"] == 0 and ref[0]["rewards/chosen"] == ref[0]["rewards/rejected"] == pytest.approx(0, abs=1e-6)
    assert 0.5 < ref[0]["loss"] < 0.75  # each example's 0.5, x 1.5 where desirable
    for key in ("loss", "kl", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected"):
        # abs: a reward is beta x a difference of fp32 sums of ~50 nats, so ~1e-6 of it is rounding
        assert_metric_close(got, ref, key, rel=1e-4, abs=2e-6, what=name)
    assert all(r["kl"] > 0 for r in ref[1:])  # it trains: the policy leaves the reference


def test_a_dpo_run_logs_trls_metrics_and_says_what_it_trains(runs):
    from distributed import run_stdout

    first = records(runs("one", "lora", "dpo"))[0]
    # the reference's forward (adapters disabled) counts in the model FLOPs: 1/3 more than SimPO's step
    assert first["flops_per_token"] == pytest.approx(
        4 / 3 * records(runs("one", "lora", "simpo"))[0]["flops_per_token"], rel=1e-9)
    for key in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                "logps/rejected"):
        assert key in first
    assert first["rewards/chosen"] == pytest.approx(0.0, abs=1e-6)  # the policy is the reference at step 1
    said = run_stdout(runs("one", "lora", "dpo"))
    assert "objective: dpo, beta 0.1" in said and "adapters disabled" in said
    said = run_stdout(runs("one", "full", "dpo"))
    assert "log-probabilities computed before step 1" in said
    assert "reference: 20 of 48 train pairs' log-probabilities computed before step 1" in said  # 5 steps x 4


FORMS = {  # each form of one pair: prompt "Name a colour.", chosen "Blue.", rejected "Loud."
    "pairs": {"prompt": "Name a colour.", "chosen": "Blue.", "rejected": "Loud."},
    "conversational": {"prompt": [{"role": "user", "content": "Name a colour."}],
                       "chosen": [{"role": "assistant", "content": "Blue."}],
                       "rejected": [{"role": "assistant", "content": "Loud."}]},
    "implicit": {"chosen": [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}],
                 "rejected": [{"role": "user", "content": "Name a colour."},
                              {"role": "assistant", "content": "Loud."}]},
    "alpaca": {"instruction": "Name a colour.", "input": "", "chosen": "Blue.", "rejected": "Loud."},
    "sharegpt": {"conversations": [{"from": "human", "value": "Name a colour."}],
                 "chosen": {"from": "gpt", "value": "Blue."}, "rejected": {"from": "gpt", "value": "Loud."}},
    "mapped": {"question": "Name a colour.", "good": "Blue.", "bad": "Loud."},
    "conversation_per_side": {"prompt": "Name a colour.",
                              "chosen": [{"role": "user", "content": "Name a colour."},
                                         {"role": "assistant", "content": "Blue."}],
                              "rejected": [{"role": "user", "content": "Name a colour."},
                                           {"role": "assistant", "content": "Loud."}]},
}


def test_every_preference_form_reads_as_the_same_pair(tmp_path, monkeypatch, tiny_chatml_model):
    """TRL's standard, conversational and implicit-prompt forms, alpaca and ShareGPT (LLaMA-Factory's
    ranking form) with chosen/rejected, and --columns: the same token rows, through the chat template,
    labels on the completion only (its text and the end of its turn)."""
    from transformers import AutoTokenizer

    from toolkit.config import parse_config
    from toolkit.data.prepare import prepare_data

    monkeypatch.setenv("TOOLKIT_CACHE", str(tmp_path / "cache"))
    tok = AutoTokenizer.from_pretrained(tiny_chatml_model)
    seen = {}
    for form, record in FORMS.items():
        path = write_pairs(tmp_path / f"{form}.jsonl", [record] * 3)
        extra = ["--columns", "prompt=question,chosen=good,rejected=bad"] if form == "mapped" else []
        cfg = parse_config(["--dataset", str(path), "--objective", "dpo", "--seq-len", "64", *extra])
        row = prepare_data(cfg.data_settings, tok).train[0]
        seen[form] = row
        for side, text in (("", "Blue."), ("rejected_", "Loud.")):
            ids, labels = row[f"{side}input_ids"], row[f"{side}labels"]
            assert tok.decode(ids).startswith("<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\n")
            assert tok.decode([t for t in labels if t != -100]) == text + "<|im_end|>"
    assert all(row == seen["pairs"] for row in seen.values())


@pytest.mark.parametrize("argv, data, says", [
    ([], "pairs", "holds preference pairs (prompt, chosen, rejected), which SFT would not train on as pairs; pass "
                  "--objective dpo"),
    (DPO, "sft", "--objective dpo trains on preference pairs, and --dataset"),
    (DPO, "kto", "unpaired preference data (prompt, completion, label) is KTO's form; pass --objective kto, or give"),
    ([], "kto", "unpaired preference data (prompt, completion, label) is KTO's form; pass --objective kto"),
    ([*DPO, "--simpo-gamma", "0.5"], "pairs", "--simpo-gamma applies to simpo, not dpo"),
    ([*DPO, "--train-on-prompt"], "pairs", "--objective dpo trains on the completions of the pairs"),
    ([*DPO, "--format", "alpaca"], "pairs", "pairs are read by their columns"),
    (["--objective", "orpo", "--label-smoothing", "0.1"], "pairs", "--label-smoothing applies to dpo and simpo"),
    ([*DPO, "--loss", "chunked"], "pairs", "--loss chunked computes only their summed loss: use --loss auto"),
    (["--objective", "orpo", "--packing"], "pairs", "--objective orpo does not run with --packing yet"),
    ([*DPO, "--cp", "2", "--packing"], "pairs", "--cp 2 with --packing does not run yet for --objective dpo"),
    (["--beta", "0.2"], "pairs", "--beta set a preference objective's loss; pass --objective dpo"),
    (["--objective", "kto", "--packing"], "kto", "--objective kto does not run with --packing yet"),
    ([*DPO, "--pp", "2", "--pp-devices", "cpu,cpu"], "pairs", "--objective dpo with --pp 2 runs one process per stage"),
    ([*DPO, "--pp", "2", "--packing"], "pairs", "--objective dpo does not run with --pp and --packing together"),
    ([*DPO, "--desirable-weight", "2"], "pairs", "--desirable-weight applies to kto, not dpo"),
    (["--objective", "kto", "--undesirable-weight", "0"], "kto", "--undesirable-weight must be > 0"),
    (["--objective", "kto"], "sft", "--objective kto trains on preference data, and --dataset"),
    (DPO, "empty", "d.jsonl: no training pair is left: 4 of 4 have an empty or whitespace-only 'chosen' "
                   "or 'rejected'; fill in"),
])
def test_preference_mistakes_are_one_line(tmp_path, tiny_model, argv, data, says, capsys):
    """Preference data never trains as SFT, SFT data never as pairs; what an objective cannot take is
    named before any model loads."""
    import finetune

    rows = {"pairs": string_pairs(4), "sft": [{"instruction": "a", "output": "b"}] * 4,
            "kto": [{"prompt": "a", "completion": "b", "label": True}] * 4,
            "empty": [{"prompt": "a", "chosen": "", "rejected": "b"}] * 4}[data]
    path = write_pairs(tmp_path / "d.jsonl", rows)
    with pytest.raises(SystemExit) as e:
        finetune.main(["--model", str(tiny_model), "--dataset", str(path), "--output-dir", str(tmp_path / "out"),
                       "--max-steps", "1", "--report-to", "none", *argv])
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("finetune.py: error:")]
    assert e.value.code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert says in lines[0]
    assert not (tmp_path / "out" / "final").exists()


def test_a_full_dpo_run_resumes_exactly_on_its_saved_reference(tmp_path, monkeypatch, tiny_model, pairs_file, capsys):
    """A full finetune's reference pass scores only the pairs the run's steps read (4 steps x 4 of the
    file's 48), is saved beside the run and cached: a resume reads it (its weights are trained: a new pass
    would move the reference) and continues the losses exactly; a resume that finds it nowhere stops in
    one line; a longer fresh run scores only the pairs the cache lacks. The final folder reloads (the
    run's integrity gate)."""
    import shutil

    import finetune
    from distributed import parity_args

    monkeypatch.setenv("TOOLKIT_CACHE", str(tmp_path / "cache"))
    first = tmp_path / "first"
    argv = [*parity_args(tiny_model, pairs_file, first, "full"), *DPO, "--save-every", "2", "--max-steps", "4",
            "--report-to", "none", "--verify", "load"]
    finetune.main(argv)
    said = capsys.readouterr().out
    assert ("reference: 16 of 48 train pairs' log-probabilities computed before step 1 (the model as loaded; the 16 "
            "the run's 4 steps read)") in said and "reloads with plain" in said
    whole = records(first)
    assert whole[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    summary = json.loads((first / "summary.json").read_text())
    assert summary["objective"] == "dpo"

    second = tmp_path / "second"
    second.mkdir()
    shutil.copy(first / "reference_logps.safetensors", second)
    monkeypatch.setenv("TOOLKIT_CACHE", str(tmp_path / "empty_cache"))
    finetune.main([*argv[:argv.index("--output-dir")], "--output-dir", str(second),
                   *argv[argv.index("--output-dir") + 2:], "--resume", str(first / "checkpoint-2")])
    said = capsys.readouterr().out
    assert f"read from {second / 'reference_logps.safetensors'}" in said
    assert [r["loss"] for r in records(second)] == pytest.approx([r["loss"] for r in whole[2:]], rel=1e-6)

    third = tmp_path / "third"
    monkeypatch.setenv("TOOLKIT_CACHE", str(tmp_path / "another_cache"))
    with pytest.raises(SystemExit):
        finetune.main([*argv[:argv.index("--output-dir")], "--output-dir", str(third),
                       *argv[argv.index("--output-dir") + 2:], "--resume", str(first / "checkpoint-2")])
    err = capsys.readouterr().err
    assert ("reference log-probabilities of 16 train pairs this run reads are in neither" in err
            and "Traceback" not in err)

    longer = tmp_path / "longer"
    monkeypatch.setenv("TOOLKIT_CACHE", str(tmp_path / "cache"))
    finetune.main([*argv[:argv.index("--output-dir")], "--output-dir", str(longer),
                   *argv[argv.index("--output-dir") + 2:], "--max-steps", "8", "--verify", "none"])
    said = capsys.readouterr().out
    assert "reference: 16 of 48 train pairs' log-probabilities computed before step 1 (the model as loaded; the 32 " \
           "the run's 8 steps read, 16 of them from the cache)" in said
    assert records(longer)[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)


def test_checkpointing_and_dropout_leave_dpo_as_it_was(runs):
    """LoRA DPO with --gradient-checkpointing (the reference's no-gradient forward inside it) and
    --lora-dropout 0.1, which a preference objective turns off as TRL does (or the policy would not be
    its reference at step 1): one process's losses, step 1 ln 2, and the run says it."""
    from distributed import run_stdout

    got, ref = records(runs("one", "lora", "dpo_gc_dropout")), records(runs("one", "lora", "dpo"))
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in ref], rel=1e-5)
    assert got[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert "dropout off in" in run_stdout(runs("one", "lora", "dpo_gc_dropout"))


@pytest.mark.parametrize("objective", ["dpo", "orpo"])
def test_held_out_pairs_are_scored_with_trls_metrics(runs, objective):
    """--eval-split under a preference objective: eval records carry the mean pair loss and TRL's
    metrics on held-out pairs (their reference computed before step 1 too): DPO's at step 0 is ln 2 with
    every reward 0 (accuracy 0: no pair's chosen reward exceeds its rejected's); ORPO's is its odds term
    plus the held-out chosen tokens' NLL."""
    evals = records(runs("one", "full", f"{objective}_eval"), "eval_loss")
    assert [r["step"] for r in evals] == [0, 5]
    for key in ("eval_rewards/accuracies", "eval_rewards/margins", "eval_logps/chosen", "eval_logps/rejected"):
        assert all(math.isfinite(r[key]) for r in evals)
    if objective == "dpo":
        assert evals[0]["eval_loss"] == pytest.approx(math.log(2), abs=1e-6)
        assert evals[0]["eval_rewards/accuracies"] == 0.0 and evals[0]["eval_rewards/margins"] == 0.0
    else:
        assert evals[0]["eval_loss"] > evals[0]["eval_logps/chosen"] * -1 > 0  # the NLL is in it
    assert evals[1]["eval_loss"] < evals[0]["eval_loss"]  # 5 steps on the training pairs help the held-out ones


def test_orpo_through_a_pipeline_trains_and_evaluates_as_one_process(runs):
    """ORPO under --pp 2 (a pair per pipeline micro-batch, the objective on the last stage from the
    target tensor it is handed: labels, and the chosen NLL's labels): one process's training losses and
    held-out records within 1e-4 (its eval from the pipeline's per-row log-probabilities)."""
    from distributed import assert_metric_close

    ref, got = records(runs("one", "full", "orpo_eval")), records(runs("pp", "full", "orpo_eval"))
    assert [r["step"] for r in got] == [r["step"] for r in ref] and len(ref) == 7  # 5 steps, 2 evals
    for key in ("loss", "eval_loss", "rewards/margins", "eval_rewards/margins", "eval_logps/chosen"):
        assert_metric_close(got, ref, key, rel=1e-4, abs=1e-6)


def test_held_out_kto_examples_are_scored_with_trls_metrics(runs):
    """KTO's eval records: the mean loss per held-out example (0.5 each, x 1.5 where desirable, at step 0:
    the policy is the reference) and TRL's metrics, its KL estimate from the held-out batches."""
    evals = records(runs("one", "lora", "kto_eval"), "eval_loss")
    assert [r["step"] for r in evals] == [0, 5]
    assert 0.5 < evals[0]["eval_loss"] < 0.75 and evals[0]["eval_kl"] == 0.0
    assert evals[0]["eval_rewards/chosen"] == evals[0]["eval_rewards/rejected"] == 0.0
    assert evals[1]["eval_kl"] > 0 and math.isfinite(evals[1]["eval_rewards/margins"])


def test_kto_reads_its_unpaired_form_and_splits_pairs(tmp_path, monkeypatch, tiny_chatml_model):
    """KTO's unpaired records (TRL's standard and conversational forms) and pairs (split into a
    desirable and an undesirable example, as TRL's unpair_preference_dataset: the chosen ones first, so
    no KL sequence is its own pair's): each completion through the chat template, labels on it only,
    and beside it the KL sequence: its own prompt with the previous example's completion (the first
    with the last's), labels on that completion."""
    from transformers import AutoTokenizer

    from toolkit.config import parse_config
    from toolkit.data.prepare import prepare_data

    monkeypatch.setenv("TOOLKIT_CACHE", str(tmp_path / "cache"))
    tok = AutoTokenizer.from_pretrained(tiny_chatml_model)
    forms = {"standard": [{"prompt": "Name a colour.", "completion": "Blue.", "label": True},
                          {"prompt": "Name a sound.", "completion": "Loud.", "label": False}],
             "conversational": [{"prompt": [{"role": "user", "content": p}],
                                 "completion": [{"role": "assistant", "content": c}], "label": g}
                                for p, c, g in (("Name a colour.", "Blue.", True), ("Name a sound.", "Loud.", False))],
             "pairs": [{"prompt": "Name a colour.", "chosen": "Blue.", "rejected": "Loud."},
                       {"prompt": "Name a sound.", "chosen": "Quiet.", "rejected": "Red."}]}
    expect = {"standard": [("Name a colour.", "Blue.", True, "Loud."), ("Name a sound.", "Loud.", False, "Blue.")],
              "pairs": [("Name a colour.", "Blue.", True, "Red."), ("Name a sound.", "Quiet.", True, "Blue."),
                        ("Name a colour.", "Loud.", False, "Quiet."), ("Name a sound.", "Red.", False, "Loud.")]}
    expect["conversational"] = expect["standard"]
    for form, examples in forms.items():
        cfg = parse_config(["--dataset", str(write_pairs(tmp_path / f"{form}.jsonl", examples)), "--objective", "kto",
                            "--seq-len", "64"])
        rows = prepare_data(cfg.data_settings, tok).train
        assert len(rows) == len(expect[form]), form
        for row, (prompt, completion, good, other) in zip(rows, expect[form]):
            head = f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"
            assert tok.decode(row["input_ids"]).startswith(head) and row["desirable"] is good, form
            assert tok.decode([t for t in row["labels"] if t != -100]) == completion + "<|im_end|>"
            assert tok.decode(row["kl_input_ids"]).startswith(head + other), form
            assert tok.decode([t for t in row["kl_labels"] if t != -100]) == other + "<|im_end|>"
    from toolkit.data.pairs import kto_balance  # the data line: the weights KTO's authors advise, where outside

    assert kto_balance([True, False], 1.0, 1.0) == "data: 1 desirable and 1 undesirable examples"
    assert kto_balance([True] * 3 + [False], 1.0, 1.0).endswith("is 3.00x the undesirable's, outside the 1 to 4/3 "
                                                               "KTO's authors advise: --desirable-weight 0.33 to 0.44 "
                                                               "would bring it in")


def test_sft_columns_beside_pairs_train_as_sft_and_a_conversation_per_side_reads_as_a_pair(tmp_path, monkeypatch,
                                                                                            tiny_chatml_model):
    """UltraFeedback-binarized's layout: `messages` beside `prompt`/`chosen`/`rejected`, where each side
    is the whole conversation. SFT trains its messages (as before this objective existed); DPO reads
    each side's shared turns as the prompt and its last turn as the completion."""
    from transformers import AutoTokenizer

    from toolkit.config import parse_config
    from toolkit.data.prepare import prepare_data

    monkeypatch.setenv("TOOLKIT_CACHE", str(tmp_path / "cache"))
    tok = AutoTokenizer.from_pretrained(tiny_chatml_model)
    user = {"role": "user", "content": "Name a colour."}
    record = {"prompt": "Name a colour.", "messages": [user, {"role": "assistant", "content": "Blue."}],
              "chosen": [user, {"role": "assistant", "content": "Blue."}],
              "rejected": [user, {"role": "assistant", "content": "Loud."}]}
    path = write_pairs(tmp_path / "uf.jsonl", [record] * 3)
    sft = prepare_data(parse_config(["--dataset", str(path), "--seq-len", "64"]).data_settings, tok)
    assert sft.format == "chat" and "rejected_input_ids" not in sft.train[0]
    dpo = prepare_data(parse_config(["--dataset", str(path), *DPO, "--seq-len", "64"]).data_settings, tok)
    row = dpo.train[0]
    assert tok.decode([t for t in row["labels"] if t != -100]) == "Blue.<|im_end|>"
    assert tok.decode([t for t in row["rejected_labels"] if t != -100]) == "Loud.<|im_end|>"


def test_plan_config_plans_a_pair_as_two_sequences(tmp_path, capsys):
    """`plan --config` reads `objective`: the DPO recipe's activations and logits are those of its SFT
    twin at twice the micro-batch."""
    from pathlib import Path

    import yaml

    from toolkit.cli.main import main as cli

    recipe = Path(__file__).resolve().parents[1] / "examples" / "dpo-dates-after-sft.yaml"
    raw = yaml.safe_load(recipe.read_text())

    def planned(**changes) -> dict:
        path = tmp_path / f"r{len(list(tmp_path.iterdir()))}.yaml"
        path.write_text(yaml.safe_dump({**raw, **changes}))
        cli(["plan", "--config", str(path), "--json", "--cpu-memory", "2TB"])
        return json.loads(capsys.readouterr().out)["asked"]["bytes"]

    dpo = planned()
    sft = planned(objective="sft", micro_batch_size=2 * raw["micro_batch_size"], loss="full")
    assert (dpo["activations"], dpo["logits"]) == (sft["activations"], sft["logits"])


@pytest.mark.parametrize("objective, method", [("dpo", "lora"), ("dpo", "full"), ("simpo", "lora")])
def test_packed_pairs_give_each_pairs_loss_as_padded_rows_do(tiny_model, pairs_file, tmp_path, monkeypatch, objective,
                                                              method):
    """--packing: pairs laid end to end as documents (chosen, rejected, ...) in packed rows give
    the summed pair loss, its gradients and metrics of the same pairs in padded rows, within 1e-5
    (the reference: adapters disabled, or each pair's precomputed log-probabilities carried along)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from toolkit.config import parse_config
    from toolkit.data import collate
    from toolkit.data.packing import PackedRows, collate_packed, model_inputs, pack_bins
    from toolkit.data.prepare import prepare_data
    from toolkit.data.tokenize import ensure_chat_template

    monkeypatch.setenv("TOOLKIT_CACHE", str(tmp_path / "cache"))
    tok = AutoTokenizer.from_pretrained(tiny_model)
    ensure_chat_template(tok)
    rows = prepare_data(parse_config(["--dataset", str(pairs_file), *DPO, "--seq-len", "64"]).data_settings, tok).train
    model = AutoModelForCausalLM.from_pretrained(tiny_model).float()
    if method == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
        reference = "adapters"
    else:
        torch.manual_seed(0)
        rows.reference = torch.randn(len(rows), 2) - 40.0
        reference = "precomputed" if objective == "dpo" else None
    perturb(model)
    packed = PackedRows(rows, pack_bins(rows.lengths, 256), rows.lengths)
    chosen = [k for k in range(len(packed)) if len(packed.bins[k]) > 1][:2]
    assert chosen, "some row packs several pairs"
    batch = collate_packed([packed[k] for k in chosen], 0)
    order = [i for k in chosen for i in packed.bins[k]]
    padded = collate([rows[i] for i in order], 0)
    assert batch["documents"] == 2 * len(order) and int(batch["pairs"]) == len(order)

    def run(b):
        model.zero_grad(set_to_none=True)
        loss = PreferenceLoss(objective, 0.5, reference=reference)
        total, _ = loss(model, b, model_inputs(b))
        total.backward()
        return total.detach(), loss.take_metrics(), grads(model)

    (a, ma, ga), (b, mb, gb) = run(batch), run(padded)
    torch.testing.assert_close(a, b, **TOL)
    torch.testing.assert_close(ma, mb, **TOL)
    for name in gb:
        torch.testing.assert_close(ga[name], gb[name], **TOL, msg=name)


def test_packed_dpo_trains_from_ln_2_and_matches_one_process_on_2_ranks(runs):
    """--packing under DPO: pairs packed into rows of 2 x --seq-len (their documents kept apart, the
    start-up packing check holding), step 1 ln 2 for LoRA and full (the precomputed reference carried
    through the packed rows), and 2 DDP ranks give one process's losses within 1e-4."""
    from distributed import run_stdout

    for method in ("lora", "full"):
        got = records(runs("one", method, "dpo_packed"))
        assert got[0]["loss"] == pytest.approx(math.log(2), abs=1e-6) and got[-1]["loss"] != got[0]["loss"]
    said = run_stdout(runs("one", "lora", "dpo_packed"))
    assert "packing: 48 pairs ->" in said and "rows of <= 96 tokens" in said
    ddp = records(runs("ddp", "lora", "dpo_packed"))
    assert [r["loss"] for r in ddp] == pytest.approx([r["loss"] for r in records(runs("one", "lora", "dpo_packed"))],
                                                     rel=1e-4)


def test_ktos_line_says_its_kl_is_clamped_at_0():
    """A `kl` of 0.0 is TRL's clamp of a negative estimate (or the policy still being the reference), not a
    missing term: the objective's line says so once (issue 57: 0.0 at all 15 steps of a LoRA run)."""
    line = PreferenceLoss("kto", 0.1, reference="adapters").describe()
    assert "clamped at 0 as TRL's (kl 0.0: the policy is the reference, or scores those completions below it)" in line


def test_dpo_straight_after_a_lora_sft_trains_its_adapter_on_from_ln_2(tmp_path, monkeypatch, chatml_dir, pairs_file,
                                                                       data_files, capsys):
    """Issue 57: `--objective dpo --model <SFT LoRA final/>` loads the base its adapter_config names and
    trains that adapter on (its rank, not --lora-r's); the reference is the SFT policy (the adapter on,
    its log-probabilities computed before step 1), so step 1 is ln 2. Both runs were given paths relative
    to their working directory, yet every adapter records its base absolute: final/ loads with plain peft
    from another one. --merge-adapter folds the adapter in first and trains a new one, and --method full
    the merged model, from ln 2 too."""
    import shutil

    import finetune
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("TOOLKIT_CACHE", str(tmp_path / "cache"))
    work = tmp_path / "work"
    shutil.copytree(chatml_dir, work / "base")
    monkeypatch.chdir(work)
    common = ["--seq-len", "64", "--micro-batch-size", "4", "--log-every", "1", "--warmup-steps", "0",
              "--mixed-precision", "no", "--lora-dropout", "0", "--seed", "7", "--report-to", "none"]
    finetune.main(["--model", "base", "--dataset", str(data_files["alpaca"]), "--output-dir", "sft", "--max-steps", "3",
                   "--lr", "1e-2", "--lora-r", "4", "--lora-alpha", "8", *common])
    finetune.main(["--model", "sft/final", *DPO, "--dataset", str(pairs_file), "--output-dir", "dpo", "--max-steps",
                   "2", "--lr", "1e-3", *common])
    said = capsys.readouterr().out
    assert f"model: sft/final is a LoRA adapter on {work / 'base'}: trained on as it is (its r 4, alpha 8" in said
    assert "reference: 8 of 48 train pairs' log-probabilities computed before step 1" in said  # 2 steps x 4
    got = records(work / "dpo")
    assert got[0]["loss"] == pytest.approx(math.log(2), abs=1e-6) and got[1]["loss"] != got[0]["loss"]
    sft, dpo = (load_file(work / run / "final" / "adapter_model.safetensors") for run in ("sft", "dpo"))
    assert sft.keys() == dpo.keys() and any(not torch.equal(sft[k], dpo[k]) for k in sft)  # the same adapter, on
    assert any(k.endswith("lora_B.weight") and sft[k].abs().max() > 0 for k in sft)  # SFT moved it off the base

    finetune.main(["--model", "sft/final", "--merge-adapter", *DPO, "--dataset", str(pairs_file), "--output-dir",
                   "merged-dpo", "--max-steps", "1", *common])
    merged = json.loads((work / "merged-dpo" / "final" / "adapter_config.json").read_text())
    assert f"model: sft/final merged into its base {work / 'base'} (--merge-adapter), in" in capsys.readouterr().out
    assert records(work / "merged-dpo")[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert merged["r"] == 16 and merged["base_model_name_or_path"].startswith(str(tmp_path / "cache" / "merged"))
    finetune.main(["--model", "sft/final", "--method", "full", *DPO, "--dataset", str(pairs_file), "--output-dir",
                   "full-dpo", "--max-steps", "1", *common])  # no adapter to train on: merged (the same folder)
    assert f"(--method full), in {merged['base_model_name_or_path']}" in capsys.readouterr().out
    assert records(work / "full-dpo")[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)

    monkeypatch.chdir(tmp_path)  # another working directory: each final/ names a base that loads from here
    ids = torch.tensor([[5, 6, 7, 8]])
    for run, base in (("sft", work / "base"), ("dpo", work / "base"), ("merged-dpo", None)):
        final = work / run / "final"
        recorded = json.loads((final / "adapter_config.json").read_text())["base_model_name_or_path"]
        assert Path(recorded).is_absolute() and (base is None or recorded == str(base)), (run, recorded)
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(recorded), str(final))
        assert torch.isfinite(model(input_ids=ids).logits).all()


def test_an_adapter_whose_base_is_gone_and_a_stray_merge_flag_are_one_line(tmp_path, tiny_model, pairs_file, capsys):
    """An adapter that recorded its base relative to another folder (as runs before issue 57 did) is named with
    the field it was read from, not as a --model the user never passed; --merge-adapter on a model, and a
    step checkpoint as --model, are refused in one line."""
    import finetune

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "runs/sft-merged",
                                                             "peft_type": "LORA"}))
    step = tmp_path / "checkpoint-2"  # a step checkpoint's adapter is in its sharded state/
    step.mkdir()
    (step / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(tiny_model)}))
    (step / "trainer_state.json").write_text(json.dumps({"step": 2}))
    cases = [(["--model", str(adapter)], f"--model {adapter} is a LoRA adapter on runs/sft-merged "
              "(adapter_config.json's base_model_name_or_path), which cannot be opened: runs/sft-merged: not a "
              "local folder"),
             (["--model", str(tiny_model), "--merge-adapter"],
              f"--merge-adapter: --model {tiny_model} is not a LoRA adapter folder (no adapter_config.json)"),
             (["--model", str(step)], f"--model {step} is a step checkpoint: write its adapter folder first with "
              f"`python -m toolkit convert-checkpoint {step} --output DIR`")]
    for argv, says in cases:
        with pytest.raises(SystemExit) as e:
            finetune.main([*argv, *DPO, "--dataset", str(pairs_file), "--output-dir", str(tmp_path / "out"),
                           "--max-steps", "1", "--report-to", "none"])
        err = capsys.readouterr().err
        lines = [x for x in err.splitlines() if x.startswith("finetune.py: error:")]
        assert e.value.code == 2 and len(lines) == 1 and says in lines[0] and "Traceback" not in err, err
        assert "--model runs/sft-merged" not in lines[0]
