"""The planner's search: which layouts it weighs (`planned_strategies`), how it ranks their estimates and picks
one (`choose`), the global batch split into micro-batch and accumulation, what `--strategy auto` runs after an
out-of-memory (`fallbacks`), and the flags of a layout; `search` puts them together for `explain.plan`. Numbers
only: the words are `toolkit.planner.explain`'s."""

from __future__ import annotations
from dataclasses import dataclass, field, replace
from toolkit.errors import UserError
from toolkit.planner.estimate import (Candidate, Plan, PlanInput, asked_candidate, asked_data_ranks, check_cp, check_ep,
                                      check_tp, estimate, estimate_layout, offloads, reestimate)
from toolkit.layout.dims import ParallelDims
from toolkit.layout.rules import (flags_of, layout_problems)
from toolkit.planner.layouts import (divisors, mesh_layouts)
from toolkit.planner.layouts import flags as mesh_flags
from toolkit.planner.memory import (STRATEGIES)
from toolkit.planner.params import (count_params, lora_params, trainable_parts,
                                    with_tp_plan)


# predicted times closer than this are treated as equal
TIE = 0.05


# times closer than this print as +0.0% (`explain.time_against`): the top list keeps them together
EQUAL = 0.0005


# rows in the top list (`listed`), more where rows as fast as the last one shown follow it
TOP = 5


ORDER = ["ddp", "zero1", "zero2", "fsdp_grad_op", "zero3", "fsdp_full", "zero2_offload", "zero3_offload",
         "zero3_offload_param"]


def planned_strategies(inp: PlanInput) -> list[str]:
    """The strategies worth predicting: those the runtime runs with this method and precision
    (`toolkit.layout.rules`: QLoRA's 4-bit base can be neither sharded by parameter nor offloaded);
    on one GPU ZeRO and FSDP shard over a single rank (nothing saved, DeepSpeed's or FSDP's overhead
    paid), so only DDP and the CPU-offload variants remain."""
    world = inp.gpus_per_node * inp.nodes
    out = []
    for name in ORDER:
        s = STRATEGIES[name]
        if layout_problems(flags_of(name), inp.method, inp.precision, inp.loss, inp.micro_batch):
            continue
        if world == 1 and s.shard_optimizer and not offloads(s):
            continue
        out.append(name)
    return out


def simplicity(c: Candidate) -> tuple[int, ...]:
    """Which of two equally fast candidates to prefer: the 1-D strategies in ORDER, then mesh
    layouts with fewer and smaller model-parallel degrees, ep among them and, at equal degrees, the
    one without ep (its predicted time assumes a balanced router)."""
    if c.dims is None:
        return (0, ORDER.index(c.name))
    d = c.dims
    return (1 + sum(v > 1 for v in d.values()), d["pp"] * d["cp"] * d["tp"] * d.get("ep", 1), d.get("ep", 1))


def offloads_row(c: Candidate) -> bool:
    return c.dims is None and offloads(STRATEGIES[c.name])


def rank_key(c: Candidate, target: int) -> tuple:
    """Runnable and fits first, then the global batch asked for (`target`), then no CPU offload, then
    the least predicted time per example; ties go to the simpler layout (`simplicity`)."""
    return (not (c.fits and c.runnable), c.global_batch != target, offloads_row(c), c.seconds_per_example,
            simplicity(c))


def tie_key(c: Candidate) -> tuple:
    """Which of the rows within `TIE` of the fastest `choose` prefers: the simpler (`simplicity`),
    then the one without checkpointing, then the faster. The last decides between equally simple
    layouts (cp2_dp_shard4 and tp2_dp_shard4), which the order the search listed them in once did:
    a 1.6% slower row was chosen for coming first, which told the reader nothing."""
    return simplicity(c), c.checkpointing, c.seconds_per_example


def choose(rows: list[Candidate], target: int) -> Candidate:
    """The first by `rank_key`, except that predictions within `TIE` of the fastest count as equal
    (the time model is not that accurate) and the first among them by `tie_key` wins."""
    best = min(rows, key=lambda c: rank_key(c, target))
    near = [c for c in rows if rank_key(c, target)[:3] == rank_key(best, target)[:3]
            and c.seconds_per_example <= (1 + TIE) * best.seconds_per_example]
    return min(near, key=tie_key)


def time_ratio(c: Candidate, chosen: Candidate) -> float:
    """`c`'s predicted time per example over the chosen's, less 1: + where `c` is slower. Every line
    that compares two rows (the ranking, why:, ep:, asked:) takes it from here, in this direction, and
    prints it with `time_against`: a plan once said +16% on one line and -14.0% on the next for the
    same two rows (each right, from either side), which read as two comparisons."""
    return c.seconds_per_example / chosen.seconds_per_example - 1


def same_time(c: Candidate, other: Candidate) -> bool:
    """Predicted times per example the plan prints as equal: `time_against` reads +0.0% or -0.0%."""
    return abs(time_ratio(c, other)) < EQUAL


def listed(best: Candidate, ranked: list[Candidate]) -> list[Candidate]:
    """The rows of the top list, in its order. Where a layout is chosen: it first (the plan's answer
    is the line a reader looks for); then the other rows that run and fit, those as fast as it
    (`same_time`) next to it, then the rest in the plan's order (`ranked`, by `rank_key`), to `TOP`
    rows, a row as fast as the last one shown kept with it. Issue 64: the chosen stood fifth under
    faster rows it did not choose, fsdp_full, as fast as the chosen zero3, was cut off below them,
    and a row that does not fit filled a place the table already says it cannot have. Where nothing
    fits: the first `TOP` in the plan's order, the nearest to a choice among them."""
    if not (best.fits and best.runnable):
        rest = [c for c in ranked if c is not best][:TOP - 1]
        return [c for c in ranked if c is best or any(c is x for x in rest)]
    others = [c for c in ranked if c is not best and c.fits and c.runnable]
    top = [best] + [c for c in others if same_time(c, best)]
    for c in others:
        if any(c is x for x in top):
            continue
        if len(top) >= TOP and not same_time(c, top[-1]):
            break
        top.append(c)
    return top


def target_batch(inp: PlanInput) -> int:
    """Examples per optimizer step the user asked for: `--global-batch`, else what their flags give
    under plain data parallelism over every GPU (micro-batch x accumulation x GPUs), which is what
    finetune.py runs with those flags and no layout flags, or under the layout a run's settings ask
    for (`asked_data_ranks`). Always set (the flags have defaults), so the plan never invents a batch
    size."""
    return inp.global_batch or inp.micro_batch * inp.grad_accum * asked_data_ranks(inp)


def rank_share(target: int, ranks: int) -> int:
    """Examples each of `ranks` data-parallel ranks takes per optimizer step: target / ranks, or,
    where the ranks do not divide the target (only a `--global-batch` can do that), the share of the
    nearest multiple of `ranks` (halfway rounds up), and at least one example each."""
    return max(1, (2 * target + ranks) // (2 * ranks))


def split_batch(inp: PlanInput, c: Candidate, target: int) -> Candidate:
    """`c` at the split of the global batch it runs best: micro-batch m x accumulation share / m on
    each of its data-parallel ranks (`rank_share`), m a divisor of the share, so the examples per
    optimizer step stay the target. A layout with fewer data-parallel ranks (tp, pp, cp) gets a
    larger share. It starts from the micro-batch asked for (the largest divisor of the share not
    above it); a larger m is taken where it fits and is predicted more than `TIE` faster per example
    (per-micro-batch costs shared by more examples: DeepSpeed's reductions, ZeRO-3/FSDP gathers,
    offload traffic, the pipeline bubble), a smaller one where the one asked for does not fit. A
    pipeline runs one pipeline micro-batch per example (`layouts.pipeline_schedule`), so
    `--pp-microbatches` always divides the micro-batch. A layout that fits at no split is returned at
    micro-batch 1, where it is smallest; one the runtime refuses, at the micro-batch asked for."""
    share = rank_share(target, c.data_ranks)
    options = divisors(share)
    asked = max(m for m in options if m <= inp.micro_batch)

    def at(m: int) -> Candidate:
        x = c if m == c.micro_batch else reestimate(inp, c, m)
        x.set_accumulation(share // m)
        return x

    if not c.runnable:
        return at(asked)
    fitting = []
    # memory grows with the micro-batch
    for m in options:
        x = at(m)
        if not x.fits:
            if not fitting:
                # micro-batch 1
                return x
            break
        fitting.append(x)
    start = next((x for x in fitting if x.micro_batch == asked), fitting[-1])
    fastest = min(fitting, key=lambda x: x.seconds_per_example)
    return fastest if fastest.seconds_per_example * (1 + TIE) < start.seconds_per_example else start


def fallbacks(inp: PlanInput, chosen: Candidate, rows: list[Candidate], target: int) -> list[Candidate]:
    """What `--strategy auto` runs after an out-of-memory in its first steps, in order: the
    chosen layout with gradient checkpointing on; then its micro-batch made smaller, the accumulation
    larger (the global batch kept), down to 1; then the layouts of the plan that hold less per GPU in
    weights, gradients and optimizer state (sharded or offloaded), at their smallest (checkpointing,
    micro-batch 1), best first."""
    world = inp.gpus_per_node * inp.nodes

    def at(c: Candidate, m: int) -> Candidate:
        x = estimate(inp, STRATEGIES[c.name], True, m) if c.dims is None else \
            estimate_layout(inp, ParallelDims(world, **c.dims), True, m)
        x.set_accumulation(rank_share(target, c.data_ranks) // m)
        return x

    out = [] if chosen.checkpointing else [at(chosen, chosen.micro_batch)]
    share = rank_share(target, chosen.data_ranks)
    out += [at(chosen, m) for m in sorted(divisors(share), reverse=True) if m < chosen.micro_batch]

    def states(c: Candidate) -> int:
        return c.bytes["weights"] + c.bytes["grads"] + c.bytes["optimizer"]

    smaller = [at(r, 1) for r in rows if r.checkpointing and r.runnable and states(r) < states(chosen)]
    return out + sorted(smaller, key=lambda c: rank_key(c, target))


def flags_for(name: str, gc: bool, mb: int, ga: int, method: str) -> list[str]:
    s = STRATEGIES[name]
    flags = ["--method", method]
    if s.deepspeed:
        flags += ["--zero-stage", name[4]]
        if s.offload_optimizer:
            flags += ["--offload", "optimizer+param" if s.offload_params else "optimizer"]
    elif name.startswith("fsdp"):
        flags += ["--fsdp", "--fsdp-sharding", name.split("_", 1)[1]]
    if gc:
        flags.append("--gradient-checkpointing")
    return flags + ["--micro-batch-size", str(mb), "--grad-accum", str(ga)]


@dataclass
class Search:
    """What `search` found, before a word is said about it (`toolkit.planner.explain.plan` says them)."""
    # its numbers: every row and, where one fits, the chosen, its split and its flags; no words yet
    result: Plan
    # as planned: the model with its config class's TP plan (`with_tp_plan`)
    inp: PlanInput
    # the 1-D strategies predicted (`planned_strategies`)
    names: list[str]
    # every row at its split of the global batch, the layout asked for among them
    rows: list[Candidate]
    # the choice (`choose`, or the layout asked for where it fits); where nothing fits, the nearest
    best: Candidate
    # the rows by `rank_key`
    ranked: list[Candidate]
    # why the layout asked for was not predicted ('' where it was, or none was asked)
    unpredicted: str
    # what --strategy auto runs after an out-of-memory
    fallbacks: list[Candidate] = field(default_factory=list)


def search(inp: PlanInput) -> Search:
    """Predict every layout (`estimate`, `estimate_layout`), each at its split of the global batch
    (`split_batch`), and choose one (`choose`; the layout a run asks for where it fits and runs): the
    Plan's numbers, its flags and its fallbacks. Raises UserError on input no layout can take."""
    problems = []
    if inp.gpus_per_node < 1 or inp.nodes < 1:
        problems.append("--gpus-per-node and --nodes must be >= 1")
    if inp.seq_len < 1 or inp.micro_batch < 1 or inp.grad_accum < 1:
        problems.append("--seq-len, --micro-batch-size and --grad-accum must be >= 1")
    if inp.global_batch is not None and inp.global_batch < 1:
        problems.append(f"--global-batch must be >= 1 (got {inp.global_batch})")
    if inp.method not in ("full", "lora", "qlora"):
        problems.append(f"--method must be full, lora or qlora (got {inp.method})")
    if problems:
        raise UserError("; ".join(problems))
    world = inp.gpus_per_node * inp.nodes
    # --tp may be planned: the run's rules read the config class's TP plan (`with_tp_plan`)
    if world > 1:
        inp = replace(inp, model=with_tp_plan(inp.model))
    for t in inp.tp or []:
        check_tp(inp.model, t, inp.gpus_per_node, world)
    for p in inp.pp or []:
        if p < 2 or p > inp.model["num_hidden_layers"] or world % p:
            raise UserError(f"--pp {p}: needs 2 <= stages <= blocks ({inp.model['num_hidden_layers']}) and "
                            f"to divide the world size ({world})")
    for c in inp.cp or []:
        check_cp(inp.model, c, world)
    for e in inp.ep or []:
        check_ep(inp.model, e, world)
    names = planned_strategies(inp)
    gc_options = [inp.checkpointing] if inp.checkpointing is not None else [False, True]
    rows = [estimate(inp, STRATEGIES[n], gc, inp.micro_batch) for gc in gc_options for n in names]
    layouts = [] if inp.method == "qlora" else mesh_layouts(inp.model, world, inp.gpus_per_node, inp.tp, inp.pp, inp.cp,
                                                             inp.ep)
    rows += [estimate_layout(inp, d, gc, inp.micro_batch) for gc in gc_options for d in layouts]
    target = target_batch(inp)
    rows = [split_batch(inp, r, target) for r in rows]
    asked, unpredicted = asked_candidate(inp) if inp.asked else (None, "")
    # the search's row of the same layout at the same split is this one
    if asked is not None:
        same = (asked.name, asked.dims, asked.checkpointing, asked.micro_batch, asked.grad_accum)
        rows = [r for r in rows if (r.name, r.dims, r.checkpointing, r.micro_batch, r.grad_accum) != same] + [asked]
    counts = count_params(inp.model)
    trainable = counts.total if inp.method == "full" else lora_params(inp.model, inp.lora_r, inp.lora_targets)
    result = Plan(counts.total, trainable, world, rows, None, gpu_memory=inp.gpu_memory, cpu_memory=inp.cpu_memory,
                  hardware=inp.hw.name, global_batch=target, asked=asked, device=inp.device,
                  trainable_parts=trainable_parts(inp.model, inp.method, inp.lora_r, inp.lora_targets),
                  cpu_memory_unknown=inp.cpu_memory_unknown)
    best = choose([r for r in rows if r is not asked], target)
    if asked is not None and asked.fits and asked.runnable:
        best = asked
    ranked = sorted(rows, key=lambda c: rank_key(c, target))
    if not (best.fits and best.runnable):
        return Search(result, inp, names, rows, best, ranked, unpredicted)
    result.chosen, result.chosen_detail, result.grad_accum = best.name, best, best.grad_accum
    if best.dims is None:
        result.flags = flags_for(best.name, best.checkpointing, best.micro_batch, result.grad_accum, inp.method)
    else:
        result.flags = (["--method", inp.method] + mesh_flags(ParallelDims(world, **best.dims), best.micro_batch)
                        + (["--gradient-checkpointing"] if best.checkpointing else [])
                        + ["--micro-batch-size", str(best.micro_batch), "--grad-accum", str(result.grad_accum)])
    return Search(result, inp, names, rows, best, ranked, unpredicted, fallbacks(inp, best, rows, target))
