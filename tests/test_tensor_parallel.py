"""Tensor parallelism: the comm primitives, the parallel layers, the plan read from each config's
`base_model_tp_plan` (the zoo's architectures) and `--tp` runs, each against the single-process math
on gloo (fp32, tolerance 1e-5 unless stated).

Layout under test: 2 ranks = tp 2; 4 ranks = tp 2 x dp 2 (TP groups {0,1} {2,3}).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from distributed import batched_runs, common_args, run_distributed
from helpers import build_model_dir, build_tokenizer, random_model, records, save_model_dir

TOL = dict(atol=1e-5, rtol=1e-5)


def _init():
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    return dist


# ---------------------------------------------------------------- primitives and layers


def _primitives_and_layers() -> dict:
    """Runs on every rank of a 2-rank group; returns max |difference| per check."""
    dist = _init()
    from torch import nn

    from toolkit.parallel.tp.comm import copy_to_tp, gather_from_tp, reduce_from_tp, split_to_tp
    from toolkit.parallel.tp.layers import ColumnParallelLinear, RowParallelLinear

    group, rank, t = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    diff = {}
    # Rank-dependent inputs with a known sum over ranks: X_r = (r + 1) * base.
    base = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    upstream = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))

    x = (base * (rank + 1)).requires_grad_()
    y = copy_to_tp(x, group)
    (y * upstream * (rank + 1)).sum().backward()  # dL_r/dy = upstream * (r + 1)
    diff["copy.forward"] = (y - x).abs().max().item()
    diff["copy.backward"] = (x.grad - upstream * sum(r + 1 for r in range(t))).abs().max().item()

    x = (base * (rank + 1)).requires_grad_()
    y = reduce_from_tp(x, group)
    (y * upstream).sum().backward()
    diff["reduce.forward"] = (y - base * sum(r + 1 for r in range(t))).abs().max().item()
    diff["reduce.backward"] = (x.grad - upstream).abs().max().item()

    x = base.clone().requires_grad_()
    y = split_to_tp(x, group)
    (y * upstream.chunk(t, -1)[rank]).sum().backward()
    diff["split.forward"] = (y - base.chunk(t, -1)[rank]).abs().max().item()
    # every rank's slice gradient lands in its own columns
    diff["split.backward"] = (x.grad - upstream).abs().max().item()

    x = base.chunk(t, -1)[rank].clone().requires_grad_()
    y = gather_from_tp(x, group)
    (y * upstream).sum().backward()
    diff["gather.forward"] = (y - base).abs().max().item()
    diff["gather.backward"] = (x.grad - upstream.chunk(t, -1)[rank]).abs().max().item()

    # Layers: a full nn.Linear vs its sharded copies; same input, same upstream gradient.
    for bias in (False, True):
        torch.manual_seed(0)
        full = nn.Linear(8, 6, bias=bias)
        inp = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(2))
        g_out = torch.randn(2, 5, 6, generator=torch.Generator().manual_seed(3))
        xr = inp.clone().requires_grad_()
        (full(xr) * g_out).sum().backward()

        col = ColumnParallelLinear.from_linear(full, group, gather_output=True, copy_input=True)
        xc = inp.clone().requires_grad_()
        yc = col(xc)
        (yc * g_out).sum().backward()
        diff[f"column{bias=}.forward"] = (yc - full(inp)).abs().max().item()
        diff[f"column{bias=}.dx"] = (xc.grad - xr.grad).abs().max().item()
        diff[f"column{bias=}.dweight"] = (col.weight.grad - full.weight.grad.chunk(t, 0)[rank]).abs().max().item()
        if bias:
            diff[f"column{bias=}.dbias"] = (col.bias.grad - full.bias.grad.chunk(t, 0)[rank]).abs().max().item()

        row = RowParallelLinear.from_linear(full_in := nn.Linear(6, 8, bias=bias), group, input_is_parallel=False)
        inp2 = torch.randn(2, 5, 6, generator=torch.Generator().manual_seed(4))
        g2 = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(5))
        xr2 = inp2.clone().requires_grad_()
        (full_in(xr2) * g2).sum().backward()
        xw = inp2.clone().requires_grad_()
        yr = row(xw)
        (yr * g2).sum().backward()
        diff[f"row{bias=}.forward"] = (yr - full_in(inp2)).abs().max().item()
        diff[f"row{bias=}.dx"] = (xw.grad - xr2.grad).abs().max().item()
        diff[f"row{bias=}.dweight"] = (row.weight.grad - full_in.weight.grad.chunk(t, 1)[rank]).abs().max().item()
        if bias:
            diff[f"row{bias=}.dbias"] = (row.bias.grad - full_in.bias.grad).abs().max().item()
    dist.destroy_process_group()
    return diff


def test_primitives_and_layers_match_single_process_math():
    for rank, diff in enumerate(run_distributed(_primitives_and_layers, 2)):
        bad = {k: v for k, v in diff.items() if v > 1e-6}
        assert not bad, f"rank {rank}: {bad}"
        assert len(diff) == 8 + 2 * 6 + 2  # every check ran


def test_primitives_are_identity_on_one_rank():
    from toolkit.parallel.tp.comm import copy_to_tp, gather_from_tp, reduce_from_tp, split_to_tp

    x = torch.randn(2, 4)
    for fn in (copy_to_tp, reduce_from_tp, split_to_tp, gather_from_tp):
        assert fn(x, None) is x


# ---------------------------------------------------------------- the plan, from base_model_tp_plan

# The zoo (toolkit.model.synthetic.ZOO) under --tp 2: what runs, and the plan entry each refusal names
ZOO_TP_MOE = ("mixtral", "qwen3_moe", "deepseek_v3")  # every expert's intermediate split (moe_tp_experts)
ZOO_TP_RUNS = ("llama", "qwen3", "gemma2", "gemma3_text", "phi3", "cohere", "granite", "gpt_neox", *ZOO_TP_MOE)
ZOO_TP_REFUSED = {"gpt2": "its config declares no base_model_tp_plan",
                  "gpt_oss": "'embed_tokens: embedding_rowwise'"}


def _model_dirs(root) -> dict:
    """Five block layouts, each split by its config's `base_model_tp_plan`: Llama GQA (4 q / 2 kv heads),
    Llama MHA with attention and MLP biases (row-parallel bias added once), Qwen3 (q/k RMSNorm inside
    the TP region, head_dim != h/heads, tied embeddings), Qwen2 (q/k/v biases), Mistral (GQA,
    sliding-window config). Each: {"path", "methods"} (full and LoRA)."""
    tok = build_tokenizer()
    small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=256)
    dirs = {"llama_gqa": build_model_dir(root / "llama_gqa"),
            "llama_bias": build_model_dir(root / "llama_bias", num_key_value_heads=4, attention_bias=True,
                                          mlp_bias=True),
            "qwen3": save_model_dir(root / "qwen3", random_model("qwen3", **small, head_dim=24,
                                                                 tie_word_embeddings=True), tok),
            "qwen2": save_model_dir(root / "qwen2", random_model("qwen2", **small), tok),
            "mistral": save_model_dir(root / "mistral", random_model("mistral", **small, sliding_window=64), tok)}
    return {k: {"path": str(v), "methods": ("full", "lora")} for k, v in dirs.items()}


def _zoo_models() -> dict:
    """Every zoo architecture whose plan the layers express, full finetune, built from its config in
    each rank (eager attention: Gemma 2 has no sdpa); LoRA too on the packed projections (Phi-3:
    qkv_proj split by q/k/v heads, gate_up_proj by gate and up). And OLMo 2 (not in the zoo), whose
    plan gathers q/k/v for a norm over every head: the gathered path, full and LoRA."""
    from toolkit.model.synthetic import ZOO

    ids = dict(vocab_size=384, pad_token_id=0, eos_token_id=1, bos_token_id=2, tie_word_embeddings=False)
    models = {f"zoo/{t}": {"config": (t, {**ZOO[t], **ids}), "methods": ("full", "lora") if t == "phi3" else ("full",)}
              for t in ZOO_TP_RUNS}
    models["zoo/olmo2"] = {"config": ("olmo2", {**ZOO["llama"], **ids}), "methods": ("full", "lora")}
    return models


def _logits_and_grads(dirs: dict, tp: int, scratch: str) -> dict:
    """Unsharded vs TP model from the same folder: logits and every parameter's gradient; the TP
    shards gathered back; for Phi-3 (packed projections) an Adam step's weights and moments through
    a sharded checkpoint (`scratch`), read back whole and loaded back into the shards."""
    dist = _init()
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from toolkit.objectives.sft.loss import token_loss_sum
    from toolkit.parallel.parallelize import Parallelized
    from toolkit.parallel.tp import apply_tensor_parallel, make_layout
    from toolkit.parallel.traffic import counting

    layout = make_layout(tp)
    out = {}
    for name, spec in dirs.items():
        for method in spec["methods"]:
            def build():
                torch.manual_seed(0)
                if "config" in spec:  # the same random init on every rank and for both copies
                    model_type, kw = spec["config"]
                    m = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **kw), dtype=torch.float32,
                                                         attn_implementation="eager")
                else:
                    m = AutoModelForCausalLM.from_pretrained(spec["path"], dtype=torch.float32)
                if method == "lora":  # B random too (init_lora_weights=False) so every LoRA gradient is non-zero
                    m = get_peft_model(m, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear",
                                                     init_lora_weights=False))
                return m

            cuts = {}  # how the plan cut each parameter, by name (`toolkit.parallel.cut`)
            ref, tpm = build(), apply_tensor_parallel(build(), layout.tp_group, cuts)
            g = torch.Generator().manual_seed(layout.dp_rank)  # dp groups see different data, TP peers the same
            ids = torch.randint(5, 300, (2, 12), generator=g)
            mask = torch.ones_like(ids)
            mask[1, :3] = 0  # left padding in one row
            loss_ref = token_loss_sum(ref(input_ids=ids, attention_mask=mask).logits, ids)
            logits_ref = ref(input_ids=ids, attention_mask=mask).logits
            loss_ref.backward()
            with counting("tp") as traffic:
                logits = tpm(input_ids=ids, attention_mask=mask).logits
                token_loss_sum(logits, ids).backward()
            key = f"{name}/{method}"
            if method == "full" and "gathered" not in tpm.toolkit_tp and "experts" not in tpm.toolkit_tp:
                # Megatron's: 2 all-reduces of b*s*h per block each way (an MoE block's experts copy in their
                # routing weights too, and DeepSeek-V3's attention stays whole)
                expected = 2 * tpm.config.num_hidden_layers * ids.numel() * tpm.config.hidden_size * 4
                out[key + "/bytes_off"] = abs(traffic["forward"] - expected) + abs(traffic["backward"] - expected)
            out[key + "/logits"] = (logits - logits_ref).abs().max().item()
            out[key + "/grads"], out[key + "/n_grads"] = _grads_off(ref, tpm, layout, cuts)
            assert out[key + "/n_grads"] == sum(p.requires_grad for p in ref.parameters()), key
            shards = Parallelized(cuts, layout.tp_group)
            gathered = shards.state_dict(tpm)
            ref_state = ref.state_dict()
            assert gathered.keys() == ref_state.keys()
            out[key + "/gathered"] = max((gathered[k] - ref_state[k]).abs().max().item() for k in ref_state)
            if name == "zoo/phi3":
                checked = _checkpoint_off(ref, tpm, shards, layout, f"{scratch}/{method}")
                out.update({f"{key}/{k}": v for k, v in checked.items()})
    dist.destroy_process_group()
    return out


def _grads_off(ref, tpm, layout, cuts: dict) -> tuple[float, int]:
    """The largest difference of a TP parameter's gradient from its slice of the unsharded one, and
    how many were compared. fp32 rounding of a split sum grows with the tensor's scale (gradients up
    to ~12 here): the difference is taken relative to the largest entry where that exceeds 1."""
    ref_params = dict(ref.named_parameters())
    worst, n = 0.0, 0
    for pname, p in tpm.named_parameters():
        if p.grad is None:
            continue
        expect = _my_slice(ref_params[pname].grad, cuts.get(pname), layout)
        assert p.grad.shape == expect.shape, (pname, p.grad.shape, expect.shape)
        worst, n = max(worst, ((p.grad - expect).abs().max() / expect.abs().max().clamp(min=1.0)).item()), n + 1
    return worst, n


def _my_slice(full: torch.Tensor, cut, layout) -> torch.Tensor:
    """This TP rank's part of `full` as the plan cut it (`cut`: its `toolkit.parallel.cut.Cut`): a slice
    along the dim it names, a packed projection's slice of every part."""
    from toolkit.parallel.tp.layers import Packed

    split = cut.tp.split if cut is not None and cut.tp is not None else None
    if split is None:
        return full
    dim, parts = (split.dim, split.parts) if isinstance(split, Packed) else (split, (full.shape[split],))
    return torch.cat([part.chunk(layout.tp, dim)[layout.tp_rank] for part in full.split(list(parts), dim)], dim)


def _checkpoint_off(ref, tpm, shards, layout, folder: str) -> dict:
    """An Adam step on both; the TP run's weights and first moments through a sharded checkpoint
    (packed projections written one box per part), read back whole against the unsharded run's, then
    loaded back into zeroed shards."""
    import torch.distributed as dist

    from toolkit.parallel.tp.layers import Packed
    from toolkit.train.sharded_state import full_tensors, load_sharded, save_sharded

    Path(folder).mkdir(parents=True, exist_ok=True)
    # lr 0: Adam's first update is +-lr wherever a gradient is ~0, whatever its rounding; the moments carry it
    opt_ref, opt_tp = torch.optim.Adam(ref.parameters(), lr=0.0), torch.optim.Adam(tpm.parameters(), lr=0.0)
    opt_ref.step()
    opt_tp.step()
    named = [(n, p, shards.cuts.get(n)) for n, p in tpm.named_parameters() if p.requires_grad]
    save_sharded(folder, named, opt_tp)
    dist.barrier()
    out = {}
    whole = full_tensors(folder, prefix="")
    ref_params = dict(ref.named_parameters())
    pairs = {"weights": lambda n: (whole[f"model.{n}"], ref_params[n].detach()),
             "moments": lambda n: (whole[f"optimizer.{n}.exp_avg"], opt_ref.state[ref_params[n]]["exp_avg"])}
    for kind, pair in pairs.items():
        out[kind] = max(((got - want).abs().max() / want.abs().max().clamp(min=1.0)).item()
                        for got, want in (pair(n) for n, _, _ in named))
    before = {n: p.detach().clone() for n, p, _ in named}
    with torch.no_grad():
        for _, p, _ in named:
            p.zero_()
    assert load_sharded(folder, named, opt_tp) == []
    out["reloaded"] = max((p - before[n]).abs().max().item() for n, p, _ in named)
    out["packed_params"] = float(sum(s.tp is not None and isinstance(s.tp.split, Packed) for s in shards.cuts.values()))
    return out


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return _model_dirs(tmp_path_factory.mktemp("tp_models"))


@pytest.mark.parametrize("world", [2, 4])
def test_logits_and_every_gradient_match_unsharded(model_dirs, world, tmp_path):
    """tp 2 (with the zoo) and tp 2 x dp 2: every checked difference within 1e-5."""
    dirs = {**model_dirs, **_zoo_models()} if world == 2 else model_dirs
    results = run_distributed(_logits_and_grads, world, dirs, 2, str(tmp_path))
    for rank, diff in enumerate(results):
        bad = {k: v for k, v in diff.items() if not k.endswith(("n_grads", "packed_params")) and v > 1e-5}
        assert not bad, f"rank {rank}: {bad}"
        assert len([k for k in diff if k.endswith("/grads")]) == sum(len(d["methods"]) for d in dirs.values())
        local = 5 + (len(ZOO_TP_RUNS) - len(ZOO_TP_MOE) if world == 2 else 0)  # full dense runs, no gathered region
        assert len([k for k in diff if k.endswith("/bytes_off")]) == local  # checked (== 0) by `bad` above
        if world == 2:  # the packed qkv_proj and gate_up_proj weights of 2 blocks (LoRA: and their lora_B)
            assert diff["zoo/phi3/full/packed_params"] == 4 and diff["zoo/phi3/lora/packed_params"] == 8
            assert {"zoo/phi3/full/weights", "zoo/phi3/full/moments", "zoo/phi3/lora/reloaded"} <= diff.keys()


def test_zoo_tp_support_matrix(tmp_path):
    """Which zoo architectures --tp 2 runs, and the one line each refusal is, from the config alone
    (`make_strategy`'s check, before any weights load)."""
    from types import SimpleNamespace

    from transformers import AutoConfig

    from toolkit.parallel.build import _model_problems
    from toolkit.model.synthetic import ZOO

    assert set(ZOO) == set(ZOO_TP_RUNS) | set(ZOO_TP_REFUSED)
    from toolkit.layout.flags import ParallelConfig

    cfg = SimpleNamespace(parallel=ParallelConfig(tp=2),
                          model=SimpleNamespace(trust_remote_code=False, router_aux_loss_coef=None, method="full"))
    for t in ZOO:
        AutoConfig.for_model(t, **ZOO[t]).save_pretrained(tmp_path / t)
        problems = _model_problems(cfg, str(tmp_path / t), world=2)
        if t in ZOO_TP_RUNS:
            assert problems == [], (t, problems)
        else:
            assert len(problems) == 1 and problems[0].startswith(f"--tp 2: {t}: "), (t, problems)
            assert ZOO_TP_REFUSED[t] in problems[0] and "drop --tp" in problems[0], (t, problems)
    cfg.model.method = "lora"  # LoRA's adapters on stacked experts are not split: refused before the weights load
    for t in ZOO_TP_MOE:
        problems = _model_problems(cfg, str(tmp_path / t), world=2)
        assert problems == [f"--tp 2 with --method lora: {t}'s LoRA adapts its stacked experts, which TP does not "
                            "split yet; use --method full with --tp, or drop --tp (--dp-shard N or --zero-stage 3)"]


def test_reading_the_plan():
    """What the TP layers make of transformers' styles, and the entry a refusal names."""
    from toolkit.layout.tp_regions import NotExpressible, Region, packed_parts, read_tp_plan

    plan = read_tp_plan({"embed_in": "embedding_rowwise", "layers.*.attention.query_key_value": "colwise",
                         "layers.*.attention.dense": "rowwise",
                         "layers.*.attention.q_norm": "replicated_with_grad_allreduce"})
    assert plan.blocks == "layers" and plan.outside == ("embed_in: embedding_rowwise",)
    assert plan.regions == (Region("attention", ("query_key_value",), "dense", replicated=("q_norm",)),)
    gathered = read_tp_plan({"layers.*.mlp.gate_up_proj": "colwise_gather_output",
                             "layers.*.mlp.down_proj": "rowwise_split_input"})
    assert gathered.regions == (Region("mlp", ("gate_up_proj",), "down_proj", gathered=True),)
    packed = read_tp_plan({"layers.*.mlp.gate_up_proj": "packed_colwise", "layers.*.mlp.down_proj": "rowwise"})
    assert packed.regions[0].packed == ("gate_up_proj",)
    # a routed-experts module (Qwen3-MoE's): its stacked projections a region of their own, beside the
    # dense MLP's (its mlp_only_layers) though inside its path: a block holds one or the other
    from transformers import AutoConfig

    moe = read_tp_plan(AutoConfig.for_model("qwen3_moe").base_model_tp_plan)
    assert Region("mlp.experts", ("gate_up_proj",), "down_proj", packed=("gate_up_proj",), experts=True) in moe.regions
    assert Region("mlp", ("gate_proj", "up_proj"), "down_proj") in moe.regions
    from transformers import AutoModelForCausalLM

    from toolkit.parallel.tp.plan import nested_regions
    from toolkit.model.synthetic import ZOO

    blocks = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3_moe", **ZOO["qwen3_moe"])).model.layers
    assert [nested_regions(b, moe.regions) for b in blocks] == [None, None]  # block 0 dense, block 1 MoE
    mlp = torch.nn.Module()  # a plan whose regions do meet in one block is refused as it is applied
    mlp.up, mlp.down, mlp.shared = torch.nn.Linear(4, 8), torch.nn.Linear(8, 4), torch.nn.Module()
    mlp.shared.up, mlp.shared.down = torch.nn.Linear(4, 8), torch.nn.Linear(8, 4)
    block = torch.nn.Module()
    block.mlp = mlp
    both = read_tp_plan({"layers.*.mlp.up": "colwise", "layers.*.mlp.down": "rowwise",
                         "layers.*.mlp.shared.up": "colwise", "layers.*.mlp.shared.down": "rowwise"})
    assert nested_regions(block, both.regions) == ("mlp", "mlp.shared")
    refusals = {  # plan -> the entry named
        "layers.*.mlp.up_proj: colwise": {"layers.*.mlp.up_proj": "colwise"},  # no row layer closes the region
        "layers.*.mlp.down_proj: rowwise_split_input": {"layers.*.mlp.up_proj": "colwise",
                                                         "layers.*.mlp.down_proj": "rowwise_split_input"},
        "layers.*.self_attn.q_norm: replicated_with_grad_allreduce": {
            "layers.*.self_attn.q_proj": "colwise_gather_output", "layers.*.self_attn.o_proj": "rowwise_split_input",
            "layers.*.self_attn.q_norm": "replicated_with_grad_allreduce"},  # its gradient is whole there
        "layers.*.mlp.experts: moe_tp_experts": {"layers.*.mlp.experts": "moe_tp_experts"},  # nothing under it
        "layers.*.self_attn.kv_a_proj_with_mqa: mla_kv_a_proj": {
            "layers.*.self_attn.kv_a_proj_with_mqa": "mla_kv_a_proj"},
        "layers.*: sequence_parallel": {"layers.*": "sequence_parallel"},
    }
    for entry, bad in refusals.items():
        with pytest.raises(NotExpressible, match=re.escape(f"'{entry}'")):
            read_tp_plan(bad)
    with pytest.raises(NotExpressible, match="declares no base_model_tp_plan"):
        read_tp_plan(None)
    # a fused projection's parts from the widths: q/k/v heads (Phi-3 with 4 q, 2 kv heads of 16), gate/up
    assert packed_parts(128, 64, heads=4, kv_heads=2, head_dim=16, intermediate=128) == (64, 32, 32)
    assert packed_parts(256, 128, heads=4, kv_heads=2, head_dim=16, intermediate=128) == (128, 128)
    # gate_up of an MLP as wide as the q heads with kv = q/2: both readings fit, so neither is taken (gathered)
    assert packed_parts(128, 64, heads=4, kv_heads=2, head_dim=16, intermediate=64) is None
    assert packed_parts(96, 64, heads=4, kv_heads=2, head_dim=16, intermediate=128) is None  # no packing


def test_packed_split_places_each_part():
    """A packed projection's TP slices: rank r holds slice r of each part; `runs` places any range of
    its rows (an FSDP2 shard inside the slice) in the full tensor, `assemble` inverts the split."""
    from toolkit.parallel.tp.layers import Packed

    full = torch.arange(16.0).view(8, 2)  # parts of 4, 2, 2 rows: q, k, v
    split = Packed(0, (4, 2, 2))
    mine = [torch.cat([part.chunk(2)[r] for part in full.split([4, 2, 2])]) for r in range(2)]
    assert torch.equal(split.assemble(mine), full)
    for r in range(2):
        for start, length in ((0, 4), (1, 2), (2, 2), (3, 1)):
            for at, full_at, n in split.runs(start, length, r, 2):
                assert torch.equal(mine[r][at:at + n], full[full_at:full_at + n])
            assert sum(n for *_, n in split.runs(start, length, r, 2)) == length
    assert split.runs(0, 4, 1, 2) == [(0, 2, 2), (2, 5, 1), (3, 7, 1)]


def test_tp_problems_name_the_fix(model_dirs):
    from transformers import AutoConfig

    from toolkit.layout.rules import model_problems

    def tp_problems(config, t, world):
        return model_problems({**config.to_dict(), "base_model_tp_plan": config.base_model_tp_plan}, tp=t, pp=1, cp=1,
                              world=world)

    llama = AutoConfig.from_pretrained(model_dirs["llama_gqa"]["path"])  # 4 heads, 2 kv heads, intermediate 128
    assert tp_problems(llama, 2, 4) == []
    assert tp_problems(llama, 4, 4) == ["--tp 4: must divide the kv heads (2)"]
    assert any("world size that is a multiple of 2 (got 1 process)" in p for p in tp_problems(llama, 2, 1))
    assert any("multiple of 2 (got 3 processes)" in p for p in tp_problems(llama, 2, 3))


def test_unknown_block_layout_names_the_modules_found(model_dirs):
    from torch import nn
    from transformers import AutoModelForCausalLM

    from toolkit.errors import UserError
    from toolkit.parallel.tp import apply_tensor_parallel

    model = AutoModelForCausalLM.from_pretrained(model_dirs["llama_gqa"]["path"])
    model.model.layers[0].mlp = nn.Sequential(nn.Linear(64, 64))

    class TwoRanks:  # apply_tensor_parallel only asks the group for its size before checking blocks
        pass

    import toolkit.parallel.tp.plan as plan

    real = plan.group_size
    plan.group_size = lambda g: 2
    try:
        with pytest.raises(UserError, match=r"block 0 \(LlamaDecoderLayer\) has no mlp.gate_proj, mlp.up_proj, "
                                            r"mlp.down_proj.*layers.0.mlp.*0: Linear"):
            apply_tensor_parallel(model, TwoRanks())
    finally:
        plan.group_size = real


# ---------------------------------------------------------------- finetune.py --tp N


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model, data_files):
    """(layout, method) -> output dir. Global batch 8 everywhere: 1 x mb 8; tp2 x mb 4 x accum 2;
    tp2 x dp2 x mb 2 x accum 2."""
    layouts = {"single": (1, ["--micro-batch-size", "8"]),
               "tp2": (2, ["--tp", "2", "--micro-batch-size", "4", "--grad-accum", "2"]),
               "tp2_dp2": (4, ["--tp", "2", "--micro-batch-size", "2", "--grad-accum", "2"]),
               "tp2_gc": (2, ["--tp", "2", "--micro-batch-size", "8", "--gradient-checkpointing"]),
               "single_dropout": (1, ["--micro-batch-size", "8", "--lora-dropout", "0.1"]),
               "tp2_dropout": (2, ["--tp", "2", "--micro-batch-size", "8", "--lora-dropout", "0.1"])}
    used = [("single", "full"), ("single", "lora"), ("tp2", "full"), ("tp2", "lora"), ("tp2_dp2", "full"),
            ("tp2_dp2", "lora"), ("tp2_gc", "lora"), ("single_dropout", "lora"), ("tp2_dropout", "lora")]
    return batched_runs(tmp_path_factory, common_args(tiny_model, data_files["chat"]),
                        {(lay, m): (layouts[lay][0], ["--method", m, *layouts[lay][1]]) for lay, m in used})


@pytest.mark.parametrize("layout, method", [("tp2", "full"), ("tp2", "lora"), ("tp2_dp2", "full"),
                                            ("tp2_dp2", "lora"), ("tp2_gc", "lora")])
def test_losses_match_single_process(runs, layout, method):
    """Gradient checkpointing runs with LoRA: frozen embeddings, recomputed all-reduces."""
    ref = [r["loss"] for r in records(runs("single", method))]
    got = [r["loss"] for r in records(runs(layout, method))]
    assert len(got) == 5 and got == pytest.approx(ref, abs=1e-5, rel=1e-5), f"{layout}/{method}: {got} vs {ref}"


def test_lora_dropout_drops_the_same_features_as_one_process(runs):
    """Row-parallel LoRA inputs are split; ShardedDropout keeps the slice of the full-width mask, so
    per-step losses with --lora-dropout 0.1 match the single process (the mask is drawn as F.dropout
    draws it on CPU)."""
    ref = [r["loss"] for r in records(runs("single_dropout", "lora"))]
    got = [r["loss"] for r in records(runs("tp2_dropout", "lora"))]
    no_dropout = [r["loss"] for r in records(runs("single", "lora"))]
    assert got == pytest.approx(ref, abs=1e-5, rel=1e-5), f"{got} vs {ref}"
    assert ref[2:] != pytest.approx(no_dropout[2:], abs=1e-4)  # dropout changed the run: the check has teeth


@pytest.mark.parametrize("method", ["full", "lora"])
@pytest.mark.parametrize("layout", ["tp2", "tp2_dp2"])
def test_saved_folder_is_standard_and_reloads_with_matching_logits(runs, tiny_model, layout, method):
    """Plain transformers/peft, no toolkit code: same files, same tensors (1e-5) and same logits
    as the single-process run's folder."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    name = "model.safetensors" if method == "full" else "adapter_model.safetensors"
    ref_dir, got_dir = runs("single", method) / "final", runs(layout, method) / "final"
    ref, got = load_file(ref_dir / name), load_file(got_dir / name)
    assert got.keys() == ref.keys() and len(ref) > 0
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], **TOL, msg=k)
    config = "config.json" if method == "full" else "adapter_config.json"

    def settings(folder):  # peft writes target_modules from a set: compare it as one
        c = json.loads((folder / config).read_text())
        return {**c, "target_modules": sorted(c["target_modules"])} if "target_modules" in c else c

    assert settings(got_dir) == settings(ref_dir)

    def logits(folder):
        if method == "full":
            model = AutoModelForCausalLM.from_pretrained(folder)
        else:
            model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), folder)
        with torch.no_grad():
            return model.eval()(input_ids=torch.arange(3, 40).view(1, -1)).logits

    torch.testing.assert_close(logits(got_dir), logits(ref_dir), **TOL)


def test_tp_halves_the_sharded_parameters(runs):
    """Per-rank parameter bytes at step 1: the block linears are split in two, embeddings and norms
    are not, so tp2 holds (blocks/2 + rest) of the single-process bytes."""
    ref = records(runs("single", "full"))[0]["param_bytes"][0]
    got = records(runs("tp2", "full"))[0]["param_bytes"]
    h, kv, i, layers = 64, 2 * 16, 128, 2  # 2 kv heads of 16
    linear = layers * 4 * (2 * h * h + 2 * h * kv + 3 * h * i)  # fp32 bytes of q,o + k,v + gate,up,down
    assert len(got) == 2 and got[0] == got[1] == ref - linear // 2


@pytest.mark.parametrize("method", ["full", "lora"])
def test_planner_tp_row_matches_measured_bytes(runs, tiny_model, method):
    """The planner's tp2 row (same divisibility and split rules as the runtime plan) against the
    per-rank bytes measured at step 1: weights (adapters included), gradients, Adam states, 5%."""
    from toolkit.layout.dims import ParallelDims
    from toolkit.planner.estimate import PlanInput, estimate_layout

    cfg = json.loads((tiny_model / "config.json").read_text())
    inp = PlanInput(model=cfg, gpu_memory=2**40, gpus_per_node=2, method=method, lora_r=16, seq_len=64,
                    micro_batch=4, precision="no")
    row = estimate_layout(inp, ParallelDims(2, tp=2), False, 4)
    assert row.name == "tp2"
    measured = records(runs("tp2", method))[0]
    for rank in range(2):
        assert measured["param_bytes"][rank] == pytest.approx(row.bytes["weights"], rel=0.05)
        assert measured["grad_bytes"][rank] == pytest.approx(row.bytes["grads"], rel=0.05)
        assert measured["optim_bytes"][rank] == pytest.approx(row.bytes["optimizer"], rel=0.05)
