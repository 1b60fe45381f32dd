"""Reward functions for `--objective grpo`: `--reward path.py:function` (any number of times, weighted by
`--reward-weights`) and the built-ins `builtin:math_answer` and `builtin:regex:PATTERN`.

A reward function is plain Python with TRL's signature, so one written for TRL's GRPOTrainer runs here
unchanged: `fn(prompts=..., completions=..., completion_ids=..., **columns)` -> one float or None per
completion, where `prompts` has each completion's prompt (a prompt repeated for its G completions),
`completions` the decoded completions, `completion_ids` their token ids (lists, EOS included, no padding),
and `columns` every other column of the records as a list (TRL leaves out `prompt`, `completion` and
`completion_ids`), plus `trainer_state` (`RewardState`: global_step, max_steps, epoch, the attributes of
TRL's TrainerState reward shaping reads), `log_extra(column, values)` and `log_metric(name, value)`.
As TRL: a completion is a string where its prompt is a string, and `[{"role": "assistant", "content":
text}]` where its prompt is a list of messages (`completions_for`). None leaves that function out for that
completion; a completion every function left out is unscorable (advantage 0,
`toolkit.objectives.grpo.functions.weighted_rewards`). Pure Python: no torch here.
"""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import math
import numbers
import re
import sys
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any, Callable, Sequence

from toolkit.errors import UserError

RewardFn = Callable[..., Sequence[float | None]]
NOT_COLUMNS = ("prompt", "completion", "completion_ids")  # what TRL keeps out of the columns it passes
# not columns (`environments`: the rollouts' environment instances, with --environment)
ARGUMENTS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric", "environments")


@dataclass(frozen=True)
class RewardState:
    """`trainer_state` as reward functions see it: the attributes of TRL's TrainerState that reward shaping
    by training progress reads."""
    global_step: int = 0
    max_steps: int = 0
    epoch: float = 0.0


@dataclass(frozen=True)
class Reward:
    """One `--reward`: its spec as written (what errors name), a short name for metrics (TRL's: the
    function's __name__), the function and its weight."""
    spec: str
    name: str
    fn: RewardFn
    weight: float = 1.0


@dataclass
class Scores:
    """`score`'s result: rewards[row][function] (NaN where that function returned None), and what the
    functions logged through `log_extra` (column -> values) and `log_metric` (name -> values)."""
    rewards: list[list[float]]
    extra: dict[str, list] = field(default_factory=dict)
    metrics: dict[str, list[float]] = field(default_factory=dict)


# --- the built-ins
_NUMBER = re.compile(r"(?P<sign>(?<![\w)\]])[-\u2212])?(?:\$(?P<sign2>[-\u2212])?)?"
                     r"(?P<digits>(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)")


def numbers_in(text: str) -> list[Decimal]:
    """The numbers written in `text`, in order: thousands commas (1,234), a dollar sign ($5, -$5, $-5), a
    minus (also U+2212) not glued to a word before it (so 5-7 is 5 and 7), decimals (3.50 is 3.5);
    a sentence's full stop is not a decimal point."""
    out = []
    for m in _NUMBER.finditer(text):
        value = Decimal(m["digits"].replace(",", ""))
        out.append(-value if m["sign"] or m["sign2"] else value)
    return out


def reference_answer(answer: str) -> Decimal | None:
    """The number a record's answer gives: after GSM8K's `#### ` where there is one, else the answer's
    last number; None where it has none."""
    found = numbers_in(str(answer).rsplit("####", 1)[-1])
    return found[-1] if found else None


def completion_text(completion: Any) -> str:
    """A completion's text: itself, or a conversational completion's assistant messages' contents joined (a
    tool's result is not the model's answer)."""
    if isinstance(completion, str):
        return completion
    return "".join(m["content"] for m in completion
                   if isinstance(m.get("content"), str) and m.get("role", "assistant") == "assistant")


def math_answer(prompts: list, completions: list, answer: list | None = None, **columns) -> list[float]:
    """1.0 where the completion's last number equals the record's `answer` (GSM8K's `... #### 42` or a plain
    number; compared as decimals: 3.50 is 3.5, 1,000 is 1000), else 0.0 (also when the completion has no
    number). Without an `answer` column, alpaca's `output` (or a `solution` column) is the answer."""
    if answer is None:
        answer = columns.get("output", columns.get("solution"))
    if answer is None:
        names = ", ".join(sorted(k for k in columns if k not in ARGUMENTS))
        raise UserError(f"needs an 'answer' column; the records have: {names or 'none besides the prompt'}")
    scores = []
    for completion, reference in zip(completions, answer, strict=True):
        expected = reference_answer(reference)
        if expected is None:
            raise UserError(f"the answer {str(reference)[:60]!r} has no number")
        found = numbers_in(completion_text(completion))
        scores.append(1.0 if found and found[-1] == expected else 0.0)
    return scores


def regex_reward(pattern: str) -> RewardFn:
    """1.0 where `re.search(pattern, completion, re.DOTALL)` finds the pattern, else 0.0: unanchored it tests
    that the completion contains it, `^...$` (or `\\A...\\Z`) test the whole completion; DOTALL lets `.` cross
    the lines a reasoning spans."""
    compiled = re.compile(pattern, re.DOTALL)

    def regex(prompts: list, completions: list, **_) -> list[float]:
        return [1.0 if compiled.search(completion_text(c)) else 0.0 for c in completions]

    return regex


# --- loading
_MODULES: dict[Path, Any] = {}  # a file's module, executed once however many of its functions are named


def _user_module(path: Path, spec: str) -> Any:
    """`path` executed as a module of its own (registered in sys.modules under a private name, which
    dataclasses and pickling need); nothing else is imported or run."""
    path = path.resolve()
    if path in _MODULES:
        return _MODULES[path]
    stem = re.sub(r"\W", "_", path.stem)
    name = f"toolkit_reward_{len(_MODULES)}_{stem}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise UserError(f"--reward {spec}: {path} is not a Python file")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - the user's file: said in one line
        del sys.modules[name]
        raise UserError(f"--reward {spec}: loading {path} raised {type(e).__name__}: {e}") from e
    _MODULES[path] = module
    return module


def load_reward(spec: str) -> tuple[str, RewardFn]:
    """(name, function) of one `--reward`: `builtin:math_answer`, `builtin:regex:PATTERN`, or
    `path.py:function` (the path relative to the working directory)."""
    if spec.startswith("builtin:"):
        kind, _, arg = spec.removeprefix("builtin:").partition(":")
        if kind == "math_answer" and not arg:
            return "math_answer", math_answer
        if kind == "regex" and arg:
            try:
                return "regex", regex_reward(arg)
            except re.error as e:
                raise UserError(f"--reward {spec}: not a regular expression: {e}") from e
        raise UserError(f"--reward {spec}: no such built-in; the built-ins are builtin:math_answer and "
                        "builtin:regex:PATTERN")
    file, sep, name = spec.rpartition(":")
    if not sep or not file or not name:
        raise UserError(f"--reward {spec}: write path.py:function or builtin:math_answer or builtin:regex:PATTERN")
    path = Path(file)
    if not path.is_file():
        raise UserError(f"--reward {spec}: no file {path}")
    module = _user_module(path, spec)
    if not hasattr(module, name):
        defined = sorted(k for k, v in vars(module).items()
                         if inspect.isfunction(v) and v.__module__ == module.__name__ and not k.startswith("_"))
        raise UserError(f"--reward {spec}: {path} has no {name!r} (its functions: {', '.join(defined) or 'none'})")
    fn = getattr(module, name)
    if not callable(fn):
        raise UserError(f"--reward {spec}: {name!r} in {path} is a {type(fn).__name__}, not a function")
    return getattr(fn, "__name__", name), fn


def overlong_reward(max_length: int, buffer: int, factor: float) -> Reward:
    """--overlong-buffer's reward, named `overlong` in the metrics: each completion's `overlong_penalty` from its
    token count."""
    from toolkit.objectives.grpo.functions import overlong_penalty

    def overlong(prompts, completions, completion_ids, **columns) -> list[float]:
        return overlong_penalty([len(ids) for ids in completion_ids], max_length, buffer, factor)

    return Reward(f"--overlong-buffer {buffer}", "overlong", overlong, 1.0)


def load_rewards(specs: Sequence[str], weights: Sequence[float] | None = None) -> list[Reward]:
    """Every `--reward`, weighted by `--reward-weights` (1.0 each when not given, as TRL)."""
    if not specs:
        raise UserError("--objective grpo needs at least one --reward (path.py:function or builtin:math_answer)")
    if weights is not None and len(weights) != len(specs):
        raise UserError(f"--reward-weights gives {len(weights)} weights for {len(specs)} --reward functions")
    weights = [1.0] * len(specs) if weights is None else [float(w) for w in weights]
    bad = [w for w in weights if not math.isfinite(w)]
    if bad:
        raise UserError(f"--reward-weights: {bad[0]} is not a finite number")
    return [Reward(spec, *load_reward(spec), weight) for spec, weight in zip(specs, weights)]


# --- calling
def completions_for(prompts: Sequence, texts: Sequence[str], trajectories: Sequence[list] | None = None) -> list:
    """The completions as TRL hands them to reward functions: the text where the prompt is a string, a
    one-message conversation `[{"role": "assistant", "content": text}]` where it is a list of messages; with
    tools, that conversation is the completion's trajectory (its assistant turns, their `tool_calls`, and the
    `tool` messages between them)."""
    if trajectories is not None:
        return [text if isinstance(prompt, str) else path
                for prompt, text, path in zip(prompts, texts, trajectories, strict=True)]
    return [text if isinstance(prompt, str) else [{"role": "assistant", "content": text}]
            for prompt, text in zip(prompts, texts, strict=True)]


def _where(row: int, num_generations: int, records: Sequence[int] | None) -> str:
    where = f"prompt {row // num_generations} completion {row % num_generations}"
    return f"{where} (record {records[row]})" if records is not None else where


def _as_number(value: Any) -> float | None:
    """A returned reward as a float (None stays None); raises TypeError for anything else."""
    if value is None:
        return None
    if not isinstance(value, numbers.Real) and hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        value = value.item()  # a numpy or torch scalar
    if isinstance(value, numbers.Real):
        return float(value)
    raise TypeError(type(value).__name__)


async def _gathered(coroutines: list) -> list:
    """Every reward coroutine's result (or what it raised), run concurrently."""
    return await asyncio.gather(*coroutines, return_exceptions=True)


def _call(fn: RewardFn, kwargs: dict) -> Any:
    out = fn(**kwargs)
    return asyncio.run(out) if inspect.isawaitable(out) else out


def score(rewards: Sequence[Reward], prompts: Sequence, completions: Sequence, completion_ids: Sequence[Sequence[int]],
          columns: dict[str, Sequence] | None = None, num_generations: int = 1, records: Sequence[int] | None = None,
          state: RewardState | None = None) -> Scores:
    """Every reward function on every completion, as TRL's `_calculate_rewards` calls them (all rows at once,
    keyword arguments). Rows are prompt-major (`num_generations` per prompt); `records`: each row's record
    number in the dataset, for the error. A function that raises, returns the wrong number of rewards, or
    returns something not a number or None (NaN and infinities included: None is how to leave one out)
    stops the run in one line naming it and the completion (a raise is retried row by row to find it)."""
    n = len(completions)
    logged = Scores([[math.nan] * len(rewards) for _ in range(n)])

    def log_extra(column: str, values: list) -> None:
        logged.extra.setdefault(column, []).extend(values)

    def log_metric(name: str, value: float) -> None:
        logged.metrics.setdefault(name, []).append(value)

    cols = {k: list(v) for k, v in (columns or {}).items() if k not in NOT_COLUMNS}
    common = dict(trainer_state=state or RewardState(), log_extra=log_extra, log_metric=log_metric)

    def kwargs_for(rows: slice) -> dict:
        return dict(prompts=list(prompts[rows]), completions=list(completions[rows]),
                    completion_ids=list(completion_ids[rows]), **{k: v[rows] for k, v in cols.items()}, **common)

    outputs: dict[int, Any] = {}
    # coroutine functions (TRL's async rewards: a judge served over HTTP, ...) awaited together, as TRL gathers them
    waiting: list[tuple[int, Any]] = []
    for f, reward in enumerate(rewards):
        try:
            out = reward.fn(**kwargs_for(slice(None)))
        except Exception as e:  # noqa: BLE001 - the user's function: said in one line, naming the completion
            for _, coroutine in waiting:
                getattr(coroutine, "close", lambda: None)()
            raise UserError(_failure(reward, e, n, kwargs_for, num_generations, records)) from e
        if inspect.isawaitable(out):
            waiting.append((f, out))
        else:
            outputs[f] = out
    if waiting:
        for (f, _), out in zip(waiting, asyncio.run(_gathered([c for _, c in waiting]))):
            if isinstance(out, Exception):
                raise UserError(_failure(rewards[f], out, n, kwargs_for, num_generations, records)) from out
            if isinstance(out, BaseException):
                raise out
            outputs[f] = out
    for f, reward in enumerate(rewards):
        out = outputs[f]
        if isinstance(out, (str, bytes)) or not hasattr(out, "__len__"):
            raise UserError(f"reward {reward.spec} returned a {type(out).__name__}, not a list of {n} rewards "
                            f"(one per completion)")
        if len(out) != n:
            raise UserError(f"reward {reward.spec} returned {len(out)} rewards for {n} completions "
                            f"({_where(0, num_generations, records)} onwards)")
        for row, value in enumerate(out):
            try:
                number = _as_number(value)
            except TypeError as e:
                raise UserError(f"reward {reward.spec} returned a {e} for {_where(row, num_generations, records)}: "
                                "a reward is a number, or None to leave that completion out") from None
            if number is not None and not math.isfinite(number):
                raise UserError(f"reward {reward.spec} returned {number} for {_where(row, num_generations, records)}: "
                                "return None to leave a completion out")
            logged.rewards[row][f] = math.nan if number is None else number
    return logged


def _failure(reward: Reward, error: Exception, n: int, kwargs_for: Callable[[slice], dict], num_generations: int,
             records: Sequence[int] | None) -> str:
    """The line for a reward function that raised on the whole batch: the first completion it raises on
    alone (its message), else the batch."""
    for row in range(n):
        try:
            _call(reward.fn, kwargs_for(slice(row, row + 1)))
        except Exception as e:  # noqa: BLE001
            error, where = e, _where(row, num_generations, records)
            break
    else:
        where = f"the batch of {n} completions (on none of them alone)"
    said = str(error) if isinstance(error, UserError) else f"{type(error).__name__}: {error}"
    return f"reward {reward.spec} failed on {where}: {said}"
