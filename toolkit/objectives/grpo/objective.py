"""`--objective grpo`: no rows read as batches; each step's completions sampled from the policy a round at a
time (`toolkit.objectives.grpo.rollout.Rollouts`), scored by the reward functions, trained with `GRPOLoss`,
evaluated by the greedy completions' rewards on the held-out prompts."""

from __future__ import annotations

from typing import Callable

import torch
from torch.utils.data import DataLoader

from toolkit.config.objectives import groups_problem
from toolkit.objectives.base import Context, LayoutHooks
from toolkit.objectives.grpo.loss import GRPOLoss, GRPOSpec
from toolkit.objectives.preference.objective import one_process_pipeline


class GRPO:
    """Group relative policy optimization with Python rewards (`toolkit.objectives.base.Objective`)."""

    name, unit, eval_metric = "grpo", "completions", "eval_reward"

    def __init__(self, cfg):
        from toolkit.objectives.grpo.rewards import load_rewards
        from toolkit.objectives.grpo.tools import environment_reward

        self.cfg, self.spec = cfg, GRPOSpec.from_config(cfg)
        rl = cfg.rl
        weights = [float(w) for w in rl.reward_weights.split(",") if w.strip()] or None
        # a reward, tool or environment file's errors are said now, before the weights load
        specs = [s for s in rl.reward.splitlines() if s.strip()]
        self.tools, self.environments = self.load_tools()
        # one per class that defines get_reward, as TRL
        owned = [environment_reward(cls) for cls in dict.fromkeys(type(e) for e in self.environments.values())
                 if hasattr(cls, "get_reward")]
        if not specs and not owned:
            from toolkit.errors import UserError

            raise UserError("--objective grpo needs a reward: at least one --reward, or an --environment whose class "
                            "defines get_reward()")
        self.rewards = load_rewards(specs, weights) if specs else []
        # an environment that owns its reward: a reward named after its class, weight 1, beside the functions
        self.rewards += owned
        if rl.overlong_buffer:
            from toolkit.objectives.grpo.rewards import overlong_reward

            # DAPO's soft length penalty, beside the user's rewards
            self.rewards.append(overlong_reward(rl.max_completion_length, rl.overlong_buffer, rl.overlong_penalty))
        self.loss: GRPOLoss | None = None
        self.rollouts, self.reference_model, self.toolbox = None, None, None

    def load_tools(self) -> tuple[list, dict]:
        """--tools' functions and --environment's probe instances (`toolkit.objectives.grpo.tools`)."""
        from toolkit.objectives.grpo.tools import load_environments, load_tools

        rl = self.cfg.rl
        return (load_tools([s for s in rl.tools.splitlines() if s.strip()]),
                load_environments([s for s in rl.environment.splitlines() if s.strip()]))

    def tokenizer_problems(self, tokenizer) -> list[str]:
        """With tools: a chat template that shows them to the model and renders calls and results (`template_problem`),
        for the standalone tools and each environment's."""
        from toolkit.objectives.grpo.tools import environment_methods, schema_of, template_problem

        if not self.tools and not self.environments:
            return []
        envs = self.environments or {None: None}
        for env in envs.values():
            methods = [getattr(env, m) for m in environment_methods(type(env))] if env is not None else []
            problem = template_problem(tokenizer, [schema_of(t, "--tools") for t in self.tools + methods])
            if problem:
                return [f"--tools/--environment: the chat template of --model {self.cfg.model.model} cannot run tools: "
                        f"{problem}; give one that can with --chat-template (a ChatML model such as SmolLM2: "
                        "--chat-template chatml-tools)"]
        return []

    def make_toolbox(self, ctx: Context, prompts):
        """The run's `Toolbox` where it has tools or environments (None otherwise)."""
        if not self.tools and not self.environments:
            return None
        from toolkit.errors import UserError
        from toolkit.objectives.grpo.turns import Toolbox

        rl = self.cfg.rl
        if prompts.processor is not None:
            raise UserError("--tools / --environment with image prompts does not run yet (a tool turn re-reads the "
                            "prompt's images); use a text model, or --images off")
        problems = self.tokenizer_problems(ctx.tokenizer)
        if problems:
            raise UserError(problems[0])
        return Toolbox(self.tools, self.environments, ctx.tokenizer, rl.max_tool_calls, rl.tool_timeout,
                       rl.max_completion_length)

    def make_loss(self, hooks: LayoutHooks) -> GRPOLoss:
        """The layout's `hooks` change nothing in it: sampling is the rollouts', through `Strategy.generating`."""
        self.loss = GRPOLoss(self.spec, self.rewards)
        return self.loss

    def layout_problems(self, kind: str, dims) -> list[str]:
        """A global batch that holds whole prompt groups; a frozen reference copy (a full finetune with beta > 0)
        only where the policy is whole on each rank: a layout that shards it would have to shard the copy too."""
        p = one_process_pipeline(self.cfg, kind)
        t, rl, par = self.cfg.train, self.cfg.rl, self.cfg.parallel
        groups = groups_problem(t.micro_batch_size, t.grad_accum, dims.dp, rl.num_generations)
        p += [groups] if groups else []
        whole = kind == "accelerate" or (kind == "deepspeed" and (par.zero_stage or 0) < 3)
        if self.spec.reference == "copy" and not whole:
            p.append(f"--objective grpo with --beta {self.spec.beta:g} and --method full: the reference is a frozen "
                     "copy of the model, which this layout would have to shard like the policy (not yet); use DDP, "
                     "ZeRO-1/2 or one process, or --method lora (its reference is the base, adapters disabled), or "
                     "--beta 0")
        return p

    def loader(self, rows, tokenizer, log: Callable[[str], None], pin: bool, whole: bool, attn: str | None):
        """The prompts' row indices: what `prepare` is handed (the rollouts read the prompts themselves)."""
        return DataLoader(list(range(len(rows))), batch_size=self.cfg.train.micro_batch_size)

    def steps_per_epoch(self, loader, rows, data_ranks: int) -> int:
        from toolkit.objectives.grpo.rollout import steps_per_epoch

        return steps_per_epoch(self.cfg, len(rows), data_ranks)

    def batch_words(self, global_batch: int) -> str:
        g = self.cfg.rl.num_generations
        return (f"{global_batch} completions ({global_batch // g} prompts x {g} generations); a loss near 0 is "
                "expected (the advantages of a group sum to 0: the loss moves the policy without being small or "
                "large)")

    def before_training(self, ctx: Context, loader, rows, eval_rows, steps_per_epoch: int, resuming: bool) -> None:
        """A full finetune's reference with beta > 0: a frozen copy of the model as loaded."""
        self.reference_model = ctx.frozen_copy() if self.spec.reference == "copy" else None

    def batches(self, ctx: Context, loader, rows, first_step: int, steps_per_epoch: int, saved: dict | None):
        """The rounds from `first_step`; `saved`: the rest of a round a checkpoint was written in."""
        from toolkit.objectives.grpo.rollout import Rollouts

        self.toolbox = self.make_toolbox(ctx, rows)
        self.rollouts = Rollouts(ctx, rows, self.loss, self.reference_model, self.toolbox)
        self.rollouts.start_at(first_step)
        ctx.log(self.rollouts.decode_line)
        if self.toolbox is not None:
            ctx.log(self.toolbox.describe())
        if saved is not None:
            self.rollouts.load_state_dict(saved)
        return self.rollouts

    def begin_step(self, model, micro: list[dict], reduce, replicas: int, examples: torch.Tensor) -> None:
        """Nothing: the advantages came with the batch."""

    def metric_values(self, sums: torch.Tensor, examples) -> dict[str, float]:
        return self.loss.metric_values(sums, examples)

    def extra_forwards(self) -> int:
        return 0

    def evaluate(self, ctx: Context, rows) -> dict[str, float]:
        from toolkit.objectives.grpo.rollout import eval_rewards

        return eval_rewards(ctx, rows, self.rewards, self.rollouts.decoder if self.rollouts is not None else None,
                            self.toolbox)
