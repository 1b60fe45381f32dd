"""Prompts for `--objective grpo`: records -> each prompt's tokens (the chat template and its generation
prompt, as SFT renders a user turn), the prompt as reward functions see it, and the record's other columns.

The forms (TRL's GRPOTrainer reads the first; alpaca's is this toolkit's SFT form):
- `prompt`: a string (one user turn) or a list of messages ({role, content}, or the keys and speakers
  `--columns role=...,content=...` name);
- `instruction` (and `input`): alpaca's, joined as SFT joins them into the user turn.
Every other column (GSM8K's `answer`, alpaca's `output`, ...) is handed to the reward functions by name,
as TRL hands a dataset's columns. A prompt longer than --seq-len tokens is dropped and counted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from toolkit.config.schema import DataConfig
from toolkit.data.formats import DataSource, record_place, with_system_prompt
from toolkit.errors import UserError

PROMPT_FORMATS = {"prompt": ("prompt",), "alpaca": ("instruction", "input", "system")}


def prompt_format(columns: list[str], source: DataSource) -> str:
    """The source's prompt form from its columns, or one line naming what it needs."""
    for fmt, (first, *_) in PROMPT_FORMATS.items():
        if first in columns:
            return fmt
    raise UserError(f"--objective grpo samples completions to prompts, and {source.flag} {source.path} has none "
                    f"(columns {', '.join(sorted(columns))}): it needs a prompt column (a string or a list of "
                    "messages), or instruction (and input); map yours with --columns prompt=YOURS")


def prompt_of(row: dict[str, Any], fmt: str, where: str, source: DataSource) -> str | list[dict[str, str]]:
    """The record's prompt as reward functions get it (TRL's `prompts`): a string, or a list of messages."""
    if fmt == "alpaca":
        instruction, extra = row.get("instruction"), row.get("input")
        if not isinstance(instruction, str) or not instruction.strip():
            raise UserError(f"{where}: 'instruction' is empty or not a string")
        return f"{instruction}\n\n{extra}" if isinstance(extra, str) and extra.strip() else instruction
    prompt = row.get("prompt")
    if isinstance(prompt, str):
        if not prompt.strip():
            raise UserError(f"{where}: 'prompt' is empty")
        return prompt
    turns = source.turns
    role, content = turns.keys("role", "content")
    if isinstance(prompt, list) and prompt and all(isinstance(m, dict) and role in m and content in m for m in prompt):
        from toolkit.data.images import content_parts

        # a content of parts: its text joined, or kept with its image parts (an image-text model's prompt)
        return [{"role": turns.role_of(str(m[role])) or str(m[role]), "content": content_parts(m[content], where)}
                for m in prompt]
    raise UserError(f"{where}: 'prompt' must be a string or a list of {{{role}, {content}}} messages")


def prompt_messages(prompt: str | list[dict[str, str]], system: str = "", system_column: Any = None
                    ) -> list[dict[str, str]]:
    """The conversation the completion continues: a string prompt as one user turn (alpaca's `system`
    column in front), --system-prompt added where it has no system message."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if isinstance(system_column, str) and system_column.strip() and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system_column}, *messages]
    return with_system_prompt(messages, system)


@dataclass
class PromptRows:
    """A split's prompts: each one's tokens, the prompt as given and the record's other columns, by row."""
    prompt_ids: list[list[int]] = field(default_factory=list)
    prompts: list = field(default_factory=list)
    columns: dict[str, list] = field(default_factory=dict)
    format: str = "prompt"
    # longer than --seq-len
    dropped: int = 0
    # image prompts (an image-text model's): each one's rendered text and image references, and the processor
    texts: list[str] = field(default_factory=list)
    images: list[list[str]] = field(default_factory=list)
    processor: Any = None
    # the conversation each prompt's tokens render (--system-prompt included): what a run with tools renders
    # again with their schemas, and an environment's reset extends (`toolkit.objectives.grpo.turns`)
    messages: list[list[dict]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.prompt_ids)

    def __bool__(self) -> bool:
        return bool(self.prompt_ids)

    def __getitem__(self, i):
        """A prompt as a row of tokens (the integrity check's probe: a loss on the prompt's own tokens)."""
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        row = {"input_ids": self.prompt_ids[i], "labels": self.prompt_ids[i]}
        # an image prompt: what `toolkit.data.image_rows.MediaCollate` collates it from
        return {**row, "text": self.texts[i], "images": self.images[i]} if self.processor is not None else row

    def columns_of(self, rows: list[int]) -> dict[str, list]:
        """The other columns of `rows`, by name, for the reward functions."""
        return {k: [v[i] for i in rows] for k, v in self.columns.items()}

    def media(self, rows: list[int], ids=None) -> dict:
        """The processor's image inputs of `rows`' prompts, in order (pixel_values, ...), as the model takes them;
        empty for text prompts. Per row, whatever the ids' padding; per token (Gemma 3's `token_type_ids`, each
        token's modality, checked to be such when the prompt was read: `_image_prompt`; Mllama's
        `cross_attention_mask`) as a function of the ids the forward gets, or (`ids`: those ids, (B, T)) made of them
        (`toolkit.data.images.of_ids`). Multi-axis positions read the ids (`toolkit.model.vision.padded_mrope`)."""
        import torch

        from toolkit.data.images import OF_IDS, of_ids, open_image

        if self.processor is None or not any(self.images[i] for i in rows):
            return {}
        enc = self.processor(text=[self.texts[i] for i in rows],
                             images=[[open_image(r) for r in self.images[i]] for i in rows],
                             add_special_tokens=False, padding=True, return_tensors="pt")
        out = {k: v for k, v in enc.items() if k not in ("input_ids", "attention_mask", *OF_IDS) and torch.is_tensor(v)}
        # M-RoPE's modality types are read from the ids by its hook (`toolkit.model.vision.padded_mrope`)
        made = of_ids(self.processor, enc, ("token_type_ids", "cross_attention_mask"))
        return {**out, **({k: f(ids) for k, f in made.items()} if ids is not None else made)}


def load_prompts(data: DataConfig, source: DataSource, tokenizer, records=None, processor=None) -> PromptRows:
    """Every record of `source` (or the given `records`, a `datasets.Dataset` already mapped) as a prompt.
    `processor`: an image-text model's: the record's images placed in its prompt as SFT places them
    (`toolkit.data.images.with_images`), the prompt rendered by the processor's template and its image tokens
    expanded as the processor expands them."""
    from toolkit.data.formats import load_records, map_columns
    from toolkit.data.images import has_images, with_images, without_images
    from toolkit.data.tokenize import prompt_text

    if records is None:
        records = map_columns(load_records(source.path, source.flag), source)
    fmt = prompt_format(records.column_names, source)
    out = PromptRows(format=fmt, processor=processor)
    others = [c for c in records.column_names if c not in ("prompt",)]
    for i, row in enumerate(records):
        where = f"{source.flag} {record_place(source.path, i)}"
        prompt = prompt_of(row, fmt, where, source)
        if processor is None and isinstance(prompt, list) and has_images(prompt):
            # a text model's run (--images off): the prompt's text alone
            prompt = without_images(prompt)
        messages = prompt_messages(prompt, data.system_prompt, row.get("system"))
        if processor is not None:
            messages = with_images([dict(m) for m in messages], row, source.path, f"{where}: ")
            text, refs, ids = _image_prompt(processor, messages, f"{where}: ")
        else:
            ids = tokenizer(prompt_text(tokenizer, messages), add_special_tokens=False)["input_ids"]
        if len(ids) > data.seq_len:
            out.dropped += 1
            continue
        out.prompt_ids.append(ids)
        out.prompts.append(prompt)
        out.messages.append(messages)
        if processor is not None:
            out.texts.append(text)
            out.images.append(refs)
        for c in others:
            out.columns.setdefault(c, []).append(row[c])
    return out


def _image_prompt(processor, messages: list[dict], where: str) -> tuple[str, list[str], list[int]]:
    """(the prompt rendered by the processor's template with its generation prompt, its image references, its ids
    with each image's tokens expanded). A processor's `token_type_ids` must be each token's modality (GRPO makes
    them of a row's ids, `PromptRows.media`), not a prefix (PaliGemma's: `toolkit.data.images.refuse_prefix_types`)."""
    from toolkit.data.images import image_refs, open_images, refuse_prefix_types, template_messages, within_bounds

    text = processor.apply_chat_template(template_messages(messages), tokenize=False, add_generation_prompt=True)
    refs = image_refs(messages)
    images = within_bounds(processor, open_images(refs, where), refs, where)
    enc = processor(text=[text], images=[images] if images else None, add_special_tokens=False)
    refuse_prefix_types(processor, enc, "grpo")
    ids = enc["input_ids"][0]
    return text, refs, list(ids.tolist() if hasattr(ids, "tolist") else ids)


def subset(rows: PromptRows, keep: list[int]) -> PromptRows:
    """The rows `keep` of `rows`, in that order."""
    images = bool(rows.texts)
    return PromptRows([rows.prompt_ids[i] for i in keep], [rows.prompts[i] for i in keep],
                      {k: [v[i] for i in keep] for k, v in rows.columns.items()}, rows.format, 0,
                      [rows.texts[i] for i in keep] if images else [], [rows.images[i] for i in keep] if images else [],
                      rows.processor, [rows.messages[i] for i in keep] if rows.messages else [])


def builtin_eval_prompts(data: DataConfig, source: DataSource, tokenizer, processor=None) -> PromptRows:
    """A built-in dataset's own held-out prompts (`toolkit.data.builtin`: disjoint from its training ones)."""
    from toolkit.data.builtin import builtin_dataset
    from toolkit.data.formats import map_columns

    return load_prompts(data, source, tokenizer, map_columns(builtin_dataset(source.path.split(":", 1)[1], "eval"),
                                                        source), processor)
