"""`python -m toolkit <command>`: prepare-model, prepare-data, merge, generate, accelerate-config,
plan, convert-checkpoint, verify."""

from __future__ import annotations

import argparse
import sys

from toolkit.cli.accelerate_config import cmd_accelerate_config
from toolkit.cli.checkpoints import cmd_convert_checkpoint, cmd_verify
from toolkit.cli.generate import SAMPLING, cmd_generate
from toolkit.cli.merge import cmd_merge
from toolkit.cli.plan import cmd_plan
from toolkit.cli.prepare import cmd_prepare_data, cmd_prepare_model
from toolkit.errors import UserError, exit_on_user_error


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


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m toolkit", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    s = sub.add_parser("prepare-model", help="convert the embedded SmolLM2-135M-Instruct GGUF to safetensors, or "
                                             "build a tiny random model offline (--tiny)")
    s.add_argument("--force", action="store_true", help="convert again even if the cache holds it; with --tiny, "
                                                        "write over a non-empty --output")
    s.add_argument("--tiny", metavar="ARCH", help="instead, a tiny random model (2 blocks, hidden 64, random weights, "
                                                  "a 384-token tokenizer) of this architecture, one of "
                                                  "toolkit/model/synthetic.py's ZOO: qwen3_moe, mixtral, "
                                                  "deepseek_v3 and gpt_oss are MoE (to try --ep), llama, qwen3, "
                                                  "gemma2, ... dense")
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
    s.add_argument("--image", action="append", metavar="PATH", help="with --prompt, to an image-text model: an image "
                                                                     "before the prompt's text (repeat for several)")
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

    # the same defaults as finetune.py
    m, d, t = ModelConfig(), DataConfig(), TrainConfig()
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
    s.add_argument("--gpu-memory", default="80GB",
                   help="memory per GPU in GB: 80 or 80GB (GB = GiB, as GPUs are sold), or 1.5TB")
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
                   help="the run's --loss: full logits, or one chunk's (auto, chunked, liger, cce; pipeline stages "
                        "use full)")
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


def typed_flags(argv: list[str]) -> set[str]:
    """The plan flags given on the command line (as dests): they win over a run's YAML (`--config`)."""
    parser = build_parser()
    plan_parser = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["plan"]
    for action in plan_parser._actions:
        action.default = argparse.SUPPRESS
    return set(vars(plan_parser.parse_args(argv))) - {"fn"}


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
    # finetune.py's flags, as they are
    if argv[:1] == ["prepare-data"] and not {"-h", "--help"} & set(argv[1:2]):
        args = argparse.Namespace(command="prepare-data", flags=argv[1:], fn=cmd_prepare_data)
    else:
        args = build_parser().parse_args(_join_negative_values(argv))
        if args.command == "plan":
            args.typed = typed_flags(_join_negative_values(argv)[1:])
    # these load models: keep it quiet
    if args.command in ("merge", "generate", "verify", "prepare-model", "convert-checkpoint", "prepare-data"):
        from toolkit.console import quiet

        quiet()
    args.fn(args)


if __name__ == "__main__":
    main()
