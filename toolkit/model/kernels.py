"""What a model runs its layers with: its routed experts (found by their forward's signature;
--experts), the router's load-balancing loss at load (--router-aux-loss-coef), Liger-Kernel's fused
kernels (--kernels liger), its decoder blocks and --compile's backend."""

from __future__ import annotations

import inspect

import torch

from toolkit.config import ModelConfig
from toolkit.errors import UserError

# an experts forward's second parameter: each token's experts
INDEX_NAMES = ("top_k_index", "router_indices")


def experts_modules(model) -> list:
    """The model's routed-experts modules, in its order: those whose forward takes (hidden_states,
    each token's top-k experts, their weights) and that know their `num_experts`."""
    found = []
    for module in model.modules():
        if not isinstance(getattr(module, "num_experts", None), int):
            continue
        try:
            params = tuple(inspect.signature(module.forward).parameters)[:3]
        except (TypeError, ValueError):
            continue
        if len(params) == 3 and params[0] == "hidden_states" and params[1] in INDEX_NAMES:
            found.append(module)
    return found


def experts_line(m: ModelConfig, skeleton) -> str:
    """'; experts: grouped_mm' for an MoE model (what `--experts` asks, or transformers' choice), '' for a
    dense one; --experts on a dense model is refused in one line."""
    if not experts_modules(skeleton):
        if m.experts != "auto":
            raise UserError(f"--experts {m.experts}: {type(skeleton).__name__} has no routed experts; "
                            "leave the flag out")
        return ""
    if m.experts != "auto":
        try:
            skeleton.set_experts_implementation(m.experts)
        except (ValueError, ImportError) as e:
            raise UserError(f"--experts {m.experts}: {' '.join(str(e).split())}; use --experts auto") from None
    return f"; experts: {skeleton.config._experts_implementation} (transformers' experts_implementation)"


def router_kwargs(m: ModelConfig) -> dict:
    """--router-aux-loss-coef as config overrides at load: the coefficient, and the router logits the model
    must return for its forward to compute the load-balancing loss (off at 0)."""
    coef = m.router_aux_loss_coef
    return {} if coef is None else {"router_aux_loss_coef": coef, "output_router_logits": coef > 0}


def kernels_problem() -> str | None:
    """Why --kernels liger cannot run here, or None."""
    import importlib.util

    if not torch.cuda.is_available():
        return "--kernels liger runs Triton kernels, which need a CUDA GPU; leave --kernels out on this machine"
    if importlib.util.find_spec("liger_kernel") is None:
        return ("--kernels liger needs the liger-kernel package, which is not installed: pip install 'toolkit[gpu]' "
                "(or leave --kernels out)")
    return None


def decoder_layers(model) -> list[torch.nn.Module]:
    """The decoder blocks (`model.model.layers` of a causal LM, under a peft wrapper too); [] where the
    model keeps them elsewhere."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return list(getattr(getattr(base, "model", None), "layers", None) or [])


# torch.compile's backend for --compile (`toolkit.parallel.parallelize.apply_compile`); a test seam: the suite
# compiles with "aot_eager" (dynamo and AOTAutograd, without inductor's C++ build on a 2-core CPU)
COMPILE_BACKEND_ENV = "TOOLKIT_COMPILE_BACKEND"


def apply_liger(model) -> None:
    """--kernels liger: Liger-Kernel's fused RMSNorm, SwiGLU and RoPE (Triton) patched into this model's
    modules; its fused linear cross-entropy is --loss liger. One line where it cannot run."""
    problem = kernels_problem()
    if problem:
        raise UserError(problem)
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    try:
        _apply_liger_kernel_to_instance(model=model, rope=True, swiglu=True, rms_norm=True, cross_entropy=False,
                                        fused_linear_cross_entropy=False)
    except (TypeError, ValueError, KeyError) as e:
        raise UserError(f"--kernels liger: Liger-Kernel has no kernels for this model ({model.config.model_type}: "
                        f"{e}); leave --kernels out") from None
