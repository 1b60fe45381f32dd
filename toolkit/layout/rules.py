"""Which layouts may run: the one place that says which parallel dimensions compose, what must divide
what, what each method and precision allows, and the words of each refusal. Config validation, the
planner, the strategy builders and the command line all ask here.

Pure Python: no torch, no torch.distributed, no model loading (a model is its config as a dict).
"""

from __future__ import annotations

from typing import Any

from toolkit.layout.dims import ParallelDims


def tp_divisibility_problems(cfg: dict[str, Any], t: int) -> list[str]:
    """Each rank keeps whole query and kv heads and an equal slice of the MLP: t must divide the
    attention heads, the kv heads and the intermediate size. The runtime (`--tp`) uses this too."""
    nq, nkv = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    if t < 1:
        return [f"--tp {t}: must be >= 1"]
    bad = [f"{what} ({n})" for what, n in (("attention heads", nq), ("kv heads", nkv),
                                           ("intermediate size", cfg["intermediate_size"])) if n % t]
    return [f"--tp {t}: must divide the {', '.join(bad)}"] if bad else []


def cp_divisibility_problems(cfg: dict[str, Any], tp: int, cp: int) -> list[str]:
    """The heads each rank keeps after TP must split again over cp (Ulysses exchanges whole heads).
    The runtime (`toolkit.parallel.cp.cp_problems`) uses this too."""
    if cp == 1:
        return []
    q, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    if q % (tp * cp) or kv % (tp * cp):
        return [f"--cp {cp}{f' x --tp {tp}' if tp > 1 else ''} needs query and key/value heads divisible by "
                f"{tp * cp} (this model has {q} and {kv}); choose cp{' x tp' if tp > 1 else ''} dividing both"]
    return []


def not_runnable(d: ParallelDims, method: str, precision: str, loss: str) -> str:
    """Why the runtime refuses this layout today ('' when it runs): the rules of `toolkit.config`."""
    if method == "qlora":
        return "QLoRA's 4-bit base is not sharded or split on the mesh"
    if precision == "fp16":
        return "fp16 has no loss scaling across mesh ranks (use bf16)"
    if d.cp > 1 and d.pp > 1:
        return "context parallel does not compose with pipeline stages yet"
    if d.pp > 1 and loss == "chunked":
        return "pipeline stages compute full logits (--loss chunked is refused with --pp)"
    return ""


def pipeline_schedule(d: ParallelDims, micro_batch: int) -> tuple[str, int]:
    """(schedule, pipeline micro-batches): one example each; 1F1B where there are >= pp of them."""
    return ("1f1b" if micro_batch >= d.pp else "gpipe"), micro_batch
