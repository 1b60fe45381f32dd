"""Expert parallelism on the device mesh: each MoE layer's experts split over the ranks of an ep group
(borrowed from dp_shard, or under TP the TP group itself: `toolkit.layout.dims`), tokens exchanged by all-to-all
(`comm`), the experts
modules' own forwards run on what arrives (`experts`)."""

from toolkit.parallel.ep.comm import all_to_all, exchange_counts
from toolkit.parallel.ep.experts import ExpertShards, apply_expert_parallel

__all__ = ["all_to_all", "exchange_counts", "ExpertShards", "apply_expert_parallel"]
