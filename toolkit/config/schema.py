"""A run's settings as typed, frozen dataclass sections (`ModelConfig`, `DataConfig`, `TrainConfig`, `RLConfig`,
the layout's `ParallelConfig`, `OutputConfig`, `PlanConfig`), the `Config` that holds them, what the data
package is given of it (`DataSettings`), the defaults (`DEFAULT_MODEL`, `DEFAULT_DATASET`), and every key
with its section and type (`_fields`, `_field_type`).

Every field is one flag (`--lora-r`) and one YAML key (`lora_r`); field names are unique across
sections so a flat YAML file or a flat command line addresses them without a section prefix. A field's
metadata holds its help text and its choices (`toolkit.config.parse` turns each into a flag).
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Optional

from toolkit.config.objectives import DEFAULT_SIMPO_GAMMA, OBJECTIVES
from toolkit.layout.flags import ParallelConfig

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_DATASET = "builtin:dates"


def _f(default: Any, help: str, choices: tuple | None = None, **kw) -> Any:
    meta = {"help": help}
    if choices:
        meta["choices"] = choices
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta, **kw)


@dataclass(frozen=True)
class ModelConfig:
    model: str = _f(DEFAULT_MODEL, f"local HF folder, hub id, or '{DEFAULT_MODEL}' (embedded default)")
    method: str = _f("lora", "what to train", ("full", "lora", "qlora"))
    lora_r: int = _f(16, "LoRA rank")
    lora_alpha: int = _f(32, "LoRA alpha (scale = alpha / r)")
    lora_dropout: float = _f(0.0, "dropout on the LoRA input; above 0 it keeps a mask of "
                                         "each adapted layer's input (benchmarks/lora_dropout.md)")
    lora_targets: str = _f("all-linear", "comma-separated module names, or 'all-linear'")
    trust_remote_code: bool = _f(False, "allow model code from the model folder/hub to run")
    train_vision: str = _f("none", "image-text models: what of the vision side trains besides the language model "
                                   "(LoRA adapts the language model's linears; a full finetune trains it and the "
                                   "projector): projector, or all (the vision tower too)", ("none", "projector", "all"))
    merge_adapter: bool = _f(False, "with --model a LoRA adapter folder: fold it into its base first (as python -m "
                                    "toolkit merge does) and train a new adapter, or the full model, on the merged "
                                    "weights; by default LoRA trains the same adapter on")
    router_aux_loss_coef: Optional[float] = _f(None, "MoE models: the router load-balancing loss's coefficient, "
                                                     "added to the loss as the model adds it (0 = off; unset = "
                                                     "the config's, on where it sets output_router_logits)")
    experts: str = _f("auto", "MoE models: how each layer's experts run, transformers' experts_implementation: "
                              "grouped_mm (one grouped matmul: torch's grouped_mm where the device has it, else "
                              "transformers' fallback), batched_mm (one batched matmul over each token's experts), "
                              "eager (a loop over the experts hit); auto: transformers' choice (grouped_mm where it "
                              "can dispatch)", ("auto", "grouped_mm", "batched_mm", "eager"))
    attn: str = _f("auto", "attention kernel: sdpa (transformers'; a dense block-diagonal mask for packed rows); "
                           "varlen (torch's varlen_attn on CUDA, per document on CPU), flex (flex_attention with a "
                           "document mask), flash (flash-attn): packed rows without padding or a dense mask; auto: "
                           "sdpa for padded batches, for packed ones the first of varlen, flash, flex available on "
                           "the device (on CPU varlen)", ("auto", "sdpa", "flex", "varlen", "flash"))
    chat_template: str = _f("", "the chat template that renders the training data, eval, samples and generation, and "
                                "is saved with final/'s tokenizer: a Jinja file, or the name of one of the templates "
                                "the tokenizer carries (default: the tokenizer's own; where it has none, a plain "
                                "<|role|> layout)")


@dataclass(frozen=True)
class DataConfig:
    dataset: str = _f(DEFAULT_DATASET, "json/jsonl/csv/parquet file, hub id, or builtin:NAME; a mixture: "
                                       "a.jsonl:0.7,b.json:0.3 (sampled by weight with --seed); a source's own "
                                       "columns after it, ';' between them: 'a.jsonl:0.7:instruction=q;output=a' "
                                       "(in YAML also a list of {path, weight, columns})")
    format: str = _f("auto", "record layout", ("auto", "alpaca", "chat", "sharegpt", "text"))
    seq_len: int = _f(1024, "tokens per example; longer ones are truncated")
    eval_split: float = _f(0.0, "fraction of the data held out for eval loss (0 = none)")
    eval_dataset: str = _f("", "held-out data from a file of its own (json/jsonl/csv/parquet file, folder or hub id), "
                               "read as --dataset is (its own format detection, --columns, or its own columns after "
                               "it: 'eval.jsonl:instruction=q'); evaluated where --eval-split's rows would be; not "
                               "with --eval-split")
    columns: str = _f("", "use your own column names: OURS=YOURS pairs, e.g. instruction=prompt,output=response "
                          "(in YAML also a mapping); ours are instruction, input, output, system, messages, "
                          "conversations, text, and for preference data prompt, chosen, rejected, completion, label; "
                          "in the turns of messages/conversations the keys role and content, and your speakers "
                          "for user_role, assistant_role, system_role (conversations=dialog,role=who,content=says,"
                          "user_role=customer,assistant_role=agent)")
    system_prompt: str = _f("", "system message added to every conversation that has none")
    train_on_prompt: bool = _f(False, "also train on prompt tokens (default: completions only)")
    images: str = _f("auto", "train on the data's images (an image-text model, toolkit/data/images.py), or off: on the "
                             "text alone; auto: on where the model is image-text and the data has images, or where "
                             "the model loads only as an image-text model", ("auto", "on", "off"))
    image_min_pixels: int = _f(0, "image-text models: the image processor's min_pixels, each image scaled up to at "
                                  "least this many pixels (Qwen2-VL-like processors; 0: the processor's own)")
    image_max_pixels: int = _f(0, "image-text models: the image processor's max_pixels, each image scaled down to at "
                                  "most this many pixels, so to at most about this / 784 image tokens on Qwen2-VL "
                                  "(0: the processor's own); a processor without it is one line")
    packing: bool = _f(False, "pack several examples into each --seq-len row (attention and positions "
                              "stay per example); --micro-batch-size then counts packed rows")
    padding_free: Optional[bool] = _f(None, "lay each micro-batch's examples (a pair's chosen and rejected) end to "
                                            "end in one row, no padding, positions restarting per example (TRL's "
                                            "padding_free); the same examples per step and the same loss. Unset "
                                            "(auto, the default): where the attention keeps them apart without a "
                                            "dense mask (--attn auto's varlen, flash or flex) and the batches reach "
                                            "the model whole (not --pp, --cp, --objective grpo); --padding-free: "
                                            "also with sdpa's or eager's block-diagonal mask; --no-padding-free: "
                                            "padded rows")
    data_workers: int = _f(0, "processes that tokenize (0 = the node's cores); the result is cached, so later "
                              "runs and the other ranks read it")
    streaming: bool = _f(False, "read and tokenize the records as training goes, in file order, nothing cached "
                                "(data larger than disk or RAM); needs --max-steps")


@dataclass(frozen=True)
class TrainConfig:
    micro_batch_size: int = _f(4, "examples per rank per forward pass")
    grad_accum: int = _f(1, "micro-batches per optimizer step")
    lr: Optional[float] = _f(None, "peak learning rate (default 2e-4 for lora/qlora, 2e-5 for full; under "
                                   "--objective grpo 1e-5 and 1e-6, TRL's GRPOConfig's scale)")
    lr_schedule: str = _f("cosine", "decay after warmup", ("cosine", "linear", "constant"))
    warmup_steps: int = _f(10, "linear warmup steps")
    weight_decay: float = _f(0.0, "AdamW weight decay (not applied to biases and norms)")
    max_grad_norm: float = _f(1.0, "gradient clipping norm (0 = no clipping)")
    epochs: int = _f(1, "passes over the training data")
    max_steps: int = _f(-1, "optimizer steps; overrides --epochs when > 0")
    seed: int = _f(42, "seed for weights init, shuffling and dropout")
    mixed_precision: str = _f("auto", "bf16 on GPUs that support it, fp32 on CPU", ("auto", "no", "bf16", "fp16"))
    gradient_checkpointing: bool = _f(False, "recompute activations in backward to save memory")
    max_bad_steps: int = _f(3, "non-finite loss or gradient norm: skip the update; after this many in a row, "
                               "save a checkpoint and stop")
    loss: str = _f("auto", "full: logits then cross-entropy; chunked: LM head + cross-entropy 256 tokens at a time "
                           "inside the head's forward, so batch x seq x vocab fp32 logits never exist (same loss and "
                           "gradients; its softmax compiled on CUDA); liger / cce: the same through Liger-Kernel's / "
                           "Apple's Cut Cross-Entropy's Triton kernels (CUDA only; pip install 'toolkit[gpu]'); auto: "
                           "on a GPU full logits where the planner says they fit, else chunked (cce and liger only "
                           "when asked: slower on real packed data; cce refuses fp32); on CPU chunked; full under --pp "
                           "or with a non-linear LM head",
                   ("auto", "full", "chunked", "liger", "cce"))
    compile: Optional[bool] = _f(None, "compile each decoder block with torch.compile (regional); unset (auto, the "
                                       "default): on CUDA from step 4 where the steps left repay the compile, timed "
                                       "on steps 2-3, eager on CPU and on layouts that cannot compile, said in one "
                                       "line; --compile: from step 1; --no-compile: never. The compile step's "
                                       "metrics record says so (compile_warmup)")
    objective: str = _f("sft", "what to train on: sft = next-token loss on the completions; grpo = online RL on "
                               "prompts: the policy samples --num-generations completions per prompt, --reward "
                               "functions score them, and the policy moves toward the better ones (GRPO, Dr. GRPO, "
                               "DAPO, GSPO: --loss-type, --importance-sampling); dpo, orpo, simpo = "
                               "preference pairs (prompt, chosen, rejected): DPO against the model as loaded (LoRA: "
                               "the adapters disabled; full: its log-probabilities computed once before step 1), "
                               "ORPO (the chosen sequences' NLL + an odds-ratio term), SimPO (mean log-probabilities, "
                               "a margin, no reference); kto = completions labelled desirable or not (prompt, "
                               "completion, label; pairs are split into one of each), against the reference as DPO",
                        OBJECTIVES)
    beta: Optional[float] = _f(None, "preference objectives' beta; grpo's KL coefficient (default: dpo, orpo and "
                                     "kto 0.1 as TRL, grpo 0 as TRL: no reference forward, simpo 2.0 as "
                                     "its authors)")
    simpo_gamma: float = _f(DEFAULT_SIMPO_GAMMA, "SimPO's target reward margin gamma (its authors' 0.5 x beta 2.0)")
    label_smoothing: float = _f(0.0, "dpo and simpo: the chance a pair's preference is flipped (conservative DPO), "
                                     "in [0, 0.5)")
    desirable_weight: float = _f(1.0, "kto: the weight of a desirable completion's loss (TRL's desirable_weight)")
    undesirable_weight: float = _f(1.0, "kto: the weight of an undesirable completion's loss; with unbalanced data, "
                                        "KTO's authors keep weight x count within 1 to 4/3 between the two")
    kernels: str = _f("none", "fused kernels for the model's layers: liger = Liger-Kernel's RMSNorm, SwiGLU and RoPE "
                              "(CUDA; pip install 'toolkit[gpu]')", ("none", "liger"))


@dataclass(frozen=True)
class RLConfig:
    """--objective grpo: generation, rewards and the policy loss, with TRL 1.16 GRPOConfig's names and defaults
    (`toolkit.objectives.grpo.loss`, `toolkit.objectives.grpo.rollout`)."""
    num_generations: int = _f(8, "completions sampled per prompt (G), a group whose rewards are compared; the "
                                 "global batch (micro-batch x accumulation x data-parallel ranks) counts "
                                 "completions and must be a multiple of it")
    max_completion_length: int = _f(512, "tokens sampled per completion at most (one that reaches it without "
                                         "its end-of-turn token is truncated)")
    temperature: float = _f(1.0, "sampling temperature; the log-probabilities the loss compares are of the logits "
                                 "/ temperature, as TRL's")
    top_p: float = _f(1.0, "nucleus sampling's probability mass (1 = off)")
    top_k: int = _f(0, "sample from the k most likely tokens (0 = off)")
    loss_type: str = _f("dapo", "how the clipped per-token losses are averaged: dapo = over every completion token "
                                "of the global batch (TRL's default: no length bias); grpo = each completion's "
                                "mean, then over completions; dr_grpo = their sum over completions x "
                                "--max-completion-length (Dr. GRPO); bnpo = dapo's global token mean (TRL "
                                "averages each micro-batch's, which depends on the split)",
                        ("dapo", "grpo", "dr_grpo", "bnpo"))
    importance_sampling: str = _f("token", "the importance ratio per token, or per sequence (the masked mean of "
                                           "its tokens' log-ratios: GSPO)", ("token", "sequence"))
    epsilon: float = _f(0.2, "the ratio's lower clip, 1 - epsilon (and the upper, unless --epsilon-high)")
    epsilon_high: Optional[float] = _f(None, "the ratio's upper clip, 1 + epsilon_high (DAPO's clip-higher: 0.28; "
                                             "default: --epsilon)")
    scale_rewards: str = _f("group", "the advantage's divisor: each prompt group's reward std (GRPO), the global "
                                     "batch's (batch), or none (Dr. GRPO)", ("group", "batch", "none"))
    mask_truncated_completions: bool = _f(False, "leave completions that reached --max-completion-length without "
                                                 "ending out of the loss (DAPO's overlong filtering)")
    overlong_buffer: int = _f(0, "DAPO's soft overlong punishment: a completion within this many tokens of "
                                 "--max-completion-length loses reward linearly, --overlong-penalty at the limit; "
                                 "added as the reward 'overlong', weight 1 (0 = off)")
    overlong_penalty: float = _f(1.0, "the reward a completion of --max-completion-length tokens loses under "
                                      "--overlong-buffer (DAPO's penalty factor)")
    steps_per_generation: int = _f(1, "optimizer steps each generation round's completions serve (their "
                                      "log-probabilities at generation are then the ratio's old ones)")
    num_iterations: int = _f(1, "times each round's completions are trained on (mu; > 1: their old "
                                "log-probabilities computed once after generation)")
    reward: str = _f("", "a reward function: path.py:function (TRL's signature: fn(prompts, completions, "
                         "completion_ids, **columns) -> a float or None per completion), builtin:math_answer (the "
                         "last number against the answer column, GSM8K's '#### 42' read), or builtin:regex:PATTERN "
                         "(1 where the completion matches); give the flag once per function (YAML: a list)")
    reward_weights: str = _f("", "one weight per --reward, comma-separated (default: 1 each)")
    dynamic_sampling: bool = _f(False, "DAPO's dynamic sampling: a step's prompt groups whose rewards all agree are "
                                       "dropped and its batch refilled from the next prompts (prompts are then used "
                                       "up faster than one batch a step)")
    dynamic_sampling_rounds: int = _f(4, "extra sampling rounds a step may take under --dynamic-sampling; a batch "
                                         "still short then trains with agreeing groups (advantage 0) in the gaps")
    tools: str = _f("", "tools the model may call while it samples: path.py:fn[,fn...] (TRL's tools: plain Python "
                        "functions, sync or async, with type hints and a docstring, their schemas shown by the chat "
                        "template); results are appended as tool messages and sampling continues; give the flag once "
                        "per file (YAML: a list)")
    environment: str = _f("", "an environment per rollout: path.py:Class (TRL's environment_factory: reset(**record) "
                              "-> None or text added to the prompt, its public methods the tools, get_reward() an "
                              "optional reward named after the class), or name=path.py:Class, once per environment, "
                              "chosen per record by its 'environment' column")
    max_tool_calls: int = _f(10, "tool-calling turns per completion at most (TRL's max_tool_calling_iterations); "
                                 "the completion's tokens, tool results included, stay within "
                                 "--max-completion-length")
    tool_timeout: float = _f(30.0, "seconds a tool call may run; past it the call is abandoned, the model is told "
                                   "it timed out, and it is counted (tools/timeouts)")
    log_completions_every: int = _f(0, "steps between the samples of prompts, completions and their rewards "
                                       "written to completions.jsonl (0 = at each metrics record)")


@dataclass(frozen=True)
class OutputConfig:
    output_dir: str = _f("output", "where metrics, checkpoints and the final model go")
    overwrite_output_dir: bool = _f(False, "allow writing into a non-empty output dir")
    log_every: int = _f(0, "optimizer steps between metrics records (0 = about 50 records per run: every step "
                           "in runs under 50 steps)")
    eval_every: int = _f(0, "steps between eval-loss records (0 = only at the end)")
    eval_on_start: bool = _f(False, "an eval loss at step 0, before the first update (needs --eval-split)")
    report_to: str = _f("tensorboard", "trackers besides metrics.jsonl: none, all, or tensorboard, wandb, mlflow, "
                                      "trackio (comma-separated); wandb runs offline without network, mlflow "
                                      "writes to OUTPUT_DIR/mlruns unless MLFLOW_TRACKING_URI is set")
    sample_prompts: str = _f("", "prompts the model completes during training (greedy, the run's chat template) "
                                 "into samples.jsonl and the trackers: a file (a prompt per line, or .jsonl "
                                 "of {\"prompt\": ...}) or \"p1;p2\"")
    sample_every: int = _f(0, "steps between sample generations (0 = at each eval and at the end)")
    sample_max_new_tokens: int = _f(64, "tokens generated per sample prompt")
    save_every: int = _f(0, "steps between resumable checkpoints (0 = only the final model)")
    keep_last: int = _f(0, "keep only the newest K checkpoints (0 = keep all)")
    resume: str = _f("", "resume from 'auto' (the newest complete checkpoint in --output-dir) or a checkpoint folder")
    resume_ignore_mismatch: bool = _f(False, "resume even if the dataset or result-changing settings differ from the "
                                             "checkpoint's")
    continue_finished: bool = _f(False, "with --resume auto on a finished run (final/ written): train it further, to a "
                                        "larger --max-steps, from its newest checkpoint; final/ is replaced at the end")
    verify: str = _f("load", "after the final save: files = the weight files equal the trained tensors; load = "
                             "also reload the folder with plain transformers/peft in this process and compare the "
                             "loss on a short batch (skipped when too large for the CPU); full = that reload in a "
                             "fresh process; none = no check", ("none", "files", "load", "full"))
    push_to_hub: str = _f("", "after final/ is saved and checked, upload it to this Hugging Face repo (USER/NAME, "
                              "created if missing) with your token (hf auth login, or HF_TOKEN); offline or without "
                              "a token the run is refused at start")
    hub_private: bool = _f(False, "--push-to-hub: create the repo private (otherwise the account's own setting "
                                  "decides)")
    profile: bool = _f(False, "profile steps 4-6 with torch.profiler: profile.txt (the top ops by self time, a GPU's "
                              "on one), profile.json and a chrome trace beside the metrics")
    debug: bool = _f(False, "show full tracebacks for errors")


@dataclass(frozen=True)
class PlanConfig:
    """The machine a recipe is for, which `python -m toolkit plan --config RECIPE.yaml` plans on (its
    flags win). The run itself uses the machine it runs on and ignores these. In YAML also a section:
    `plan: {gpu: h100, gpus_per_node: 8}`."""
    plan_gpu: str = _f("", "plan --config: the card (as plan --gpu: h100, a100-80gb, rtx4090, ...); the run ignores it")
    plan_gpu_memory: str = _f("", "plan --config: memory per GPU (as plan --gpu-memory: 80GB) for a card plan_gpu "
                                  "does not name; the run ignores it")
    plan_gpus_per_node: Optional[int] = _f(None, "plan --config: GPUs in each node; the run ignores it")
    plan_nodes: Optional[int] = _f(None, "plan --config: nodes; the run ignores it")
    plan_cpu_memory: str = _f("", "plan --config: host RAM per node (as plan --cpu-memory: 2TB); the run ignores it")


SECTIONS = ("model", "data", "train", "rl", "parallel", "output", "plan")


@dataclass(frozen=True)
class DataSettings:
    """What the data package reads of a run (`Config.data_settings`): its section, and the two training settings
    that shape the rows: the objective picks the formats and columns a source may have, the seed draws the
    eval split and a mixture's order; `ranks`, those reading different micro-batches (`Config.data_ranks`), decide
    whether an image-free one can train."""
    data: DataConfig
    objective: str
    seed: int
    ranks: int = 1


@dataclass(frozen=True)
class Config:
    """A run's settings, resolved once and frozen: defaults < YAML < flags, with what a launcher or a
    --deepspeed file fixes (`parse_config`); the planner's choices under --strategy auto and a resume's
    re-split of the global batch make a new one (`replace`), never change this one."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    # Where settings came from when not from the flags (an accelerate config, a launcher's flags, a
    # --deepspeed file, the planner): one line each, printed at start. Not config keys.
    notes: tuple[str, ...] = ()

    @classmethod
    def from_values(cls, values: dict[str, Any], notes: tuple[str, ...] = ()) -> Config:
        """The config with `values` (flat keys, already of the fields' types) over the defaults."""
        by_section: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
        for k, v in values.items():
            by_section[_fields()[k][0]][k] = v
        return cls(**{s: cls.__dataclass_fields__[s].default_factory(**kw) for s, kw in by_section.items()},
                   notes=tuple(notes))

    def replace(self, notes: tuple[str, ...] = (), **values: Any) -> Config:
        """A new config with `values` (flat keys) changed and `notes` added; this one stays as it is."""
        by_section: dict[str, dict[str, Any]] = {}
        for k, v in values.items():
            by_section.setdefault(_fields()[k][0], {})[k] = v
        return dataclasses.replace(self, notes=self.notes + tuple(notes),
                                   **{s: dataclasses.replace(getattr(self, s), **kw) for s, kw in by_section.items()})

    def flat(self) -> dict[str, Any]:
        """Every key with its value, in declaration order: the YAML `config.yaml` holds."""
        return {f.name: getattr(getattr(self, s), f.name) for s, f in _fields().values()}

    @property
    def data_settings(self) -> DataSettings:
        """What `toolkit.data` is passed in place of this whole config."""
        return DataSettings(self.data, self.train.objective, self.train.seed, self.data_ranks)

    @property
    def data_ranks(self) -> int:
        """The ranks that read different micro-batches: the launch's (WORLD_SIZE) over those that share one (--tp x
        --pp x --cp). Under --tp alone every rank reads the same micro-batch, so an image-free one needs no blank
        image. Before --strategy auto has planned, every rank of the launch."""
        p = self.parallel
        return max(1, int(os.environ.get("WORLD_SIZE", "1")) // (p.tp * p.pp * p.cp))

    @property
    def lr(self) -> float:
        """The learning rate in force: the user's, else the method's usual default."""
        if self.train.lr is not None:
            return self.train.lr
        # TRL's GRPOConfig: 1e-6 for a full model; LoRA's 10x, as SFT's
        if self.train.objective == "grpo":
            return 1e-6 if self.model.method == "full" else 1e-5
        return 2e-5 if self.model.method == "full" else 2e-4

    @property
    def lr_words(self) -> str:
        """The learning rate in force and where it comes from, for the run's training line."""
        if self.train.lr is not None:
            return f"{self.lr:g} (--lr)"
        whose = "--objective grpo's" if self.train.objective == "grpo" else "the"
        return f"{self.lr:g} ({whose} default for --method {self.model.method}; --lr sets it)"


def _fields() -> dict[str, tuple[str, dataclasses.Field]]:
    """key -> (section name, field) for every configurable value."""
    out: dict[str, tuple[str, dataclasses.Field]] = {}
    for section in SECTIONS:
        for f in dataclasses.fields(Config.__dataclass_fields__[section].default_factory):  # type: ignore[arg-type]
            assert f.name not in out, f"duplicate config key {f.name}"
            out[f.name] = (section, f)
    return out


def _field_type(section: str, f: dataclasses.Field) -> tuple[type, bool]:
    section_cls = Config.__dataclass_fields__[section].default_factory
    tp = typing.get_type_hints(section_cls)[f.name]
    optional = False
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        optional, tp = True, args[0]
    return tp, optional
