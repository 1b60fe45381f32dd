"""Expert-parallel communication: the token exchange as an autograd function whose backward is the
conjugate exchange (torchtitan's `expert_parallel.py` dispatch/combine, Megatron's
`token_dispatcher.py` all-to-all). With n ranks in `group`, rank r sending `send[j]` rows to rank j
and receiving `recv[j]` rows from it:

    all_to_all(X, recv, send)  forward  X = [X_r->0; ...; X_r->n-1]  ->  [X_0->r; ...; X_n-1->r]
                               backward dY = [dY_0->r; ...]  ->  [dY_r->0; ...] (all_to_all(dY, send, recv))

Dispatch is `all_to_all(tokens, recv, send)`, combine the same call with the sizes swapped: each is
the other's backward. The bytes each rank sends are counted while a benchmark asks
(`toolkit.parallel.traffic.counting("ep")`), to compare them with the planner's count.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from toolkit.parallel import traffic


def _exchange(x: torch.Tensor, recv: list[int], send: list[int], group, phase: str) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x, output_split_sizes=recv, input_split_sizes=send, group=group)
    if traffic.wanted("ep"):
        row = x[0].numel() * x.element_size() if len(x) else 0
        # what leaves this rank
        traffic.add("ep", phase, (len(x) - send[dist.get_rank(group)]) * row)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, recv: list[int], send: list[int], group) -> torch.Tensor:
        ctx.recv, ctx.send, ctx.group = recv, send, group
        return _exchange(x, recv, send, group, "forward")

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        return _exchange(dy, ctx.send, ctx.recv, ctx.group, "backward"), None, None, None


def all_to_all(x: torch.Tensor, recv: list[int], send: list[int], group) -> torch.Tensor:
    """Rows `sum(send[:j]) .. sum(send[:j+1])` of `x` go to rank j of `group`; the result holds
    `recv[j]` rows from each rank j, in rank order (module docstring)."""
    return _AllToAll.apply(x, recv, send, group)


def exchange_counts(counts: torch.Tensor, group) -> torch.Tensor:
    """`counts` [n * e]: this rank's tokens for every expert, expert-major (rank j holds experts
    j*e .. (j+1)*e - 1). Returns [n, e]: row j, the tokens rank j sends to each of this rank's experts."""
    n = dist.get_world_size(group)
    out = torch.empty_like(counts)
    dist.all_to_all_single(out, counts.contiguous(), group=group)
    return out.view(n, -1)
