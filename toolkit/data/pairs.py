"""Preference pairs as data (`--objective dpo|orpo|simpo`): records -> (prompt messages, chosen,
rejected) -> two token sequences per pair in the prepared table -> micro-batches with chosen at even
rows and rejected at odd ones, so any even split of the rows keeps pairs whole. The objectives that
train on them are `toolkit.preference`'s."""

from __future__ import annotations

from typing import Any

import torch

from toolkit.errors import UserError

PAIR_FORMATS: dict[str, tuple[str, ...]] = {  # detection order
    "sharegpt-pairs": ("conversations", "chosen", "rejected"),  # LLaMA-Factory's ranking form
    "alpaca-pairs": ("instruction", "chosen", "rejected"),
    "pairs": ("prompt", "chosen", "rejected"),  # TRL's standard and conversational forms
    "implicit-pairs": ("chosen", "rejected"),  # TRL's implicit prompt: two whole conversations
}
UNPAIRED_COLUMNS = ("prompt", "completion", "label")  # KTO's form


def preference_format(columns: list[str]) -> str | None:
    """The preference format the columns fit, or None (SFT data)."""
    cols = set(columns)
    if all(c in cols for c in UNPAIRED_COLUMNS):
        return "unpaired"
    return next((fmt for fmt, need in PAIR_FORMATS.items() if all(c in cols for c in need)), None)


def check_data_fits(columns: list[str], objective: str, source: str) -> str | None:
    """The preference format of a source (None for SFT data), or one line where the data and
    --objective disagree: pairs are never trained as SFT (`toolkit.data.source_format` asks only where
    no SFT format fits the columns), nor SFT data as pairs; KTO's unpaired form is not trained yet."""
    fmt = preference_format(columns)
    if fmt == "unpaired":
        raise UserError(f"--dataset {source}: unpaired preference data (prompt, completion, label) is KTO's form, "
                        "which this toolkit does not train yet; use pairs (prompt, chosen, rejected) with "
                        "--objective dpo, orpo or simpo")
    if fmt is not None and objective == "sft":
        raise UserError(f"--dataset {source} holds preference pairs ({', '.join(PAIR_FORMATS[fmt])}), which SFT "
                        "would not train on as pairs; pass --objective dpo (or orpo, simpo)")
    if objective != "sft" and fmt is None:
        raise UserError(f"--objective {objective} trains on preference pairs, and --dataset {source} has none "
                        f"(columns {', '.join(sorted(columns))}); it needs prompt, chosen and rejected (or "
                        "instruction/conversations with chosen and rejected); map yours with --columns, or use "
                        "--objective sft")
    return fmt


def _answer(value: Any, what: str) -> str:
    """A completion as text: a string, a {from/role, value/content} turn, or a list holding one
    assistant turn (TRL's conversational form)."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        text = value.get("content", value.get("value"))
        if isinstance(text, str):
            return text
    if isinstance(value, list) and len(value) == 1:
        return _answer(value[0], what)
    raise UserError(f"'{what}' must be a string or one assistant turn ({{role, content}}); got "
                    f"{type(value).__name__}{f' of {len(value)} turns' if isinstance(value, list) else ''}")


def _messages(value: Any, what: str) -> list[dict[str, str]]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if isinstance(value, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in value):
        return [{"role": str(m["role"]), "content": str(m["content"] or "")} for m in value]
    raise UserError(f"'{what}' must be a string or a list of {{role, content}} messages")


def to_pair(row: dict[str, Any], fmt: str) -> tuple[list[dict[str, str]], str, str]:
    """One preference record as (the prompt's messages, the chosen completion, the rejected one)."""
    from toolkit.data.formats import to_conversation

    if fmt == "pairs" and isinstance(row["chosen"], list) and len(row["chosen"]) > 1:
        fmt = "implicit-pairs"  # whole conversations beside a prompt (UltraFeedback's): their shared turns are it
    if fmt == "pairs":
        prompt = _messages(row["prompt"], "prompt")
    elif fmt == "alpaca-pairs":
        prompt = to_conversation({**row, "output": ""}, "alpaca")[:-1]
    elif fmt == "sharegpt-pairs":
        prompt = to_conversation(row, "sharegpt")
    else:  # implicit: the shared leading messages are the prompt, each side's last turn its completion
        chosen, rejected = _messages(row["chosen"], "chosen"), _messages(row["rejected"], "rejected")
        if len(chosen) < 2 or chosen[:-1] != rejected[:-1] or chosen[-1]["role"] != "assistant":
            raise UserError("'chosen' and 'rejected' must be conversations that differ only in their last, "
                            "assistant turn (or give a 'prompt' column)")
        return chosen[:-1], chosen[-1]["content"], rejected[-1]["content"]
    if not prompt or prompt[-1]["role"] == "assistant":
        raise UserError("the prompt must end with a user turn (the completions answer it)")
    return prompt, _answer(row["chosen"], "chosen"), _answer(row["rejected"], "rejected")


PAIR_COLUMNS = {"rejected_input_ids": ("int32",), "rejected_labels": ("int32",)}  # beside the chosen's


def encode_pairs(rows: list[dict], indices: list[int], fmt: str, cfg, spec: str, tokenizer) -> dict[str, list]:
    """Preference records as the prepared table's columns: the chosen sequence in `input_ids`/`labels`,
    the rejected one in `rejected_*`, each prompt + completion through the chat template with labels on
    the completion (its last assistant turn) only; `length` is both sequences' tokens, `targets` the
    fewer of their completion tokens (a pair left without one on either side is not trained)."""
    from toolkit.data.formats import with_system_prompt
    from toolkit.data.formats import record_place
    from toolkit.data.table import token_columns
    from toolkit.data.tokenize import encode_batch

    chats, added = [], []
    for row, i in zip(rows, indices):
        try:
            prompt, chosen, rejected = to_pair(row, fmt)
        except UserError as e:
            raise UserError(f"--dataset {record_place(spec, i)}: {e}") from None
        given = with_system_prompt(prompt, cfg.data.system_prompt)
        added.append(given is not prompt)
        chats += [given + [{"role": "assistant", "content": chosen}], given + [{"role": "assistant", "content": rejected}]]
    encs = encode_batch(tokenizer, chats, cfg.data.seq_len, False, last_turn=True)
    chosen, rejected = token_columns(encs[0::2]), token_columns(encs[1::2])
    return {"input_ids": chosen["input_ids"], "labels": chosen["labels"],
            "rejected_input_ids": rejected["input_ids"], "rejected_labels": rejected["labels"],
            "length": [a + b for a, b in zip(chosen["length"], rejected["length"])],
            "targets": [min(a, b) for a, b in zip(chosen["targets"], rejected["targets"])],
            "truncated": [a or b for a, b in zip(chosen["truncated"], rejected["truncated"])], "system_added": added}


def pair_rows(batch: list[dict]) -> list[dict]:
    """A micro-batch of pairs as 2 x len(batch) sequences, chosen at even rows, rejected at odd ones
    (`toolkit.data.collate` pads them and adds `pair_extras`)."""
    return [row for x in batch for row in ({"input_ids": x["input_ids"], "labels": x["labels"]},
                                           {"input_ids": x["rejected_input_ids"], "labels": x["rejected_labels"]})]


def pair_extras(batch: list[dict]) -> dict[str, torch.Tensor]:
    """`pairs`, the loss's normaliser (`toolkit.train.step.batch_counts`), and each pair's precomputed
    reference log-probabilities (`ref_logps`, (2P,)) where the rows carry them."""
    out = {"pairs": torch.tensor(len(batch))}
    if "ref_logps" in batch[0]:
        out["ref_logps"] = torch.tensor([v for x in batch for v in x["ref_logps"]], dtype=torch.float32)
    return out
