"""Causal-LM loss as a *sum* over target tokens, so the caller can normalise by the global count.

Normalising per micro-batch (the mean) weights short batches more than long ones and makes the
update depend on how a global batch is cut into micro-batches and ranks. Summing here and dividing
by the number of target tokens in the whole global batch (all ranks, all accumulation steps) makes
1 process x micro-batch 8 and 2 processes x micro-batch 2 x accumulation 2 the same update.

`--loss` (`loss_head_for`): `full` computes (B, T, V) logits, then the cross-entropy; `chunked` runs
the LM head and the cross-entropy a chunk of rows at a time inside the head's forward, so the logits
never exist whole; `liger` and `cce` do that with Liger-Kernel's or Apple's Cut Cross-Entropy's
Triton kernels (CUDA, the `[gpu]` extra); `auto` picks one (`choose_loss`).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import warnings
from contextlib import contextmanager
from typing import Callable, Iterator

import torch
import torch.nn.functional as F

from toolkit.data.labels import shift_labels, target_rows
from toolkit.data.tokenize import IGNORE_INDEX
from toolkit.errors import UserError


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropies in fp32. logits (B, T, V), labels (B, T) -> scalar."""
    return target_loss_sum(logits, shift_labels(labels))


def target_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """`token_loss_sum` on labels already shifted (context parallel shifts before it splits a sequence)."""
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1).to(logits.device),
                           ignore_index=IGNORE_INDEX, reduction="sum")


def flat_targets(hidden: torch.Tensor, labels: torch.Tensor, shifted: bool = False,
                 rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden (B, T, h), labels (B, T) -> (N, h) rows and their (N,) next-token targets: every position
    (ignored ones keep IGNORE_INDEX and still cost the head's FLOPs), or only `rows` (`target_rows`)."""
    h = hidden.reshape(-1, hidden.size(-1))
    y = (labels if shifted else shift_labels(labels)).reshape(-1).to(hidden.device, non_blocking=True)
    if rows is None:
        return h, y
    rows = rows.to(hidden.device, non_blocking=True)
    return h.index_select(0, rows), y.index_select(0, rows)


def matmul_dtype(device_type: str, hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """What `F.linear(hidden, weight)` multiplies in: autocast's dtype where autocast is on."""
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return torch.promote_types(hidden.dtype, weight.dtype)


def softmax_grad_(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """One chunk's summed cross-entropy; `logits` is overwritten with its gradient.

    logits (c, V) in the matmul dtype, targets (c,) -> fp32 scalar. d CE / d z = softmax(z) - onehot(y),
    the gradient of log-sum-exp(z) minus the target logit; rows whose target is IGNORE_INDEX get 0. The
    softmax and the one-hot subtraction run in fp32 (a bf16 p - 1 near p = 1 would lose the gradient),
    as `target_loss_sum`'s. Static shapes and no host reads: torch.compile fuses it into one kernel
    (measured on CPU inductor), eagerly every in-place op is one pass over the chunk."""
    valid = (targets != IGNORE_INDEX).unsqueeze(1)
    # any column will do on an ignored row
    y = torch.where(valid, targets.unsqueeze(1), 0)
    # the same buffer when the logits are fp32
    z = logits.float()
    target = z.gather(1, y)
    top = z.amax(1, keepdim=True)
    z.sub_(top).exp_()
    norm = z.sum(1, keepdim=True)
    loss = torch.where(valid, top + norm.log() - target, 0.0).sum()
    z.div_(norm)
    # a column compare fuses into the pass; a scatter would split it
    if torch.compiler.is_compiling():
        z = torch.where(torch.arange(z.size(1), device=z.device) == y, z - 1.0, z)
    # c elements, where the compare would allocate a (c, V) mask
    else:
        z.scatter_add_(1, y, torch.full_like(target, -1.0))
    z.mul_(valid)
    if z is not logits:
        logits.copy_(z)
    return loss


@functools.cache
def compiled_softmax_grad() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """`softmax_grad_` under torch.compile; every chunk is full, so one graph per (chunk, V, dtype)."""
    return torch.compile(softmax_grad_, dynamic=False, fullgraph=True)


def add_matmul_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b, acc fp32 and a, b perhaps bf16: on CUDA one bf16 GEMM with an fp32 output (as
    Liger-Kernel sums its weight gradient), elsewhere through a product in a's dtype."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif acc.is_cuda and hasattr(torch.ops.aten.addmm, "dtype_out"):
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:
        acc += a @ b


class LogitTransform:
    """What a model's forward does to its LM head's output before the loss, read from its config:
    logits x `scale` (Cohere's `logit_scale`, Granite's 1 / `logits_scaling`, Falcon-H1's
    `lm_head_multiplier`), then `softcap` x tanh(logits / `softcap`) (Gemma 2 and 3's
    `final_logit_softcapping`). A loss head that replaces the LM head applies it itself, and turns
    the model's own off while it runs (`off`): the model would otherwise transform the loss sum the
    head returns. A transform not listed here is caught by the start-up loss check
    (`toolkit.train.loss_check`), not applied."""

    # config key -> (what it does, where the forward reads it: the model, its decoder or its config)
    KNOWN = {"logit_scale": ("scale", "model"), "logits_scaling": ("divide", "config"),
             "lm_head_multiplier": ("scale", "decoder"), "final_logit_softcapping": ("softcap", "config")}

    def __init__(self, scale: float = 1.0, softcap: float | None = None, read: tuple = ()):
        self.scale, self.softcap = float(scale), softcap
        # (owner, attribute, identity value) for each transform the forward reads
        self.read = read

    @classmethod
    def of(cls, model: torch.nn.Module) -> LogitTransform:
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        config = getattr(base, "config", None)
        # not a transformers model: its head's output is its logits
        if config is None:
            return cls()
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        owners = {"model": base, "decoder": getattr(base, getattr(base, "base_model_prefix", "model"), None),
                  "config": config}
        scale, softcap, read = 1.0, None, []
        for key, (kind, where) in cls.KNOWN.items():
            owner = owners[where]
            value = getattr(owner, key, None) if owner is not None else None
            if value is None or isinstance(value, bool):
                continue
            if kind == "softcap":
                softcap, identity = float(value), None
            else:
                scale, identity = scale * (1.0 / float(value) if kind == "divide" else float(value)), 1.0
            read.append((owner, key, identity))
        return cls(scale, softcap, tuple(read))

    @property
    def identity(self) -> bool:
        return self.scale == 1.0 and self.softcap is None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The transform on full logits (a pipeline's last stage), as the model's forward writes it."""
        if self.scale != 1.0:
            logits = logits * self.scale
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    @contextmanager
    def off(self) -> Iterator[None]:
        """The model's own transform set to the identity while a loss head applies it."""
        saved = [(owner, key, getattr(owner, key)) for owner, key, _ in self.read]
        for owner, key, identity in self.read:
            setattr(owner, key, identity)
        try:
            yield
        finally:
            for owner, key, value in saved:
                setattr(owner, key, value)

    def describe(self) -> str:
        parts = ([f"x {self.scale:g}"] if self.scale != 1.0 else []) + \
            ([f"softcap {self.softcap:g}"] if self.softcap is not None else [])
        return "logits " + ", then ".join(parts) if parts else "no logit transform"


# Rows of logits alive at once: 256 x 49,152 (SmolLM2's vocab) fp32 = 50 MB instead of 201 MB per
# 1,024 tokens, and still large enough matmuls to keep a GPU busy.
LOSS_CHUNK_TOKENS = 256


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """sum_t CE(h_t W^T + b, y_t) computed `chunk` rows at a time; full logits never exist. Rows whose
    target is IGNORE_INDEX add nothing and get a zero gradient.

    The gradient is formed in forward, chunk by chunk, while each chunk's logits are alive
    (dlogits = softmax - onehot): dH is kept (N x h, the size of the input) and dW, db summed in fp32;
    backward only scales them by the incoming scalar. All the work happens inside the LM head's forward,
    where ZeRO-3/FSDP have the weight gathered; nothing is recomputed later (the fused linear
    cross-entropy of Liger-Kernel and Apple's Cut Cross-Entropy, without their custom kernels). The
    matmuls run in the dtype F.linear would (autocast's), the weight cast once rather than per chunk,
    and the last chunk is padded with ignored targets, so `step` always sees one shape."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk, step, transform=None):
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        scale, cap = (transform.scale, transform.softcap) if transform is not None else (1.0, None)
        dtype = matmul_dtype(hidden.device.type, hidden, weight)
        h, w = hidden.to(dtype), weight.to(dtype)
        b = bias.to(dtype) if bias is not None else None
        n = len(targets)
        targets = F.pad(targets, (0, -n % chunk), value=IGNORE_INDEX)
        # reused by every chunk; zeros: a short tail stays finite
        logits = h.new_zeros(chunk, weight.size(0))
        total = h.new_zeros((), dtype=torch.float32)
        d_hidden = torch.empty_like(h) if need_h else None
        d_weight = torch.zeros_like(weight, dtype=torch.float32) if need_w else None
        d_bias = torch.zeros_like(bias, dtype=torch.float32) if need_b else None
        # tanh(z / cap), for its derivative
        capped = torch.empty_like(logits) if cap is not None else None
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, n, chunk):
                rows = slice(start, min(start + chunk, n))
                # (r, V)
                z = logits[:rows.stop - start]
                if b is None:
                    torch.mm(h[rows], w.t(), out=z)
                else:
                    torch.addmm(b, h[rows], w.t(), out=z)
                # the model's logit scale, as its forward applies it
                if scale != 1.0:
                    z.mul_(scale)
                # final softcapping: cap * tanh(z / cap)
                if cap is not None:
                    torch.div(logits, cap, out=capped).tanh_()
                    torch.mul(capped, cap, out=logits)
                # z now holds dlogits
                total += step(logits, targets[start:start + chunk])
                # d(cap * tanh(u / cap)) / du = 1 - tanh^2
                if cap is not None:
                    logits.mul_(capped.square_().neg_().add_(1.0))
                if scale != 1.0:
                    z.mul_(scale)
                if need_h:
                    torch.mm(z, w, out=d_hidden[rows])
                if need_w:
                    add_matmul_(d_weight, z.t(), h[rows])
                if need_b:
                    d_bias += z.sum(0, dtype=torch.float32)
        # Kept on ctx, not saved for backward: backward scales them in place and hands them over, so
        # no second weight-sized buffer appears (a second backward through this graph is an error).
        ctx.grads = d_hidden, d_weight, d_bias
        ctx.dtypes = hidden.dtype, weight.dtype, bias.dtype if bias is not None else None
        return total

    @staticmethod
    def backward(ctx, grad):
        if ctx.grads is None:
            raise RuntimeError("chunked loss: backward ran twice through the same graph")
        grads, ctx.grads = ctx.grads, None
        return (*(g.mul_(grad).to(dtype) if g is not None else None for g, dtype in zip(grads, ctx.dtypes)),
                None, None, None, None)


def linear_cross_entropy_sum(h: torch.Tensor, head: torch.nn.Linear, y: torch.Tensor,
                             chunk: int = LOSS_CHUNK_TOKENS, compiled: bool = False,
                             transform: LogitTransform | None = None) -> torch.Tensor:
    """sum of CE(transform(head(h)), y) over the rows whose target is not IGNORE_INDEX: h (N, h), y (N,) -> fp32."""
    step = compiled_softmax_grad() if compiled else softmax_grad_
    return _ChunkedLinearCrossEntropy.apply(h, head.weight, head.bias, y, chunk, step, transform)


def chunked_loss_sum(hidden: torch.Tensor, head: torch.nn.Linear, labels: torch.Tensor,
                     chunk: int = LOSS_CHUNK_TOKENS, shifted: bool = False, rows: torch.Tensor | None = None,
                     compiled: bool = False, transform: LogitTransform | None = None) -> torch.Tensor:
    """`token_loss_sum(transform(head(hidden)), labels)` (`target_loss_sum` when `shifted`) without
    materialising (B, T, V) logits. hidden (B, T, h) from the last norm, labels (B, T) -> scalar fp32
    sum over targets. `rows` (`target_rows`): only those positions go through the head."""
    h, y = flat_targets(hidden, labels, shifted, rows)
    return linear_cross_entropy_sum(h, head, y, chunk, compiled, transform)


# --loss name -> (PyPI package, module, function): fused linear cross-entropies in Triton kernels
FUSED = {"liger": ("liger-kernel", "liger_kernel.transformers.functional", "liger_fused_linear_cross_entropy"),
         "cce": ("cut-cross-entropy", "cut_cross_entropy", "linear_cross_entropy")}


def choose_loss(choice: str, device_type: str, head_is_linear: bool, logits_fit: bool | None) -> str:
    """`--loss` resolved to full | chunked | liger | cce; a name other than `auto` is kept as asked.

    auto: full logits where the head is not a plain Linear (nothing else applies). On CPU chunked,
    eager: measured on 2 cores (fp32, 2 x 1024 tokens, h 576, vocab 49,152 and 128,256, half of each
    row prompt) it peaks at 0.14x full's memory in 0.46-0.50x its time on the target rows, which a CPU
    head finds itself (0.90-0.97x over every row); the matmuls dominate, so compiling gains nothing.
    On CUDA full logits where the planner says they fit (`logits_fit`; None: not asked, so perhaps not):
    then no chunk loop can be faster. Else ours, compiled, which runs every dtype. The Triton kernels
    only when asked: on the user's path (one H100, `finetune.py` on 1,000 alpaca records, 2048 x 4
    packed, LoRA on the Llama-3.2-1B shape) Cut Cross-Entropy averaged 31.2k tokens/s against
    chunked's 34.9k, its 5-step windows swinging from 39k to 10.6k, and its backward refuses fp32; Liger
    ran 2-3x slower than compiled chunked losses (linkedin/Liger-Kernel#227, pytorch/pytorch#124480)."""
    if choice != "auto":
        return choice
    if not head_is_linear:
        return "full"
    if device_type == "cuda" and logits_fit:
        return "full"
    return "chunked"


HALF = (torch.bfloat16, torch.float16)


def fused_kernel(kind: str, device_type: str, bias: bool, softcap: bool = False,
                 dtype: torch.dtype = torch.bfloat16) -> Callable:
    """The package's fused linear cross-entropy for `--loss liger|cce`, or one UserError saying why not.
    `dtype`: what the head multiplies in (autocast's, else its weight's)."""
    package, module, name = FUSED[kind]
    if device_type != "cuda":
        raise UserError(f"--loss {kind} runs {package}'s Triton kernels, which need a CUDA GPU; this run is on "
                        f"{device_type}: use --loss chunked (the same loss in PyTorch)")
    # its backward asserts it (AssertionError at step 1)
    if kind == "cce" and dtype not in HALF:
        raise UserError(f"--loss cce: Cut Cross-Entropy's backward runs in bf16 or fp16 only, and this run's head "
                        f"computes in {str(dtype).removeprefix('torch.')} (--mixed-precision no): use --loss chunked "
                        "(the same loss in PyTorch, any dtype), or --mixed-precision bf16")
    if importlib.util.find_spec(module.split(".")[0]) is None:
        raise UserError(f"--loss {kind} needs the {package} package, which is not installed: "
                        "pip install 'toolkit[gpu]' (or use --loss chunked)")
    try:
        fn = getattr(importlib.import_module(module), name)
    except ImportError as e:
        raise UserError(f"--loss {kind}: {package} is installed but does not import ({e}); "
                        "reinstall it with pip install 'toolkit[gpu]'") from e
    if bias and "bias" not in inspect.signature(fn).parameters:
        raise UserError(f"--loss {kind}: this model's LM head has a bias, which the installed {package} does "
                        "not take; use --loss chunked")
    if softcap and "softcap" not in inspect.signature(fn).parameters:
        raise UserError(f"--loss {kind}: this model softcaps its logits, which the installed {package} cannot; "
                        "use --loss chunked")
    return fn


def fused_loss_sum(kind: str, kernel: Callable, h: torch.Tensor, head: torch.nn.Linear,
                   y: torch.Tensor, transform: LogitTransform | None = None) -> torch.Tensor:
    """`linear_cross_entropy_sum` through Liger-Kernel or Cut Cross-Entropy: h (N, h), y (N,) -> fp32.
    Each reads back from the GPU once per call inside the package (Liger: the target count's
    `.item()`; CCE: `nonzero` of the target rows). Liger casts under autocast itself and sums dW in
    the weight's dtype (fp32 master weights: fp32); CCE multiplies in its inputs' dtype, so it gets
    autocast's, as F.linear would."""
    scale, cap = (transform.scale, transform.softcap) if transform is not None else (1.0, None)
    # both kernels cap each chunk's logits themselves
    extra = {} if cap is None else {"softcap": cap}
    # a logit scale folded into the rows and the bias: (s h) W^T + s b = s (h W^T + b)
    if kind == "liger":
        bias = head.bias * scale if head.bias is not None and scale != 1.0 else head.bias
        return kernel(h * scale if scale != 1.0 else h, head.weight, y, bias=bias, ignore_index=IGNORE_INDEX,
                      reduction="sum", **extra).float()
    dtype = matmul_dtype(h.device.type, h, head.weight)
    bias = {} if head.bias is None else {"bias": (head.bias * scale).to(dtype)}
    return kernel((h * scale if scale != 1.0 else h).to(dtype), head.weight.to(dtype), y, ignore_index=IGNORE_INDEX,
                  reduction="sum", **bias, **extra).float()


class FusedLossHead:
    """Turns the model's LM head into a loss for the forward passes run inside `labels(...)`.

    The head's `forward` is replaced on the instance (parameters and state-dict keys untouched), so
    the loss is computed inside the model's own forward: DDP, ZeRO and FSDP see an ordinary module
    call with its weight gathered. Outside `labels(...)` the head computes logits as before
    (generation, eval). Inside it the model's `.logits` output is the scalar loss sum. The head runs
    on the target rows only where it knows them without a device sync: `rows` given (`target_rows`),
    or a CPU model; elsewhere on every row, the ignored ones weighted 0."""

    def __init__(self, model: torch.nn.Module, kind: str = "chunked", chunk: int = LOSS_CHUNK_TOKENS,
                 compiled: bool = False, kernel: Callable | None = None):
        self.head = model.get_output_embeddings()
        if not isinstance(self.head, torch.nn.Linear):
            raise UserError(f"--loss {kind} needs a linear LM head; this model has {type(self.head).__name__}")
        self.kind, self.chunk, self.compiled, self.kernel = kind, chunk, compiled, kernel
        # applied here, the model's own turned off (`labels`)
        self.transform = LogitTransform.of(model)
        self.compile_error: str | None = None
        self._labels, self._shifted, self._rows = None, False, None
        original = self.head.forward

        def forward(hidden):
            if self._labels is None:
                return original(hidden)
            return self.loss_sum(hidden, self._labels, self._shifted, self._rows)

        self.head.forward = forward

    def restore(self) -> None:
        """The LM head's own forward back (full logits from here on)."""
        # the instance attribute set above; the class's forward shows through again
        del self.head.forward

    def loss_sum(self, hidden: torch.Tensor, labels: torch.Tensor, shifted: bool = False,
                 rows: torch.Tensor | None = None) -> torch.Tensor:
        # host memory: finding the targets waits for nothing
        if rows is None and hidden.device.type == "cpu":
            rows = target_rows(labels, shifted)
        h, y = flat_targets(hidden, labels, shifted, rows)
        if self.kind != "chunked":
            return fused_loss_sum(self.kind, self.kernel, h, self.head, y, self.transform)
        try:
            return linear_cross_entropy_sum(h, self.head, y, self.chunk, self.compiled, self.transform)
        # no working compiler (C++ on CPU, Triton on CUDA)
        except torch._dynamo.exc.TorchDynamoException as e:
            if not self.compiled:
                raise
            self.compiled, self.compile_error = False, (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            warnings.warn(f"--loss chunked: torch.compile failed ({self.compile_error}); the loss runs eagerly "
                          "(same values, more passes over each chunk)", RuntimeWarning, stacklevel=2)
            return linear_cross_entropy_sum(h, self.head, y, self.chunk, False, self.transform)

    def describe(self) -> str:
        """What the strategy logs after `loss: `."""
        applied = "" if self.transform.identity else f", the model's {self.transform.describe()} applied inside"
        if self.kind in FUSED:
            return f"{FUSED[self.kind][0]} fused linear cross-entropy{applied}"
        how = "compiled" if self.compiled else "eager" + (f"; torch.compile failed: {self.compile_error}"
                                                           if self.compile_error else "")
        return f"chunked LM head + cross-entropy, {self.chunk} rows at a time ({how}){applied}"

    @contextmanager
    def labels(self, labels: torch.Tensor, shifted: bool = False, rows: torch.Tensor | None = None) -> Iterator[None]:
        """`shifted`: `labels` are already the targets of each position (`shift_labels`); `rows`: the
        positions with a target (`target_rows`, made on the CPU), so the head skips the others."""
        self._labels, self._shifted, self._rows = labels, shifted, rows
        try:
            with self.transform.off():
                yield
        finally:
            self._labels = self._rows = None


def loss_head_for(model: torch.nn.Module, choice: str, device_type: str, logits_fit: bool | None = None,
                  compiled: bool | None = None, precision: str = "no") -> FusedLossHead | None:
    """`--loss` resolved for this model and device (`choose_loss`); None: the full-logits path.
    `compiled`: the chunked loss's per-chunk softmax under torch.compile; default on CUDA only (on CPU
    the matmuls dominate, and the first call compiles for ~15 s). `precision`: the run's mixed
    precision (no | bf16 | fp16), which with the head's weight gives the dtype it multiplies in."""
    head = model.get_output_embeddings()
    linear = isinstance(head, torch.nn.Linear)
    kind = choose_loss(choice, device_type, linear, logits_fit)
    if kind == "full":
        return None
    kernel = None
    if kind in FUSED and linear:
        softcap = LogitTransform.of(model).softcap is not None
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, head.weight.dtype)
        kernel = fused_kernel(kind, device_type, head.bias is not None, softcap, dtype)
    return FusedLossHead(model, kind, compiled=device_type == "cuda" if compiled is None else compiled, kernel=kernel)
