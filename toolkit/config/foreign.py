"""The option names people bring from transformers' Trainer, TRL, axolotl and LLaMA-Factory, and what
each one means here: taken as one of ours with its value as it is (`ALIASES`), taken with its value
translated (`FOREIGN`: `load_in_4bit: true` is `--method qlora`), or refused in one line that says
what to use instead (`Foreign.instead`: `neftune_noise_alpha`).

A hint names only a flag that does the same job. A foreign name is looked up here by its exact name;
a close spelling counts only as a typo of one of these names or of ours (`near_typo`: a letter or
two wrong), never as a word two unrelated names share: `eval_strategy` is not `--strategy`,
`val_set_size` is `--eval-split`, not `--eval-every`. Pure data and the standard library: the config
layer reads it (`toolkit.config.parse.translate_aliases`, `translate_keys`, `closest_key`).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

# Their name -> ours, the value taken as it is (transformers' Trainer, TRL, axolotl, LLaMA-Factory).
ALIASES = {
    "learning_rate": "lr", "per_device_train_batch_size": "micro_batch_size", "batch_size": "micro_batch_size",
    "gradient_accumulation_steps": "grad_accum", "num_train_epochs": "epochs", "num_epochs": "epochs",
    "max_seq_length": "seq_len", "max_length": "seq_len", "sequence_len": "seq_len", "cutoff_len": "seq_len",
    "model_name_or_path": "model", "base_model": "model", "lora_rank": "lora_r", "lora_target_modules": "lora_targets",
    "lora_target": "lora_targets", "warmup": "warmup_steps", "bf16": "mixed_precision", "fp16": "mixed_precision",
    "save_steps": "save_every", "logging_steps": "log_every", "resume_from_checkpoint": "resume",
    "eval_steps": "eval_every", "save_total_limit": "keep_last", "val_set_size": "eval_split", "val_size": "eval_split",
    "train_on_inputs": "train_on_prompt", "sample_packing": "packing", "neat_packing": "packing",
    "dataset_num_proc": "data_workers", "preprocessing_num_workers": "data_workers",
    "dataset_processes": "data_workers", "data_processes": "data_workers", "default_system": "system_prompt",
    "default_system_message": "system_prompt", "chat_template_path": "chat_template",
    "chat_template_jinja": "chat_template", "pref_beta": "beta", "rl_beta": "beta", "dpo_beta": "beta",
    "orpo_alpha": "beta", "activation_checkpointing": "gradient_checkpointing", "tensor_parallel_size": "tp",
    "context_parallel_size": "cp", "sequence_parallel_degree": "cp", "hub_private_repo": "hub_private",
    "eval_max_new_tokens": "sample_max_new_tokens", "importance_sampling_level": "importance_sampling",
}
# suggested, not taken: ambiguous (global or per device? steps or a ratio? eval generations or samples?)
HINT_ONLY = {"batch_size", "warmup", "lora_rank", "eval_max_new_tokens"}


class _From(str):
    """A value read from another of their options (`push_to_hub: true` pushes to `hub_model_id`)."""


class Foreign:
    """What one of their options means here. `values`: their value (normalized: `normalize`) -> our
    settings ({} = nothing to set: it is what runs here anyway); a value not listed is refused with
    `instead`, or, for a name in `ALIASES` or one of ours, taken as it is. (A plain class: building a
    dataclass at import cost flag parsing ~10 ms on 2 cores.)"""
    __slots__ = ("values", "instead", "hint", "switch", "words", "reads")

    def __init__(self, values: Mapping[Any, Mapping[str, Any]] | None = None, instead: str = "", hint: str = "",
                 switch: bool = False, words: bool = False, reads: str = ""):
        self.values = values or {}
        # what to use here: said for a value with no counterpart
        self.instead = instead
        # our key that does the same job, named in a hint
        self.hint = hint
        # a boolean option: a bare --name is true
        self.switch = switch
        # a list of words (a YAML list, or space/comma separated), each looked up in `values` another of their options
        # this one takes its value from (`_From`)
        self.words = words
        self.reads = reads


_METHOD = "--method lora (or qlora: the base in 4-bit NF4) trains a LoRA adapter, --method full every weight"
_ATTN = "--attn sdpa, flex, varlen or flash (flash-attn), or auto"
_OBJECTIVE = "--objective sft, dpo, orpo, simpo, kto or grpo picks what is trained"
_NEFTUNE = "NEFTune (noise on the embeddings) is not implemented here; remove it"
# off, or left empty: nothing to set
_NO = {False: {}, None: {}}
_SCHEDULE = Foreign({"cosine": {"lr_schedule": "cosine"}, "linear": {"lr_schedule": "linear"},
                     "constant": {"lr_schedule": "constant"}},
                    "--lr-schedule cosine, linear or constant (cosine and linear warm up over --warmup-steps; "
                    "constant has no warm-up)", hint="lr_schedule")

FOREIGN: dict[str, Foreign] = {
    # what trains: LoRA, QLoRA or every weight
    "adapter": Foreign({"lora": {"method": "lora"}, "qlora": {"method": "qlora"}, None: {"method": "full"},
                        "": {"method": "full"}},
                       "axolotl's adapter is --method here: lora or qlora (none: --method full)",
                       hint="method"),
    "load_in_4bit": Foreign({True: {"method": "qlora"}, **_NO}, "--method qlora loads the base in 4-bit NF4 under LoRA",
                            hint="method", switch=True),
    "use_peft": Foreign({True: {"method": "lora"}, False: {"method": "full"}, None: {}}, _METHOD, hint="method",
                        switch=True),
    "finetuning_type": Foreign({"lora": {"method": "lora"}, "full": {"method": "full"}},
                               f"{_METHOD}; freeze and oft are not implemented", hint="method"),
    "quantization_bit": Foreign({4: {"method": "qlora"}, None: {}}, "--method qlora loads the base in 4-bit NF4; "
                                "there is no 8-bit base here", hint="method"),
    "load_in_8bit": Foreign(_NO, "there is no 8-bit base here: --method qlora loads it in 4-bit NF4, --method lora "
                            "in the run's precision", switch=True),
    "bnb_4bit_quant_type": Foreign({"nf4": {}, None: {}}, "--method qlora quantizes to NF4 only"),
    # qlora: always double-quantized
    "use_bnb_nested_quant": Foreign({True: {}, False: {}, None: {}}, switch=True),
    "use_dora": Foreign(_NO, "DoRA is not implemented: --method lora trains plain LoRA", switch=True),
    "peft_use_dora": Foreign(_NO, "DoRA is not implemented: --method lora trains plain LoRA", switch=True),
    "use_rslora": Foreign(_NO, "rsLoRA is not implemented: LoRA scales by --lora-alpha / --lora-r", switch=True),
    "peft_use_rslora": Foreign(_NO, "rsLoRA is not implemented: LoRA scales by --lora-alpha / --lora-r", switch=True),
    "lora_task_type": Foreign({"causal_lm": {}, None: {}}, "only causal LMs train here"),
    "lora_modules_to_save": Foreign({None: {}}, "modules_to_save is not implemented: under --method lora only the "
                                    "adapters train (--method full trains every weight)"),
    "lora_target_linear": Foreign({True: {"lora_targets": "all-linear"}, **_NO}, "--lora-targets all-linear",
                                  hint="lora_targets", switch=True),
    # other values: module names, as ours
    "lora_target": Foreign({"all": {"lora_targets": "all-linear"}}),
    "adapter_name_or_path": Foreign({None: {}}, "--model ADAPTER_FOLDER trains on a LoRA adapter (its base is read "
                                    "from it)"),
    "lora_model_dir": Foreign({None: {}}, "--model ADAPTER_FOLDER trains on a LoRA adapter (its base is read from it)"),
    "dtype": Foreign({"auto": {}, None: {}}, "the weights' dtype follows --mixed-precision here (bf16 or fp16: a LoRA "
                     "base is loaded in it)"),
    "torch_dtype": Foreign({"auto": {}, None: {}}, "the weights' dtype follows --mixed-precision here (bf16 or fp16: a "
                           "LoRA base is loaded in it)"),
    # axolotl's; true/false: Trainer's switch
    "bf16": Foreign({"auto": {"mixed_precision": "auto"}}),
    "model_type": Foreign({"automodelforcausallm": {}, None: {}}, "the model's class comes from its config.json here"),
    "tokenizer_type": Foreign({"autotokenizer": {}, None: {}}, "the tokenizer comes from the model folder here"),
    # the schedule and the optimizer
    "lr_scheduler_type": _SCHEDULE,
    # axolotl's
    "lr_scheduler": _SCHEDULE,
    "warmup_ratio": Foreign({0: {"warmup_steps": 0}, None: {}}, "--warmup-steps counts optimizer steps: give the "
                            "ratio x the run's steps", hint="warmup_steps"),
    "optim": Foreign({"adamw_torch": {}, "adamw_torch_fused": {}, "adamw_hf": {}, "adamw": {}, None: {}},
                     "the optimizer here is torch's AdamW (betas 0.9, 0.999, eps 1e-8); 8-bit, paged and other "
                     "optimizers are not implemented"),
    "adam_beta1": Foreign({0.9: {}}, "AdamW's betas are 0.9, 0.999 here (a --deepspeed file's optimizer section "
                          "sets its own)"),
    "adam_beta2": Foreign({0.999: {}}, "AdamW's betas are 0.9, 0.999 here (a --deepspeed file's optimizer section "
                          "sets its own)"),
    "adam_epsilon": Foreign({1e-8: {}}, "AdamW's eps is 1e-8 here (a --deepspeed file's optimizer section sets its "
                            "own)"),
    "label_smoothing_factor": Foreign({0: {}}, "label smoothing of the token loss is not implemented "
                                      "(--label-smoothing is conservative DPO's)"),
    "neftune_noise_alpha": Foreign({None: {}}, _NEFTUNE),
    "noisy_embedding_alpha": Foreign({None: {}}, _NEFTUNE),
    "torch_compile": Foreign({True: {"compile": True}, False: {"compile": False}}, hint="compile", switch=True),
    "use_liger_kernel": Foreign({True: {"kernels": "liger"}, **_NO}, hint="kernels", switch=True),
    "enable_liger_kernel": Foreign({True: {"kernels": "liger"}, **_NO}, hint="kernels", switch=True),
    "liger_rope": Foreign({True: {"kernels": "liger"}, **_NO}, hint="kernels", switch=True),
    "liger_rms_norm": Foreign({True: {"kernels": "liger"}, **_NO}, hint="kernels", switch=True),
    "liger_glu_activation": Foreign({True: {"kernels": "liger"}, **_NO}, hint="kernels", switch=True),
    "liger_fused_linear_cross_entropy": Foreign({True: {"loss": "liger"}, **_NO}, hint="loss", switch=True),
    "auto_find_batch_size": Foreign(_NO, "--strategy auto picks a batch split that fits (on one process it also "
                                    "falls back after an out-of-memory)", switch=True),
    # attention
    "attn_implementation": Foreign({"sdpa": {"attn": "sdpa"}, "flash_attention_2": {"attn": "flash"},
                                    "flex_attention": {"attn": "flex"}, None: {}}, _ATTN, hint="attn"),
    "flash_attn": Foreign({"auto": {"attn": "auto"}, "fa2": {"attn": "flash"}, "sdpa": {"attn": "sdpa"}}, _ATTN,
                          hint="attn"),
    "flash_attention": Foreign({True: {"attn": "flash"}, **_NO}, hint="attn", switch=True),
    "sdp_attention": Foreign({True: {"attn": "sdpa"}, **_NO}, hint="attn", switch=True),
    "flex_attention": Foreign({True: {"attn": "flex"}, **_NO}, hint="attn", switch=True),
    "s2_attention": Foreign(_NO, "shifted sparse attention (LongLoRA's) is not implemented", switch=True),
    "shift_attn": Foreign(_NO, "shifted sparse attention (LongLoRA's) is not implemented", switch=True),
    "xformers_attention": Foreign(_NO, f"xformers is not offered: {_ATTN}", hint="attn", switch=True),
    # when to evaluate, save, log
    "eval_strategy": Foreign(_NO, "--eval-every N evaluates every N steps (with --eval-split); there is no "
                             "per-epoch eval", hint="eval_every"),
    "evaluation_strategy": Foreign(_NO, "--eval-every N evaluates every N steps (with --eval-split); there is no "
                                   "per-epoch eval", hint="eval_every"),
    "evals_per_epoch": Foreign({None: {}}, "--eval-every N counts steps between evals", hint="eval_every"),
    "save_strategy": Foreign(_NO, "--save-every N saves a checkpoint every N steps; there is no per-epoch saving",
                             hint="save_every"),
    "saves_per_epoch": Foreign({None: {}}, "--save-every N counts steps between checkpoints", hint="save_every"),
    "logging_strategy": Foreign({"steps": {}}, "--log-every N writes a metrics record every N steps",
                                hint="log_every"),
    "local_rank": Foreign({None: {}, -1: {}}, "the launcher gives each process its rank (LOCAL_RANK); remove it"),
    "do_train": Foreign({True: {}}, "finetune.py always trains; remove do_train"),
    "do_eval": Foreign(_NO, "--eval-split F holds out a fraction of the data for the eval loss"),
    "save_safetensors": Foreign({True: {}}, "weights are always saved as safetensors"),
    # loss.png is always written
    "plot_loss": Foreign({True: {}, False: {}}, switch=True),
    # a folder: as ours
    "resume_from_checkpoint": Foreign({True: {"resume": "auto"}, **_NO}),
    "auto_resume_from_checkpoints": Foreign({True: {"resume": "auto"}, **_NO}, hint="resume", switch=True),
    "fsdp": Foreign({"full_shard": {"fsdp": True, "fsdp_sharding": "full"},
                     "shard_grad_op": {"fsdp": True, "fsdp_sharding": "grad_op"},
                     "hybrid_shard": {"fsdp": True, "fsdp_sharding": "hybrid"}, "auto_wrap": {}},
                    "--fsdp shards with FSDP2, --fsdp-sharding full, grad_op or hybrid; CPU offload is DeepSpeed's "
                    "here (--zero-stage 3 --offload optimizer+param)", words=True),
    "fsdp_version": Foreign({2: {}, None: {}}, "FSDP here is FSDP2 (--fsdp)"),
    # a YAML list: ours, comma-separated
    "report_to": Foreign(words=True),
    # data
    "datasets": Foreign(instead="axolotl's datasets list is not read: --dataset FILE (several, weighted: "
                        "a.jsonl:0.7,b.jsonl:0.3); the format is detected from the columns, --columns maps yours",
                        hint="dataset"),
    "dataset_text_field": Foreign({"text": {}}, "--columns text=FIELD reads your column as the text", hint="columns"),
    "completion_only_loss": Foreign({True: {}, None: {}, False: {"train_on_prompt": True}}, hint="train_on_prompt",
                                    switch=True),
    "assistant_only_loss": Foreign({True: {}, False: {}, None: {}}, hint="train_on_prompt", switch=True),
    "interleave_probs": Foreign(instead="--dataset a.jsonl:0.7,b.jsonl:0.3 samples the files by weight"),
    "template": Foreign(instead="LLaMA-Factory's template names are not read here: the tokenizer's own chat "
                        "template is used, and --chat-template FILE (or a template name the tokenizer carries) "
                        "picks another", hint="chat_template"),
    # axolotl's; others: ours
    "chat_template": Foreign({"tokenizer_default": {"chat_template": ""}}),
    # preference objectives
    "rl": Foreign({"dpo": {"objective": "dpo"}, "orpo": {"objective": "orpo"}, "simpo": {"objective": "simpo"},
                   "kto": {"objective": "kto"}, "grpo": {"objective": "grpo"}, None: {}},
                  f"{_OBJECTIVE}; ipo is not implemented", hint="objective"),
    "stage": Foreign({"sft": {"objective": "sft"}, "dpo": {"objective": "dpo"}, "kto": {"objective": "kto"}},
                     f"{_OBJECTIVE}; pt, rm and ppo are not implemented", hint="objective"),
    "pref_loss": Foreign({"sigmoid": {"objective": "dpo"}, "orpo": {"objective": "orpo"},
                          "simpo": {"objective": "simpo"}}, f"{_OBJECTIVE}; other losses are not implemented",
                         hint="objective"),
    # online RL
    "log_completions": Foreign({True: {}, False: {}, None: {}}, "--objective grpo always writes completions.jsonl; "
                               "--log-completions-every N sets how often", hint="log_completions_every", switch=True),
    # the hub
    "push_to_hub": Foreign({True: {"push_to_hub": _From("hub_model_id")}, **_NO},
                           "it takes the repo here: --push-to-hub USER/NAME (or Trainer's push_to_hub: true with "
                           "hub_model_id: USER/NAME)",
                           switch=True, reads="hub_model_id"),
    "hub_model_id": Foreign(instead="hub_model_id names push_to_hub's repo and uploads nothing by itself: "
                            "--push-to-hub USER/NAME uploads final/ there", hint="push_to_hub"),
    "hub_token": Foreign({None: {}}, "the token is never a setting here: log in with `hf auth login` or set HF_TOKEN"),
    "hub_strategy": Foreign({"end": {}, None: {}}, "--push-to-hub uploads final/ once, at the end"),
    "export_dir": Foreign({None: {}}, "python -m toolkit merge --adapter OUTPUT_DIR/final --output DIR writes the "
                          "merged model"),
    "per_device_eval_batch_size": Foreign({None: {}}, "eval runs in batches of --micro-batch-size"),
    "eval_batch_size": Foreign({None: {}}, "eval runs in batches of --micro-batch-size"),
}

# Two of their options that set one of ours to different values, read together: stage dpo with
# pref_loss orpo is ORPO; use_peft with load_in_4bit is QLoRA.
JOINS = {("method", frozenset({"lora", "qlora"})): "qlora", ("objective", frozenset({"dpo", "orpo"})): "orpo",
         ("objective", frozenset({"dpo", "simpo"})): "simpo"}

# a flag given without a value
MISSING = object()


def normalize(value: Any) -> Any:
    """Their value as `FOREIGN` lists it: YAML's and the command line's true/false/yes/no as booleans,
    numbers as numbers (YAML reads 1e-8 as a string), other text lower-case."""
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("true", "yes", "on"):
            return True
        if text in ("false", "no", "off"):
            return False
        if text in ("none", "null", "~"):
            return None
        try:
            number = float(text)
        except ValueError:
            return text
        return int(number) if number.is_integer() else number
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _looked_up(entry: Foreign, value: Any) -> Mapping[str, Any] | None:
    try:
        return entry.values.get(normalize(value))
    # a mapping or a list: not a value any entry lists
    except TypeError:
        return None


def translate(name: str, value: Any, theirs: Mapping[str, Any], ours: bool = False) -> dict[str, Any] | str | None:
    """Our settings for their `name: value`, or the line that refuses it (`Foreign.instead`), or None
    where it is not theirs to translate: a name of neither table, a value of our own kind where
    `ours` (`name` is also our key: `fsdp`, `push_to_hub`), or one taken as `ALIASES` says
    (`lora_target: q_proj,v_proj`). `theirs`: every option they gave, for `Foreign.reads`."""
    entry = FOREIGN.get(name)
    if entry is None:
        return None
    if value is MISSING:
        if not entry.switch:
            return None
        value = True
    found = _words(entry, value, name) if entry.words else _looked_up(entry, value)
    if found is None:
        return None if name in ALIASES or (ours and not _their_kind(entry, value)) else entry.instead or None
    if any(isinstance(v, _From) and not theirs.get(v) for v in found.values()):
        return entry.instead
    return {k: theirs[v] if isinstance(v, _From) else v for k, v in found.items()}


def _words(entry: Foreign, value: Any, name: str) -> dict[str, Any] | None:
    if isinstance(value, bool) or not isinstance(value, (str, list, tuple)):
        return None
    words = value.replace(",", " ").split() if isinstance(value, str) else list(value)
    # a list of our values, which we write comma-separated: report_to: [wandb, tensorboard]
    if not entry.values:
        return {name: ",".join(map(str, words))} if isinstance(value, (list, tuple)) else None
    out: dict[str, Any] = {}
    for word in words:
        found = _looked_up(entry, word)
        if found is None:
            return None
        out.update(found)
    return out


def _their_kind(entry: Foreign, value: Any) -> bool:
    """Whether a value of one of our keys is of the kind their option of that name takes (a boolean
    for a switch, text or a list of words), so that one not translated is refused, not taken as ours."""
    if entry.switch:
        return isinstance(normalize(value), bool)
    if entry.words:
        return isinstance(value, (list, tuple)) or (isinstance(value, str) and not isinstance(normalize(value), bool))
    return False


def joined(key: str, values: Iterable[Any]) -> tuple[bool, Any]:
    """(whether they agree, the value) of several settings of our `key` from their options (and ours)."""
    values = list(values)
    distinct = {repr(v) if isinstance(v, (list, tuple, dict)) else normalize(v) for v in values}
    if len(distinct) == 1:
        return True, values[0]
    join = JOINS.get((key, frozenset(distinct)))
    return join is not None, join


def near_typo(name: str, candidates: Iterable[str]) -> str | None:
    """The candidate `name` misspells: the nearest within `typos(candidate)` letters dropped, added,
    changed or swapped (`lerning_rate`, `grad_acum`, `max_stepz`), or the one it is the start of, cut
    at a word (`micro_batch` for `micro_batch_size`). A whole word more or less is another name
    (`eval_strategy` is not `strategy`, `vllm_tensor_parallel_size` not `tensor_parallel_size`)."""
    candidates = list(candidates)
    near = sorted((edits(name, c), c) for c in candidates if abs(len(c) - len(name)) <= typos(c))
    near = [(d, c) for d, c in near if d <= typos(c)]
    if near:
        return near[0][1]
    starts = [c for c in candidates if len(name) >= 5 and c.startswith(name + "_")]
    return starts[0] if len(starts) == 1 else None


def typos(word: str) -> int:
    """How many slips a name of this length may carry and still be recognised: none in a name of 3
    letters or fewer (tp, cp, lr differ by one), one up to 10 (local_rank is not lora_rank), two up to
    20, three beyond."""
    return 0 if len(word) <= 3 else 1 if len(word) <= 10 else 2 if len(word) <= 20 else 3


def edits(a: str, b: str) -> int:
    """Letters dropped, added, changed or two neighbours swapped to turn `a` into `b` (optimal string
    alignment distance)."""
    prev2, prev = [], list(range(len(b) + 1))
    for i in range(1, len(a) + 1):
        row = [i] + [0] * len(b)
        for j in range(1, len(b) + 1):
            row[j] = min(prev[j] + 1, row[j - 1] + 1, prev[j - 1] + (a[i - 1] != b[j - 1]))
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                row[j] = min(row[j], prev2[j - 2] + 1)
        prev2, prev = prev, row
    return prev[-1]


def hint(name: str, ours: Iterable[str]) -> tuple[str | None, str]:
    """(our key doing the job of `name`, a line on what to use instead) for a name not taken: by its
    exact name in the tables, else as a near typo of one of ours or of theirs (`near_typo`)."""
    ours = list(ours)
    for exact in (True, False):
        target = name if exact else near_typo(name, [*ours, *ALIASES, *FOREIGN])
        if target is None:
            return None, ""
        if target in ALIASES:
            return ALIASES[target], ""
        entry = FOREIGN.get(target)
        if entry is not None and target not in ours:
            return (entry.hint or None), entry.instead
        if not exact and target in ours:
            return target, ""
    return None, ""
