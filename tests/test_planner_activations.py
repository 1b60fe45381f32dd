"""Predicted activation bytes vs what autograd actually saves (saved_tensors_hooks), tiny Llama."""

import pytest
import torch

from toolkit.planner.memory import activation_elements_per_token

CFG = dict(hidden_size=128, intermediate_size=352, num_hidden_layers=3, num_attention_heads=4,
           num_key_value_heads=2, vocab_size=512, tie_word_embeddings=False)


def saved_bytes(batch: int, seq: int, checkpointing: bool) -> int:
    """Bytes of distinct storages autograd keeps for backward, parameters excluded."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from toolkit.models import enable_checkpointing

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CFG, attn_implementation="sdpa"))
    model.config.use_cache = False
    if checkpointing:
        enable_checkpointing(model)
    model.train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    ids = torch.randint(0, CFG["vocab_size"], (batch, seq))
    return _saved(lambda: model(input_ids=ids), params)


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("batch, seq", [(1, 64), (2, 128), (4, 256), (1, 512)])
def test_activation_formula_within_15_percent(batch, seq, checkpointing):
    h, i = CFG["hidden_size"], CFG["intermediate_size"]
    kv = CFG["num_key_value_heads"] * h // CFG["num_attention_heads"]
    rope = 2 * h // CFG["num_attention_heads"]  # cos and sin, head_dim each
    predicted = 4 * batch * seq * activation_elements_per_token(CFG["num_hidden_layers"], h, i, kv, checkpointing, rope)
    assert saved_bytes(batch, seq, checkpointing) == pytest.approx(predicted, rel=0.15)


def _saved(run, params) -> int:
    """Bytes of distinct storages saved for backward while `run()` executes, parameters excluded."""
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen.setdefault(st.data_ptr(), st.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(seen.values())


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CFG, attn_implementation="sdpa"))
    model.config.use_cache = False
    return model.train()


def _predicted(dims, stage: int, batch: int, seq: int) -> int:
    from toolkit.planner.layouts import stage_bytes
    from toolkit.planner.plan import PlanInput

    inp = PlanInput(model=CFG, gpu_memory=2**40, method="full", seq_len=seq, micro_batch=batch, precision="no")
    return stage_bytes(inp, dims, stage, False, batch)["activations"]


def _mesh_saved(batch: int, seq: int) -> dict[str, int]:
    """On each of 4 gloo ranks laid out cp 2 x tp 2 (the runtime's mesh): forwards under tp 2, cp 2,
    cp 2 x tp 2, and each pp 2 stage of the tp 2 model run alone (stage 1 from a hidden-state
    input, 1 x 2*seq tokens), bytes saved for backward on this rank."""
    import torch.distributed as dist

    from toolkit.parallel.cp import ContextParallel, use_ulysses
    from toolkit.parallel.dims import ParallelDims
    from toolkit.parallel.mesh import build_mesh
    from toolkit.parallel.pp.split import DecoderStage, decoder_parts
    from toolkit.parallel.tp import apply_tensor_parallel
    from toolkit.planner.layouts import stage_blocks

    dist.init_process_group("gloo")
    try:
        mesh = build_mesh(ParallelDims(4, cp=2, tp=2), "cpu")
        tp_group, cp_group = mesh.get_group("tp"), mesh.get_group("cp")
        ids = torch.randint(0, CFG["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(0))
        rows = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
        out = {}
        for name, tp, cp in (("tp2", True, False), ("cp2", False, True), ("cp2_tp2", True, True)):
            model = _model()
            if tp:
                model = apply_tensor_parallel(model, tp_group)
            params = {p.untyped_storage().data_ptr() for p in model.parameters()}
            if not cp:
                out[name] = _saved(lambda: model(input_ids=ids), params)
                continue
            use_ulysses(model)
            context = ContextParallel(cp_group, model.config)

            def forward():
                with context.shard(rows) as local:
                    model(**local["inputs"])

            out[name] = _saved(forward, params)
        model = apply_tensor_parallel(_model(), tp_group)
        parts, sizes = decoder_parts(model), stage_blocks(CFG, 2)
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        ids = torch.randint(0, CFG["vocab_size"], (1, 2 * seq), generator=torch.Generator().manual_seed(1))
        hidden = torch.randn(1, 2 * seq, CFG["hidden_size"], requires_grad=True)
        for stage, (start, stop) in enumerate([(0, sizes[0]), (sizes[0], sum(sizes))]):
            module = DecoderStage(parts, start, stop, first=stage == 0, last=stage == 1)
            out[f"pp2_tp2/{stage}"] = _saved(lambda: module(ids if stage == 0 else hidden), params)
        return out
    finally:
        dist.destroy_process_group()


def test_mesh_layout_activations_within_15_percent():
    """The planner's per-rank activations for mesh layouts (`layouts.stage_bytes`) against what
    autograd saves on each of 4 gloo ranks: tp 2, cp 2 and cp 2 x tp 2 at 2 x 128 tokens, and each
    stage of pp 2 x tp 2 at 1 x 256 (one pipeline micro-batch, fewer than stages: all of it in
    flight). The runtime's TP plan, Ulysses attention and pipeline stage modules."""
    from distributed import run_distributed

    from toolkit.parallel.dims import ParallelDims

    batch, seq = 2, 128
    layouts = {"tp2": ParallelDims(4, tp=2, dp_replicate=2), "cp2": ParallelDims(4, cp=2, dp_replicate=2),
               "cp2_tp2": ParallelDims(4, cp=2, tp=2)}
    for rank in run_distributed(_mesh_saved, 4, batch, seq):
        for name, dims in layouts.items():
            assert rank[name] == pytest.approx(_predicted(dims, 0, batch, seq), rel=0.15), name
        for stage in (0, 1):
            want = _predicted(ParallelDims(4, pp=2, tp=2), stage, 1, 2 * seq)
            assert rank[f"pp2_tp2/{stage}"] == pytest.approx(want, rel=0.15), stage
