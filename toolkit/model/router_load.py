"""How an MoE model's routers spread its tokens over the experts, so a collapsing router is seen.

transformers 5 calls every routed-experts module of every MoE architecture the same way,
`experts(hidden_states, top_k_index, top_k_weights)` (Mixtral, Qwen3-MoE, DeepSeek-V3; gpt-oss names
them `router_indices`, `routing_weights`), whatever the experts' form inside: the model says where its experts are by
that signature, and a
forward pre-hook on each counts the tokens routed to each expert, on the device (no read-back), for
the training forwards only (not evaluation, a reference or a KL forward without gradients, nor the
recomputation of a checkpointed block in backward). Padding is not counted where the 2-D mask the
model was called with lines up with the tokens the block routes (padded rows; not a context-parallel
slice, a pipeline's stages, which never call the model's own forward, or packed rows, whose padding is
a row's tail alone: there padding counts).

The record's figures (`load_stats`), each expert's tokens over its layer's mean (1 is an even share):
`expert_load_min` and `expert_load_max`, the least and most loaded expert of any MoE layer, and
`expert_load_cv`, the coefficient of variation (std / mean) of tokens per expert, averaged over the
MoE layers. They are ratios, so the counts' sum over ranks needs no normaliser.

Idle experts (`idle_warning`): the first logging window in which some expert of a layer received no
token, while the window's tokens gave that layer's experts at least `IDLE_MIN_MEAN` (32) each on
average, prints one line naming the layers, once a run (the counts are summed over ranks, so every
rank agrees, and the main process prints). Why 32: were the routing even, an expert's tokens in such a
window would be about Poisson with a mean of 32 or more, empty with chance e^-32 (1e-14) or less, so a
zero there is the router, not a small window's luck; a smaller window (a tiny run's first steps) says
nothing either way.
"""

from __future__ import annotations

import re

import torch
from torch import nn

# where the model says its experts are
from toolkit.model.kernels import INDEX_NAMES, experts_modules

def load_stats(counts: torch.Tensor) -> dict[str, float]:
    """From (MoE layers, experts) token counts: the least and most loaded expert's tokens over its
    layer's mean, and the coefficient of variation per layer, averaged (module docstring)."""
    counts = counts.double()
    mean = counts.mean(1, keepdim=True)
    # a layer no token reached (a pipeline stage's, say) says nothing
    used = mean[:, 0] > 0
    if not used.any():
        return {}
    share = counts[used] / mean[used]
    cv = counts[used].std(1, unbiased=False) / mean[used, 0]
    return {"expert_load_min": share.min().item(), "expert_load_max": share.max().item(),
            "expert_load_cv": cv.mean().item()}


# tokens per expert a layer must average in a window before an empty expert is said
IDLE_MIN_MEAN = 32.0


def idle_experts(counts: torch.Tensor, min_mean: float = IDLE_MIN_MEAN) -> dict[int, int]:
    """{MoE layer (its index among them): experts that received no token} over the layers whose experts
    averaged at least `min_mean` tokens in the window (module docstring: below it a zero may be luck)."""
    counts = counts.double()
    mean, idle = counts.mean(1).tolist(), (counts == 0).sum(1).tolist()
    return {i: int(n) for i, (m, n) in enumerate(zip(mean, idle)) if m >= min_mean and n}


def idle_warning(counts: torch.Tensor, layers: list[str], step: int, min_mean: float = IDLE_MIN_MEAN) -> str | None:
    """The line for a window whose routers left experts without a token (`idle_experts`), or None:
    which layers and how many of their experts, so a collapsing router is seen before the run ends."""
    idle = idle_experts(counts, min_mean)
    if not idle:
        return None
    experts = counts.shape[1]
    shown = [f"{n} of {experts} experts in {layers[i]}" if not j else f"{n} of {experts} in {layers[i]}"
             for j, (i, n) in enumerate(list(idle.items())[:4])]
    more = f" and in {len(idle) - 4} more layers" if len(idle) > 4 else ""
    return (f"expert load: the window ending at step {step} routed no token to {', '.join(shown)}{more} ({len(idle)} "
            f"of {len(counts)} MoE layers), where an even spread gives each expert at least {min_mean:g} tokens: the "
            f"routers send their tokens to fewer experts. expert_load_min/max in metrics.jsonl follow it; "
            f"--router-aux-loss-coef weighs the load-balancing loss that spreads them (said once a run)")


def layer_label(name: str) -> str:
    """'layer 3' for a module named 'model.layers.3.mlp.experts' (the block index, as configs count
    layers), else the name itself."""
    found = re.search(r"\.(\d+)\.", f".{name}.")
    return f"layer {found.group(1)}" if found else name


class RouterLoad:
    """Tokens per expert of every MoE layer since the last `take`, (layers, experts) on the device."""

    def __init__(self, model: nn.Module, modules: list[nn.Module]):
        # all of them under --ep
        self.experts = max(getattr(m, "ep_experts", m.num_experts) for m in modules)
        names = {id(m): n for n, m in model.named_modules()}
        # idle_warning's
        self.layers = [layer_label(names.get(id(m), f"MoE layer {i}")) for i, m in enumerate(modules)]
        self.counts: torch.Tensor | None = None
        # the 2-D attention mask of the forward running, flattened
        self.mask: torch.Tensor | None = None
        self.handles = [model.register_forward_pre_hook(self._keep_mask, with_kwargs=True)]
        self.handles += [m.register_forward_pre_hook(self._counter(i, len(modules)), with_kwargs=True)
                         for i, m in enumerate(modules)]

    @classmethod
    def attach(cls, model: nn.Module) -> "RouterLoad | None":
        """Counting hooks on `model`'s experts, or None for a dense model."""
        modules = experts_modules(model)
        return cls(model, modules) if modules else None

    def _keep_mask(self, module, args, kwargs) -> None:
        mask = kwargs.get("attention_mask")
        self.mask = mask.reshape(-1) if torch.is_tensor(mask) and mask.dim() == 2 else None

    def _counter(self, layer: int, layers: int):
        def count(module, args, kwargs) -> None:
            if not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:
                # a forward without gradients, or a checkpointed block recomputed in backward
                return
            index = args[1] if len(args) > 1 else next(kwargs[n] for n in INDEX_NAMES if n in kwargs)
            # (tokens, top-k)
            index = index.reshape(len(index), -1)
            weights = None
            if self.mask is not None and self.mask.numel() == len(index):
                weights = self.mask.to(index.device, torch.float32).repeat_interleave(index.shape[1])
            seen = torch.bincount(index.reshape(-1), weights=weights, minlength=self.experts + 1)[:self.experts]
            if self.counts is None:
                self.counts = torch.zeros(layers, self.experts, dtype=torch.float64, device=index.device)
            self.counts[layer] += seen.to(self.counts.dtype)
        return count

    def take(self, device: torch.device) -> torch.Tensor:
        """The counts since the last call: zeros on a rank whose forwards reached none of the MoE
        layers (a pipeline stage without one), so every rank reduces the same shape."""
        taken, self.counts = self.counts, None
        return taken if taken is not None else torch.zeros(len(self.handles) - 1, self.experts, dtype=torch.float64,
                                                           device=device)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
