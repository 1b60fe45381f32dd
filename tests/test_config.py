import pytest
import yaml

from toolkit.config import Config, parse_config, save_config
from toolkit.errors import UserError


def test_defaults_yaml_flags_precedence(tmp_path):
    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_text("lr: 0.001\nseq_len: 128\ntrain:\n  grad_accum: 3\nlora-r: 4\n")
    cfg = parse_config(["--config", str(cfg_file), "--seq-len", "64", "--output-dir", str(tmp_path / "o")])
    assert cfg.train.lr == 0.001  # from YAML
    assert cfg.data.seq_len == 64  # flag beats YAML
    assert cfg.train.grad_accum == 3  # section-nested YAML
    assert cfg.model.lora_r == 4  # dashed YAML key
    assert cfg.train.micro_batch_size == Config().train.micro_batch_size  # default


def test_saved_config_reads_back_to_the_same_run(tmp_path):
    cfg = parse_config(["--method", "full", "--lr-schedule", "linear", "--gradient-checkpointing",
                        "--output-dir", str(tmp_path / "o")])
    save_config(cfg, tmp_path / "config.yaml")
    flat = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert flat["lr"] == 2e-5 and flat["method"] == "full"  # the method's default lr is resolved
    again = parse_config(["--config", str(tmp_path / "config.yaml")])
    assert again.flat() == {**cfg.flat(), "lr": 2e-5}


@pytest.mark.parametrize("argv, message", [
    (["--lora-rank", "8"], "unknown flag --lora-rank (did you mean --lora-r?)"),
    (["--method", "fulll"], "did you mean 'full'"),
    (["--format", "xml"], "--format must be one of auto, alpaca, chat, sharegpt, text"),
    (["--seq-len", "long"], "--seq-len must be an integer"),
    (["--lr", "-1"], "--lr must be > 0"),
    (["--micro-batch-size", "0", "--eval-split", "1.5"],
     "--eval-split must be in [0, 1) (got 1.5); --micro-batch-size must be >= 1 (got 0)"),
    (["--dataset", "missing.jsonl"], "--dataset missing.jsonl: file not found"),
    (["--dataset", "notes.txt"], "unsupported file type"),
])
def test_bad_flags_name_the_problem(tmp_path, argv, message):
    if "notes.txt" in argv:
        (tmp_path / "notes.txt").write_text("x")
        argv = ["--dataset", str(tmp_path / "notes.txt")]
    with pytest.raises(UserError) as e:
        parse_config(argv + ["--output-dir", str(tmp_path / "o")])
    assert message in str(e.value)


def test_unknown_yaml_key_suggests_closest(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("micro_batch: 2\n")
    with pytest.raises(UserError, match="unknown key 'micro_batch'.*did you mean 'micro_batch_size'"):
        parse_config(["--config", str(f)])


def test_yaml_typos_and_bad_values_are_said_together(tmp_path):
    """Typo'd keys were said and `micro_batch_size: 0` beside them was not (the keys raised before any value
    was checked): every problem of the file is in the one line."""
    f = tmp_path / "run.yaml"
    f.write_text("lerning_rate: 1e-4\nmicro_batch_size: 0\ngrad_accum: 2.5\nwarmup_step: 3\n"
                 f"output_dir: {tmp_path / 'o'}\n")
    with pytest.raises(UserError) as e:
        parse_config(["--config", str(f)])
    assert str(e.value).split("; ") == [
        f"unknown key 'lerning_rate' in {f} (did you mean 'lr'?)", f"unknown key 'warmup_step' in {f} (did you mean "
        f"'warmup_steps'?)", f"'grad_accum' in {f} must be an integer, got 2.5",
        "--micro-batch-size must be >= 1 (got 0)"]


def test_yaml_wrong_type(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("grad_accum: 2.5\n")
    with pytest.raises(UserError, match="'grad_accum' in .* must be an integer, got 2.5"):
        parse_config(["--config", str(f)])


def test_non_empty_output_dir_needs_overwrite(tmp_path):
    (tmp_path / "keep.txt").write_text("precious")
    with pytest.raises(UserError, match="not empty and holds no checkpoint to resume; pass --overwrite-output-dir to "):
        parse_config(["--output-dir", str(tmp_path)])
    assert parse_config(["--output-dir", str(tmp_path), "--overwrite-output-dir"]).output.overwrite_output_dir


def test_help_states_each_default_and_choice_once(capsys):
    """No '(default: None)' or '(default: False)', no default repeated after a help text that gives
    it, and each choice list only as the flag's metavar."""
    from toolkit.config import build_parser

    import re

    text = build_parser().format_help()
    flat = " ".join(text.split())  # argparse wraps lines
    assert "(default: None)" not in flat and "(default: False)" not in flat
    assert "(default: completions only)" in flat and "(default: lora)" in flat
    flags = re.split(r"\n  (?=--)", text.split("options:", 1)[1])
    assert len(flags) > 40 and all(" ".join(f.split()).count("default") <= 1 for f in flags)
    assert text.count("{auto,alpaca,chat,sharegpt,text}") == 2  # usage line + the flag's own line


@pytest.mark.parametrize("name", ["lerning_rate", "learning-rat", "micro_batch", "grad_acum"])
def test_misspelt_yaml_keys_get_the_closest_key(tmp_path, name):
    """Our keys and the transformers/TRL names people bring (learning_rate -> lr, taken as they are:
    tests/test_tracking.py) are both matched."""
    f = tmp_path / "run.yaml"
    f.write_text(f"{name}: 2\n")
    want = {"lerning_rate": "lr", "learning-rat": "lr", "micro_batch": "micro_batch_size", "grad_acum": "grad_accum"}
    with pytest.raises(UserError, match=f"unknown key '{name.replace('-', '_')}' in .*did you mean '{want[name]}'"):
        parse_config(["--config", str(f)])


def test_columns_from_a_flag_or_a_yaml_mapping(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("columns:\n  instruction: prompt\n  output: response\nsystem_prompt: Be brief.\n")
    from_yaml = parse_config(["--config", str(f), "--output-dir", str(tmp_path / "o")])
    from_flag = parse_config(["--columns", "instruction=prompt,output=response", "--output-dir", str(tmp_path / "o")])
    assert from_yaml.data.columns == from_flag.data.columns == "instruction=prompt,output=response"
    assert from_yaml.data.system_prompt == "Be brief."
    save_config(from_yaml, tmp_path / "config.yaml")  # and it reads back
    assert parse_config(["--config", str(tmp_path / "config.yaml")]).data.columns == from_yaml.data.columns


@pytest.mark.parametrize("spec, message", [
    ("instruction", "--columns 'instruction': write OURS=YOURS"),
    ("instrucion=prompt", "'instrucion' is not a field the formats read (did you mean 'instruction'?)"),
    ("output=a,output=b", "--columns maps output more than once"),
])
def test_bad_column_mapping_is_named(tmp_path, spec, message):
    with pytest.raises(UserError) as e:
        parse_config(["--columns", spec, "--output-dir", str(tmp_path / "o")])
    assert message in str(e.value)


def test_a_recipe_names_its_machine_for_the_planner_and_the_run_ignores_it(tmp_path):
    """Issue 45: `plan_gpu`, `plan_gpus_per_node`, `plan_nodes`, ... (flat, or a `plan:` section
    without the prefix) are read into `Config.plan` for `python -m toolkit plan --config`; nothing the
    run does reads them (they change neither the resume fingerprint's settings nor the layout)."""
    from toolkit.train.resume import LAYOUT_KEYS, RESULT_KEYS

    section, flat = tmp_path / "section.yaml", tmp_path / "flat.yaml"
    section.write_text("plan:\n  gpu: h100\n  gpus_per_node: 8\n  nodes: 2\nlr: 0.001\n")
    flat.write_text("plan_gpu: h100\nplan_gpus_per_node: 8\nplan_nodes: 2\nlr: 0.001\n")
    a = parse_config(["--config", str(section), "--output-dir", str(tmp_path / "o")])
    b = parse_config(["--config", str(flat), "--output-dir", str(tmp_path / "o")])
    assert a == b and (a.plan.plan_gpu, a.plan.plan_gpus_per_node, a.plan.plan_nodes) == ("h100", 8, 2)
    assert a.replace(plan_gpu="", plan_gpus_per_node=None, plan_nodes=None) == parse_config(
        ["--lr", "0.001", "--output-dir", str(tmp_path / "o")])
    assert not {k for k in a.flat() if k.startswith("plan_")} & (set(RESULT_KEYS) | set(LAYOUT_KEYS))
    save_config(a, tmp_path / "config.yaml")  # the run's config.yaml keeps the machine, and reads back
    assert parse_config(["--config", str(tmp_path / "config.yaml")]).plan == a.plan
    with pytest.raises(UserError, match="'plan_nodes' in .* must be an integer, got 'two'"):
        (tmp_path / "bad.yaml").write_text("plan: {nodes: two}\n")
        parse_config(["--config", str(tmp_path / "bad.yaml")])


@pytest.mark.parametrize("argv, yaml_text, message", [
    (["--per_device_train_batch_size", "0"], "", "--per_device_train_batch_size must be >= 1 (got 0)"),
    (["--per-device-train-batch-size=0"], "", "--per-device-train-batch-size must be >= 1 (got 0)"),
    (["--output_dir", "IN_A_FILE"], "", "--output_dir IN_A_FILE is a file, not a folder"),
    ([], "per_device_train_batch_size: 0\n", "'per_device_train_batch_size' in RUN must be >= 1 (got 0)"),
    ([], "gradient_accumulation_steps: 1.5\n", "'gradient_accumulation_steps' in RUN must be an integer, got 1.5"),
    ([], "bf16: maybe\n", "'bf16' in RUN must be true or false"),
    (["--per_device_train_batch_size", "0", "--micro-batch-size", "0"], "", "--micro-batch-size must be >= 1"),
    (["--micro-batch-size", "0"], "per_device_train_batch_size: 2\n", "--micro-batch-size must be >= 1 (got 0)"),
])
def test_a_problem_is_said_under_the_name_the_user_typed(tmp_path, argv, yaml_text, message):
    """Issue 45: `--per_device_train_batch_size 0` (a Trainer name, translated) was reported as
    --micro-batch-size. A problem is now said in the user's words, flag or YAML key; where they also
    typed our own name last, that is the one read and said."""
    (tmp_path / "IN_A_FILE").write_text("x")
    argv = [a.replace("IN_A_FILE", str(tmp_path / "IN_A_FILE")) for a in argv]
    run = tmp_path / "run.yaml"
    run.write_text(yaml_text or "lr: 0.001\n")
    with pytest.raises(UserError) as e:
        parse_config(["--config", str(run), "--output-dir", str(tmp_path / "o"), *argv])
    said = str(e.value)
    assert message.replace("RUN", str(run)).replace("IN_A_FILE", str(tmp_path / "IN_A_FILE")) in said, said
    assert "--micro-batch-size" not in said or "--micro-batch-size" in argv


def test_yaml_columns_name_one_column_each(tmp_path):
    """Issue 45: `columns: {instruction: [a, b]}` said `--columns "'b']": write OURS=YOURS`."""
    for value, shape in [("[a, b]", "a list (['a', 'b'])"), ("{x: y}", "a mapping ({'x': 'y'})"), ("'a,b'", "'a,b'")]:
        f = tmp_path / "run.yaml"
        f.write_text(f"columns:\n  instruction: {value}\n")
        with pytest.raises(UserError) as e:
            parse_config(["--config", str(f), "--output-dir", str(tmp_path / "o")])
        assert str(e.value) == (f"'columns' in {f}: 'instruction' maps to {shape}; a column name must be a string "
                                "without ',' or '=' (one column for each of ours, e.g. instruction: prompt)")


def test_ep_other_than_tp_is_refused_by_the_config_in_one_line(tmp_path):
    """Under --tp the ep group is the TP group (each expert whole, benchmarks/etp.md): --tp 2 --ep 4 is one
    refusal naming both flags and the fix, before any launch; --tp 2 --ep 2 passes."""
    with pytest.raises(UserError) as e:
        parse_config(["--tp", "2", "--ep", "4", "--output-dir", str(tmp_path / "o")])
    said = [line for line in str(e.value).splitlines() if "--ep" in line]
    assert len(said) == 1 and "--ep 4 with --tp 2 is not supported" in said[0] and "use --ep 2 --tp 2" in said[0], said
    cfg = parse_config(["--tp", "2", "--ep", "2", "--output-dir", str(tmp_path / "o2")])
    assert (cfg.parallel.tp, cfg.parallel.ep) == (2, 2)


# The option names people bring (issue 64, item 5). Trainer's: the dataclass fields of transformers 5.24's
# TrainingArguments; TRL 1.16's SFTConfig, DPOConfig, GRPOConfig and ModelConfig fields beyond those; axolotl's
# and LLaMA-Factory's from their documented configs. Written out, not imported: importing TRL takes seconds.
TRAINER = """accelerator_config activation_checkpointing activation_checkpointing_kwargs adam_beta1 adam_beta2
adam_epsilon auto_find_batch_size average_tokens_across_devices batch_eval_metrics bf16 bf16_full_eval data_seed
dataloader_drop_last dataloader_in_order dataloader_multiprocessing_context dataloader_num_workers
dataloader_persistent_workers dataloader_pin_memory dataloader_prefetch_factor ddp_backend ddp_broadcast_buffers
ddp_bucket_cap_mb ddp_find_unused_parameters ddp_static_graph ddp_timeout debug deepspeed disable_tqdm do_eval
do_predict do_train enable_jit_checkpoint eval_accumulation_steps eval_delay eval_do_concat_batches eval_on_start
eval_steps eval_strategy eval_use_gather_object fp16 fp16_full_eval fsdp fsdp_config full_determinism
gradient_accumulation_steps gradient_checkpointing gradient_checkpointing_kwargs greater_is_better hub_always_push
hub_model_id hub_private_repo hub_revision hub_strategy hub_token ignore_data_skip include_for_metrics
include_num_input_tokens_seen label_names label_smoothing_factor learning_rate length_column_name liger_kernel_config
load_best_model_at_end local_rank log_level log_level_replica log_on_each_node logging_first_step
logging_nan_inf_filter logging_steps logging_strategy lr_scheduler_kwargs lr_scheduler_type max_grad_norm max_steps
metric_for_best_model neftune_noise_alpha num_train_epochs optim optim_args optim_target_modules output_dir
parallelism_config per_device_eval_batch_size per_device_train_batch_size prediction_loss_only project push_to_hub
remove_unused_columns report_to restore_callback_states_from_checkpoint resume_from_checkpoint run_name
save_on_each_node save_only_model save_steps save_strategy save_total_limit seed skip_memory_metrics tf32
torch_compile torch_compile_backend torch_compile_mode torch_empty_cache_steps trackio_bucket_id trackio_space_id
trackio_static_space_id train_sampling_strategy use_cache use_cpu use_liger_kernel warmup_steps weight_decay
evaluation_strategy warmup_ratio"""
TRL = """activation_offloading assistant_only_loss chat_template_path completion_only_loss dataset_kwargs
dataset_num_proc dataset_text_field eos_token eval_packing loss_type max_length model_init_kwargs packing
packing_strategy pad_to_multiple_of pad_token padding_free router_aux_loss_coef shuffle_dataset truncation_mode
trust_remote_code beta disable_dropout discopop_tau f_alpha_divergence_coef f_divergence_type label_smoothing
ld_alpha loss_weights precompute_ref_batch_size precompute_ref_log_probs ref_model_mixup_alpha ref_model_sync_steps
sync_ref_model use_weighting cache_implementation cast_lm_head_to_fp32 chat_template_kwargs delta
ds3_gather_for_generation entropy_coef epsilon epsilon_high generation_batch_size generation_kwargs
importance_sampling_level log_completions mask_truncated_completions max_completion_length max_prompt_length min_p
num_generations num_iterations repetition_penalty reward_weights scale_rewards steps_per_generation temperature
top_k top_p use_vllm vllm_mode vllm_gpu_memory_utilization vllm_server_host vllm_server_port
vllm_tensor_parallel_size attn_implementation bnb_4bit_quant_storage bnb_4bit_quant_type dtype torch_dtype
load_in_4bit load_in_8bit lora_alpha lora_dropout lora_modules_to_save lora_r lora_target_modules
lora_target_parameters lora_task_type model_name_or_path model_revision use_bnb_nested_quant use_dora use_peft
use_rslora max_seq_length desirable_weight undesirable_weight"""
AXOLOTL = """base_model base_model_config model_type tokenizer_type tokenizer_config strict datasets test_datasets
dataset_prepared_path push_dataset_to_hub val_set_size adapter lora_model_dir sequence_len sample_packing
eval_sample_packing pad_to_sequence_len lora_target_linear lora_fan_in_fan_out wandb_project wandb_entity wandb_watch
wandb_name wandb_log_model micro_batch_size num_epochs optimizer lr_scheduler train_on_inputs group_by_length
early_stopping_patience xformers_attention flash_attention sdp_attention flex_attention s2_attention evals_per_epoch
saves_per_epoch special_tokens tokens chat_template chat_template_jinja default_system_message device_map
eval_batch_size eval_max_new_tokens eval_table_size hub_repo max_memory mlflow_experiment_name data_processes
dataset_processes rl rl_beta dpo_beta orpo_alpha sequence_parallel_degree context_parallel_size tensor_parallel_size
fsdp_version plugins liger_rope liger_rms_norm liger_glu_activation liger_fused_linear_cross_entropy
unfrozen_parameters peft_use_dora peft_use_rslora cosine_min_lr_ratio auto_resume_from_checkpoints save_safetensors
is_llama_derived_model loss_watchdog_threshold noisy_embedding_alpha gpu_memory_limit lora_on_cpu
shuffle_merged_datasets batch_size"""
LLAMA_FACTORY = """adapter_name_or_path stage finetuning_type lora_rank lora_target dataset dataset_dir template
cutoff_len max_samples overwrite_cache preprocessing_num_workers plot_loss val_size quantization_bit
quantization_method pref_beta pref_loss pref_ftx neat_packing mask_history flash_attn use_unsloth enable_liger_kernel
export_dir export_size infer_backend additional_target pissa_init freeze_trainable_layers rope_scaling shift_attn
upcast_layernorm new_special_tokens resize_vocab default_system tool_format buffer_size mix_strategy
interleave_probs tokenized_path"""
THEIRS = sorted({*TRAINER.split(), *TRL.split(), *AXOLOTL.split(), *LLAMA_FACTORY.split()})

# The one key of ours that does the same job, for every name of theirs that has one (a translated value may
# set two: fsdp). Every other name gets no suggestion of a key: at most a line saying what to do instead.
SAME_JOB = {
    "learning_rate": "lr", "per_device_train_batch_size": "micro_batch_size", "batch_size": "micro_batch_size",
    "gradient_accumulation_steps": "grad_accum", "num_train_epochs": "epochs", "num_epochs": "epochs",
    "max_seq_length": "seq_len", "max_length": "seq_len", "sequence_len": "seq_len", "cutoff_len": "seq_len",
    "model_name_or_path": "model", "base_model": "model", "lora_rank": "lora_r", "lora_target_modules": "lora_targets",
    "lora_target": "lora_targets", "lora_target_linear": "lora_targets", "bf16": "mixed_precision",
    "fp16": "mixed_precision", "save_steps": "save_every", "logging_steps": "log_every",
    "resume_from_checkpoint": "resume", "auto_resume_from_checkpoints": "resume", "eval_steps": "eval_every",
    "save_total_limit": "keep_last", "val_set_size": "eval_split", "val_size": "eval_split",
    "train_on_inputs": "train_on_prompt", "completion_only_loss": "train_on_prompt",
    "assistant_only_loss": "train_on_prompt", "sample_packing": "packing", "neat_packing": "packing",
    "dataset_num_proc": "data_workers", "preprocessing_num_workers": "data_workers",
    "dataset_processes": "data_workers",
    "data_processes": "data_workers", "default_system": "system_prompt", "default_system_message": "system_prompt",
    "chat_template_path": "chat_template", "chat_template_jinja": "chat_template", "template": "chat_template",
    "pref_beta": "beta", "rl_beta": "beta", "dpo_beta": "beta", "orpo_alpha": "beta",
    "activation_checkpointing": "gradient_checkpointing", "tensor_parallel_size": "tp", "context_parallel_size": "cp",
    "sequence_parallel_degree": "cp", "hub_private_repo": "hub_private", "hub_model_id": "push_to_hub",
    "eval_max_new_tokens": "sample_max_new_tokens", "adapter": "method", "load_in_4bit": "method", "use_peft": "method",
    "finetuning_type": "method", "quantization_bit": "method", "lr_scheduler_type": "lr_schedule",
    "lr_scheduler": "lr_schedule", "warmup_ratio": "warmup_steps", "torch_compile": "compile",
    "use_liger_kernel": "kernels", "enable_liger_kernel": "kernels", "liger_rope": "kernels",
    "liger_rms_norm": "kernels",
    "liger_glu_activation": "kernels", "liger_fused_linear_cross_entropy": "loss", "attn_implementation": "attn",
    "flash_attn": "attn", "flash_attention": "attn", "sdp_attention": "attn", "flex_attention": "attn",
    "xformers_attention": "attn", "eval_strategy": "eval_every", "evaluation_strategy": "eval_every",
    "evals_per_epoch": "eval_every", "save_strategy": "save_every", "saves_per_epoch": "save_every",
    "logging_strategy": "log_every", "datasets": "dataset", "dataset_text_field": "columns", "rl": "objective",
    "stage": "objective", "pref_loss": "objective", "loss_type": "objective", "fsdp": ("fsdp", "fsdp_sharding"),
    "report_to": "report_to", "chat_template": "chat_template", "push_to_hub": "push_to_hub",
    "importance_sampling_level": "importance_sampling", "log_completions": "log_completions_every",
}


def test_a_name_of_theirs_is_never_matched_to_an_unrelated_flag_of_ours():
    """Issue 64: `--eval_strategy` was told to use --strategy, `--val-set-size` --eval-every, `--template`
    --dp-replicate: difflib found a close spelling of an unrelated flag. Every name of Trainer, TRL, axolotl and
    LLaMA-Factory that is not ours gets as its hint the key of ours that does the same job (`SAME_JOB`), or none;
    each value translated lands on that key."""
    from toolkit.config import _fields, closest_key
    from toolkit.config.foreign import FOREIGN

    wrong = {name: closest_key(name) for name in THEIRS if name not in _fields()
             if closest_key(name) != SAME_JOB.get(name)}
    assert not wrong, wrong
    for name, entry in FOREIGN.items():
        keys = {k for settings in entry.values.values() for k in settings}
        want = SAME_JOB.get(name, ())
        assert keys <= ({want} if isinstance(want, str) else set(want)), (name, keys)


def test_a_near_typo_of_a_name_still_finds_its_flag():
    """A letter or two wrong (more in longer names) is a typo of ours or of theirs; a whole word more or less is
    another name; a short name is not matched at all (dp is neither tp nor cp), nor is a typo of one of theirs
    with no counterpart."""
    from toolkit.config import closest_key

    typos = {"lerning_rate": "lr", "learning-rat": "lr", "grad_acum": "grad_accum", "max-stepz": "max_steps",
             "micro_batch": "micro_batch_size", "lora_alpah": "lora_alpha", "stategy": "strategy",
             "val_set_sise": "eval_split", "lod_in_4bit": "method", "dp": None, "local_rnk": None,
             "vllm_tensor_parallel_size": None, "gradient_checkpointing_kwargs": None, "hub_strategy": None}
    assert {typed: closest_key(typed) for typed in typos} == typos


@pytest.mark.parametrize("argv, yaml_text, want", [
    (["--load_in_4bit"], "", {"method": "qlora"}),
    ([], "load_in_4bit: true\n", {"method": "qlora"}),
    (["--use_peft", "--load_in_4bit"], "", {"method": "qlora"}),  # TRL's QLoRA
    ([], "use_peft: false\nlearning_rate: 0.001\n", {"method": "full", "lr": 0.001}),
    (["--use_peft", "false"], "", {"method": "full"}),
    ([], "adapter: qlora\nmicro_batch_size: 2\nsequence_len: 64\nnum_epochs: 2\nval_set_size: 0.1\nlora_r: 8\n"
         "lora_target_modules: [q_proj, v_proj]\n", {"method": "qlora", "micro_batch_size": 2, "seq_len": 64,
                                                     "epochs": 2, "eval_split": 0.1, "lora_r": 8,
                                                     "lora_targets": "q_proj,v_proj"}),
    ([], "adapter:\nbase_model: some/model\n", {"method": "full", "model": "some/model"}),  # axolotl: no adapter
    ([], "adapter: lora\nload_in_4bit: true\n", {"method": "qlora"}),
    (["--lr_scheduler_type", "linear", "--torch_compile", "--use_liger_kernel"], "",
     {"lr_schedule": "linear", "compile": True, "kernels": "liger"}),
    ([], "lr_scheduler: constant\ntorch_compile: false\nwarmup_ratio: 0.0\n",
     {"lr_schedule": "constant", "compile": False, "warmup_steps": 0}),
    (["--fsdp", "shard_grad_op auto_wrap"], "", {"fsdp": True, "fsdp_sharding": "grad_op"}),
    ([], "push_to_hub: true\nhub_model_id: me/run\nhub_private_repo: true\n",
     {"push_to_hub": "me/run", "hub_private": True}),
    (["--push_to_hub", "--hub_model_id", "me/run"], "", {"push_to_hub": "me/run"}),
    ([], "push_to_hub: false\nhub_model_id: me/run\n", {"push_to_hub": ""}),  # Trainer: no push, the id unused
    ([], "stage: dpo\npref_loss: orpo\npref_beta: 0.2\n", {"objective": "orpo", "beta": 0.2}),  # LLaMA-Factory
    ([], "completion_only_loss: false\neval_strategy: 'no'\nresume_from_checkpoint: true\n",
     {"train_on_prompt": True, "resume": "auto"}),
    ([], "bf16: auto\nattn_implementation: sdpa\noptim: adamw_torch\nadam_epsilon: 1e-8\n",
     {"mixed_precision": "auto", "attn": "sdpa"}),
])
def test_their_names_are_taken_with_their_values_translated(tmp_path, argv, yaml_text, want):
    """Issue 64: `--load_in_4bit`, `--use_peft` and axolotl's `adapter: qlora` got no hint towards --method;
    TRL's, Trainer's, axolotl's and LLaMA-Factory's options that have a counterpart are now read as it, on the
    command line and in YAML, values translated (use_peft with load_in_4bit is QLoRA)."""
    run = tmp_path / "run.yaml"
    run.write_text(yaml_text or "seed: 42\n")
    if "resume" in want:
        (tmp_path / "o").mkdir()
    flat = parse_config(["--config", str(run), *argv, "--output-dir", str(tmp_path / "o")]).flat()
    assert {k: flat[k] for k in want} == want


@pytest.mark.parametrize("argv, yaml_text, said", [
    (["--neftune_noise_alpha", "5"], "", "--neftune_noise_alpha: not a flag here; NEFTune (noise on the embeddings) "
                                         "is not implemented here; remove it"),
    (["--eval_strategy", "steps"], "", "--eval_strategy: not a flag here; --eval-every N evaluates every N steps"),
    (["--template", "llama3"], "", "--template: not a flag here; LLaMA-Factory's template names are not read here"),
    (["--warmup_ratio", "0.1"], "", "--warmup-steps counts optimizer steps"),
    (["--optim", "paged_adamw_8bit"], "", "the optimizer here is torch's AdamW"),
    ([], "neftune_noise_alpha: 5\ndatasets:\n  - path: a.jsonl\n",
     "'neftune_noise_alpha' in RUN: not a key here; NEFTune (noise on the embeddings) is not implemented here; remove "
     "it; 'datasets' in RUN: not a key here; axolotl's datasets list is not read: --dataset FILE"),
    ([], "push_to_hub: true\n", "'push_to_hub: true' in RUN: it takes the repo here: --push-to-hub USER/NAME"),
    ([], "method: full\nadapter: lora\n", "'adapter: lora' and 'method: full' in RUN disagree (--method lora vs full)"),
    (["--use_peft", "false", "--load_in_4bit"], "", "--use_peft false and --load_in_4bit disagree"),
    ([], "load_in_4bit: true\nzero_stage: 3\n", "'load_in_4bit: true' in RUN with ZeRO-3/FSDP sharding is not "
                                                "supported"),
])
def test_their_names_without_a_counterpart_say_what_to_use(tmp_path, argv, yaml_text, said):
    """A name of theirs with no counterpart here (or a value without one) is one line naming what to do
    instead, never a flag that does another job; a problem with a translated value is said in their words."""
    run = tmp_path / "run.yaml"
    run.write_text(yaml_text or "seed: 42\n")
    with pytest.raises(UserError) as e:
        parse_config(["--config", str(run), *argv, "--output-dir", str(tmp_path / "o")])
    assert said.replace("RUN", str(run)) in str(e.value)
    assert "--strategy" not in str(e.value) and "--dp-replicate" not in str(e.value)


def test_parsing_their_names_and_the_new_flags_imports_nothing_heavy(tmp_path):
    """Flag parsing stays light (bad flags fail before anything heavy loads): their names, --chat-template and
    --push-to-hub are read without importing torch, transformers, peft or huggingface_hub."""
    import subprocess
    import sys
    from pathlib import Path

    (tmp_path / "t.jinja").write_text("{{ messages }}")
    argv = ["--load_in_4bit", "--lr_scheduler_type", "linear", "--chat-template", str(tmp_path / "t.jinja"),
            "--push-to-hub", "me/run", "--output-dir", str(tmp_path / "o")]
    code = (f"import sys; from toolkit.config import parse_config; cfg = parse_config({argv!r}); "
            "print(cfg.model.method, sorted(m for m in ('torch', 'transformers', 'peft', 'huggingface_hub') "
            "if m in sys.modules))")
    p = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip() == "qlora []"


def test_resume_over_a_config_file_that_overwrites_its_folder(tmp_path):
    """The quickstarts' YAML sets overwrite_output_dir (to run again from scratch); the line a preempted run
    prints says to add --resume auto: typed over the file, resuming wins and the file's overwrite is not
    applied, said in a note. Both typed still contradict each other."""
    from toolkit.config import parse_config
    from toolkit.errors import UserError

    data = tmp_path / "d.jsonl"
    data.write_text('{"instruction": "a", "output": "b"}\n')
    path = tmp_path / "run.yaml"
    path.write_text(f"dataset: {data}\noutput_dir: {tmp_path / 'out'}\noverwrite_output_dir: true\n")
    cfg = parse_config(["--config", str(path), "--resume", "auto"])
    assert cfg.output.resume == "auto" and not cfg.output.overwrite_output_dir
    assert any("the config's overwrite_output_dir: true is not applied" in n for n in cfg.notes)
    assert parse_config(["--config", str(path)]).output.overwrite_output_dir
    with pytest.raises(UserError, match="--resume and --overwrite-output-dir contradict each other"):
        parse_config(["--config", str(path), "--resume", "auto", "--overwrite-output-dir"])


@pytest.mark.parametrize("flags, said", [([], "2e-05 (the default for --method full; --lr sets it)"),
                                         (["--objective", "grpo", "--method", "lora", "--reward", "builtin:math_answer",
                                           "--num-generations", "4"],
                                          "1e-05 (--objective grpo's default for --method lora; --lr sets it)"),
                                         (["--lr", "3e-4"], "0.0003 (--lr)")])
def test_the_learning_rate_in_force_says_where_it_comes_from(tmp_path, flags, said):
    from toolkit.config import parse_config

    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "a", "answer": "1"}\n' if "grpo" in flags else '{"instruction": "a", "output": "b"}\n')
    method = [] if "--method" in flags else ["--method", "full"]
    assert parse_config(["--dataset", str(data), *method, *flags]).lr_words == said
