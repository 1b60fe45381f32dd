"""`--columns`: the fields the formats read (`DATA_FIELDS`) and the keys of a conversation's turns
(`TURN_FIELDS`) a dataset's own column names map to, the names people give them (`SAME_JOB`, for "did
you mean"), the mapping parsed (`parse_columns`, `record_columns`, `turn_mapping` into `Turns`) and
checked (`column_problems`). Standard library only: config validation calls these, and the data layer
reads the mapping here."""

from __future__ import annotations

import difflib
from dataclasses import dataclass

# the fields the formats read (toolkit.data.formats), which --columns may map a dataset's columns to
DATA_FIELDS = ("instruction", "input", "output", "system", "messages", "conversations", "text",
               # from prompt on: preference data (pairs, KTO)
               "prompt", "chosen", "rejected", "completion", "label",
               # examples with images (`toolkit.data.images`)
               "images", "image")
# how the turns of messages / conversations (and of preference data's message lists) are written, as LLaMA-
# Factory's dataset_info `tags`: the key of a turn's speaker (ours: role, ShareGPT's from) and of its text
# (content, ShareGPT's value), and your speaker values for our three roles (beside ShareGPT's own names)
TURN_FIELDS = ("role", "content", "user_role", "assistant_role", "system_role")
ROLE_FIELDS = {"user_role": "user", "assistant_role": "assistant", "system_role": "system"}
# names people give our fields, for "did you mean": a hint names only a field that does the same job
# (difflib alone offered 'conversations' for 'completion', 'prompt' for 'from', 'content' for 'context')
SAME_JOB = {"response": "output", "answer": "output", "reply": "output", "target": "output",
            "question": "instruction", "query": "instruction", "context": "input", "system_prompt": "system",
            "dialog": "conversations", "dialogue": "conversations", "turns": "conversations",
            "history": "conversations", "from": "role", "speaker": "role", "role_tag": "role", "value": "content",
            "content_tag": "content", "user": "user_role", "human": "user_role", "user_tag": "user_role",
            "assistant": "assistant_role", "gpt": "assistant_role", "assistant_tag": "assistant_role",
            "system_tag": "system_role", "good": "chosen", "preferred": "chosen", "bad": "rejected",
            "kto_tag": "label"}


def parse_columns(spec: str) -> dict[str, str]:
    """'instruction=prompt,output=response' -> {'instruction': 'prompt', 'output': 'response'}."""
    pairs = [item.split("=", 1) for item in spec.split(",") if item.strip()]
    return {ours.strip(): yours.strip() for ours, *rest in pairs for yours in rest}


def same_job(name: str) -> str | None:
    """The field `name` most likely means: a name people use for it (`SAME_JOB`), or a typo of one."""
    if name in SAME_JOB:
        return SAME_JOB[name]
    hint = difflib.get_close_matches(name, DATA_FIELDS + TURN_FIELDS, n=1, cutoff=0.8)
    return hint[0] if hint else None


def column_problems(spec: str, where: str = "--columns") -> list[str]:
    """What is wrong with a column mapping (`where`: --columns, or the --dataset source that gives its own)."""
    problems, seen = [], []
    for item in (i for i in spec.split(",") if i.strip()):
        ours, sep, yours = (x.strip() for x in item.partition("="))
        seen.append(ours)
        if not sep or not ours or not yours:
            problems.append(f"{where} {item.strip()!r}: write OURS=YOURS, e.g. --columns "
                            "instruction=prompt,output=response")
        elif ours not in DATA_FIELDS + TURN_FIELDS:
            hint = same_job(ours)
            problems.append(f"{where} {item.strip()}: '{ours}' is not a field the formats read"
                            + (f" (did you mean '{hint}'?)" if hint else "")
                            + f"; use one of {', '.join(DATA_FIELDS)}, or for the turns of messages/conversations "
                            f"{', '.join(TURN_FIELDS)}")
    twice = sorted({k for k in seen if seen.count(k) > 1})
    if twice:
        problems.append(f"{where} maps {', '.join(twice)} more than once; give one column for each")
    return problems


def record_columns(spec: str) -> dict[str, str]:
    """{ours: yours} of the mapping's record columns (`DATA_FIELDS`): the renames a dataset gets."""
    return {k: v for k, v in parse_columns(spec).items() if k not in TURN_FIELDS}


@dataclass(frozen=True)
class Turns:
    """How a file writes a turn: the key of its speaker and of its text ("": the format's own), and your
    speaker values for our roles, (yours, ours) pairs, read beside ShareGPT's names."""

    role: str = ""
    content: str = ""
    roles: tuple[tuple[str, str], ...] = ()

    def __bool__(self) -> bool:
        return bool(self.role or self.content or self.roles)

    def keys(self, role: str, content: str) -> tuple[str, str]:
        """The speaker's and the text's key: yours, else the format's (`role`, `content`)."""
        return self.role or role, self.content or content

    def role_of(self, speaker: str) -> str | None:
        return dict(self.roles).get(speaker)


def turn_mapping(spec: str) -> Turns:
    """The turn keys and role values of a column mapping (`TURN_FIELDS`)."""
    mapping = parse_columns(spec)
    return Turns(mapping.get("role", ""), mapping.get("content", ""),
                 tuple((yours, ROLE_FIELDS[ours]) for ours, yours in mapping.items() if ours in ROLE_FIELDS))
