"""transformers' tensor-parallel plan, read into what the toolkit's TP layers (`toolkit.parallel.tp`)
run, or the one entry they cannot express. The plan is `base_model_tp_plan`, a class attribute of a
model's config (module pattern -> style, e.g. 'layers.*.self_attn.q_proj': 'colwise'), which
`to_dict()` leaves out. Pure: no torch; the layout rules ask it before any weights load.

A decoder block is split region by region. A region is a block submodule (`self_attn`, `mlp`)
whose entries are column projections and one row projection:

    colwise | packed_colwise   column-parallel, the output left split: each rank computes its own
      + rowwise                heads or features in between; the block input is copied to the ranks
                               once, the row layer's all-reduce closes the region. packed_colwise
                               (a 2-D gate_up) is split part by part: gate, then up.
    colwise_gather_output      transformers gathers the full output in between: for a fused qkv
      + rowwise_split_input    sliced by position, or a norm over every head (OLMo 2). The toolkit
                               keeps the output local where each column is a packed projection
                               whose parts it can name from the widths (`packed_parts`: q, k and v
                               heads; gate and up) and the region holds no other parameter;
                               otherwise it gathers, as the plan says.
    replicated_with_grad_allreduce
                               a module inside a local region (Qwen3's q/k norms): whole on every
                               rank, its gradient summed over the ranks.
    moe_tp_experts             a routed-experts module whose stacked experts ([E, out, in] tensors)
      + packed_colwise/rowwise  the entries under it split like a dense MLP, every expert's
                               intermediate cut in t (Megatron's expert tensor parallel): its inputs
                               (the tokens and their routing weights) copied in, its output all-reduced;
                               the router stays whole on every rank.

Regions may sit inside one another's path (Qwen3-MoE's dense `mlp` and its MoE `mlp.experts`): each
applies to the blocks that hold its projections, and a block holding two nested ones is refused when
the plan is applied. A model with one kind of those blocks only (Qwen3-30B-A3B routes every layer)
leaves the other region unmatched, which is no error (`toolkit.parallel.tp.plan.tp_fit`).

Entries outside the decoder blocks (a vocab-parallel embedding) stay whole on every rank, as do the
LM head and the norms: always correct, only less memory saved. Any other style inside a block
(sequence parallel, MLA projections) is refused, naming its entry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

LOCAL = {"colwise": "column", "packed_colwise": "column", "rowwise": "row"}
GATHERED = {"colwise_gather_output": "column", "rowwise_split_input": "row"}
REPLICATED = "replicated_with_grad_allreduce"
# marks a routed-experts module: the region of the entries under it
EXPERTS = "moe_tp_experts"
WHY_NOT = {"moe_identity_expert": "MoE identity experts",
           "mla_kv_a_proj": "multi-head latent attention", "sequence_parallel": "sequence parallel",
           "packed_rowwise": "a packed row projection"}


class NotExpressible(ValueError):
    """The plan asks for something the TP layers do not do; the message names the entry."""


@dataclass(frozen=True)
class Region:
    """One region of every decoder block: `path` under the block, its column projections, the row
    projection that closes it, and how (local or gathered in between)."""
    path: str
    columns: tuple[str, ...]
    row: str
    gathered: bool = False
    # packed_colwise columns: two equal parts, gate then up
    packed: tuple[str, ...] = ()
    # replicated_with_grad_allreduce modules under `path`
    replicated: tuple[str, ...] = ()
    # a routed-experts module: its columns and row are stacked [E, out, in] parameters
    experts: bool = False


@dataclass(frozen=True)
class TPPlan:
    # the decoder blocks' list under the base model: 'layers'
    blocks: str
    regions: tuple[Region, ...]
    # 'entry: style' outside the blocks, kept whole on every rank
    outside: tuple[str, ...] = ()


def _entry(key: str, style: str) -> str:
    return f"'{key}: {style}'"


def read_tp_plan(plan: Mapping[str, str] | None) -> TPPlan:
    """The regions `plan` splits every block into; NotExpressible naming the first entry the TP
    layers cannot express."""
    if not plan:
        raise NotExpressible("its config declares no base_model_tp_plan")
    # region path -> [(leaf, style, key)]
    inside: dict[str, list[tuple[str, str, str]]] = {}
    outside, blocks, experts = [], None, set()
    for key, style in plan.items():
        if ".*." not in key:
            outside.append(f"{key}: {style}")
            continue
        if style == EXPERTS:
            blocks, _, rest = key.partition(".*.")
            experts.add(rest)
            continue
        if style not in LOCAL and style not in GATHERED and style != REPLICATED:
            why = WHY_NOT.get(style, "a style the TP layers do not express")
            raise NotExpressible(f"base_model_tp_plan entry {_entry(key, style)} ({why}) is not expressible by "
                                 "the toolkit's TP layers")
        prefix, _, rest = key.partition(".*.")
        path, _, leaf = rest.rpartition(".")
        if blocks not in (None, prefix) or "*" in rest or not path:
            raise NotExpressible(f"base_model_tp_plan entry {_entry(key, style)} is not a projection inside the "
                                 f"decoder blocks ('{blocks or prefix}.*.<module>.<projection>')")
        blocks = prefix
        inside.setdefault(path, []).append((leaf, style, key))
    lone = experts - set(inside)
    if lone:
        raise NotExpressible(f"base_model_tp_plan entry '{blocks}.*.{sorted(lone)[0]}: {EXPERTS}' names no "
                             "projections under it to split")
    if not inside:
        only = ", ".join(f"'{e}'" for e in outside)
        raise NotExpressible(f"base_model_tp_plan splits nothing inside the decoder blocks (only {only}, which "
                             "would stay whole on every rank)")
    regions = tuple(_region(path, entries, blocks, path in experts) for path, entries in inside.items())
    return TPPlan(blocks, regions, tuple(outside))


def _region(path: str, entries: list[tuple[str, str, str]], blocks: str, experts: bool = False) -> Region:
    """Columns in, one row out, all of one kind (local or gathered); replicated modules in a local one."""
    projections = [(leaf, style, key) for leaf, style, key in entries if style != REPLICATED]
    gathered = bool(projections) and projections[0][1] in GATHERED
    kind = GATHERED if gathered else LOCAL
    for leaf, style, key in entries:
        if style == REPLICATED and gathered:
            raise NotExpressible(f"base_model_tp_plan entry {_entry(key, style)} sits in a region whose output is "
                                 "gathered; its gradient is whole already")
        if style != REPLICATED and style not in kind:
            raise NotExpressible(f"base_model_tp_plan entry {_entry(key, style)} mixes gathered and split outputs "
                                 f"in '{blocks}.*.{path}'")
    columns = tuple(leaf for leaf, style, _ in projections if kind[style] == "column")
    rows = [(leaf, style, key) for leaf, style, key in projections if kind[style] == "row"]
    if len(rows) != 1 or not columns:
        leaf, style, key = rows[1] if len(rows) > 1 else entries[0]
        raise NotExpressible(f"base_model_tp_plan entry {_entry(key, style)}: region '{blocks}.*.{path}' needs "
                             "column projections and exactly one row projection to close it")
    return Region(path, columns, rows[0][0], gathered,
                  packed=tuple(leaf for leaf, style, _ in projections if style == "packed_colwise"),
                  replicated=tuple(leaf for leaf, style, _ in entries if style == REPLICATED), experts=experts)


def packed_parts(width: int, row_in: int, heads: int, kv_heads: int, head_dim: int,
                 intermediate: int | None) -> tuple[int, ...] | None:
    """The parts a fused column projection of output `width` holds, found from the widths: q, k and
    v heads (Phi-3's qkv_proj: the row projection reads the q heads), or gate and up (gate_up_proj:
    twice the row's input, the intermediate size). None where neither or both fit: the widths do
    not say which, and the region is gathered instead."""
    qkv = row_in == heads * head_dim and width == (heads + 2 * kv_heads) * head_dim
    halves = width == 2 * row_in and row_in == intermediate
    if qkv == halves:
        return None
    return (row_in, kv_heads * head_dim, kv_heads * head_dim) if qkv else (row_in, row_in)
