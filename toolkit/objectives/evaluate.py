"""Eval loss over held-out data and exact-match accuracy of greedy answers.

Each rank takes a strided shard of the examples (no padding with duplicates, unlike a sharded
training loader), and the sums are all-reduced, so the numbers are exact for any world size.
"""

from __future__ import annotations

from typing import Iterator

import torch

from toolkit.data import collate
from toolkit.data.tokenize import prompt_text
from toolkit.data.labels import count_targets


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
    for i in range(-(-len(rows) // (batch_size * ranks))):
        held = index[i * batch_size:(i + 1) * batch_size]
        chosen = [rows[j] for j in (held or index[:1] or [0])]
        batch = collate_padding_free(chosen, pad_id, whole=True) if padding_free else collate(chosen, pad_id)
        yield {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}, held


@torch.no_grad()
@torch.compiler.set_stance("force_eager")  # compiled blocks keep their training graphs
def eval_loss(strategy, model, rows: list[dict], batch_size: int, pad_id: int) -> float:
    """Mean token loss over `rows`; `strategy` (toolkit.parallel.strategy) runs the forward."""
    accelerator = strategy.accelerator
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=accelerator.device)
    for batch, held in sharded_batches(strategy, rows, batch_size, pad_id, strategy.eval_device(model)):
        loss = strategy.eval_loss_sum(model, batch).to(accelerator.device)
        total += bool(held) * torch.stack([loss.double(), count_targets(batch["labels"]).double().to(accelerator.device)])
    total = accelerator.reduce(total, "sum")  # model-parallel peers count both sums as often: the ratio holds
    model.train()
    return (total[0] / total[1]).item()


@torch.no_grad()
@torch.compiler.set_stance("force_eager")  # compiled blocks keep their training graphs
def exact_match(strategy, model, tokenizer, conversations: list, answers: list[str],
                batch_size: int = 16, max_new_tokens: int = 16) -> tuple[int, int, list[str]]:
    """(correct, total, rank-0 samples): greedy completion of each prompt vs the expected answer."""
    accelerator = strategy.accelerator
    model.eval()
    gen_model = strategy.unwrap(model)
    # Before prepare() the model is still where it was loaded (CPU, or its device_map for QLoRA).
    device = next(gen_model.parameters()).device
    prompts = [prompt_text(tokenizer, [m for m in c if m["role"] != "assistant"]) for c in conversations]
    rank, ranks, replicas = strategy.data.rank, strategy.data.ranks, strategy.data.replicas
    idx = list(range(rank, len(prompts), ranks))
    per_rank = -(-len(prompts) // ranks)
    idx += [idx[0] if idx else 0] * (per_rank - len(idx))  # equal work on every rank; padding not scored
    n_real = len(range(rank, len(prompts), ranks))
    old_side, tokenizer.padding_side = tokenizer.padding_side, "left"
    correct, samples = 0, []
    for start in range(0, len(idx), batch_size):
        chunk = idx[start:start + batch_size]
        enc = tokenizer([prompts[i] for i in chunk], return_tensors="pt", padding=True,
                        add_special_tokens=False).to(device)
        out = gen_model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id, use_cache=True,
                                 synced_gpus=accelerator.num_processes > 1)
        texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        for j, (i, text) in enumerate(zip(chunk, texts)):
            if start + j < n_real:
                correct += text.strip() == answers[i].strip()
                if len(samples) < 3:
                    question = next(m["content"] for m in reversed(conversations[i]) if m["role"] == "user")
                    samples.append(f"{question!r} -> {text.strip()!r} "
                                   f"(expected {answers[i]!r})")
    tokenizer.padding_side = old_side
    total = accelerator.reduce(torch.tensor([correct], device=accelerator.device), "sum").item() // replicas
    model.train()
    return int(total), len(prompts), samples


@torch.no_grad()
@torch.compiler.set_stance("force_eager")  # compiled blocks keep their training graphs
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
            nxt = torch.where(done, torch.full_like(done, pad, dtype=ids.dtype), out.logits[:, -1].argmax(-1).to(ids.dtype))
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


@torch.no_grad()
@torch.compiler.set_stance("force_eager")  # compiled blocks keep their training graphs
def eval_preference(strategy, model, rows, batch_size: int, pad_id: int) -> dict[str, float]:
    """A preference objective on held-out pairs (KTO's examples): its mean loss per pair (`eval_loss`;
    ORPO's NLL over all the held-out chosen tokens, as training's over the global batch's) and TRL's
    metrics (`eval_rewards/accuracies`, ...), means over the pairs; sharded as `eval_loss`. From the
    layout's whole-row log-probabilities (`Strategy.sequence_logps`), so a pipeline's too; KTO's KL
    estimate from each batch alone (TRL's, in evaluation)."""
    from toolkit.data.labels import shift_labels
    from toolkit.data.tokenize import IGNORE_INDEX
    from toolkit.objectives.preference.functions import orpo_nll_tokens, orpo_rows, pairs_in

    accelerator, objective = strategy.accelerator, strategy.objective
    model.eval()
    total = None  # pair loss, pairs, ORPO's NLL and its tokens, then the metrics' sums
    try:
        for batch, held in sharded_batches(strategy, rows, batch_size, pad_id, strategy.eval_device(model)):
            logps = strategy.sequence_logps(model, batch)
            ref = objective.reference_logps(model, batch)  # through the layout's `strategy.sequence_logps`
            if objective.kind.estimates_kl:
                objective.state.kl = objective.kl_estimate(model, [batch], lambda x: x, 1)
            counts = (shift_labels(batch["labels"]) != IGNORE_INDEX).sum(1).to(logps.device)
            loss = objective.loss_of(logps, counts, ref, batch.get("desirable"))
            nll = torch.zeros((), device=logps.device)
            if objective.kind.nll:
                nll = -strategy.sequence_logps(model, orpo_rows(batch)).sum()
            parts = torch.stack([t.to(accelerator.device, torch.float64) for t in
                                 (loss, torch.tensor(float(pairs_in(batch))), nll, orpo_nll_tokens(batch))])
            part = bool(held) * torch.cat([parts, objective.take_metrics().to(accelerator.device)])
            total = part if total is None else total + part
    finally:
        model.train()
    total = accelerator.reduce(total, "sum")
    pairs = total[1].clamp(min=1)
    loss = total[0] / pairs + (total[2] / total[3].clamp(min=1) if objective.kind.nll else 0.0)
    return {"eval_loss": float(loss), **{f"eval_{m}": v for m, v in objective.metric_values(total[4:], pairs).items()}}
