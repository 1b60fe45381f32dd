"""The tensor-parallel plan applied in place to a loaded model (full or peft-LoRA) by slicing its full
weights. What is split comes from the config's `base_model_tp_plan` (transformers' own), read by
`toolkit.layout.tp_regions` into regions; the layout rules ask the same reading before the weights load,
so a plan the layers cannot express never gets here. Which blocks each region splits is `tp_fit`,
asked of a meta-device copy of the model before the weights load too (and by the planner of each
tp row), then again here on the loaded model.

Per region of every decoder block, with t ranks:
    local     columns keep their output split: rank i keeps q heads i*n/t .. (i+1)*n/t - 1 and the
              same kv heads (the q/kv group ratio is kept), or its slice of the intermediate; a packed
              projection (Phi-3's qkv_proj, gate_up_proj) its slice of every part. The region's input
              is copied into it once and the row layer's output all-reduced once: 2 all-reduces of
              b*s*h per block each way, as Megatron's fused QKV / gate-up. Attention modules reshape
              with -1 heads; the head counts a region reads (its attributes, its config) become the
              local ones.
    gathered  each column all-gathers its output and the row splits its input (the plan's
              colwise_gather_output / rowwise_split_input): what sits in between runs whole on every
              rank (OLMo 2's norm over every head), with whole gradients.

A routed-experts region (`moe_tp_experts`: Megatron's expert tensor parallel) splits every expert's
intermediate: the stacked column [E, 2I, H] by rows (gate and up part by part), the row [E, H, I] by
columns; the experts module's inputs (the tokens, their routing weights) are copied in and its output
all-reduced, so the router, whole on every rank, gets whole gradients and the same top-k everywhere.
LoRA on stacked experts (peft's target_parameters) is not split: refused in one line. Under expert
parallel (`skip_experts`) the routed experts are left whole: expert parallel splits them over the TP
group instead, each TP rank dispatching its 1/tp of the tokens (`toolkit.parallel.ep`; an expert is cut
by TP or by EP, never both).

LoRA adapters follow their base layer in a local region: column -> lora_A replicated (its gradient
summed over ranks), lora_B split by output rows (by parts where packed); row -> lora_A split by input
columns (its r-dim output all-reduced), lora_B replicated. A row layer's LoRA dropout draws the
full-width mask and keeps its slice (ShardedDropout), so TP and non-TP runs drop the same features.
In a gathered region adapters stay whole: they see the whole input and add to the whole output.
Replicated modules the plan names inside a local region (Qwen3's q/k norms) get a gradient
all-reduce hook. Embeddings, norms, the LM head and plan entries outside the blocks stay whole.

How each parameter was cut is written once, as it is cut, into the run's table of cuts
(`toolkit.parallel.cut.Cut`, by the full model's parameter names), not on the parameters or the layers: a
slice's dim (`Packed` by parts), this rank's place and the TP group (`Slice`), and the replicated parameters
whose gradients are per-rank partial sums (`Cut.partial`), which FSDP2, replacing the parameters and their
hooks, reduces again (`Parallelized.reduce_partial_grads`).
"""

from __future__ import annotations

import inspect

from torch import nn

from toolkit.errors import UserError
from toolkit.layout.tp_regions import NotExpressible, Region, TPPlan, packed_parts, read_tp_plan
from toolkit.parallel.cut import Cut, Packed, Slice, split_of
from toolkit.parallel.tp.comm import all_reduce_grad, copy_to_tp, group_size, reduce_from_tp
from toolkit.parallel.tp.layers import ColumnParallelLinear, RowParallelLinear, ShardedDropout, shard

LOCAL_SIZES = ("num_attention_heads", "num_heads", "num_key_value_heads", "intermediate_size")

# the run's table of cuts: full parameter name -> how the plan cut it
Record = dict[str, Cut]


def text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def tp_plan_of(config) -> TPPlan:
    """The config's `base_model_tp_plan` (a class attribute, not in `to_dict()`), read; the layout
    rules' words where the layers cannot express it."""
    text = text_config(config)
    try:
        return read_tp_plan(getattr(text, "base_model_tp_plan", None))
    except NotExpressible as e:
        raise UserError(f"--tp: {getattr(text, 'model_type', '?')}: {e}") from None


def _decoder(model) -> nn.Module:
    """The module the plan's names start from: the text model (`get_decoder`), under peft too."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.get_decoder() if hasattr(base, "get_decoder") else getattr(base, "base_model", base)


def decoder_blocks(model, path: str | None = None) -> list[nn.Module]:
    """The decoder blocks: the text model's module list at `path` (the TP plan's 'layers'), by default
    its one list of blocks (`layers`, GPT-2's `h`)."""
    decoder = _decoder(model)
    if path is not None:
        lists = [decoder.get_submodule(path)] if _has(decoder, path) else []
    else:
        lists = [m for m in decoder.children() if isinstance(m, nn.ModuleList)]
        if len(lists) > 1:
            n = getattr(text_config(model.config), "num_hidden_layers", None)
            lists = [m for m in lists if len(m) == n]
    if len(lists) != 1 or not isinstance(lists[0], nn.ModuleList):
        found = ", ".join(f"{n}: {type(m).__name__}" for n, m in decoder.named_children())
        raise UserError(f"--tp: cannot find the decoder blocks{f' at {path}' if path else ''} in "
                        f"{type(decoder).__name__}; found modules: {found}")
    return list(lists[0])


def _has(module: nn.Module, name: str) -> bool:
    """Whether `module` has a submodule (or, a routed-experts module's stacked weight, a parameter) `name`."""
    for get in (module.get_submodule, module.get_parameter):
        try:
            get(name)
            return True
        except AttributeError:
            pass
    return False


class LocalConfig:
    """The model's config as one TP rank's region reads it: its own head counts and intermediate
    size (Phi-3's attention slices its fused qkv at `config.num_attention_heads * head_dim`), every
    other value the shared config's, live (an attention implementation set later included)."""

    def __init__(self, config, t: int):
        self.__dict__["_config"] = config
        for name in LOCAL_SIZES:
            value = getattr(config, name, None)
            if isinstance(value, int):
                self.__dict__[name] = value // t

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.__dict__["_config"], name)

    def __setattr__(self, name: str, value) -> None:
        setattr(self.__dict__["_config"], name, value)


def _region_parts(module: nn.Module, region: Region, config, t: int) -> dict[str, tuple[int, ...]] | None:
    """The parts of each column in a gathered region, where each is a packed projection the widths
    name (`packed_parts`) and nothing else holds parameters in between: then the region runs local.
    None: it runs gathered, as the plan says."""
    others = [n for n, _ in module.named_parameters()
              if not any(n.startswith(p + ".") for p in (*region.columns, region.row))]
    if others:
        return None
    heads = getattr(config, "num_attention_heads", None)
    kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(module, "head_dim", None) or getattr(config, "head_dim", None) or (
        config.hidden_size // heads if heads else None)
    row_in = _linear(module, region.row).in_features
    parts = {}
    for column in region.columns:
        found = heads and head_dim and packed_parts(_linear(module, column).out_features, row_in, heads, kv,
                                                    head_dim, getattr(config, "intermediate_size", None))
        if not found or any(p % t for p in found):
            return None
        parts[column] = found
    return parts


def _linear(parent: nn.Module, name: str) -> nn.Module:
    target = parent.get_submodule(name)
    # peft LoRA wraps the nn.Linear
    return getattr(target, "base_layer", target)


def _tp_cut(split: "int | Packed", group) -> Cut:
    """A TP slice along `split`: this rank's of the group's."""
    import torch.distributed as dist

    t = group_size(group)
    return Cut(tp=Slice(split, dist.get_rank(group) if t > 1 else 0, t, group))


def _shard(full: nn.Parameter, dim: int, group, record: Record, name: str,
           parts: tuple[int, ...] | None = None) -> nn.Parameter:
    """`shard`, recording how the new parameter (`name`, in the full model) was cut."""
    record[name] = _tp_cut(split_of(dim, parts), group)
    return shard(full, dim, group, parts)


def _shard_projection(parent: nn.Module, name: str, kind: str, group, where: str, record: Record, at: str,
                      parts: tuple[int, ...] | None = None, gathered: bool = False) -> None:
    """Replace `parent`'s projection `name` (`at`: `parent`'s name in the model) by its column or row layer,
    and its LoRA adapters by theirs, recording each cut parameter."""
    # an nn.Linear: `_check_region`
    target, base = parent.get_submodule(name), _linear(parent, name)
    try:
        if kind == "column":
            sharded = ColumnParallelLinear.from_linear(base, group, gather_output=gathered, copy_input=gathered,
                                                       parts=parts)
        else:
            sharded = RowParallelLinear.from_linear(base, group, input_is_parallel=not gathered)
    except ValueError as e:
        raise UserError(f"--tp {group_size(group)}: {where}.{name}: {e}") from None
    at = f"{at}.{name}"
    layer = at if target is base else f"{at}.base_layer"
    record[f"{layer}.weight"] = _tp_cut(split_of(0, parts) if kind == "column" else 1, group)
    # a row layer's bias is whole, added after the sum
    if kind == "column" and sharded.bias is not None:
        record[f"{layer}.bias"] = _tp_cut(split_of(0, parts), group)
    if target is base:
        owner, _, leaf = name.rpartition(".")
        setattr(parent.get_submodule(owner) if owner else parent, leaf, sharded)
        return
    target.base_layer = sharded
    # adapters whole: they read the whole input and add to the whole output
    if gathered:
        return
    target.in_features, target.out_features = sharded.in_features, sharded.out_features
    for adapter in target.lora_A:
        lora_a, lora_b = target.lora_A[adapter], target.lora_B[adapter]
        if kind == "column":
            lora_b.weight = _shard(lora_b.weight, 0, group, record, f"{at}.lora_B.{adapter}.weight", parts)
            if lora_b.bias is not None:
                lora_b.bias = _shard(lora_b.bias, 0, group, record, f"{at}.lora_B.{adapter}.bias", parts)
            lora_b.out_features = lora_b.weight.shape[0]
            # replicated inside the region: each rank's gradient is partial
            for n, p in lora_a.named_parameters():
                _sum_grad(p, group, record, f"{at}.lora_A.{adapter}.{n}")
        # lora_B stays whole: its gradient comes from the reduced output
        else:
            lora_a.weight = _shard(lora_a.weight, 1, group, record, f"{at}.lora_A.{adapter}.weight")
            lora_a.in_features = lora_a.weight.shape[1]
            lora_a.register_forward_hook(lambda _m, _args, out: reduce_from_tp(out, group))
            dropout = target.lora_dropout[adapter]
            if isinstance(dropout, nn.Dropout) and dropout.p > 0:
                target.lora_dropout[adapter] = ShardedDropout(dropout.p, group)


def _sum_grad(p: nn.Parameter, group, record: Record, name: str) -> None:
    if p.requires_grad:
        p.register_hook(all_reduce_grad(group))
        # for FSDP2, which replaces the parameter (and its hook)
        record[name] = Cut(partial=True)


def _copy_input(module: nn.Module, group):
    """A pre-hook copying the region's input (its forward's first argument) into the TP region."""
    first = next(iter(inspect.signature(module.forward).parameters))

    def hook(_module, args, kwargs):
        if args:
            return (copy_to_tp(args[0], group), *args[1:]), kwargs
        return args, {**kwargs, first: copy_to_tp(kwargs[first], group)}
    return hook


def _holds(block: nn.Module, region: Region) -> bool:
    """Whether `block` has `region`'s module and every projection the plan names in it (a routed-experts
    module: itself, whatever wraps its weights)."""
    if region.experts:
        return _has(block, region.path)
    return _has(block, region.path) and all(_has(block.get_submodule(region.path), n)
                                            for n in (*region.columns, region.row))


def nested_regions(block: nn.Module, regions: tuple[Region, ...]) -> tuple[str, str] | None:
    """Two regions `block` holds one inside the other (their paths), or None: each would copy its input
    in and reduce its output, the inner one inside the outer's split."""
    held = [r.path for r in regions if _holds(block, r)]
    return next(((a, b) for a in held for b in held if b.startswith(a + ".")), None)


def _check_region(i: int, block: nn.Module, region: Region, blocks: str) -> None:
    """Block i's module for `region` against the plan, before anything is split: every projection and
    replicated module it names, each projection an nn.Linear, and (a region split locally) no parameter
    between them without a style."""
    module = block.get_submodule(region.path)
    missing = [f"{region.path}.{n}" for n in (*region.columns, region.row, *region.replicated) if not _has(module, n)]
    if missing:
        found = ", ".join(f"{n}: {type(m).__name__}" for n, m in module.named_children())
        raise UserError(f"--tp: block {i} ({type(block).__name__}) has no {', '.join(missing)}; its "
                        f"base_model_tp_plan does not fit '{blocks}.{i}.{region.path}' (found {found})")
    owned = (*region.columns, region.row, *region.replicated)
    stray = [n for n, _ in module.named_parameters() if not any(n.startswith(o + ".") for o in owned)]
    # a per-head weight (Cohere's qk norms) would not fit this rank's heads
    if stray and not region.gathered:
        raise UserError(f"--tp: {blocks}.{i}.{region.path}.{stray[0]} sits between the column and row projections "
                        "but base_model_tp_plan gives it no style; drop --tp for this model")
    for kind, name in [*(("column", c) for c in region.columns), ("row", region.row)]:
        base = _linear(module, name)
        if type(base) is not nn.Linear:
            raise UserError(f"--tp: {blocks}.{i}.{region.path}.{name} is a {type(base).__name__}, not the linear "
                            f"layer the plan's {kind} projection splits")


def _split_experts(module: nn.Module, region: Region, group, where: str, record: Record, at: str) -> str:
    """Split a routed-experts module's stacked projections in place (module docstring)."""
    t = group_size(group)
    for name in (*region.columns, region.row):
        if hasattr(module, "base_layer") or not isinstance(module._parameters.get(name), nn.Parameter) or \
                getattr(module, name).dim() != 3:
            raise UserError(f"--tp: {where}.{name} is not a stacked [experts, out, in] weight (LoRA on the experts "
                            "wraps them; TP does not split those adapters yet): use --method full, or drop --tp")
    try:
        # a fused gate_up is [gate; up], chunked in two by every transformers 5
        for name in region.columns:
            # experts forward, so split by parts even where the plan says colwise
            full = getattr(module, name)
            parts = (full.shape[1] // 2,) * 2 if name in region.packed or "gate_up" in name else None
            setattr(module, name, _shard(full, 1, group, record, f"{at}.{name}", parts))
        setattr(module, region.row, _shard(getattr(module, region.row), 2, group, record, f"{at}.{region.row}"))
    except ValueError as e:
        raise UserError(f"--tp {t}: {where}: {e}") from None
    for attr in ("intermediate_dim", "intermediate_size", "moe_intermediate_size"):
        if isinstance(getattr(module, attr, None), int):
            setattr(module, attr, getattr(module, attr) // t)
    names = list(inspect.signature(module.forward).parameters)

    # the tokens and their routing weights: whole gradients back
    def copy_in(_module, args, kwargs):
        args = [copy_to_tp(a, group) if i in (0, 2) else a for i, a in enumerate(args)]
        kwargs = {k: copy_to_tp(v, group) if k in (names[0], names[2]) else v for k, v in kwargs.items()}
        return tuple(args), kwargs

    module.register_forward_pre_hook(copy_in, with_kwargs=True)
    module.register_forward_hook(lambda _m, _args, out: reduce_from_tp(out, group))
    return f"{region.path} {' '.join(region.columns)} -> {region.row} (every expert's intermediate)"


def _split_region(module: nn.Module, region: Region, group, config, where: str, record: Record, at: str) -> str:
    """Split one block's `region` in place (`at`: its module's name in the model), recording each
    parameter's cut; returns how (for the describe line)."""
    t = group_size(group)
    if region.experts:
        return _split_experts(module, region, group, where, record, at)
    parts = {c: (_linear(module, c).out_features // 2,) * 2 for c in region.packed}
    if region.gathered:
        found = _region_parts(module, region, config, t)
        local, parts = found is not None, found or {}
    # a parameter between the projections without a style: refused by `tp_fit`
    else:
        local = True
    for column in region.columns:
        _shard_projection(module, column, "column", group, where, record, at, parts.get(column), gathered=not local)
    _shard_projection(module, region.row, "row", group, where, record, at, gathered=not local)
    if not local:
        return f"{region.path} {' '.join(region.columns)} -> {region.row} (gathered in between)"
    module.register_forward_pre_hook(_copy_input(module, group), with_kwargs=True)
    for name in region.replicated:
        for n, p in module.get_submodule(name).named_parameters():
            _sum_grad(p, group, record, f"{at}.{name}.{n}")
    # some modules keep their own head counts
    for attr in LOCAL_SIZES:
        if isinstance(getattr(module, attr, None), int):
            setattr(module, attr, getattr(module, attr) // t)
    if hasattr(module, "config"):
        module.config = LocalConfig(module.config, t)
    columns = " ".join(c + (f" [{len(parts[c])} parts]" if c in parts else "") for c in region.columns)
    return f"{region.path} {columns} -> {region.row}"


def tp_fit(model: nn.Module, plan: TPPlan) -> list[tuple[int, Region]]:
    """Where each region of `plan` applies: (block index, region) for every block that holds it (MoE and
    dense blocks differ), checked against the module tree only (no weights, no group: the layout rules
    and the planner ask it of a meta-device copy, `tp_tree_problems`). A region that no block holds is
    no error where another region in the same module of the block applies: the plan names every kind
    of that module (Qwen3-MoE's dense `mlp` and routed `mlp.experts`) and this model has some only
    (every layer routed: `mlp_only_layers` empty). Refused, in the run's words: no decoder
    blocks, nested regions in one block, a region whose module lacks a projection the plan names, has one
    that is not an nn.Linear or an unstyled parameter between them, a region matching nothing with no
    such alternative (a plan whose names this model does not use)."""
    blocks = decoder_blocks(model, plan.blocks)
    for i, block in enumerate(blocks):
        nested = nested_regions(block, plan.regions)
        if nested:
            raise UserError(f"--tp: block {i} holds both '{nested[0]}' and '{nested[1]}', which "
                            "base_model_tp_plan splits as regions of their own: the TP layers do not nest them")
    fit = [(i, region) for region in plan.regions for i, block in enumerate(blocks) if _applies(block, region, plan)]
    held = {region.path for _, region in fit}
    for region in plan.regions:
        # the block's module the region sits in: `mlp`, `self_attn`
        slot = region.path.split(".")[0]
        if not any(path.split(".")[0] == slot for path in held):
            raise UserError(f"--tp: base_model_tp_plan region '{plan.blocks}.*.{region.path}' matches no module in "
                            f"{type(blocks[0]).__name__}")
    for i, region in fit:
        # an experts module's weights are checked as they are split
        if not region.experts:
            _check_region(i, blocks[i], region, plan.blocks)
    return fit


def _applies(block: nn.Module, region: Region, plan: TPPlan) -> bool:
    """Whether `region` splits `block`: it holds the region's projections, or (a dense region) it has the
    region's module and no region nested in it applies instead (`_check_region` then names what is missing)."""
    return _holds(block, region) or (_has(block, region.path) and not region.experts and not any(
        _holds(block, r) for r in plan.regions if r.path.startswith(region.path + ".")))


def tp_tree_problems(config, trust_remote_code: bool = False) -> list[str]:
    """`tp_fit` on a meta-device copy of the architecture (no weights are read): the module-tree part of
    --tp's rules, asked before the weights load and by the planner of each tp row. The plan's own
    reading and the divisibility of the widths: `toolkit.layout.rules.tp_plan_problems` and
    `tp_divisibility_problems`."""
    from toolkit.parallel.meta import meta_model

    skeleton = meta_model(config, trust_remote_code)
    try:
        tp_fit(skeleton, tp_plan_of(skeleton.config))
    except UserError as e:
        return [str(e)]
    return []


def apply_tensor_parallel(model: nn.Module, group, cuts: Record | None = None,
                          skip_experts: bool = False) -> nn.Module:
    """Shard `model` in place over `group`; returns it, and writes how it cut each parameter into
    `cuts` (the run's table, by name: `toolkit.parallel.cut`). `skip_experts`: leave the routed-experts
    regions whole (expert parallel then splits the experts over this TP group: `toolkit.parallel.ep`).
    Every rank must call this with identical full weights (same checkpoint, same seed for LoRA init)."""
    t = group_size(group)
    if t == 1:
        return model
    plan = tp_plan_of(model.config)
    config = text_config(model.config)
    blocks = decoder_blocks(model, plan.blocks)
    # the regions' modules stay, their projections change
    names = {id(m): n for n, m in model.named_modules()}
    how, record = {}, cuts if cuts is not None else {}
    for i, region in tp_fit(model, plan):
        if region.experts and skip_experts:
            how[region.path] = f"{region.path} whole (expert parallel over the TP group)"
            continue
        module = blocks[i].get_submodule(region.path)
        how[region.path] = _split_region(module, region, group, config, f"{plan.blocks}.{i}.{region.path}", record,
                                         names[id(module)])
    unknown = set(record) - dict(model.named_parameters()).keys()
    # the names the plan wrote are the model's own, or the table would miss its cuts
    if unknown:
        raise RuntimeError(f"--tp: cuts recorded under names the model does not have: {sorted(unknown)[:3]}")
    outside = ", ".join(plan.outside + ("lm_head",))
    # not `tp_size`: transformers reserves that for its own TP
    model.toolkit_tp = (f"tensor parallel over {t} ranks from base_model_tp_plan, per block: "
                        f"{'; '.join(how.values())}; whole on every rank (always correct): embeddings, norms, "
                        f"{outside}")
    return model
