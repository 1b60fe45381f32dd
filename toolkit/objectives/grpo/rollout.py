"""`--objective grpo`'s generation rounds: prompts -> sampled completions -> rewards -> group advantages ->
the micro-batches of the next steps, which the loop trains as it trains read data (`Rollouts` is its
`toolkit.objectives.base.Batches`, as `toolkit.data.loader.global_batches` is SFT's).

A step's global batch holds `micro-batch x accumulation x data-parallel ranks` completions: P prompts of the
epoch's seeded permutation, G (`--num-generations`) each, in (prompt, generation) order. Every rank reads the
same prompts and samples only the completions it trains: its contiguous share of that order, cut into its
micro-batches. So no completion crosses ranks; the rewards do (every rank's, gathered: a prompt's group may
span ranks, and `--scale-rewards batch` needs them all). A round samples `--steps-per-generation` steps'
prompts at once and serves them `--num-iterations` times; the policy's log-probabilities at sampling (the
ratio's old ones, where the policy moves before a later use) and the reference's (beta > 0) are computed
then, once.

Each completion draws from its own generator, seeded from (seed, the step that first trains it, the prompt's
row, its generation index) (`toolkit.objectives.grpo.sampling.completion_seed`): one process and N ranks sample the same
completions, so every layout is compared with one process, as SFT's global batch is.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable

import torch

from toolkit.data.images import MEDIA
from toolkit.errors import UserError
from toolkit.objectives.base import Interrupted


@dataclass
class RoundMetrics:
    """What the rounds since the last metrics record measured, over the global batch (every rank alike)."""
    rewards: list[float] = field(default_factory=list)  # each completion's weighted reward (NaN: unscored)
    per_function: dict[str, list[float]] = field(default_factory=dict)
    zero_std: list[float] = field(default_factory=list)  # 1 where the completion's group agreed
    lengths: list[int] = field(default_factory=list)
    truncated: list[bool] = field(default_factory=list)
    generated_tokens: int = 0  # this rank's
    generate_s: float = 0.0
    score_s: float = 0.0
    # with tools, every rank's: calls per completion, turns per completion, and the faults' counts
    tool_calls: list[int] = field(default_factory=list)
    turns: list[int] = field(default_factory=list)
    tool_faults: dict[str, int] = field(default_factory=dict)
    # --dynamic-sampling: groups dropped (their rewards agreed), sampling rounds per step, groups filled past the cap
    dropped_groups: int = 0
    sampling_rounds: list[int] = field(default_factory=list)
    filled_groups: int = 0

    def values(self) -> dict[str, float]:
        """TRL's names: the reward's mean and std, each function's mean, the share of groups without signal,
        completion lengths, the truncated share; generation tokens/s (this rank's); the round's seconds."""
        def mean(xs):
            kept = [x for x in xs if not math.isnan(x)]
            return sum(kept) / len(kept) if kept else float("nan")

        def std(xs):
            kept = [x for x in xs if not math.isnan(x)]
            m = mean(kept)
            return math.sqrt(sum((x - m) ** 2 for x in kept) / (len(kept) - 1)) if len(kept) > 1 else 0.0

        out = {"reward": mean(self.rewards), "reward_std": std(self.rewards),
               **{f"rewards/{name}/mean": mean(v) for name, v in self.per_function.items()},
               "frac_reward_zero_std": mean(self.zero_std),
               "completions/mean_length": mean([float(n) for n in self.lengths]),
               "completions/min_length": float(min(self.lengths)), "completions/max_length": float(max(self.lengths)),
               "completions/clipped_ratio": mean([float(t) for t in self.truncated]),
               "time/generate_s": self.generate_s, "time/score_s": self.score_s}
        if self.generate_s > 0:
            out["generation_tokens_per_sec"] = self.generated_tokens / self.generate_s
        if self.turns:  # TRL's names where it has them
            calls = sum(self.tool_calls)
            out["tools/call_frequency"] = calls / len(self.tool_calls)
            out["tools/failure_frequency"] = self.tool_faults.get("failures", 0) / calls if calls else 0.0
            out["tools/timeouts"] = float(self.tool_faults.get("timeouts", 0))
            out["tools/malformed"] = float(self.tool_faults.get("malformed", 0))
            out["turns/mean"] = mean([float(n) for n in self.turns])
        if self.sampling_rounds:
            out["dynamic_sampling/dropped_groups"] = float(self.dropped_groups)
            out["dynamic_sampling/rounds"] = mean([float(n) for n in self.sampling_rounds])
            out["dynamic_sampling/filled_groups"] = float(self.filled_groups)
        return out


# steps in a row whose groups all agreed before a run says it is learning nothing
NO_SIGNAL_STEPS = 3


def unfinished_anywhere(run, unfinished: torch.Tensor, doing: str) -> bool:
    """Whether any row of any rank still samples (under FSDP, ZeRO-3, TP and EP every forward is collective, so
    every rank decodes as many steps), asked together with whether any rank was asked to stop, in one host
    all-reduce: every rank abandons the sampling at the same token (`Interrupted`). `run`: the run's `Context`."""
    state = float(bool(unfinished.any())) + 2.0 * float(run.stop_requested())
    state = run.strategy.host_max(state)
    if state >= 2:
        raise Interrupted(doing)
    return state > 0


def eos_ids(tokenizer, model) -> list[int]:
    """The ids that end a completion: the tokenizer's EOS and the generation config's (TRL's list)."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    config = getattr(model, "generation_config", None)
    extra = getattr(config, "eos_token_id", None)
    ids.update(extra if isinstance(extra, (list, tuple)) else [extra] if extra is not None else [])
    return sorted(i for i in ids if i is not None)


def suppressed(prompts) -> tuple[int, ...]:
    """The ids sampling never draws for `prompts` (`SamplingConfig.suppress`): an image-text model's image token, and
    every id its processor counts as an image's (`image_token_ids`: Gemma 3's soft tokens, where its `image_token_id`
    is the begin-of-image mark)."""
    from toolkit.data.images import image_token_id

    processor = getattr(prompts, "processor", None)
    if processor is None:
        return ()
    ids = {image_token_id(processor), *(getattr(processor, "image_token_ids", None) or ())}
    return tuple(sorted(i for i in ids if i is not None))


def completion_texts(tokenizer, completions) -> list[str]:
    """Each completion's text as a string prompt's reward functions get it: with tools, the model's own tokens alone
    (a tool's result is not the model's answer: `builtin:math_answer` would read the calculator's number)."""
    ids = completions.token_lists()
    if completions.tool_mask is None:
        return tokenizer.batch_decode(ids, skip_special_tokens=True)
    own = [[t for t, m in zip(row, keep.tolist()) if m] for row, keep in zip(ids, completions.tool_mask.cpu())]
    return tokenizer.batch_decode(own, skip_special_tokens=True)


def collate_rollout(prompt_ids: list[list[int]], completion_ids: torch.Tensor, completion_mask: torch.Tensor,
                    pad_id: int, device, tool_mask: torch.Tensor | None = None) -> dict:
    """A micro-batch of (prompt, completion) rows: prompts left-padded so every completion starts at one
    column, completions right-padded to the longest (C); the positions each row's forward takes (from its
    first real token, as sampling gave them), and the labels on completion tokens (the loop's token counts).
    `tool_mask`: 0 on tool results' tokens, which are attended to but are not the loss's: `completion_mask`
    is then TRL's completion_mask x tool_mask (the loss, the ratio and its metrics read it alone)."""
    from toolkit.objectives.grpo.sampling import left_pad

    width = int(completion_mask.sum(1).max().clamp(min=1))
    completion, mask = completion_ids[:, :width], completion_mask[:, :width]
    prompt, prompt_mask = left_pad(prompt_ids, pad_id)
    ids = torch.cat([prompt, completion.cpu()], 1)
    attention = torch.cat([prompt_mask, mask.cpu()], 1)
    loss_mask = mask if tool_mask is None else mask * tool_mask[:, :width].to(mask.device)
    labels = torch.where(torch.cat([torch.zeros_like(prompt_mask), loss_mask.cpu()], 1).bool(), ids, -100)
    return {"input_ids": ids.to(device), "attention_mask": attention.to(device),
            "positions": (attention.cumsum(-1) - 1).clamp(min=0).to(device), "labels": labels.to(device),
            "completion_ids": completion.to(device), "completion_mask": loss_mask.to(device)}


def steps_per_epoch(cfg, prompts: int, data_ranks: int) -> int:
    """Optimizer steps an epoch of `prompts` makes (`Rollouts.steps_per_epoch`, before the rollouts exist)."""
    per_step = cfg.train.micro_batch_size * cfg.train.grad_accum * data_ranks
    return prompts // max(1, per_step // cfg.rl.num_generations) * cfg.rl.num_iterations


class Rollouts:
    """The loop's batches under --objective grpo: (epoch, this rank's micro-batches) per optimizer step,
    sampled a round at a time. `run`: the run's `toolkit.objectives.base.Context`; `objective`: its `GRPOLoss`
    (the reward functions, the old and reference log-probabilities); a round's seconds are handed back
    (`take_seconds`) to be kept out of the step's tokens/s, as eval's are."""

    def __init__(self, run, prompts, objective, reference_model=None, toolbox=None):
        from toolkit.objectives.grpo.sampling import SamplingConfig, decoder_for

        cfg, t = run.cfg, run.cfg.train
        self.run, self.prompts, self.reference_model = run, prompts, reference_model
        self.objective, self.rewards = objective, objective.rewards
        weights = [r.weight for r in self.rewards]
        self.spec = self.objective.spec
        self.weights = torch.tensor(weights, dtype=torch.float64)
        self.data = run.strategy.data
        self.per_step = t.micro_batch_size * t.grad_accum * self.data.ranks  # completions in a global batch
        self.G = cfg.rl.num_generations
        self.P = self.per_step // self.G  # prompts a step
        self.per_epoch = len(prompts) // self.P  # prompt batches an epoch (its last, short one is not sampled)
        if self.per_epoch == 0:
            raise UserError(f"--objective grpo: {len(prompts)} training prompt(s), fewer than the {self.P} a step "
                            f"samples from (global batch {self.per_step} completions / --num-generations {self.G}); "
                            "lower --micro-batch-size or --grad-accum, or give more prompts")
        self.K, self.mu = self.spec.steps_per_generation, self.spec.num_iterations
        self.sampling = SamplingConfig(cfg.rl.max_completion_length, cfg.rl.temperature, cfg.rl.top_k, cfg.rl.top_p,
                                       suppress=suppressed(prompts))
        # the decode path (`toolkit.objectives.grpo.sampling.decoder_for`: a static cache and a compiled step on
        # CUDA), kept for the run, and the line that names it in the run's log
        self.decoder, self.decode_line = decoder_for(run.strategy.unwrap(run.model))
        if prompts.processor is not None and self.decoder is not None:
            # the prompts' forward takes their images, which the static path's compiled step does not
            self.decoder, self.decode_line = None, "decode: dynamic KV cache, eager steps (image prompts)"
        self.toolbox = toolbox  # `toolkit.objectives.grpo.turns.Toolbox`: --tools, --environment
        if toolbox is not None and self.decoder is not None:
            # a turn after tool results has a budget of its own per row, which the static path does not take
            self.decoder, self.decode_line = None, "decode: dynamic KV cache, eager steps (multi-turn with tools)"
        if self.decoder is not None:  # one cache length for every round: the longest prompt's
            self.decoder.reserve = max(len(p) for p in prompts.prompt_ids) + self.sampling.max_completion_length
        self.pending: list[tuple[int, list[dict]]] = []
        self.step = 1  # the optimizer step the next batch serves
        # --dynamic-sampling (`toolkit.objectives.grpo.dynamic`): the next prompt batch to sample, kept in checkpoints
        self.dynamic, self.dynamic_rounds = cfg.rl.dynamic_sampling, cfg.rl.dynamic_sampling_rounds
        self.cursor, self.said_filled = 0, False
        self.metrics = RoundMetrics()
        self.seconds = 0.0  # the rounds' since the last `take_seconds`
        self.no_signal, self.said_no_signal, self.said_unscored = 0, False, set()  # `say_if_nothing_is_learned`

    def steps_per_epoch(self) -> int:
        """Optimizer steps an epoch of prompts makes: each prompt batch trained --num-iterations times."""
        return self.per_epoch * self.mu

    def start_at(self, step: int) -> None:
        """Resume at `step` (a round boundary, or the round's state restored with `load_state_dict`)."""
        self.step = step
        self.cursor = (step - 1) // (self.K * self.mu) * self.K  # without the filter; a checkpoint's own otherwise

    def __iter__(self):
        return self

    def __next__(self) -> tuple[int, list[dict]]:
        if not self.pending:
            self.pending = self.round(self.step)
        self.step += 1
        return self.pending.pop(0)

    # --- one round
    def round(self, first: int) -> list[tuple[int, list[dict]]]:
        """The micro-batches of the K x mu steps from `first`: K prompt batches sampled, scored and turned into
        advantages (and old and reference log-probabilities where needed)."""
        if self.dynamic:
            from toolkit.objectives.grpo.dynamic import dynamic_round

            return dynamic_round(self, first)
        start = (first - 1) // (self.K * self.mu) * self.K  # the round's first prompt batch (0-based)
        batches = [start + k for k in range(self.K)]
        t0 = time.perf_counter()
        rows, prompt_ids, seeds, steps = self.rows_of(batches, first)
        envs, tools = None, None
        if self.toolbox is not None:  # each rollout's environment, reset, and its prompt with its tools' schemas
            self.toolbox.begin_round()
            prompt_ids, envs, tools = self.toolbox.open(self.prompts, rows)
        completions, trajectories = self.sample(prompt_ids, seeds, rows, tools)
        generated = time.perf_counter()
        texts, rewards = self.score(rows, completions, first, trajectories, envs)
        scored = time.perf_counter()
        advantages = self.advantages(rewards, len(batches))
        out = self.micro_batches(batches, rows, prompt_ids, completions, advantages)
        self.metrics.generate_s += generated - t0
        self.metrics.score_s += scored - generated
        self.metrics.generated_tokens += int(completions.mask.sum() if completions.tool_mask is None else
                                             (completions.mask * completions.tool_mask).sum())
        self.log_samples(first, rows, trajectories or texts, rewards)
        self.seconds += time.perf_counter() - t0
        return [(self.epoch_of(b), micro) for _ in range(self.mu) for b, micro in zip(batches, out)]

    def epoch_of(self, batch: int) -> int:
        return batch // self.per_epoch

    def prompt_rows(self, batch: int) -> list[int]:
        """The P prompt rows of prompt batch `batch`: its epoch's seeded permutation (as SFT's sampler)."""
        epoch, k = divmod(batch, self.per_epoch)
        g = torch.Generator().manual_seed(self.run.cfg.train.seed + epoch)
        order = torch.randperm(len(self.prompts), generator=g).tolist()
        return order[k * self.P:(k + 1) * self.P]

    def mine(self) -> range:
        """This rank's share of a step's completions, as indices into its (prompt, generation) order."""
        share = self.per_step // self.data.ranks
        return range(self.data.rank * share, (self.data.rank + 1) * share)

    def rows_of(self, batches: list[int], first: int):
        """(this rank's completions' prompt rows, their prompt ids, their seeds, the step of each), the
        round's prompt batches in order."""
        from toolkit.objectives.grpo.sampling import completion_seed

        rows, ids, seeds, steps = [], [], [], []
        for k, batch in enumerate(batches):
            step = first + k  # the step that first trains it: its seed's
            prompt_rows = self.prompt_rows(batch)
            for j in self.mine():
                row, g = prompt_rows[j // self.G], j % self.G
                rows.append(row)
                ids.append(self.prompts.prompt_ids[row])
                seeds.append(completion_seed(self.run.cfg.train.seed, step, row, g))
                steps.append(step)
        return rows, ids, seeds, steps

    def unfinished_or_stop(self, unfinished: torch.Tensor) -> bool:
        """`sample`'s `any_unfinished` for this round (`unfinished_anywhere`), and the fault-injection point
        "sampling" of the tests that stop a run mid-round."""
        if self.run.fault is not None:
            self.run.fault("sampling", self.step)
        return unfinished_anywhere(self.run, unfinished, f"sampling step {self.step}")

    def sample(self, prompt_ids: list[list[int]], seeds: list[int], rows: list[int], tools: list[dict] | None = None):
        """(this rank's completions, their trajectories with tools, else None), a step's share at a time, from the
        policy as the layout gives it for generating (its parameters gathered once: `Strategy.generating`);
        `rows`: their prompts' rows (their images, for an image-text model); `tools`: each rollout's tools by name
        (`toolkit.objectives.grpo.turns.run_turns`)."""
        from toolkit.objectives.grpo.sampling import sample
        from toolkit.objectives.grpo.turns import run_turns

        run = self.run
        strategy = run.strategy
        tok = run.tokenizer
        share = self.per_step // self.data.ranks
        parts, trajectories = [], []
        with strategy.generating(run.model) as model:
            ends = eos_ids(tok, model)

            def generate(ids, seeds, limits=None, media=None):
                return sample(model, ids, seeds, self.sampling, ends, tok.pad_token_id,
                              any_unfinished=self.unfinished_or_stop, decoder=self.decoder, media=media, limits=limits)

            for i in range(0, len(prompt_ids), share):
                mine = slice(i, i + share)
                part = generate(prompt_ids[mine], seeds[mine], media=self.prompts.media(rows[mine]))
                if tools is not None:
                    part, paths = run_turns(self.toolbox, part, prompt_ids[i:i + share], seeds[i:i + share],
                                            tools[i:i + share], generate,
                                            lambda going: strategy.host_max(float(going)) > 0, tok.pad_token_id)
                    trajectories += paths
                parts.append(part)
        return joined(parts, tok.pad_token_id), trajectories if tools is not None else None

    def score(self, rows: list[int], completions, first: int, trajectories: list[list[dict]] | None = None,
              environments: list | None = None) -> tuple[list[str], torch.Tensor]:
        """(this rank's completions as text, every rank's rewards (round completions, functions): NaN where a
        function left one out), gathered in the round's (step, prompt, generation) order. With tools, a
        conversational prompt's completion is its trajectory (TRL's), and `environments` the rollouts'."""
        from toolkit.objectives.grpo.rewards import RewardState, completions_for, score

        tok = self.run.tokenizer
        ids = completions.token_lists()
        texts = completion_texts(tok, completions)
        prompts = [self.prompts.prompts[r] for r in rows]
        state = RewardState(first, self.run.total_steps, (first - 1) / self.steps_per_epoch())
        columns = self.prompts.columns_of(rows)
        if environments is not None and any(e is not None for e in environments):
            columns["environments"] = environments
        scores = scored_unless_stopped(self.run, f"scoring step {self.step}", score, self.rewards, prompts,
                                       completions_for(prompts, texts, trajectories), ids, columns, self.G, rows,
                                       state)
        # TRL's lengths: the model's tokens (tool results left out)
        lengths = [len(x) for x in ids] if completions.tool_mask is None else \
            [int(n) for n in (completions.mask * completions.tool_mask).sum(1).tolist()]
        if self.toolbox is not None:
            self.count_tools()
        mine = (self.data.rank, scores.rewards, lengths, completions.truncated.tolist())
        # model-parallel peers hold the same share
        every = {r: (s, n, t) for r, s, n, t in self.run.strategy.gather_objects(mine)}
        share, K = self.per_step // self.data.ranks, len(rows) // (self.per_step // self.data.ranks)
        ordered_rewards, ordered_lengths, ordered_truncated = [], [], []
        for k in range(K):  # step k's completions, rank by rank
            for r in range(self.data.ranks):
                s, n, t = every[r]
                ordered_rewards += s[k * share:(k + 1) * share]
                ordered_lengths += n[k * share:(k + 1) * share]
                ordered_truncated += t[k * share:(k + 1) * share]
        rewards = torch.tensor(ordered_rewards, dtype=torch.float64)
        m = self.metrics
        for f, reward in enumerate(self.rewards):
            m.per_function.setdefault(reward.name, []).extend(rewards[:, f].tolist())
        m.lengths += ordered_lengths
        m.truncated += ordered_truncated
        return texts, rewards

    def count_tools(self) -> None:
        """The round's tool counts, every rank's, into the metrics."""
        c = self.toolbox.take_counts()
        faults = {"failures": c.failures, "timeouts": c.timeouts, "malformed": c.malformed}
        m = self.metrics
        every = {r: (calls, turns, f) for r, calls, turns, f in
                 self.run.strategy.gather_objects((self.data.rank, c.per_completion, c.turns, faults))}
        for calls, turns, f in every.values():
            m.tool_calls += calls
            m.turns += turns
            for k, v in f.items():
                m.tool_faults[k] = m.tool_faults.get(k, 0) + v

    def advantages(self, rewards: torch.Tensor, steps: int) -> torch.Tensor:
        """This rank's completions' advantages, from every rank's rewards: per prompt group (G rows), scaled
        over the group or the round's completions (TRL's generation batch)."""
        from toolkit.objectives.grpo.functions import group_advantages, weighted_rewards, zero_std_groups

        total = weighted_rewards(rewards, self.weights)
        advantages = group_advantages(total, self.G, self.spec.scale_rewards)
        self.metrics.rewards += total.tolist()
        zero_std = zero_std_groups(total, self.G, self.spec.scale_rewards)
        self.metrics.zero_std += zero_std.double().tolist()
        self.say_if_nothing_is_learned(rewards, bool(zero_std.all()), steps)
        share = self.per_step // self.data.ranks
        mine = [k * self.per_step + j for k in range(steps) for j in self.mine()]
        assert len(mine) == share * steps
        return advantages[mine].float()

    def say_if_nothing_is_learned(self, rewards: torch.Tensor, agreed: bool, steps: int) -> None:
        """One warning when every group's rewards agreed for `NO_SIGNAL_STEPS` steps in a row (their advantages
        are 0: the steps train nothing), with what usually causes it; one per reward function that returned None
        for most of a round's completions (those carry no signal from it). Every rank alike; the main process
        says it."""
        self.no_signal = self.no_signal + steps * self.mu if agreed else 0
        if self.no_signal >= NO_SIGNAL_STEPS and not self.said_no_signal:
            self.said_no_signal = True
            m = self.metrics
            cut = sum(m.truncated) / max(1, len(m.truncated))
            means = ", ".join(f"{r.name} {torch.nanmean(rewards[:, f]).item():.3g}" for f, r in enumerate(self.rewards))
            self.run.warn(f"warning: every group's completions got the same reward for {self.no_signal} steps in a "
                          f"row (frac_reward_zero_std 1.0): their advantages are 0 and the steps train nothing. "
                          f"Usually the completions are too short to reach an answer ({cut:.0%} of the last round's "
                          f"were cut at --max-completion-length {self.sampling.max_completion_length}), or a reward "
                          f"never fires (mean per function: {means}); read a few lines of completions.jsonl")
        for f, reward in enumerate(self.rewards):
            unscored = float(torch.isnan(rewards[:, f]).double().mean())
            if unscored > 0.5 and reward.name not in self.said_unscored:
                self.said_unscored.add(reward.name)
                self.run.warn(f"warning: reward {reward.name} returned None for {unscored:.0%} of the completions "
                              f"sampled at step {self.step}: those carry no signal from it (None is TRL's 'does not "
                              "apply'); a completion no function scores is left out of its group's baseline and "
                              "trains nothing")

    def micro_batches(self, batches, rows, prompt_ids, completions, advantages) -> list[list[dict]]:
        """Each step's micro-batches on this rank: its share cut into --grad-accum pieces of --micro-batch-size,
        with their advantages, the units the loss type divides by, and the old and reference log-probabilities
        where the objective needs them (computed now, without gradients, from the policy that sampled)."""
        run, spec = self.run, self.spec
        mb = run.cfg.train.micro_batch_size
        device = run.strategy.accelerator.device
        mask, tool_mask = completions.mask, completions.tool_mask
        if spec.mask_truncated:
            mask = mask * (~completions.truncated).long().unsqueeze(1)
        out, share = [], self.per_step // self.data.ranks
        for k in range(len(batches)):
            micro = []
            for i in range(k * share, (k + 1) * share, mb):
                part = slice(i, i + mb)
                batch = collate_rollout(prompt_ids[part], completions.ids[part], mask[part], run.tokenizer.pad_token_id,
                                        device, None if tool_mask is None else tool_mask[part])
                # an image-text model's image inputs of the rows' prompts: on the host until their forward (a
                # round's micro-batches wait for their steps)
                batch.update({MEDIA + k: v for k, v in self.prompts.media(rows[part], batch["input_ids"]).items()})
                if spec.mask_truncated:  # the labels the loop counts: the loss tokens
                    batch["labels"][:, -batch["completion_mask"].shape[1]:][batch["completion_mask"] == 0] = -100
                batch["advantages"] = advantages[part].to(device)
                batch["units"] = spec.units(batch["completion_mask"])
                micro.append(batch)
            out.append(micro)
        if spec.needs_old or spec.reference is not None:
            with torch.compiler.set_stance("force_eager"):
                for micro in out:
                    for batch in micro:
                        if spec.needs_old:
                            batch["old_logps"] = self.objective.old_logps(run.model, batch)
                        if spec.reference is not None:
                            batch["ref_logps"] = self.objective.reference_logps(run.model, batch, self.reference_model)
        return out

    # --- what the loop reads
    def take_metrics(self) -> dict[str, float]:
        """The rounds' metrics since the last call (the step's record)."""
        taken, self.metrics = self.metrics, RoundMetrics()
        return taken.values() if taken.rewards else {}

    def take_seconds(self) -> float:
        """The rounds' seconds since the last call: not training (kept out of the step's tokens/s)."""
        taken, self.seconds = self.seconds, 0.0
        return taken

    def log_samples(self, first: int, rows: list[int], texts: list[str], rewards: torch.Tensor) -> None:
        """The prompts, completions and rewards of each step the round sampled for that falls on the
        --log-completions-every cadence (0: the metrics records'), into completions.jsonl (main process;
        every rank's gathered)."""
        run = self.run
        every = run.cfg.rl.log_completions_every or run.log_every
        share = self.per_step // self.data.ranks
        logged = [k for k in range(len(rows) // share) if (first + k) % every == 0 or first + k == 1]
        if not logged:
            return
        mine = [(self.data.rank, k, [(self.prompts.prompts[r], text) for r, text in
                                     zip(rows[k * share:(k + 1) * share], texts[k * share:(k + 1) * share])])
                for k in logged]
        gathered = {(rank, k): pairs for part in run.strategy.gather_objects(mine) for rank, k, pairs in part}
        if not run.strategy.accelerator.is_main_process:
            return
        names = [r.name for r in self.rewards]
        with open(Path(run.out_dir) / "completions.jsonl", "a") as f:
            for k in logged:
                j = k * self.per_step  # the step's rows in the round's rewards: rank by rank
                for rank in range(self.data.ranks):
                    for prompt, text in gathered[(rank, k)]:
                        scores = {n: (None if math.isnan(v) else v) for n, v in zip(names, rewards[j].tolist())}
                        f.write(json.dumps({"step": first + k, "prompt": prompt, "completion": text,
                                            "rewards": scores}, default=str) + "\n")
                        j += 1

    def state_dict(self) -> dict | None:
        """What a checkpoint written mid-round must keep: the round's remaining micro-batches (sampled from
        weights the checkpoint no longer holds), on the CPU; under --dynamic-sampling, always, the next prompt
        batch (how many it took depended on the rewards); else None at a round's end."""
        if not self.pending and not self.dynamic:
            return None
        state = {"pending": [(epoch, [{k: v.cpu() if torch.is_tensor(v) else v for k, v in b.items()} for b in micro])
                             for epoch, micro in self.pending]}
        return {**state, "cursor": self.cursor} if self.dynamic else state

    def load_state_dict(self, state: dict) -> None:
        if self.dynamic and "cursor" in state:
            self.cursor = state["cursor"]
        device = self.run.strategy.accelerator.device
        self.pending = [(epoch, [{k: v.to(device) if torch.is_tensor(v) else v for k, v in b.items()} for b in micro])
                        for epoch, micro in state.get("pending", [])]


def joined(parts: list, pad_id: int):
    """One `Completions` of the shares' parts, right-padded to the widest."""
    from toolkit.objectives.grpo.sampling import Completions

    width = max(p.ids.shape[1] for p in parts)

    def padded(x, value):
        return torch.nn.functional.pad(x, (0, width - x.shape[1]), value=value)

    tools = None if parts[0].tool_mask is None else torch.cat([padded(p.tool_mask, 1) for p in parts])
    return Completions(torch.cat([padded(p.ids, pad_id) for p in parts]), torch.cat([padded(p.mask, 0) for p in parts]),
                       torch.cat([p.truncated for p in parts]), tools)


def scored_unless_stopped(run, doing: str, score: Callable, *args):
    """`score(*args)`, the user's reward functions, ended at once by a signal (`run.abandonable`: the
    completions depend only on the seed, the step and the prompt, so a resumed run scores them again); then
    every rank asks whether any was stopped, and all abandon the round alike (`Interrupted`)."""
    out = None
    with run.abandonable():
        out = score(*args)
    if run.strategy.host_max(float(run.stop_requested())) > 0:
        raise Interrupted(doing)
    return out


@torch.no_grad()
def eval_rewards(run, prompts, rewards, decoder=None, toolbox=None) -> dict[str, float]:
    """Greedy completions (the most likely token each step) of the held-out prompts, each data-parallel rank
    a strided share, scored by the run's reward functions: `eval_reward` (the weighted sum's mean: with
    builtin:math_answer, the accuracy) and each function's mean. `run`: the run's
    `toolkit.objectives.base.Context`; `decoder`: the rollouts' decode path, where they made one; `toolbox`: the
    run's tools (`toolkit.objectives.grpo.turns.Toolbox`), called as in training (their counts kept apart)."""
    weights = [r.weight for r in rewards]
    from toolkit.objectives.grpo.rewards import completions_for, score
    from toolkit.objectives.grpo.sampling import SamplingConfig, sample
    from toolkit.objectives.grpo.tools import ToolCounts
    from toolkit.objectives.grpo.turns import run_turns

    strategy, tok, data = run.strategy, run.tokenizer, run.strategy.data
    cfg = SamplingConfig(run.cfg.rl.max_completion_length, 1.0, 1, 1.0, suppress=suppressed(prompts))  # greedy
    rows = list(range(data.rank, len(prompts), data.ranks))
    size = run.cfg.train.micro_batch_size * run.cfg.rl.num_generations
    n_batches = math.ceil(len(prompts) / (size * data.ranks))  # the same count on every rank (sharded forwards)
    scored = []
    training_counts = toolbox.counts if toolbox is not None else None
    with strategy.generating(run.model) as model:
        ends = eos_ids(tok, model)
        anywhere = partial(unfinished_anywhere, run, doing="evaluating")

        def generate(ids, seeds, limits=None, media=None):
            return sample(model, ids, seeds, cfg, ends, tok.pad_token_id, any_unfinished=anywhere,
                          decoder=None if prompts.processor is not None or toolbox is not None else decoder,
                          media=media, limits=limits)

        for b in range(n_batches):
            part = rows[b * size:(b + 1) * size]
            held = part or rows[:1] or [0]  # a rank out of rows samples a dummy one, and keeps nothing
            prompt_ids, envs, paths = [prompts.prompt_ids[r] for r in held], None, None
            if toolbox is not None:
                toolbox.begin_round()
                toolbox.counts = ToolCounts()
                prompt_ids, envs, tools = toolbox.open(prompts, held)
            out = generate(prompt_ids, [0] * len(held), media=prompts.media(held))
            if toolbox is not None:
                out, paths = run_turns(toolbox, out, prompt_ids, [0] * len(held), tools, generate,
                                       lambda going: strategy.host_max(float(going)) > 0, tok.pad_token_id)
            if not part:  # the stop check every rank makes in `scored_unless_stopped`, made here too
                if run.strategy.host_max(float(run.stop_requested())) > 0:
                    raise Interrupted("evaluating")
                continue
            ids = out.token_lists()
            texts = completion_texts(tok, out)
            given = [prompts.prompts[r] for r in part]
            columns = prompts.columns_of(part)
            if envs is not None and any(e is not None for e in envs):
                columns["environments"] = envs
            s = scored_unless_stopped(run, "evaluating", score, rewards, given, completions_for(given, texts, paths),
                                      ids, columns, 1, part)
            scored += s.rewards
    if toolbox is not None:
        toolbox.counts = training_counts
    every = [x for part in strategy.gather_objects((data.rank, scored)) for x in [part]]
    table = torch.tensor([r for _, s in {rank: s for rank, s in every}.items() for r in s], dtype=torch.float64)
    if not len(table):
        return {}
    from toolkit.objectives.grpo.functions import weighted_rewards

    total = weighted_rewards(table.view(-1, len(rewards)), torch.tensor(weights, dtype=torch.float64))
    out = {"eval_reward": float(torch.nanmean(total))}
    for f, reward in enumerate(rewards):
        out[f"eval_rewards/{reward.name}/mean"] = float(torch.nanmean(table.view(-1, len(rewards))[:, f]))
    return out
