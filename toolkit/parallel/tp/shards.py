"""What the TP plan cut, as the rest of a run reads it (`TPShards`)."""

from __future__ import annotations

from toolkit.parallel import grad_norm
from toolkit.parallel.cut import Cut, full_state_dict


class TPShards:
    """TP's part of a layout: its group, the run's table of cuts (`toolkit.parallel.cut`: how the TP plan,
    then expert parallel, cut each parameter, by name) and the plan's describe line. The table is by name:
    FSDP2 replaces the parameters, and with them the gradient hooks the plan put on the replicated ones
    whose gradients are partial sums (`reduce_partial_grads` does their work again)."""

    def __init__(self, group=None, cuts: dict[str, Cut] | None = None, plan: str = ""):
        self.group = group
        self.cuts: dict[str, Cut] = cuts if cuts is not None else {}
        self.plan = plan  # what the plan split and what it kept whole

    @property
    def partial(self) -> list[str]:
        """TP-replicated parameters whose gradient is a per-rank partial sum, by name."""
        return [n for n, cut in self.cuts.items() if cut.partial]

    def describe(self) -> str:
        """What TP split, per block, and what every rank keeps whole (a line of the strategy's describe)."""
        return self.plan + "\n" if self.plan else ""

    def coordinates(self) -> tuple[int, int]:
        """(this rank's TP rank, TP degree): where its slices sit in the full tensors."""
        import torch.distributed as dist

        return (dist.get_rank(self.group), dist.get_world_size(self.group)) if self.group is not None else (0, 1)

    def reduce_partial_grads(self, model) -> None:
        """What the TP plan's gradient hooks do, on FSDP2's reduced shards: the sum over the TP group
        commutes with the mean over data-parallel ranks, and TP peers hold the same shard of these."""
        partial = self.partial
        if not partial or self.group is None:
            return
        import torch.distributed as dist

        params = dict(model.named_parameters())
        for name in partial:
            if name in params and params[name].grad is not None:
                dist.all_reduce(grad_norm.local(params[name].grad), group=self.group)

    def state_dict(self, model) -> dict:
        return full_state_dict(model, self.cuts, self.group)
