"""GRPO's parts (issue 65): the loss, its gradient and metrics equal TRL 1.16's `GRPOTrainer._compute_loss` (run on
a stand-in trainer with fixed log-probabilities), on one micro-batch and on TRL's equal micro-batches and ranks;
any split of the global batch gives the same loss; the advantages equal what TRL's
`_generate_and_score_completions` computes (run with stubs, its rewards from TRL's own `_calculate_rewards`);
reward functions get TRL's arguments and fail in one line. (The sampler: tests/test_sampling.py.)"""

from __future__ import annotations

import math
from collections import defaultdict, deque
from types import SimpleNamespace

import pytest
import torch

from toolkit.objectives.grpo import functions as gf
from toolkit.objectives.grpo import rewards as rw
from toolkit.errors import UserError

trl = pytest.importorskip("trl", reason="trl is in the dev extras: pip install -e '.[dev]'")
TOL = dict(atol=1e-6, rtol=1e-6)
EPS_LOW, EPS_HIGH = 0.2, 0.28


# --- the policy loss against GRPOTrainer._compute_loss
def rollout(seed: int = 0) -> dict:
    """6 completions of lengths 7, 3, 5, 1, 6, 4: old log-probabilities a row-wise shift (+-0.5) and some noise
    from the new ones, so both clips fire at token and at sequence level; advantages of both signs."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([7, 3, 5, 1, 6, 4])
    mask = (torch.arange(7)[None] < lengths[:, None]).long()
    logps = -3 * torch.rand(6, 7, generator=g)
    shift = torch.tensor([0.5, -0.5, 0.5, -0.5, 0.1, -0.1]).unsqueeze(1)
    return dict(mask=mask, logps=logps, old=logps - shift + 0.2 * torch.randn(6, 7, generator=g),
                ref=logps + 0.3 * torch.randn(6, 7, generator=g), entropies=torch.rand(6, 7, generator=g),
                advantages=torch.tensor([1.2, -0.8, -1.0, 0.7, 0.3, -0.4]))


def trl_trainer(loss_type: str, level: str, beta: float, logps: torch.Tensor, entropies: torch.Tensor,
                accumulation: int = 1, processes: int = 1, steps_per_generation: int = 1, max_len: int = 7):
    """The attributes `GRPOTrainer._compute_loss` reads, TRL's defaults otherwise; the model's forward replaced
    by fixed per-token log-probabilities (a leaf) and entropies."""
    identity = SimpleNamespace(num_processes=processes, gather=lambda t: t, reduce=lambda t, reduction="sum": t)
    return SimpleNamespace(
        beta=beta, epsilon_low=EPS_LOW, epsilon_high=EPS_HIGH, loss_type=loss_type, importance_sampling_level=level,
        max_completion_length=max_len, model=SimpleNamespace(training=True), accelerator=identity,
        args=SimpleNamespace(delta=None, use_bias_correction_kl=True, steps_per_generation=steps_per_generation),
        _metrics={"train": defaultdict(list)}, current_gradient_accumulation_steps=accumulation,
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, use_vllm=False, aux_loss_enabled=False,
        _entropy_bonus_enabled=False, _get_per_token_logps_and_entropies=lambda *a, **k: (logps, entropies, None))


def trl_loss(r: dict, rows, loss_type: str, level: str, beta: float, leaf: torch.Tensor, num_items, **kw):
    """TRL's loss on `rows` of the rollout (its metrics beside), the log-probabilities a slice of `leaf`."""
    trainer = trl_trainer(loss_type, level, beta, leaf[rows], r["entropies"][rows], **kw)
    n, t = r["mask"][rows].shape
    inputs = dict(prompt_ids=torch.ones(n, 2, dtype=torch.long), prompt_mask=torch.ones(n, 2, dtype=torch.long),
                  completion_ids=torch.ones(n, t, dtype=torch.long), completion_mask=r["mask"][rows],
                  advantages=r["advantages"][rows], old_per_token_logps=r["old"][rows],
                  ref_per_token_logps=r["ref"][rows], num_items_in_batch=torch.as_tensor(num_items))
    return trl.GRPOTrainer._compute_loss(trainer, None, inputs), trainer._metrics["train"]


def our_loss(r: dict, pieces, loss_type: str, level: str, beta: float, leaf: torch.Tensor) -> torch.Tensor:
    """The toolkit's loss: each piece's sum over the global batch's normaliser, summed as the loop sums them."""
    counts = sum(gf.completion_counts(r["mask"][rows]) for rows in pieces)
    norm = gf.loss_normaliser(loss_type, counts[0], counts[1], 7)
    total = 0
    for rows in pieces:
        terms = gf.policy_loss_terms(leaf[rows], r["old"][rows], r["advantages"][rows], r["mask"][rows], EPS_LOW,
                                     EPS_HIGH, level, beta, r["ref"][rows])
        total = total + gf.loss_sum(terms.loss, r["mask"][rows], loss_type) / norm
    return total


def leaf_of(r: dict) -> torch.Tensor:
    return r["logps"].clone().requires_grad_()


@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_the_loss_its_gradient_and_metrics_equal_trls_compute_loss(loss_type, level, beta):
    r = rollout()
    theirs_leaf, ours_leaf = leaf_of(r), leaf_of(r)
    everything = slice(None)
    theirs, metrics = trl_loss(r, everything, loss_type, level, beta, theirs_leaf, r["mask"].sum())
    theirs.backward()
    ours = our_loss(r, [everything], loss_type, level, beta, ours_leaf)
    ours.backward()
    torch.testing.assert_close(ours, theirs, **TOL)
    torch.testing.assert_close(ours_leaf.grad, theirs_leaf.grad, **TOL)
    assert theirs_leaf.grad.abs().sum() > 0

    assert metrics["clip_ratio/low_mean"][0] > 0 and metrics["clip_ratio/high_mean"][0] > 0  # both clips fired
    terms = gf.policy_loss_terms(r["logps"], r["old"], r["advantages"], r["mask"], EPS_LOW, EPS_HIGH, level, beta,
                                 r["ref"])
    mine = gf.policy_metrics(terms, r["advantages"], r["mask"], EPS_LOW, EPS_HIGH, r["entropies"])
    assert set(mine.sums) | set(mine.minimum) | set(mine.maximum) == set(metrics)
    for name, (total, count) in mine.sums.items():
        assert (total / count).item() == pytest.approx(metrics[name][0], abs=1e-6), name
    for name, value in {**mine.minimum, **mine.maximum}.items():
        assert value.item() == pytest.approx(metrics[name][0], abs=1e-6), name


@pytest.mark.parametrize("processes, accumulation", [(1, 3), (3, 1), (2, 3)])
@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo", "bnpo"])
def test_trls_equal_micro_batches_and_ranks_give_our_global_loss_except_bnpo(loss_type, processes, accumulation):
    """TRL's accumulation: each micro-batch's loss / its accumulation steps (dapo: / the generation batch's
    tokens per rank), DDP's mean over ranks. That sum equals ours (one normaliser over the global batch) for
    grpo, dr_grpo and dapo; TRL's bnpo divides by each micro-batch's own tokens, so with micro-batches of
    different token counts it is another loss, where ours stays the one-micro-batch loss."""
    r = rollout(1)
    micro = 6 // (processes * accumulation)
    pieces = [slice(i, i + micro) for i in range(0, 6, micro)]
    theirs_leaf, ours_leaf = leaf_of(r), leaf_of(r)
    theirs = sum(trl_loss(r, rows, loss_type, "token", 0.04, theirs_leaf, r["mask"].sum(), accumulation=accumulation,
                          processes=processes, steps_per_generation=accumulation)[0] for rows in pieces) / processes
    theirs.backward()
    ours = our_loss(r, pieces, loss_type, "token", 0.04, ours_leaf)
    ours.backward()
    whole_leaf = leaf_of(r)
    whole, _ = trl_loss(r, slice(None), loss_type, "token", 0.04, whole_leaf, r["mask"].sum())
    whole.backward()
    torch.testing.assert_close(ours, whole, **TOL)  # ours does not depend on the split
    torch.testing.assert_close(ours_leaf.grad, whole_leaf.grad, **TOL)
    if loss_type == "bnpo":
        assert abs(theirs.item() - ours.item()) > 1e-3
    else:
        torch.testing.assert_close(ours, theirs, **TOL)
        torch.testing.assert_close(ours_leaf.grad, theirs_leaf.grad, **TOL)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_any_split_of_the_global_batch_gives_the_same_loss_and_gradient(loss_type):
    """Micro-batches of 1, 4 and 1 completions (no equal split TRL could run) against the whole batch at once."""
    r = rollout(2)
    whole_leaf, split_leaf = leaf_of(r), leaf_of(r)
    whole = our_loss(r, [slice(None)], loss_type, "sequence", 0.04, whole_leaf)
    split = our_loss(r, [slice(0, 1), slice(1, 5), slice(5, 6)], loss_type, "sequence", 0.04, split_leaf)
    whole.backward()
    split.backward()
    torch.testing.assert_close(split, whole, **TOL)
    torch.testing.assert_close(split_leaf.grad, whole_leaf.grad, **TOL)


def test_nanstd_is_trls():
    from trl.trainer.utils import nanstd

    x = torch.tensor([[1.0, 2.0, float("nan"), 4.0], [float("nan")] * 3 + [5.0], [3.0] * 4])
    torch.testing.assert_close(gf.nanstd(x, dim=1), nanstd(x, dim=1), equal_nan=True)
    torch.testing.assert_close(gf.nanstd(x), nanstd(x), equal_nan=True)


# --- the advantages against GRPOTrainer._generate_and_score_completions
G = 4
COMPLETIONS = ["aa", "ab", "xb", "abc",  # one left out by `length`
               "xxa", "xxb", "a", "aaaa",  # two unscorable (both functions None)
               "xxc", "b", "xxd", "xxe",  # one scorable: its group's std is NaN
               "bb", "bb", "bb", "bb"]  # all alike: std 0
COMPLETION_IDS = [[5] * (i % 5 + 1) + ([2] if i % 3 else []) for i in range(len(COMPLETIONS))]  # 2: EOS


def length(prompts, completions, completion_ids, **kw):
    return [None if c.startswith("x") else float(len(c)) for c in completions]


def count_a(prompts, completions, **kw):
    return [None if c.startswith("xx") else float(c.count("a")) for c in completions]


def trl_scorer(scale_rewards: str, mask_truncated: bool, funcs=(length, count_a), weights=(1.0, 0.5)):
    """The attributes `_generate_and_score_completions` and `_calculate_rewards` read: generation replaced by
    fixed completions, the reward functions TRL's own code calls; one process, one generation per step."""
    from accelerate.state import PartialState

    PartialState()  # TRL's logger needs accelerate's state
    s = SimpleNamespace(
        accelerator=SimpleNamespace(device=torch.device("cpu"), gather=lambda t: t, process_index=0, num_processes=1,
                                    is_main_process=True),
        model=SimpleNamespace(training=True, is_gradient_checkpointing=False), environment_factories=None,
        environments=None, tools=None, pad_to_multiple_of=None, _tokenizer=SimpleNamespace(pad_token_id=0),
        mask_truncated_completions=mask_truncated, eos_token_ids=[2], num_iterations=1, use_vllm=False, beta=0.0,
        args=SimpleNamespace(per_device_train_batch_size=len(COMPLETIONS), gradient_checkpointing_kwargs=None,
                             steps_per_generation=1, gradient_accumulation_steps=1, report_to=[]),
        reward_funcs=list(funcs), reward_processing_classes=[None] * len(funcs),
        reward_func_names=[f.__name__ for f in funcs], state=SimpleNamespace(global_step=3),
        _log_completion_extra=lambda *a: None, _log_metric=lambda *a: None, num_generations=G,
        multi_objective_aggregation="sum_then_normalize", reward_weights=torch.tensor(weights),
        scale_rewards=scale_rewards, _metrics={"train": defaultdict(list)}, _pending_extra_logs=defaultdict(list),
        _pending_metrics=defaultdict(list), _logs={"prompt": deque(), "completion": deque(),
                                                   "rewards": defaultdict(deque), "advantages": deque(),
                                                   "extra": defaultdict(deque)})
    s._generate = lambda prompts: ([[1, 1]] * len(prompts), COMPLETION_IDS, None, COMPLETIONS, None, {}, None, [])
    s._calculate_rewards = lambda *a: trl.GRPOTrainer._calculate_rewards(s, *a)
    return s


def trl_inputs() -> list[dict]:
    """The rollout's input records, as TRL's trainer is handed them: a prompt and an answer per completion."""
    return [{"prompt": f"question {i // G}", "answer": str(i)} for i in range(len(COMPLETIONS))]


@pytest.mark.parametrize("mask_truncated", [False, True])
@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_advantages_equal_trls_generate_and_score_completions(scale_rewards, mask_truncated):
    trainer = trl_scorer(scale_rewards, mask_truncated)
    theirs = trl.GRPOTrainer._generate_and_score_completions(trainer, trl_inputs())
    rewards = [rw.Reward("length", "length", length, 1.0), rw.Reward("count_a", "count_a", count_a, 0.5)]
    prompts = [x["prompt"] for x in trl_inputs()]
    scores = rw.score(rewards, prompts, COMPLETIONS, COMPLETION_IDS, {"answer": [x["answer"] for x in trl_inputs()]}, G)
    per_func = torch.tensor(scores.rewards)
    total = gf.weighted_rewards(per_func, torch.tensor([r.weight for r in rewards]))
    advantages = gf.group_advantages(total, G, scale_rewards)
    torch.testing.assert_close(advantages, theirs["advantages"], **TOL)
    assert (advantages[4:6] == 0).all() and (advantages[8:12] == 0).all() and advantages[:4].abs().min() > 0.1

    # TRL's zero-std count is of the std it scaled by: the group's, or the batch's
    zero = gf.zero_std_groups(total, G, scale_rewards).float().mean().item()
    assert zero == theirs_metric(trainer, "frac_reward_zero_std")
    truncated = torch.tensor([ids[-1] != 2 for ids in COMPLETION_IDS])
    full = (torch.arange(6)[None] < torch.tensor([len(ids) for ids in COMPLETION_IDS])[:, None]).long()
    mask = gf.truncated_mask(full, truncated) if mask_truncated else full
    assert torch.equal(mask, theirs["completion_mask"].long())
    assert gf.completion_counts(mask)[1].item() == theirs["num_items_in_batch"].item()


def theirs_metric(trainer, name: str) -> float:
    return trainer._metrics["train"][name][0]


# --- reward functions: TRL's call, the built-ins, loading, and mistakes in one line
def test_a_reward_function_gets_the_arguments_trl_gives_it():
    seen = {}

    def spy(prompts, completions, completion_ids, **kw):
        seen.setdefault("calls", []).append(dict(prompts=prompts, completions=completions,
                                                 completion_ids=completion_ids, **kw))
        return [0.0] * len(completions)

    trainer = trl_scorer("group", False, funcs=(spy,), weights=(1.0,))
    trl.GRPOTrainer._generate_and_score_completions(trainer, trl_inputs())
    prompts = [x["prompt"] for x in trl_inputs()]
    rw.score([rw.Reward("spy", "spy", spy)], prompts, COMPLETIONS, COMPLETION_IDS,
             {"prompt": prompts, "answer": [x["answer"] for x in trl_inputs()]}, G, state=rw.RewardState(global_step=3))
    theirs, ours = seen["calls"]
    assert set(ours) == set(theirs)
    for key in ("prompts", "completions", "completion_ids", "answer"):
        assert ours[key] == theirs[key], key
    assert ours["trainer_state"].global_step == theirs["trainer_state"].global_step
    assert rw.completions_for(["a", [{"role": "user", "content": "q"}]], ["x", "y"]) == \
        ["x", [{"role": "assistant", "content": "y"}]]  # TRL's `_generate`: conversational prompts get a message


@pytest.mark.parametrize("completion, answer, reward", [
    ("She has 72 clips.", "48 + 24 = 72\n#### 72", 1.0),
    ("The total is $1,234.50.", "#### 1234.5", 1.0),
    ("so 3.50", "3.5", 1.0),
    ("It drops to -7 degrees", "#### -7", 1.0),
    ("It drops to 7 degrees", "#### -7", 0.0),
    ("from 5-7, the answer is 12.", "#### 12", 1.0),
    ("72 then 73", "#### 72", 0.0),  # the last number counts
    ("no idea", "#### 72", 0.0),
    ("1,000 apples", "#### 1000", 1.0),
    ("costs $-5", "#### -5", 1.0),
])
def test_math_answer_reads_gsm8k_answers(completion, answer, reward):
    assert rw.math_answer(["q"], [completion], answer=[answer]) == [reward]
    conversational = [{"role": "assistant", "content": completion}]
    assert rw.math_answer([[{"role": "user", "content": "q"}]], [conversational], answer=[answer]) == [reward]


def dapo_length_reward(length: int, l_max: int, l_cache: int) -> float:
    """DAPO's R_length (Yu et al. 2025, eq. 13), written piecewise as the paper does."""
    if length <= l_max - l_cache:
        return 0.0
    if length <= l_max:
        return ((l_max - l_cache) - length) / l_cache
    return -1.0


@pytest.mark.parametrize("l_max, l_cache", [(16, 4), (512, 128), (8, 7)])
def test_the_overlong_penalty_is_dapos_soft_length_punishment(l_max, l_cache):
    """--overlong-buffer's reward: DAPO's eq. 13 for every length up to the cap (0 until l_max - l_cache, then -1 at
    l_max), scaled by --overlong-penalty; the reward function reads the lengths from `completion_ids`."""
    lengths = list(range(0, l_max + 1))
    assert gf.overlong_penalty(lengths, l_max, l_cache) == pytest.approx(
        [dapo_length_reward(n, l_max, l_cache) for n in lengths], abs=1e-12)
    assert gf.overlong_penalty([l_max], l_max, l_cache, 0.5) == [-0.5]
    reward = rw.overlong_reward(l_max, l_cache, 2.0)
    assert reward.name == "overlong" and reward.weight == 1.0
    ids = [[1] * (l_max - l_cache), [1] * l_max]
    assert reward.fn(["p", "p"], ["a", "b"], ids) == [0.0, -2.0]


def test_coroutine_rewards_are_awaited_together():
    """Two async reward functions that each wait for the other (as two judges behind one server might): awaited one
    after the other, the first would wait 5 s and fail; gathered, as TRL 1.16 gathers them, both finish. A sync
    function beside them scores as before, and each result lands in its own column."""
    import asyncio

    events: dict[str, asyncio.Event] = {}

    def event(name: str) -> asyncio.Event:
        return events.setdefault(name, asyncio.Event())

    async def first(completions, **kwargs):
        event("a").set()
        await asyncio.wait_for(event("b").wait(), 5)
        return [1.0] * len(completions)

    async def second(completions, **kwargs):
        event("b").set()
        await asyncio.wait_for(event("a").wait(), 5)
        return [2.0] * len(completions)

    def third(completions, **kwargs):
        return [3.0] * len(completions)

    rewards = [rw.Reward(f"x.py:{f.__name__}", f.__name__, f) for f in (first, third, second)]
    scores = rw.score(rewards, ["p", "p"], ["a", "b"], [[1], [2]])
    assert scores.rewards == [[1.0, 3.0, 2.0], [1.0, 3.0, 2.0]]

    async def broken(completions, **kwargs):
        raise ValueError("judge down")

    with pytest.raises(UserError, match="judge down"):
        rw.score([rw.Reward("x.py:broken", "broken", broken)], ["p"], ["a"], [[1]])


def test_regex_reward_searches_across_lines():
    name, fn = rw.load_reward(r"builtin:regex:^<think>.*</think>\s*<answer>\d+</answer>$")
    done = "<think>a\nb</think>\n<answer>42</answer>"
    assert name == "regex" and fn(["q"] * 3, [done, "x" + done, "<answer>42</answer>"]) == [1.0, 0.0, 0.0]
    assert rw.load_reward("builtin:regex:answer")[1](["q"] * 2, ["the answer: 4", "none"]) == [1.0, 0.0]


def test_a_reward_file_loads_once_and_its_mistakes_are_one_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.py").write_text(
        "from dataclasses import dataclass\nLOADS = []\nLOADS.append(1)\nLIMIT = 3\n"
        "@dataclass\nclass Box:\n    n: int\n"
        "def short(prompts, completions, **kw):\n    return [float(len(c) < LIMIT) for c in completions]\n"
        "def other(completions, **kw):\n    return [Box(1).n * 1.0 for _ in completions]\n")
    (tmp_path / "broken.py").write_text("def f(:\n")
    rewards = rw.load_rewards(["mine.py:short", "mine.py:other", "builtin:math_answer"], [1.0, 0.5, 2.0])
    assert [(r.name, r.weight) for r in rewards] == [("short", 1.0), ("other", 0.5), ("math_answer", 2.0)]
    assert rewards[0].fn.__globals__["LOADS"] == [1]  # executed once for both functions
    assert rw.score(rewards[:2], ["q", "q"], ["ab", "abcd"], [[1], [1]]).rewards == [[1.0, 1.0], [0.0, 1.0]]
    for spec, says in [("gone.py:f", "--reward gone.py:f: no file gone.py"),
                       ("mine.py:nope", "mine.py has no 'nope' (its functions: other, short)"),
                       ("mine.py:LIMIT", "'LIMIT' in mine.py is a int, not a function"),
                       ("broken.py:f", "--reward broken.py:f: loading"),
                       ("mine.py", "write path.py:function"),
                       ("builtin:length", "no such built-in"),
                       ("builtin:regex:(", "not a regular expression")]:
        with pytest.raises(UserError, match=None) as e:
            rw.load_reward(spec)
        assert says in str(e.value) and "\n" not in str(e.value), spec
    with pytest.raises(UserError, match="gives 1 weights for 2 --reward functions"):
        rw.load_rewards(["mine.py:short", "mine.py:other"], [1.0])


def bad(kind):
    def fn(prompts, completions, **kw):
        if kind == "raises":
            return [1 / 0 if c == "boom" else 1.0 for c in completions]
        return {"short": [1.0], "text": ["1.0"] * len(completions), "nan": [float("nan")] * len(completions),
                "inf": [1.0, math.inf] + [1.0] * (len(completions) - 2), "scalar": 1.0}[kind]
    return fn


@pytest.mark.parametrize("kind, says", [
    ("raises", "reward mine.py:bad failed on prompt 1 completion 1 (record 11): ZeroDivisionError: division by zero"),
    ("short", "reward mine.py:bad returned 1 rewards for 4 completions"),
    ("text", "reward mine.py:bad returned a str for prompt 0 completion 0 (record 10): a reward is a number, or None"),
    ("nan", "reward mine.py:bad returned nan for prompt 0 completion 0 (record 10): return None to leave"),
    ("inf", "reward mine.py:bad returned inf for prompt 0 completion 1 (record 10)"),
    ("scalar", "reward mine.py:bad returned a float, not a list of 4 rewards"),
])
def test_a_reward_function_that_misbehaves_stops_the_run_in_one_line_naming_the_completion(kind, says):
    completions = ["a", "b", "c", "boom"]
    with pytest.raises(UserError) as e:
        rw.score([rw.Reward("mine.py:bad", "bad", bad(kind))], ["p", "p", "q", "q"], completions, [[1]] * 4,
                 num_generations=2, records=[10, 10, 11, 11])
    assert says in str(e.value) and "\n" not in str(e.value)


def test_math_answer_without_an_answer_column_names_the_record():
    with pytest.raises(UserError, match=r"builtin:math_answer failed on prompt 0 completion 0 \(record 7\): needs an "
                                        r"'answer' column; the records have: hint$"):
        rw.score([rw.Reward("builtin:math_answer", "math_answer", rw.math_answer)], ["q"], ["4"], [[1]],
                 {"hint": ["4"]}, records=[7])
    # alpaca's `output` (or a `solution` column) is the answer where there is no `answer` column
    for column in ("output", "solution"):
        scored = rw.score([rw.Reward("builtin:math_answer", "math_answer", rw.math_answer)], ["q", "q"],
                          ["it is 4", "5"], [[1], [1]], {column: ["The sum is 4.", "#### 4"]})
        assert scored.rewards == [[1.0], [0.0]]


# --- the completion tokens' log-probabilities
@pytest.mark.parametrize("rows", [1, 4, 7, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_log_probabilities_and_entropies_are_trls(rows, dtype):
    """`selective_logps`, any chunk of positions, against TRL's `selective_log_softmax` and `entropy_from_logits` of
    logits / temperature in fp32 (as `_get_per_token_logps_and_entropies` without its fused head), values and
    the gradient of a weighted sum (autograd through TRL's, the logits' dtype kept)."""
    from trl.trainer.utils import entropy_from_logits, selective_log_softmax

    g = torch.Generator().manual_seed(0)
    logits = (4 * torch.randn(3, 6, 500, generator=g)).to(dtype).requires_grad_()
    targets = torch.randint(0, 500, (3, 6), generator=g)
    weights = torch.randn(3, 6, generator=g)
    scaled = logits.float() / 0.7
    want = selective_log_softmax(scaled, targets)
    want_grad, = torch.autograd.grad((want * weights).sum(), logits)
    got, entropies = gf.selective_logps(logits, targets, 0.7, entropy=True, rows=rows)
    got_grad, = torch.autograd.grad((got * weights).sum(), logits)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-6)
    torch.testing.assert_close(entropies, entropy_from_logits(scaled.detach()), atol=2e-6, rtol=1e-6)
    assert got.dtype == entropies.dtype == torch.float32 and not entropies.requires_grad
    assert got_grad.dtype == dtype
    torch.testing.assert_close(got_grad, want_grad, **(TOL if dtype == torch.float32 else {}))


def test_chunked_log_probabilities_keep_only_the_logits_for_backward():
    """What autograd saves: the logits (the model's output, alive anyway), the targets and one log-sum-exp per
    position; no (N, V) log-softmax, softmax or scaled copy (the full-vocabulary intermediates a step made)."""
    logits = torch.randn(4, 9, 300, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        gf.selective_logps(logits * 1.0, torch.zeros(4, 9, dtype=torch.long), 0.5, entropy=True, rows=5)
    big = [t for t in saved if t.numel() >= 300 * 9]
    assert len(big) == 1 and big[0].shape == (36, 300), [t.shape for t in saved]
    assert sum(t.numel() for t in saved) == 36 * 300 + 2 * 36
