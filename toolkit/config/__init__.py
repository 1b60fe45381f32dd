"""Run configuration: typed dataclass sections filled from defaults < `--config run.yaml` < flags.

Every field is one flag (`--lora-r`) and one YAML key (`lora_r`); field names are unique across
sections so a flat YAML file or a flat command line addresses them without a section prefix.
Values from YAML and from flags go through the same `_coerce`, so both get the same checks and the
same messages. `validate` collects every problem and raises once (torchtitan/litgpt habit).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Collection, Optional

import yaml

from toolkit.config.chat_template import template_problems
from toolkit.errors import UserError
from toolkit.config.foreign import ALIASES, FOREIGN, HINT_ONLY, MISSING, hint, joined, normalize, translate
from toolkit.config.hub import repo_problems
from toolkit.config.columns import column_problems
from toolkit.config.output_dir import output_dir_problems
from toolkit.config.paths import (dataset_problems, eval_dataset_problems, sample_problems, streaming_problems,
                                  unused_columns_problems)
from toolkit.layout.flags import ParallelConfig
from toolkit.layout.rules import layout_problems
from toolkit.config.objectives import DEFAULT_SIMPO_GAMMA, OBJECTIVES, generates, objective_problems
from toolkit.config.trackers import spec_problems as tracker_problems

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
    lr: Optional[float] = _f(None, "peak learning rate (default 2e-4 for lora/qlora, 2e-5 for full)")
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
                           "on a GPU full logits where the planner says they fit, else chunked (cce and liger only when "
                           "asked: slower on real packed data; cce refuses fp32); on CPU chunked; full under --pp or "
                           "with a non-linear LM head",
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
    steps_per_generation: int = _f(1, "optimizer steps each generation round's completions serve (their "
                                      "log-probabilities at generation are then the ratio's old ones)")
    num_iterations: int = _f(1, "times each round's completions are trained on (mu; > 1: their old "
                                "log-probabilities computed once after generation)")
    reward: str = _f("", "a reward function: path.py:function (TRL's signature: fn(prompts, completions, "
                         "completion_ids, **columns) -> a float or None per completion), builtin:math_answer (the "
                         "last number against the answer column, GSM8K's '#### 42' read), or builtin:regex:PATTERN "
                         "(1 where the completion matches); give the flag once per function (YAML: a list)")
    reward_weights: str = _f("", "one weight per --reward, comma-separated (default: 1 each)")
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
    resume_ignore_mismatch: bool = _f(False, "resume even if the dataset or result-changing settings differ from the checkpoint's")
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
    eval split and a mixture's order."""
    data: DataConfig
    objective: str
    seed: int


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
        return DataSettings(self.data, self.train.objective, self.train.seed)

    @property
    def lr(self) -> float:
        """The learning rate in force: the user's, else the method's usual default."""
        if self.train.lr is not None:
            return self.train.lr
        if self.train.objective == "grpo":  # TRL's GRPOConfig 1e-6 for a full model; LoRA's 10x (as SFT's)
            return 1e-6 if self.model.method == "full" else 1e-5
        return 2e-5 if self.model.method == "full" else 2e-4


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


# keys whose YAML value may take more than one shape: what to say when it has another
SHAPES = {"reward": "a list of reward specs, or one", "reward_weights": "a list of numbers, or 'w1,w2,...'",
          "columns": "a mapping of ours: yours (instruction: prompt) or a string OURS=YOURS,...",
          "lora_targets": "a list of module names, a comma-separated string, or all-linear",
          "dataset": "a path (a.jsonl, or a mixture a.jsonl:0.7,b.json:0.3), or a list of sources, each a path or "
                     "{path, weight, columns}",
          "eval_dataset": "a path, or {path, columns}"}


def _column_mapping(value: dict, where: str, forbidden: str = ",=") -> str:
    """A YAML mapping of ours: yours as --columns writes it, each name checked to be one column."""
    for ours, yours in value.items():
        if not isinstance(yours, (str, int, float)) or isinstance(yours, bool) or any(c in str(yours)
                                                                                      for c in forbidden):
            shape = {list: "a list", dict: "a mapping"}.get(type(yours))
            got = f"{shape} ({yours!r})" if shape else repr(yours)
            raise UserError(f"{where}: '{ours}' maps to {got}; a column name must be a string without "
                            f"{' or '.join(repr(c) for c in forbidden)} (one column for each of ours, e.g. "
                            f"{ours}: prompt)")
    return ",".join(f"{k}={v}" for k, v in value.items())


def _dataset_sources(value: Any, where: str) -> str:
    """YAML's list of sources (each a path string or `{path, weight, columns}`; one mapping alone is one
    source) as `toolkit.config.datasets` writes them: a.json:0.5:instruction=prompt;output=response,b.json."""
    from toolkit.config.datasets import source_spec

    out = []
    for entry in value if isinstance(value, list) else [value]:
        if isinstance(entry, str):
            out.append(entry)
            continue
        if not isinstance(entry, dict) or not isinstance(entry.get("path"), str):
            raise UserError(f"{where}: each source is a path or a mapping with a path ({{path: a.jsonl, weight: 0.5, "
                            f"columns: {{instruction: prompt}}}}), got {entry!r}")
        unknown = sorted(set(entry) - {"path", "weight", "columns"})
        if unknown:
            raise UserError(f"{where}: source {entry['path']} has unknown key(s) {', '.join(map(str, unknown))}; a "
                            "source takes path, weight and columns")
        weight, columns = entry.get("weight"), entry.get("columns") or {}
        if weight is not None and (isinstance(weight, bool) or not isinstance(weight, (int, float))):
            raise UserError(f"{where}: source {entry['path']}'s weight must be a number, got {weight!r}")
        if isinstance(columns, str):
            columns = {k: v for k, v in (e.split("=", 1) for e in columns.split(",") if "=" in e)}
        if not isinstance(columns, dict):
            raise UserError(f"{where}: source {entry['path']}'s columns must be a mapping of ours: yours, got "
                            f"{columns!r}")
        _column_mapping(columns, f"{where}: source {entry['path']}'s columns", ",;:=")
        out.append(source_spec(entry["path"], None if weight is None else float(weight), columns))
    return ",".join(out)


def _coerce(key: str, value: Any, origin: str, name: str | None = None) -> Any:
    """Turn a flag string or a YAML value into the field's type, or raise naming the key (as `name`
    where the user wrote another: a YAML key of transformers' Trainer, `ALIASES`)."""
    section, f = _fields()[key]
    tp, optional = _field_type(section, f)
    where = f"--{key.replace('_', '-')}" if origin == "flag" else f"'{name or key}' in {origin}"
    if value is None or (optional and isinstance(value, str) and value.lower() in ("none", "null", "auto")):
        if optional:
            return None
        raise UserError(f"{where} needs a value")
    try:
        if tp is bool:
            if isinstance(value, bool):
                out: Any = value
            elif str(value).lower() in ("1", "true", "yes", "on"):
                out = True
            elif str(value).lower() in ("0", "false", "no", "off"):
                out = False
            else:
                raise ValueError
        elif tp is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            out = int(value) if not isinstance(value, str) else int(value.strip())
        elif tp is float:
            if isinstance(value, bool):
                raise ValueError
            out = float(value)
        else:
            if isinstance(value, (list, tuple)) and key in ("lora_targets", "reward_weights"):
                value = ",".join(map(str, value))
            if isinstance(value, (list, tuple)) and key == "reward":  # one spec per flag or list item (a spec
                value = "\n".join(map(str, value))                    # may hold a comma: a regex)
            if isinstance(value, dict) and key == "columns":
                value = _column_mapping(value, where)
            if isinstance(value, (list, dict)) and key in ("dataset", "eval_dataset"):
                value = _dataset_sources(value, where)
            if not isinstance(value, (str, int, float)):
                raise ValueError
            out = str(value)
    except (TypeError, ValueError):
        kind = SHAPES.get(key) or {bool: "true or false", int: "an integer", float: "a number"}.get(tp, "a string")
        shape = {list: "a list", tuple: "a list", dict: "a mapping"}.get(type(value))
        raise UserError(f"{where} must be {kind}, got " + (f"{shape} ({value!r})" if shape else repr(value))) from None
    choices = f.metadata.get("choices")
    if choices and out is not None and out not in choices:
        names = [str(c) for c in choices]
        hint = difflib.get_close_matches(str(out), names, n=1)
        also = f" (did you mean '{hint[0]}'?)" if hint and hint[0] != str(out) else ""
        raise UserError(f"{where} must be one of {', '.join(names)}; got '{out}'{also}")
    return out


PRECISION_ALIASES = ("bf16", "fp16")  # Trainer's booleans: --bf16 [true|false] -> --mixed-precision bf16


def translate_aliases(argv: list[str], typed: dict[str, str] | None = None) -> list[str]:
    """The flag names people bring from transformers' Trainer, TRL, axolotl and LLaMA-Factory, as ours
    (`toolkit.config.foreign`): `--learning_rate` -> `--lr`, `--output_dir` -> `--output-dir` (underscores
    for any of ours), `--bf16` [true|false] -> `--mixed-precision bf16`, `--load_in_4bit` -> `--method
    qlora`. Only names that are no flag of ours are translated; --help shows ours. `typed` gets our
    flag -> the name typed for it, so a problem is said in the user's words."""
    out: list[Any] = []
    typed = {} if typed is None else typed
    theirs = _their_flags(argv)
    consumed = {FOREIGN[k].reads for k in theirs if FOREIGN[k].reads}  # hub_model_id, read by push_to_hub
    found: dict[str, list[tuple[Any, str]]] = {}  # our key -> (value, as typed) from their flags
    i = 0
    while i < len(argv):
        arg = argv[i]
        name, eq, value = arg[2:].partition("=") if arg.startswith("--") else ("", "", "")
        key = name.replace("-", "_")
        nxt = argv[i + 1] if not eq and i + 1 < len(argv) and not argv[i + 1].startswith("--") else None
        settings, took = _their_flag(key, value if eq else MISSING, nxt, theirs) if name else (None, False)
        if isinstance(settings, str):  # one of ours, given their kind of value (push_to_hub true without a repo)
            raise UserError(f"--{name}{' ' + nxt if took else ''}: {settings}")
        if settings is not None:
            said = f"{arg} {nxt}" if took else arg
            for ours, v in settings.items():
                found.setdefault(ours, []).append((v, said))
                out.append((ours,))  # where it goes: the first of their flags that sets it
            i += 1 + took
            continue
        if key in consumed and key not in _fields():
            i += 1 + (nxt is not None)
            continue
        if name in PRECISION_ALIASES or key in PRECISION_ALIASES:
            if not eq and i + 1 < len(argv) and argv[i + 1].lower() in ("true", "false", "1", "0", "yes", "no"):
                value, i = argv[i + 1], i + 1
            if (value or "true").lower() in ("true", "1", "yes"):
                out += ["--mixed-precision", key]
                typed["--mixed-precision"] = f"--{name}"
        elif name and (key in ALIASES and key not in HINT_ONLY or ("_" in name and key in _fields())):
            ours = f"--{ALIASES.get(key, key).replace('_', '-')}"
            out.append(f"{ours}{eq}{value}")
            typed[ours] = f"--{name}"
        else:
            if name and typed.get(f"--{name}"):  # our own name typed after the other: ours is the one read
                del typed[f"--{name}"]
            out.append(arg)
        i += 1
    flags = {k: _as_flag(k, v) for k, v in _agreed(found, typed).items()}
    return [a for item in out for a in (flags.pop(item[0], []) if isinstance(item, tuple) else [item])]


def _their_flags(argv: list[str]) -> dict[str, Any]:
    """Their options among the flags (`toolkit.config.foreign.FOREIGN`), name -> the value after it
    (None: none), for one that reads another's (`Foreign.reads`: push_to_hub's hub_model_id)."""
    out: dict[str, Any] = {}
    for i, arg in enumerate(argv):
        name, eq, value = arg[2:].partition("=") if arg.startswith("--") else ("", "", "")
        if name.replace("-", "_") in FOREIGN:
            after = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else None
            out[name.replace("-", "_")] = value if eq else after
    return out


def _their_flag(key: str, value: Any, nxt: str | None, theirs: dict[str, Any]) -> tuple[dict | str | None, bool]:
    """(our settings for their flag `--key [value]`, or the line refusing it, or None; whether the
    next argument was its value)."""
    entry = FOREIGN.get(key)
    if entry is None:
        return None, False
    took = value is MISSING and nxt is not None and (not entry.switch or isinstance(normalize(nxt), bool))
    if value is MISSING and nxt is not None and not took and key in _fields():
        return None, False  # ours, with its value: --push_to_hub me/x
    settings = translate(key, nxt if took else value, theirs, ours=key in _fields())
    if isinstance(settings, str) and key not in _fields():
        return None, False  # said as an unknown flag, with what to use instead (`_unknown`)
    return settings, took and settings is not None


def _agreed(found: dict[str, list[tuple[Any, str]]], typed: dict[str, str], where: str = "",
            given: Collection[str] = ()) -> dict[str, Any]:
    """Our settings from what their options set (`found`: our key -> (value, as they wrote it)), where
    they agree or join (`foreign_names.JOINS`: use_peft with load_in_4bit is qlora), else one line each;
    `typed` learns their words for each, except for a key a flag sets (`given`: the flag wins)."""
    out, problems = {}, []
    for key, said in found.items():
        ok, out[key] = joined(key, [v for v, _ in said])
        if not ok:
            problems.append(f"{' and '.join(s for _, s in said)}{where} disagree (--{key.replace('_', '-')} "
                            f"{' vs '.join(str(v) for v, _ in said)}); keep one")
        elif key not in given:  # a problem with the value is said in their words: --load_in_4bit with ZeRO-3 ...
            typed[" ".join(_as_flag(key, out[key]))] = " and ".join(dict.fromkeys(s for _, s in said)) + where
    if problems:
        raise UserError("; ".join(problems))
    return out


def _as_flag(key: str, value: Any) -> list[str]:
    flag = f"--{key.replace('_', '-')}"
    if isinstance(value, bool):
        return [flag if value else f"--no-{flag[2:]}"]
    return [flag, str(value)]


def translate_keys(loaded: dict[str, Any], path: str, typed: dict[str, str], given: dict[str, Any]) -> dict[str, Any]:
    """A YAML file's keys of Trainer, TRL, axolotl or LLaMA-Factory whose values translate (`adapter:
    qlora`, `load_in_4bit: true`, `lr_scheduler_type: cosine`) as ours; the rest as they are (ours,
    `ALIASES`, or unknown: said with what to use instead). Two that disagree are one line, as is one
    that disagrees with our own key in the same file; a flag given wins over both."""
    settings = {k: translate(k, v, loaded, ours=k in _fields()) for k, v in loaded.items()}
    refused = [f"'{k}: {_shown(loaded[k])}' in {path}: {s}" for k, s in settings.items()
               if isinstance(s, str) and k in _fields()]  # theirs are said as unknown keys, with what to use
    if refused:
        raise UserError("; ".join(refused))
    translated = {k: s for k, s in settings.items() if isinstance(s, dict)}
    done = {*translated, *(FOREIGN[k].reads for k in translated if FOREIGN[k].reads)}  # push_to_hub reads hub_model_id
    found: dict[str, list[tuple[Any, str]]] = {}
    for k, ours in translated.items():
        for key, v in ours.items():
            found.setdefault(key, []).append((v, f"'{k}: {_shown(loaded[k])}'"))
    for ours in found:  # our own key in the same file is read with theirs
        if ours in loaded and ours not in done:
            found[ours].append((loaded[ours], f"'{ours}: {_shown(loaded[ours])}'"))
    return {**{k: v for k, v in loaded.items() if k not in done}, **_agreed(found, typed, f" in {path}", given)}


def _shown(value: Any) -> str:
    """A YAML value as the user wrote it: true, not True."""
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


def closest_key(name: str) -> str | None:
    """Our key that does the job of a misspelt or foreign name, if there is one: a foreign name by
    `toolkit.config.foreign`' tables (never by a close spelling of an unrelated key of ours), and a
    near typo of ours or theirs ('lerning_rate' finds 'lr')."""
    return hint(name.lstrip("-").replace("-", "_"), [*_fields(), "config"])[0]


def _unknown(key: str, origin: str) -> UserError:
    ours, instead = hint(key.lstrip("-").replace("-", "_"), [*_fields(), "config"])
    if origin == "flag":
        if instead:
            return UserError(f"{key}: not a flag here; {instead}")
        return UserError(f"unknown flag {key}" + (f" (did you mean --{ours.replace('_', '-')}?)" if ours
                                                   else "; see --help"))
    if instead:
        return UserError(f"'{key}' in {origin}: not a key here; {instead}")
    return UserError(f"unknown key '{key}' in {origin}" + (f" (did you mean '{ours}'?)" if ours
                                                           else "; see python finetune.py --help for the keys"))


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> typing.NoReturn:  # argparse would print usage + exit
        raise UserError(message)


def build_parser(prog: str = "finetune.py") -> argparse.ArgumentParser:
    parser = _Parser(prog=prog, allow_abbrev=False, argument_default=argparse.SUPPRESS,
                     description="Finetune a Hugging Face causal LM. Every flag is also a YAML key "
                                 "(dashes -> underscores) for --config.")
    parser.add_argument("--config", help="YAML file of keys; flags override it")
    for section in dataclasses.fields(Config):
        group = parser.add_argument_group(section.name)
        for key, (sec, f) in _fields().items():
            if sec != section.name:
                continue
            tp, _ = _field_type(sec, f)
            names = [str(c) for c in f.metadata.get("choices", ())]  # shown once, as the metavar
            help_ = f.metadata["help"] + _default_note(f)
            flag = f"--{key.replace('_', '-')}"
            if tp is bool:
                group.add_argument(flag, action=argparse.BooleanOptionalAction, help=help_)
            elif key == "reward":  # given once per function
                group.add_argument(flag, action="append", metavar="SPEC", help=help_)
            else:
                group.add_argument(flag, metavar="{" + ",".join(names) + "}" if names else key.upper(), help=help_)
    return parser


def _default_note(f: dataclasses.Field) -> str:
    """' (default: X)' unless the help already says it, the default is unset, or a switch is off."""
    default = f.default if f.default is not dataclasses.MISSING else None
    if "default" in f.metadata["help"] or default is None or default is False or default == "":
        return ""
    return " (default: on)" if default is True else f" (default: {default})"


def load_yaml(path: str) -> dict[str, Any]:
    """Flat `key: value` YAML; section-nested YAML (`train: {lr: ...}`) is accepted too, where a key
    may leave out its section's prefix (`plan: {gpu: h100}` is `plan_gpu: h100`)."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"--config {path}: file not found")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" line {mark.line + 1}" if mark else ""
        raise UserError(f"--config {path}:{at} is not valid YAML ({getattr(e, 'problem', e)})") from None
    if not isinstance(data, dict):
        raise UserError(f"--config {path}: expected a mapping of keys to values, got {type(data).__name__}")
    sections = {s.name for s in dataclasses.fields(Config)}
    flat: dict[str, Any] = {}
    for k, v in data.items():
        k = str(k).replace("-", "_")
        if k in sections and isinstance(v, dict):
            for kk, vv in v.items():
                kk = str(kk).replace("-", "_")
                flat[f"{k}_{kk}" if kk not in _fields() and f"{k}_{kk}" in _fields() else kk] = vv
        else:
            flat[k] = v
    return flat


def parse_config(argv: list[str] | None = None, prog: str = "finetune.py", check_dataset: bool = True) -> Config:
    """defaults < --config YAML < flags; raises `UserError` for any problem, collected once, naming
    each setting as the user wrote it. `check_dataset=False` leaves the dataset's files unlooked-for
    (`plan --config` reads a recipe on a machine that need not hold its data)."""
    from toolkit.layout.launcher import local_rank_problem, pop_local_rank

    argv = sys.argv[1:] if argv is None else argv
    argv, local_rank, problem = pop_local_rank(argv)  # DeepSpeed's launcher appends --local_rank=K
    problem = problem or local_rank_problem(local_rank, os.environ)
    if problem:
        raise UserError(problem)
    typed: dict[str, str] = {}  # our flag -> what the user wrote for it, where that was another name
    try:
        return _parse(argv, prog, typed, check_dataset)
    except UserError as e:  # said in the user's words: --per_device_train_batch_size, not --micro-batch-size
        raise UserError(_in_typed_words(str(e), typed)) from None


def _in_typed_words(message: str, typed: dict[str, str]) -> str:
    import re

    for ours, theirs in typed.items():
        message = re.sub(re.escape(ours) + r"(?![\w-])", lambda _: theirs, message)
    return message


def _parse(argv: list[str], prog: str, typed: dict[str, str], check_dataset: bool) -> Config:
    parser = build_parser(prog)
    ns, extra = parser.parse_known_args(translate_aliases(argv, typed))
    flags = [a.split("=")[0] for a in extra if a.startswith("-")]
    if flags:  # every unknown flag in one line, not the first of several runs
        raise UserError("; ".join(str(_unknown(f, "flag")) for f in dict.fromkeys(flags)))
    if extra:
        raise UserError(f"unexpected argument '{extra[0]}' (flags take the form --name value)")
    given = vars(ns)
    values: dict[str, Any] = {}
    problems: list[str] = []  # every problem of the YAML and the values, said together in one line
    if "config" in given:
        path = given.pop("config")
        loaded = translate_keys(load_yaml(path), path, typed, given)
        unknown = [k for k in loaded if k not in _fields() and (k not in ALIASES or k in HINT_ONLY)
                   and k not in PRECISION_ALIASES]
        problems += [str(_unknown(k, path)) for k in unknown]
        for k, v in ((k, v) for k, v in loaded.items() if k not in unknown):
            ours = "mixed_precision" if k in PRECISION_ALIASES else ALIASES.get(k, k)
            if ours != k and ours not in given:  # a flag, if given, is what the run reads
                typed.setdefault(f"--{ours.replace('_', '-')}", f"'{k}' in {path}")
            try:
                if k in PRECISION_ALIASES:  # Trainer's bf16: true
                    if _coerce("overwrite_output_dir", v, path, name=k):  # a boolean, read as our booleans are
                        values["mixed_precision"] = k
                    continue
                values[ours] = _coerce(ours, v, path, name=k)
            except UserError as e:  # said with the others; the key keeps its default meanwhile
                problems.append(str(e))
    for k, v in given.items():
        try:
            values[k] = _coerce(k, v, "flag")
        except UserError as e:
            problems.append(str(e))
    settings, notes = _Settings(values), []
    adopted = _adopt_launcher(settings, set(values), notes) or _adopt_deepspeed_file(settings, set(values), notes)
    if adopted:
        raise UserError("; ".join(problems + adopted))
    cfg = Config.from_values({k: v for k, v in settings.items() if k in _fields()}, tuple(notes))
    checked = validate(cfg)
    if not check_dataset:
        files = dataset_problems(cfg.data.dataset) + eval_dataset_problems(cfg.data.eval_dataset, cfg.data.eval_split)
        checked = [p for p in checked if p not in files]
    if problems + checked:
        raise UserError("; ".join(problems + checked))
    return cfg


def validate(cfg: Config) -> list[str]:
    """Cross-field and range checks; returns every problem found (empty list = fine). Which layouts
    may run is `toolkit.layout.rules`' to say."""
    p: list[str] = []
    m, d, t, o = cfg.model, cfg.data, cfg.train, cfg.output

    def need(cond: bool, msg: str) -> None:
        if not cond:
            p.append(msg)

    need(m.lora_r > 0, f"--lora-r must be > 0 (got {m.lora_r})")
    need(m.lora_alpha > 0, f"--lora-alpha must be > 0 (got {m.lora_alpha})")
    need(0.0 <= m.lora_dropout < 1.0, f"--lora-dropout must be in [0, 1) (got {m.lora_dropout})")
    need(bool(m.lora_targets.strip(", ")), "--lora-targets is empty (use 'all-linear' or module names)")
    need(d.seq_len >= 8, f"--seq-len must be >= 8 (got {d.seq_len})")
    need(0.0 <= d.eval_split < 1.0, f"--eval-split must be in [0, 1) (got {d.eval_split})")
    need(t.micro_batch_size >= 1, f"--micro-batch-size must be >= 1 (got {t.micro_batch_size})")
    need(t.grad_accum >= 1, f"--grad-accum must be >= 1 (got {t.grad_accum})")
    need(t.lr is None or t.lr > 0, f"--lr must be > 0 (got {t.lr})")
    need(t.warmup_steps >= 0, f"--warmup-steps must be >= 0 (got {t.warmup_steps})")
    need(t.weight_decay >= 0, f"--weight-decay must be >= 0 (got {t.weight_decay})")
    need(t.max_grad_norm >= 0, f"--max-grad-norm must be >= 0 (got {t.max_grad_norm})")
    need(t.epochs >= 1 or t.max_steps > 0, f"--epochs must be >= 1 (got {t.epochs})")
    need(t.max_steps != 0, "--max-steps must be > 0, or -1 to use --epochs")
    need(o.log_every >= 0, f"--log-every must be >= 0 (got {o.log_every}; 0 = about 50 records per run)")
    need(o.sample_every >= 0, f"--sample-every must be >= 0 (got {o.sample_every})")
    need(o.sample_max_new_tokens >= 1, f"--sample-max-new-tokens must be >= 1 (got {o.sample_max_new_tokens})")
    held_out = d.eval_split > 0 or bool(d.eval_dataset)
    need(not (o.eval_on_start and not held_out),
         "--eval-on-start needs held-out data: set --eval-split (for example 0.05) or --eval-dataset FILE")
    p.extend(tracker_problems(o.report_to))
    p.extend(sample_problems(o.sample_prompts, cfg.parallel.pp, cfg.parallel.cp))
    need(o.eval_every >= 0, f"--eval-every must be >= 0 (got {o.eval_every})")
    need(o.save_every >= 0, f"--save-every must be >= 0 (got {o.save_every})")
    need(o.keep_last >= 0, f"--keep-last must be >= 0 (got {o.keep_last})")
    need(t.max_bad_steps >= 1, f"--max-bad-steps must be >= 1 (got {t.max_bad_steps})")
    need(not (o.resume and o.overwrite_output_dir),
         "--resume and --overwrite-output-dir contradict each other (overwriting deletes the checkpoints); drop one")
    need(not (o.eval_every > 0 and not held_out),
         "--eval-every needs held-out data: set --eval-split (for example 0.05) or --eval-dataset FILE")
    from toolkit.layout.launcher import nproc_problem

    p.extend(x for x in [nproc_problem(cfg.parallel.nproc_per_node, os.environ)] if x)
    p.extend(layout_problems(cfg.parallel, m.method, t.mixed_precision, t.loss, t.micro_batch_size, t.compile is True, m.attn,
                             t.objective if generates(t.objective) else None))
    p.extend(objective_problems(cfg))
    blocked = padding_free_blocked(cfg)
    need(not (d.padding_free and blocked), f"--padding-free: {blocked}; drop it (the batches are padded there)")
    if d.data_workers < 0:
        p.append(f"--data-workers must be >= 0 (0 = the node's cores; got {d.data_workers})")
    if d.streaming:
        p.extend(streaming_problems(d.dataset, d.eval_split, t.max_steps))
    p.extend(column_problems(d.columns))
    p.extend(template_problems(m.chat_template))
    p.extend(repo_problems(o.push_to_hub))
    need(not (o.hub_private and not o.push_to_hub), "--hub-private goes with --push-to-hub REPO")
    p.extend(unused_columns_problems(d.columns, d.dataset, d.eval_dataset))
    p.extend(dataset_problems(d.dataset))
    p.extend(eval_dataset_problems(d.eval_dataset, d.eval_split))
    p.extend(output_dir_problems(o.output_dir, o.overwrite_output_dir, o.resume, o.continue_finished, t.max_steps))
    return p


def padding_free_blocked(cfg: Config) -> str | None:
    """Why this run's micro-batches cannot reach the model padding-free (None: they can): a layout that cuts
    the collated rows (a row of a micro-batch's examples end to end cannot be split into pipeline micro-batches,
    and context parallel's slices run the model's own attention), or batches the loader does not make."""
    p = cfg.parallel
    if p.pp > 1:
        return f"--pp {p.pp} splits each micro-batch's rows into pipeline micro-batches"
    if p.cp > 1:
        return f"--cp {p.cp} cuts each row into slices, attended by the model's own attention"
    if cfg.train.objective == "grpo":
        return "--objective grpo trains on sampled completions, not on the loader's batches"
    return None


class _Settings(dict):
    """The flat key -> value settings being resolved (flags and YAML so far); a key not set reads
    as its default. What a launcher or a --deepspeed file fixes is written here before the frozen
    `Config` is built from it."""

    def __missing__(self, key: str) -> Any:
        section, f = _fields()[key]
        return f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]


def _adopt_launcher(values: _Settings, given: set[str], notes: list[str]) -> list[str]:
    """`accelerate launch --use_deepspeed/--use_fsdp`, or an accelerate config naming DeepSpeed or FSDP,
    must agree with our flags. What only the launcher says is adopted (an accelerate config alone
    works) and said in one line (`notes`); a flag the user gave that disagrees is refused. Returns the
    refusals; (stage, launcher) beside a --deepspeed file is left in `values` for `_adopt_deepspeed_file`."""
    from toolkit.layout.launcher import (accelerate_fsdp_sharding, launch_source, single_process_launch,
                                         single_process_refusal)

    env = os.environ
    if single_process_launch(env):
        return [single_process_refusal()]
    deepspeed = env.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true"
    fsdp = env.get("ACCELERATE_USE_FSDP", "").lower() == "true"
    if not (deepspeed or fsdp):
        return []
    source = launch_source(env)
    says = "DeepSpeed" if deepspeed else "FSDP"
    if values["strategy"] == "auto":
        return [f"{source} says {says}, and --strategy auto picks the layout itself; drop one of them"]
    adopted: list[str] = []
    precision = env.get("ACCELERATE_MIXED_PRECISION", "no")
    if precision in ("bf16", "fp16") and "mixed_precision" not in given:
        values["mixed_precision"] = precision  # "no" is also what accelerate says when nobody chose
        adopted.append(precision)
    if fsdp:
        if values["zero_stage"] is not None or values["deepspeed"]:
            asked = f"--zero-stage {values['zero_stage']}" if values["zero_stage"] is not None \
                else f"--deepspeed {values['deepspeed']}"
            return [f"{source} says FSDP, {asked} asks for DeepSpeed; drop one of them"]
        values["fsdp"] = True
        sharding, problem = accelerate_fsdp_sharding(env)
        if problem:
            return [f"{source} {problem}"]
        if "fsdp_sharding" in given and values["fsdp_sharding"] != sharding:
            return [f"{source} says FSDP with {sharding} sharding, --fsdp-sharding {values['fsdp_sharding']} "
                    "disagrees; drop one of them"]
        values["fsdp_sharding"] = sharding
        notes.append(f"layout: FSDP2, {sharding} sharding, from {source}"
                     + (f"; {', '.join(adopted)} from it too" if adopted else ""))
        return []
    if "fsdp" in given and values["fsdp"]:
        return [f"{source} says DeepSpeed, --fsdp asks for FSDP; drop one of them"]
    ds_file = env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")
    if ds_file not in ("", "none"):  # the config names a DeepSpeed JSON: read as --deepspeed FILE
        if values["deepspeed"] and Path(values["deepspeed"]).resolve() != Path(ds_file).resolve():
            return [f"{source} names DeepSpeed config {ds_file}, --deepspeed names {values['deepspeed']}; "
                    "drop one of them"]
        values["deepspeed"] = ds_file
        values[_NAMED_BY] = source
        return []
    if values["deepspeed"]:  # the file decides the stage; a stage the launcher was given must agree with it
        named = env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE")
        values[_LAUNCHER_STAGE] = (int(named), source) if named not in (None, "") else None
        return []
    stage = int(env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2"))  # accelerate's default stage
    if values["zero_stage"] is not None and values["zero_stage"] != stage:
        return [f"{source} says ZeRO-{stage}, --zero-stage {values['zero_stage']} disagrees; drop one of them"]
    values["zero_stage"] = stage
    optim = env.get("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "none")
    offload = "optimizer+param" if env.get("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "none") not in ("none", "") \
        else "optimizer" if optim not in ("none", "") else "none"
    if "offload" in given and values["offload"] != offload:
        return [f"{source} says offload {offload}, --offload {values['offload']} disagrees; drop one of them"]
    values["offload"] = offload
    what = f"ZeRO-{stage}" + ("" if offload == "none" else f" with {offload} offload")
    notes.append(f"layout: {what} from {source}" + (f"; {', '.join(adopted)} from it too" if adopted else ""))
    return []


# set by `_adopt_launcher` for `_adopt_deepspeed_file`, not config keys: the accelerate config that named
# the --deepspeed file, and the (stage, launcher) a launcher gave beside one
_NAMED_BY, _LAUNCHER_STAGE = "_deepspeed_named_by", "_deepspeed_launcher_stage"

# a --deepspeed file's settings -> the DeepSpeed key that sets them (for messages)
DS_KEYS = {"zero_stage": "zero_optimization.stage", "offload": "zero_optimization.offload_optimizer/offload_param",
           "micro_batch_size": "train_micro_batch_size_per_gpu", "grad_accum": "gradient_accumulation_steps",
           "max_grad_norm": "gradient_clipping", "mixed_precision": "bf16/fp16 enabled", "lr": "optimizer.params.lr",
           "weight_decay": "optimizer.params.weight_decay"}


def _adopt_deepspeed_file(values: _Settings, given: set[str], notes: list[str]) -> list[str]:
    """`--deepspeed FILE`: DeepSpeed's own checks on the file first; then every setting it fixes is
    adopted where no flag set it, and a flag that disagrees is refused (one line each)."""
    path = values["deepspeed"]
    if not path:
        return []
    from toolkit.layout.deepspeed import (compiles_cpu_adam, deepspeed_accelerator, file_settings, fp16_problem,
                                          read_user_config, torch_adam_note, user_config_problems)

    try:
        ds = read_user_config(path)
    except UserError as e:
        return [str(e)]
    problems = user_config_problems(ds, path)
    if problems:
        return problems
    if values["fsdp"]:
        return [f"--deepspeed {path} with --fsdp: both shard the model; choose one"]
    if values["strategy"] == "auto":
        return [f"--deepspeed {path} with --strategy auto: the planner picks the sharding itself; drop one of them"]
    settings = file_settings(ds)
    launcher = values.get(_LAUNCHER_STAGE)
    if launcher and launcher[0] != settings["zero_stage"]:
        return [f"{launcher[1]} says ZeRO-{launcher[0]}, --deepspeed {path} says stage {settings['zero_stage']}; "
                "drop one of them"]
    adopted = []
    for key, value in settings.items():
        value = _coerce(key, value, f"--deepspeed {path} ({DS_KEYS[key]})")
        current = values[key]
        if key in given or (key == "zero_stage" and current is not None):
            if current != value:
                problems.append(f"--deepspeed {path} sets {DS_KEYS[key]} to {value}, --{key.replace('_', '-')} "
                                f"{current} disagrees; drop one of them")
            continue
        if current != value:
            adopted.append(f"{key.replace('_', ' ')} {value}")
        values[key] = value
    ranks = int(os.environ.get("WORLD_SIZE", "1"))
    want = values["micro_batch_size"] * values["grad_accum"] * ranks
    if isinstance(ds.get("train_batch_size"), int) and ds["train_batch_size"] != want:
        problems.append(f"--deepspeed {path}: train_batch_size {ds['train_batch_size']} is not micro batch "
                        f"{values['micro_batch_size']} x accumulation {values['grad_accum']} x {ranks} ranks = {want}; "
                        "set it to \"auto\" or make them agree")
    device, runs_fp16 = deepspeed_accelerator()
    if values["mixed_precision"] == "fp16" and not runs_fp16:
        problems.append(fp16_problem(path, settings.get("mixed_precision") == "fp16", device))
    if not problems:
        named_by = values.get(_NAMED_BY)
        where = f"DeepSpeed config {path}, named by {named_by}" if named_by else f"--deepspeed {path}"
        also = [a for a in adopted if not a.startswith("zero")]
        notes.append(f"layout: ZeRO-{values['zero_stage']} from {where}" + (f"; also from the file: {', '.join(also)}"
                                                                            if also else ""))
        if device == "cpu" and compiles_cpu_adam(ds):  # swapped in `parallel.build.run_deepspeed_config`
            notes.append(torch_adam_note(path, ds))
    return problems


def save_config(cfg: Config, path: Path) -> None:
    """Write the resolved config as flat YAML that `--config` reads back to the same run."""
    flat = cfg.flat()
    flat["lr"] = cfg.lr
    try:
        path.write_text(yaml.safe_dump(flat, sort_keys=False))
    except OSError as e:  # a write names no file: this one is said with its path (toolkit.errors)
        raise OSError(e.errno, e.strerror, str(path)) from None
