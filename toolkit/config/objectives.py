"""What `--objective` may be, its defaults and what it cannot run with: read by the config's checks
(`toolkit.config.checks`), the data (`toolkit.data.pairs`), the loss (`toolkit.objectives.preference.loss`) and the
planner, so a leaf below them all."""

from __future__ import annotations

from dataclasses import dataclass

OBJECTIVES = ("sft", "dpo", "orpo", "simpo", "kto", "grpo")
# objectives that sample from the policy in the loop (online RL): `Strategy.generating` gives the model, and
# `toolkit.layout.rules.generation_problems` says which layouts cannot sample yet
GENERATES = ("grpo",)


@dataclass(frozen=True)
class Example:
    """What one example of an objective is, said once for the layers below the objectives: the form its
    records take (`toolkit.data`: conversations or text to train on, pairs of completions, single completions
    labelled desirable or not, prompts to sample from), its sequences (each up to --seq-len tokens: a pair's
    two, prompt + chosen and prompt + rejected), and what it is called."""
    form: str
    sequences: int
    unit: str


EXAMPLES = {"sft": Example("conversations", 1, "examples"), "dpo": Example("pairs", 2, "pairs"),
            "orpo": Example("pairs", 2, "pairs"), "simpo": Example("pairs", 2, "pairs"),
            "kto": Example("labelled", 1, "examples"), "grpo": Example("prompts", 1, "completions")}


def form(objective: str) -> str:
    """The form `objective`'s records take (`Example.form`)."""
    return EXAMPLES[objective].form


def generates(objective: str) -> bool:
    """Whether `objective` samples from the policy while it trains."""
    return objective in GENERATES

# beta: TRL's DPOConfig, ORPOConfig and KTOConfig defaults; SimPO's from its authors' repository (princeton-nlp/SimPO,
# beta 2.0 and gamma_beta_ratio 0.5: the margin gamma 1.0). TRL's CPOConfig would give SimPO 0.1 and 0.5.
# grpo's: the KL coefficient
DEFAULT_BETA = {"dpo": 0.1, "orpo": 0.1, "simpo": 2.0, "kto": 0.1, "grpo": 0.0}
DEFAULT_SIMPO_GAMMA = 1.0
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           # TRL's names, each a mean over pairs
           "logps/rejected")
# KTO's (TRL's KTOTrainer): means over the desirable (chosen) and the undesirable (rejected) completions,
# margins their difference, and the KL estimate the step used
KTO_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected", "kl")

# a preference micro-batch's keys that are not sliced with its sequences (context parallel): per example, or
# KTO's KL sequences (its estimate runs on whole sequences)
WHOLE = ("pairs", "ref_logps", "desirable", "ref_kl_logps", "kl_input_ids", "kl_attention_mask", "kl_labels")


def rl_flags_given(cfg) -> list[str]:
    """The --objective grpo settings (the config's `rl` section) set away from their defaults, as flags."""
    from dataclasses import fields

    return [f"--{f.name.replace('_', '-')}" for f in fields(cfg.rl) if getattr(cfg.rl, f.name) != f.default]


def objective_problems(cfg) -> list[str]:
    """What an objective cannot run with (one line each; none for plain sft)."""
    t, d, par = cfg.train, cfg.data, cfg.parallel
    rl = rl_flags_given(cfg)
    if t.objective != "grpo" and rl:
        return [f"{', '.join(rl)} set --objective grpo's generation, rewards or loss; pass --objective grpo or "
                "drop them"]
    if t.objective == "sft":
        given = [f for f, v in (("--beta", t.beta is not None), ("--label-smoothing", t.label_smoothing != 0.0),
                                ("--simpo-gamma", t.simpo_gamma != DEFAULT_SIMPO_GAMMA),
                                ("--desirable-weight", t.desirable_weight != 1.0),
                                ("--undesirable-weight", t.undesirable_weight != 1.0)) if v]
        return [f"{', '.join(given)} set a preference objective's loss; pass --objective dpo (or orpo, simpo, kto) "
                "or drop them"] if given else []
    if t.objective == "grpo":
        return grpo_problems(cfg)
    p, o = [], f"--objective {t.objective}"
    if t.beta is not None and not t.beta > 0:
        p.append(f"--beta must be > 0 (got {t.beta})")
    if not 0.0 <= t.label_smoothing < 0.5:
        p.append(f"--label-smoothing must be in [0, 0.5) (got {t.label_smoothing})")
    if t.objective in ("orpo", "kto") and t.label_smoothing:
        p.append(f"--label-smoothing applies to dpo and simpo, not {t.objective}; drop it")
    for flag, weight in (("--desirable-weight", t.desirable_weight), ("--undesirable-weight", t.undesirable_weight)):
        if t.objective != "kto" and weight != 1.0:
            p.append(f"{flag} applies to kto, not {t.objective}; drop it")
        elif not weight > 0:
            p.append(f"{flag} must be > 0 (got {weight})")
    if t.objective != "simpo" and t.simpo_gamma != DEFAULT_SIMPO_GAMMA:
        p.append(f"--simpo-gamma applies to simpo, not {t.objective}; drop it")
    if d.train_on_prompt:
        p.append(f"{o} trains on the completions of the pairs; drop --train-on-prompt")
    if d.format != "auto":
        p.append(f"{o}: pairs are read by their columns (prompt, chosen, rejected, ...); drop --format {d.format}")
    if t.loss not in ("auto", "full"):
        p.append(f"{o} takes each sequence's log-probability from full logits; --loss {t.loss} computes only "
                 "their summed loss: use --loss auto (or full)")
    if t.objective in ("orpo", "kto") and d.packing:
        why = "its NLL reads each chosen sequence's prompt" if t.objective == "orpo" else \
            "its KL estimate's sequences are not packed"
        p.append(f"--objective {t.objective} does not run with --packing yet ({why}); drop --packing, or use dpo "
                 "or simpo")
    if par.cp > 1 and d.packing:
        p.append(f"--cp {par.cp} with --packing does not run yet for {o} (a slice holds no whole documents); "
                 "drop one")
    if d.streaming:
        p.append(f"{o} does not run with --streaming yet (pairs are whole sequences on one rank); drop --streaming")
    if par.pp > 1 and d.packing:
        p.append(f"{o} does not run with --pp and --packing together yet (the last stage scores whole rows); "
                 "drop one")
    return p


def grpo_problems(cfg) -> list[str]:
    """What --objective grpo cannot run with, and its settings' ranges (one line each)."""
    t, d, rl = cfg.train, cfg.data, cfg.rl
    p, o = [], "--objective grpo"
    specs = [s for s in rl.reward.splitlines() if s.strip()]
    environments = [s for s in rl.environment.splitlines() if s.strip()]
    # an environment may own the reward (its get_reward: found when it loads)
    if not specs and not environments:
        p.append(f"{o} needs at least one --reward: builtin:math_answer (the last number against the answer "
                 "column), builtin:regex:PATTERN, or path.py:function (TRL's signature)")
    for spec in specs:
        p += reward_problems(spec)
    for spec in (s for s in rl.tools.splitlines() if s.strip()):
        file, _, names = spec.rpartition(":")
        for name in (n.strip() for n in names.split(",") if n.strip()):
            p += [x.replace("--reward", "--tools", 1) for x in reward_problems(f"{file}:{name}")]
    for spec in environments:
        named, eq, rest = spec.partition("=")
        p += [x.replace("--reward", "--environment", 1)
              for x in reward_problems(rest if eq and ":" not in named and "/" not in named else spec)]
    if rl.dynamic_sampling_rounds < 0:
        p.append("--dynamic-sampling-rounds must be >= 0")
    if rl.max_tool_calls < 1:
        p.append("--max-tool-calls must be >= 1")
    if not rl.tool_timeout > 0:
        p.append("--tool-timeout must be > 0 (seconds)")
    p += group_problems(cfg)
    weights = [w for w in rl.reward_weights.split(",") if w.strip()]
    if weights:
        try:
            values = [float(w) for w in weights]
        except ValueError:
            values = None
            p.append(f"--reward-weights {rl.reward_weights}: numbers, comma-separated, one per --reward")
        if values is not None and specs and len(values) != len(specs):
            p.append(f"--reward-weights gives {len(values)} weight(s) for {len(specs)} --reward function(s); give "
                     "one per function")
    for flag, ok, want in (("--num-generations", rl.num_generations >= 2, ">= 2 (a group of one has no baseline: its "
                                                                          "advantage is always 0)"),
                           ("--max-completion-length", rl.max_completion_length >= 1, ">= 1"),
                           ("--temperature", rl.temperature > 0, "> 0 (sampling; greedy completions would all agree)"),
                           ("--top-p", 0 < rl.top_p <= 1, "in (0, 1]"), ("--top-k", rl.top_k >= 0, ">= 0 (0 = off)"),
                           ("--epsilon", rl.epsilon > 0, "> 0"),
                           ("--epsilon-high", rl.epsilon_high is None or rl.epsilon_high > 0, "> 0"),
                           ("--steps-per-generation", rl.steps_per_generation >= 1, ">= 1"),
                           ("--num-iterations", rl.num_iterations >= 1, ">= 1"),
                           ("--overlong-buffer", 0 <= rl.overlong_buffer < rl.max_completion_length,
                            f">= 0 and below --max-completion-length {rl.max_completion_length}"),
                           ("--overlong-penalty", rl.overlong_penalty >= 0, ">= 0"),
                           ("--log-completions-every", rl.log_completions_every >= 0, ">= 0 (0 = at each metrics "
                                                                                       "record)"),
                           ("--beta", t.beta is None or t.beta >= 0, ">= 0 (grpo's KL coefficient; 0 = off)")):
        if not ok:
            p.append(f"{flag} must be {want}")
    prefs = [f for f, v in (("--label-smoothing", t.label_smoothing != 0.0),
                            ("--simpo-gamma", t.simpo_gamma != DEFAULT_SIMPO_GAMMA),
                            ("--desirable-weight", t.desirable_weight != 1.0),
                            ("--undesirable-weight", t.undesirable_weight != 1.0)) if v]
    if prefs:
        p.append(f"{', '.join(prefs)} set a preference objective's loss, not grpo's; drop them")
    if d.train_on_prompt:
        p.append(f"{o} trains on the sampled completions; drop --train-on-prompt")
    if d.format != "auto":
        p.append(f"{o}: prompts are read by their columns (prompt, or instruction and input); drop --format {d.format}")
    if t.loss not in ("auto", "full"):
        p.append(f"{o} takes each token's log-probability from the logits; --loss {t.loss} computes only their "
                 "summed loss: use --loss auto (or full)")
    for flag, on in (("--packing", d.packing), ("--streaming", d.streaming)):
        if on:
            p.append(f"{o} does not run with {flag} yet (each step's completions are sampled, not read); drop it")
    # the layouts it cannot sample on yet (--pp, --cp): `toolkit.layout.rules.generation_problems`
    return p


def extra_forwards(objective: str, method: str) -> int:
    """Forwards without gradients per trained sequence, beside its own (the time model's and MFU's): LoRA
    DPO's and KTO's reference (the base, adapters disabled); KTO's KL estimate, one sequence per example
    under the policy and, with LoRA, again under the reference (a full finetune's are computed once)."""
    reference = objective in ("dpo", "kto") and method != "full"
    return int(reference) + (1 + int(reference) if objective == "kto" else 0)


def plan_terms(objective: str, method: str, loss: str, cfg=None) -> dict:
    """What an objective changes in the planner's question (`toolkit.planner.estimate.PlanInput`): a pair is
    two sequences with full logits (KTO's example one); `extra_forwards` no-grad forwards per sequence.
    --objective grpo (`cfg`: the run's config, for its settings): a sequence is a prompt and its completion
    (--seq-len bounds the prompt), full logits over the completion; the old policy's forward where the policy
    moves within a round, the reference's where beta > 0; sampling's peak (`generation`: a step's share of
    completions at once, over prompt and completion)."""
    if objective == "grpo":
        rl, t = cfg.rl, cfg.train
        tokens = cfg.data.seq_len + rl.max_completion_length
        forwards = int(rl.steps_per_generation * rl.num_iterations > 1) + int((t.beta or 0) > 0)
        return {"sequences": 1, "extra_forwards": forwards, "loss": "full", "seq_len": tokens,
                "generation": (t.micro_batch_size * t.grad_accum, tokens)}
    preference = objective != "sft"
    return {"sequences": 2 if preference and objective != "kto" else 1,
            "extra_forwards": extra_forwards(objective, method), "loss": "full" if preference else loss}


BUILTIN_REWARDS = ("math_answer", "regex")


def reward_problems(spec: str) -> list[str]:
    """A `--reward` that cannot load, found without running anything (the config's check, before torch is
    imported): a built-in that does not exist or a pattern that does not compile, a file that is not there or
    does not parse, a function it does not define at its top level. What only running the file tells (an import
    inside it that fails) is said when the objective loads it (`toolkit.objectives.grpo.rewards.load_reward`)."""
    import ast
    import re
    from pathlib import Path

    if spec.startswith("builtin:"):
        kind, _, arg = spec.removeprefix("builtin:").partition(":")
        if kind == "regex" and arg:
            try:
                re.compile(arg)
            except re.error as e:
                return [f"--reward {spec}: not a regular expression: {e}"]
            return []
        if kind == "math_answer" and not arg:
            return []
        return [f"--reward {spec}: no such built-in; the built-ins are builtin:math_answer and builtin:regex:PATTERN"]
    file, sep, name = spec.rpartition(":")
    if not sep or not file or not name:
        return [f"--reward {spec}: write path.py:function or builtin:math_answer or builtin:regex:PATTERN"]
    path = Path(file)
    if not path.is_file():
        return [f"--reward {spec}: no file {path}"]
    try:
        tree = ast.parse(path.read_bytes(), str(path))
    except (SyntaxError, ValueError) as e:
        return [f"--reward {spec}: {path} is not Python that parses ({type(e).__name__}: {e})"]
    defined, functions, star = set(), [], False
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
            functions += [node.name] if not node.name.startswith("_") and not isinstance(node, ast.ClassDef) else []
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            star |= any(a.name == "*" for a in node.names)
            defined.update((a.asname or a.name).split(".")[0] for a in node.names)
        else:
            defined.update(n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store))
    # a star import, or a name made at run time (globals()), is left for the load to find
    if name in defined or star or "globals" in {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}:
        return []
    return [f"--reward {spec}: {path} has no {name!r} (its functions: {', '.join(sorted(functions)) or 'none'})"]


def group_problems(cfg) -> list[str]:
    """A global batch that holds no whole number of prompt groups, where the world's data-parallel degree is
    known before the launch (the launcher's WORLD_SIZE, or --nproc-per-node): the global batch is micro-batch
    x accumulation x data-parallel ranks completions, each group --num-generations of them. The strategy checks
    it again on the world it is built for."""
    import os

    t, par, rl = cfg.train, cfg.parallel, cfg.rl
    if par.strategy == "auto" or rl.num_generations < 1:
        return []
    world = int(os.environ.get("WORLD_SIZE") or par.nproc_per_node or 1)
    model_parallel = max(1, par.tp) * max(1, par.pp) * max(1, par.cp)
    if world % model_parallel:
        return []
    problem = groups_problem(t.micro_batch_size, t.grad_accum, world // model_parallel, rl.num_generations)
    return [problem] if problem else []


def groups_problem(micro_batch: int, accumulation: int, ranks: int, generations: int) -> str | None:
    """The global batch's completions against --num-generations: whole prompt groups, or one line."""
    completions = micro_batch * accumulation * ranks
    if completions % generations == 0:
        return None
    return (f"--objective grpo: the global batch ({micro_batch} micro-batch x {accumulation} accumulation x {ranks} "
            f"data-parallel rank(s) = {completions} completions) is not a multiple of --num-generations {generations}: "
            "a step trains whole prompt groups; change one of them")
