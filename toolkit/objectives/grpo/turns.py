"""Multi-turn sampling with tools (`--tools`, `--environment`): TRL 1.16's `_tool_call_loop`, with the same
completions on every layout.

A completion is sampled (`toolkit.objectives.grpo.sampling.sample`); where its turn ends in tool calls, each call
runs (`toolkit.objectives.grpo.tools.call_tool`), the results are appended as the chat template renders `tool`
messages (`suffix_ids`), and sampling continues from prompt + everything so far, up to `--max-tool-calls` turns
and within `--max-completion-length` tokens in all. The completion is then every turn's tokens and the tool
results' between them; `tool_mask` is 0 on the results' (in the context, never in the loss, the ratio or the
lengths). A result that would leave no room for a reply is dropped and the completion ends (TRL's rule).

Each turn draws from its own generator, seeded from the completion's seed and the turn (`turn_seed`): a turn's
tokens depend only on (seed, step, prompt, generation, turn), the tools' results and the model, so one process
and N ranks sample the same trajectories. Where every forward is collective (FSDP, ZeRO-3, TP), a rank with no
completion left to continue samples a one-token dummy row while the others continue (`anywhere`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable


from toolkit.objectives.grpo.sampling import Completions, turn_seed
from toolkit.objectives.grpo.tools import (ToolCounts, TOOL_CALL, call_tool, environment_methods, parse_calls,
                                           schema_of, suffix_ids, tool_dict, reset_prompt)


@dataclass
class Toolbox:
    """A run's tools: the standalone functions, the environments by name (a probe instance of each: TRL's
    pool starts with it), the tokenizer that renders and parses, and the limits."""
    tools: list[Callable]
    environments: dict[str | None, Any]
    tokenizer: Any
    max_turns: int
    timeout: float
    max_length: int
    counts: ToolCounts = field(default_factory=ToolCounts)
    pools: dict = field(default_factory=dict)
    cursor: dict = field(default_factory=dict)
    rendered: dict = field(default_factory=dict)

    def __post_init__(self):
        names = list(self.environments) or [None]
        self.pools = {name: [probe] for name, probe in self.environments.items()}
        self.schemas = {}
        for name in names:
            env = self.environments.get(name)
            methods = [getattr(env, m) for m in environment_methods(type(env))] if env is not None else []
            self.schemas[name] = [schema_of(t, "--tools") for t in self.tools + methods]

    def describe(self) -> str:
        """The run's line: each environment's tools (or the standalone ones), the limits."""
        parts = []
        for name, schemas in self.schemas.items():
            env = self.environments.get(name)
            who = (f"environment {name + ' = ' if name else ''}{type(env).__name__}" if env is not None else "tools")
            parts.append(f"{who}: {', '.join(s['function']['name'] for s in schemas) or 'none'}")
        return (f"tools: {'; '.join(parts)}; up to {self.max_turns} tool turns a completion, {self.timeout:g} s a "
                "call; tool results are context, never loss")

    def begin_round(self) -> None:
        """Every environment instance free again (a round's rollouts hold theirs until they are scored)."""
        self.cursor = {}

    def environment_of(self, prompts, row: int) -> str | None:
        """The record's environment: the one unnamed, or the one its `environment` column names."""
        if None in self.environments or not self.environments:
            return None
        name = prompts.columns.get("environment", [None] * len(prompts))[row]
        if name not in self.environments:
            from toolkit.errors import UserError

            raise UserError(f"--environment: prompt record {row} has environment {name!r}, not one of "
                            f"{', '.join(map(str, self.environments))}; each record names its environment in an "
                            "'environment' column")
        return name

    def open(self, prompts, rows: list[int]) -> tuple[list[list[int]], list, list[dict]]:
        """(each rollout's prompt ids, its environment instance or None, its tools by name) for the rollouts of
        `rows` (a record's row per completion): an environment per rollout from the pool, reset with its record
        (its observation appended to the prompt), the prompt rendered with its tools' schemas."""
        ids, envs, tools = [], [], []
        for row in rows:
            name = self.environment_of(prompts, row)
            messages = prompts.messages[row]
            env = None
            if self.environments:
                pool, k = self.pools[name], self.cursor.get(name, 0)
                if k == len(pool):
                    pool.append(type(pool[0])())
                self.cursor[name] = k + 1
                env = pool[k]
                record = {"prompt": prompts.prompts[row], **{c: v[row] for c, v in prompts.columns.items()
                                                             if not (c == "environment" and name is not None)}}
                observation = reset(env, record, row)
                if observation is not None:
                    messages = reset_prompt(messages, observation)
                    ids.append(self.ids_of(messages, name))
                else:
                    ids.append(self.cached(prompts, row, name))
            else:
                ids.append(self.cached(prompts, row, name))
            envs.append(env)
            tools.append(tool_dict(self.tools, env))
        return ids, envs, tools

    def cached(self, prompts, row: int, name) -> list[int]:
        key = (id(prompts), row)
        if key not in self.rendered:
            self.rendered[key] = self.ids_of(prompts.messages[row], name)
        return self.rendered[key]

    def ids_of(self, messages: list[dict], name) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, tools=self.schemas[name] or None, tokenize=False,
                                                  add_generation_prompt=True)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def take_counts(self) -> ToolCounts:
        taken, self.counts = self.counts, ToolCounts()
        return taken


def reset(env, record: dict, row: int):
    """`env.reset(**record)`; an environment that raises stops the run in one line naming the record (its state
    would be the last rollout's)."""
    try:
        return env.reset(**record)
    except Exception as e:  # noqa: BLE001 - the user's environment
        from toolkit.errors import UserError

        raise UserError(f"--environment: {type(env).__name__}.reset raised {type(e).__name__}: {e} on prompt "
                        f"record {row}") from None


def assistant_message(tokenizer, ids: list[int], calls: list[dict]) -> dict:
    """A turn as TRL's trajectories hold it: its text (the calls' markup left out), its calls."""
    text = tokenizer.decode(ids, skip_special_tokens=True)
    message = {"role": "assistant", "content": TOOL_CALL.sub("", text).strip() if calls else text}
    if calls:
        message["tool_calls"] = [{"type": "function", "function": c} for c in calls]
    return message


def run_turns(box: Toolbox, first: Completions, prompt_ids: list[list[int]], seeds: list[int], tools: list[dict],
              generate: Callable, anywhere: Callable[[bool], bool], pad_id: int
              ) -> tuple[Completions, list[list[dict]]]:
    """(the completions with their tool turns, each one's trajectory: its assistant turns and tool messages).
    `first`: their first turns; `generate(ids, seeds, limits)` samples continuations (`sample`);
    `anywhere(flag)`: whether any rank has a completion to continue (every rank asks as often)."""
    tok, counts = box.tokenizer, box.counts
    ids = first.token_lists()
    masks = [[1] * len(x) for x in ids]
    truncated = [bool(t) for t in first.truncated.tolist()]
    calls_made, turns = [0] * len(ids), [1] * len(ids)
    trajectories, active = [], {}
    for i, row in enumerate(ids):
        calls, malformed = parse_calls(tok, row, tok.decode(row, skip_special_tokens=False), prompt_ids[i])
        counts.malformed += int(malformed)
        trajectories.append([assistant_message(tok, row, calls)])
        if calls and not truncated[i]:
            active[i] = calls
    for turn in range(1, box.max_turns + 1):
        going = []
        for i, calls in active.items():
            messages = [call_tool(tools[i], c, box.timeout, counts) for c in calls]
            calls_made[i] += len(calls)
            try:
                suffix = suffix_ids(tok, messages)
            except Exception:  # noqa: BLE001 - the template cannot render this result: the turn ends, counted
                counts.malformed += 1
                continue
            if len(ids[i]) + len(suffix) >= box.max_length:  # no room left for a reply: TRL drops the results
                continue
            ids[i] += suffix
            masks[i] += [0] * len(suffix)
            trajectories[i] += messages
            going.append(i)
        if not anywhere(bool(going)):
            break
        rows = going or [0]  # nothing to continue here: a one-token dummy keeps the collective forwards in step
        out = generate([prompt_ids[i] + ids[i] for i in rows], [turn_seed(seeds[i], turn) for i in rows],
                       [box.max_length - len(ids[i]) if going else 1 for i in rows])
        active = {}
        for k, (i, new) in enumerate(zip(going, out.token_lists())):
            before = prompt_ids[i] + ids[i]
            ids[i] += new
            masks[i] += [1] * len(new)
            turns[i] += 1
            truncated[i] = bool(out.truncated[k])
            calls, malformed = parse_calls(tok, new, tok.decode(new, skip_special_tokens=False), before)
            counts.malformed += int(malformed)
            trajectories[i].append(assistant_message(tok, new, calls))
            if calls and not truncated[i]:
                active[i] = calls
    counts.per_completion += calls_made
    counts.turns += turns
    return Completions.from_lists(ids, truncated, masks, pad_id, first.ids.device), trajectories

