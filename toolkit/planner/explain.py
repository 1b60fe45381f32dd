"""The planner's words: why a plan chose what it chose, and the table `python -m toolkit plan` prints.

`plan` runs the search (`toolkit.planner.search.search`) and says why: each choice names the term
of the time or memory model that decided it (`decision`), and for an MoE model one line says why
expert parallel wins or loses (`expert_parallel_line`). Every line that compares two rows prints one
number in one direction, the other's time per example against the chosen's (`time_against`); a
choice within `HEADROOM` of a memory limit says what it leaves (`memory_line`); where nothing fits,
the advice names what is short (`nothing_fits`). `render_table` prints the plan.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from toolkit.layout.dims import ParallelDims
from toolkit.layout.rules import num_experts
from toolkit.planner.estimate import Candidate, GiB, Plan, PlanInput, asked_data_ranks, estimate, estimate_layout
from toolkit.planner.search import (ORDER, TIE, TOP, choose, flags_for, listed, offloads_row, rank_key, search,
                                    simplicity, target_batch, tie_key, time_ratio)
from toolkit.planner.layouts import flags as mesh_flags
from toolkit.planner.memory import STRATEGIES
from toolkit.planner.params import lora_layer_params

# a choice that leaves less than this fraction of a memory limit says so (`memory_line`)
HEADROOM = 0.05
MEMORY_TERMS = ("weights", "grads", "optimizer", "autocast_copies", "activations", "logits", "buffers")
# `cost.TERMS`, as a user reads them
TERM_TEXT = {
    "compute": "compute (under pp, the largest stage's)",
    "recompute": "recomputing the forward under gradient checkpointing",
    "pp_bubble": "the pipeline bubble",
    "tp": "tensor-parallel all-reduces",
    "cp": "context-parallel all-to-alls",
    "ep": "expert-parallel all-to-alls",
    "pp": "sends between pipeline stages",
    "dp": "data-parallel traffic not hidden behind compute (gradient reduction, parameter gathers)",
    "dp_sync": "the gradient all-reduce at the optimizer step",
    "offload": "PCIe traffic to and from the host (offload)",
    "optimizer": "the optimizer step",
}
PART_WORDS = {"attention": "attention", "mlp": "MLP", "experts": "routed experts", "router": "routers",
              "norms": "norms", "embeddings": "embeddings", "lm_head": "LM head"}


def plan(inp: PlanInput) -> Plan:
    """The plan `plan` prints and --json writes: `search`'s numbers, and the words that say why (the
    notes, each listed row's reason, the verdict on the layout asked for, the choice's batch split,
    what decided it, expert parallel, its memory headroom and the fallbacks), or what is short."""
    found = search(inp)
    result, inp, names, rows, best, ranked = found.result, found.inp, found.names, found.rows, found.best, found.ranked
    world, asked, unpredicted = result.world, result.asked, found.unpredicted
    if world == 1:
        result.notes.append(f"one {inp.per}: ZeRO-1/2/3 and FSDP would shard over a single rank, so only DDP and the "
                            "CPU-offload variants are planned" + (" besides the layout asked for" if asked else ""))
    if inp.method == "qlora":
        result.notes.append("QLoRA: mesh layouts (--tp/--pp/--cp/--dp-shard) are not planned; its 4-bit base is "
                            "neither sharded nor split")
    result.ranking = []
    for c in listed(best, ranked):
        reason, term = decision(c, best, inp, rows)
        if c is best and ranked[0] is not best and not best.asked and best.fits and best.runnable:
            reason += f": the simplest of the layouts within {TIE:.0%} of the fastest"
        result.ranking.append({"name": c.name, "checkpointing": c.checkpointing, "micro_batch": c.micro_batch,
                               "grad_accum": c.grad_accum, "gib_per_gpu": round(c.bytes["total"] / GiB, 2),
                               "seconds_per_example": c.seconds_per_example, "reason": reason, "term": term,
                               "asked": c.asked})
    if inp.asked is not None:
        result.asked_verdict = (f"not predicted: {unpredicted}" if asked is None else
                                decision(asked, best, inp, rows)[0] if asked is not best else "fits: chosen")
    if not (best.fits and best.runnable):
        result.advice = nothing_fits(inp, names)
        return result
    result.batch = batch_line(inp, best)
    result.why = why_chosen(best, [best] + [c for c in ranked if c is not best], inp)
    result.expert_parallel = expert_parallel_line(inp, rows, best)
    result.memory = memory_line(inp, best, ranked)
    result.fallbacks = [fallback_record(c, best, inp) for c in found.fallbacks]
    return result


def nothing_fits(inp: PlanInput, names: list[str]) -> str:
    """Name the resource that is short: GPU memory for the smallest plan that fits in host RAM, and
    host RAM for the plans (CPU offload) that would fit on the GPU. (Every layout was tried down to
    micro-batch 1, so a smaller micro-batch is no way out.)"""
    gc = inp.checkpointing is not False
    how = "gradient checkpointing" if gc else "no checkpointing"
    smallest = [estimate(inp, STRATEGIES[n], gc, 1) for n in names]
    gpu, cpu = inp.gpu_memory, inp.cpu_memory
    in_ram = [c for c in smallest if cpu is None or c.cpu_bytes_per_node <= cpu]
    parts = []
    per, where = inp.per, "GPU memory" if inp.device == "GPU" else "the memory of a process"
    if in_ram:
        c = min(in_ram, key=lambda c: c.bytes["total"])
        parts.append(f"the smallest plan in {where} ({c.name}, {how}, micro-batch 1) needs "
                     f"{gib(c.bytes['total'])} GiB per {per}, {gib(c.bytes['total'] - gpu)} GiB more than "
                     f"the {gpu / GiB:.0f} GiB " + ("GPU" if inp.device == "GPU" else "a process has"))
    on_gpu = [c for c in smallest if c.bytes["total"] <= gpu and cpu is not None and c.cpu_bytes_per_node > cpu]
    if on_gpu:
        c = min(on_gpu, key=lambda c: c.cpu_bytes_per_node)
        parts.append(f"{c.name} ({how}, micro-batch 1) would fit the {per} ({gib(c.bytes['total'])} of "
                     f"{gpu / GiB:.0f} GiB) but needs {gib(c.cpu_bytes_per_node)} GiB of host RAM per node, "
                     f"{gib(c.cpu_bytes_per_node - cpu)} GiB more than the {cpu / GiB:.0f} GiB there")
    helps = [f"more {per}es" if per == "process" else f"more {per}s", "more host RAM for CPU offload",
             "--method qlora", "a shorter --seq-len"]
    if not gc:
        helps.insert(0, "--gradient-checkpointing")
    return "nothing fits: " + "; ".join(parts) + "; " + ", ".join(helps[:-1]) + f" or {helps[-1]} would reduce it"


def fallback_record(c: Candidate, chosen: Candidate, inp: PlanInput) -> dict[str, Any]:
    """A fallback as plan.json keeps it: what changes, in words and as finetune.py's flags."""
    world = inp.gpus_per_node * inp.nodes
    if (c.name, c.dims) != (chosen.name, chosen.dims):
        what = f"{c.name} with gradient checkpointing (less held per {inp.per})"
    elif not chosen.checkpointing and c.micro_batch == chosen.micro_batch:
        what = "gradient checkpointing on"
    else:
        what = (f"micro-batch {c.micro_batch} x accumulation {c.grad_accum} with gradient checkpointing (the global "
                "batch kept)")
    flags = flags_for(c.name, True, c.micro_batch, c.grad_accum, inp.method) if c.dims is None else \
        (["--method", inp.method] + mesh_flags(ParallelDims(world, **c.dims), c.micro_batch)
         + ["--gradient-checkpointing", "--micro-batch-size", str(c.micro_batch), "--grad-accum", str(c.grad_accum)])
    return {"what": what, "name": c.name, "dims": c.dims, "checkpointing": True, "micro_batch": c.micro_batch,
            "grad_accum": c.grad_accum, "gib_per_gpu": round(c.bytes["total"] / GiB, 2), "flags": flags}


def decision(c: Candidate, chosen: Candidate, inp: PlanInput, rows: list[Candidate]) -> tuple[str, str | None]:
    """Why `chosen` ranks before `c`, in a few words, and the term that decided it: a key of `bytes`
    where `c` does not fit, of `seconds` (`cost.TERMS`) where the two differ in time; None where a
    rule decided (runnable, host RAM, the global batch, offload, a tie within `TIE`). `chosen` is
    the fastest within `TIE` unless it is the layout a run asks for (`Candidate.asked`), which is
    kept where it fits: then `c` may be the faster, and the text says by how much and why."""
    ok = chosen.fits and chosen.runnable
    target = target_batch(inp)
    if c is chosen and ok:
        return "chosen" + (", the layout asked for" if c.asked else ""), None
    if not c.runnable:
        return f"not runnable yet: {c.why_not}", None
    if c.bytes["total"] > inp.gpu_memory:
        text = f"does not fit: {gib(c.bytes['total'])} GiB per {inp.per} at micro-batch {c.micro_batch}"
        if not ok:
            return text, None
        term = max(MEMORY_TERMS, key=lambda k: c.bytes[k] - chosen.bytes[k])
        because = smaller_because(chosen, term, inp)
        return (f"{text}, {term} {gib(c.bytes[term])} GiB where the chosen holds {gib(chosen.bytes[term])}"
                + (f" ({because})" if because else "")), term
    if not c.fits:
        return f"needs {gib(c.cpu_bytes_per_node)} GiB of host RAM per node", None
    if c.global_batch != target and chosen.global_batch == target:
        return (f"its {c.data_ranks} data-parallel ranks cannot share the global batch of {target} evenly "
                f"(nearest: {c.global_batch})"), None
    if offloads_row(c) and not offloads_row(chosen):
        return "CPU offload: host RAM and PCIe traffic, only when nothing else fits", None
    ratio = time_ratio(c, chosen)
    if ratio <= TIE and (ratio >= -TIE or not chosen.asked):
        return (f"{time_against(c, chosen)}, within {TIE:.0%}: "
                + ("the layout asked for stays" if chosen.asked else preferred(chosen, c, rows, target))), None
    # per optimizer step of the chosen's global batch
    scale = chosen.global_batch / c.global_batch
    diff = {k: c.seconds[k] * scale - chosen.seconds[k] for k in chosen.seconds}
    # what makes it slower, or faster
    term = (max if ratio > 0 else min)(diff, key=diff.get)
    text = (f"{time_against(c, chosen)}, mostly {TERM_TEXT[term]} ({diff[term]:+.2g} s per "
            f"optimizer step of {chosen.global_batch} examples)")
    twin = next((x for x in rows if x.name == c.name and not x.checkpointing), None)
    if ratio > 0 and term == "recompute" and not chosen.checkpointing and twin is not None and not twin.fits:
        because = smaller_because(chosen, "activations", inp)
        text += (f", which {c.name} needs to fit ({gib(twin.bytes['total'])} GiB per {inp.per} without it at "
                 f"micro-batch {twin.micro_batch}, activations {gib(twin.bytes['activations'])} GiB) and the "
                 f"chosen does not (activations {gib(chosen.bytes['activations'])} GiB"
                 + (f": {because})" if because else ")"))
    return text, term


def preferred(chosen: Candidate, c: Candidate, rows: list[Candidate], target: int) -> str:
    """Why `choose` took the chosen over `c`, a row within `TIE` of it, in words: what makes the chosen
    first by `tie_key`; or, where `c` is first by it, that `c` is more than `TIE` slower than the
    fastest row and so out of the tie. "The simpler layout wins" once said it for two layouts equally
    simple, and for a faster one that was not simpler."""
    if tie_key(c) < tie_key(chosen):
        fastest = min(rows, key=lambda r: rank_key(r, target))
        return f"{label(c)} is the simpler, but more than {TIE:.0%} slower than the fastest, {label(fastest)}"
    a, b = simplicity(chosen), simplicity(c)
    if a == b:
        if c.checkpointing != chosen.checkpointing:
            return "the chosen needs no gradient checkpointing"
        return "as simple as the chosen" + (", and slower" if time_ratio(c, chosen) > 0
                                            else ": the chosen was found first")
    if a[0] == b[0] == 0:
        return f"{c.name} comes after the chosen in the 1-D order ({', '.join(ORDER[a[1]:b[1] + 1])})"
    if a[0] == 0:
        return f"the chosen is a 1-D strategy, {c.name} a device mesh"
    if a[0] != b[0]:
        return f"the chosen's mesh has {a[0] - 1} dimension{'s' * (a[0] != 2)}, {c.name}'s {b[0] - 1}"
    if a[1] != b[1]:
        return f"the chosen's model-parallel degrees (pp x cp x tp x ep) multiply to {a[1]}, {c.name}'s to {b[1]}"
    return f"the chosen's ep is {a[2]}, {c.name}'s {b[2]} (its predicted time assumes a balanced router)"


def smaller_because(c: Candidate, term: str, inp: PlanInput) -> str:
    """Why a mesh layout's activations (`term`) are smaller per rank, in its degrees' words ('' otherwise)."""
    if term != "activations" or c.dims is None:
        return ""
    d = c.dims
    parts = ([f"cp {d['cp']} gives each rank {-(-inp.seq_len // d['cp']):,} of the {inp.seq_len:,} tokens"]
             * (d["cp"] > 1))
    parts += [f"tp {d['tp']} splits each block's attention and MLP"] * (d["tp"] > 1)
    parts += [f"each of pp {d['pp']} stages holds 1/{d['pp']} of the blocks"] * (d["pp"] > 1)
    ep, experts = d.get("ep", 1), num_experts(inp.model)
    if ep > 1 and inp.method != "full" and sum(lora_layer_params(inp.model, inp.lora_r, inp.lora_targets,
                                                                 experts_only=True)):
        parts.append(f"ep {ep} merges LoRA into {experts // ep} of the {experts} experts of each layer")
    return "; ".join(parts)


def why_chosen(chosen: Candidate, ranked: list[Candidate], inp: PlanInput) -> list[dict[str, Any]]:
    """What decided the choice: against the runner-up and, for a mesh layout, against the best plain
    data-parallel strategy (the 1-D one finetune.py would otherwise run), each with its deciding term.
    For the layout a run asks for: against the plan's own pick, the best of the others."""
    others = [c for c in ranked if c is not chosen]
    if chosen.asked:
        target = target_batch(inp)
        against, roles = ([choose(others, target)] if others else []), ("the plan's own pick",)
    else:
        against, roles = others[:1], ("the runner-up", "the best 1-D strategy")
        plain = next((c for c in others if c.dims is None), None)
        if chosen.dims is not None and plain is not None and plain is not others[0]:
            against.append(plain)
    out = []
    for c, role in zip(against, roles):
        text, term = decision(c, chosen, inp, ranked)
        out.append({"against": c.name, "checkpointing": c.checkpointing, "role": role, "term": term, "text": text})
    return out


def batch_line(inp: PlanInput, c: Candidate) -> str:
    """How `c` splits the global batch, against what was asked, in one line."""
    target, ranks = target_batch(inp), asked_data_ranks(inp)
    asked = f"--global-batch {inp.global_batch}" if inp.global_batch else \
        f"{inp.micro_batch} x {inp.grad_accum} x {ranks}"
    split = (f"micro-batch {c.micro_batch} x accumulation {c.grad_accum} x {c.data_ranks} data-parallel "
             f"rank{'s' if c.data_ranks != 1 else ''}")
    if c.global_batch == target:
        same = (c.micro_batch, c.grad_accum, c.data_ranks) == (inp.micro_batch, inp.grad_accum, ranks)
        return (f"global batch {target} kept: {split} "
                f"({'as asked' if same and not inp.global_batch else f'asked: {asked}'})")
    return (f"global batch {c.global_batch}, not the {target} asked ({asked}): no layout that fits shares {target} "
            f"evenly over its data-parallel ranks, this is the nearest multiple of its {c.data_ranks}: {split}")


def expert_parallel_line(inp: PlanInput, rows: list[Candidate], best: Candidate) -> str:
    """Why the best layout with ep wins or loses against the best without, in one line ('' where no
    row has ep > 1: a dense model): one of the two is the chosen `best`, the other the best of its kind
    (`choose`); their time per example; then what ep itself changes against the same layout, split
    and checkpointing without ep: each block gathers E/ep of the E experts (`layouts.gathered_block`),
    so the gathered transient and LoRA's merged experts (`saved.moe_merged`) shrink, and so does the
    data-parallel traffic (`layouts.traffic`), against the all-to-alls ep adds
    (`cost.expert_all_to_all_bytes`), per optimizer step."""
    with_ep = [c for c in rows if ep_of(c) > 1]
    if not with_ep:
        return ""
    target = target_batch(inp)
    e = best if ep_of(best) > 1 else choose(with_ep, target)
    n = best if ep_of(best) == 1 else choose([c for c in rows if ep_of(c) == 1], target)
    other = n if e is best else e
    tie = (f", within {TIE:.0%}" + (": the simpler layout wins" if simplicity(best) < simplicity(other) else "")
           if abs(time_ratio(other, best)) <= TIE else "")
    if e is best and not (n.fits and n.runnable):
        verdict = f"{label(e)} is chosen: no layout without ep fits"
    elif e is best:
        verdict = f"{label(e)} is chosen; {label(n)}, the best without ep: {time_against(n, e)}{tie}"
    elif not (e.fits and e.runnable):
        verdict = f"no layout with ep fits ({label(e)}: {gib(e.bytes['total'])} GiB per {inp.per})"
    else:
        verdict = f"{label(e)}, the best with ep: {time_against(e, n)}{tie}"
    d = ParallelDims(inp.gpus_per_node * inp.nodes, **e.dims)
    twin = estimate_layout(inp, replace(d, ep=1), e.checkpointing, e.micro_batch)
    twin.set_accumulation(e.grad_accum)
    experts = num_experts(inp.model)
    diff = {k: (e.bytes[k] - twin.bytes[k]) / GiB for k in ("buffers", "activations")}
    changes = [less_or_more(diff["buffers"], "{:.2f} GiB") + " gathered"]
    changes += [less_or_more(diff["activations"], "{:.2f} GiB") + " activations (LoRA's merged experts)"] \
        * (abs(diff["activations"]) >= 0.01)
    changes += [less_or_more(e.seconds["dp"] - twin.seconds["dp"], "{:.2g} s") + " data-parallel traffic",
                f"{e.seconds['ep']:.2g} s of all-to-all added per optimizer step"]
    return (f"{verdict}; against {label(twin)} it gathers {experts // d.ep} of {experts} experts per block: "
            + ", ".join(changes[:-1]) + f" and {changes[-1]}")


def ep_of(c: Candidate) -> int:
    """The row's expert-parallel degree (1: none, or a 1-D strategy)."""
    return (c.dims or {}).get("ep", 1)


def less_or_more(x: float, text: str) -> str:
    """'`text` less' for x < 0, else '`text` more', `text` formatting |x| ('{:.2f} GiB' -> '1.20 GiB less')."""
    return f"{text.format(abs(x))} {'less' if x < 0 else 'more'}"


def memory_line(inp: PlanInput, chosen: Candidate, ranked: list[Candidate]) -> str:
    """One line where the chosen's memory needs a word ('' otherwise): within `HEADROOM` of the GPU's
    (or the host RAM's) limit, what it leaves, since the memory model is an estimate and a run that
    fits by 1% may not, and the first row of its rank that leaves more with what that costs; its CPU
    offload's host RAM where nothing checked it (`cpu_memory` None)."""
    parts, gpu, total = [], inp.gpu_memory, chosen.bytes["total"]
    if gpu - total < HEADROOM * gpu:
        text = (f"{gib(total)} of {gpu / GiB:.0f} GiB per {inp.per}: {gib(gpu - total)} GiB headroom, within "
                f"{HEADROOM:.0%} of the limit")
        key = rank_key(chosen, target_batch(inp))[:3]
        roomier = next((c for c in ranked if rank_key(c, target_batch(inp))[:3] == key
                        and gpu - c.bytes["total"] >= HEADROOM * gpu), None)
        if roomier is not None:
            text += (f"; {label(roomier)} leaves {gib(gpu - roomier.bytes['total'])} GiB at "
                     f"{time_against(roomier, chosen)}")
        parts.append(text)
    ram, cpu = inp.cpu_memory, chosen.cpu_bytes_per_node
    if cpu and ram is None:
        parts.append(f"CPU offload needs {gib(cpu)} GiB of host RAM per node, not checked"
                     + (" (host RAM unknown: --cpu-memory SIZE)" if inp.cpu_memory_unknown else ""))
    elif cpu and ram - cpu < HEADROOM * ram:
        parts.append(f"host RAM {gib(cpu)} of {ram / GiB:.0f} GiB per node: {gib(ram - cpu)} GiB headroom, "
                     f"within {HEADROOM:.0%} of the limit")
    return "; ".join(parts)


def time_against(c: Candidate, chosen: Candidate) -> str:
    """`time_ratio` in words, at one rounding wherever it is printed."""
    return f"{time_ratio(c, chosen):+.1%} predicted time per example against the chosen"


def label(c: Candidate) -> str:
    return c.name + (" +gc" if c.checkpointing else "") + (" (asked)" if c.asked else "")


def gib(n: int) -> str:
    """Bytes as the plan prints them everywhere (table, reasons, advice): GiB to two decimals, so a
    figure said twice reads the same."""
    return f"{n / GiB:.2f}"


def parts_line(p: Plan) -> str:
    """Where the trainable parameters sit (`params.trainable_parts`), each with its share: the
    header's one total says nothing of whether attention or a thousand experts train."""
    total = sum(p.trainable_parts.values()) or 1
    return "trainable by part: " + ", ".join(
        f"{PART_WORDS[k]} {n:,} ({f'{n / total:.1%}' if n >= total / 1000 else 'under 0.1%'})"
        for k, n in p.trainable_parts.items())


def fits_word(c: Candidate, p: Plan) -> str:
    """The table's fits column: yes; no and what is short (`Candidate.short`), so an offload row that
    fits the GPU says it is host RAM; RAM? where it fits the GPU, needs host RAM and none was checked."""
    if not c.fits:
        return "no: " + "+".join({"gpu": "GPU" if p.device == "GPU" else "memory", "host_ram": "RAM"}[k]
                                 for k in c.short)
    return "yes, RAM?" if c.cpu_bytes_per_node and p.cpu_memory is None else "yes"


def table_legend(p: Plan, shown: list[Candidate], mesh: int) -> str:
    """The line under the table that says what its columns mean, the fits column's words included."""
    short = "GPU: its memory" if p.device == "GPU" else "memory: a process's"
    unchecked = any(fits_word(c, p).endswith("RAM?") for c in shown)
    return (f"each row at its split of the global batch of {p.global_batch} (mb x acc: micro-batch x accumulation "
            f"per data-parallel rank; micro-batch 1 where none fits"
            + ("; (asked): the run's own layout at its own split" if p.asked else "")
            + "); step s: predicted seconds per optimizer step; fits: no names what is short "
            f"({short}; RAM: the node's host RAM that CPU offload fills)"
            + ("; RAM?: fits the GPU, host RAM not checked" if unchecked else "")
            + f"; {mesh} mesh layouts (pp x dp x cp x tp) predicted, those in the top list shown (all in --json)")


def top_heading(p: Plan) -> str:
    """The line over the top list, saying the order `listed` gives it."""
    order = "keeps the global batch, no CPU offload, then the least predicted time per example"
    if not p.chosen:
        return f"nothing fits; the first {len(p.ranking)} in the plan's order ({order}), each with what is short:"
    fewer = f" (only {len(p.ranking)} run and fit)" if len(p.ranking) < TOP else ""
    return (f"top {len(p.ranking)}{fewer}: the chosen first, then the other layouts that run and fit, those as fast as "
            f"it (+0.0%) next, then in the plan's order ({order}), each with what decided it against the chosen:")


def render_table(p: Plan) -> str:
    """Where the trainable parameters sit, the 1-D strategies' memory breakdown, the mesh layouts
    among the top list (and the layout a run asks for), each row's fits saying what is short, then the
    top list (`listed`: the chosen first, the rows as fast as it, then the others that run and fit by
    `rank_key`) with why each lost, then the choice: its split of the global batch,
    its headroom where it is tight (`memory_line`), its predicted step term by term, what decided it,
    and its flags. Each figure is printed once, and every GiB figure as `gib` rounds it."""
    cols = ["weights", "grads", "optimizer", "autocast_copies", "activations", "logits", "buffers", "allocated",
            "total"]
    gpu = p.device == "GPU"
    per = "GPU" if gpu else "process"
    ram = ("unknown, not checked" if p.cpu_memory_unknown else "not checked") if p.cpu_memory is None \
        else f"{p.cpu_memory / GiB:.0f} GiB"
    top = {(r["name"], r["checkpointing"]) for r in p.ranking}
    shown = [c for c in p.strategies if c.dims is None or c.asked or (c.name, c.checkpointing) in top]
    mesh = len([c for c in p.strategies if c.dims is not None and not c.asked])
    world = f"{p.world} GPU{'s' * (p.world != 1)}" if gpu else f"{p.world} CPU process{'es' * (p.world != 1)}"
    lines = [f"params {p.params:,}  trainable {p.trainable_params:,}  world {world}  "
             f"{'GPU memory' if gpu else 'memory per process'} {p.gpu_memory / GiB:.0f} GiB  "
             f"step times for {p.hardware}  "
             f"host RAM per node {ram}  (GiB per {per} below)", parts_line(p), *p.notes,
             f"{'layout':<26}" + "".join(f"{c:>{max(12, len(c) + 1)}}" for c in cols)
             + f"{'cpu/node':>10}{'mb x acc':>10}{'step s':>8}  {'fits'}"]
    for c in shown:
        lines.append(f"{label(c):<26}" + "".join(f"{gib(c.bytes[k]):>{max(12, len(k) + 1)}}" for k in cols)
                     + f"{gib(c.cpu_bytes_per_node):>10}{f'{c.micro_batch} x {c.grad_accum}':>10}"
                     f"{c.step_time_s:>8.3g}  {fits_word(c, p)}")
    lines.append(table_legend(p, shown, mesh))
    lines.append(top_heading(p))
    for r in p.ranking:
        name = r["name"] + (" +gc" if r["checkpointing"] else "") + (" (asked)" if r.get("asked") else "")
        split = f"{r['micro_batch']} x {r['grad_accum']}"
        lines.append(f"  {name:<26} mb {split:<8} {r['seconds_per_example'] * 1e3:>9.2f} ms/example  {r['reason']}")
    if p.asked_verdict and not (p.chosen_detail is not None and p.chosen_detail is p.asked):
        name = p.asked.name + (" +gc" if p.asked.checkpointing else "") if p.asked else "the layout the run asks for"
        lines.append(f"asked: {name}: {p.asked_verdict}")
    if p.chosen:
        d = p.chosen_detail
        lines.append(f"chosen: {label(d)}" + (", the layout the run asks for: it fits" if d.asked else "")
                     + " (its memory and step time: its row above)")
        lines.append("batch: " + p.batch)
        lines += [f"memory: {p.memory}"] * bool(p.memory)
        terms = [f"{k} {v:.3g}" for k, v in d.seconds.items() if v > 1e-3 * d.step_time_s]
        lines.append(f"time: {' + '.join(terms)} (seconds of its optimizer step, whose sum is its step s; --json: "
                     "seconds)")
        lines += [f"why: against {w['against']}{' +gc' if w['checkpointing'] else ''} ({w['role']}): {w['text']}"
                  for w in p.why if (w["against"], w["checkpointing"]) not in top]
        lines += [f"ep: {p.expert_parallel}"] * bool(p.expert_parallel)
        lines.append("flags: " + " ".join(p.flags))
    else:
        lines.append(p.advice)
    return "\n".join(lines)
