"""Parameter counts from a decoder config (Llama / Mistral / Qwen2 family), no torch needed.

Per block: attention q,o = h x (n_heads * d_head), k,v = h x (n_kv * d_head) (grouped-query
attention), SwiGLU MLP = 3 x h x i, two RMSNorms = 2h; plus embeddings V x h, a final norm h and an
untied lm_head V x h (tied embeddings counted once). Qwen2 adds q/k/v biases; Qwen3 adds q/k
RMSNorms of size d_head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def head_dim(cfg: dict[str, Any]) -> int:
    return cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]


def linear_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """module name -> (in_features, out_features) of each linear in one block."""
    h, i, d = cfg["hidden_size"], cfg["intermediate_size"], head_dim(cfg)
    nq, nkv = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    return {"q_proj": (h, nq * d), "k_proj": (h, nkv * d), "v_proj": (h, nkv * d), "o_proj": (nq * d, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def _attention_bias(cfg: dict[str, Any]) -> bool:
    return bool(cfg.get("attention_bias", cfg.get("model_type") == "qwen2"))


@dataclass
class ParamCounts:
    embedding: int
    per_block: int
    blocks: int
    final_norm: int
    lm_head: int  # 0 when tied to the embedding

    @property
    def total(self) -> int:
        return self.embedding + self.per_block * self.blocks + self.final_norm + self.lm_head


def count_params(cfg: dict[str, Any]) -> ParamCounts:
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    shapes = linear_shapes(cfg)
    block = sum(a * b for a, b in shapes.values()) + 2 * h
    if _attention_bias(cfg):
        block += sum(shapes[n][1] for n in ("q_proj", "k_proj", "v_proj"))
        if cfg.get("attention_bias"):  # Llama-style attention_bias also biases o_proj
            block += shapes["o_proj"][1]
    if cfg.get("model_type") == "qwen3":  # per-head RMSNorm on queries and keys
        block += 2 * head_dim(cfg)
    if cfg.get("mlp_bias"):
        block += sum(shapes[n][1] for n in ("gate_proj", "up_proj", "down_proj"))
    tied = cfg.get("tie_word_embeddings", False)
    return ParamCounts(embedding=v * h, per_block=block, blocks=cfg["num_hidden_layers"], final_norm=h,
                       lm_head=0 if tied else v * h)


COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # the rest are row-parallel


def lora_targets(targets: str | list[str]) -> list[str]:
    """The linears LoRA adapts: `all-linear` (peft) is every linear of the blocks, not the lm_head."""
    if targets == "all-linear":
        return list(LINEARS)
    return [t.strip() for t in (targets.split(",") if isinstance(targets, str) else targets) if t.strip()]


def adapted_inputs(cfg: dict[str, Any], targets: str | list[str]) -> dict[str, int]:
    """Each adapted linear's in-features (what its adapter saves per token scales with)."""
    shapes = linear_shapes(cfg)
    return {t: shapes[t][0] for t in lora_targets(targets) if t in shapes}


def lora_params(cfg: dict[str, Any], r: int, targets: str | list[str] = "all-linear", tp: int = 1) -> int:
    """LoRA adds A (r x in) and B (out x r) per targeted linear; `all-linear` (peft) is every linear
    of the blocks, not the lm_head. Per rank under tensor parallel degree `tp` (the toolkit's plan):
    a column-parallel layer keeps A whole and 1/tp of B's rows, a row-parallel one 1/tp of A's
    columns and B whole."""
    names = lora_targets(targets)
    shapes = linear_shapes(cfg)
    unknown = [n for n in names if n not in shapes]
    if unknown:
        raise ValueError(f"LoRA targets {unknown} are not linears of this architecture ({', '.join(LINEARS)})")
    def per_rank(n: str) -> int:
        fan_in, fan_out = shapes[n]
        return r * (fan_in + fan_out // tp) if n in COLUMN_PARALLEL else r * (fan_in // tp + fan_out)

    return cfg["num_hidden_layers"] * sum(per_rank(n) for n in names)
