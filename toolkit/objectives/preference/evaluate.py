"""A preference objective's evaluation on held-out pairs (KTO's examples): its loss and TRL's metrics."""

from __future__ import annotations

import torch

from toolkit.objectives.evaluate import sharded_batches


@torch.no_grad()
# compiled blocks keep their training graphs
@torch.compiler.set_stance("force_eager")
def eval_preference(strategy, model, rows, batch_size: int, pad_id: int, objective) -> dict[str, float]:
    """A preference objective on held-out pairs (KTO's examples): its mean loss per pair (`eval_loss`;
    ORPO's NLL over all the held-out chosen tokens, as training's over the global batch's) and TRL's
    metrics (`eval_rewards/accuracies`, ...), means over the pairs; sharded as `eval_loss`. From the
    layout's whole-row log-probabilities (`Strategy.sequence_logps`), so a pipeline's too; KTO's KL
    estimate from each batch alone (TRL's, in evaluation). `objective`: the run's `PreferenceLoss`."""
    from toolkit.data.labels import shift_labels
    from toolkit.data.tokenize import IGNORE_INDEX
    from toolkit.objectives.preference.functions import (
        orpo_nll_tokens,
        orpo_rows,
        pairs_in,
    )

    accelerator = strategy.accelerator
    model.eval()
    # pair loss, pairs, ORPO's NLL and its tokens, then the metrics' sums
    total = None
    try:
        for batch, held in sharded_batches(strategy, rows, batch_size, pad_id, strategy.eval_device(model)):
            logps = strategy.sequence_logps(model, batch)
            # through the layout's `strategy.sequence_logps`
            ref = objective.reference_logps(model, batch)
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
