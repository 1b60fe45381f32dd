"""Finetune a Hugging Face causal LM: parse -> load data -> load model -> train -> save.

    python finetune.py --dataset data.json --method lora
    accelerate launch --num_processes 2 finetune.py --dataset data.json
    torchrun --nproc_per_node 2 finetune.py --dataset data.json

Every flag is also a YAML key for --config; see `python finetune.py --help`.
"""

import json
import os
import sys
from functools import partial

from toolkit.cli.startup import resolve_images, settle
from toolkit.errors import exit_on_user_error


@exit_on_user_error("finetune.py")
def main(argv: list[str] | None = None):
    # every check that needs no model, before torch is imported (bad flags, YAML, data columns, --push-to-hub)
    cfg = settle(argv)

    from toolkit.config import save_config
    from toolkit.config.trackers import requested
    from toolkit.data.prepare import prepare_data
    from toolkit.data.tokenize import ensure_chat_template
    from toolkit.model.load import (check_model, count_parameters, human, load_model, load_tokenizer,
                                    resolved_precision, training_model)
    from toolkit.model.source import tokenizer_dir
    from toolkit.model.vision import plan_view, processor_for
    from toolkit.objectives.sft.evaluate import ExactMatch
    from toolkit.parallel.build import make_accelerator, make_strategy
    from toolkit.parallel.tree import tree_problem
    from toolkit.planner.auto import apply_auto_strategy, restart_after_oom
    from toolkit.train.checkpoint import save_final
    from toolkit.train.integrity import verify_saved
    from toolkit.train.loop import train
    from toolkit.train.output import prepare_output_dir, report_data, summarize
    from toolkit.train.resume import resume_point, resumed_weights
    from toolkit.train.trackers import start_trackers

    # a LoRA adapter folder: its base (or, merged, the merged folder); LoRA targets checked on a weightless skeleton
    model_path, source = training_model(cfg)
    # --images auto: on where the model is image-text and the data holds images
    cfg = resolve_images(cfg, model_path)
    attention = check_model(cfg, model_path)
    tokenizer = load_tokenizer(tokenizer_dir(cfg.model.model, model_path), cfg.model.trust_remote_code,
                               cfg.model.chat_template)
    added_template = ensure_chat_template(tokenizer)
    # an image-text model's, where the run reads images: their inputs in every batch, saved in final/
    pixels = (cfg.data.image_min_pixels, cfg.data.image_max_pixels)
    processor = processor_for(model_path, tokenizer, cfg.model.trust_remote_code, cfg.model.chat_template, pixels) \
        if cfg.data.images == "on" else None
    # tokenized once into the cache; bad data fails before the model
    data = prepare_data(cfg.data_settings, tokenizer, processor=processor)

    planned = None
    # the planner's layout, checkpointing and batch sizes
    if cfg.parallel.strategy == "auto":
        cfg, planned, table = apply_auto_strategy(cfg, model_path, resolved_precision(cfg), tree_problem, plan_view)
    accelerator = make_accelerator(cfg, model_path)
    # a checkpoint of another run is refused before loading; its global batch re-split for this launch
    resume = resume_point(cfg.flat(), cfg.parallel, accelerator)
    if resume is not None and resume.split is not None:
        cfg = cfg.replace(micro_batch_size=resume.split[0], grad_accum=resume.split[1])
    # the layout and the objective, decided once (a reward file that cannot load fails here, before the weights)
    strategy = make_strategy(cfg, accelerator, model_path, tokenizer=tokenizer)
    log = accelerator.print
    # where the model came from (an SFT adapter), and the layout when not from our flags (a launcher, a DeepSpeed file)
    for note in ([source] if source else []) + list(cfg.notes):
        log(note)
    if resume is None and cfg.output.resume == "auto":
        log(f"--resume auto: no checkpoint in {cfg.output.output_dir}; starting from step 0")
    out_dir = prepare_output_dir(cfg.output, accelerator)
    if accelerator.is_main_process:
        save_config(cfg, out_dir / "config.yaml")
        if planned:
            (out_dir / "plan.json").write_text(json.dumps(planned.to_json(), indent=2))
            log(table)
    report_data(log, cfg.data, cfg.train, cfg.model.chat_template, data, added_template)
    trackers = start_trackers(requested(cfg.output.report_to), out_dir, cfg.flat(), accelerator, log)

    # loaded, then shaped in one place (`parallelize`: adapters, kernels, the layout); a DeepSpeed checkpoint's weights
    model = resumed_weights(strategy.shard_model(load_model(cfg, model_path)), resume, cfg.model.method)
    trainable, total = count_parameters(model)
    per = " on this rank" if cfg.parallel.tp > 1 or cfg.parallel.ep > 1 else ""
    log(f"model: {model_path} ({human(total)} params{per}, {human(trainable)} trainable, method {cfg.model.method}); "
        f"{attention}")
    scores = ExactMatch(strategy, tokenizer, data.em_conversations, data.answers, log, processor)
    # --strategy auto on one process: an out-of-memory in the first steps runs the plan's next fallback
    restart = None
    if planned and argv is None and accelerator.num_processes == 1 and not cfg.output.resume:
        restart = partial(restart_after_oom, planned, say=log)
    model, result = train(cfg, strategy, model, tokenizer, data.train, data.eval, out_dir, log, resume, restart,
                          trackers, scores.before if data.answers else None)
    written = save_final(strategy, model, processor or tokenizer, out_dir / "final")
    verify_saved(strategy, model, tokenizer, data.train, out_dir / "final", model_path,
                 resolved_precision(cfg), cfg.model.method == "qlora", log, cfg.output.verify, written)
    # a full copy of the weights on the main process under ZeRO-3/FSDP
    del written
    run = summarize(log, cfg.train.objective, out_dir, result, scores.after(model), accelerator, model)
    accelerator.wait_for_everyone()
    # destroy the process group: gloo/DeepSpeed threads alive at exit can abort a rank
    accelerator.end_training()
    # saved and checked; no collective waits on the upload
    if cfg.output.push_to_hub and accelerator.is_main_process:
        from toolkit.config.hub import push_final

        print(f"hub: {out_dir / 'final'} uploaded to "
              f"{push_final(None, out_dir / 'final', cfg.output.push_to_hub, cfg.output.hub_private)}")
    return run


if __name__ == "__main__":
    main()
    # saved, the group destroyed: no interpreter teardown, where freed gloo groups aborted a rank (SIGABRT)
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)
