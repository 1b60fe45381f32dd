"""Every preset as its authors ship it (issue 57): `plan` offers only rows that the run accepts, a TP
plan's entries for a kind of block the model lacks are no refusal, and each preset has a tiny runnable model
of its structure (`toolkit.model.synthetic.tiny_preset`).

A row the planner offers runnable for a preset (`toolkit.planner.presets`: dense and MoE, every layer routed
as Qwen3-30B-A3B publishes it, DeepSeek-V3's dense first blocks, gpt-oss's plan with nothing inside the
blocks) passes every gate the run puts before its first step: the flags' rules, the degrees the launch
infers, the model's checks before its weights load (`parallel.build._model_problems`: the config, the
pipeline's stages and the TP plan's regions on a meta-device copy), and the TP split itself, applied to the
meta-device module tree as one rank of the row's tp. A row refused is marked with the refusal's words.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from toolkit.planner.presets import PRESETS

GiB = 1024**3


def _split_on_meta(config, tp: int, monkeypatch) -> str:
    """`apply_tensor_parallel` on the meta-device tree of `config`, as rank 0 of `tp` ranks: the split
    asks the group only its size and this rank (no collective runs while splitting)."""
    import torch.distributed as dist

    from toolkit.parallel.meta import meta_model
    from toolkit.parallel.tp import apply_tensor_parallel

    model = meta_model(config)
    with monkeypatch.context() as m:
        m.setattr(dist, "is_initialized", lambda: True)
        m.setattr(dist, "get_world_size", lambda group=None: tp)
        m.setattr(dist, "get_rank", lambda group=None: 0)
        return apply_tensor_parallel(model, None).toolkit_tp


def _once(check):
    """`check` (a meta-tree check of the one model a test saves) run on its first call only."""
    said: list[list[str]] = []

    def once(config, trust_remote_code: bool = False) -> list[str]:
        if not said:
            said.append(check(config, trust_remote_code))
        return said[0]
    return once


@pytest.mark.parametrize("name", list(PRESETS))
def test_plan_offers_only_rows_the_run_accepts(name, tmp_path, monkeypatch):
    """8 GPUs of 80 GiB, full and LoRA: each mesh row offered runnable passes the run's gates (module
    docstring); each refused row says why. Qwen3-30B-A3B (every layer routed, `mlp_only_layers: []`) is
    offered its tp rows for a full finetune, and they split: its plan's dense-MLP region matches no
    block, which is no refusal. Fails where the planner offers a row that the run then refuses."""
    from transformers import AutoConfig

    from toolkit.layout.dims import ParallelDims
    from toolkit.layout.rules import dims_for, layout_problems, mesh_flags
    from toolkit.parallel.tree import tree_problem
    from toolkit.parallel.build import _model_problems
    from toolkit.planner.estimate import PlanInput
    from toolkit.planner.explain import plan

    import toolkit.parallel.pp as pp
    import toolkit.parallel.tp.plan as tp_plan

    preset = dict(PRESETS[name])
    config = AutoConfig.for_model(preset.pop("model_type"), **preset)
    config.save_pretrained(tmp_path)
    for module, check in ((pp, "pipeline_problems"), (tp_plan, "tp_tree_problems")):  # one meta build each
        monkeypatch.setattr(module, check, _once(getattr(module, check)))
    checked: dict[tuple, list[str]] = {}
    offered_tp = set()
    for method in ("full", "lora"):
        result = plan(PlanInput(model=dict(PRESETS[name]), gpu_memory=80 * GiB, cpu_memory=2048 * GiB, method=method,
                                tree_check=tree_problem))
        rows = [c for c in result.strategies if c.dims is not None]
        assert all(c.runnable or c.why_not for c in rows)
        for c in rows:
            if not c.runnable:
                continue
            d = ParallelDims(8, **c.dims)
            par = mesh_flags(d, c.micro_batch)
            assert layout_problems(par, method, "bf16", "auto", c.micro_batch) == [], (c.name, method)
            dims, problems = dims_for(par, 8, 8)
            assert problems == [] and dims == d, (c.name, problems)
            key = (method, d.tp, d.pp, d.cp, d.ep)
            if key not in checked:  # the model's gate depends on the degrees and the method only
                run = SimpleNamespace(parallel=par, model=SimpleNamespace(trust_remote_code=False,
                                                                          router_aux_loss_coef=None, method=method))
                checked[key] = _model_problems(run, str(tmp_path), 8)
            assert checked[key] == [], (name, c.name, method, checked[key])
            if d.tp > 1 and method == "full":
                offered_tp.add(d.tp)
    for tp in sorted(offered_tp):
        assert f"tensor parallel over {tp} ranks" in _split_on_meta(config, tp, monkeypatch)
    if name == "qwen3-30b-a3b":
        assert offered_tp == {2, 4}


def test_a_plan_entry_for_a_kind_of_block_the_model_lacks_is_no_refusal(monkeypatch):
    """Qwen3-MoE's plan names a dense MLP (`layers.*.mlp.gate_proj` ...) beside the routed experts
    (`layers.*.mlp.experts`); with every layer routed (Qwen3-30B-A3B as published) or none, the other
    region matches no block, and the split goes on without it. A region that matches no block and has
    no such alternative (a name this model does not use) is still refused, as is a plan whose regions
    all miss. Fails where the dense region's miss refuses the routed model."""
    from transformers import AutoConfig

    from toolkit.errors import UserError
    from toolkit.model.synthetic import ZOO

    for dense, kept, absent in (([], "mlp.experts gate_up_proj -> down_proj", "mlp gate_proj"),
                                ([0, 1], "mlp gate_proj up_proj -> down_proj", "mlp.experts")):
        config = AutoConfig.for_model("qwen3_moe", **{**ZOO["qwen3_moe"], "mlp_only_layers": dense})
        said = _split_on_meta(config, 2, monkeypatch)
        assert kept in said and absent not in said and "self_attn q_proj" in said, said
    llama = AutoConfig.for_model("llama", **ZOO["llama"])
    plan = dict(llama.base_model_tp_plan)
    misnamed = {k.replace("self_attn", "attn"): v for k, v in plan.items()}
    nowhere = {k.replace("self_attn", "moe").replace("mlp", "moe.shared"): v for k, v in plan.items()}
    for bad, region in ((misnamed, "attn"), (nowhere, "moe")):
        llama.base_model_tp_plan = bad
        with pytest.raises(UserError, match=rf"^--tp: base_model_tp_plan region 'layers\.\*\.{region}' matches no "
                                            r"module in LlamaDecoderLayer$"):
            _split_on_meta(llama, 2, monkeypatch)


def _blocks_shape(model, n: int | None = None) -> list[tuple]:
    """The structure of a model's decoder blocks (the first n), without their widths: each module's name
    and class, a linear layer's bias or none, a dropout's p, the block's attention type and its
    attention's window or none; and whether the head is tied to the embedding."""
    from torch import nn

    from toolkit.parallel.tp.plan import decoder_blocks

    def shape(block) -> tuple:
        attention = getattr(block, "self_attn", None)
        return ((getattr(block, "attention_type", None), getattr(attention, "sliding_window", None) is not None),
                *((name, type(m).__name__, getattr(m, "bias", None) is not None if isinstance(m, nn.Linear) else
                   getattr(m, "p", None)) for name, m in block.named_modules()))

    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    return [shape(b) for b in decoder_blocks(model)[:n]] + [("tied", tied)]


@pytest.mark.parametrize("name", list(PRESETS))
def test_each_preset_has_a_tiny_model_of_its_structure_that_trains(name):
    """`toolkit.model.synthetic.tiny_preset`: the preset's published structure at hidden 64 (module docstring of
    the function's table): its blocks are the published model's first ones, and every kind of block the
    published model has is among them (the meta-device copy's module tree: every module's name and class,
    each linear's bias, each dropout, each block's attention type and window); the same TP fit; and the
    tiny model runs a forward and backward on its own loss."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from toolkit.parallel.meta import meta_model
    from toolkit.parallel.tp.plan import tp_tree_problems
    from toolkit.model.synthetic import tiny_preset

    values = dict(PRESETS[name])
    published = AutoConfig.for_model(values.pop("model_type"), **values)
    config = tiny_preset(PRESETS[name])
    assert config.hidden_size == 64 and config.num_hidden_layers <= 6
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    n = config.num_hidden_layers
    full = meta_model(published)
    assert _blocks_shape(model) == _blocks_shape(full, n)  # the first blocks, in order
    assert set(_blocks_shape(model)) == set(_blocks_shape(full))  # every kind of block the published model has
    assert bool(tp_tree_problems(config)) == bool(tp_tree_problems(published))
    ids = torch.randint(4, config.vocab_size, (2, 40))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
