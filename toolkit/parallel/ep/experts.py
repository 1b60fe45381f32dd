"""Expert parallel applied in place to a loaded model (full or peft-LoRA): every routed-experts module
keeps E/n of its experts, and its forward sends each token to the rank that holds its expert and takes
the result back (torchtitan's `ExpertParallel`, on transformers' own experts modules).

The model says where its experts are: transformers 5 calls every MoE architecture's experts as
`experts(hidden_states, top_k_index, top_k_weights)` (`toolkit.model.router_load.experts_modules`), with the
experts stacked along dim 0 of each weight ([E, 2I, H] and [E, H, I]; gpt-oss's transposed, with
biases [E, ...]). Rank r of an ep group of n keeps experts r*E/n .. (r+1)*E/n - 1 of each, and per
forward, over T tokens with k experts each:

    1. sort the T*k (token, expert) pairs by expert; count them per expert          [E] per rank
    2. exchange the counts (all-to-all): how many rows each rank sends to each of mine
    3. dispatch: all-to-all the pairs' hidden states to their experts' ranks         T*k x H sent
    4. run the module's own forward on what arrived, with local expert ids and weight 1 (so grouped_mm,
       batched_mm or eager, whichever `config._experts_implementation` chose, runs the local experts)
    5. combine: all-to-all the outputs back (step 3 reversed), scale by the routing weights and sum
       each token's k outputs, as the module would have

The routing weights are applied on the token's own rank, so the router's gradient never travels.
Under --tp the ep group is the TP group (torchtitan's etp=1 with ep = tp; benchmarks/etp.md): the TP
plan leaves the experts whole (`apply_tensor_parallel(skip_experts=True)`), TP peers hold the same
tokens and route them alike (the router is replicated), and each dispatches only its 1/tp of them
(`_split_tokens`, torchtitan's ReordererSequenceParallel); the experts' output, zero on the peers'
tokens, is summed over TP (Partial -> Replicate), so no token travels twice and no expert GEMM is cut.
LoRA on the experts (peft's `ParamWrapper`, target_parameters) is split with them: A [E*r, in] by its
expert-major rows, B [out, r*E] by its expert-minor columns (a `Packed` split of r parts of E).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch
from torch import nn

from toolkit.errors import UserError
from toolkit.parallel.cut import Cut, Packed, Slice
from toolkit.parallel.ep.comm import all_to_all, exchange_counts


def _peft_wrappers(model: nn.Module, experts: nn.Module) -> list[nn.Module]:
    """peft's ParamWrappers whose base layer is `experts` (one per adapted parameter, nested)."""
    return [m for m in model.modules() if hasattr(m, "parameter_name") and hasattr(m, "lora_A")
            and m.get_base_layer() is experts]


def _keep(p: nn.Parameter, rows: slice) -> nn.Parameter:
    return nn.Parameter(p.detach()[rows].clone(), requires_grad=p.requires_grad)


@dataclass
class ExpertShards:
    """What `apply_expert_parallel` leaves besides the cuts it records: the modules that hold the experts'
    parameters (the experts modules, or their outermost peft wrapper: what FSDP2 shards over the expert
    mesh), and a line for the layout's describe."""
    holders: list[nn.Module]
    line: str

    def describe(self, fsdp_mesh) -> str:
        """The layout's line: the split, and what each rank's experts are sharded over (None: not sharded)."""
        if fsdp_mesh is None:
            return f"{self.line} (each rank's experts whole, not sharded)\n"
        return (f"{self.line} (each rank's experts FSDP2-sharded over {' x '.join(fsdp_mesh.mesh_dim_names)}: "
                f"{fsdp_mesh.size()} rank(s))\n")


def apply_expert_parallel(model: nn.Module, group, cuts: dict[str, Cut] | None = None,
                          tp_group=None) -> ExpertShards:
    """Keep this rank's experts of every MoE layer of `model` (in place) and route their tokens over
    `group`, writing each expert parameter's slice into `cuts` (the run's table, by name:
    `toolkit.parallel.cut`). `tp_group`: under TP, the TP group, which `group` is: each TP rank then
    dispatches its 1/tp of the tokens and the outputs are summed over it (module docstring); the TP
    plan must have left the experts whole. Every rank must call it with the same full weights (and the
    same LoRA init)."""
    import torch.distributed as dist

    from toolkit.model.kernels import experts_modules

    n, rank = dist.get_world_size(group), dist.get_rank(group)
    if tp_group is not None and dist.get_world_size(tp_group) != n:
        raise UserError(f"--ep {n} with --tp {dist.get_world_size(tp_group)}: under TP the ep group is the TP "
                        "group; --ep must equal --tp")
    modules = experts_modules(model)
    if not modules:
        raise UserError(f"--ep {n}: found no routed-experts module (a forward taking hidden_states, top_k_index, "
                        "top_k_weights) in this model; drop --ep")
    cuts = cuts if cuts is not None else {}
    # the experts modules stay, their parameters change
    names = {id(m): n for n, m in model.named_modules()}
    holders = []
    for module in modules:
        experts = module.num_experts
        if experts % n:
            raise UserError(f"--ep {n} must divide the model's {experts} experts per layer; use a divisor of it")
        local = experts // n
        rows = slice(rank * local, (rank + 1) * local)
        for name, p in list(module._parameters.items()):
            if p is None:
                continue
            if p.dim() < 1 or p.shape[0] != experts:
                raise UserError(f"--ep {n}: {type(module).__name__}.{name} {tuple(p.shape)} is not stacked by expert "
                                f"(dim 0 of {experts}); this experts form is not split by --ep yet: drop --ep")
            full_name = f"{names[id(module)]}.{name}"
            if cuts.get(full_name, Cut()).tp is not None:
                raise RuntimeError(f"{full_name}: cut by TP already; under --tp the TP plan leaves the "
                                   "routed experts to expert parallel (apply_tensor_parallel(skip_experts=True))")
            setattr(module, name, _keep(p, rows))
            cuts[full_name] = Cut(ep=Slice(0, rank, n, group))
        for wrapper in _peft_wrappers(model, module):
            for adapter in wrapper.lora_A:
                a, b = wrapper.lora_A[adapter], wrapper.lora_B[adapter]
                r = a.weight.shape[0] // experts
                a.weight = _keep(a.weight, slice(rank * local * r, (rank + 1) * local * r))
                b_cols = b.weight.detach().view(b.weight.shape[0], r, experts)[:, :, rows]
                b.weight = nn.Parameter(b_cols.reshape(b.weight.shape[0], r * local).clone(),
                                        requires_grad=b.weight.requires_grad)
                a.out_features, b.in_features = a.weight.shape[0], b.weight.shape[1]
                at = names[id(wrapper)]
                cuts[f"{at}.lora_A.{adapter}.weight"] = Cut(ep=Slice(0, rank, n, group))
                cuts[f"{at}.lora_B.{adapter}.weight"] = Cut(ep=Slice(Packed(1, (experts,) * r), rank, n, group))
            wrapper.num_experts = local
        # ep_experts: the global count (router_load) the outermost: holds every expert parameter
        module.num_experts, module.ep_experts = local, experts
        owner = (_peft_wrappers(model, module) or [module])[0]
        holders.append(owner)
        module.forward = _routed_forward(owner, module.forward, group, experts)
        if tp_group is not None:
            module.forward = _split_tokens(module.forward, tp_group)
    layers = f"{len(modules)} MoE layer{'s' if len(modules) > 1 else ''}"
    over = "the TP group's " if tp_group is not None else ""
    line = (f"expert parallel over {over}{n} ranks: {layers}, {local} of {experts} experts each per rank, "
            "tokens dispatched and combined by all-to-all"
            + (" (each TP rank its 1/tp of the tokens, the outputs summed over TP)" if tp_group is not None else ""))
    return ExpertShards(holders, line)


def _split_tokens(routed, tp_group):
    """Under TP, around the routed forward (torchtitan's ReordererSequenceParallel with Partial ->
    Replicate): TP peers hold the same tokens; rank r dispatches rows r*T/t .. (r+1)*T/t - 1 of them, and
    its output, zero on the peers' rows, is all-reduced over TP. `copy_to_tp` on the tokens and their
    routing weights: each rank's gradient covers its own rows, summed over TP in backward."""
    import torch.distributed as dist

    from toolkit.parallel.tp.comm import copy_to_tp, reduce_from_tp

    t, r = dist.get_world_size(tp_group), dist.get_rank(tp_group)
    signature = inspect.signature(routed)

    @functools.wraps(routed)
    def forward(*args, **kwargs):
        hidden, index, weights = list(signature.bind(*args, **kwargs).arguments.values())[:3]
        hidden, weights = copy_to_tp(hidden, tp_group), copy_to_tp(weights, tp_group)
        n = hidden.shape[0]
        rows = slice(r * n // t, (r + 1) * n // t)
        mine = routed(hidden[rows], index[rows], weights[rows])
        partial = torch.nn.functional.pad(mine, (0, 0, rows.start, n - rows.stop))
        return reduce_from_tp(partial, tp_group)

    return forward


def _routed_forward(owner: nn.Module, local_forward, group, experts: int):
    """The experts module's forward under EP (module docstring, steps 1-5), with its signature;
    `owner` holds its parameters (and their LoRA adapters)."""
    import torch.distributed as dist

    n = dist.get_world_size(group)
    signature = inspect.signature(local_forward)

    @functools.wraps(local_forward)
    def forward(*args, **kwargs):
        hidden, index, weights = list(signature.bind(*args, **kwargs).arguments.values())[:3]
        if hidden.dim() != 2:
            raise RuntimeError(f"expert parallel expects [tokens, hidden] states, got {tuple(hidden.shape)}")
        k = index.shape[-1]
        # 1. pairs sorted by expert
        order = torch.argsort(index.reshape(-1), stable=True)
        token = order // k
        counts = torch.bincount(index.reshape(-1), minlength=experts)
        # 2. [source rank, my expert]
        arriving = exchange_counts(counts, group)
        send = counts.view(n, -1).sum(1).tolist()
        recv = arriving.sum(1).tolist()
        # 3. dispatch
        x = all_to_all(hidden[token], recv, send, group)
        mine = torch.arange(experts // n, device=hidden.device).repeat(n).repeat_interleave(arriving.reshape(-1))
        # 4.
        y = local_forward(x, mine[:, None], torch.ones(len(x), 1, dtype=weights.dtype, device=hidden.device))
        # no token came: an eager forward returns zeros tied to nothing, but the dispatch's
        if len(x) == 0:
            # backward must still run (its peers wait in theirs) and the experts take part in the gradient
            # reduction (zeros)
            y = y + (x.sum() + sum(p.reshape(-1)[:1].sum() for p in owner.parameters())) * 0
        # 5. combine
        back = all_to_all(y, send, recv, group)
        # in the weights' dtype, as the module's own product
        scaled = back * weights.reshape(-1)[order, None]
        return torch.zeros_like(hidden).index_add(0, token, scaled.to(hidden.dtype))

    return forward
