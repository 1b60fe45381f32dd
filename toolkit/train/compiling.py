"""--compile auto | --compile | --no-compile: whether, and from which step, the decoder blocks are compiled.

Compiling each block (`toolkit.parallel.parallelize.apply_compile`, regional, as torchtitan compiles per block) made
one H200's steps faster: the default eager run was 0.75x the compiled one's tokens/s for a full
finetune of the Llama-3.2-1B shape and 0.62x for LoRA, at 0.82x and 0.75x its peak memory
(benchmarks/gpu/throughput_*.json). It costs a compile first, so `auto`, the default,
decides on CUDA from what the run measures: it times EAGER_STEPS eager steps after the first (one
device sync each, this decision only), and compiles from the next step when the steps left, each
saving the measured gain of an eager step (`MEASURED`: an H200's, by method), repay the compile's expected
seconds: the last measured compile of this model, shape and layout on this machine
(`cache_dir()/compile_seconds.json`), else the H200's cold compile (`MEASURED`). On a CPU it
stays eager (inductor's C++ build takes minutes on a few cores, and the matmuls dominate), and a layout
that refuses --compile (`toolkit.layout.rules`) runs eager under auto, saying why in one line.

The compile step's record is marked `compile_warmup` and its time, less an eager step's, is the
compile's measured seconds (said in one line, kept for the next run). Later records carry
`compiled_graphs`, dynamo's count of graphs compiled so far; a run that keeps compiling new graphs after
its warm-up step (changing shapes) says so once. Once the blocks compile, the loader pads its batches to
few widths (`toolkit.data.packing.Collate`). Every rank decides alike: on the slowest rank's eager step and the
costliest node's expected compile; the main process keeps the measured seconds. Inductor's cache lives under
`cache_dir()/inductor`
(unless TORCHINDUCTOR_CACHE_DIR is set), so the second run of a shape starts warm.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

@dataclass(frozen=True)
class Measured:
    """What compiling the blocks was measured to save and cost: `gain`, the share of an eager step a compiled step
    saves; `cold_s`, the seconds of a compile with a cold inductor cache."""
    gain: float
    cold_s: float


# One H200, the Llama-3.2-1B shape, 2048 tokens x micro-batch 4 packed, bf16, torch 2.11 (the GPU user part:
# ../shared/gpu): LoRA 0.172 s a step eager, 0.104 s compiled, 12.8 s of compile at step 1 and 6.7 s at
# step 2's recompile (cold cache); a full finetune 0.185 s, 0.140 s, 7.6 s + 3.0 s. Step 2's recompile is gone
# since (packed rows' boundaries keep their shapes once the blocks compile: `toolkit.data.packing.collate_packed`),
# so the cold seconds are an upper bound until a GPU measures them again. QLoRA and other shapes and layouts take
# LoRA's figures (unmeasured: a regional compile compiles one block's graph whatever the depth, so the cost
# follows a block's width and kind, not the layer count).
MEASURED = {"lora": Measured(1 - 0.104 / 0.172, 12.8 + 6.7), "full": Measured(1 - 0.140 / 0.185, 7.6 + 3.0)}
# eager steps timed, after the first (the checks, the allocator's growth), before deciding
EAGER_STEPS = 2
# graphs compiled after the warm-up step above which a run says its shapes keep changing
RECOMPILES_SAID = 4


def measured(method: str) -> Measured:
    """The measured gain and cold compile of `method` (`MEASURED`; QLoRA and any other: LoRA's)."""
    return MEASURED[method] if method in MEASURED else MEASURED["lora"]


def pays(steps_left: int, eager_step_s: float, compile_s: float, gain: float) -> bool:
    """Whether compiling now saves more than it costs: steps_left x eager_step_s x gain > compile_s."""
    return steps_left * eager_step_s * gain > compile_s


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process (first compiles and recompiles)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def use_cache_dir(cache: Path) -> None:
    """Inductor's on-disk caches under the toolkit's cache dir (the user's TORCHINDUCTOR_CACHE_DIR wins)."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache / "inductor"))


def shape_key(model_config: dict, flags: dict) -> str:
    """What a compile's cost depends on: the model's config and the run's shape and layout."""
    blob = json.dumps({"model": model_config, **flags}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def expected_compile_s(path: Path | None, key: str, cold_s: float) -> tuple[float, str]:
    """(seconds, where the figure comes from): the last measured compile of `key` on this machine, else `cold_s`
    (`MEASURED`'s, an H200's cold compile)."""
    try:
        seen = json.loads(path.read_text()).get(key) if path is not None else None
    except (OSError, ValueError):
        seen = None
    return (float(seen), "measured on the last run of this shape") if seen else \
        (cold_s, "an H200's cold compile of the 1B shape")


def remember_compile_s(path: Path, key: str, seconds: float) -> None:
    """Kept for the next run of this shape (by one process; a write that fails only loses the figure)."""
    try:
        seen = json.loads(path.read_text())
    except (OSError, ValueError):
        seen = {}
    seen[key] = round(seconds, 2)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # processes of other runs may write beside it
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(seen, indent=1))
        tmp.replace(path)
    except OSError:
        pass


@dataclass
class Compiling:
    """One run's compile plan. `mode`: "on", "off" or "auto"; `at`: the step whose forward compiles
    (None: eager so far); `key`/`path`: where the measured compile seconds are kept."""
    mode: str
    at: int | None = None
    key: str = ""
    # where the measured seconds are kept; None: not kept (or not this process)
    path: Path | None = None
    # this process writes the measured seconds to `path` (the main one)
    keeps: bool = True
    # the method's measured gain and cold compile
    expected: Measured = MEASURED["lora"]
    # the loader's `toolkit.data.packing.Collate`, whose widths bucket once blocks compile
    collate: object | None = None
    eager_step_s: float | None = None
    graphs_after_warmup: int | None = None
    said_recompiles: bool = False
    _t0: float = field(default=0.0, repr=False)

    def bucket(self) -> None:
        """Batches padded to few widths from now on (`toolkit.data.packing.Collate`): one compiled graph each. A
        batch the loader fetched ahead still has its own width (one graph more, at most)."""
        if self.collate is not None:
            self.collate.bucket = True

    def start_timing(self, sync) -> None:
        """After the first step: the eager steps to decide on start now (`sync`: waits for the device)."""
        sync()
        self._t0 = time.perf_counter()

    def decide(self, step: int, total_steps: int, sync, compile_now, say, agree=lambda s: s) -> None:
        """After EAGER_STEPS timed eager steps (the last is `step`): compile from step + 1 if it pays.
        `agree`: the ranks' slowest step time, so every rank decides alike."""
        sync()
        self.eager_step_s = agree((time.perf_counter() - self._t0) / EAGER_STEPS)
        left = total_steps - step
        cost, source = expected_compile_s(self.path, self.key, self.expected.cold_s)
        # each node reads its own cache: the costliest decides for all
        cost = agree(cost)
        gain = self.expected.gain
        saved = left * self.eager_step_s * gain
        figures = (f"eager steps take {self.eager_step_s:.3f} s; the {left} steps left would save ~{saved:.0f} s at "
                   f"{gain:.0%} a step (an H200's measured gain), against ~{cost:.0f} s of compile ({source})")
        if pays(left, self.eager_step_s, cost, gain):
            compile_now()
            self.bucket()
            self.at = step + 1
            say(f"compile: auto: compiling the decoder blocks from step {step + 1}: {figures}")
        else:
            self.mode = "off"
            say(f"compile: auto: eager: {figures}")

    def warmed_up(self, step: int, seconds: float, say) -> None:
        """The compile step's record: its seconds less an eager step's are the compile's, kept for the next run."""
        compile_s = max(0.0, seconds - (self.eager_step_s or 0.0))
        if self.path is not None and self.keeps:
            remember_compile_s(self.path, self.key, compile_s)
        self.graphs_after_warmup = compiled_graphs()
        say(f"compile: step {step} compiled the blocks in {compile_s:.1f} s ({compiled_graphs()} graphs); "
            f"tokens_per_sec and mfu count from step {step + 1} on")

    def recompiles(self, say) -> dict:
        """`compiled_graphs` for a record after the warm-up, and one line the first time the graphs
        compiled since the warm-up pass RECOMPILES_SAID."""
        if self.graphs_after_warmup is None:
            return {}
        graphs = compiled_graphs()
        if graphs - self.graphs_after_warmup > RECOMPILES_SAID and not self.said_recompiles:
            self.said_recompiles = True
            say(f"compile: {graphs - self.graphs_after_warmup} graphs compiled after the warm-up step: the batches' "
                "shapes keep changing (each new one compiles); --packing gives every row one width")
        return {"compiled_graphs": graphs}


# unpacked batches' widths round up to a multiple of this where blocks may compile
BUCKET = 64
# the device types auto compiles on (default cuda); a test seam
AUTO_DEVICES_ENV = "TOOLKIT_COMPILE_AUTO_DEVICES"
CPU_EAGER = ("inductor's C++ build takes minutes on a few cores, and a CPU step is its matmuls; --compile "
             "compiles anyway")


def plan(cfg, device_type: str, model, world: int, cache: Path, say, keeps: bool = True) -> Compiling:
    """The run's compile mode, said in one line where auto stays eager from the start: on a CPU, on a
    layout that refuses --compile (the refusal's words), on a model without decoder blocks. `keeps`:
    this process writes the measured compile seconds (the main one; every process reads them)."""
    from toolkit.layout.rules import layout_problems
    from toolkit.model.kernels import COMPILE_BACKEND_ENV, decoder_layers

    t, p = cfg.train, cfg.parallel
    if t.compile is False:
        return Compiling("off")
    if t.compile is None:
        allowed = os.environ.get(AUTO_DEVICES_ENV, "cuda").split(",")
        why = (f"on {device_type} ({CPU_EAGER})" if device_type not in allowed else
               next(iter(layout_problems(p, cfg.model.method, t.mixed_precision, t.loss, t.micro_batch_size, True,
                                         cfg.model.attn)), None) or
               (None if decoder_layers(model) else "the model keeps no decoder blocks at model.layers"))
        if why:
            say(f"compile: auto: eager {why}" if why.startswith("on ") else f"compile: auto: eager: {why}")
            return Compiling("off")
    use_cache_dir(cache)
    flags = {"method": cfg.model.method, "seq_len": cfg.data.seq_len, "micro_batch": t.micro_batch_size,
             "packing": cfg.data.packing, "precision": t.mixed_precision, "world": world, "parallel": str(p),
             "checkpointing": t.gradient_checkpointing, "attn": cfg.model.attn, "device": device_type,
             "backend": os.environ.get(COMPILE_BACKEND_ENV, "inductor")}
    # --compile's measured seconds are kept too: a later auto run of this shape weighs them
    return Compiling("on" if t.compile else "auto", key=shape_key(model.config.to_dict(), flags),
                     path=cache / "compile_seconds.json", keeps=keeps, expected=measured(cfg.model.method))
