"""`--chat-template`: which chat template renders a run's conversations. It is set on the tokenizer
once, where the tokenizer is loaded (`toolkit.model.load.load_tokenizer`), so the training data, the eval
and exact-match prompts, the samples, `generate` and the tokenizer saved in `final/` all use it, and
the token cache's key (`toolkit.data.table.tokenizer_digest`, which hashes the tokenizer's template)
changes with it. Standard library only: config validation checks a file here before anything loads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from toolkit.errors import UserError

JINJA_SUFFIXES = (".jinja", ".jinja2", ".j2", ".tmpl", ".txt")
# what transformers writes beside a saved tokenizer
FILE_IN_FOLDER = "chat_template.jinja"

# a ChatML template that renders tools (the Hermes / Qwen2.5 form), for ChatML models whose own template ignores
# them (SmolLM2): `--chat-template chatml-tools`
CHATML_TOOLS = (
    "{%- if messages[0].role == 'system' %}{%- set system = messages[0].content %}{%- set rest = messages[1:] %}"
    "{%- else %}{%- set system = '' %}{%- set rest = messages %}{%- endif %}"
    "{%- if tools %}{{ '<|im_start|>system\\n' }}{%- if system %}{{ system + '\\n\\n' }}{%- endif %}"
    "{{ '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with '"
    "'function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{ '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{ '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within '"
    "'<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": '"
    "'<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif system %}{{ '<|im_start|>system\\n' + system + '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in rest %}{{ '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.content is string %}{{ message.content }}{%- elif message.content %}"
    "{%- for part in message.content if part.type == 'text' %}{{ part.text }}{%- endfor %}{%- endif %}"
    "{%- for call in message.tool_calls or [] %}{%- if call.function is defined %}{%- set call = call.function %}"
    "{%- endif %}{%- if (message.content is string and message.content) or not loop.first %}{{ '\\n' }}{%- endif %}"
    "{{ '<tool_call>\\n{\"name\": \"' + call.name + '\", \"arguments\": ' }}"
    "{%- if call.arguments is string %}{{ call.arguments }}{%- else %}{{ call.arguments | tojson }}{%- endif %}"
    "{{ '}\\n</tool_call>' }}{%- endfor %}{{ '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")
BUILTIN_TEMPLATES = {"chatml-tools": CHATML_TOOLS}


def is_inline(spec: str) -> bool:
    """A template written out in the value itself (YAML: chat_template: "{% for m in messages %}...")."""
    return "{{" in spec or "{%" in spec


def _path(spec: str) -> Path:
    path = Path(spec).expanduser()
    return path / FILE_IN_FOLDER if path.is_dir() else path


def template_problems(spec: str) -> list[str]:
    """A --chat-template that names a file which is not there, or holds nothing (checked with the
    config, before any model or data); a name is checked against the tokenizer (`apply_template`)."""
    if not spec or is_inline(spec) or spec in BUILTIN_TEMPLATES:
        return []
    path = _path(spec)
    if path.is_file():
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            return [f"--chat-template {spec}: cannot be read as UTF-8 text ({type(e).__name__})"]
        return [] if text.strip() else [f"--chat-template {spec}: the file is empty; it should hold a Jinja chat "
                                        "template"]
    if Path(spec).expanduser().is_dir():
        return [f"--chat-template {spec} is a folder without {FILE_IN_FOLDER}; give the template file"]
    if "/" in spec or "\\" in spec or spec.lower().endswith(JINJA_SUFFIXES):
        return [f"--chat-template {spec}: file not found (a Jinja template file, or the name of a template the "
                "tokenizer carries)"]
    return []


def apply_template(tokenizer: Any, spec: str, model: str) -> None:
    """Set the tokenizer's chat template to the one `spec` gives: a Jinja file (or a folder's
    chat_template.jinja), a template written out, a built-in (`BUILTIN_TEMPLATES`: chatml-tools), or the name
    of one of the templates the tokenizer carries (transformers' `chat_template` dict). Without `spec`, a
    tokenizer with several templates and no default is refused here, in one line naming them, rather than at
    its first conversation."""
    current = getattr(tokenizer, "chat_template", None)
    names = sorted(current) if isinstance(current, dict) else []
    if not spec:
        if names and "default" not in names:
            raise UserError(f"--model {model}: its tokenizer carries several chat templates and none is the "
                            f"default ({', '.join(names)}); choose one with --chat-template NAME")
        return
    if is_inline(spec):
        tokenizer.chat_template = spec
    elif spec in BUILTIN_TEMPLATES:
        tokenizer.chat_template = BUILTIN_TEMPLATES[spec]
    elif _path(spec).is_file():
        tokenizer.chat_template = _path(spec).read_text(encoding="utf-8")
    elif spec in names:
        tokenizer.chat_template = current[spec]
    else:
        has = (f"its templates are {', '.join(names)}" if names else
               "it carries one template, with no name" if current else "it carries no chat template")
        raise UserError(f"--chat-template {spec}: not a file, and the tokenizer of {model} has no template of "
                        f"that name ({has}); give a Jinja file, or leave it out for the tokenizer's own (other "
                        "tools' built-in names, such as chatml, are not read here; the built-in here: chatml-tools)")
