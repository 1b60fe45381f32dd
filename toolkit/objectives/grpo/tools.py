"""Tools and environments for `--objective grpo`, as TRL 1.16's GRPOTrainer takes them (`tools=`,
`environment_factory=`), so a file written for TRL runs here unchanged:

- `--tools path.py:fn,fn2`: plain Python functions, sync or async, with type hints and a docstring; their JSON
  schemas (transformers' `get_json_schema`) go to the chat template, which shows them to the model.
- `--environment path.py:Class` (or `name=path.py:Class`, several, chosen per record by its `environment`
  column): one instance per rollout; `reset(**record)` returns None or text appended to the prompt's last
  message; its public methods are the rollout's tools; an optional `get_reward()` scores the rollout (the
  reward named after the class, weight 1).

A completion that ends in tool calls (parsed by the tokenizer's own response parser, transformers'
`parse_response`, where it has one; the common `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` form
otherwise) gets each call's result as a `tool` message, rendered by the chat template (`suffix_ids`, TRL's
`_get_tool_suffix_ids`), and sampling continues (`toolkit.objectives.grpo.rollout.Rollouts.sample`). A call that
raises returns its error to the model, one past `--tool-timeout` is abandoned, a malformed one ends the turn:
each is counted (`ToolCounts`), none stops the run. Tools run in the training process, with its rights: a tool
file is code you run, as a reward file is.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from toolkit.errors import UserError

# the `<tool_call>` form most tool-tuned chat templates write (Hermes, Qwen2.5/3, SmolLM3, ...)
TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
TOOL_CALL_OPEN = "<tool_call>"


# --- loading: every problem one line, before the model loads
def _module(path: Path, flag: str, spec: str):
    from toolkit.objectives.grpo.rewards import _user_module

    try:
        return _user_module(path, spec)
    except UserError as e:  # the reward loader's words, the tool's flag
        raise UserError(str(e).replace("--reward", flag, 1)) from None


def _split(spec: str, flag: str) -> tuple[Path, str]:
    file, sep, names = spec.rpartition(":")
    if not sep or not file or not names.strip():
        raise UserError(f"{flag} {spec}: write path.py:" + ("function[,function...]" if flag == "--tools" else
                                                            "Class (or name=path.py:Class)"))
    path = Path(file)
    if not path.is_file():
        raise UserError(f"{flag} {spec}: no file {path}")
    return path, names


def schema_of(tool: Callable, flag: str) -> dict:
    """The tool's JSON schema as the chat template gets it (transformers' `get_json_schema`: its type hints and
    its docstring's Args), or one line naming what it lacks."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(tool)
    except Exception as e:  # noqa: BLE001 - transformers' reason (a missing hint or argument description)
        name = getattr(tool, "__name__", repr(tool))
        raise UserError(f"{flag}: no JSON schema for {name} ({type(e).__name__}: {e}); a tool needs a type hint "
                        "on every argument and a docstring whose Args section describes each (transformers' "
                        "get_json_schema)") from None


def load_tools(specs: list[str]) -> list[Callable]:
    """The functions of every `--tools path.py:fn,fn2` (their schemas checked now)."""
    tools = []
    for spec in specs:
        path, names = _split(spec, "--tools")
        module = _module(path, "--tools", spec)
        for name in (n.strip() for n in names.split(",") if n.strip()):
            fn = getattr(module, name, None)
            if not callable(fn) or inspect.isclass(fn):
                defined = sorted(k for k, v in vars(module).items() if inspect.isfunction(v)
                                 and v.__module__ == module.__name__ and not k.startswith("_"))
                raise UserError(f"--tools {spec}: {path} has no function {name!r} (its functions: "
                                f"{', '.join(defined) or 'none'})")
            schema_of(fn, "--tools")
            tools.append(fn)
    names = [t.__name__ for t in tools]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise UserError(f"--tools: {', '.join(twice)} given twice; each tool is called by its name")
    return tools


def environment_methods(cls: type) -> list[str]:
    """The tools an environment class exposes: its public methods besides `reset` and `get_reward` (TRL's
    rule: listed on the class, so properties are not evaluated)."""
    return [name for name, _ in inspect.getmembers(cls, predicate=inspect.isfunction)
            if name not in ("reset", "get_reward") and not name.startswith("_")]


def load_environments(specs: list[str]) -> dict[str | None, Any]:
    """`--environment [name=]path.py:Class` -> {name (None for one unnamed): an instance}. Each class is made once
    now (TRL's probe, the first of its pool): its `reset`, and its methods' schemas, checked before the model
    loads."""
    out: dict[str | None, Any] = {}
    for spec in specs:
        name, eq, rest = spec.partition("=")
        if not eq or ":" in name or "/" in name:
            name, rest = None, spec
        elif not name.strip():
            raise UserError(f"--environment {spec}: an empty name before '='")
        path, cls_name = _split(rest, "--environment")
        module = _module(path, "--environment", spec)
        cls = getattr(module, cls_name.strip(), None)
        if not callable(cls):
            raise UserError(f"--environment {spec}: {path} has no {cls_name.strip()!r}")
        try:
            probe = cls()
        except Exception as e:  # noqa: BLE001 - the user's class: one line
            raise UserError(f"--environment {spec}: {cls_name}() raised {type(e).__name__}: {e} (an environment "
                            "is made with no arguments, one per rollout)") from None
        if not callable(getattr(probe, "reset", None)):
            raise UserError(f"--environment {spec}: {cls_name} has no reset method (TRL's contract: reset(**record) "
                            "returns None or text added to the prompt)")
        for method in environment_methods(type(probe)):
            schema_of(getattr(probe, method), f"--environment {spec}")
        key = name.strip() if name else None
        if key in out:
            raise UserError(f"--environment {spec}: {'the name ' + repr(key) if key else 'an unnamed environment'} "
                            "given twice")
        out[key] = probe
    if None in out and len(out) > 1:
        raise UserError("--environment: several environments are chosen per record by name; write each as "
                        "name=path.py:Class")
    return out


# --- the chat template
def template_problem(tokenizer, schemas: list[dict]) -> str | None:
    """Why the tokenizer's chat template cannot run tools, or None: it must show the tools' schemas, render an
    assistant's tool call and a tool's result (TRL's `supports_tool_calling` probe), and render a conversation's
    earlier turns the same whatever follows (the tool results' tokens are cut from two renderings:
    `suffix_ids`)."""
    name, arg, value, content = "tool_name_a8f3", "tool_arg_b9d4", "tool_val_d6e7", "tool_content_c4f9"
    calls = [{"type": "function", "function": {"name": name, "arguments": {arg: value}}}]
    talk = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": calls},
            {"role": "tool", "name": name, "content": content}]
    try:
        shown = tokenizer.apply_chat_template(talk[:1], tools=schemas or None, tokenize=False,
                                              add_generation_prompt=True)
        rendered = tokenizer.apply_chat_template(talk, tokenize=False)
        suffix_ids(tokenizer, [{"role": "tool", "name": name, "content": content}])
    except Exception as e:  # noqa: BLE001 - the template's own error
        return f"rendering a tool call fails ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    if schemas and schemas[0]["function"]["name"] not in shown:
        return "it does not show the tools to the model"
    if not all(s in rendered for s in (name, arg, value, content)):
        return "it drops an assistant's tool calls or the tool's result"
    return None


def suffix_ids(tokenizer, tool_messages: list[dict]) -> list[int]:
    """The tokens that follow an assistant turn ending in tool calls: the tool messages and the next assistant
    header, cut from a dummy conversation rendered without and with them (TRL 1.16's `_get_tool_suffix_ids`: the
    prefix trimmed after its last EOS, where templates put a newline after the end-of-turn token)."""
    calls = [{"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}]
    dummy = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": calls}]
    prefix = tokenizer.apply_chat_template(dummy, add_generation_prompt=False, tokenize=True, return_dict=False)
    full = tokenizer.apply_chat_template(dummy + tool_messages, add_generation_prompt=True, tokenize=True,
                                         return_dict=False)
    ends = [i for i, t in enumerate(prefix) if t == tokenizer.eos_token_id]
    if ends:
        prefix = prefix[:ends[-1] + 1]
    if list(full[:len(prefix)]) != list(prefix):
        raise ValueError("the chat template renders the turns before a tool's result differently once it follows")
    return list(full[len(prefix):])


# --- parsing and calling
def parse_calls(tokenizer, ids: list[int], text: str, prefix: list[int] | None = None) -> tuple[list[dict], bool]:
    """(the completion turn's tool calls as [{"name", "arguments"}], whether it tried to call and could not be
    parsed). The tokenizer's response parser where it has one (transformers' `parse_response`: a new-style
    `response_template` reads the turn after `prefix`, the tokens before it, as TRL passes them); the
    `<tool_call>{json}</tool_call>` form otherwise."""
    if getattr(tokenizer, "response_template", None) is not None or \
            getattr(tokenizer, "response_schema", None) is not None:
        try:
            parsed = tokenizer.parse_response(ids, prefix=list(prefix or [])) \
                if getattr(tokenizer, "response_template", None) is not None else tokenizer.parse_response(ids)
        except (ValueError, TypeError):
            return [], TOOL_CALL_OPEN in text
        calls = []
        for call in (parsed or {}).get("tool_calls") or []:
            function = call.get("function", call) if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                return [], True
            calls.append({"name": function["name"], "arguments": function.get("arguments") or {}})
        return calls, False
    calls = []
    for body in TOOL_CALL.findall(text):
        try:
            call = json.loads(body)
        except json.JSONDecodeError:
            return [], True
        arguments = call.get("arguments", {}) if isinstance(call, dict) else None
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                return [], True
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not isinstance(arguments, dict):
            return [], True
        calls.append({"name": call["name"], "arguments": arguments})
    unclosed = TOOL_CALL_OPEN in text and not calls
    return calls, unclosed


@dataclass
class ToolCounts:
    """A round's tool use on this rank: calls made, calls that raised (or named no tool), calls stopped at
    --tool-timeout, turns whose call could not be parsed; per completion, its calls and its turns."""
    calls: int = 0
    failures: int = 0
    timeouts: int = 0
    malformed: int = 0
    per_completion: list[int] = field(default_factory=list)
    turns: list[int] = field(default_factory=list)


def _run_sync(fn: Callable, arguments: dict, timeout: float) -> tuple[Any, str | None]:
    """(result, None), or (None, "error" | "timeout"): `fn(**arguments)` in a thread of its own, abandoned
    (a daemon: it cannot be killed) when it runs past `timeout` seconds."""
    box: dict[str, Any] = {}

    def target():
        try:
            box["out"] = fn(**arguments)
            if inspect.isawaitable(box["out"]):
                box["out"] = asyncio.run(asyncio.wait_for(box["out"], timeout))
        except Exception as e:  # noqa: BLE001 - the tool's error goes back to the model
            box["error"] = e

    thread = threading.Thread(target=target, daemon=True, name="toolkit-tool")
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        return f"timed out after {timeout:g} s", "timeout"
    if "error" in box:
        e = box["error"]
        if isinstance(e, (asyncio.TimeoutError, TimeoutError)):
            return f"timed out after {timeout:g} s", "timeout"
        return str(e), "error"
    return box.get("out"), None


def call_tool(tools: dict[str, Callable], call: dict, timeout: float, counts: ToolCounts) -> dict:
    """One call's `tool` message (TRL's: the result as text, `{'error': ...}` where it raised or named no tool),
    counted."""
    name = call["name"]
    counts.calls += 1
    fn = tools.get(name)
    if fn is None:
        counts.failures += 1
        return {"role": "tool", "name": name, "content": str({"error": f"Tool {name} not found."})}
    result, fault = _run_sync(fn, call["arguments"], timeout)
    if fault == "timeout":
        counts.timeouts += 1
        counts.failures += 1
        return {"role": "tool", "name": name, "content": str({"error": result})}
    if fault == "error":
        counts.failures += 1
        return {"role": "tool", "name": name, "content": str({"error": result})}
    return {"role": "tool", "name": name, "content": as_content(result)}


def as_content(result: Any) -> str | list:
    """A tool's result as a `tool` message's content: a list of content parts as it is (TRL's multimodal results),
    anything else as text (`str`, as TRL; a result whose `str` raises is its type's name)."""
    if isinstance(result, list) and all(isinstance(p, dict) and "type" in p for p in result):
        return result
    try:
        return str(result)
    except Exception:  # noqa: BLE001 - the tool's object: never the run's fault
        return f"<{type(result).__name__}>"


def tool_dict(tools: list[Callable], environment: Any = None) -> dict[str, Callable]:
    """A rollout's tools by name: the standalone ones and its environment's methods (bound to its instance)."""
    out = {t.__name__: t for t in tools}
    if environment is not None:
        out.update({name: getattr(environment, name) for name in environment_methods(type(environment))})
    return out


def environment_reward(cls: type):
    """The reward `get_reward` gives (TRL's: named after the class, weight 1; None for a rollout of another
    environment), called with the rollouts' `environments`."""
    from toolkit.objectives.grpo.rewards import Reward

    def reward(prompts, completions, environments=None, **_) -> list[float | None]:
        out = []
        for env in environments or [None] * len(completions):
            if type(env) is not cls:
                out.append(None)
                continue
            value = env.get_reward()
            out.append(asyncio.run(value) if inspect.isawaitable(value) else value)
        return out

    reward.__name__ = cls.__name__
    return Reward(f"--environment {cls.__name__}.get_reward", cls.__name__, reward, 1.0)


def reset_prompt(prompt, observation):
    """The prompt with `reset`'s observation appended to its last message (TRL's rule: text to text, parts to
    parts); a string prompt is one user turn."""
    if observation is None:
        return prompt
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
    content = messages[-1]["content"]
    if isinstance(observation, list) and isinstance(content, str):
        content = [{"type": "text", "text": content}]
    if isinstance(observation, str) and isinstance(content, list):
        observation = [{"type": "text", "text": observation}]
    messages[-1] = {**messages[-1], "content": content + observation}
    return messages
