"""GRPO's sampler (`toolkit.objectives.grpo.sampling`): a completion depends only on its seed; the cached decode
draws what one full forward gives (the KV cache reaches the model under the name its forward takes: transformers
5.4, the floor, ignores `cache=`); the completion log-probabilities are the full log-softmax's; the warpers are
`generate`'s; the static compiled path draws the dynamic path's tokens. No TRL needed: CI runs this file at the
dependency floors too."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from toolkit.objectives.grpo import sampling as sm


# --- sampling
@pytest.fixture(scope="module", params=["llama", "gpt2"])
def tiny(request, tmp_path_factory):
    """Llama (RoPE: an offset of every position changes nothing) and GPT-2 (learned absolute positions: a
    prompt's positions must start at 0 whatever its left padding)."""
    from transformers import AutoModelForCausalLM

    from toolkit.model.synthetic import build_zoo_model_dir

    path = build_zoo_model_dir(tmp_path_factory.mktemp("grpo") / request.param, request.param)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


PROMPTS = [[3, 17, 90, 41], [8], [200, 12, 77, 5, 60, 61, 62, 9, 10], [55, 56]]
CFG = sm.SamplingConfig(max_completion_length=12, temperature=0.8, top_k=40, top_p=0.9)
EOS = list(range(20, 384, 20))  # 19 EOS ids: two of the four rows stop early


def seeds_for(prompt_indices, generation=0):
    return [sm.completion_seed(7, 3, p, generation) for p in prompt_indices]


def test_a_completion_depends_only_on_its_seed_not_on_its_batch(tiny):
    together = sm.sample(tiny, PROMPTS, seeds_for(range(4)), CFG, EOS, pad_id=0)
    assert together.truncated.tolist().count(True) not in (0, 4)  # some stopped at an EOS, some ran to the end
    reordered = sm.sample(tiny, [PROMPTS[2], PROMPTS[0]], seeds_for([2, 0]), CFG, EOS, pad_id=0)
    for i, prompt in enumerate(PROMPTS):
        alone = sm.sample(tiny, [prompt], seeds_for([i]), CFG, EOS, pad_id=0)
        n = int(alone.mask.sum())
        assert together.token_lists()[i] == alone.token_lists()[0], i
        assert together.truncated[i] == alone.truncated[0]
        assert together.mask[i].tolist() == [1] * n + [0] * (together.mask.shape[1] - n)
        assert (together.ids[i, n:] == 0).all()
        ended = together.token_lists()[i][-1] in EOS
        assert ended != bool(together.truncated[i]) and (ended or n == CFG.max_completion_length)
    assert reordered.token_lists() == [together.token_lists()[2], together.token_lists()[0]]
    other = sm.sample(tiny, PROMPTS[:1], seeds_for([0], generation=1), CFG, EOS, pad_id=0)
    assert other.token_lists()[0] != together.token_lists()[0]  # another generation, another stream


def test_the_cached_decode_draws_what_one_full_forward_gives(tiny):
    """Each sampled token is the inverse CDF, at its uniform, of the distribution a plain forward over the
    prompt and the tokens so far gives (no cache, left-padded batch): the cache, positions and masks are right."""
    out = sm.sample(tiny, PROMPTS, seeds_for(range(4)), CFG, [], pad_id=0)  # no EOS: every row runs to the end
    prompt_ids, prompt_mask = sm.left_pad(PROMPTS, 0)
    ids = torch.cat([prompt_ids, out.ids], 1)
    mask = torch.cat([prompt_mask, out.mask], 1)
    with torch.no_grad():
        logits = tiny(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    steps = out.ids.shape[1]
    scores = logits[:, prompt_ids.shape[1] - 1:-1].float()  # (B, L, V): the distribution of each completion token
    u = sm.uniforms(seeds_for(range(4)), CFG.max_completion_length)
    warp = sm.logits_warpers(CFG)
    redrawn = torch.stack([sm.inverse_cdf(torch.softmax(warp(ids, scores[:, t]), -1), u[:, t])
                           for t in range(steps)], 1)
    assert torch.equal(redrawn, out.ids)


def test_a_models_completion_log_probabilities_are_its_full_log_softmax(tiny):
    """`completion_logps` (the logits of the completion positions only, chunked) on left-padded prompts and
    right-padded completions: each token's log-probability and entropy as one full forward's log-softmax gives
    them, and the same gradients; without gradients, no graph."""
    from toolkit.objectives.grpo.loss import completion_logps
    from toolkit.objectives.grpo.rollout import collate_rollout

    out = sm.sample(tiny, PROMPTS, seeds_for(range(4)), CFG, EOS, pad_id=0)
    batch = collate_rollout(PROMPTS, out.ids, out.mask, 0, "cpu")
    width = batch["completion_ids"].shape[1]
    weights = torch.randn(out.ids.shape, generator=torch.Generator().manual_seed(1)) * out.mask

    def gradients(logps):
        tiny.zero_grad(set_to_none=True)
        (logps * weights).sum().backward()
        return {n: p.grad.clone() for n, p in tiny.named_parameters() if p.grad is not None}

    logits = tiny(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                  position_ids=batch["positions"]).logits[:, -width - 1:-1].float() / CFG.temperature
    full = torch.log_softmax(logits, -1)
    want = full.gather(-1, batch["completion_ids"].unsqueeze(-1)).squeeze(-1)
    want_entropy = -(full.exp() * full).sum(-1).detach()
    want_grads = gradients(want)
    got, entropies = completion_logps(tiny, batch, CFG.temperature, entropy=True)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-6)
    torch.testing.assert_close(entropies, want_entropy, atol=2e-6, rtol=1e-6)
    got_grads = gradients(got)
    assert got_grads.keys() == want_grads.keys()
    # fp32 sums in another order: at the floors (torch 2.11) one of GPT-2's position embedding gradients is 1.9e-6 off
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, atol=2e-6, rtol=1e-5, msg=lambda m: f"{name}: {m}")
    with torch.no_grad():
        assert not completion_logps(tiny, batch, CFG.temperature)[0].requires_grad


def test_the_warpers_are_those_generate_applies(tiny):
    from transformers import GenerationConfig

    scores = torch.randn(3, 384, generator=torch.Generator().manual_seed(0))
    for cfg in [CFG, sm.SamplingConfig(temperature=1.3, top_p=0.5), sm.SamplingConfig(top_k=5, min_p=0.05),
                sm.SamplingConfig()]:
        theirs = tiny._get_logits_processor(GenerationConfig(do_sample=True, temperature=cfg.temperature,
                                                             top_k=cfg.top_k, top_p=cfg.top_p, min_p=cfg.min_p))
        torch.testing.assert_close(sm.logits_warpers(cfg)(None, scores.clone()), theirs(None, scores.clone()))
        assert [type(w).__name__ for w in sm.logits_warpers(cfg)] == [type(w).__name__ for w in theirs]


def test_inverse_cdf_draws_each_token_in_proportion_and_never_a_filtered_one():
    probs = torch.tensor([[0.1, 0.0, 0.6, 0.3, 0.0]])
    k = 10_000
    u = (torch.arange(k, dtype=torch.float64) + 0.5) / k
    drawn = sm.inverse_cdf(probs.expand(k, -1), u)
    counts = torch.bincount(drawn, minlength=5)
    assert counts.tolist() == [1000, 0, 6000, 3000, 0]
    assert sm.inverse_cdf(probs, torch.tensor([1 - 1e-17])).item() == 3


def test_sampling_runs_without_dropout_and_restores_each_modules_mode(tmp_path):
    from helpers import build_model_dir
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    path = build_model_dir(tmp_path / "model", attention_dropout=0.5)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    evaluated = sm.sample(model, PROMPTS, seeds_for(range(4)), CFG, EOS, pad_id=0)
    model.train()
    model.model.layers[0].eval()  # a module the caller keeps in eval mode stays so
    trained = sm.sample(model, PROMPTS, seeds_for(range(4)), CFG, EOS, pad_id=0)
    assert trained.token_lists() == evaluated.token_lists()
    assert model.training and model.model.layers[1].training and not model.model.layers[0].training

    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))  # B = 0: the base
    assert sm.sample(peft, PROMPTS, seeds_for(range(4)), CFG, EOS, pad_id=0).token_lists() == evaluated.token_lists()
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 1.0, generator=torch.Generator().manual_seed(1))
    assert sm.sample(peft, PROMPTS, seeds_for(range(4)), CFG, EOS, pad_id=0).token_lists() != evaluated.token_lists()


# --- the static decode path (a StaticCache and a compiled step: CUDA's default)
def test_the_static_compiled_path_draws_the_dynamic_paths_tokens(tiny):
    """Prompts of 1 to 9 tokens, rows that end at an EOS and rows that run to the end: the static path (its step
    compiled with aot_eager: dynamo and AOTAutograd, the graph inductor would get) gives the dynamic path's
    completions exactly, in a batch and alone (another batch size: a recompile); the held cache is reused."""
    from torch._dynamo.utils import counters

    decoder = sm.StaticDecoder("aot_eager", "cpu")
    compiled = counters["stats"]["unique_graphs"]
    dynamic = sm.sample(tiny, PROMPTS, seeds_for(range(4)), CFG, EOS, pad_id=0)
    static = sm.sample(tiny, PROMPTS, seeds_for(range(4)), CFG, EOS, pad_id=0, decoder=decoder)
    assert decoder.failed is None and counters["stats"]["unique_graphs"] > compiled  # compiled, and it ran
    assert static.truncated.tolist().count(True) not in (0, 4)
    for got in (static, sm.sample(tiny, PROMPTS, seeds_for(range(4)), CFG, EOS, pad_id=0, decoder=decoder)):
        assert torch.equal(got.ids, dynamic.ids) and torch.equal(got.mask, dynamic.mask)
        assert torch.equal(got.truncated, dynamic.truncated)
    held = decoder.caches[4][1]
    alone = sm.sample(tiny, PROMPTS[2:3], seeds_for([2]), CFG, EOS, pad_id=0, decoder=decoder)
    assert decoder.failed is None and alone.token_lists() == [dynamic.token_lists()[2]]
    assert decoder.caches[4][1] is held and set(decoder.caches) == {1, 4}


def test_the_static_cache_grows_in_buckets_and_is_kept(tiny):
    """Uncompiled (the cache alone): a prompt + completion past one bucket takes the next multiple of 128, later
    shorter batches reuse it; the tokens stay the dynamic path's; a reserved length sizes the first cache."""
    decoder = sm.StaticDecoder(None, "cpu")
    cfg = sm.SamplingConfig(max_completion_length=8, temperature=0.8)
    long_prompt = [(7 * i) % 300 + 10 for i in range(125)]  # 125 + 8 > 128
    short = sm.sample(tiny, PROMPTS[:2], seeds_for([0, 1]), cfg, [], pad_id=0, decoder=decoder)
    assert decoder.caches[2][0] == 128
    longer = sm.sample(tiny, [long_prompt, PROMPTS[1]], seeds_for([5, 1]), cfg, [], pad_id=0, decoder=decoder)
    size, held = decoder.caches[2]
    assert size == 256
    again = sm.sample(tiny, PROMPTS[:2], seeds_for([0, 1]), cfg, [], pad_id=0, decoder=decoder)
    assert decoder.caches[2] == (256, held)
    assert again.token_lists() == short.token_lists() == sm.sample(tiny, PROMPTS[:2], seeds_for([0, 1]), cfg, [],
                                                                    pad_id=0).token_lists()
    assert longer.token_lists() == sm.sample(tiny, [long_prompt, PROMPTS[1]], seeds_for([5, 1]), cfg, [],
                                             pad_id=0).token_lists()
    reserved = sm.StaticDecoder(None, "cpu")
    reserved.reserve = 300  # a run's longest prompt + completion: every cache that long from the start
    sm.sample(tiny, PROMPTS[:2], seeds_for([0, 1]), cfg, [], pad_id=0, decoder=reserved)
    assert reserved.caches[2][0] == 384


def test_a_failing_compiled_step_says_so_once_and_the_dynamic_path_samples(tiny, capsys):
    decoder = sm.StaticDecoder(None, "cpu")

    def broken(*args, **kwargs):
        raise RuntimeError("no compiler here\nmore detail")

    decoder.step = broken
    got = [sm.sample(tiny, PROMPTS, seeds_for(range(4)), CFG, EOS, pad_id=0, decoder=decoder) for _ in range(2)]
    said = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("decode:")]
    assert said == ["decode: the static path failed (RuntimeError: no compiler here); dynamic KV cache, eager steps "
                    "from here"]
    dynamic = sm.sample(tiny, PROMPTS, seeds_for(range(4)), CFG, EOS, pad_id=0)
    assert all(g.token_lists() == dynamic.token_lists() for g in got)


def test_the_decode_path_is_the_devices_default_and_says_why(tiny, monkeypatch):
    """The CPU samples on the dynamic path; TOOLKIT_DECODE=static takes the static one (compiled with
    TOOLKIT_COMPILE_BACKEND's backend); a model that cannot (a quantization that does not compile) stays dynamic
    and the line says why; anything else in TOOLKIT_DECODE is refused."""
    from toolkit.model.kernels import COMPILE_BACKEND_ENV

    monkeypatch.delenv(sm.DECODE_ENV, raising=False)
    decoder, line = sm.decoder_for(tiny)
    assert decoder is None and line.startswith("decode: dynamic KV cache, eager steps (the CPU default")
    monkeypatch.setenv(sm.DECODE_ENV, "static")
    monkeypatch.setenv(COMPILE_BACKEND_ENV, "aot_eager")
    decoder, line = sm.decoder_for(tiny)
    assert decoder.backend == "aot_eager" and not decoder.graphs
    assert line == ("decode: static KV cache (prompt + completion length), the prompt's forward eager, each decode "
                    "step compiled (torch.compile backend aot_eager)")
    monkeypatch.setattr(tiny, "hf_quantizer", SimpleNamespace(is_compileable=False), raising=False)
    decoder, line = sm.decoder_for(tiny)
    assert decoder is None and "quantization does not compile" in line
    monkeypatch.setenv(sm.DECODE_ENV, "paged")
    with pytest.raises(ValueError, match="TOOLKIT_DECODE=paged: dynamic or static"):
        sm.decoder_for(tiny)
