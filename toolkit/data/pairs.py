"""Preference data as tokens. Pairs (`--objective dpo|orpo|simpo`): records -> (prompt messages,
chosen, rejected) -> two token sequences per pair in the prepared table -> micro-batches with chosen at
even rows and rejected at odd ones, so any even split of the rows keeps pairs whole.

KTO (`--objective kto`): completions labelled desirable or not (TRL's unpaired form; pairs are split
into one of each, as TRL's `unpair_preference_dataset`: each chunk's chosen examples, then its rejected
ones), one sequence per example, and beside it the
sequence its KL estimate scores: its own prompt with another example's completion (TRL's rotation by
one within a batch; here within each chunk the table is encoded in, so the partner is fixed in the
table and a full finetune's reference can be computed once). The objectives that train on them are
`toolkit.objectives.preference.loss`'s."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from toolkit.config.columns import Turns
from toolkit.config.schema import DataConfig
from toolkit.data.images import content_parts, has_images, without_images
from toolkit.data.tokenize import blank
from toolkit.config.objectives import form
from toolkit.errors import UserError

# torch is imported where a batch is made: the early data check runs before it loads
if TYPE_CHECKING:
    import torch

# detection order
PAIR_FORMATS: dict[str, tuple[str, ...]] = {
    # LLaMA-Factory's ranking form
    "sharegpt-pairs": ("conversations", "chosen", "rejected"),
    "alpaca-pairs": ("instruction", "chosen", "rejected"),
    # TRL's standard and conversational forms
    "pairs": ("prompt", "chosen", "rejected"),
    # TRL's implicit prompt: two whole conversations
    "implicit-pairs": ("chosen", "rejected"),
}
# KTO's form
UNPAIRED_COLUMNS = ("prompt", "completion", "label")
PREFERENCE_READS = {**PAIR_FORMATS, "alpaca-pairs": ("instruction", "input", "system", "chosen", "rejected"),
                    # every field each reads
                    "pairs": ("prompt", "chosen", "rejected"), "unpaired": UNPAIRED_COLUMNS}


def preference_format(columns: list[str]) -> str | None:
    """The preference format the columns fit, or None (SFT data)."""
    cols = set(columns)
    if all(c in cols for c in UNPAIRED_COLUMNS):
        return "unpaired"
    return next((fmt for fmt, need in PAIR_FORMATS.items() if all(c in cols for c in need)), None)


def check_data_fits(columns: list[str], objective: str, source: str, flag: str = "--dataset") -> str | None:
    """The preference format of a source (None for SFT data), or one line where the data and
    --objective disagree: pairs are never trained as SFT (`toolkit.data.source_format` asks only where
    no SFT format fits the columns), nor SFT data as pairs; KTO's unpaired form only under kto."""
    fmt, wants = preference_format(columns), form(objective)
    if fmt == "unpaired" and wants != "labelled":
        also = "" if wants == "conversations" else ", or give pairs (prompt, chosen, rejected)"
        raise UserError(f"{flag} {source}: unpaired preference data (prompt, completion, label) is KTO's form; "
                        f"pass --objective kto{also}")
    if fmt is not None and wants == "conversations":
        raise UserError(f"{flag} {source} holds preference pairs ({', '.join(PAIR_FORMATS[fmt])}), which SFT "
                        "would not train on as pairs; pass --objective dpo (or orpo, simpo, kto)")
    if wants != "conversations" and fmt is None:
        labelled = wants == "labelled"
        raise UserError(f"--objective {objective} trains on preference {'data' if labelled else 'pairs'}, "
                        f"and {flag} {source} has none (columns {', '.join(sorted(columns))}); it needs prompt, "
                        "chosen and rejected (or instruction/conversations with chosen and rejected"
                        f"{'; or prompt, completion and label' if labelled else ''}); map yours with "
                        "--columns, or use --objective sft")
    return fmt


def _answer(value: Any, what: str, turns: Turns = Turns()) -> str:
    """A completion as text: a string, a {from/role, value/content} turn (or the text key `turns` names),
    or a list holding one assistant turn (TRL's conversational form)."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        text = value.get(turns.content) if turns.content else value.get("content", value.get("value"))
        # content parts of text alone (TRL's image-text pairs write completions so)
        if isinstance(text, list):
            text = content_parts(text, "")
        if isinstance(text, str):
            return text
    if isinstance(value, list) and len(value) == 1:
        return _answer(value[0], what, turns)
    raise UserError(f"'{what}' must be a string or one assistant turn ({{role, content}}); got "
                    f"{type(value).__name__}{f' of {len(value)} turns' if isinstance(value, list) else ''}")


def _messages(value: Any, what: str, turns: Turns = Turns()) -> list[dict]:
    """A prompt (or a whole conversation) as messages: a string is one user turn; a list of {role, content}
    (or of the keys and speakers `turns` names), a content of parts as `toolkit.data.images.content_parts` reads
    it (text parts joined; image parts kept, for an image-text model)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    role, content = turns.keys("role", "content")
    if isinstance(value, list) and all(isinstance(m, dict) and role in m and content in m for m in value):
        return [{"role": turns.role_of(str(m[role])) or str(m[role]),
                 "content": content_parts(m[content], f"'{what}': ")} for m in value]
    raise UserError(f"'{what}' must be a string or a list of {{{role}, {content}}} messages")


def to_pair(row: dict[str, Any], fmt: str, turns: Turns = Turns()) -> tuple[list[dict[str, str]], str, str]:
    """One preference record as (the prompt's messages, the chosen completion, the rejected one); `turns`:
    the turn keys and speakers a column mapping names."""
    from toolkit.data.formats import to_conversation

    if fmt == "pairs" and isinstance(row["chosen"], list) and len(row["chosen"]) > 1:
        # whole conversations beside a prompt (UltraFeedback's): their shared turns are it
        fmt = "implicit-pairs"
    if fmt == "pairs":
        prompt = _messages(row["prompt"], "prompt", turns)
    elif fmt == "alpaca-pairs":
        prompt = to_conversation({**row, "output": ""}, "alpaca")[:-1]
    elif fmt == "sharegpt-pairs":
        prompt = to_conversation(row, "sharegpt", turns=turns)
    # implicit: the shared leading messages are the prompt, each side's last turn its completion
    else:
        chosen, rejected = _messages(row["chosen"], "chosen", turns), _messages(row["rejected"], "rejected", turns)
        if len(chosen) < 2 or chosen[:-1] != rejected[:-1] or chosen[-1]["role"] != "assistant":
            raise UserError("'chosen' and 'rejected' must be conversations that differ only in their last, "
                            "assistant turn (or give a 'prompt' column)")
        return chosen[:-1], chosen[-1]["content"], rejected[-1]["content"]
    if not prompt or prompt[-1]["role"] == "assistant":
        raise UserError("the prompt must end with a user turn (the completions answer it)")
    return prompt, _answer(row["chosen"], "chosen", turns), _answer(row["rejected"], "rejected", turns)


def to_unpaired(row: dict[str, Any], turns: Turns = Turns()) -> tuple[list[dict[str, str]], str, bool]:
    """One KTO record as (the prompt's messages, the completion, whether it is desirable)."""
    label = row["label"]
    if not (isinstance(label, bool) or label in (0, 1)):
        raise UserError(f"'label' must be true (desirable) or false; got {label!r}")
    prompt = _messages(row["prompt"], "prompt", turns)
    if not prompt or prompt[-1]["role"] == "assistant":
        raise UserError("the prompt must end with a user turn (the completion answers it)")
    return prompt, _answer(row["completion"], "completion", turns), bool(label)


# beside the chosen's; `empty`: a completion empty or whitespace-only (`blank`), the row kept untrained: its
# end-of-turn token alone would be trained as the answer, so the objective would push a model towards, or
# away from, saying nothing. Its `targets` stay 0, so `table_stats` drops it, and the data line says why
# (`toolkit.train.output.report_data`)
PAIR_COLUMNS = {"rejected_input_ids": ("int32",), "rejected_labels": ("int32",), "empty": "bool"}
KTO_COLUMNS = {"kl_input_ids": ("int32",), "kl_labels": ("int32",), "desirable": "bool", "empty": "bool"}


def encode_pairs(rows: list[dict], indices: list[int], fmt: str, data: DataConfig, source,
                 tokenizer) -> dict[str, list]:
    """Preference records as the prepared table's columns: the chosen sequence in `input_ids`/`labels`,
    the rejected one in `rejected_*`, each prompt + completion through the chat template with labels on
    the completion (its last assistant turn) only; `length` is both sequences' tokens, `targets` the
    fewer of their completion tokens (a pair left without one on either side is not trained), 0 for a
    pair with a `blank` side (`empty`). `source`: the `toolkit.data.formats.DataSource` read."""
    from toolkit.data.formats import with_system_prompt
    from toolkit.data.formats import record_place
    from toolkit.data.table import token_columns
    from toolkit.data.tokenize import encode_batch

    chats, added, empty = [], [], []
    for row, i in zip(rows, indices):
        try:
            prompt, chosen, rejected = to_pair(row, fmt, source.turns)
        except UserError as e:
            raise UserError(f"{source.flag} {record_place(source.path, i)}: {e}") from None
        # a text model's run (--images off): the prompt's text alone
        prompt = without_images(prompt) if has_images(prompt) else prompt
        given = with_system_prompt(prompt, data.system_prompt)
        added.append(given is not prompt)
        empty.append(blank(chosen) or blank(rejected))
        chats += [given + [{"role": "assistant", "content": chosen}],
                  given + [{"role": "assistant", "content": rejected}]]
    encs = encode_batch(tokenizer, chats, data.seq_len, False, last_turn=True)
    chosen, rejected = token_columns(encs[0::2]), token_columns(encs[1::2])
    return {"input_ids": chosen["input_ids"], "labels": chosen["labels"],
            "rejected_input_ids": rejected["input_ids"], "rejected_labels": rejected["labels"],
            "length": [a + b for a, b in zip(chosen["length"], rejected["length"])],
            "targets": [0 if e else min(a, b) for a, b, e in zip(chosen["targets"], rejected["targets"], empty)],
            "truncated": [a or b for a, b in zip(chosen["truncated"], rejected["truncated"])], "system_added": added,
            "empty": empty}


def prompt_length(labels: list[int]) -> int:
    """Tokens before the completion: up to the first label (a sequence encoded with `last_turn`)."""
    from toolkit.data.tokenize import IGNORE_INDEX

    return next((k for k, x in enumerate(labels) if x != IGNORE_INDEX), len(labels))


def kl_sequences(ids: list[list[int]], labels: list[list[int]], seq_len: int,
                 empty: list[bool] | None = None) -> tuple[list, list]:
    """KTO's mismatched sequences: example i's prompt with example i-1's completion (the first takes the
    last's), labels on that completion, cut to `seq_len` (TRL's KL completions, built by token).
    `empty`: rows dropped for a `blank` completion, passed over as partners (an empty completion would
    make a degenerate KL sample); such a row takes its own completion, never read."""
    from toolkit.data.tokenize import IGNORE_INDEX

    kept = [i for i in range(len(ids)) if not (empty and empty[i])]
    # k - 1 = -1: the last kept
    partner = {i: kept[k - 1] for k, i in enumerate(kept)}
    out_ids, out_labels = [], []
    for i in range(len(ids)):
        j = partner.get(i, i)
        p, q = prompt_length(labels[i]), prompt_length(labels[j])
        out_ids.append((ids[i][:p] + ids[j][q:])[:seq_len])
        out_labels.append(([IGNORE_INDEX] * p + labels[j][q:])[:seq_len])
    return out_ids, out_labels


def encode_kto(rows: list[dict], indices: list[int], fmt: str, data: DataConfig, source, tokenizer) -> dict[str, list]:
    """KTO's records (or pairs, split into a desirable and an undesirable example) as the prepared
    table's columns: each prompt + completion through the chat template with labels on the completion,
    `desirable`, and the KL estimate's sequence (`kl_sequences`; not trained, so not in `length`); an
    example with a `blank` completion is kept untrained (`targets` 0, `empty`)."""
    from toolkit.data.formats import record_place, with_system_prompt
    from toolkit.data.table import token_columns
    from toolkit.data.tokenize import encode_batch

    chats, desirable, added = [], [], []
    for row, i in zip(rows, indices):
        try:
            if fmt == "unpaired":
                prompt, completion, good = to_unpaired(row, source.turns)
                sides = [(completion, good)]
            else:
                prompt, chosen, rejected = to_pair(row, fmt, source.turns)
                sides = [(chosen, True), (rejected, False)]
        except UserError as e:
            raise UserError(f"{source.flag} {record_place(source.path, i)}: {e}") from None
        prompt = without_images(prompt) if has_images(prompt) else prompt
        given = with_system_prompt(prompt, data.system_prompt)
        for completion, good in sides:
            chats.append(given + [{"role": "assistant", "content": completion}])
            desirable.append(good)
            added.append(given is not prompt)
    # every chosen example, then every rejected one (TRL's unpairing): side by side, a rejected example's KL
    if fmt != "unpaired":
        order = list(range(0, len(chats), 2)) + list(range(1, len(chats), 2))
        # partner would
        chats, desirable, added = ([x[k] for k in order] for x in (chats, desirable, added))
        # be its own pair's chosen completion, its own prompt's: a matched sequence, not a mismatched one
    cols = token_columns(encode_batch(tokenizer, chats, data.seq_len, False, last_turn=True))
    empty = [blank(chat[-1]["content"]) for chat in chats]
    cols["targets"] = [0 if e else n for n, e in zip(cols["targets"], empty)]
    kl_ids, kl_labels = kl_sequences(cols["input_ids"], cols["labels"], data.seq_len, empty)
    return {**cols, "kl_input_ids": kl_ids, "kl_labels": kl_labels, "desirable": desirable, "system_added": added,
            "empty": empty}


def kto_balance(desirable: list[bool], desirable_weight: float, undesirable_weight: float) -> str:
    """The data line on KTO's balance: its counts and, where desirable weight x count over undesirable's is
    outside the 1 to 4/3 its authors advise (Ethayarajh et al. 2024, eq. 8; TRL warns alike), the
    weight that would bring it in."""
    good = sum(desirable)
    bad = len(desirable) - good
    line = f"data: {good} desirable and {bad} undesirable examples"
    ratio = desirable_weight * good / max(undesirable_weight * bad, 1e-12)
    if good and bad and not 1.0 <= ratio <= 4 / 3:
        low, high = undesirable_weight * bad / good, 4 / 3 * undesirable_weight * bad / good
        line += (f"; desirable weight x count is {ratio:.2f}x the undesirable's, outside the 1 to 4/3 KTO's authors "
                 f"advise: --desirable-weight {low:.2f} to {high:.2f} would bring it in")
    return line


def kl_rows(batch: list[dict]) -> list[dict]:
    """A KTO micro-batch's KL sequences, as rows to pad (`toolkit.data.collate`)."""
    return [{"input_ids": x["kl_input_ids"], "labels": x["kl_labels"]} for x in batch]


def kto_extras(batch: list[dict], kl: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A KTO micro-batch's extras beside its padded sequences: `pairs` (here the examples: the loss's
    normaliser), `desirable`, the KL sequences padded as their own batch (`kl`, as `kl_*`), and the
    precomputed reference log-probabilities (`ref_logps`, `ref_kl_logps`) where the rows carry them."""
    import torch

    out = {"pairs": torch.tensor(len(batch)), "desirable": torch.tensor([bool(x["desirable"]) for x in batch]),
           **{f"kl_{k}": v for k, v in kl.items()}}
    if "ref_logps" in batch[0]:
        ref = torch.tensor([x["ref_logps"] for x in batch], dtype=torch.float32)
        out.update(ref_logps=ref[:, 0].contiguous(), ref_kl_logps=ref[:, 1].contiguous())
    return out


def pair_rows(batch: list[dict]) -> list[dict]:
    """A micro-batch of pairs as 2 x len(batch) sequences, chosen at even rows, rejected at odd ones
    (`toolkit.data.collate` pads them and adds `pair_extras`)."""
    return [row for x in batch for row in ({"input_ids": x["input_ids"], "labels": x["labels"]},
                                           {"input_ids": x["rejected_input_ids"], "labels": x["rejected_labels"]})]


def pair_extras(batch: list[dict]) -> dict[str, torch.Tensor]:
    """`pairs`, the loss's normaliser (`toolkit.train.step.batch_counts`), and each pair's precomputed
    reference log-probabilities (`ref_logps`, (2P,)) where the rows carry them."""
    import torch

    out = {"pairs": torch.tensor(len(batch))}
    if "ref_logps" in batch[0]:
        out["ref_logps"] = torch.tensor([v for x in batch for v in x["ref_logps"]], dtype=torch.float32)
    return out
