"""`Strategy.generating` (what `--objective grpo` samples from, issue 65) on the layouts that may sample: on 2
gloo ranks, DDP, ZeRO-2, ZeRO-3, FSDP2 and TP 2 each sample one process's completions for the same seeds
(`toolkit.objectives.grpo.sampling.completion_seed`); ZeRO-3 and FSDP2 all-gather their parameters when `generating`
begins and never while it decodes (the collectives counted from the profiler), where the same sampling outside it
gathers at every token; and the two training steps after a generation give exactly the losses of the same layout
without one, with as many all-gathers. --pp and --cp are refused before anything loads."""

from __future__ import annotations

import os

import pytest
import torch
from distributed import run_distributed

LAYOUTS = {"ddp": [], "zero2": ["--zero-stage", "2"], "zero3": ["--zero-stage", "3"], "fsdp": ["--fsdp"],
           "tp2": ["--tp", "2"]}
SHARDED = ("zero3", "fsdp")
PROMPTS = 4  # one process samples them all; each data-parallel rank its share
NEW_TOKENS = 6


def _config(model: str, data: str, out: str, flags: list[str]):
    from toolkit.config import parse_config

    return parse_config(["--model", model, "--dataset", data, "--output-dir", out, "--method", "full", "--seq-len",
                         "64", "--micro-batch-size", "2", "--mixed-precision", "no", "--seed", "7", *flags])


def _reset(launched: dict) -> None:
    """accelerate's and transformers' process-wide state and the environment as a fresh run finds them (the
    process group stays, as in tests/layouts.py: a DeepSpeed plugin writes ACCELERATE_* into the environment)."""
    from accelerate.state import AcceleratorState, GradientState, PartialState
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    os.environ.clear()
    os.environ.update(launched)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()
    unset_hf_deepspeed_config()


def _sample(module, prompts: list[tuple[int, list[int]]], any_unfinished) -> dict[int, list[int]]:
    """Each prompt's completion, seeded by its index; no token ends one (EOS -1), so every rank runs
    NEW_TOKENS forwards."""
    from toolkit.objectives.grpo.sampling import SamplingConfig, completion_seed, sample

    seeds = [completion_seed(7, 1, i, 0) for i, _ in prompts]
    out = sample(module, [p for _, p in prompts], seeds, SamplingConfig(NEW_TOKENS), [-1], 0, any_unfinished)
    return {i: row for (i, _), row in zip(prompts, out.token_lists())}


def _all_gathers(events, within=None) -> int:
    """The all-gather collectives among the profiler's `events` (`within`: inside that event's time only)."""
    inside = (lambda e: within.time_range.start <= e.time_range.start <= within.time_range.end) if within else bool
    return sum(1 for e in events if e.name.startswith("c10d::") and "allgather" in e.name and inside(e))


def _layouts(model: str, data: str, scratch: str) -> dict:
    import torch.distributed as dist
    from functools import partial

    from toolkit.data import load_examples, tokenize_examples
    from toolkit.data.tokenize import ensure_chat_template
    from toolkit.model.load import load_model, load_tokenizer
    from toolkit.parallel.build import make_accelerator, make_strategy
    from toolkit.objectives.grpo.sampling import any_unfinished_here
    from toolkit.data.loader import make_loader
    from toolkit.train.loop import make_optimizer
    from toolkit.train.step import batch_counts

    def anyone(unfinished: torch.Tensor) -> bool:  # sharded forwards are collective: every rank runs as many
        flag = torch.tensor([float(unfinished.any())])
        dist.all_reduce(flag)
        return bool(flag.item())

    launched = dict(os.environ)
    cfg = _config(model, data, scratch, [])
    tok = load_tokenizer(model)
    ensure_chat_template(tok)
    rows, _ = tokenize_examples(load_examples(cfg.data_settings).train[:8], tok, cfg.data_settings)
    prompts = [(i, [int(t) for t in rows[i]["input_ids"][:12]]) for i in range(PROMPTS)]
    out: dict = {"one": _sample(load_model(cfg, model), prompts, any_unfinished_here)}  # one process's model
    for name, flags in LAYOUTS.items():
        for generate in (False, True):
            _reset(launched)
            cfg = _config(model, data, f"{scratch}/{name}", flags)
            accelerator = make_accelerator(cfg, model)
            strategy = make_strategy(cfg, accelerator, model)
            m = strategy.shard_model(load_model(cfg, model))
            loader = make_loader(rows, cfg, tok.pad_token_id, whole=strategy.whole_batches)
            m, optimizer, loader = strategy.prepare(m, partial(make_optimizer, cfg=cfg), loader)
            mine = prompts[strategy.data.rank::strategy.data.ranks]  # TP peers: the same prompts
            if generate:
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                    with strategy.generating(m) as module:
                        with torch.profiler.record_function("decode"):
                            tokens = _sample(module, mine, anyone)
                decode = next(e for e in prof.events() if e.name == "decode")
                out[name, "tokens"] = tokens
                out[name, "gathers"] = (_all_gathers(prof.events()), _all_gathers(prof.events(), decode))
            losses, gathers, batches = [], [], iter(loader)
            for _ in range(2):
                batch = next(batches)
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                    counts = (accelerator.reduce(batch_counts([batch], accelerator.device), "sum")
                              / strategy.data.replicas)
                    loss = strategy.forward_backward(m, [batch], scale=1 / counts[0])
                    strategy.clip_grad_norm(m, 1.0)
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                gathers.append(_all_gathers(prof.events()))
                losses.append((accelerator.reduce(loss, "sum") / strategy.data.replicas / counts[0]).item())
            out[name, generate] = (losses, gathers)
            if generate:  # the same sampling outside `generating`: the forwards gather as training's do
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                    with torch.no_grad(), torch.compiler.set_stance("force_eager"):
                        _sample(strategy.unwrap(m), mine, anyone)
                out[name, "outside"] = _all_gathers(prof.events())
    dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def generated(tmp_path_factory, tiny_model, data_files) -> list[dict]:
    """Every layout, with and without a generation before its first two steps, in one 2-rank launch."""
    return run_distributed(_layouts, 2, str(tiny_model), str(data_files["chat"]),
                           str(tmp_path_factory.mktemp("generating")), timeout=900)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_layout_samples_the_tokens_one_process_samples(generated, name):
    """Seeded per prompt, each completion is one process's token for token (fp32: exact), whichever rank
    sampled it; TP peers, which hold the same prompts, sample the same."""
    want = generated[0]["one"]
    for rank in generated:
        got = rank[name, "tokens"]
        assert got and all(len(t) == NEW_TOKENS for t in got.values())
        assert got == {i: want[i] for i in got}, name
    assert set().union(*(rank[name, "tokens"] for rank in generated)) == set(want)


@pytest.mark.parametrize("name", SHARDED)
def test_sharded_parameters_are_gathered_once_per_generation_not_per_token(generated, name):
    """ZeRO-3 and FSDP2: the all-gathers of a generation all come as it begins, none while its NEW_TOKENS
    forwards decode; the same sampling outside `generating` gathers again in every one of them."""
    for rank in generated:
        total, decoding = rank[name, "gathers"]
        assert total > 0 and decoding == 0, (name, total, decoding)
        assert rank[name, "outside"] >= NEW_TOKENS, (name, rank[name, "outside"])


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_training_after_a_generation_is_unchanged(generated, name):
    """After `generating` the layout trains as it would have: the same two losses, exactly, and as many
    all-gathers a step (ZeRO-3's hooks back, FSDP2's units resharded and resharding after forward again)."""
    for rank in generated:
        assert rank[name, True] == rank[name, False], name


@pytest.mark.parametrize("flags", [["--pp", "2"], ["--cp", "2"], ["--pp", "2", "--cp", "2"]])
def test_an_objective_that_generates_is_refused_under_pp_and_cp(flags):
    """Keyed on `objective_spec.generates`, said by config validation before anything loads."""
    from toolkit.layout.flags import ParallelConfig
    from toolkit.layout.rules import layout_problems

    par = ParallelConfig(pp=int(flags[flags.index("--pp") + 1]) if "--pp" in flags else 1,
                         cp=int(flags[flags.index("--cp") + 1]) if "--cp" in flags else 1)
    said = [p for p in layout_problems(par, "full", "no", "auto", 2, sampling="grpo") if "grpo" in p]
    off = " and ".join(f"{f} {v}" for f, v in zip(flags[::2], flags[1::2]))
    assert said == ["--objective grpo does not run under --pp / --cp yet: it samples completions token by token from "
                    f"the whole model, which pipeline stages and context-parallel slices do not hold; drop {off}"]
    assert not [p for p in layout_problems(par, "full", "no", "auto", 2) if "samples" in p]


def test_an_objective_that_generates_is_refused_under_expert_parallel():
    from toolkit.layout.flags import ParallelConfig
    from toolkit.layout.rules import generation_problems

    said = generation_problems(ParallelConfig(ep=2, dp_shard=2), "grpo")
    assert said == ["--objective grpo does not run under --ep 2 yet: sampling with the experts split over ranks is "
                    "not tested against one process; drop --ep (each rank then holds every expert)"]
    assert not generation_problems(ParallelConfig(ep=2, dp_shard=2), None)
