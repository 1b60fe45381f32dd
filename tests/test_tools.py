"""--objective grpo with tools and environments (issue 74): TRL 1.16's tools= and environment_factory= contracts,
the multi-turn sampling loop (tool results in the context, never in the loss), its faults counted without stopping
the run, the loss with a tool mask against TRL's own `_compute_loss`, and end-to-end runs on a tiny model taught to
call a tool: every layout samples one process's trajectories and gives its losses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from toolkit.config.chat_template import CHATML_TOOLS
from toolkit.errors import UserError
from toolkit.objectives.grpo import tools as tl
from toolkit.objectives.grpo.sampling import Completions
from toolkit.objectives.grpo.turns import Toolbox, run_turns

TOOLS = '''
import time


def add(a: int, b: int) -> int:
    """Adds two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


def broken(x: int) -> int:
    """Raises.

    Args:
        x: Anything.
    """
    raise RuntimeError("broken on purpose")


def slow(x: int) -> int:
    """Sleeps past any timeout.

    Args:
        x: Anything.
    """
    time.sleep(5)
    return x


async def async_add(a: int, b: int) -> int:
    """Adds two integers, as a coroutine.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


def no_hints(a, b):
    """No type hints."""
    return a


class Counter:
    """TRL's environment_factory example shape: reset, tools as methods, get_reward."""

    def __init__(self):
        self.total = 0

    def reset(self, **record):
        self.total = 0
        return None

    def increment(self, step: int) -> int:
        """Adds to the counter.

        Args:
            step: How much to add.
        """
        self.total += step
        return self.total

    def get_reward(self) -> float:
        return float(self.total)


class NoReset:
    def step(self, x: int) -> int:
        """A step.

        Args:
            x: Anything.
        """
        return x
'''


@pytest.fixture(scope="module")
def tool_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tools") / "tools.py"
    path.write_text(TOOLS)
    return path


@pytest.fixture(scope="module")
def tok():
    from toolkit.model.synthetic import build_tokenizer

    t = build_tokenizer(CHATML_TOOLS)
    t.eos_token = "<|im_end|>"
    return t


def call(name: str, **arguments) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call><|im_end|>'


# --- loading: each mistake one line
def test_tools_and_environments_load_as_trl_takes_them(tool_file):
    tools = tl.load_tools([f"{tool_file}:add,async_add"])
    assert [t.__name__ for t in tools] == ["add", "async_add"]
    envs = tl.load_environments([f"{tool_file}:Counter"])
    assert list(envs) == [None] and tl.environment_methods(type(envs[None])) == ["increment"]
    named = tl.load_environments([f"a={tool_file}:Counter", f"b={tool_file}:Counter"])
    assert sorted(named) == ["a", "b"]


@pytest.mark.parametrize("flag, spec, said", [
    ("tools", "{f}:nothing", "has no function 'nothing' (its functions: add, async_add, broken, no_hints, slow)"),
    ("tools", "{f}:no_hints", "no JSON schema for no_hints"),
    ("tools", "{f}", "write path.py:function"),
    ("tools", "missing.py:add", "no file missing.py"),
    ("tools", "{f}:add,add", "add given twice"),
    ("environment", "{f}:NoReset", "NoReset has no reset method"),
    ("environment", "{f}:Nothing", "has no 'Nothing'"),
])
def test_a_bad_tool_or_environment_is_one_line(tool_file, flag, spec, said):
    load = tl.load_tools if flag == "tools" else tl.load_environments
    with pytest.raises(UserError, match=None) as e:
        load([spec.format(f=tool_file)])
    assert said in str(e.value) and f"--{flag}" in str(e.value)


# --- parsing and calling
def test_calls_are_parsed_and_faults_counted(tok, tool_file):
    ids = tok(call("add", a=3, b=4), add_special_tokens=False)["input_ids"]
    assert tl.parse_calls(tok, ids, tok.decode(ids)) == ([{"name": "add", "arguments": {"a": 3, "b": 4}}], False)
    for text in ("<tool_call>\n{not json}\n</tool_call>", "<tool_call>\n{\"name\": \"add\", \"arg"):
        assert tl.parse_calls(tok, [], text) == ([], True)
    assert tl.parse_calls(tok, [], "just words") == ([], False)

    tools = tl.tool_dict(tl.load_tools([f"{tool_file}:add,broken,slow,async_add"]))
    counts = tl.ToolCounts()
    assert tl.call_tool(tools, {"name": "add", "arguments": {"a": 2, "b": 5}}, 1.0, counts)["content"] == "7"
    assert tl.call_tool(tools, {"name": "async_add", "arguments": {"a": 2, "b": 5}}, 1.0, counts)["content"] == "7"
    assert "broken on purpose" in tl.call_tool(tools, {"name": "broken", "arguments": {"x": 1}}, 1.0, counts)["content"]
    assert "Tool nope not found" in tl.call_tool(tools, {"name": "nope", "arguments": {}}, 1.0, counts)["content"]
    slow = {"name": "slow", "arguments": {"x": 1}}
    assert "timed out after 0.2 s" in tl.call_tool(tools, slow, 0.2, counts)["content"]
    assert "unexpected keyword" in tl.call_tool(tools, {"name": "add", "arguments": {"z": 1}}, 1.0, counts)["content"]
    assert (counts.calls, counts.failures, counts.timeouts) == (6, 4, 1)


def test_the_template_check_names_what_is_missing(tok):
    from toolkit.model.synthetic import build_tokenizer

    schemas = []
    plain = build_tokenizer("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert "drops an assistant's tool calls" in tl.template_problem(plain, schemas)
    assert tl.template_problem(tok, schemas) is None


# --- the turn loop, with a scripted model
def scripted(tok, script: dict[int, list[str]]):
    """`generate` that answers turn t of completion i with script[i][t] (tokens), recording what it saw."""
    seen = []

    def generate(ids, seeds, limits=None, media=None):
        outs = []
        for row, seed, limit in zip(ids, seeds, limits or [99] * len(ids)):
            i, turn = owner[seed]
            text = script[i][turn]
            toks = tok(text, add_special_tokens=False)["input_ids"][:limit]
            seen.append((i, turn, list(row), limit))
            outs.append(toks)
        width = max(len(o) for o in outs)
        t = torch.zeros(len(outs), width, dtype=torch.long)
        m = torch.zeros(len(outs), width, dtype=torch.long)
        for k, o in enumerate(outs):
            t[k, :len(o)], m[k, :len(o)] = torch.tensor(o), 1
        ended = torch.tensor([bool(o) and o[-1] == tok.eos_token_id for o in outs])
        return Completions(t, m, ~ended)

    from toolkit.objectives.grpo.sampling import turn_seed

    owner = {turn_seed(100 + i, t): (i, t) for i in script for t in range(len(script[i]))}
    return generate, seen


def test_tool_results_are_context_and_masked_and_the_loop_ends_as_trl_ends_it(tok, tool_file):
    tools = tl.load_tools([f"{tool_file}:add,broken"])
    box = Toolbox(tools, {}, tok, max_turns=2, timeout=1.0, max_length=400)
    script = {0: [call("add", a=3, b=4), "seven<|im_end|>"],  # one call, then the answer
              1: ["no tools<|im_end|>"],  # answers at once
              2: [call("broken", x=1), call("add", a=1, b=1), call("add", a=2, b=2), "never<|im_end|>"],  # capped
              3: ["<tool_call>\n{oops}\n</tool_call><|im_end|>"]}  # malformed: the turn ends
    generate, seen = scripted(tok, script)
    prompts = [tok("q", add_special_tokens=False)["input_ids"]] * 4
    seeds = [100 + i for i in range(4)]
    first = generate(prompts, seeds)
    done, paths = run_turns(box, first, prompts, seeds, [tl.tool_dict(tools)] * 4, generate, lambda going: going,
                            tok.pad_token_id)
    rows = done.token_lists()
    text = [tok.decode(r) for r in rows]
    assert text[0] == call("add", a=3, b=4) + "\n<|im_start|>tool\n7<|im_end|>\n<|im_start|>assistant\nseven<|im_end|>"
    # the mask: 0 on exactly the tool message and the next assistant header
    suffix = tl.suffix_ids(tok, [{"role": "tool", "name": "add", "content": "7"}])
    first_len = len(tok(call("add", a=3, b=4), add_special_tokens=False)["input_ids"])
    mask = done.tool_mask[0, :len(rows[0])].tolist()
    assert mask == [1] * first_len + [0] * len(suffix) + [1] * (len(rows[0]) - first_len - len(suffix))
    assert done.tool_mask[1, :len(rows[1])].tolist() == [1] * len(rows[1])
    # the second turn's context is the prompt + the first turn + the tool's result
    assert seen[4][:2] == (0, 1) and seen[4][2] == prompts[0] + rows[0][:first_len + len(suffix)]
    assert [m["role"] for m in paths[0]] == ["assistant", "tool", "assistant"]
    assert paths[0][0]["tool_calls"][0]["function"] == {"name": "add", "arguments": {"a": 3, "b": 4}}
    assert paths[0][1]["content"] == "7" and paths[0][2]["content"] == "seven"
    # two tool turns (TRL's max_tool_calling_iterations), then the third call is left unanswered
    assert [m["role"] for m in paths[2]] == ["assistant", "tool", "assistant", "tool", "assistant"]
    assert paths[2][-1]["tool_calls"] and len(seen) == 4 + 3
    assert "broken on purpose" in paths[2][1]["content"]
    c = box.take_counts()
    assert (c.calls, c.failures, c.malformed, c.per_completion, c.turns) == (3, 1, 1, [1, 0, 2, 0], [2, 1, 3, 1])
    assert not done.truncated.any()


def test_a_result_past_the_budget_ends_the_completion_and_the_last_turn_keeps_to_it(tok, tool_file):
    tools = tl.load_tools([f"{tool_file}:add"])
    first_len = len(tok(call("add", a=3, b=4), add_special_tokens=False)["input_ids"])
    suffix = len(tl.suffix_ids(tok, [{"role": "tool", "name": "add", "content": "7"}]))
    for budget, roles in ((first_len + suffix, ["assistant"]), (first_len + suffix + 3, ["assistant", "tool",
                                                                                         "assistant"])):
        box = Toolbox(tools, {}, tok, max_turns=3, timeout=1.0, max_length=budget)
        generate, seen = scripted(tok, {0: [call("add", a=3, b=4), "a long answer here<|im_end|>"]})
        first = generate([[5]], [100])
        done, paths = run_turns(box, first, [[5]], [100], [tl.tool_dict(tools)], generate, lambda g: g, 0)
        assert [m["role"] for m in paths[0]] == roles
        assert len(done.token_lists()[0]) <= budget
        if len(roles) > 1:  # the reply was cut at the budget: truncated, its tokens in the loss
            assert seen[-1][3] == 3 and done.truncated[0] and done.tool_mask[0, -3:].tolist() == [1, 1, 1]


def test_a_rank_with_nothing_to_continue_keeps_the_forwards_in_step(tok, tool_file):
    """Sharded layouts: while any rank continues, every rank samples (a one-token dummy row where it has none)."""
    tools = tl.load_tools([f"{tool_file}:add"])
    box = Toolbox(tools, {}, tok, max_turns=2, timeout=1.0, max_length=200)
    generate, seen = scripted(tok, {0: ["done<|im_end|>", "dummy<|im_end|>", "dummy<|im_end|>"]})
    first = generate([[5]], [100])
    asked = []

    def another_rank_continues(going):  # the other rank calls tools in both turns --max-tool-calls allows
        asked.append(going)
        return True

    done, _ = run_turns(box, first, [[5]], [100], [tl.tool_dict(tools)], generate, another_rank_continues, 0)
    assert asked == [False, False] and [s[3] for s in seen[1:]] == [1, 1]
    assert tok.decode(done.token_lists()[0]) == "done<|im_end|>"


def test_an_environment_per_rollout_reset_with_its_record_and_its_reward(tool_file, tok):
    envs = tl.load_environments([f"{tool_file}:Counter"])
    reward = tl.environment_reward(type(envs[None]))
    box = Toolbox([], envs, tok, max_turns=2, timeout=1.0, max_length=200)
    from toolkit.data.prompts import PromptRows

    rows = PromptRows(prompt_ids=[[1], [2]], prompts=["p0", "p1"], columns={"answer": ["1", "2"]},
                      messages=[[{"role": "user", "content": "p0"}], [{"role": "user", "content": "p1"}]])
    box.begin_round()
    ids, instances, tools = box.open(rows, [0, 0, 1])
    assert len({id(e) for e in instances}) == 3 and set(tools[0]) == {"increment"}
    tools[0]["increment"](step=2)
    tools[2]["increment"](step=5)
    assert reward.fn(prompts=[0] * 3, completions=[0] * 3, environments=instances) == [2.0, 0.0, 5.0]
    assert reward.name == "Counter"
    box.begin_round()  # the pool's instances are reused, reset
    again = box.open(rows, [1])[1]
    assert again[0] is instances[0] and again[0].total == 0
    assert "increment" in tok.decode(ids[0])  # the prompt shows the environment's tools


def test_reset_text_is_appended_to_the_last_message_as_trl_appends_it():
    assert tl.reset_prompt([{"role": "user", "content": "a"}], " b") == [{"role": "user", "content": "a b"}]
    parts = tl.reset_prompt([{"role": "user", "content": [{"type": "text", "text": "a"}]}], "b")
    assert parts[0]["content"] == [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert tl.reset_prompt("a", None) == "a"


# --- the loss with tool results: TRL's `_compute_loss` given the same tool mask
def tool_mask_of(mask: torch.Tensor) -> torch.Tensor:
    """Tool-result spans inside three of the rollout's completions (0 there), as `run_turns` marks them."""
    tools = torch.ones_like(mask)
    tools[0, 2:4], tools[2, 1:3], tools[4, 3:5] = 0, 0, 0
    return tools


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_the_loss_with_tool_results_equals_trls_and_ignores_their_tokens(loss_type, level):
    from test_grpo_functions import TOL, leaf_of, our_loss, rollout, trl_trainer

    import trl

    r = rollout(3)
    tools = tool_mask_of(r["mask"])
    theirs_leaf = leaf_of(r)
    trainer = trl_trainer(loss_type, level, 0.04, theirs_leaf, r["entropies"])
    n, t = r["mask"].shape
    inputs = dict(prompt_ids=torch.ones(n, 2, dtype=torch.long), prompt_mask=torch.ones(n, 2, dtype=torch.long),
                  completion_ids=torch.ones(n, t, dtype=torch.long), completion_mask=r["mask"], tool_mask=tools,
                  advantages=r["advantages"], old_per_token_logps=r["old"], ref_per_token_logps=r["ref"],
                  num_items_in_batch=(r["mask"] * tools).sum())
    theirs = trl.GRPOTrainer._compute_loss(trainer, None, inputs)
    theirs.backward()
    masked = {**r, "mask": r["mask"] * tools}  # collate_rollout's completion_mask with tools
    ours_leaf = leaf_of(r)
    ours = our_loss(masked, [slice(None)], loss_type, level, 0.04, ours_leaf)
    ours.backward()
    torch.testing.assert_close(ours, theirs, **TOL)
    torch.testing.assert_close(ours_leaf.grad, theirs_leaf.grad, **TOL)
    assert ours_leaf.grad[tools == 0].abs().max() == 0 and ours_leaf.grad.abs().sum() > 0

    # every tool-result token's log-probabilities (new, old, reference) replaced: the same loss and gradient
    flipped = {k: v.clone() for k, v in masked.items()}
    noise = torch.randn(n, t, generator=torch.Generator().manual_seed(1)) * 3
    for key in ("logps", "old", "ref"):
        flipped[key] = torch.where(tools == 0, flipped[key] + noise, flipped[key])
    flipped_leaf = leaf_of(flipped)
    again = our_loss(flipped, [slice(None)], loss_type, level, 0.04, flipped_leaf)
    again.backward()
    torch.testing.assert_close(again, ours, **TOL)
    torch.testing.assert_close(flipped_leaf.grad, ours_leaf.grad, **TOL)


def test_a_micro_batch_with_tool_results_attends_to_them_and_counts_only_the_models_tokens():
    from toolkit.objectives.grpo.rollout import collate_rollout

    ids = torch.arange(1, 13).view(2, 6)
    mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2])
    tools = torch.tensor([[1, 1, 0, 0, 1, 1], [1, 0, 1, 1, 1, 1]])
    batch = collate_rollout([[7, 8], [9]], ids, mask, 0, "cpu", tools)
    assert batch["attention_mask"].tolist() == [[1, 1] + [1] * 6, [0, 1] + [1] * 4 + [0, 0]]
    assert batch["completion_mask"].tolist() == [[1, 1, 0, 0, 1, 1], [1, 0, 1, 1, 0, 0]]
    assert (batch["labels"][:, 2:] != -100).long().tolist() == batch["completion_mask"].tolist()
    assert (batch["labels"][:, :2] == -100).all()


# --- end to end: a tiny model taught to call `add`, then GRPO with the tool and with an environment
RUN_TOOLS = '''
def add(a: int, b: int) -> int:
    """Adds two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


def right_sum(prompts, completions, answer, **kwargs):
    """1 where a tool returned the record's answer."""
    return [float(any(m["role"] == "tool" and m["content"] == a for m in c)) for c, a in zip(completions, answer)]


class Adder:
    """TRL's environment_factory shape: reset(**record), its tools as methods, get_reward."""

    def __init__(self):
        self.answer, self.results = None, []

    def reset(self, answer=None, **record):
        self.answer, self.results = answer, []
        return ""

    def add(self, a: int, b: int) -> int:
        """Adds two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        self.results.append(a + b)
        return a + b

    def get_reward(self) -> float:
        return float(str(self.results[-1]) == self.answer) if self.results else 0.0
'''


def tiny_tools_template() -> str:
    """CHATML_TOOLS with the tools shown in one short line: the tiny tokenizer's bytes would make the usual
    instructions ~700 tokens, past the tiny model's positions."""
    start, end = CHATML_TOOLS.index("{%- if tools %}"), CHATML_TOOLS.index("{%- elif system %}")
    short = ("{%- if tools %}{{ '<|im_start|>system\\ntools:' }}{%- for tool in tools %}{{ ' ' + tool.function.name }}"
             "{%- endfor %}{{ '<|im_end|>\\n' }}")
    return CHATML_TOOLS[:start] + short + CHATML_TOOLS[end:]


@pytest.fixture(scope="module")
def taught(tmp_path_factory) -> dict:
    """A tiny Llama whose turns end in <|im_end|>, fully finetuned (300 steps, 2 s) to answer "What is a + b?"
    with an `add` call; the prompts and the tools file of the runs."""
    import random
    import subprocess
    import sys

    from transformers import AutoTokenizer

    from toolkit.model.synthetic import build_model_dir, build_tokenizer

    d = tmp_path_factory.mktemp("taught")
    template = tiny_tools_template()
    end = build_tokenizer(template).convert_tokens_to_ids("<|im_end|>")
    build_model_dir(d / "base", chat_template=template, eos_token_id=end)
    tok = AutoTokenizer.from_pretrained(d / "base")
    tok.eos_token = "<|im_end|>"
    tok.save_pretrained(d / "base")
    rng = random.Random(0)
    sft, prompts = [], []
    for _ in range(32):
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        q = f"What is {a} + {b}?"
        sft.append({"messages": [{"role": "system", "content": "tools: add"}, {"role": "user", "content": q},
                                 {"role": "assistant", "content": call("add", a=a, b=b).removesuffix("<|im_end|>")}]})
        prompts.append({"prompt": [{"role": "user", "content": q}], "answer": str(a + b)})
    (d / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sft))
    (d / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in prompts))
    (d / "run_tools.py").write_text(RUN_TOOLS)
    root = Path(__file__).resolve().parents[1]
    p = subprocess.run([sys.executable, str(root / "finetune.py"), "--model", str(d / "base"), "--dataset",
                        str(d / "sft.jsonl"), "--method", "full", "--lr", "3e-3", "--max-steps", "300",
                        "--micro-batch-size", "8", "--warmup-steps", "0", "--mixed-precision", "no", "--report-to",
                        "none", "--output-dir", str(d / "sft"), "--log-every", "100", "--save-every", "0"],
                       capture_output=True, text=True, cwd=root)
    assert p.returncode == 0, p.stderr[-3000:]
    return {"model": d / "sft" / "final", "prompts": d / "prompts.jsonl", "file": d / "run_tools.py"}


def tool_common(t: dict) -> list[str]:
    return ["--model", str(t["model"]), "--dataset", str(t["prompts"]), "--objective", "grpo",
            "--num-generations", "4", "--max-completion-length", "96", "--temperature", "0.7", "--max-steps", "4",
            "--steps-per-generation", "2", "--num-iterations", "2", "--lr", "3e-3", "--warmup-steps", "0",
            "--seed", "3", "--mixed-precision", "no", "--log-every", "1", "--report-to", "none", "--save-every", "1",
            "--method", "lora", "--beta", "0.05"]


ONE = ["--micro-batch-size", "8"]
TWO = ["--micro-batch-size", "2", "--grad-accum", "2"]
LAYOUTS = {"one": (1, ONE), "ddp": (2, TWO), "zero3": (2, [*TWO, "--zero-stage", "3"]), "fsdp": (2, [*TWO, "--fsdp"]),
           "tp2": (2, [*ONE, "--tp", "2"])}


def kind_flags(kind: str, t: dict) -> list[str]:
    f = t["file"]
    tools = ["--tools", f"{f}:add", "--reward", f"{f}:right_sum"]
    if kind == "dyn":  # DAPO's dynamic sampling, a round each step (so a checkpoint falls between rounds)
        return [*tools, "--dynamic-sampling", "--steps-per-generation", "1", "--num-iterations", "1"]
    return tools if kind == "tools" else ["--environment", f"{f}:Adder"]


KINDS = {"one": ("tools", "env", "dyn"), "ddp": ("tools", "env", "dyn"), "zero3": ("tools", "env"),
         "fsdp": ("tools", "env", "dyn"), "tp2": ("tools", "env")}


@pytest.fixture(scope="module")
def tool_runs(tmp_path_factory, taught):
    from distributed import batched_runs

    specs = {(layout, kind): (ranks, [*flags, *kind_flags(kind, taught)])
             for layout, (ranks, flags) in LAYOUTS.items() for kind in KINDS[layout]}
    return batched_runs(tmp_path_factory, tool_common(taught), specs)


def trajectories(out: Path) -> list[str]:
    return [json.dumps([c["step"], c["completion"], c["rewards"]]) for c in
            map(json.loads, (out / "completions.jsonl").read_text().splitlines())]


@pytest.mark.parametrize("layout, kind", [(lay, kind) for lay in LAYOUTS if lay != "one" for kind in KINDS[lay]])
def test_every_layout_samples_one_process_trajectories_and_its_losses(tool_runs, layout, kind):
    """The same trajectories (as text: every turn, every tool call and result, every reward) and per-step
    losses within 1e-5 (fp32, the loss's tokens the model's alone) on DDP, ZeRO-3, FSDP2 and TP 2."""
    from distributed import assert_metric_close
    from helpers import records

    got, ref = tool_runs(layout, kind), tool_runs("one", kind)
    assert trajectories(got) == trajectories(ref)
    a, b = records(got, "loss"), records(ref, "loss")
    assert [r["step"] for r in a] == [1, 2, 3, 4]
    # TP 2 splits each matmul's reduction over its ranks: the partial sums' order moves fp32 by ~1e-6 a step,
    # which 4 steps of these ~90-token completions grow to 1.7e-5 (measured; the data-parallel layouts: 2e-6)
    rel = 1e-4 if layout == "tp2" else 1e-5
    for key in ("loss", "grad_norm", "reward", "kl", "tools/call_frequency", "turns/mean", "completions/mean_length"):
        assert_metric_close(a, b, key, rel=rel, abs=1e-6, what=f"{layout} {kind}")


@pytest.mark.parametrize("kind", ["tools", "env"])
def test_a_tool_run_calls_the_tool_logs_trls_metrics_and_writes_trajectories(tool_runs, kind):
    from distributed import run_stdout
    from helpers import records

    out = tool_runs("one", kind)
    first, *rest = records(out, "loss")
    assert first["tools/call_frequency"] > 0.5 and first["turns/mean"] > 1.5  # the taught model calls add
    assert first["tools/failure_frequency"] == 0 and "tools/malformed" in first and "tools/timeouts" in first
    reward = "rewards/right_sum/mean" if kind == "tools" else "rewards/Adder/mean"
    assert first[reward] > 0 and first["reward"] == pytest.approx(first[reward])
    logged = [json.loads(x) for x in (out / "completions.jsonl").read_text().splitlines()]
    called = [c for c in logged if len(c["completion"]) > 1]
    assert called and called[0]["completion"][0]["tool_calls"][0]["function"]["name"] == "add"
    assert called[0]["completion"][1]["role"] == "tool"
    # the lengths are the model's tokens: less than the whole completion where a tool's result is in it
    said = run_stdout(out)
    who = "tools: add" if kind == "tools" else "environment Adder: add"
    assert f"tools: {who}; up to 10 tool turns a completion, 30 s a call" in said


@pytest.fixture(scope="module")
def tools_resumed(tmp_path_factory, taught, tool_runs):
    """One process's tool run and 2 ranks' FSDP environment run, resumed from checkpoint-1 (mid-round)."""
    import shutil

    from distributed import launch_layouts

    out = {}
    for layout, kind in (("one", "tools"), ("fsdp", "env")):
        ranks, flags = LAYOUTS[layout]
        name = f"{layout}_{kind}"
        root = tmp_path_factory.mktemp(f"resumed_{name}")
        shutil.copytree(tool_runs(layout, kind), root / name)
        for later in ("checkpoint-2", "checkpoint-3", "checkpoint-4", "final"):
            shutil.rmtree(root / name / later)
        out[name] = launch_layouts(root, tool_common(taught), {name: [*flags, *kind_flags(kind, taught), "--resume",
                                                                      "auto"]}, nproc=ranks)[name]
    return out


@pytest.mark.parametrize("name", ["one_tools", "fsdp_env"])
def test_a_resume_in_the_middle_of_a_tool_round_continues_exactly(tool_runs, tools_resumed, name):
    """The round's remaining micro-batches hold the trajectories (tool results included): nothing is replayed,
    environments included; the resumed steps equal the uninterrupted run's (one process: bitwise)."""
    from distributed import assert_metric_close
    from helpers import records

    run = tools_resumed[name]
    assert run["exit"] == 0, run["stderr"].read_text()[-3000:]
    assert "checkpoint-1: continuing at step 2" in run["stdout"].read_text()
    got, ref = records(run["out"], "loss"), records(tool_runs(*name.split("_")), "loss")
    tol = 0 if name.startswith("one") else 1e-6
    for key in ("loss", "grad_norm", "kl", "reward"):
        assert_metric_close(got, ref, key, rel=tol, abs=tol, what=name)


BAD = [  # (flags, the line's start): every one before the model loads
    (["--tools", "nowhere.py:add", "--reward", "builtin:math_answer"], "--tools nowhere.py:add: no file nowhere.py"),
    (["--tools", "tools.py:nothing", "--reward", "builtin:math_answer"], "--tools tools.py:nothing: tools.py has no "
                                                                         "'nothing'"),
    (["--tools", "tools.py:no_hints", "--reward", "builtin:math_answer"], "--tools: no JSON schema for no_hints"),
    (["--environment", "tools.py:NoReset"], "--environment tools.py:NoReset: NoReset has no reset method"),
    (["--environment", "tools.py:Counter", "--max-tool-calls", "0"], "--max-tool-calls must be >= 1"),
    (["--tools", "tools.py:add"], "--objective grpo needs at least one --reward"),
    (["--tools", "tools.py:add", "--reward", "builtin:math_answer", "--chat-template", "{{ messages[0]['content'] }}"],
     "--tools/--environment: the chat template of --model"),
    (["--tools", "tools.py:add", "--reward", "builtin:math_answer", "--objective", "sft"],
     "--num-generations, --reward, --tools set --objective grpo's"),
]


def test_a_bad_tool_flag_or_file_is_one_line_before_the_model_loads(tool_file, taught):
    """Each case in a process of its own: exit 2, one line, no traceback, no model loaded."""
    import subprocess
    import sys

    from distributed import ROOT

    for flags, says in BAD:
        argv = ["--model", str(taught["model"]), "--dataset", str(taught["prompts"]), "--objective", "grpo",
                "--micro-batch-size", "8", "--num-generations", "4", "--report-to", "none", "--output-dir",
                str(tool_file.parent / "out"), "--overwrite-output-dir", *flags]
        p = subprocess.run([sys.executable, str(ROOT / "finetune.py"), *argv], cwd=tool_file.parent,
                           capture_output=True, text=True, timeout=300)
        lines = [x for x in p.stderr.splitlines() if x.strip() and "kernels" not in x]
        assert p.returncode == 2 and len(lines) == 1, (flags, p.stderr[-2000:])
        assert lines[0].startswith(f"finetune.py: error: {says}"), lines[0]
        assert "model:" not in p.stdout


# --- DAPO's dynamic sampling
def test_dynamic_sampling_keeps_the_groups_dapo_keeps():
    """DAPO eq. 11: a group is kept where 0 < |correct| < G, i.e. its rewards do not all agree; a group of fewer
    than two scored rewards (None: NaN) compares nothing."""
    from toolkit.objectives.grpo.functions import informative_groups

    nan = float("nan")
    groups = [[1, 1, 1, 1], [0, 1, 0, 0], [0, 0, 0, 0], [0.1, 0.1, 0.1, 0.1], [nan, 1, nan, nan], [nan, 1, 0, nan],
              [0.5, 0.5, 0.5, 0.25]]
    correct = [sum(1 for x in g if x == 1) for g in groups]
    assert correct[:3] == [4, 1, 0]  # DAPO's rule on the 0/1 groups: keep 0 < correct < G
    got = informative_groups(torch.tensor(groups, dtype=torch.float64).view(-1), 4).tolist()
    assert got == [False, True, False, False, False, True, True]


def test_a_dynamic_sampling_run_trains_only_groups_with_signal_and_counts_the_drops(tool_runs):
    from helpers import records

    got = records(tool_runs("one", "dyn"), "loss")
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    assert sum(r["dynamic_sampling/dropped_groups"] for r in got) > 0  # the taught model's groups often agree
    assert all(r["frac_reward_zero_std"] == 0 for r in got if r["dynamic_sampling/filled_groups"] == 0)
    assert any(r["dynamic_sampling/rounds"] > 1 for r in got)
    plain = records(tool_runs("one", "tools"), "loss")
    assert any(r["frac_reward_zero_std"] > 0 for r in plain)  # without the filter, groups without signal train


@pytest.fixture(scope="module")
def dyn_resumed(tmp_path_factory, taught, tool_runs):
    """One process's dynamic-sampling run resumed from checkpoint-2: a round boundary, where the next prompt batch
    is the checkpoint's cursor (how many batches steps 1-2 took depended on their rewards)."""
    import shutil

    from distributed import launch_layouts

    root = tmp_path_factory.mktemp("resumed_dyn")
    shutil.copytree(tool_runs("one", "dyn"), root / "one_dyn")
    for later in ("checkpoint-3", "checkpoint-4", "final"):
        shutil.rmtree(root / "one_dyn" / later)
    lines = (root / "one_dyn" / "completions.jsonl").read_text().splitlines()
    (root / "one_dyn" / "completions.jsonl").write_text("".join(x + "\n" for x in lines if json.loads(x)["step"] <= 2))
    return launch_layouts(root, tool_common(taught), {"one_dyn": [*ONE, *kind_flags("dyn", taught), "--resume",
                                                                  "auto"]})["one_dyn"]


def test_a_dynamic_sampling_resume_between_rounds_samples_the_same_prompts(tool_runs, dyn_resumed):
    from distributed import assert_metric_close
    from helpers import records

    before = [r["dynamic_sampling/rounds"] for r in records(tool_runs("one", "dyn"), "loss")][:2]
    assert sum(before) > 2  # steps 1-2 took more prompt batches than steps: the cursor is not the step's
    assert dyn_resumed["exit"] == 0, dyn_resumed["stderr"].read_text()[-3000:]
    assert "checkpoint-2: continuing at step 3" in dyn_resumed["stdout"].read_text()
    assert trajectories(dyn_resumed["out"]) == trajectories(tool_runs("one", "dyn"))
    for key in ("loss", "grad_norm", "reward", "dynamic_sampling/dropped_groups"):
        assert_metric_close(records(dyn_resumed["out"], "loss"), records(tool_runs("one", "dyn"), "loss"), key,
                            rel=0, abs=0, what="dyn resumed")


def test_the_same_tools_file_runs_in_trls_grpo_trainer(taught, tmp_path):
    """The run's tools and environment file, unchanged, in TRL 1.16's GRPOTrainer (`tools=`, `environment_factory=`)
    on the same taught model: TRL calls the tool too. The tokenizer is given TRL's Qwen3 response template, which
    TRL needs to parse calls (it knows only its listed templates); given it, this toolkit parses with it too."""
    import importlib.util

    import trl
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl.chat_template_utils import qwen3_template

    spec = importlib.util.spec_from_file_location("run_tools_for_trl", taught["file"])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    tok = AutoTokenizer.from_pretrained(taught["model"])
    tok.response_template = qwen3_template
    rows = [json.loads(x) for x in Path(taught["prompts"]).read_text().splitlines()[:4]]
    for kind, kw in (("tools", dict(tools=[module.add], reward_funcs=[module.right_sum])),
                     ("env", dict(environment_factory=module.Adder, reward_funcs=[]))):
        args = trl.GRPOConfig(output_dir=str(tmp_path / kind), per_device_train_batch_size=4, num_generations=4,
                              max_completion_length=96, max_steps=1, report_to=[], logging_steps=1, use_cpu=True,
                              bf16=False, temperature=0.7, save_strategy="no")
        trainer = trl.GRPOTrainer(model=str(taught["model"]), args=args, train_dataset=Dataset.from_list(rows),
                                  processing_class=tok, **kw)
        trainer.train()
        logged = trainer.state.log_history[0]
        assert logged["tools/call_frequency"] > 0.5, (kind, logged)
    # the toolkit's parser with the tokenizer's response template: the turn after its prompt
    prompt = tok.apply_chat_template([{"role": "user", "content": "q"}], tokenize=True, add_generation_prompt=True,
                                     return_dict=False)
    ids = tok(call("add", a=3, b=4), add_special_tokens=False)["input_ids"]
    assert tl.parse_calls(tok, ids, tok.decode(ids), prompt) == ([{"name": "add", "arguments": {"a": 3, "b": 4}}],
                                                                  False)


def test_a_string_prompts_reward_reads_the_models_text_not_the_tools(tok):
    """`builtin:math_answer` reads the last number: a tool's result in the text would score a completion that called
    the calculator and never answered. A string prompt's completion is the model's tokens alone."""
    from toolkit.objectives.grpo.rollout import completion_texts

    model = tok(call("multiply", a=3, b=4), add_special_tokens=False)["input_ids"]
    result = tl.suffix_ids(tok, [{"role": "tool", "name": "multiply", "content": "12"}])
    row = model + result + tok("no idea<|im_end|>", add_special_tokens=False)["input_ids"]
    mask = [1] * len(model) + [0] * len(result) + [1] * (len(row) - len(model) - len(result))
    done = Completions(torch.tensor([row]), torch.ones(1, len(row), dtype=torch.long), torch.tensor([False]),
                       torch.tensor([mask]))
    text = completion_texts(tok, done)[0]
    assert "12" not in text and text.endswith("no idea") and '"a": 3' in text
    from toolkit.objectives.grpo.rewards import math_answer

    assert math_answer(["q"], [text], answer=["12"]) == [0.0]


def test_chatml_tools_renders_content_parts_and_the_environment_column_is_checked(tok, tool_file):
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is"}, {"type": "text", "text": " 3 + 4?"}]}]
    assert "What is 3 + 4?<|im_end|>" in tok.apply_chat_template(parts, tokenize=False)
    from toolkit.data.prompts import PromptRows

    envs = tl.load_environments([f"a={tool_file}:Counter"])
    box = Toolbox([], envs, tok, max_turns=1, timeout=1.0, max_length=50)
    rows = PromptRows(prompt_ids=[[1]], prompts=["p"], columns={"environment": ["b"]}, messages=[[{"role": "user",
                                                                                                   "content": "p"}]])
    with pytest.raises(UserError, match="prompt record 0 has environment 'b', not one of a"):
        box.open(rows, [0])


def test_the_quickstarts_task_demonstrates_the_tool_and_grades_the_answer(tok):
    """builtin:products (the tools quickstart's): disjoint train and eval pairs, each record's `messages` a
    demonstration whose call parses and, run through configs/calculator.py, gives the record's answer, which
    builtin:math_answer grades 1; the two quickstart configs parse."""
    import re

    from toolkit.config import parse_config
    from toolkit.data.builtin import builtin_records
    from toolkit.objectives.grpo.rewards import math_answer

    root = Path(__file__).resolve().parents[1]
    train, held = builtin_records("products", "train"), builtin_records("products", "eval")
    pairs = [{tuple(map(int, re.findall(r"\d+", r["prompt"]))) for r in rows} for rows in (train, held)]
    assert (len(train), len(held), len(pairs[0]), len(pairs[1])) == (512, 64, 512, 64) and not pairs[0] & pairs[1]
    multiply = tl.tool_dict(tl.load_tools([f"{root / 'configs' / 'calculator.py'}:multiply"]))
    for row in train[:16] + held[:16]:
        user, demo, result, answer = row["messages"]
        a, b = map(int, re.findall(r"\d+", row["prompt"]))
        assert 100 <= a <= 999 and 11 <= b <= 99 and row["answer"] == str(a * b) == result["content"]
        calls, bad = tl.parse_calls(tok, [], demo["content"])
        assert not bad and tl.call_tool(multiply, calls[0], 5.0, tl.ToolCounts())["content"] == row["answer"]
        assert math_answer([row["prompt"]], [answer["content"]], answer=[row["answer"]]) == [1.0]
    for name in ("tools_sft.yaml", "tools_quickstart.yaml"):
        cfg = parse_config(["--config", str(root / "configs" / name), "--output-dir", "/nonexistent/x"])
        assert cfg.data.dataset == "builtin:products"
