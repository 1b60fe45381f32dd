"""The tensor-parallel plan for Llama-family HF models (Llama, Mistral, Qwen2, Qwen3), applied in
place to a loaded model (full or peft-LoRA) by slicing its full weights. Which projections are
column- and row-parallel comes from the config's `base_model_tp_plan` (transformers' own), with
the hand-written Llama plan below as the fallback.

Per decoder block, with t ranks:
    attention: q/k/v column-parallel (whole heads: rank i keeps heads i*n/t .. (i+1)*n/t - 1, and
               the same for kv heads), o row-parallel; attention modules reshape with -1 heads, so
               they run on n/t query and n_kv/t kv heads unchanged (the q/kv group ratio is kept).
    MLP:       gate/up column-parallel, down row-parallel.
The block input is copied into the TP region once per attention and once per MLP (one backward
all-reduce each, as Megatron's fused QKV / gate-up do), and each row-parallel output is all-reduced
once: 2 all-reduces of b*s*h per block in forward and 2 in backward.

LoRA adapters follow their base layer: column -> lora_A replicated (its gradient is summed over
ranks), lora_B split by output rows; row -> lora_A split by input columns (its r-dim output is
all-reduced), lora_B replicated. Replicated parameters inside the region (column lora_A, Qwen3
q/k norms) get a gradient all-reduce hook. A row layer's LoRA dropout draws the full-width mask and
keeps its slice (ShardedDropout), so TP and non-TP runs drop the same features. Embeddings, norms
and the LM head stay replicated.
"""

from __future__ import annotations

from torch import nn

from toolkit.errors import UserError
from toolkit.parallel.tp.comm import all_reduce_grad, copy_to_tp, group_size, reduce_from_tp
from toolkit.parallel.tp.layers import ColumnParallelLinear, RowParallelLinear, ShardedDropout, shard

# The hand-written plan: the fallback for a config that declares no `base_model_tp_plan` we can run
ATTENTION = {"q_proj": "column", "k_proj": "column", "v_proj": "column", "o_proj": "row"}
MLP = {"gate_proj": "column", "up_proj": "column", "down_proj": "row"}
FALLBACK_PLAN = {"self_attn": ATTENTION, "mlp": MLP}
STYLES = {"colwise": "column", "rowwise": "row"}  # transformers' TP styles these layers implement


def block_plan(config) -> dict[str, dict[str, str]]:
    """{block submodule: {projection: column | row}}, read from the config's `base_model_tp_plan`
    (transformers' own, e.g. 'layers.*.self_attn.q_proj': 'colwise'). Parameters it marks
    'replicated_with_grad_allreduce' (Qwen3's q/k norms) are what every replicated parameter inside
    the TP region gets here anyway. A plan beyond per-block column/row pairs (vocab-parallel
    embeddings, packed or sequence-parallel styles) or none at all: the hand-written plan."""
    declared = getattr(config, "base_model_tp_plan", None) or {}
    plan: dict[str, dict[str, str]] = {}
    for key, style in declared.items():
        parts = key.split(".")
        if style == "replicated_with_grad_allreduce" and parts[:2] == ["layers", "*"]:
            continue
        if len(parts) != 4 or parts[:2] != ["layers", "*"] or style not in STYLES:
            return FALLBACK_PLAN
        plan.setdefault(parts[2], {})[parts[3]] = STYLES[style]
    # each region: columns in, exactly one row out (the all-reduce that closes it)
    if not plan or any(list(kinds.values()).count("row") != 1 for kinds in plan.values()):
        return FALLBACK_PLAN
    return plan


def decoder_blocks(model) -> list[nn.Module]:
    """The decoder blocks of a Llama-family model (or a peft model around one)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    inner = getattr(base, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        found = sorted({type(m).__name__ for m in base.children()} | {type(m).__name__ for m in (inner or base).children()})
        raise UserError(f"--tp: cannot find decoder blocks at model.model.layers in {type(base).__name__}; "
                        f"found modules: {', '.join(found)}")
    return list(layers)


def _check_block(i: int, block: nn.Module, plan: dict[str, dict[str, str]]) -> None:
    missing = [f"{sub}.{n}" for sub, kinds in plan.items() for n in kinds
               if getattr(block, sub, None) is None or not hasattr(getattr(block, sub), n)]
    if missing:
        found = ", ".join(f"{n}: {type(m).__name__}" for n, m in block.named_children())
        raise UserError(f"--tp: block {i} ({type(block).__name__}) has no {', '.join(missing)}; "
                        f"the Llama-family plan does not fit (found {found})")


def _shard_projection(parent: nn.Module, name: str, kind: str, group) -> None:
    target = getattr(parent, name)
    base = getattr(target, "base_layer", target)  # peft LoRA wraps the nn.Linear
    if kind == "column":
        sharded = ColumnParallelLinear.from_linear(base, group, gather_output=False, copy_input=False)
    else:
        sharded = RowParallelLinear.from_linear(base, group, input_is_parallel=True)
    if target is base:
        setattr(parent, name, sharded)
        return
    target.base_layer = sharded
    target.in_features, target.out_features = sharded.in_features, sharded.out_features
    for adapter in target.lora_A:
        lora_a, lora_b = target.lora_A[adapter], target.lora_B[adapter]
        if kind == "column":
            lora_b.weight = shard(lora_b.weight, 0, group)
            lora_b.out_features = lora_b.weight.shape[0]
        else:
            lora_a.weight = shard(lora_a.weight, 1, group)
            lora_a.in_features = lora_a.weight.shape[1]
            lora_a.register_forward_hook(lambda _m, _args, out: reduce_from_tp(out, group))
            lora_b.weight.tp_full_grad = True
            dropout = target.lora_dropout[adapter]
            if isinstance(dropout, nn.Dropout) and dropout.p > 0:
                target.lora_dropout[adapter] = ShardedDropout(dropout.p, group)


def _copy_hidden_states(group):
    def hook(_module, args, kwargs):
        if args:
            return (copy_to_tp(args[0], group), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": copy_to_tp(kwargs["hidden_states"], group)}
    return hook


def apply_tensor_parallel(model: nn.Module, group) -> nn.Module:
    """Shard `model` in place over `group`; returns it. Every rank must call this with identical
    full weights (same checkpoint, same seed for LoRA init)."""
    t = group_size(group)
    if t == 1:
        return model
    plan = block_plan(model.config)
    for i, block in enumerate(decoder_blocks(model)):
        _check_block(i, block, plan)
        for sub, kinds in ((getattr(block, name), kinds) for name, kinds in plan.items()):
            for name, kind in kinds.items():
                _shard_projection(sub, name, kind, group)
            sub.register_forward_pre_hook(_copy_hidden_states(group), with_kwargs=True)
            for p in sub.parameters():
                if p.requires_grad and not hasattr(p, "tp_split_dim") and not getattr(p, "tp_full_grad", False):
                    p.register_hook(all_reduce_grad(group))
                    p.tp_partial_grad = True  # for FSDP2, which replaces the parameter (and its hook)
        attn = block.self_attn
        for attr in ("num_heads", "num_key_value_heads"):  # some archs keep per-module head counts
            if isinstance(getattr(attn, attr, None), int):
                setattr(attn, attr, getattr(attn, attr) // t)
        attn.tp_degree = t
    model.toolkit_tp_degree = t  # not `tp_size`: transformers reserves that for its own TP
    return model
