"""Conversations -> token ids + labels, with prompt tokens masked to -100.

The chat is rendered once with the tokenizer's chat template; each assistant message is then
located in the rendered text (in order) and the tokens whose character offsets overlap it, plus the
special end-of-turn token right after it, are trained. Working on offsets rather than on re-rendered
prefixes means any template works, even ones that rewrite earlier turns, and every assistant turn of
a multi-turn chat is trained. An empty or whitespace-only answer is never trained (`blank`): its turn
has no span, so it adds no label (trained, its end-of-turn token alone would teach the model to answer
with nothing), and an example whose answers are all empty gets no label at all (`Encoded.empty`), so
it is dropped and counted as one cut to nothing by --seq-len is.
"""

from __future__ import annotations

from dataclasses import dataclass

from toolkit.errors import UserError

IGNORE_INDEX = -100

# Used when a tokenizer ships no chat template (base models, tiny test tokenizers). Each message is
# `<|role|>\n{content}{eos}\n`; the generation prompt is `<|assistant|>\n`. It is saved with the
# tokenizer so generation after training uses the same layout.
FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def ensure_chat_template(tokenizer) -> bool:
    """Give the tokenizer the fallback template if it has none; True if it was added."""
    if getattr(tokenizer, "chat_template", None):
        return False
    tokenizer.chat_template = FALLBACK_CHAT_TEMPLATE
    return True


@dataclass
class Encoded:
    input_ids: list[int]
    labels: list[int]
    truncated: bool
    # every answer (or the text) empty or whitespace-only: no label, the example is dropped
    empty: bool = False
    # empty assistant turns left untrained in an example that trains others
    blank_turns: int = 0


def blank(text: str) -> bool:
    """An empty or whitespace-only answer or text: nothing to train on."""
    return not text.strip()


def empty_answers(example: list[dict[str, str]] | str) -> tuple[bool, int]:
    """(whether every answer of `example` is `blank` (a plain text: whether it is), its blank assistant
    turns). A conversation without an assistant turn is not empty: it has no answer to be empty."""
    if isinstance(example, str):
        return blank(example), 0
    # content parts (`toolkit.data.images`): their text
    answers = [blank(m["content"] if isinstance(m["content"], str) else
                     "".join(p.get("text", "") for p in m["content"])) for m in example if m["role"] == "assistant"]
    return bool(answers) and all(answers), sum(answers)


def encode(tokenizer, example: list[dict[str, str]] | str, seq_len: int, train_on_prompt: bool) -> Encoded:
    return encode_batch(tokenizer, [example], seq_len, train_on_prompt)[0]


def encode_batch(tokenizer, examples: list, seq_len: int, train_on_prompt: bool,
                 last_turn: bool = False) -> list[Encoded]:
    """Conversations and texts tokenized in one call to the tokenizer (its Rust batch path: no
    per-example call overhead); the same ids as one call per example. `last_turn`: only the last
    assistant turn is trained (a preference pair's completion; earlier turns are its prompt). An example
    whose answers are all empty (`empty_answers`) gets no label, under `train_on_prompt` too: its
    rendered empty turn would still teach an empty answer; other empty turns are left untrained."""
    out: list[Encoded | None] = [None] * len(examples)
    texts = [i for i, x in enumerate(examples) if isinstance(x, str)]
    if texts:
        batch = tokenizer([examples[i] for i in texts], add_special_tokens=True)["input_ids"]
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        for i, ids in zip(texts, batch):
            ids = ids + eos
            empty = blank(examples[i])
            labels = [IGNORE_INDEX] * len(ids) if empty else list(ids)
            out[i] = Encoded(ids[:seq_len], labels[:seq_len], len(ids) > seq_len, empty)
    chats = [i for i, x in enumerate(examples) if not isinstance(x, str)]
    if any(isinstance(m["content"], list) for i in chats for m in examples[i]):
        raise UserError("an example holds images, but --model is a text-only model (no vision_config in its "
                        "config.json); train an image-text model, or drop the images")
    if chats:
        # The end-of-turn marker right after an answer (<|im_end|>, <|eot_id|>, </s>, ...) is trained
        # too, so the model learns to stop: any special token that directly follows the content.
        specials = sorted({t for t in tokenizer.all_special_tokens if t}, key=len, reverse=True)
        rendered = [_render_chat(tokenizer, examples[i], specials) for i in chats]
        enc = tokenizer([text for text, _ in rendered], add_special_tokens=False, return_offsets_mapping=True)
        for i, (_, spans), ids, offsets in zip(chats, rendered, enc["input_ids"], enc["offset_mapping"]):
            empty, blanks = empty_answers(examples[i])
            if empty:
                labels = [IGNORE_INDEX] * len(ids)
            elif train_on_prompt:
                # every token trains, as asked: an empty turn among others too
                labels, blanks = list(ids), 0
            else:
                labels = _answer_labels(ids, offsets, [s for s in (spans[-1:] if last_turn else spans) if s])
            out[i] = Encoded(ids[:seq_len], labels[:seq_len], len(ids) > seq_len, empty, blanks)
    return out


def _render_chat(tokenizer, messages: list[dict[str, str]],
                 specials: list[str]) -> tuple[str, list[tuple[int, int] | None]]:
    """(the chat rendered by its template, the character spans of the assistant answers in it; None for
    a `blank` answer, which is not looked for: "" is found anywhere, and the special token after it
    would be the previous turn's)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    spans: list[tuple[int, int] | None] = []
    cursor = 0
    for m in messages:
        if m["role"] == "assistant" and blank(m["content"]):
            spans.append(None)
            continue
        start = text.find(m["content"], cursor)
        if start < 0:
            raise UserError("the chat template dropped or rewrote a message's text, so prompt and answer "
                            "cannot be told apart; use --train-on-prompt or another template")
        end = start + len(m["content"])
        if m["role"] == "assistant":
            end += next((len(t) for t in specials if text.startswith(t, end)), 0)
            spans.append((start, end))
        cursor = end
    return text, spans


def _answer_labels(ids: list[int], offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """Each token's id where its characters overlap an answer span, else -100."""
    labels = [IGNORE_INDEX] * len(ids)
    j = 0
    for i, (s, e) in enumerate(offsets):
        while j < len(spans) and spans[j][1] <= s:
            j += 1
        if j < len(spans) and e > spans[j][0] and s < spans[j][1]:
            labels[i] = ids[i]
    return labels


def prompt_text(tokenizer, messages: list[dict[str, str]]) -> str:
    """The conversation up to (and including) the assistant generation prompt."""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
