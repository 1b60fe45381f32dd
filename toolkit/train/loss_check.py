"""Before step 1, what a run computes is checked against what the model computes: the loss this layout
trains (its head, the model's logit transforms, the router loss, the slices or stages it cuts) against
`model(input_ids, labels=...)`; with --packing or padding-free rows, a row's documents against each run
alone. A check that fails stops the run in one line (`--loss auto` falls back to full logits first), so no run
trains another objective while every later check passes: the integrity check compares the saved
model with the trained one, never with the loss that trained it.

Both run without gradients, in eval mode (dropout would make the two sides differ, and neither may draw
random numbers the run would then not draw), and eagerly where blocks are compiled (`--compile`: the
checks' shapes would only add recompiles; what they check is the model's math, not the compiler's).
`run` is `toolkit.train.loop.Run`.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from toolkit.errors import UserError
from toolkit.train.numerics import agreement, mean_agreement
from toolkit.parallel import rank_max


@contextmanager
def evaluating(model) -> Iterator[None]:
    """No gradients, eval mode, no compiled code: the model as the checks run it; train mode after."""
    model.eval()
    try:
        with torch.no_grad(), torch.compiler.set_stance("force_eager"):
            yield
    finally:
        model.train()


def checked_dtype(run) -> torch.dtype:
    """The least precise dtype the checked forwards compute in: autocast's (the run's), or a weight's
    (a LoRA base loaded in bf16, a DeepSpeed bf16 module)."""
    dtypes = {run.dtype} | {p.dtype for p in run.model.parameters() if p.is_floating_point()}
    return max(dtypes, key=lambda d: torch.finfo(d).eps)


def check_loss(run, batch: dict) -> None:
    """Before step 1: on the first rows of the first micro-batch, the loss this layout trains (its
    head, its transforms, the router's load-balancing loss) must equal the model's own forward loss
    (`model(input_ids, labels=...)`) within rounding. If not, `--loss auto` falls back to full
    logits and says so; otherwise the run stops with one line naming the model type and the head.
    Every rank checks its own rows; they agree on the worst. The bound is the dtype's (`mean_agreement`:
    1e-4 in fp32, 2.4e-4 in bf16)."""
    # above the bar
    strategy, accelerator, log = run.strategy, run.strategy.accelerator, run.metrics.write
    model_type = strategy.unwrap(run.model).config.get_text_config().model_type
    bound = mean_agreement(checked_dtype(run))
    # the second: --loss auto's fall-back to full logits
    for attempt in range(2):
        with evaluating(run.model):
            got = strategy.loss_check(run.model, batch, full_logits=attempt == 1)
        ours, own = (got.ours, got.own) if got.ours is not None else (0.0, 0.0)
        gap = abs(ours - own) / max(abs(own), 1e-12) if got.ours is not None else 0.0
        gap = float(rank_max(accelerator, torch.tensor([gap], device=accelerator.device)).item())
        if gap <= bound:
            log(f"loss check: {'full logits give' if attempt else 'the loss trained is'} model type {model_type}'s "
                f"own on the first rows (relative gap {gap:.1e})")
            # in step 1's record
            run.memory["loss_check_gap"] = gap
            return
        seen = f"{ours:.6f} against the model's own {own:.6f}" if got.ours is not None else "on another rank"
        if attempt == 0 and run.cfg.train.loss == "auto" and got.fused:
            log(f"loss check: {got.head} gave {seen} on model type {model_type} (relative gap {gap:.1e} > "
                f"{bound:.1e}): --loss auto falls back to full logits")
            continue
        raise UserError(f"loss check: the loss this run would train ({got.head}) is not model type {model_type}'s own: "
                        f"relative gap up to {gap:.1e} (> {bound:.1e}) on the first rows; "
                        + ("use --loss full, which runs the model's own logits" if got.fused
                           else "this layout does not compute what the model computes: run it on another layout"))


def check_causal(run, batch: dict) -> None:
    """An image-text run, before step 1: replacing the first row's last target token must leave every earlier
    position's last hidden state as it was. With the inputs its processor gives, a model can let text attend to
    later tokens (PaliGemma's prefix-LM: its processor's token_type_ids, all 0 without a `suffix`, make the whole
    row one bidirectional block): the run would learn answers it can see, so it stops in one line. Every rank
    checks its own rows (two forwards each, so sharded forwards stay in step); they agree on the worst."""
    from toolkit.data.packing import model_inputs
    from toolkit.data.tokenize import IGNORE_INDEX

    strategy, accelerator = run.strategy, run.strategy.accelerator
    model = strategy.unwrap(run.model)
    ids, labels = batch["input_ids"], batch["labels"][0]
    targets = (labels != IGNORE_INDEX).nonzero()
    t = int(targets[-1]) if len(targets) else ids.shape[1] - 1
    # another of the row's targets, a text token (or the next id where the row has one target alone)
    others = labels[(labels != IGNORE_INDEX) & (labels != ids[0, t])]
    changed = ids.clone()
    changed[0, t] = others[0] if len(others) else (ids[0, t] + 1) % model.config.get_text_config().vocab_size
    # the language model's last hidden states (one tensor, no full logits: `logits_to_keep` 1)
    seen = []
    decoder = model.get_decoder()
    hook = decoder.register_forward_hook(lambda module, args, out: seen.append(out[0][0, :t].float()))
    try:
        with evaluating(run.model):
            for x in (ids, changed):
                run.model(**model_inputs({**batch, "input_ids": x}), logits_to_keep=1)
    finally:
        hook.remove()
    gap = (seen[1] - seen[0]).abs().max() / seen[0].abs().max().clamp(min=1e-12)
    gap = float(rank_max(accelerator, gap.reshape(1)).item())
    run.memory["causal_check_gap"] = gap
    bound = agreement(checked_dtype(run))
    if gap > bound:
        raise UserError(f"model type {model.config.model_type}: with the inputs its processor gives (token_type_ids: "
                        f"{'media:token_type_ids' in batch}), a token sees later ones (changing the first row's last "
                        f"target token moved the earlier positions by {gap:.1e} relative, over {bound:.1e}): it "
                        "would learn answers it can see (a prefix-LM such as PaliGemma's); not yet trained here")


def packing_gaps(packed: torch.Tensor, alone: torch.Tensor, n: int) -> tuple[float, float]:
    """(first document's gap, second's): the largest |packed - alone| over each document's positions,
    relative to the largest |alone| logit. Neither run lets the first document see the second (both are
    causal), so its gap is the two forwards' rounding alone; a mask that lets the second document see the
    first shows in the second's gap only."""
    scale = alone.abs().max().clamp(min=1e-12)
    diff = (packed - alone).abs()
    return float(diff[:, :n].max() / scale), float(diff[:, n:].max() / scale)


def leaks(rounding: float, gap: float, dtype: torch.dtype) -> bool:
    """Whether the second document's `gap` is more than rounding: above what two kernels computing in
    `dtype` differ by (`agreement`) and above 4x the first document's gap, this forward's own rounding
    measured beside it (a kernel noisier than the dtype's bound says is not a leak). A leak is of
    another order: gpt-oss's packed rows, whose mask ignores the positions, differ by ~1e-1 or more."""
    return gap > max(agreement(dtype), 4 * rounding)


def check_packing(run, batch: dict, n: int = 8) -> None:
    """--packing or padding-free rows (`toolkit.data.packing.collate_padding_free`), before step 1: two
    documents laid end to end in one row must give the logits each gives alone, within rounding (`leaks`).
    The model's own attention keeps packed documents apart only where its forward builds the mask from the
    positions (gpt-oss's does not: its packed rows attend across documents); the padding-free kernels do it
    by construction. The documents are the first 2n
    tokens of the batch, the same shapes on every rank, so sharded forwards stay in step."""
    strategy, accelerator = run.strategy, run.strategy.accelerator
    ids = batch["input_ids"][:1, :2 * n]
    n = ids.shape[1] // 2
    positions = torch.cat([torch.arange(n), torch.arange(n)]).to(ids.device)[None]
    with evaluating(run.model):
        packed = run.model(input_ids=ids[:, :2 * n], position_ids=positions, use_cache=False).logits.float()
        alone = torch.cat([run.model(input_ids=ids[:, :n], use_cache=False).logits.float(),
                           run.model(input_ids=ids[:, n:2 * n], use_cache=False).logits.float()], 1)
    gaps = torch.tensor(packing_gaps(packed, alone, n), device=ids.device)
    rounding, gap = rank_max(accelerator, gaps).tolist()
    dtype = checked_dtype(run)
    # in step 1's record
    run.memory["packing_check_gap"] = gap
    if leaks(rounding, gap, dtype):
        unwrapped = strategy.unwrap(run.model)
        model_type = unwrapped.config.get_text_config().model_type
        impl = unwrapped.config.get_text_config()._attn_implementation
        bound = max(agreement(dtype), 4 * rounding)
        packing = run.cfg.data.packing
        raise UserError(f"{'--packing' if packing else 'padding-free rows'}: model type {model_type}'s {impl} "
                        f"attention does not keep a {'packed' if packing else 'padding-free'} row's documents "
                        f"apart (the second document's logits differ from it run alone by up to {gap:.1e} relative, "
                        f"over the {bound:.1e} that {str(dtype).removeprefix('torch.')} rounding explains; the first "
                        f"document's differ by {rounding:.1e}): its forward builds the mask without the positions; "
                        + ("drop --packing" if packing else "pass --no-padding-free")
                        + ("" if impl == "packed_fa" else ", or use --attn flash on a GPU with flash-attn"))
