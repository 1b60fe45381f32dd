"""One optimizer step with no host sync, and the window of steps between two metrics records.

A GPU runs ahead of the Python that launches its work only while nothing reads a value back: each
`.item()`, `.tolist()` or `float(tensor)` waits for every kernel queued before it. So a step keeps
its numbers on the device: the global batch's target count (all-reduced) scales the loss as a
tensor, the loss sum and the gradient norm stay tensors, and a non-finite step is skipped inside the
fused AdamW kernel (its `found_inf`, which is how torch's GradScaler skips a step without a sync).
`Window` keeps the steps since the last metrics record; `host` reads them back once per record, and
a CPU test counts its calls (tests/test_train.py).

Where the skip cannot happen on the device (an optimizer without the fused kernel, or fp16's
GradScaler, which sets `found_inf` itself), the step reads its finiteness back (`sync_free` False).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from toolkit.data.packing import count_examples
from toolkit.data.labels import count_targets


def host(t: torch.Tensor) -> list[float]:
    """The one way the loop reads device values back (a sync on a GPU): a flat list of numbers."""
    return t.detach().to(torch.float64).cpu().reshape(-1).tolist()


def sync_free(optimizer, accelerator, always_steps: bool) -> bool:
    """Whether a non-finite step can be skipped on the device: AdamW's fused kernel takes `found_inf`
    (an optimizer without it, or fp16's GradScaler, which owns that attribute, cannot)."""
    inner = getattr(optimizer, "optimizer", optimizer)
    fused = all(g.get("fused") for g in inner.param_groups)
    return fused and getattr(accelerator, "scaler", None) is None and not always_steps


def batch_counts(micro: list[dict], device: torch.device) -> torch.Tensor:
    """(what the loss is normalised by: target tokens, pairs for a preference objective, --objective grpo's
    `units` (completions or their tokens, by --loss-type); real tokens;
    examples; computed tokens: rows x width, padding included) of this rank's micro-batches, float64 on the
    device. The last is a shape the host knows: a fill, no copy."""
    ids = micro[0]["input_ids"]
    computed = torch.full((), sum(b["input_ids"].numel() for b in micro), dtype=torch.long, device=ids.device)
    return torch.stack([sum(b["units"] if "units" in b else b["pairs"] if "pairs" in b else count_targets(b["labels"])
                            for b in micro),
                        sum(b["attention_mask"].sum() for b in micro),
                        sum(count_examples(b) for b in micro), computed]).to(device, torch.float64)


@dataclass
class Step:
    """One step's numbers, on the device."""
    # the global batch's summed token loss
    loss: torch.Tensor
    # its (target tokens, real tokens, examples, computed tokens)
    counts: torch.Tensor
    grad_norm: torch.Tensor | None
    # loss and gradient norm finite: the update was applied
    finite: torch.Tensor
    # the router load-balancing loss x target tokens (in `loss` x its coefficient)
    aux: torch.Tensor | None = None
    # the objective's metric sums (`Loss.take_metrics`)
    objective: torch.Tensor | None = None
    # an MoE model's tokens per expert, (MoE layers, experts) (`RouterLoad`)
    load: torch.Tensor | None = None


# a step's columns in `Window.read`: its 4 counts, finite, loss, grad norm, aux
FIXED = 8


@dataclass
class Window:
    """The steps since the last metrics record, kept on the device until `read`."""
    # when it began (eval and sample time is added, to keep it out of tokens/s)
    t0: float
    steps: list[tuple[int, Step]] = field(default_factory=list)

    def add(self, step: int, s: Step) -> None:
        self.steps.append((step, s))

    def tokens(self) -> int:
        """Real tokens of the finite steps so far (a read-back: for checkpoints, not every step)."""
        if not self.steps:
            return 0
        return int(host(sum(s.counts[1] * s.finite for _, s in self.steps))[0])

    def read(self) -> dict:
        """The window's sums over its finite steps, and each step's (step, finite, loss, grad norm),
        read back in one transfer: the one sync of a logged step."""
        rows = []
        for _, s in self.steps:
            norm = s.grad_norm if s.grad_norm is not None else torch.full((), float("nan"))
            aux = s.aux if s.aux is not None else torch.zeros(())
            rows.append(torch.cat([s.counts.to(torch.float64),
                                   torch.stack([s.finite.to(torch.float64), s.loss.to(torch.float64),
                                                torch.as_tensor(norm).to(s.loss.device, torch.float64),
                                                aux.to(s.loss.device, torch.float64)]),
                                   *([s.objective.to(s.loss.device, torch.float64)] if s.objective is not None
                                     else []),
                                   *([s.load.reshape(-1).to(s.loss.device, torch.float64)] if s.load is not None
                                     else [])]))
        values = host(torch.stack(rows))
        # FIXED columns, the objective's sums, the expert load
        width = len(values) // len(self.steps)
        per = [values[i * width:(i + 1) * width] for i in range(len(self.steps))]
        good = [v for v in per if v[4]]
        has_aux = any(s.aux is not None for _, s in self.steps)
        last = self.steps[-1][1]
        pref_end = FIXED + (last.objective.numel() if last.objective is not None else 0)
        return {"loss": sum(v[5] for v in good), "targets": sum(v[0] for v in good),
                "tokens": sum(v[1] for v in good), "examples": sum(v[2] for v in good),
                "computed": sum(v[3] for v in good), "aux": sum(v[7] for v in good) if has_aux else None,
                "objective": [sum(v[i] for v in good) for i in range(FIXED, pref_end)] if pref_end > FIXED else None,
                "load": (torch.tensor([sum(v[i] for v in good) for i in range(pref_end, width)]).view(last.load.shape)
                         if last.load is not None else None),
                "steps": [(step, bool(v[4]), v[5], v[6] if s.grad_norm is not None else None)
                          for (step, s), v in zip(self.steps, per)]}
