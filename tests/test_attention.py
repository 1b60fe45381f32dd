"""Packed attention (`toolkit.model.attention`): packed rows give each document the loss and the gradients
it gets run alone, with every kernel that runs on CPU, on a tiny Llama (2 blocks, hidden 64, 4 heads
over 2 key/value heads, fp32). Tolerance 1e-5 absolute for per-token losses and parameter gradients
(fp32; measured differences are about 1e-6). The CPU cannot run every kernel's real code:
- varlen: torch's kernel is CUDA-only; on CPU the same contract is served by `reference_varlen`,
  trained here; the call into torch's kernel is checked against its signature on meta tensors.
- flex: torch 2.13 has no CPU backward for flex_attention, so only its loss is checked here.
- flash: flash-attn is CUDA-only and not installed; transformers' real flash path runs here on
  stand-in kernels with flash-attn's signatures (`reference_varlen` inside).
"""

import pytest
import torch
import torch.nn.functional as F
from helpers import tiny_llama

from toolkit.model import attention
from toolkit.errors import UserError

DOCS = ((7, 12, 5), (20, 6), (9,))  # three packed rows: 3, 2 and 1 documents, right-padded to 26 tokens
TOL = 1e-5


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


@pytest.fixture(scope="module")
def documents() -> list[list[list[int]]]:
    g = torch.Generator().manual_seed(1)
    return [[torch.randint(1, 100, (n,), generator=g).tolist() for n in row] for row in DOCS]


def packed(documents, bounds: bool = False) -> dict:
    """The rows as `collate_packed` gives them: positions restart per document, padding its own block."""
    from toolkit.data.packing import collate_packed

    rows = [{"input_ids": sum(row, []), "labels": sum(([-100] + d[1:] for d in row), []),
             "position_ids": sum((list(range(len(d))) for d in row), [])} for row in documents]
    return collate_packed(rows, pad_id=0, bounds=bounds)


def token_losses(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """(B, S-1) cross-entropy of each next token."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="none").view(len(ids), -1)


def run(model, name: str, inputs: dict, grad: bool = True) -> tuple[torch.Tensor, dict | None]:
    """(per-token losses, parameter gradients of their sum over `labels`' targets) with attention `name`."""
    model.set_attn_implementation(name)
    model.zero_grad()
    with torch.set_grad_enabled(grad):
        logits = model(**inputs).logits
        losses = token_losses(logits, inputs["input_ids"])
        if not grad:
            return losses, None
        targets = inputs["labels"][:, 1:] != -100
        (losses * targets).sum().backward()
    return losses.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def alone(model, documents) -> tuple[list[torch.Tensor], dict]:
    """Each document run on its own (sdpa, no padding): its per-token losses, and the gradients of
    all their sums."""
    model.set_attn_implementation("sdpa")
    model.zero_grad()
    losses = []
    for row in documents:
        for d in row:
            ids = torch.tensor([d])
            loss = token_losses(model(input_ids=ids).logits, ids)[0]
            loss.sum().backward()
            losses.append(loss.detach())
    return losses, {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_documents(losses: torch.Tensor, grads: dict | None, alone) -> None:
    """Each document's tokens in the packed rows have the losses (and together the gradients) they have alone."""
    want, want_grads = alone
    got = [losses[r, sum(row[:i]):sum(row[:i + 1]) - 1] for r, row in enumerate(DOCS) for i in range(len(row))]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=TOL, rtol=0)
    for n, g in (grads or {}).items():
        torch.testing.assert_close(g, want_grads[n], atol=TOL, rtol=0, msg=n)


def model_inputs_of(batch: dict) -> dict:
    from toolkit.data.packing import model_inputs

    return {**model_inputs(batch), "labels": batch["labels"]}


@pytest.mark.parametrize("kernel", attention.available("cpu"))
def test_packed_rows_train_as_documents_alone(model, documents, alone, kernel):
    """sdpa (the dense block-diagonal mask) and varlen: losses and gradients."""
    name = attention.attn_implementation(kernel, "cpu", packing=True)
    losses, grads = run(model, name, model_inputs_of(packed(documents)))
    assert_documents(losses, grads, alone)


def test_collated_bounds_match_the_positions(model, documents, alone):
    """`collate_packed(bounds=True)`: the kwargs are computed on the CPU, model_inputs passes them,
    and the kernels use them instead of deriving their own."""
    batch = packed(documents, bounds=True)
    assert batch["cu_seq_lens"].tolist() == [0, 7, 19, 24, 26, 46, 52, 61, 78]
    assert batch["max_length"] == 20
    inputs = model_inputs_of(batch)
    assert inputs["cu_seq_lens_q"] is batch["cu_seq_lens"] and inputs["max_length_q"] == 20
    losses, grads = run(model, attention.register("varlen"), inputs)
    assert_documents(losses, grads, alone)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_forward_matches_documents_alone(model, documents, alone):
    """Loss only: torch 2.13's flex_attention refuses a CPU backward (gradients are for the GPU run)."""
    losses, _ = run(model, attention.register("flex"), model_inputs_of(packed(documents)), grad=False)
    assert_documents(losses, None, alone)


def test_flash_wrapper_gives_packed_rows_their_documents(model, documents, alone, monkeypatch):
    """transformers' flash path, on stand-ins for flash-attn's two functions: the wrapper hands it
    cu_seqlens, which it infers only for a batch of one row (3 rows here)."""
    import transformers.modeling_flash_attention_utils as fa
    from transformers.modeling_flash_attention_utils import _pad_input, _unpad_input

    def varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
               causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
               return_attn_probs=False, block_table=None):
        window = (-1, 0) if causal else (-1, -1)
        return attention.reference_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                          scale=softmax_scale, window_size=window, enable_gqa=True)

    def dense(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
              alibi_slopes=None, deterministic=False, return_attn_probs=False):
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=softmax_scale, enable_gqa=True)
        return out.transpose(1, 2)

    monkeypatch.setattr(fa, "_lazy_imports", lambda *a, **k: (dense, varlen, None, _pad_input, _unpad_input))
    monkeypatch.setattr(fa, "_loaded_implementation", None)  # transformers caches loaded kernels: not ours, after
    monkeypatch.setattr(attention, "flash_package", lambda: "flash_attention_2")
    losses, grads = run(model, attention.register("flash"), model_inputs_of(packed(documents)))
    assert_documents(losses, grads, alone)


def test_varlen_calls_torch_kernel_as_it_is_defined(model, documents, monkeypatch):
    """The call a CUDA run makes into torch.nn.attention.varlen.varlen_attn, replayed on meta
    tensors (shapes only): its signature, GQA heads and output shape."""
    from torch.nn.attention.varlen import varlen_attn

    calls = []

    def spy(*args, **kwargs):
        calls.append((args, kwargs))
        return attention.reference_varlen(*args, **kwargs)

    monkeypatch.setattr(attention, "_varlen_kernel", lambda device, dtype: spy)
    run(model, attention.register("varlen"), model_inputs_of(packed(documents)), grad=False)
    assert len(calls) == 2  # one per layer
    args, kwargs = calls[0]
    meta = [a.to("meta", torch.bfloat16 if a.is_floating_point() else a.dtype) if torch.is_tensor(a) else a
            for a in args]
    assert attention.adapt_varlen(varlen_attn)(*meta, **kwargs).shape == args[0].shape


def test_varlen_adapts_to_each_torch_versions_signature():
    """torch's varlen_attn as each version defines it (the newest: enable_gqa and window_size; torch 2.11:
    no enable_gqa, as the H200 image's raised; older: is_causal) gives the reference's GQA causal output
    through `adapt_varlen`: k and v repeated to the query's heads where the kernel cannot."""
    torch.manual_seed(0)
    q, k, v = torch.randn(10, 4, 8), torch.randn(10, 2, 8), torch.randn(10, 2, 8)
    cu = torch.tensor([0, 3, 10], dtype=torch.int32)
    want = attention.reference_varlen(q, k, v, cu, cu, 7, 7, scale=0.3, window_size=(-1, 0), enable_gqa=True)

    def newest(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
        return attention.reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=window_size,
                                          enable_gqa=enable_gqa)

    def torch_2_11(q, k, v, cu_q, cu_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)):
        assert k.shape[1] == q.shape[1]
        return attention.reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=window_size)

    def older(q, k, v, cu_q, cu_k, max_q, max_k, *, is_causal=False, return_aux=None, scale=None):
        assert k.shape[1] == q.shape[1]
        return attention.reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale,
                                          window_size=(-1, 0) if is_causal else (-1, -1))

    for kernel in (newest, torch_2_11, older):
        got = attention.adapt_varlen(kernel)(q, k, v, cu, cu, 7, 7, scale=0.3, window_size=(-1, 0), enable_gqa=True)
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    with pytest.raises(UserError, match="no sliding window"):
        attention.adapt_varlen(older)(q, k, v, cu, cu, 7, 7, window_size=(4, 0))


def test_boundaries_are_derived_once_per_forward(model, documents, monkeypatch):
    calls = []
    derive = attention.document_bounds
    monkeypatch.setattr(attention, "document_bounds", lambda p: calls.append(1) or derive(p))
    run(model, attention.register("varlen"), model_inputs_of(packed(documents)))
    assert len(calls) == 1  # two layers, forward and backward
    inputs = model_inputs_of(packed(documents, bounds=True))
    calls.clear()
    run(model, attention.register("varlen"), inputs)
    assert not calls  # the collate's bounds are used


def test_checkpointed_layers_reuse_the_boundaries(documents, alone, monkeypatch):
    """Activation checkpointing (as `toolkit.parallel.parallelize` enables it) recomputes each layer's attention in
    the backward, handed the same position tensor: 4 kernel calls, 1 derivation."""
    from toolkit.parallel.parallelize import apply_checkpointing

    calls, kernels = [], []
    derive = attention.document_bounds
    monkeypatch.setattr(attention, "document_bounds", lambda p: calls.append(1) or derive(p))
    monkeypatch.setattr(attention, "_varlen_kernel", lambda *_: kernels.append(1) or attention.reference_varlen)
    model = tiny_llama()
    apply_checkpointing(model)
    model.train()
    losses, grads = run(model, attention.register("varlen"), model_inputs_of(packed(documents)))
    assert_documents(losses, grads, alone)
    assert len(kernels) == 4 and len(calls) == 1


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("kernel", ["varlen", "flex"])
def test_padded_batch_matches_sdpa(model, documents, kernel):
    """An unpacked, right-padded batch goes to SDPA with its mask, whichever kernel is named."""
    from toolkit.data import collate

    rows = [{"input_ids": d, "labels": d} for d in (documents[0][1], documents[1][1], documents[2][0])]
    inputs = model_inputs_of(collate(rows, pad_id=0))
    want, want_grads = run(model, "sdpa", inputs, grad=kernel != "flex")
    got, grads = run(model, attention.register(kernel), inputs, grad=kernel != "flex")
    real = inputs["attention_mask"][:, 1:] == 1
    torch.testing.assert_close(got[real], want[real], atol=TOL, rtol=0)
    for n, g in (grads or {}).items():
        torch.testing.assert_close(g, want_grads[n], atol=TOL, rtol=0, msg=n)


def test_generation_with_a_cache_matches_sdpa(model):
    """Prefill and one-token decode steps with a KV cache, left padding included."""
    ids = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    out = {}
    for name in ("sdpa", attention.register("varlen")):
        model.set_attn_implementation(name)
        out[name] = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                                   pad_token_id=0)
    assert out["sdpa"].tolist() == out["packed_varlen"].tolist()


def test_document_bounds():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1], [0, 1, 2, 3, 4, 5, 6]])  # 3 documents + 1 (no packing)
    bounds = attention.document_bounds(positions)
    assert bounds["cu_seq_lens_q"].tolist() == [0, 3, 5, 7, 14] and bounds["cu_seq_lens_q"].dtype == torch.int32
    assert bounds["max_length_q"] == bounds["max_length_k"] == 7
    assert attention.document_ids(positions).tolist() == [[0, 0, 0, 1, 1, 2, 2], [0] * 7]


def test_auto_picks_an_available_kernel():
    for packing in (True, False):
        assert attention.auto_choice("cpu", packing, attention.available("cpu")) in attention.available("cpu")
    assert attention.attn_implementation("auto", "cpu", packing=False) == "sdpa"
    assert attention.auto_choice("cuda", True, ["sdpa", "flex", "varlen", "flash"]) == "varlen"
    assert attention.auto_choice("cuda", True, ["sdpa", "flex", "flash"]) == "flash"
    assert attention.auto_choice("cuda", True, ["sdpa", "flex"]) == "flex"
    assert attention.auto_choice("cuda", False, ["sdpa", "flex", "varlen"]) == "sdpa"


@pytest.mark.parametrize(("choice", "device", "says"), [
    ("flex", "cpu", "no backward"), ("flash", "cpu", "NVIDIA GPUs only"), ("sdpa2", "cpu", "choose one of")])
def test_unavailable_kernel_is_one_error_naming_the_fix(choice, device, says):
    with pytest.raises(UserError, match=says) as e:
        attention.attn_implementation(choice, device, packing=True)
    assert "\n" not in str(e.value)


@pytest.mark.skipif(attention.flash_package() is not None, reason="flash-attn is installed here")
def test_flash_without_the_package_says_what_to_install():
    with pytest.raises(UserError, match="pip install flash-attn"):
        attention.attn_implementation("flash", "cuda", packing=True)


def test_the_flag_offers_the_kernels_there_are():
    """--attn's choices in the config (which sits below the models layer and cannot import it) are
    toolkit.model.attention's."""
    from toolkit.model.attention import CHOICES
    from toolkit.config import _fields

    assert _fields()["attn"][1].metadata["choices"] == CHOICES


def skeleton(model_type: str, **overrides):
    """`toolkit.model.synthetic.ZOO`'s config as a weightless model, as `check_model` sees it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from toolkit.model.synthetic import ZOO

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **{**ZOO[model_type], **overrides}))


def test_each_model_gets_the_attention_it_supports_or_one_line():
    """The default is transformers' own pick (sdpa where the class supports it, else eager); packed rows
    take a padding-free kernel only where it implements the model's softcapping, sinks and windows, else
    the model's own attention with a block-diagonal mask; an --attn the model cannot run is one line."""
    choose = attention.choose_attention
    gemma2, gpt_oss, llama = skeleton("gemma2"), skeleton("gpt_oss"), skeleton("llama")
    assert attention.model_features(gemma2, 64) == ["softcap", "sliding windows"]
    assert attention.model_features(gemma2, 16) == ["softcap"]  # a window as long as the rows is none
    assert attention.model_features(gpt_oss, 64) == ["attention sinks", "sliding windows"]
    assert attention.model_features(llama, 64) == []
    assert choose("auto", "cpu", False, gemma2, 64) == (None, "attention: eager (transformers' for Gemma2ForCausalLM)")
    assert choose("auto", "cpu", False, llama, 64) == (None, "attention: sdpa (transformers' for LlamaForCausalLM)")
    assert choose("auto", "cpu", True, llama, 64)[0] == "packed_varlen"
    assert choose("auto", "cpu", True, gpt_oss, 64) == (
        None, "attention: eager with a block-diagonal mask for packed rows (the padding-free kernels here do not "
              "implement GptOssForCausalLM's attention sinks, sliding windows)")
    assert attention.model_features(skeleton("gpt2", attn_pdrop=0.1), 64) == ["attention dropout"]  # GPT-2's default
    with pytest.raises(UserError, match="Gemma2ForCausalLM does not support torch's scaled_dot_product_attention"):
        choose("sdpa", "cpu", False, gemma2, 64)
    with pytest.raises(UserError, match="--attn varlen does not implement Gemma2ForCausalLM's softcap, "
                                        "sliding windows; leave --attn out"):
        choose("varlen", "cpu", True, gemma2, 64)


PACKED_BF16 = {"llama": False, "qwen3": False, "gemma2": False, "mistral": False, "gpt_oss": True}  # -> leaks


@pytest.mark.parametrize("arch", PACKED_BF16)
def test_packing_check_tells_bf16_rounding_from_a_leak(arch):
    """The packing check's decision (`toolkit.train.loss_check.leaks`) on real logits in bf16: each model
    with the attention --packing gives it here, two documents packed in bf16 against each alone in fp32
    (two computations that differ by bf16 rounding, as a GPU's varlen kernel and SDPA do, 4.9e-3 and
    6.5e-3 of the largest logit on one H100, issue 56; the CPU's reference kernels agree exactly in any
    one dtype). Llama, Qwen3, Gemma 2 and Mistral pass at bf16's bound (`toolkit.train.numerics.agreement`),
    where the fp32 bound of 1e-4 refused them; gpt-oss, whose mask ignores the positions, is refused."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from toolkit.train.numerics import FP32_RTOL, agreement
    from toolkit.model.synthetic import ZOO
    from toolkit.train.loss_check import leaks, packing_gaps

    small = ZOO.get(arch, ZOO["llama"])  # mistral: Llama's widths, its own class (sliding window off)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(arch, **small, vocab_size=384)).eval()
    name, _ = attention.choose_attention("auto", "cpu", True, model, 64)
    if name is not None:
        model.set_attn_implementation(name)
    low = AutoModelForCausalLM.from_config(model.config, dtype=torch.bfloat16).eval()
    low.load_state_dict(model.state_dict())
    ids, n = torch.randint(5, 384, (1, 32)), 16
    positions = torch.cat([torch.arange(n), torch.arange(n)])[None]
    with torch.no_grad():
        packed = low(input_ids=ids, position_ids=positions, use_cache=False).logits.float()  # a cache: no packing
        alone = torch.cat([model(input_ids=ids[:, :n], use_cache=False).logits,
                           model(input_ids=ids[:, n:], use_cache=False).logits], 1)
    rounding, gap = packing_gaps(packed, alone, n)
    assert 2e-3 < rounding < agreement(torch.bfloat16)  # bf16 rounding, well over the fp32 bound
    assert gap > FP32_RTOL  # the old bound (fp32's, whatever the dtype) refused every model
    assert leaks(rounding, gap, torch.bfloat16) == PACKED_BF16[arch], (arch, rounding, gap)
