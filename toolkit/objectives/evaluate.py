"""What every objective's evaluation shares: held-out rows in strided shards, and greedy samples of
--sample-prompts through the model being trained.

Each rank takes a strided shard of the examples (no padding with duplicates, unlike a sharded
training loader), and the sums are all-reduced, so the numbers are exact for any world size.
"""

from __future__ import annotations

from typing import Iterator

import torch

from toolkit.data import collate
from toolkit.data.image_rows import MediaCollate
from toolkit.data.tokenize import prompt_text


def sharded_batches(strategy, rows, batch_size: int, pad_id: int, device,
                    padding_free: bool = False) -> Iterator[tuple[dict, list[int]]]:
    """(a collated batch on `device`, the indices of `rows` it holds) for this rank: a strided shard
    (model-parallel peers take the same one), the same number of batches on every rank, so sharded
    models stay in lock-step: a rank out of rows gets a dummy batch and no indices (its sums weigh 0).
    `padding_free`: each batch's rows end to end in one row (`toolkit.data.packing.collate_padding_free`), as
    a padding-free run trains them (its reference pass: `toolkit.objectives.preference.reference`)."""
    from toolkit.data.packing import collate_padding_free

    rank, ranks = strategy.data.rank, strategy.data.ranks
    index = list(range(rank, len(rows), ranks))
    # rows with images (a Subset's too, the reference pass's): collated with their processor's inputs
    # (`toolkit.data.image_rows.ImageRows`)
    processor = getattr(rows, "processor", None) or getattr(getattr(rows, "dataset", None), "processor", None)
    for i in range(-(-len(rows) // (batch_size * ranks))):
        held = index[i * batch_size:(i + 1) * batch_size]
        chosen = [rows[j] for j in (held or index[:1] or [0])]
        batch = MediaCollate(processor, pad_id, padding_free, whole=True)(chosen) if processor is not None else \
            collate_padding_free(chosen, pad_id, whole=True) if padding_free else collate(chosen, pad_id)
        yield {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}, held


@torch.no_grad()
# compiled blocks keep their training graphs
@torch.compiler.set_stance("force_eager")
def sample_completions(strategy, model, tokenizer, prompts: list[str], max_new_tokens: int) -> list[str]:
    """Greedy completions of `prompts` (each a user turn, rendered with the run's chat template) by
    the model being trained, through the same forward as the eval loss: the prepared model, so ZeRO-3
    and FSDP gather and the TP layers exchange inside it, every rank in lock-step (same prompts, same
    number of steps). One left-padded batch; the prompt runs once, then one token per forward through
    the model's KV cache (a model that returns none runs the whole sequence again each token);
    positions counted from each prompt's first token as `generate` counts them."""
    texts = [prompt_text(tokenizer, [{"role": "user", "content": p}]) for p in prompts]
    old_side, tokenizer.padding_side = tokenizer.padding_side, "left"
    try:
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    finally:
        tokenizer.padding_side = old_side
    device = strategy.eval_device(model)
    ids, mask = enc["input_ids"].to(device), enc["attention_mask"].to(device)
    start, pad = ids.shape[1], tokenizer.pad_token_id
    done = torch.zeros(len(texts), dtype=torch.bool, device=device)
    step_ids, cache, name = ids, None, cache_kwarg(model)
    model.eval()
    try:
        for _ in range(max_new_tokens):
            positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -step_ids.shape[1]:]
            out = model(input_ids=step_ids, attention_mask=mask, position_ids=positions, use_cache=True,
                        **{name: cache})
            cache = out.get(name)
            nxt = torch.where(done, torch.full_like(done, pad, dtype=ids.dtype),
                              out.logits[:, -1].argmax(-1).to(ids.dtype))
            ids = torch.cat([ids, nxt[:, None]], dim=1)
            mask = torch.cat([mask, (~done).to(mask.dtype)[:, None]], dim=1)
            done |= nxt == tokenizer.eos_token_id
            step_ids = ids if cache is None else nxt[:, None]
    finally:
        model.train()
    return [t.strip() for t in tokenizer.batch_decode(ids[:, start:], skip_special_tokens=True)]


def cache_kwarg(model) -> str:
    """What the model's forward calls its KV cache: `cache` in transformers 5.x since it was renamed,
    `past_key_values` before (the old name still works there, with a warning at every call)."""
    import inspect

    from transformers import PreTrainedModel

    hf = next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)
    return "cache" if hf is not None and "cache" in inspect.signature(hf.forward).parameters else "past_key_values"


