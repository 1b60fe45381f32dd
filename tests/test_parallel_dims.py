"""ParallelDims: degrees decided once (one inferred), every problem in one list; the mesh built from
them puts TP innermost and PP outermost (Megatron's rank order)."""

import pytest
from distributed import run_distributed

from toolkit.layout.dims import ParallelDims, infer_dims


@pytest.mark.parametrize("world,tp,pp,sharded,expected", [
    (8, 2, 2, False, {"pp": 2, "dp_replicate": 2, "dp_shard": 1, "tp": 2}),
    (8, 2, 1, True, {"pp": 1, "dp_replicate": 1, "dp_shard": 4, "tp": 2}),
    (4, 1, 1, False, {"pp": 1, "dp_replicate": 4, "dp_shard": 1, "tp": 1}),
    (1, 1, 1, True, {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "tp": 1}),
])
def test_data_parallel_degree_is_what_the_model_parallel_degrees_leave(world, tp, pp, sharded, expected):
    dims, problems = infer_dims(world, tp=tp, pp=pp, sharded=sharded)
    assert problems == []
    assert {k: getattr(dims, k) for k in expected} == expected
    assert dims.dp * dims.replicas == world and dims.replicas == tp * pp


def test_problems_name_the_degrees_and_the_launch():
    _, problems = infer_dims(6, tp=4)
    assert problems == ["--tp 4 needs a world size that is a multiple of 4 (got 6); launch torchrun "
                        "--nproc_per_node 4 (times the data-parallel degree you want)"]
    assert ParallelDims(4, tp=2).problems() == ["tp 2 is 2 ranks, but 4 were launched; launch 2 processes or change "
                                                "the degrees"]
    assert ParallelDims(2, tp=0, pp=-1).problems() == ["--pp must be >= 1 (got -1)", "--tp must be >= 1 (got 0)"]
    _, problems = infer_dims(4, tp=2, dp_shard=4)
    assert problems == ["--dp-shard 4 does not fit: 4 processes / (pp 1 x tp 2) leave 2 data-parallel ranks; "
                        "launch 8 processes or change the degrees"]
    dims, problems = infer_dims(8, tp=2, dp_shard=2)
    assert problems == [] and (dims.dp_replicate, dims.dp_shard) == (2, 2)  # the rest replicates: HSDP x TP


def test_ep_without_the_ranks_for_it_says_how_many_processes_to_launch():
    """--ep N borrows N dp_shard ranks; with fewer (one process, say) no other flag helps, so the line
    names the launch that gives them, not the divisibility rule or --dp-replicate (issue 57)."""
    from toolkit.layout.flags import ParallelConfig
    from toolkit.layout.rules import dims_for

    _, problems = dims_for(ParallelConfig(ep=2), 1, 1)
    assert problems == ["--ep 2 needs at least 2 data-parallel ranks to split the experts over (ep borrows them "
                        "from dp_shard); this launch has 1 process: launch with torchrun --nproc_per_node 2"]
    _, problems = dims_for(ParallelConfig(ep=4, cp=2), 4, 4)  # cp 2 leaves 2 dp_shard ranks of 4
    assert problems == ["--ep 4 needs at least 4 data-parallel ranks to split the experts over (ep borrows them "
                        "from dp_shard); this launch has 4 processes, which leave 2 after cp 2: launch with torchrun "
                        "--nproc_per_node 8"]
    # under --tp the ep group is the TP group (no dp_shard ranks borrowed): --ep must equal --tp, one line
    _, problems = dims_for(ParallelConfig(ep=4, tp=2), 4, 4)
    assert problems == ["--ep 4 with --tp 2 is not supported; under tensor parallel the experts are split over the TP "
                        "group itself (each expert whole, each TP rank dispatching its share of the tokens), so --ep "
                        "must equal --tp: use --ep 2 --tp 2, or drop --tp (--ep 4 then borrows from --dp-shard)"]
    assert ParallelDims(2, dp_replicate=2, ep=2).problems()[0].endswith(
        "which leave 1 after dp_replicate 2: launch with torchrun --nproc_per_node 4 or lower --dp-replicate")
    assert ParallelDims(6, dp_shard=3, ep=2).problems()[0].endswith("; use --ep 3")  # enough ranks: which ep fits


def _groups(tp: int, pp: int) -> dict:
    import torch.distributed as dist

    from toolkit.parallel.pp import make_pipeline_layout
    from toolkit.parallel.tp import make_layout

    dist.init_process_group("gloo")
    try:
        if tp > 1:
            layout = make_layout(tp)
            return {"tp": dist.get_process_group_ranks(layout.tp_group),
                    "dp": dist.get_process_group_ranks(layout.dp_group),
                    "rank": (layout.tp_rank, layout.dp_rank)}
        layout = make_pipeline_layout(pp)
        return {"pp": dist.get_process_group_ranks(layout.pp_group),
                "dp": dist.get_process_group_ranks(layout.dp_group),
                "tie": dist.get_process_group_ranks(layout.tie_group), "rank": (layout.pp_rank, layout.dp_rank)}
    finally:
        dist.destroy_process_group()


def test_mesh_puts_tp_innermost_and_pp_outermost():
    """tp2 x dp2: TP groups {0,1},{2,3}, DP {0,2},{1,3}; pp2 x dp2: stage 0 is ranks {0,1}, so the
    pipelines are {0,2},{1,3} (the groups the hand-built layouts had, now from the mesh)."""
    tp = run_distributed(_groups, 4, 2, 1)
    assert [g["tp"] for g in tp] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [g["dp"] for g in tp] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [g["rank"] for g in tp] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    pp = run_distributed(_groups, 4, 1, 2)
    assert [g["pp"] for g in pp] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [g["dp"] for g in pp] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [g["tie"] for g in pp] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [g["rank"] for g in pp] == [(0, 0), (0, 1), (1, 0), (1, 1)]
