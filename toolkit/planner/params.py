"""Parameter counts from a decoder config, no torch needed: each block's linears, norms and MoE
experts, shaped as transformers 5.24 builds them (`models/*/modeling_*.py`), so the counts equal a
meta-device instantiation (tests/test_planner_params.py, every preset).

Attention: q, k, v, o of `head_dim` (explicit where the config gives it: Gemma 3, Qwen3, gpt-oss),
grouped-query kv heads; biases where `attention_bias` / `qkv_bias` say (Qwen2: q, k, v by default);
per-head q/k RMSNorms (Qwen3, Qwen3-MoE, Gemma 3); gpt-oss's per-head attention sinks. DeepSeek's
multi-head latent attention (MLA) where the config has `kv_lora_rank`: q_a (h x q_lora_rank) + its
norm + q_b (q_lora_rank x heads (qk_nope + qk_rope)), or q (h x heads (qk_nope + qk_rope)) without
q_lora_rank; kv_a_with_mqa (h x (kv_lora_rank + qk_rope)) + its norm, kv_b (kv_lora_rank x heads
(qk_nope + v_head_dim)), o (heads v_head_dim x h).

MLP: SwiGLU (gate, up, down) of `intermediate_size`, or in an MoE layer the router (experts x h, a
bias in gpt-oss), the routed experts stacked as 3-D tensors (gate_up: experts x 2 I x h, down:
experts x h x I, I = `moe_intermediate_size` or `intermediate_size`; biases in gpt-oss), and shared
experts (DeepSeek: one SwiGLU of n_shared_experts x I; Qwen2-MoE: one of
`shared_expert_intermediate_size` and a 1-wide gate). Which layers are MoE: DeepSeek's from
`first_k_dense_replace` on; Qwen-MoE's where `(layer + 1) % decoder_sparse_step == 0` and the layer is
not in `mlp_only_layers`; every layer elsewhere (Mixtral, gpt-oss).

Norms: two RMSNorms of h per block (four in Gemma 3), the final norm; embeddings V x h and an untied
lm_head V x h (tied: counted once).

Active parameters (what one token's compute uses): the same with top-k (`num_experts_per_tok`) of the
routed experts instead of all of them; shared experts and routers always run.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Any

from toolkit.errors import UserError
from toolkit.layout.rules import EXPERT_KEYS, num_experts  # noqa: F401 - the planner's names for them

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Qwen3Attention, Qwen3MoeAttention, Gemma3Attention: q_norm, k_norm
QK_NORM = ("qwen3", "qwen3_moe", "gemma3_text")
# Gemma3DecoderLayer: pre/post feedforward norms too
FOUR_NORMS = ("gemma2", "gemma3_text")
ONE_NORM = ("cohere",)
# Qwen2Attention's q, k, v biases where the config does not say (qkv_bias: Qwen2-MoE)
QKV_BIAS = ("qwen2", "qwen2_moe")
# What a config that leaves these fields out means (each config class's default, transformers 5.24
# models/*/configuration_*.py); every other field the counts read defaults alike in every class.
CLASS_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3": {"head_dim": 128}, "gemma2": {"head_dim": 256, "tie_word_embeddings": True},
    "gemma3_text": {"head_dim": 256, "tie_word_embeddings": True}, "cohere": {"tie_word_embeddings": True},
    # CohereDecoderLayer: attention and MLP in parallel after one norm
    "gpt_oss": {"head_dim": 64, "attention_bias": True}}
# Blocks of another shape (LayerNorm biases, a fused biased qkv, a two-linear GELU MLP, learned
# positions): counting them as the decoders above would be silently wrong
NOT_COUNTED = ("gpt2", "gpt_neox", "gptj", "gpt_bigcode", "bloom", "falcon", "opt", "mpt")


@dataclass(frozen=True)
class Linear:
    """An nn.Linear of a block: `name` is its leaf module name (what peft's target_modules match);
    `tp` how tensor parallelism splits it: column (its outputs), row (its inputs) or none."""
    name: str
    fan_in: int
    fan_out: int
    bias: bool = False
    tp: str = "column"

    @property
    def params(self) -> int:
        return self.fan_in * self.fan_out + (self.fan_out if self.bias else 0)


@dataclass(frozen=True)
class Experts:
    """A layer's routed experts (transformers 5 stacks them: gate_up_proj E x 2I x h, down_proj E x h x I)
    and the router (E x h) that picks `top_k` of them per token."""
    count: int
    top_k: int
    hidden: int
    intermediate: int
    # gpt-oss: gate_up_proj_bias, down_proj_bias and the router's bias
    bias: bool = False

    @property
    def per_expert(self) -> int:
        h, i = self.hidden, self.intermediate
        return 3 * h * i + ((2 * i + h) if self.bias else 0)

    @property
    def router(self) -> int:
        return self.count * self.hidden + (self.count if self.bias else 0)


@dataclass(frozen=True)
class Block:
    """One decoder layer: its linears (attention, a dense MLP or shared experts), the parameters in
    no matmul (`other`: norms, attention sinks) and, in an MoE layer, its experts."""
    linears: tuple[Linear, ...]
    other: int
    experts: Experts | None = None

    @cached_property
    def params(self) -> int:
        e = self.experts
        return sum(x.params for x in self.linears) + self.other + (e.count * e.per_expert + e.router if e else 0)

    @cached_property
    def active(self) -> int:
        """Parameters one token uses: top-k of the routed experts."""
        e = self.experts
        return self.params - (e.count - e.top_k) * e.per_expert if e else self.params

    def per_rank(self, tp: int = 1, ep: int = 1) -> int:
        """Parameters one rank holds under tensor parallel degree `tp` (Megatron's split): the split
        linears' and experts' weights 1/tp (experts along I), biases, norms and the router whole; under
        expert parallel degree `ep`, E/ep of the routed experts (`experts_per_rank`)."""
        routed = self.experts.count * self.experts.per_expert if self.experts else 0
        split = sum(x.fan_in * x.fan_out for x in self.linears if x.tp != "none")
        return self.params - routed - split + split // tp + self.experts_per_rank(tp, ep)

    def experts_per_rank(self, tp: int = 1, ep: int = 1) -> int:
        """The routed experts' parameters one rank holds: E/ep whole experts (expert parallel,
        `toolkit.parallel.ep`: rank r keeps experts r E/ep .. (r+1) E/ep - 1; under tp the ep group is
        the TP group and no expert is TP-cut), or without ep all E, each one's weights 1/tp along I
        (biases whole); 0 in a dense block."""
        e = self.experts
        if not e:
            return 0
        if ep > 1:
            tp = 1
        weights = 3 * e.hidden * e.intermediate
        return e.count // ep * (e.per_expert - weights + weights // tp)


def head_dim(cfg: dict[str, Any]) -> int:
    """The rotary head width: explicit `head_dim`, MLA's `qk_rope_head_dim`, else h / heads."""
    if cfg.get("kv_lora_rank"):
        return cfg["qk_rope_head_dim"]
    return cfg.get("head_dim") or CLASS_DEFAULTS.get(cfg.get("model_type", ""), {}).get("head_dim") \
        or cfg["hidden_size"] // cfg["num_attention_heads"]


def kv_heads(cfg: dict[str, Any]) -> int:
    return cfg.get("num_key_value_heads") or cfg["num_attention_heads"]


def is_moe_layer(cfg: dict[str, Any], layer: int) -> bool:
    """DeepseekV3DecoderLayer: `layer_idx >= first_k_dense_replace`; Qwen2/3-MoE's decoder layers:
    not in `mlp_only_layers` and `(layer_idx + 1) % decoder_sparse_step == 0`."""
    if not num_experts(cfg):
        return False
    if "first_k_dense_replace" in cfg:
        return layer >= (cfg["first_k_dense_replace"] or 0)
    return layer not in (cfg.get("mlp_only_layers") or []) and (layer + 1) % (cfg.get("decoder_sparse_step") or 1) == 0


def _attention(cfg: dict[str, Any]) -> tuple[list[Linear], int]:
    """(the attention's linears, its parameters in no matmul)."""
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    # DeepseekV3Attention (MLA)
    if cfg.get("kv_lora_rank"):
        bias = bool(cfg.get("attention_bias"))
        qk = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
        q_rank, kv_rank = cfg.get("q_lora_rank"), cfg["kv_lora_rank"]
        q = [Linear("q_a_proj", h, q_rank, bias, "none"), Linear("q_b_proj", q_rank, heads * qk)] if q_rank \
            else [Linear("q_proj", h, heads * qk)]
        return q + [Linear("kv_a_proj_with_mqa", h, kv_rank + cfg["qk_rope_head_dim"], bias, "none"),
                    Linear("kv_b_proj", kv_rank, heads * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"])),
                    Linear("o_proj", heads * cfg["v_head_dim"], h, bias, "row")], (q_rank or 0) + kv_rank
    d, nkv = head_dim(cfg), kv_heads(cfg)
    qkv_bias = (cfg["qkv_bias"] if "qkv_bias" in cfg
                else bool(cfg.get("attention_bias", cfg.get("model_type") in QKV_BIAS)))
    o_bias = bool(cfg.get("attention_bias")) and "qkv_bias" not in cfg
    qk_norm = cfg.get("model_type") in QK_NORM or cfg.get("use_qk_norm")
    other = ((heads + nkv) * d if cfg.get("use_qk_norm") else 2 * d if qk_norm else 0) \
        + (heads if cfg.get("model_type") == "gpt_oss" else 0)
    return [Linear("q_proj", h, heads * d, qkv_bias), Linear("k_proj", h, nkv * d, qkv_bias),
            Linear("v_proj", h, nkv * d, qkv_bias), Linear("o_proj", heads * d, h, o_bias, "row")], other


def _swiglu(h: int, i: int, bias: bool = False) -> list[Linear]:
    return [Linear("gate_proj", h, i, bias), Linear("up_proj", h, i, bias), Linear("down_proj", i, h, bias, "row")]


def norms_per_block(cfg: dict[str, Any]) -> int:
    t = cfg.get("model_type")
    return 4 if t in FOUR_NORMS else 1 if t in ONE_NORM else 2


def counted(cfg: dict[str, Any]) -> None:
    """Refuse, in one line, a model whose blocks these counts do not describe."""
    if cfg.get("model_type") in NOT_COUNTED:
        raise UserError(f"the planner counts the parameters of Llama-style decoders and their MoE variants; model "
                        f"type '{cfg['model_type']}' has blocks of another shape (plan a model of another family)")


def block(cfg: dict[str, Any], layer: int) -> Block:
    """Decoder layer `layer` of the model `cfg` describes."""
    counted(cfg)
    h = cfg["hidden_size"]
    linears, other = _attention(cfg)
    other += norms_per_block(cfg) * h
    if not is_moe_layer(cfg, layer):
        return Block(tuple(linears + _swiglu(h, cfg["intermediate_size"], bool(cfg.get("mlp_bias")))), other)
    i = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    # DeepseekV3MoE.shared_experts
    if cfg.get("n_shared_experts"):
        linears += _swiglu(h, i * cfg["n_shared_experts"])
    # Qwen2MoeSparseMoeBlock.shared_expert (+ its gate)
    if cfg.get("shared_expert_intermediate_size"):
        linears += _swiglu(h, cfg["shared_expert_intermediate_size"]) + [Linear("shared_expert_gate", h, 1, tp="none")]
    top_k = cfg.get("num_experts_per_tok") or cfg.get("experts_per_token")
    return Block(tuple(linears), other, Experts(num_experts(cfg), top_k, h, i, bias=cfg.get("model_type") == "gpt_oss"))


def blocks(cfg: dict[str, Any]) -> tuple[Block, ...]:
    """Every decoder layer (memoized: the planner asks for them for each of thousands of candidates)."""
    return _blocks(frozen(cfg))


def frozen(cfg: dict[str, Any]) -> tuple:
    """A hashable copy of a config's scalar and list fields (what the counts read), with its class's
    defaults for the fields it leaves out (`CLASS_DEFAULTS`)."""
    full = {**CLASS_DEFAULTS.get(cfg.get("model_type", ""), {}), **{k: v for k, v in cfg.items() if v is not None}}
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v)
                        for k, v in full.items() if not isinstance(v, dict)))


@lru_cache(maxsize=32)
def _blocks(key: tuple) -> tuple[Block, ...]:
    cfg = dict(key)
    return tuple(block(cfg, i) for i in range(cfg["num_hidden_layers"]))


def linear_shapes(cfg: dict[str, Any], layer: int = 0) -> dict[str, tuple[int, int]]:
    """leaf name -> (in_features, out_features) of each linear of block `layer`."""
    return {x.name: (x.fan_in, x.fan_out) for x in blocks(cfg)[layer].linears}


@dataclass(frozen=True)
class ParamCounts:
    embedding: int
    # each block's parameters
    layers: tuple[int, ...]
    # each block's parameters one token uses (MoE: top-k routed experts)
    active_layers: tuple[int, ...]
    final_norm: int
    # 0 when tied to the embedding
    lm_head: int
    # the blocks' nn.Linear weights (what bitsandbytes quantizes; not the 3-D experts)
    linear: int

    @property
    def blocks(self) -> int:
        return len(self.layers)

    @property
    def per_block(self) -> int:
        """The largest block (what a sharded strategy gathers at once)."""
        return max(self.layers)

    @property
    def total(self) -> int:
        return self.embedding + sum(self.layers) + self.final_norm + self.lm_head

    @property
    def active(self) -> int:
        """Parameters one token's forward uses: memory holds `total`, compute runs `active`."""
        return self.embedding + sum(self.active_layers) + self.final_norm + self.lm_head


def count_params(cfg: dict[str, Any]) -> ParamCounts:
    counted(cfg)
    return _count(frozen(cfg))


@lru_cache(maxsize=32)
def _count(key: tuple) -> ParamCounts:
    cfg = dict(key)
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    bs = blocks(cfg)
    tied = cfg.get("tie_word_embeddings", False)
    return ParamCounts(embedding=v * h, layers=tuple(b.params for b in bs), active_layers=tuple(b.active for b in bs),
                       final_norm=h, lm_head=0 if tied else v * h,
                       linear=sum(x.fan_in * x.fan_out for b in bs for x in b.linears))


def matmul_params(cfg: dict[str, Any], active: bool = True) -> int:
    """Weights that take part in matmuls per token (PaLM's N of 6N): the blocks (their top-k experts
    when `active`) + final norm + the LM head (the tied embedding when there is no separate head);
    the input embedding is a lookup."""
    c = count_params(cfg)
    return sum(c.active_layers if active else c.layers) + c.final_norm + (c.lm_head or c.embedding)


def cast_weights(cfg: dict[str, Any]) -> int:
    """The weights autocast casts to the compute dtype for their matmuls (each cast kept for the
    whole forward): the blocks' nn.Linear weights, the routers, the LM head (or the tied embedding).
    Not the stacked experts: transformers' grouped_mm kernel runs them in their own dtype."""
    c = count_params(cfg)
    return c.linear + sum(b.experts.count * b.experts.hidden for b in blocks(cfg) if b.experts) \
        + cfg["vocab_size"] * cfg["hidden_size"]


MODEL_PLANS = ("base_model_tp_plan", "base_model_pp_plan")


def with_tp_plan(cfg: dict[str, Any]) -> dict[str, Any]:
    """The config with its class's `base_model_tp_plan` and `base_model_pp_plan`, which config.json
    and `to_dict()` leave out but the run reads for --tp and --pp (`toolkit.parallel.build`, the
    pipeline's stages): from transformers' config class for its model type, imported only here.
    Each unchanged where the config has it already, or where transformers has no such model type."""
    if not cfg.get("model_type"):
        return cfg
    plans = {attr: _class_plan(cfg["model_type"], attr) for attr in MODEL_PLANS if attr not in cfg}
    return {**cfg, **{attr: plan for attr, plan in plans.items() if plan is not False}}


@lru_cache(maxsize=None)
def _class_plan(model_type: str, attr: str) -> dict | None | bool:
    """The config class's plan `attr`: read from its source (importing transformers imports torch,
    seconds for a plan that takes a second), else imported; False where there is no such class."""
    plan = _plan_from_source(model_type, attr)
    if plan is not False:
        return plan
    try:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        return getattr(CONFIG_MAPPING[model_type], attr, None)
    except (ImportError, KeyError):
        return False


def _plan_from_source(model_type: str, attr: str) -> dict | None | bool:
    """The plan `attr` as the class whose `model_type = "..."` is `model_type` assigns it in
    transformers' models/*/configuration_*.py (None where the class sets none and derives from
    PreTrainedConfig alone); False where the source does not say (not found, or inherited)."""
    import ast
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.submodule_search_locations:
        return False
    models = Path(list(spec.submodule_search_locations)[0]) / "models"
    needle = f'model_type = "{model_type}"'
    for f in [models / model_type / f"configuration_{model_type}.py", *sorted(models.glob("*/configuration_*.py"))]:
        text = f.read_text() if f.is_file() else ""
        if needle not in text:
            continue
        for node in ast.walk(ast.parse(text)):
            body = node.body if isinstance(node, ast.ClassDef) else []
            fields = {t.id: x.value for x in body if isinstance(x, (ast.Assign, ast.AnnAssign)) and x.value is not None
                      for t in (x.targets if isinstance(x, ast.Assign) else [x.target]) if isinstance(t, ast.Name)}
            if isinstance(fields.get("model_type"), ast.Constant) and fields["model_type"].value == model_type:
                if attr in fields:
                    return ast.literal_eval(fields[attr])
                bases = {b.id for b in node.bases if isinstance(b, ast.Name)}
                return None if bases <= {"PreTrainedConfig", "PretrainedConfig"} else False
    return False


# --------------------------------------------------------------------------------------------- LoRA

# peft 0.21 (utils/transformers_weight_conversion.py, `_convert_peft_config_moe`) rewrites the
# target_modules of the MoE models whose experts transformers 5 fused (transformers'
# conversion_mapping._MODEL_TO_CONVERSION_PATTERN maps these model types to "qwen2_moe", not qwen2_moe
# itself; peft adds "mixtral"): the v4 leaf names below become target_parameters (the router's weight, the stacked
# experts; gate + up fused into gate_up_proj at twice the rank), and `all-linear` resolves to every
# nn.Linear leaf name plus these names, so in these models the dense layers' and shared experts'
# gate/up/down_proj (same leaf names) are not adapted.
PEFT_MOE_NAMES = {"qwen2_moe": ("gate", ("gate_proj", "up_proj"), "down_proj"), "mixtral": ("gate", ("w1", "w3"), "w2")}
PEFT_MOE_FAMILY = {**dict.fromkeys(("qwen3_moe", "deepseek_v2", "deepseek_v3", "olmoe"), "qwen2_moe"),
                   "mixtral": "mixtral"}


@dataclass(frozen=True)
class Adapter:
    """One LoRA adapter of a block: A (rank x fan_in) and B (fan_out x rank) per expert (`count`), or one
    for an nn.Linear or the router (count 1); `tp` as `Linear.tp`, `expert` when it adapts stacked
    expert weights (peft's ParamWrapper, which adds B A to the weight in every forward)."""
    name: str
    fan_in: int
    fan_out: int
    rank: int
    count: int = 1
    tp: str = "column"
    expert: bool = False

    def params(self, tp: int = 1, ep: int = 1) -> int:
        """Per rank under tensor parallel degree `tp`: a column-parallel layer keeps A whole and 1/tp of
        B's rows, a row-parallel one 1/tp of A's columns and B whole. Under expert parallel degree `ep`
        an experts' adapter keeps its E/ep experts' factors (`toolkit.parallel.ep` splits them with
        the experts; whole experts under tp, whose ep group is the TP group)."""
        if self.expert and ep > 1:
            tp = 1
        fan_in = self.fan_in // tp if self.tp == "row" else self.fan_in
        fan_out = self.fan_out // tp if self.tp == "column" else self.fan_out
        return (self.count // ep if self.expert else self.count) * self.rank * (fan_in + fan_out)


def lora_targets(targets: str | list[str]) -> list[str]:
    """The leaf names LoRA targets; `all-linear` (peft) is every linear of the blocks, not the lm_head."""
    if targets == "all-linear":
        return list(LINEARS)
    return [t.strip() for t in (targets.split(",") if isinstance(targets, str) else targets) if t.strip()]


def adapters(cfg: dict[str, Any], layer: int, r: int, targets: str | list[str] = "all-linear") -> list[Adapter]:
    """The LoRA adapters peft puts in block `layer` for `targets` (a list of leaf names, or
    `all-linear`: every nn.Linear of the blocks)."""
    b = blocks(cfg)[layer]
    family = PEFT_MOE_FAMILY.get(cfg.get("model_type", ""))
    router, (gate, up), down = PEFT_MOE_NAMES[family] if family else (None, (None, None), None)
    renamed = {router, gate, up, down} - {None}
    names = set(lora_targets(targets)) if targets != "all-linear" else {x.name for x in b.linears} | renamed
    out = [Adapter(x.name, x.fan_in, x.fan_out, r, tp=x.tp) for x in b.linears
           if x.name in names and x.name not in renamed]
    e = b.experts
    if family and e:
        if router in names:
            out.append(Adapter("gate", e.hidden, e.count, r, tp="none"))
        if (gate in names) != (up in names):
            raise ValueError(f"LoRA target {gate if gate in names else up} needs {up if gate in names else gate} "
                             "too: peft fuses them into the experts' gate_up_proj")
        if gate in names:
            out.append(Adapter("gate_up_proj", e.hidden, 2 * e.intermediate, 2 * r, e.count, expert=True))
        if down in names:
            out.append(Adapter("down_proj", e.intermediate, e.hidden, r, e.count, "row", expert=True))
    return out


def _check_targets(cfg: dict[str, Any], targets: str | list[str]) -> None:
    if targets == "all-linear":
        return
    known = {x.name for b in blocks(cfg) for x in b.linears}
    family = PEFT_MOE_FAMILY.get(cfg.get("model_type", ""))
    if family and num_experts(cfg):
        router, pair, down = PEFT_MOE_NAMES[family]
        known |= {router, *pair, down}
    unknown = [n for n in lora_targets(targets) if n not in known]
    if unknown:
        raise ValueError(f"LoRA targets {unknown} are not linears of this architecture ({', '.join(sorted(known))})")


def adapted_inputs(cfg: dict[str, Any], targets: str | list[str], layer: int = 0) -> dict[str, int]:
    """Each nn.Linear adapter's in-features in block `layer` (what its adapter saves per token
    scales with); the experts' adapters are `adapters`' `expert` ones."""
    return {a.name: a.fan_in for a in adapters(cfg, layer, 1, targets) if not a.expert and a.name != "gate"}


def lora_params(cfg: dict[str, Any], r: int, targets: str | list[str] = "all-linear", tp: int = 1) -> int:
    """LoRA adds A (r x in) and B (out x r) per targeted linear, per expert of a targeted expert
    stack (`adapters`); `all-linear` (peft) is every linear of the blocks, not the lm_head. Per rank
    under tensor parallel degree `tp` (the toolkit's plan)."""
    return sum(lora_layer_params(cfg, r, targets, tp))


def lora_layer_params(cfg: dict[str, Any], r: int, targets: str | list[str] = "all-linear", tp: int = 1,
                      ep: int = 1, experts_only: bool = False) -> tuple[int, ...]:
    """`lora_params` block by block (memoized, like `blocks`), per rank under expert parallel degree
    `ep` (`Adapter.params`); `experts_only`: the routed experts' adapters alone (what ep splits)."""
    _check_targets(cfg, targets)
    return _lora_layers(frozen(cfg), r, targets if isinstance(targets, str) else ",".join(targets), tp, ep,
                        experts_only)


@lru_cache(maxsize=64)
def _lora_layers(key: tuple, r: int, targets: str, tp: int, ep: int, experts_only: bool) -> tuple[int, ...]:
    cfg = dict(key)
    return tuple(sum(a.params(tp, ep) for a in adapters(cfg, i, r, targets) if a.expert or not experts_only)
                 for i in range(cfg["num_hidden_layers"]))


# ------------------------------------------------------------------------------ where parameters sit

# The parts of a decoder the plan names (`trainable_parts`), in the order it prints them
PARTS = ("attention", "mlp", "experts", "router", "norms", "embeddings", "lm_head")
# Qwen2-MoE's 1-wide gate of the shared expert: routing, not an MLP
ROUTER_LINEARS = ("shared_expert_gate",)


def trainable_parts(cfg: dict[str, Any], method: str, r: int = 16,
                    targets: str | list[str] = "all-linear") -> dict[str, int]:
    """The trainable parameters by where they sit (`PARTS`; parts with none left out), summing to the
    plan's trainable count: one total hides what trains. LoRA on an MoE adapts every routed expert
    (peft's target_parameters), so a LoRA of 1B parameters on Qwen3-30B-A3B is 92% experts, which
    is what ep splits and what each forward merges; a full finetune trains every part."""
    parts = param_parts(cfg) if method == "full" else lora_parts(cfg, r, targets)
    return {k: parts[k] for k in PARTS if parts.get(k)}


def _attention_names(cfg: dict[str, Any]) -> tuple[set[str], int]:
    """(the attention's linear names, its parameters in no matmul) as `block` builds them, with the
    config class's defaults (`frozen`)."""
    linears, other = _attention(dict(frozen(cfg)))
    return {x.name for x in linears}, other


def param_parts(cfg: dict[str, Any]) -> dict[str, int]:
    """Every parameter by part: the attention's linears and its own norms (q/k norms, MLA's, gpt-oss's
    sinks); the dense MLPs and shared experts; the routed experts; the routers (and Qwen2-MoE's
    shared-expert gate); the blocks' and the final norms; the embedding; an untied LM head."""
    names, attention_other = _attention_names(cfg)
    out = dict.fromkeys(PARTS, 0)
    for b in blocks(cfg):
        out["attention"] += attention_other
        out["norms"] += b.other - attention_other
        for x in b.linears:
            out["attention" if x.name in names else "router" if x.name in ROUTER_LINEARS else "mlp"] += x.params
        if b.experts:
            out["experts"] += b.experts.count * b.experts.per_expert
            out["router"] += b.experts.router
    c = count_params(cfg)
    out["norms"] += c.final_norm
    out["embeddings"], out["lm_head"] = c.embedding, c.lm_head
    return out


def lora_parts(cfg: dict[str, Any], r: int, targets: str | list[str] = "all-linear") -> dict[str, int]:
    """LoRA's adapters (`adapters`) by the part they adapt: the attention's linears, the MLPs'
    (dense and shared experts), the routed experts' stacked weights, the router."""
    _check_targets(cfg, targets)
    names, _ = _attention_names(cfg)
    out = dict.fromkeys(PARTS, 0)
    for layer in range(cfg["num_hidden_layers"]):
        for a in adapters(cfg, layer, r, targets):
            part = "experts" if a.expert else "attention" if a.name in names else \
                "router" if a.name == "gate" or a.name in ROUTER_LINEARS else "mlp"
            out[part] += a.params()
    return out
