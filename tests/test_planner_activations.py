"""Predicted activation bytes vs what autograd actually saves (saved_tensors_hooks): the planner's
terms (`toolkit.planner.saved`) on models loaded as the toolkit loads them, and its mesh layouts."""

import json
import weakref

import pytest
import torch
from helpers import build_model_dir, random_model
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


CFG = dict(hidden_size=128, intermediate_size=352, num_hidden_layers=3, num_attention_heads=4,
           num_key_value_heads=2, vocab_size=512, tie_word_embeddings=False)
SDPA = dict(CFG, attn_implementation="sdpa", use_cache=False)  # the mesh layouts' model: sdpa, no KV cache


# SmolLM2-135M's block (the shape of the H100 memory cases), two of them
SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=2, num_attention_heads=9, num_key_value_heads=3)


@pytest.fixture(scope="module")
def shaped_model(tmp_path_factory):
    return build_model_dir(tmp_path_factory.mktemp("saved") / "model", **SHAPE)


def _load(model_dir, method: str, precision: str, dropout: float = 0.0, checkpointing: bool = False):
    """The model as `toolkit.model.load.load_model` loads it and `parallelize` adds `method`'s adapters."""
    from toolkit.config import parse_config
    from toolkit.model.load import ModelShape, load_model
    from toolkit.parallel.parallelize import Parallelism, apply_checkpointing, parallelize

    cfg = parse_config(["--model", str(model_dir), "--output-dir", str(model_dir.parent / "o"), "--method", method,
                        "--mixed-precision", precision, "--lora-dropout", str(dropout)])
    torch.manual_seed(0)
    model, _ = parallelize(load_model(cfg, str(model_dir)), Parallelism(ModelShape.of(cfg)))
    model.train()
    if checkpointing:
        apply_checkpointing(model)
    return model


def _forward_saved(model, precision: str, batch: int, seq: int) -> int:
    """Bytes autograd saves in a forward of `model`'s decoder, under CPU autocast for bf16, parameters
    excluded."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    ids = torch.randint(10, 200, (batch, seq))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        return _saved(lambda: base.model(input_ids=ids), params)


@pytest.mark.parametrize("method, precision, dropout, checkpointing", [
    ("full", "bf16", 0.0, False), ("lora", "bf16", 0.05, False), ("lora", "bf16", 0.0, False),
    ("full", "no", 0.0, False), ("lora", "no", 0.0, False), ("full", "bf16", 0.0, True), ("lora", "bf16", 0.05, True)])
def test_saved_terms_equal_what_autograd_saves(shaped_model, method, precision, dropout, checkpointing):
    """`toolkit.planner.saved`'s terms, summed over the blocks and what lies outside them, against the
    storages autograd keeps in a forward (saved_tensors_hooks) of the model as the toolkit loads it:
    full finetune (fp32 weights, fp32 stream, autocast's per-linear casts), LoRA (bf16 base, peft's
    fp32 adapter input, its dropout's noise on the CPU), fp32, and checkpointing (each block's input),
    with autocast's bf16 copies of the trainable weights the linears save. Within 3%."""
    from toolkit.planner import saved
    from toolkit.planner.params import linear_shapes, lora_params

    cfg = {**SHAPE, "vocab_size": 512}
    h, i, heads, layers = SHAPE["hidden_size"], SHAPE["intermediate_size"], SHAPE["num_attention_heads"], 2
    kv, hd = SHAPE["num_key_value_heads"] * h // heads, h // heads
    d = saved.dtypes(method, precision, device="cpu")
    adapted = None if method == "full" else {n: fi for n, (fi, fo) in linear_shapes(cfg).items()}
    block = saved.checkpointed_block(h, d) if checkpointing else saved.block(h, i, kv, heads, d, adapted, 16, dropout)
    matmul = layers * sum(a * b for a, b in linear_shapes(cfg).values()) if method == "full" else lora_params(cfg, 16)
    copies = 0 if checkpointing else saved.autocast_copies(matmul, 4, d)  # checkpointing saves only block inputs
    # a LoRA linear saves its adapters' copies only where its input needs a gradient (not in the first
    # block, whose input is the frozen embedding's): at most `copies`, a slack here, not a term
    slack, copies = (copies, 0) if method == "lora" else (0, copies)
    # the rotary tables reach checkpointed blocks as the checkpoint's stored inputs, not as saved tensors
    outside = saved.outside_blocks(h, hd, d) - (2 * hd * d.residual if checkpointing else 0)
    model = _load(shaped_model, method, precision, dropout, checkpointing)
    for batch, seq in ((1, 64), (2, 96)):
        predicted = batch * seq * (layers * block + outside) + copies
        got = _forward_saved(model, precision, batch, seq)
        # the first block's q, k and v adapters read the frozen embedding's output, which needs no
        # gradient: their dropout keeps no noise, and its attention norm saves nothing. The terms count
        # them (over by this, once per model; 3% of this 2-block model in fp32, where nothing else is cast).
        lora = method == "lora" and not checkpointing
        first = (3 * d.mask * h * (dropout > 0) + saved.rmsnorm(h, d)) * batch * seq if lora else 0
        assert (predicted - first) * 0.97 <= got <= (predicted + slack) * 1.03, (batch, seq)


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    """Tiny Qwen3-MoE (block 0 dense: `mlp_only_layers`) and Mixtral models from the zoo, their router
    aux loss off (this counts the blocks, not the loss)."""
    from toolkit.model.synthetic import build_zoo_model_dir

    root = tmp_path_factory.mktemp("moe")
    return {t: build_zoo_model_dir(root / t, t, output_router_logits=False) for t in ("qwen3_moe", "mixtral")}


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("method, precision", [("full", "bf16"), ("lora", "bf16"), ("full", "no")])
def test_moe_saved_terms_equal_what_autograd_saves(moe_models, model_type, method, precision):
    """`saved.layer` for MoE blocks (the router's fp32 probabilities and top-k indices, the dispatch's
    index vectors, each token's top-k copies through gate_up, SiLU and down in the experts' dtype, the
    routing weights; and a LoRA's per-forward merged expert and router weights, peft's ParamWrapper)
    against the storages autograd keeps in a forward of the model as the toolkit loads it (transformers'
    default grouped_mm experts kernel): full bf16 (fp32 weights, autocast copies of every weight but the
    stacked experts, which run in fp32), LoRA bf16 (`all-linear`: peft adapts the stacked experts and the
    router of these models) and fp32. Within 3%, at two token counts, so both the per-token and the
    per-forward terms are held to it."""
    import json

    from toolkit.planner import saved
    from toolkit.planner.params import adapters, cast_weights, head_dim

    model_dir = moe_models[model_type]
    cfg = json.loads((model_dir / "config.json").read_text())
    h, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    d = saved.dtypes(method, precision, device="cpu")
    targets = None if method == "full" else "all-linear"
    per = saved.layers(cfg, d, targets, 16)
    assert any(x.per_forward for x in per) == (method == "lora")  # the merged experts: LoRA only
    outside = saved.outside_blocks(h, head_dim(cfg), d)
    linear_adapters = sum(a.params() for i in range(layers) for a in adapters(cfg, i, 16, "all-linear")
                          if not a.expert and a.name != "gate")
    # autocast's copies: a full finetune's weights but the experts' (grouped_mm is not cast) and the LM
    # head's (not run here); LoRA's nn.Linear adapters, a slack as in the dense test above
    copies = saved.autocast_copies(cast_weights(cfg) - cfg["vocab_size"] * h if method == "full" else linear_adapters,
                                   4, d)
    slack, copies = (copies, 0) if method == "lora" else (0, copies)
    model = _load(model_dir, method, precision)
    for batch, seq in ((1, 64), (2, 96)):
        tokens = batch * seq
        predicted = tokens * (sum(x.per_token for x in per) + outside) + sum(x.per_forward for x in per) + copies
        got = _forward_saved(model, precision, batch, seq)
        # the first block's input norm reads the frozen embedding's output under LoRA: it keeps nothing.
        # The terms count it (over by this, once per model).
        first = tokens * saved.rmsnorm(h, d) if method == "lora" else 0
        assert (predicted - first) * 0.97 <= got <= (predicted + slack) * 1.03, (batch, seq, got, predicted)


def test_dropout_mask_on_cuda_is_one_byte_per_element():
    """The one CPU/CUDA difference the terms carry: CUDA's dropout is `native_dropout`, which saves a
    bool mask; run here on CPU tensors directly, it saves exactly that (the CPU's own `dropout` saves
    a noise tensor of the input's dtype instead, as the test above measures)."""
    x = torch.randn(64, 96, requires_grad=True)
    assert _saved(lambda: torch.native_dropout(x, 0.1, True)[0].sum(), set()) == 64 * 96


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


def _predicted(dims, stage: int, batch: int, seq: int) -> int:
    from toolkit.planner.layouts import stage_bytes
    from toolkit.planner.estimate import PlanInput

    from toolkit.planner import saved

    inp = PlanInput(model=CFG, gpu_memory=2**40, method="full", seq_len=seq, micro_batch=batch, precision="no")
    transient = saved.backward_transient(CFG["hidden_size"], CFG["intermediate_size"] // dims.tp,
                                         saved.dtypes("full", "no")) * batch * -(-seq // dims.cp)
    return stage_bytes(inp, dims, stage, False, batch)["activations"] - transient  # what backward adds is not saved


def _mesh_saved(batch: int, seq: int) -> dict[str, int]:
    """On each of 4 gloo ranks laid out cp 2 x tp 2 (the runtime's mesh): forwards under tp 2, cp 2,
    cp 2 x tp 2, and each pp 2 stage of the tp 2 model run alone (stage 1 from a hidden-state
    input, 1 x 2*seq tokens), bytes saved for backward on this rank."""
    import torch.distributed as dist

    from toolkit.parallel.cp import ContextParallel, use_ulysses
    from toolkit.layout.dims import ParallelDims
    from toolkit.parallel.mesh import Mesh
    from toolkit.parallel.pp.split import DecoderStage, decoder_parts
    from toolkit.parallel.tp import apply_tensor_parallel
    from toolkit.planner.layouts import stage_blocks

    dist.init_process_group("gloo")
    try:
        mesh = Mesh(ParallelDims(4, cp=2, tp=2), "cpu")
        tp_group, cp_group = mesh.group("tp"), mesh.group("cp")
        ids = torch.randint(0, CFG["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(0))
        rows = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
        out = {}
        for name, tp, cp in (("tp2", True, False), ("cp2", False, True), ("cp2_tp2", True, True)):
            model = random_model("llama", **SDPA).train()
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
        model = apply_tensor_parallel(random_model("llama", **SDPA).train(), tp_group)
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

    from toolkit.layout.dims import ParallelDims

    batch, seq = 2, 128
    layouts = {"tp2": ParallelDims(4, tp=2, dp_replicate=2), "cp2": ParallelDims(4, cp=2, dp_replicate=2),
               "cp2_tp2": ParallelDims(4, cp=2, tp=2)}
    for rank in run_distributed(_mesh_saved, 4, batch, seq):
        for name, dims in layouts.items():
            assert rank[name] == pytest.approx(_predicted(dims, 0, batch, seq), rel=0.15), name
        for stage in (0, 1):
            want = _predicted(ParallelDims(4, pp=2, tp=2), stage, 1, 2 * seq)
            assert rank[f"pp2_tp2/{stage}"] == pytest.approx(want, rel=0.15), stage


def _kept(run, params) -> int:
    """Bytes of distinct storages saved for backward by `run()` that still hold memory when it returns
    (FSDP2 frees its gathered parameters after each block's forward), parameters excluded."""
    kept = []

    def pack(t):
        kept.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    sizes = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in kept}
    return sum(n for ptr, n in sizes.items() if ptr not in params)


@pytest.mark.parametrize("method", ["full", "lora"])
def test_fsdp_keeps_no_weight_copies(shaped_model, tmp_path, method):
    """FSDP2 in bf16 (`toolkit.parallel.fsdp.apply_fsdp`: the mixed-precision policy, no autocast) on one
    gloo rank: what a forward leaves saved for backward is the planner's terms under the policy
    (`saved.dtypes(fsdp=True)`: the stream in bf16 as the gathered weights are, no autocast copies)
    within 3%, with no whole-model copy; the same model under autocast keeps the bf16 copies of its
    trainable weights on top (`saved.autocast_copies`, the 129 GiB a rank of a 70B full finetune held)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from toolkit.parallel.fsdp import apply_fsdp
    from toolkit.planner import saved
    from toolkit.planner.params import linear_shapes

    cfg = {**SHAPE, "vocab_size": 512}
    h, i, heads, layers = SHAPE["hidden_size"], SHAPE["intermediate_size"], SHAPE["num_attention_heads"], 2
    kv, hd = SHAPE["num_key_value_heads"] * h // heads, h // heads
    d = saved.dtypes(method, "bf16", device="cpu", fsdp=True)
    adapted = None if method == "full" else {n: fi for n, (fi, fo) in linear_shapes(cfg).items()}
    block = saved.block(h, i, kv, heads, d, adapted, 16, 0.0)
    batch, seq = 2, 96
    ids = torch.randint(10, 200, (batch, seq))
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        model = _load(shaped_model, method, "bf16")
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        apply_fsdp(base.model, list(base.model.layers), init_device_mesh("cpu", (1,)), True, torch.bfloat16)
        shards = {getattr(p, "_local_tensor", p).untyped_storage().data_ptr() for p in model.parameters()}
        got = _kept(lambda: base.model(input_ids=ids), shards)
    finally:
        dist.destroy_process_group()
    predicted = batch * seq * (layers * block + saved.outside_blocks(h, hd, d))
    # LoRA: the first block's input norm reads the frozen embedding's output and keeps nothing
    first = batch * seq * saved.rmsnorm(h, d) if method == "lora" else 0
    assert (predicted - first) * 0.97 <= got <= predicted * 1.03, (got, predicted)
    if method == "full":  # under autocast: the weights' bf16 copies on top (and an fp32 stream)
        matmul = layers * sum(a * b for a, b in linear_shapes(cfg).values())
        copies = saved.autocast_copies(matmul, 4, saved.dtypes("full", "bf16", "cpu"))
        assert _forward_saved(_load(shaped_model, "full", "bf16"), "bf16", batch, seq) - got >= copies > got


class LiveBytes(TorchDispatchMode):
    """A step's tensor memory on any device, as the CUDA allocator's `max_memory_allocated` counts it there: the bytes
    of the storages alive (those of `tensors` given at the start, and every storage an op makes inside the mode:
    forward, backward, the optimizer's step) and their peak. Each is counted until it is freed (a weak reference to
    the storage), as torch.distributed._tools.mem_tracker.MemTracker counts them (within 0.2% of it on the LoRA
    case below; 3x faster)."""

    def __init__(self, tensors=()):
        super().__init__()
        self._refs, self.live, self.peak = {}, 0, 0
        for t in tensors:
            self._add(t.untyped_storage())

    def _add(self, storage) -> None:
        key, n = storage._cdata, storage.nbytes()
        if key in self._refs:
            return
        self.live += n
        self.peak = max(self.peak, self.live)

        def freed(_, key=key, n=n):
            self.live -= n
            self._refs.pop(key, None)

        self._refs[key] = weakref.ref(storage, freed)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._add(t.untyped_storage())
        return out


# a LLaVA whose language model has 6 blocks (the planner's one-block terms are the backward's; at 2 blocks they are
# a third of the whole, at a real model's 24 to 80 a few percent)
VLM_TEXT = dict(hidden_size=128, intermediate_size=352, num_hidden_layers=6, num_attention_heads=4,
                num_key_value_heads=2)


@pytest.fixture(scope="module")
def vlm_case(tmp_path_factory):
    """The LLaVA above and four examples of one 56 px image and a long prompt each (rows of equal length)."""
    import json

    from PIL import Image

    from toolkit.model.synthetic import build_llava_dir

    root = tmp_path_factory.mktemp("vlm_peak")
    model = build_llava_dir(root / "llava", image_size=56, **VLM_TEXT)
    Image.new("RGB", (56, 56), (200, 30, 30)).save(root / "red.png")
    row = {"messages": [{"role": "user", "content": [{"type": "image", "image": "red.png"},
                                                     {"type": "text", "text": " ".join(["describe"] * 60)}]},
                        {"role": "assistant", "content": "red " * 8}]}
    (root / "data.jsonl").write_text((json.dumps(row) + "\n") * 4)
    return model, root / "data.jsonl"


@pytest.mark.parametrize("method, train_vision", [("lora", "none"), ("full", "none"), ("lora", "projector")])
def test_planner_peak_of_an_image_text_step_within_10_percent_of_the_measured(vlm_case, method, train_vision):
    """The planner's allocator peak for an image-text model's training step (its language model as text, the rows
    at their length with the image tokens in them; the vision tower and projector counted by `plan_view`, trained as
    --method and --train-vision leave them) against the peak of the storages alive in two steps (forward with the
    toolkit's loss head, backward, AdamW) of the model as the toolkit loads it, padded batch of 4, fp32 on the CPU
    (`LiveBytes`: the CPU has no allocator statistics). Within 10%. The start-up probe's phase
    (`saved.allocated_peak`'s last) is not the step's and is left out."""
    from toolkit.cli.startup import resolve_images, settle
    from toolkit.data.image_rows import MediaCollate
    from toolkit.data.prepare import prepare_data
    from toolkit.model.load import ModelShape, load_model, load_tokenizer
    from toolkit.model.vision import plan_view, processor_for
    from toolkit.objectives.head import LossHead
    from toolkit.parallel.parallelize import Parallelism, parallelize
    from toolkit.planner import saved
    from toolkit.planner.estimate import PlanInput, estimate
    from toolkit.planner.memory import STRATEGIES

    model_dir, data = vlm_case
    cfg = resolve_images(settle(["--model", str(model_dir), "--dataset", str(data), "--method", method,
                                 "--train-vision", train_vision, "--mixed-precision", "no", "--no-padding-free",
                                 "--seq-len", "1024", "--output-dir", str(data.parent / "o")]), str(model_dir))
    tokenizer = load_tokenizer(str(model_dir))
    processor = processor_for(str(model_dir), tokenizer)
    batch = MediaCollate(processor, tokenizer.pad_token_id)(prepare_data(cfg.data_settings, tokenizer,
                                                                         processor=processor).train)
    rows, width = batch["input_ids"].shape
    torch.manual_seed(0)
    model, _ = parallelize(load_model(cfg, str(model_dir)), Parallelism(ModelShape.of(cfg)))
    model.train()
    head = LossHead()
    head.choose(model, "auto")
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    inputs = [v for v in batch.values() if isinstance(v, torch.Tensor)]
    with LiveBytes([*model.parameters(), *model.buffers(), *inputs]) as live:
        # the second step's Adam state exists from the first's end
        for _ in range(2):
            head(model, batch).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    text, vision = plan_view(json.loads((model_dir / "config.json").read_text()))
    inp = PlanInput(model=text, gpu_memory=2**40, gpus_per_node=1, method=method, lora_r=cfg.model.lora_r,
                    seq_len=width, micro_batch=rows, precision="no", vision=vision, train_vision=train_vision)
    b = estimate(inp, STRATEGIES["ddp"], False, rows).bytes
    embedding_grad = 4 * text["vocab_size"] * text["hidden_size"] if method == "full" else 0
    predicted = saved.allocated_peak(b["weights"], b["grads"], b["optimizer"], b["autocast_copies"],
                                     b["activations"], 0, b["logits"], False, False, embedding_grad, 0)
    assert rows == 4 and width == 429, width
    assert predicted == pytest.approx(live.peak, rel=0.10), (predicted / live.peak, b)
