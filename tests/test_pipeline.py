"""Pipeline parallelism: the stage split, the naive single-process pipeline and `--pp` runs on
torch.distributed.pipelining, each against the unsplit model (fp32, tolerance 1e-5).

Layouts under test: one process with p in {2, 3} stages on cpu; 2 ranks = pp 2 (GPipe, 1F1B);
4 ranks = pp 2 x dp 2 (stage 0 on ranks {0,1}, stage 1 on {2,3}). The models tie the embedding
and the LM head, so the tied weight lives on the first and the last stage.
"""

from __future__ import annotations

import contextlib
import itertools
import random

import pytest
import torch
from conftest import CHATML
from distributed import batched_runs, common_args, run_stdout
from helpers import build_model_dir, records

TOL = dict(atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def tied_model(tmp_path_factory):
    """4 blocks (so p = 3 is possible), tied embedding / LM head."""
    return build_model_dir(tmp_path_factory.mktemp("pp") / "model", chat_template=CHATML, num_hidden_layers=4,
                           tie_word_embeddings=True)


# ---------------------------------------------------------------- the split


def _brute_force(costs: list[float], p: int, first: float, last: float) -> float:
    """The smallest possible largest-stage cost over every contiguous split."""
    best = float("inf")
    for cuts in itertools.combinations(range(1, len(costs)), p - 1):
        bounds = (0, *cuts, len(costs))
        stage = [sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])]
        stage[0] += first
        stage[-1] += last
        best = min(best, max(stage))
    return best


def test_balance_is_optimal_on_random_costs():
    from toolkit.planner.stages import balance

    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 9)
        p = rng.randint(1, n)
        costs = [rng.choice([1.0, 2.0, 5.0, 13.0]) * rng.random() for _ in range(n)]
        first, last = rng.random() * 10, rng.random() * 10
        sizes = balance(costs, p, first, last)
        assert len(sizes) == p and sum(sizes) == n and min(sizes) >= 1
        bounds = [sum(sizes[:i]) for i in range(p + 1)]
        stage = [sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])]
        stage[0] += first
        stage[-1] += last
        assert max(stage) == pytest.approx(_brute_force(costs, p, first, last))


def test_uneven_model_split_is_within_one_block_of_optimal(tmp_path):
    """Blocks 1 and 2 get an MLP 8x wider: an even split by block count (2+2+2) would put both
    heavy blocks on one stage; the split by parameter count must match the brute-force optimum
    (so no boundary moved by one block could do better)."""
    from transformers import AutoModelForCausalLM

    from toolkit.parallel.pp.split import decoder_parts, param_costs
    from toolkit.planner.stages import balance

    path = build_model_dir(tmp_path / "m", num_hidden_layers=6)
    model = AutoModelForCausalLM.from_pretrained(path)
    for i in (1, 2):
        mlp = model.model.layers[i].mlp
        h, wide = mlp.gate_proj.in_features, mlp.gate_proj.out_features * 8
        mlp.gate_proj, mlp.up_proj = torch.nn.Linear(h, wide, bias=False), torch.nn.Linear(h, wide, bias=False)
        mlp.down_proj = torch.nn.Linear(wide, h, bias=False)
    blocks, first, last = param_costs(decoder_parts(model))
    assert len(set(blocks)) == 2  # uneven
    for p in (2, 3, 4):
        sizes = balance(blocks, p, first, last)
        bounds = [sum(sizes[:i]) for i in range(p + 1)]
        stage = [sum(blocks[a:b]) for a, b in zip(bounds, bounds[1:])]
        stage[0] += first
        stage[-1] += last
        assert max(stage) == _brute_force(blocks, p, first, last), (p, sizes)
    assert balance(blocks, 3, first, last)[0] <= 2  # the heavy blocks are not lumped with the embeddings


def test_a_model_without_a_pipeline_plan_is_one_line():
    """GPT-2's config declares no `base_model_pp_plan`: refused in one line, on the weightless skeleton
    too (`pipeline_problems`, before the weights load)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from toolkit.errors import UserError
    from toolkit.parallel.pp import pipeline_problems
    from toolkit.parallel.pp.split import decoder_parts

    config = GPT2Config(n_embd=16, n_layer=2, n_head=2, vocab_size=64)
    with pytest.raises(UserError, match=r"^--pp: GPT2LMHeadModel \(model type gpt2\) declares no base_model_pp_plan; "
                                        r"--pp needs it$"):
        decoder_parts(GPT2LMHeadModel(config))
    assert pipeline_problems(config) == ["--pp: GPT2LMHeadModel (model type gpt2) declares no base_model_pp_plan; "
                                         "--pp needs it"]


def test_router_load_balancing_loss_is_refused_under_pp():
    """The router loss is a product of means over every layer's router statistics, which no stage
    holds: refused before the weights load, naming the flag that turns it off; off, it runs."""
    from transformers import AutoConfig

    from toolkit.layout.rules import model_problems
    from toolkit.model.synthetic import ZOO

    for model_type in ("mixtral", "qwen3_moe", "gpt_oss"):
        config = AutoConfig.for_model(model_type, **ZOO[model_type]).to_dict()
        problems = model_problems(config, tp=1, pp=2, cp=1, world=2)
        assert len(problems) == 1 and problems[0].startswith(f"--pp 2: model type {model_type} adds a router "
                                                             "load-balancing loss (output_router_logits, "
                                                             "coefficient 0.5)"), problems
        assert "--router-aux-loss-coef 0" in problems[0]
        assert model_problems({**config, "router_aux_loss_coef": 0.0}, tp=1, pp=2, cp=1, world=2) == []
        assert model_problems({**config, "output_router_logits": False}, tp=1, pp=2, cp=1, world=1) == []


def test_problems_for_too_many_stages_and_a_bad_world(tied_model):
    from transformers import AutoConfig

    from toolkit.layout.rules import model_problems

    config = AutoConfig.from_pretrained(tied_model).to_dict()
    problems = model_problems(config, tp=1, pp=5, cp=1, world=3)
    assert problems == ["--pp 5: more stages than the model's 4 decoder blocks; use --pp 4 or fewer",
                        "--pp 5 across processes needs a world size that is a multiple of 5 (got 3); launch with "
                        "torchrun --nproc_per_node 5 (x data-parallel groups), or one process for the naive pipeline"]
    assert model_problems(config, tp=1, pp=2, cp=1, world=4) == []


def test_bubble_fraction():
    from toolkit.parallel.pp import bubble_fraction

    assert bubble_fraction(1, 8) == 0.0
    assert bubble_fraction(2, 1) == pytest.approx(0.5)
    assert bubble_fraction(4, 4) == pytest.approx(3 / 7)


# ---------------------------------------------------------------- the naive pipeline, in process


@contextlib.contextmanager
def _one_thread():
    """These models' tensors are tiny: torch's intra-op threads cost more than they save (6x the wall
    time of the naive pipeline's tests on 2 busy cores), as on the gloo ranks (`distributed._entry`)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _batches(vocab: int, pad_id: int, n: int = 3, batch: int = 4) -> list[dict[str, torch.Tensor]]:
    """Padded batches of random lengths with prompt tokens masked out of the labels."""
    from toolkit.data import collate

    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        rows = []
        for _ in range(batch):
            length = int(torch.randint(6, 30, (1,), generator=g))
            ids = torch.randint(5, vocab, (length,), generator=g).tolist()
            rows.append({"input_ids": ids, "labels": [-100] * 3 + ids[3:]})
        out.append(collate(rows, pad_id))
    return out


def _train(model_dir, method: str, stages: int, microbatches: int, gc: bool = False):
    """([loss, grad norm] of each of 3 AdamW steps, final trainable weights); unsplit when stages == 1."""
    with _one_thread():
        return _train_steps(model_dir, method, stages, microbatches, gc)


def _train_steps(model_dir, method: str, stages: int, microbatches: int, gc: bool):
    from transformers import AutoModelForCausalLM

    from toolkit.parallel.parallelize import apply_checkpointing
    from toolkit.parallel.pp import NaivePipeline
    from toolkit.data.labels import count_targets
    from toolkit.objectives.sft.loss import token_loss_sum

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if gc:
        apply_checkpointing(model)
    if method == "lora":
        from peft import LoraConfig, get_peft_model

        if gc:
            model.enable_input_require_grads()
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear"))
        g = torch.Generator().manual_seed(3)
        for n, p in model.named_parameters():  # B starts at zero: make it non-zero so A gets gradients at step 1
            if "lora_B" in n:
                torch.nn.init.normal_(p, std=0.02, generator=g)
    model.train()
    pipe = NaivePipeline(model, [torch.device("cpu")] * stages, microbatches) if stages > 1 else None
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3)
    losses = []
    for batch in _batches(model.config.vocab_size, model.config.pad_token_id):
        n = count_targets(batch["labels"]).item()
        if pipe is not None:
            loss = pipe.train_step(batch, scale=1.0 / n)
            norm = pipe.clip_grad_norm(1.0)
        else:
            loss = token_loss_sum(model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits,
                                  batch["labels"])
            (loss / n).backward()
            norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses += [loss.item() / n, norm.item()]
    return losses, {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("method", ["full", "lora"])
@pytest.mark.parametrize("stages, microbatches", [(2, 1), (2, 4), (3, 1), (3, 4)])
def test_naive_pipeline_matches_unsplit_model(tied_model, method, stages, microbatches):
    """Per-step losses, gradient norms and final weights equal the unsplit model's within 1e-5."""
    ref_losses, ref_weights = _train(tied_model, method, 1, 1)
    losses, weights = _train(tied_model, method, stages, microbatches)
    assert losses == pytest.approx(ref_losses, abs=1e-5, rel=1e-5)
    assert weights.keys() == ref_weights.keys()  # AdamW moves every weight with a gradient by ~lr = 1e-3 >> 1e-5
    for k in ref_weights:
        torch.testing.assert_close(weights[k], ref_weights[k], **TOL, msg=k)


def test_naive_pipeline_with_gradient_checkpointing_and_lora(tied_model):
    ref_losses, ref_weights = _train(tied_model, "lora", 1, 1)
    losses, weights = _train(tied_model, "lora", 2, 4, gc=True)
    assert losses == pytest.approx(ref_losses, abs=1e-5, rel=1e-5)
    for k in ref_weights:
        torch.testing.assert_close(weights[k], ref_weights[k], **TOL, msg=k)


def test_stage_modules_come_from_the_config():
    """transformers' `base_model_pp_plan` names the decoder's modules in forward order (GPT-NeoX: four,
    the dropout after the embedding among them) in the module the class's `base_model_prefix` names;
    a plan naming what the model lacks is one line."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    from toolkit.errors import UserError
    from toolkit.parallel.pp.split import decoder_parts
    from toolkit.model.synthetic import ZOO

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt_neox", **ZOO["gpt_neox"]))
    parts = decoder_parts(model)
    assert list(parts.before) == ["embed_in", "emb_dropout"] and parts.embed is model.gpt_neox.embed_in
    assert parts.blocks == "layers" and parts.layers == list(model.gpt_neox.layers)
    assert list(parts.after) == ["final_layer_norm"] and parts.head is model.lm_head
    assert parts.rotary is model.gpt_neox.rotary_emb
    model.config.base_model_pp_plan = {"embed_in": None, "layers": None, "ln_f": None}
    with pytest.raises(UserError, match=r"^--pp: cannot cut GPTNeoXForCausalLM \(model type gpt_neox\) into pipeline "
                                        r"stages by its base_model_pp_plan \(embed_in, layers, ln_f\): "
                                        r"gpt_neox.ln_f missing$"):
        decoder_parts(model)


def test_naive_pipeline_stages_hold_contiguous_blocks(tied_model):
    from transformers import AutoModelForCausalLM

    from toolkit.parallel.pp import NaivePipeline

    model = AutoModelForCausalLM.from_pretrained(tied_model)
    pipe = NaivePipeline(model, [torch.device("cpu")] * 3, 4)
    assert sum(pipe.sizes) == 4 and len(pipe.sizes) == 3
    assert pipe.stages[0].embed is model.model.embed_tokens and pipe.stages[0].head is None
    assert pipe.stages[-1].head is model.lm_head and list(pipe.stages[-1].after) == [model.model.norm]
    got = [layer for s in pipe.stages for layer in s.layers]
    assert got == list(model.model.layers)
    assert "3 stages" in pipe.describe() and "33.3%" in pipe.describe()


# ---------------------------------------------------------------- every architecture with a plan

# One process's reference and both pipelines train the zoo's tiny random models (toolkit.model.synthetic) for
# 3 AdamW steps: two padded batches and one packed batch (positions restart per document). gpt-oss's
# own forward builds its masks without the positions, so in one process its packed rows attend across
# documents; the stages mask per document: it trains the padded batches only. Its router loss, and
# Mixtral's and Qwen3-MoE's, is off (refused under --pp: test_router_load_balancing_loss_is_refused_under_pp).


@pytest.fixture(scope="module")
def zoo(tmp_path_factory) -> dict[str, tuple[str, list[dict], list[float]]]:
    """model type -> (model dir, batches, the model's own per-step losses in one process)."""
    from toolkit.model.synthetic import ZOO, build_zoo_model_dir

    out = {}
    with _one_thread():
        for model_type, config in ZOO.items():
            if model_type == "gpt2":  # no base_model_pp_plan: test_a_model_without_a_pipeline_plan_is_one_line
                continue
            off = {"output_router_logits": False} if config.get("output_router_logits") else {}
            path = build_zoo_model_dir(tmp_path_factory.mktemp("zoo") / model_type, model_type, **off)
            model = _load(path)
            batches = _zoo_batches(model.config, packed=model_type != "gpt_oss")
            out[model_type] = (str(path), batches, _own_losses(model, batches))
    return out


def _load(path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").train()


def _zoo_batches(config, packed: bool) -> list[dict[str, torch.Tensor]]:
    """Two padded batches of 4 rows (6-29 tokens: longer than the zoo's 16-token sliding windows) and
    a packed one of 2 rows."""
    from toolkit.data.packing import collate_packed, pack_rows

    batches = _batches(config.vocab_size, config.pad_token_id, n=2)
    if packed:
        g = torch.Generator().manual_seed(2)
        rows = []
        for length in (23, 16, 6, 17):
            ids = torch.randint(5, config.vocab_size, (length,), generator=g).tolist()
            rows.append({"input_ids": ids, "labels": [-100] * 3 + ids[3:]})
        batches.append(collate_packed(pack_rows(rows, 40), config.pad_token_id))
    return batches


def _own_losses(model, batches) -> list[float]:
    """The model's own loss (`model(..., labels=)`, the mean over target tokens) at each AdamW step."""
    from toolkit.data.packing import model_inputs

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for batch in batches:
        loss = model(**model_inputs(batch), labels=batch["labels"]).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _pipeline_losses(pipe, params, batches) -> list[float]:
    from toolkit.data.labels import count_targets

    opt = torch.optim.AdamW(params, lr=1e-3)
    losses = []
    for batch in batches:
        n = count_targets(batch["labels"]).item()
        losses.append(pipe.train_step(batch, scale=1.0 / n).item() / n)
        pipe.finish_grads()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses


def test_naive_pipeline_trains_the_models_own_loss_on_every_architecture(zoo):
    """2 stages x 2 micro-batches in one process: per-step losses equal the model's own within 1e-5
    (embedding transforms, per-layer-type masks and rotary, the head's logit transform), and the
    loss check on the last stage equals the model's own head on the same hidden states (5e-6); the
    check catches a last stage that drops Cohere's logit_scale (the bug --pp 2 had)."""
    from toolkit.objectives.sft.loss import LogitTransform
    from toolkit.parallel.pp import NaivePipeline

    with _one_thread():
        for model_type, (path, batches, want) in zoo.items():
            model = _load(path)
            pipe = NaivePipeline(model, [torch.device("cpu")] * 2, 2)
            ours, own = pipe.loss_check({k: v[:2] for k, v in batches[0].items()})
            assert ours == pytest.approx(own, rel=5e-6), model_type
            if model_type == "cohere":
                pipe.stages[-1].parts.transform = LogitTransform()  # the model's logit_scale left out
                wrong, own = pipe.loss_check({k: v[:2] for k, v in batches[0].items()})
                # 10x the start-up check's fp32 bound (toolkit.train.numerics.FP32_RTOL)
                assert abs(wrong - own) > 1e-3 * own
                pipe.stages[-1].parts.transform = LogitTransform.of(model)
            got = _pipeline_losses(pipe, [p for p in model.parameters() if p.requires_grad], batches)
            assert got == pytest.approx(want, abs=1e-5, rel=1e-5), model_type


def _stage_runs(zoo: dict) -> dict[str, tuple[list[float], tuple[float, float] | None]]:
    """On each of 2 gloo ranks, per model type: (per-step losses, the loss check) of its pp 2 stage
    under 1F1B with 2 micro-batches."""
    import torch.distributed as dist

    from toolkit.parallel.pp import StagePipeline, make_pipeline_layout

    dist.init_process_group("gloo")
    try:
        layout = make_pipeline_layout(2)
        out = {}
        for model_type, (path, batches, _) in zoo.items():
            model = _load(path)
            pipe = StagePipeline(model, layout, [1, 1], 2, "1f1b", torch.device("cpu"), model.config.pad_token_id)
            check = pipe.loss_check({k: v[:2] for k, v in batches[0].items()})
            out[model_type] = (_pipeline_losses(pipe, list(pipe.parameters()), batches), check)
        return out
    finally:
        dist.destroy_process_group()


def test_stage_pipeline_trains_the_models_own_loss_on_every_architecture(zoo):
    """--pp 2 across 2 processes (torch.distributed.pipelining, one stage per rank), every zoo
    architecture with a plan in one launch: per-step losses equal the model's own within 1e-5 on both
    ranks; the loss check is the last stage's (None on stage 0) and equals the model's own head."""
    from distributed import run_distributed

    first, last = run_distributed(_stage_runs, 2, zoo)
    for model_type, (_, _, want) in zoo.items():
        assert first[model_type][0] == pytest.approx(want, abs=1e-5, rel=1e-5), model_type
        assert last[model_type][0] == first[model_type][0]
        assert first[model_type][1] is None
        ours, own = last[model_type][1]
        assert ours == pytest.approx(own, rel=5e-6), model_type


# ---------------------------------------------------------------- finetune.py --pp


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tied_model, data_files):
    """(layout, method) -> output dir. Global batch 4 everywhere: 1 x mb 4 (pp split into 2 or 4
    micro-batches); pp2 x dp2 x mb 2."""
    layouts = {"single": (1, ["--micro-batch-size", "4"]),
               "naive2_time": (1, ["--micro-batch-size", "4", "--pp", "2", "--pp-microbatches", "2",
                                   "--pp-balance", "time"]),
               "gpipe2": (2, ["--micro-batch-size", "4", "--pp", "2", "--pp-microbatches", "2"]),
               "1f1b2": (2, ["--micro-batch-size", "4", "--pp", "2", "--pp-microbatches", "4",
                             "--pp-schedule", "1f1b"]),
               "pp2_dp2": (4, ["--micro-batch-size", "2", "--pp", "2", "--pp-microbatches", "2"])}
    used = [("single", "full"), ("single", "lora"), ("naive2_time", "full"), ("gpipe2", "full"), ("1f1b2", "full"),
            ("1f1b2", "lora"), ("pp2_dp2", "full")]
    get = batched_runs(tmp_path_factory, common_args(tied_model, data_files["chat"]),
                       {(lay, m): (layouts[lay][0], ["--method", m, *layouts[lay][1]]) for lay, m in used})

    def run(layout, method):
        out = get(layout, method)
        return out, run_stdout(out)

    return run


@pytest.mark.parametrize("layout, method", [("naive2_time", "full"), ("gpipe2", "full"), ("1f1b2", "full"),
                                            ("1f1b2", "lora"), ("pp2_dp2", "full")])
def test_pp_losses_and_saved_weights_match_single_process(runs, layout, method):
    from safetensors.torch import load_file

    ref_out, _ = runs("single", method)
    out, stdout = runs(layout, method)
    ref = [r[k] for r in records(ref_out) for k in ("loss", "grad_norm")]
    got = [r[k] for r in records(out) for k in ("loss", "grad_norm")]
    assert len(got) == 10 and got == pytest.approx(ref, abs=1e-5, rel=1e-5), f"{layout}/{method}: {got} vs {ref}"
    name = "model.safetensors" if method == "full" else "adapter_model.safetensors"
    ref_w, got_w = load_file(ref_out / "final" / name), load_file(out / "final" / name)
    assert got_w.keys() == ref_w.keys() and len(ref_w) > 0
    for k in ref_w:
        torch.testing.assert_close(got_w[k], ref_w[k], **TOL, msg=k)
    assert "pipeline: 2 stages" in stdout and "expected bubble" in stdout


@pytest.mark.parametrize("layout, method", [("gpipe2", "full"), ("1f1b2", "lora")])
def test_planner_pp_row_matches_measured_bytes(runs, tied_model, layout, method):
    """The planner's pp2 row (the runtime's split, heaviest stage) against the largest per-rank
    bytes measured at step 1: weights (the tied embedding on both ends), gradients, Adam states, 5%."""
    import json

    from toolkit.layout.dims import ParallelDims
    from toolkit.planner.estimate import PlanInput, estimate_layout

    cfg = json.loads((tied_model / "config.json").read_text())
    inp = PlanInput(model=cfg, gpu_memory=2**40, gpus_per_node=2, method=method, lora_r=16, seq_len=64,
                    micro_batch=4, precision="no")
    row = estimate_layout(inp, ParallelDims(2, pp=2), False, 4)
    measured = records(runs(layout, method)[0])[0]
    assert max(measured["param_bytes"]) == pytest.approx(row.bytes["weights"], rel=0.05)
    assert max(measured["grad_bytes"]) == pytest.approx(row.bytes["grads"], rel=0.05)
    assert max(measured["optim_bytes"]) == pytest.approx(row.bytes["optimizer"], rel=0.05)
