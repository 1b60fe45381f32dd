"""Which of a model's Linears LoRA can wrap (a probe of each class's forward on meta tensors), and
--lora-targets checked against them."""

from __future__ import annotations

import copy
import inspect
import warnings

import torch

from toolkit.errors import UserError

# rows of the probe's input: divisible by every group count up to 16, for a forward that splits its rows
# into groups (meta tensors: the size costs nothing)
PROBE_ROWS = 720720


def keeps_linear_contract(module: torch.nn.Linear) -> bool:
    """Whether peft's LoRA can wrap this Linear: its wrapper adds x A^T B^T, of shape (..., out_features),
    to whatever the module returns. torch's own forward returns that tensor. A subclass that overrides
    forward may not: an MoE router that returns (scores, logits) (Llama 4's, PhiMoE's) crashes peft,
    which reads `.dtype` from the tuple; so does DeepSeek-V4's grouped output projection, whose tensor has
    another shape. Such a forward runs once on a weightless replica (its parameters and buffers as meta
    tensors: no memory, no arithmetic, the module itself untouched, partitioned ZeRO-3 weights by their
    full shape) with PROBE_ROWS rows of in_features, and must return one tensor of PROBE_ROWS rows of
    out_features. Where that probe cannot run (a kernel without a meta version), the forward's return
    annotation decides: a tuple is refused, anything else kept."""
    forward = type(module).forward
    if forward is torch.nn.Linear.forward or type(module.weight) not in (torch.nn.Parameter, torch.Tensor):
        # torch's forward; or a quantized layer (bitsandbytes' Params4bit), which peft dispatches itself
        return True

    def meta(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else torch.empty(tuple(getattr(t, "ds_shape", t.shape)), dtype=t.dtype, device="meta")

    replica = copy.copy(module)
    replica._parameters = {k: meta(v) for k, v in module._parameters.items()}
    replica._buffers = {k: meta(v) for k, v in module._buffers.items()}
    # no jitter noise or sampling in the probe
    replica.training = False
    try:
        with torch.no_grad(), warnings.catch_warnings():
            # whatever the probe's forward says of meta tensors is not the user's
            warnings.simplefilter("ignore")
            rows = torch.empty(PROBE_ROWS, module.in_features, dtype=replica.weight.dtype, device="meta")
            out = forward(replica, rows)
        return isinstance(out, torch.Tensor) and tuple(out.shape) == (PROBE_ROWS, module.out_features)
    except Exception:  # noqa: BLE001 - the probe could not run: the annotation is what is known
        returns = inspect.signature(forward).return_annotation
        text = returns if isinstance(returns, str) else repr(returns)
        return not text.lower().startswith(("tuple", "typing.tuple"))


def untargetable_linears(model) -> dict[str, str]:
    """{module name: class name} of the Linears LoRA must leave alone (`keeps_linear_contract`), each
    class probed once."""
    verdicts: dict[type, bool] = {}
    found = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            kind = type(module)
            if kind not in verdicts:
                verdicts[kind] = keeps_linear_contract(module)
            if not verdicts[kind]:
                found[name] = kind.__name__
    return found


def check_lora_targets(model, targets: list[str]) -> None:
    """Each name in --lora-targets is the leaf name of some Linear that LoRA can wrap; one that is only
    a Linear LoRA cannot wrap (`keeps_linear_contract`) is named as such."""
    skipped = untargetable_linears(model)
    present = {n.rsplit(".", 1)[-1] for n, mod in model.named_modules() if n not in skipped and (
        isinstance(mod, torch.nn.Linear) or type(mod).__name__.startswith("Linear"))}
    refused = {n.rsplit(".", 1)[-1]: kind for n, kind in skipped.items()}
    for t in targets:
        if t not in present and t in refused:
            raise UserError(f"--lora-targets {t}: {refused[t]} subclasses nn.Linear but does not return one tensor "
                            "of its out_features (an MoE router returns scores and logits), so LoRA cannot wrap it; "
                            "leave it out")
    missing = [t for t in targets if t not in present]
    if missing:
        raise UserError(f"--lora-targets {', '.join(missing)} match no module of this model; "
                        f"linear modules are: {', '.join(sorted(present))}")
