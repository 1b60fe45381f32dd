"""`python -m toolkit <command>`: prepare-model, prepare-data, merge, generate, accelerate-config,
plan, convert-checkpoint, verify."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from toolkit.errors import UserError, exit_on_user_error

if TYPE_CHECKING:
    from toolkit.planner.estimate import Asked


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise UserError(message)


class _DefaultsShown(argparse.ArgumentDefaultsHelpFormatter):
    """Each flag's default in --help, where it has one to show (not None, not an off switch; a help
    that says its default already is left as it is)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default in (None, False) or "default" in (action.help or ""):
            return action.help or ""
        return super()._get_help_string(action)


def cmd_prepare_model(args) -> None:
    """The default model converted into the cache; or, with --tiny, a tiny random model of one of
    `toolkit.model.synthetic.ZOO`'s architectures written to --output: an offline model, nothing downloaded,
    to try a layout on (MoE and `--ep` with qwen3_moe, mixtral, deepseek_v3 or gpt_oss)."""
    if args.tiny is None:
        if args.output is not None:
            raise UserError("--output goes with --tiny: the default model is converted into the cache")
        from toolkit.model.load import prepare_default_model

        print(prepare_default_model(force=args.force))
        return
    if args.output is None:
        raise UserError(f"--tiny {args.tiny} needs --output DIR, the folder to write the model to")
    from toolkit.model.synthetic import ZOO, build_zoo_model_dir

    if args.tiny not in ZOO:
        raise UserError(f"--tiny {args.tiny}: not an architecture toolkit/model/synthetic.py builds; one of "
                        f"{', '.join(sorted(ZOO))}")
    out = Path(args.output)
    if out.exists() and not args.force and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--output {out} exists and is not an empty folder; pass --force to write the model over it")
    print(build_zoo_model_dir(out, args.tiny))


def _checkpoint_as_folder(path: str, work: str) -> str:
    """A step checkpoint (`checkpoint-N`) written out as a standard folder in `work` (what
    `convert-checkpoint` does); any other path as it is."""
    from toolkit.train.checkpoint import TRAINER_STATE, convert_checkpoint

    if not (Path(path) / TRAINER_STATE).is_file():
        return path
    folder = Path(work) / "model"
    convert_checkpoint(Path(path), folder)
    print(f"{path}: a step checkpoint, read as a standard folder (`python -m toolkit convert-checkpoint` writes "
          "one to keep)", file=sys.stderr)
    return str(folder)


def cmd_merge(args) -> None:
    """Fold a LoRA adapter into its base model and write a plain transformers folder."""
    import tempfile

    from transformers import AutoTokenizer

    from toolkit.model.load import is_adapter_dir, load_for_inference

    out = Path(args.output)
    if out.exists() and not out.is_dir():
        raise UserError(f"--output {out} is a file; choose a folder")
    if out.exists() and any(out.iterdir()) and not args.overwrite:
        raise UserError(f"--output {out} is not empty; pass --overwrite or choose another folder")
    with tempfile.TemporaryDirectory() as work:
        adapter = _checkpoint_as_folder(args.adapter, work)
        if not is_adapter_dir(adapter):
            raise UserError(f"--adapter {args.adapter}: no adapter_config.json there (is it a LoRA output folder?)")
        model = load_for_inference(adapter, base=args.base, trust_remote_code=args.trust_remote_code,
                                   flag="--adapter").merge_and_unload()
        model.save_pretrained(out, safe_serialization=True)
        AutoTokenizer.from_pretrained(adapter).save_pretrained(out)
    print(f"merged model written to {out}")


SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "seed": 42}  # generate's defaults under --do-sample


def sampling_options(args) -> dict:
    """`generate`'s decoding settings for transformers' `generate`, checked: greedy unless --do-sample;
    a sampling setting given without it is refused (greedy decoding would ignore it)."""
    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be at least 1 (got {args.max_new_tokens})")
    if args.temperature is not None and args.temperature <= 0:
        raise UserError(f"--temperature must be > 0 (got {args.temperature:g}); leave out --do-sample and "
                        "--temperature to decode greedily")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise UserError(f"--top-p must be in (0, 1] (got {args.top_p:g})")
    if args.top_k is not None and args.top_k < 0:
        raise UserError(f"--top-k must be 0 (off) or more (got {args.top_k})")
    if args.repetition_penalty <= 0:
        raise UserError(f"--repetition-penalty must be > 0 (1 = off; got {args.repetition_penalty:g})")
    given = [f"--{k.replace('_', '-')}" for k in SAMPLING if getattr(args, k) is not None]
    if given and not args.do_sample:
        raise UserError(f"{' and '.join(given)} {'set' if len(given) > 1 else 'sets'} sampling, and decoding is greedy "
                        f"without --do-sample; add --do-sample to sample, or leave {'them' if len(given) > 1 else 'it'} "
                        "out")
    options = {"do_sample": args.do_sample, "repetition_penalty": args.repetition_penalty}
    if args.do_sample:  # what greedy decoding ignores (transformers warns when given them)
        options.update({k: default if getattr(args, k) is None else getattr(args, k) for k, default in SAMPLING.items()})
    return options


def read_prompts(path: str, system: str) -> list[tuple[object, list[dict[str, str]]]]:
    """`generate --prompt-file`: (what the line gave, the conversation to answer) for each prompt of a
    file of one prompt per line, or JSON Lines of {"prompt": ...} or {"messages": [...]} (ending with
    the user's turn). `system` is added where a conversation has no system message, as in training."""
    import json

    file = Path(path)
    if not file.is_file():
        raise UserError(f"--prompt-file {path}: file not found")
    lines = [(n, line) for n, line in enumerate(file.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
             if line.strip()]
    out = []
    for n, line in lines:
        if file.suffix != ".jsonl":
            given, messages = line.strip(), [{"role": "user", "content": line.strip()}]
        else:
            try:
                record = json.loads(line)
                given = record["prompt"] if "prompt" in record else record["messages"]
                messages = [{"role": "user", "content": str(given)}] if "prompt" in record else \
                    [{"role": str(m["role"]), "content": str(m["content"])} for m in given]
            except (ValueError, KeyError, TypeError):
                raise UserError(f"--prompt-file {path}: line {n} is not a JSON object with a \"prompt\" or "
                                "\"messages\" ([{\"role\": ..., \"content\": ...}, ...])") from None
            if not messages or messages[-1]["role"] != "user":
                last = f"the {messages[-1]['role']}'s turn" if messages else "nothing"
                raise UserError(f"--prompt-file {path}: line {n}'s messages end with {last}; end them with the "
                                "user's turn, the one to answer")
        out.append((given, with_system(messages, system)))
    if not out:
        raise UserError(f"--prompt-file {path} holds no prompt")
    return out


def with_system(messages: list[dict[str, str]], system: str) -> list[dict[str, str]]:
    """The conversation with `system` first, unless it has a system message of its own (as training adds
    --system-prompt)."""
    if not system or any(m["role"] == "system" for m in messages):
        return messages
    return [{"role": "system", "content": system}, *messages]


def generate_checks(args) -> None:
    """What `generate` is asked, checked before any model loads: one source of prompts, and no chat
    setting beside --raw (which continues plain text, no template)."""
    from toolkit.config.chat_template import template_problems

    sources = [flag for flag, given in (("--prompt", args.prompt is not None), ("--prompt-file", args.prompt_file),
                                        ("--chat", args.chat)) if given]
    if len(sources) != 1:
        raise UserError(f"{' and '.join(sources)} both give prompts; use one" if sources else
                        "give the prompt: --prompt TEXT, --prompt-file FILE (one per line, or .jsonl), or --chat "
                        "(turns read from stdin)")
    if args.prompt is not None and not args.prompt.strip():
        raise UserError("--prompt is empty; give the text to continue or answer")
    if args.batch_size < 1:
        raise UserError(f"--batch-size must be at least 1 (got {args.batch_size})")
    if args.raw:
        chat = [f for f, given in (("--chat", args.chat), ("--system-prompt", args.system_prompt),
                                   ("--chat-template", args.chat_template)) if given]
        if chat:
            raise UserError(f"--raw continues the text as it is, with no chat template; {' and '.join(chat)} "
                            f"{'need' if len(chat) > 1 else 'needs'} one: leave out --raw")
    problems = template_problems(args.chat_template or "")
    if problems:
        raise UserError(problems[0])


def complete(model, tok, texts: list[str], options: dict, raw: bool, max_new_tokens: int,
             batch_size: int) -> list[str]:
    """Completions of `texts` (rendered prompts, or plain text with `raw`), `batch_size` at a time,
    left-padded so every row's completion starts at the same position."""
    import torch

    out, side = [], tok.padding_side
    tok.padding_side = "left"
    try:
        for start in range(0, len(texts), batch_size):
            enc = tok(texts[start:start + batch_size], return_tensors="pt", padding=True, add_special_tokens=raw)
            with torch.no_grad():
                ids = model.generate(**enc, max_new_tokens=max_new_tokens, pad_token_id=tok.pad_token_id, **options)
            out += [t.strip() for t in tok.batch_decode(ids[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)]
    finally:
        tok.padding_side = side
    return out


def cmd_generate(args) -> None:
    """Completions from a model or adapter folder of one --prompt, each prompt of a --prompt-file
    (batched; JSON Lines out), or a --chat read from stdin turn by turn, its history kept; each
    conversation rendered with the chat template, as training renders its data. The prompts and the
    template are read and checked before the model loads."""
    import json
    import tempfile

    from toolkit.data.tokenize import ensure_chat_template, prompt_text
    from toolkit.model.load import load_for_inference, load_tokenizer, resolve_model

    options = sampling_options(args)
    generate_checks(args)
    system = args.system_prompt or ""
    if args.prompt is not None:
        prompts = [(args.prompt, with_system([{"role": "user", "content": args.prompt}], system))]
    else:
        prompts = read_prompts(args.prompt_file, system) if args.prompt_file else []
    if args.raw and not all(isinstance(given, str) for given, _ in prompts):
        raise UserError(f"--raw continues plain text; --prompt-file {args.prompt_file} holds messages, which need the "
                        "chat template: leave out --raw")

    def render(messages: list[dict[str, str]]) -> str:
        try:
            return prompt_text(tok, messages)
        except Exception as e:  # noqa: BLE001 - a template that refuses the conversation (a system role, say)
            raise UserError(f"the chat template refused the conversation ({type(e).__name__}: "
                            f"{' '.join(str(e).split())[:200]})") from None

    with tempfile.TemporaryDirectory() as work:
        src = args.model if Path(args.model).exists() else resolve_model(args.model)
        src = _checkpoint_as_folder(src, work)
        tok = load_tokenizer(src, args.trust_remote_code, args.chat_template or "")
        ensure_chat_template(tok)
        texts = [given if args.raw else render(messages) for given, messages in prompts]
        model = load_for_inference(src, trust_remote_code=args.trust_remote_code).eval()
    if args.do_sample:
        from transformers import set_seed

        set_seed(options.pop("seed"))

    def answer(texts: list[str]) -> list[str]:
        return complete(model, tok, texts, options, args.raw, args.max_new_tokens, args.batch_size)

    if args.prompt is not None:
        print(answer(texts)[0])
    elif args.prompt_file:
        for (given, _), text in zip(prompts, answer(texts)):
            print(json.dumps({"prompt" if isinstance(given, str) else "messages": given, "completion": text},
                             ensure_ascii=False), flush=True)
    else:
        history = with_system([], system)
        while True:
            if sys.stdin.isatty():
                print("> ", end="", file=sys.stderr, flush=True)
            line = sys.stdin.readline()
            if not line:
                break
            if not line.strip():
                continue
            history.append({"role": "user", "content": line.strip()})
            reply = answer([render(history)])[0]
            history.append({"role": "assistant", "content": reply})
            print(reply, flush=True)


def cmd_prepare_data(args) -> None:
    """Tokenize a run's data into the cache its training run will read (no model, no GPU): what a
    login node can do before the job starts. Takes finetune.py's flags or --config."""
    from toolkit.config import parse_config
    from toolkit.data.peek import check_data
    from toolkit.data.prepare import prepare_data
    from toolkit.data.tokenize import ensure_chat_template
    from toolkit.cache import cache_dir
    from toolkit.model.load import load_tokenizer, resolve_model, tokenizer_dir

    # the run's own output dir is not touched here: a placeholder keeps its checks out of the way
    cfg = parse_config([*args.flags, "--output-dir", "/nonexistent/prepare-data"], prog="python -m toolkit prepare-data")
    check_data(cfg.data_settings)  # the data's columns, before the tokenizer loads
    # the tokenizer finetune.py will use (an SFT adapter's own, saved beside it), so the run reads this cache
    tokenizer = load_tokenizer(tokenizer_dir(cfg.model.model, resolve_model(cfg.model.model)),
                               cfg.model.trust_remote_code, cfg.model.chat_template)
    ensure_chat_template(tokenizer)
    data = prepare_data(cfg.data_settings, tokenizer)
    for what, stats in (("training", data.stats), ("eval", data.eval_stats)):
        if stats.examples:
            print(f"{what}: {stats.examples} examples ({stats.dropped} dropped, {stats.truncated} truncated), "
                  f"{stats.tokens} tokens, {stats.target_tokens} trained")
    print(f"{'read from' if data.stats.cached else 'written to'} {cache_dir() / 'data'}; runs with the same data, "
          "tokenizer and settings read it")


def cmd_accelerate_config(args) -> None:
    from toolkit.config import parse_config
    from toolkit.layout.launcher import accelerate_yaml, write_accelerate_yaml

    flags = ["--offload", args.offload, "--fsdp-sharding", args.fsdp_sharding, "--output-dir", "/nonexistent"]
    flags += (["--zero-stage", str(args.zero_stage)] if args.zero_stage is not None else []) + (["--fsdp"] if args.fsdp else [])
    par = parse_config(flags, prog="python -m toolkit accelerate-config").parallel  # same checks as finetune.py
    cfg = accelerate_yaml(par.zero_stage, par.offload, par.fsdp, par.fsdp_sharding, args.num_processes,
                          args.num_machines, args.machine_rank, args.main_process_ip, args.main_process_port,
                          args.mixed_precision)
    write_accelerate_yaml(Path(args.output), cfg)
    print(f"wrote {args.output}: accelerate launch --config_file {args.output} finetune.py ...")


def load_model_config(spec: str) -> dict:
    """A preset name, a model folder (its config.json) or a config JSON file."""
    import difflib
    import json

    from toolkit.planner.presets import HUB_IDS, PRESETS

    key = HUB_IDS.get(spec, spec.lower().removesuffix("-instruct"))
    if key in PRESETS:
        return dict(PRESETS[key])
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise UserError(f"--model {spec}: {path} is not valid JSON (line {e.lineno}: {e.msg})") from None
    hint = difflib.get_close_matches(key, list(PRESETS), n=1)
    raise UserError(f"--model {spec}: not a preset, model folder or config file"
                    + (f" (did you mean '{hint[0]}'?)" if hint else "") + f"; presets: {', '.join(PRESETS)}")


def from_run_config(args: argparse.Namespace) -> tuple[str, Asked | None]:
    """`plan --config RUN.yaml`: the run's settings as finetune.py reads them (`config.parse_config`:
    the same keys, aliases, checks and --deepspeed file) and the machine its plan keys name
    (`config.PlanConfig`), where no flag given here says otherwise. Sets them on `args`; returns the
    line that says what was read, and the layout the run asks for (`planner.estimate.Asked`; None under
    --strategy auto, where the plan's choice is the run's)."""
    import difflib
    import tempfile

    from toolkit.config import parse_config
    from toolkit.planner.estimate import Asked, parse_size
    from toolkit.planner.presets import GPU_PRESETS

    with tempfile.TemporaryDirectory() as out:  # the run's output folder is not the plan's to check
        cfg = parse_config(["--config", args.config, "--output-dir", out], prog="python -m toolkit plan --config",
                           check_dataset=False)
    m, t, par, machine = cfg.model, cfg.train, cfg.parallel, cfg.plan
    typed, read = getattr(args, "typed", set()), []

    def take(dest: str, value, shown=None) -> None:
        if dest not in typed:
            setattr(args, dest, value)
            read.append(f"{dest} {value if shown is None else shown}")

    take("model", m.model)
    take("method", m.method)
    for key in ("lora_r", "lora_targets", "lora_dropout") if m.method != "full" else ():
        take(key, getattr(m, key))
    take("seq_len", cfg.data.seq_len)
    take("micro_batch_size", t.micro_batch_size)
    take("grad_accum", t.grad_accum)
    take("mixed_precision", "bf16" if t.mixed_precision == "auto" else t.mixed_precision,
         "auto (bf16 on the GPU)" if t.mixed_precision == "auto" else None)
    take("gradient_checkpointing", "on" if t.gradient_checkpointing else "auto",
         "on" if t.gradient_checkpointing else "off (the plan also tries it on)")
    take("loss", t.loss)
    take("objective", t.objective)
    asked = None
    if par.strategy == "auto":
        read.append("strategy auto (the plan's choice is the run's)")
    else:
        gc = {"on": True, "off": False}.get(args.gradient_checkpointing, t.gradient_checkpointing)
        asked = Asked(par, gc)
        read.append(f"layout {layout_words(par)}")

    where = f"--config {args.config}"
    if machine.plan_gpu and machine.plan_gpu_memory:
        raise UserError(f"{where}: plan_gpu and plan_gpu_memory both give the GPU's memory; keep one")
    if machine.plan_gpu and machine.plan_gpu not in GPU_PRESETS:
        hint = difflib.get_close_matches(machine.plan_gpu, list(GPU_PRESETS), n=1)
        raise UserError(f"{where}: plan_gpu '{machine.plan_gpu}' is not a card the planner knows"
                        + (f" (did you mean '{hint[0]}'?)" if hint else "") + f"; use one of {', '.join(GPU_PRESETS)}, "
                        "or plan_gpu_memory: SIZE")
    for key in ("plan_gpus_per_node", "plan_nodes"):
        if getattr(machine, key) is not None and getattr(machine, key) < 1:
            raise UserError(f"{where}: {key} must be >= 1 (got {getattr(machine, key)})")
    for key in ("plan_gpu_memory", "plan_cpu_memory"):
        value = getattr(machine, key)
        if value and not (key == "plan_cpu_memory" and value.strip().lower() in ("unlimited", "none")):
            try:
                parse_size(value, key.removeprefix("plan_").replace("_", "-"))
            except UserError as e:
                raise UserError(f"{where}: {key}: {e}") from None
    named = []
    if not {"gpu", "gpu_memory"} & typed and (machine.plan_gpu or machine.plan_gpu_memory):
        args.gpu, args.gpu_memory = machine.plan_gpu or None, machine.plan_gpu_memory or args.gpu_memory
        named.append(f"plan_gpu {machine.plan_gpu}" if machine.plan_gpu else f"plan_gpu_memory {machine.plan_gpu_memory}")
    for dest in ("gpus_per_node", "nodes", "cpu_memory"):
        value = getattr(machine, f"plan_{dest}")
        if value not in (None, "") and dest not in typed:
            setattr(args, dest, value)
            named.append(f"plan_{dest} {value}")
    machine_line = (f"the machine from its {', '.join(named)}" if named else
                    "no machine named in it (plan_gpu, plan_gpus_per_node, plan_nodes): the plan's defaults")
    return f"{where}: {', '.join(read)}, as finetune.py reads them; {machine_line}", asked


def layout_words(par) -> str:
    """The layout a run's parallel settings (a `layout.flags.ParallelConfig`) ask for, in the planner's
    names or the mesh degrees."""
    from toolkit.layout.rules import strategy_name

    name = strategy_name(par)
    if name is not None:
        return name
    degrees = [f"{k} {getattr(par, k)}" for k in ("tp", "pp", "cp", "dp_shard", "dp_replicate") if getattr(par, k) > 1]
    return " x ".join(degrees)


def typed_flags(argv: list[str]) -> set[str]:
    """The plan flags given on the command line (as dests): they win over a run's YAML (`--config`)."""
    parser = build_parser()
    plan_parser = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["plan"]
    for action in plan_parser._actions:
        action.default = argparse.SUPPRESS
    return set(vars(plan_parser.parse_args(argv))) - {"fn"}


def local_gpus() -> int:
    """NVIDIA GPUs this machine shows: CUDA_VISIBLE_DEVICES where set, else the driver's entries in
    /proc. Read without torch, so `plan`, pure numbers, answers in under a second."""
    import os

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and not d.strip().startswith("-")])
    root = Path("/proc/driver/nvidia/gpus")
    return len(list(root.iterdir())) if root.is_dir() else 0


def host_ram(args) -> tuple[int | None, bool, str | None]:
    """(host RAM per node in bytes, None where not checked; whether that is because it is unknown; the
    line that says where it came from).
    --cpu-memory where given (`unlimited`: not checked). Otherwise this machine's RAM, but only where
    the plan is for this machine: one node of as many GPUs as it has. A plan for another machine (a
    cluster, another GPU count) has no figure to read here: its host RAM is unknown, said so, and
    CPU offload is not checked against it (once, 8 x 80 GB were planned against a laptop's 24 GiB,
    and the offload rows showed "fits: no" for that)."""
    from toolkit.planner.estimate import parse_size

    if args.cpu_memory is not None:
        if args.cpu_memory.strip().lower() in ("unlimited", "none"):
            return None, False, None
        return parse_size(args.cpu_memory, "cpu-memory"), False, None
    here = local_gpus()
    if args.nodes == 1 and args.gpus_per_node == here:
        from toolkit.hardware import host_memory_bytes

        ram = host_memory_bytes()
        return ram, False, (f"host RAM per node: {ram / 1024**3:.0f} GiB, this machine's (the plan is for its "
                            f"{here} GPU{'s' * (here != 1)}; --cpu-memory SIZE to plan for another node, "
                            "--cpu-memory unlimited not to check it)")
    machine = f"{args.nodes} node{'s' * (args.nodes != 1)} of {args.gpus_per_node} GPU{'s' * (args.gpus_per_node != 1)}"
    return None, True, (f"host RAM per node: unknown: the plan is for {machine}, not this machine ({here} "
                        f"GPU{'s' * (here != 1)}), so CPU offload is not checked against host RAM (--cpu-memory "
                        "SIZE to check it)")


def cmd_plan(args) -> None:
    import json

    from toolkit.planner.cost import load_hardware
    from toolkit.planner.estimate import PlanInput, parse_size
    from toolkit.planner.explain import plan, render_table

    if args.calibrate:
        from toolkit.cli.calibrate import calibrate

        calibrate(Path(args.output or "hardware.json"))
        return
    if args.output:
        raise UserError("--output is where --calibrate writes; plan prints to stdout (use --json > FILE)")
    notes, asked = [], None
    if args.config:
        note, asked = from_run_config(args)
        notes.append(note)
    if args.gpu:
        from toolkit.planner.presets import GPU_PRESETS

        memory, timing = GPU_PRESETS[args.gpu]
        args.gpu_memory = f"{memory}GB"
        if args.hardware is None and timing:
            args.hardware = timing
        given = "--gpu" if not args.config or "gpu" in getattr(args, "typed", set()) else "plan_gpu"
        notes.append(f"{given} {args.gpu}: {memory} GB per GPU; step times from the {args.hardware or 'h100-sxm'} time "
                     "model" + ("" if timing else f" (none for {args.gpu}: measure one with --calibrate)"))
    hardware = load_hardware(args.hardware)

    cfg = load_model_config(args.model_config or args.model)
    missing = [k for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
               if k not in cfg]
    if missing:
        raise UserError(f"--model {args.model}: config lacks {', '.join(missing)} (a decoder-only Llama-family "
                        "config is expected)")
    cpu_memory, unknown, note = host_ram(args)
    from toolkit.config.objectives import plan_terms

    recipe = None
    if args.objective == "grpo":  # its sampling's settings: the recipe's (plan --config), else the defaults
        from toolkit.config import Config

        recipe = Config.from_values({"objective": "grpo", "method": args.method, "seq_len": args.seq_len,
                                     "micro_batch_size": args.micro_batch_size, "grad_accum": args.grad_accum})
    terms = plan_terms(args.objective, args.method, args.loss, recipe)  # a preference pair: two sequences, full logits
    from toolkit.parallel.tree import tree_problem

    inp = PlanInput(model=cfg, gpu_memory=parse_size(args.gpu_memory, "gpu-memory"), gpus_per_node=args.gpus_per_node,
                    nodes=args.nodes, cpu_memory=cpu_memory, cpu_memory_unknown=unknown, tree_check=tree_problem,
                    sequences=terms["sequences"],
                    extra_forwards=terms["extra_forwards"], generation=terms.get("generation"),
                    method=args.method, lora_r=args.lora_r, lora_targets=args.lora_targets,
                    lora_dropout=args.lora_dropout, seq_len=terms.get("seq_len", args.seq_len),
                    micro_batch=args.micro_batch_size, grad_accum=args.grad_accum, precision=args.mixed_precision,
                    checkpointing={"auto": None, "on": True, "off": False}[args.gradient_checkpointing],
                    global_batch=args.global_batch, tp=args.tp, pp=args.pp, cp=args.cp, ep=args.ep, loss=terms["loss"],
                    hardware=hardware, asked=asked)
    try:
        result = plan(inp)
    except ValueError as e:
        raise UserError(str(e)) from None
    result.notes[:0] = notes + ([note] if note else [])
    print(json.dumps(result.to_json(), indent=2) if args.json else render_table(result))


def cmd_convert_checkpoint(args) -> None:
    from toolkit.train.checkpoint import convert_checkpoint

    out = Path(args.output)
    above = next((a for a in [out, *out.parents] if a.exists()), None)  # the nearest that exists
    if above is not None and not above.is_dir():
        raise UserError(f"--output {args.output}: {'it' if above == out else above} is a file; choose a folder "
                        "(empty or absent)")
    print(convert_checkpoint(Path(args.checkpoint), out))


def cmd_verify(args) -> None:
    import json

    from toolkit.train.integrity import reload_loss

    print(json.dumps({"loss": reload_loss(args.folder, args.base, args.batch, args.pad_id, args.load_4bit)}))


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m toolkit", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    s = sub.add_parser("prepare-model", help="convert the embedded SmolLM2-135M-Instruct GGUF to safetensors, or "
                                             "build a tiny random model offline (--tiny)")
    s.add_argument("--force", action="store_true", help="convert again even if the cache holds it; with --tiny, "
                                                        "write over a non-empty --output")
    s.add_argument("--tiny", metavar="ARCH", help="instead, a tiny random model (2 blocks, hidden 64, random weights, "
                                                  "a 384-token tokenizer) of this architecture, one of "
                                                  "toolkit/model/synthetic.py's ZOO: qwen3_moe, mixtral, deepseek_v3 and "
                                                  "gpt_oss are MoE (to try --ep), llama, qwen3, gemma2, ... dense")
    s.add_argument("--output", metavar="DIR", help="with --tiny: the folder to write the model and tokenizer to")
    s.set_defaults(fn=cmd_prepare_model)
    s = sub.add_parser("prepare-data", help="tokenize a run's data into the cache (finetune.py's flags or --config)")
    s.add_argument("flags", nargs=argparse.REMAINDER, help="finetune.py flags, e.g. --config run.yaml")
    s.set_defaults(fn=cmd_prepare_data)
    s = sub.add_parser("merge", help="merge a LoRA adapter into its base model")
    s.add_argument("--adapter", required=True,
                   help="adapter folder (OUTPUT_DIR/final of a LoRA run, or a step checkpoint OUTPUT_DIR/checkpoint-N)")
    s.add_argument("--output", required=True, help="folder for the merged model")
    s.add_argument("--base", help="base model (default: the one recorded in the adapter)")
    s.add_argument("--overwrite", action="store_true")
    s.add_argument("--trust-remote-code", action="store_true", help="allow the base model's own code to run")
    s.set_defaults(fn=cmd_merge)
    s = sub.add_parser("generate", help="print completions from a model or adapter folder: a prompt, a file of "
                                        "them, or a chat on stdin",
                       description="One of --prompt, --prompt-file or --chat. Greedy decoding unless --do-sample; "
                                   "--temperature, --top-p, --top-k and --seed shape sampling and need --do-sample.",
                       formatter_class=_DefaultsShown)
    s.add_argument("--model", required=True,
                   help="model folder, adapter folder, step checkpoint (checkpoint-N), or the default name")
    s.add_argument("--prompt", help="the text to answer (or, with --raw, to continue)")
    s.add_argument("--prompt-file", metavar="FILE", help="instead, every prompt of a file, in batches: one per line, "
                                                         "or JSON Lines of {\"prompt\": ...} or {\"messages\": [...]}; "
                                                         "prints a JSON line {\"prompt\" (or \"messages\"), "
                                                         "\"completion\"} for each")
    s.add_argument("--chat", action="store_true", help="instead, a conversation: each line read from stdin is the "
                                                       "user's next turn, answered with the whole conversation so far, "
                                                       "until end of input")
    s.add_argument("--system-prompt", help="a system message before the conversation, where it has none of its own "
                                           "(default: none)")
    s.add_argument("--chat-template", help="a Jinja template file, or the name of a template the tokenizer carries "
                                           "(default: the one saved with the model; a trained final/ holds its run's)")
    s.add_argument("--batch-size", type=int, default=8, help="--prompt-file: prompts generated together")
    s.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate at most")
    s.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding (default: greedy)")
    s.add_argument("--temperature", type=float, help=f"with --do-sample: softmax temperature, > 0 (default: "
                                                     f"{SAMPLING['temperature']})")
    s.add_argument("--top-p", type=float, help=f"with --do-sample: nucleus probability mass, in (0, 1] (default: "
                                               f"{SAMPLING['top_p']}, off)")
    s.add_argument("--top-k", type=int, help=f"with --do-sample: keep the k likeliest tokens (default: "
                                             f"{SAMPLING['top_k']}, off)")
    s.add_argument("--seed", type=int, help=f"with --do-sample: the sampling seed; the same seed gives the same text "
                                            f"(default: {SAMPLING['seed']})")
    s.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="> 1 discourages repeating tokens already in the text (1 = off); greedy too")
    s.add_argument("--raw", action="store_true", help="no chat template: continue the prompt text (default: the "
                                                      "model's chat template)")
    s.add_argument("--trust-remote-code", action="store_true", help="allow the model's own code to run")
    s.set_defaults(fn=cmd_generate)
    s = sub.add_parser("accelerate-config", help="write an accelerate YAML for `accelerate launch --config_file`")
    s.add_argument("--output", required=True, help="YAML file to write")
    s.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3))
    s.add_argument("--offload", default="none", choices=("none", "optimizer", "optimizer+param"))
    s.add_argument("--fsdp", action="store_true")
    s.add_argument("--fsdp-sharding", default="full", choices=("full", "grad_op", "hybrid"))
    s.add_argument("--num-processes", type=int, required=True, help="processes in total, all machines")
    s.add_argument("--num-machines", type=int, default=1)
    s.add_argument("--machine-rank", type=int, default=0)
    s.add_argument("--main-process-ip")
    s.add_argument("--main-process-port", type=int, default=29500)
    s.add_argument("--mixed-precision", default="no", choices=("no", "bf16", "fp16"))
    s.set_defaults(fn=cmd_accelerate_config)
    from toolkit.config import DataConfig, ModelConfig, TrainConfig
    from toolkit.config.objectives import OBJECTIVES
    from toolkit.planner.presets import GPU_PRESETS, PRESETS

    m, d, t = ModelConfig(), DataConfig(), TrainConfig()  # the same defaults as finetune.py
    s = sub.add_parser("plan", help="predict per-GPU memory and step time of each strategy and pick one that fits",
                       formatter_class=_DefaultsShown)
    s.add_argument("--model", default="smollm2-135m", help=f"a preset ({', '.join(PRESETS)}), a model folder or "
                                                          "its config.json")
    s.add_argument("--model-config", help="a config JSON file (overrides --model)")
    s.add_argument("--config", help="a finetune.py YAML, read as finetune.py reads it: its model, method, sequence, "
                                    "batch, precision and layout (predicted as it is, and chosen where it fits), and "
                                    "the machine its plan_gpu, plan_gpu_memory, plan_gpus_per_node, plan_nodes, "
                                    "plan_cpu_memory keys (or plan: section) name; flags given here win")
    s.add_argument("--gpus-per-node", type=int, default=8, help="GPUs in each node")
    s.add_argument("--nodes", type=int, default=1, help="nodes")
    s.add_argument("--gpu", choices=tuple(GPU_PRESETS), help="a card: sets --gpu-memory and, where one exists, "
                                                             "the time model (--hardware)")
    s.add_argument("--gpu-memory", default="80GB", help="memory per GPU in GB: 80 or 80GB (GB = GiB, as GPUs are sold), or 1.5TB")
    s.add_argument("--cpu-memory", help="host RAM per node, which CPU offload needs (default: this machine's where "
                                        "the plan is for it, one node of its GPU count; unknown, and not checked, "
                                        "for any other machine; 'unlimited' not to check it)")
    s.add_argument("--method", default=m.method, choices=("full", "lora", "qlora"), help="what to train")
    s.add_argument("--lora-r", type=int, default=m.lora_r, help="LoRA rank")
    s.add_argument("--lora-targets", default=m.lora_targets, help="comma-separated module names, or all-linear")
    s.add_argument("--lora-dropout", type=float, default=m.lora_dropout,
                   help="> 0 keeps a mask of each adapted layer's input for backward")
    s.add_argument("--seq-len", type=int, default=d.seq_len, help="tokens per example")
    s.add_argument("--micro-batch-size", type=int, default=t.micro_batch_size, help="examples per GPU per forward")
    s.add_argument("--grad-accum", type=int, default=t.grad_accum, help="micro-batches per optimizer step")
    s.add_argument("--mixed-precision", default="bf16", choices=("no", "bf16", "fp16"), help="compute dtype")
    s.add_argument("--gradient-checkpointing", default="auto", choices=("auto", "on", "off"),
                   help="auto: plan with and without it")
    s.add_argument("--objective", default=t.objective, choices=OBJECTIVES,
                   help="a preference objective's micro-batch holds two sequences per example, with full logits")
    s.add_argument("--loss", default="auto", choices=("auto", "full", "chunked", "liger", "cce"),
                   help="the run's --loss: full logits, or one chunk's (auto, chunked, liger, cce; pipeline stages use full)")
    s.add_argument("--global-batch", type=int,
                   help="examples per optimizer step (default: --micro-batch-size x --grad-accum x GPUs, what plain "
                        "data parallelism runs); each layout keeps it, re-split between micro-batch and accumulation")
    s.add_argument("--tp", type=int, action="append", help="tensor-parallel degree to predict (repeatable)")
    s.add_argument("--pp", type=int, action="append", help="pipeline degree to predict (repeatable)")
    s.add_argument("--cp", type=int, action="append", help="context-parallel degree to predict (repeatable)")
    s.add_argument("--ep", type=int, action="append", help="expert-parallel degree to predict, an MoE model's "
                                                           "(repeatable)")
    s.add_argument("--hardware", help="the time model's figures: a preset (h100-sxm, a100-80gb, l40s, cpu) or a "
                                      "file from --calibrate (default h100-sxm)")
    s.add_argument("--calibrate", action="store_true", help="measure this machine (matmul peak, block efficiency, "
                   "all-reduce/all-to-all bandwidth over the launcher's ranks) and write --output; run under "
                   "torchrun --nproc_per_node N -m toolkit plan --calibrate for the links")
    s.add_argument("--output", help="the hardware file --calibrate writes (default hardware.json)")
    s.add_argument("--json", action="store_true", help="print JSON instead of the table")
    s.set_defaults(fn=cmd_plan)
    s = sub.add_parser("convert-checkpoint", help="a step checkpoint (any layout) as a standard HF model or "
                                                  "adapter folder, on one process")
    s.add_argument("checkpoint", help="an OUTPUT_DIR/checkpoint-N folder")
    s.add_argument("--output", required=True, help="folder to write (must be empty or absent)")
    s.set_defaults(fn=cmd_convert_checkpoint)
    s = sub.add_parser("verify", help="(internal) loss of a saved folder on a batch, in a fresh process")
    s.add_argument("--folder", required=True)
    s.add_argument("--base", required=True, help="base model for an adapter folder")
    s.add_argument("--batch", required=True, help="JSON list of {input_ids, labels}")
    s.add_argument("--pad-id", type=int, required=True)
    s.add_argument("--load-4bit", action="store_true", help="load the base in NF4 (QLoRA adapters)")
    s.set_defaults(fn=cmd_verify)
    return p


def _join_negative_values(argv: list[str]) -> list[str]:
    """`--gpu-memory -8GB` -> `--gpu-memory=-8GB`: argparse would take "-8GB" for a flag and say
    "expected one argument"; joined, the value reaches its own check and gets a clear message."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        if a.startswith("--") and "=" not in a and i + 1 < len(argv) and argv[i + 1][:1] == "-" \
                and argv[i + 1][1:2].isdigit():
            out.append(f"{a}={argv[i + 1]}")
            i += 2
        else:
            out.append(a)
            i += 1
    return out


@exit_on_user_error("python -m toolkit")
def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["prepare-data"] and not {"-h", "--help"} & set(argv[1:2]):  # finetune.py's flags, as they are
        args = argparse.Namespace(command="prepare-data", flags=argv[1:], fn=cmd_prepare_data)
    else:
        args = build_parser().parse_args(_join_negative_values(argv))
        if args.command == "plan":
            args.typed = typed_flags(_join_negative_values(argv)[1:])
    if args.command in ("merge", "generate", "verify", "prepare-model", "convert-checkpoint", "prepare-data"):  # these load models: keep it quiet
        from toolkit.console import quiet

        quiet()
    args.fn(args)


if __name__ == "__main__":
    main()
