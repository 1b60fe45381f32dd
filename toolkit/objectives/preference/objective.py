"""`--objective dpo|orpo|simpo|kto`: rows read from the data as SFT reads them (pairs, or KTO's labelled
examples), trained with `PreferenceLoss` under the layout's hooks, evaluated by the held-out pairs' loss and
TRL's metrics; a full finetune's reference log-probabilities computed before step 1
(`toolkit.objectives.preference.reference`)."""

from __future__ import annotations

from toolkit.config.objectives import extra_forwards
from toolkit.objectives.base import Context, LayoutHooks
from toolkit.objectives.preference.loss import PreferenceLoss
from toolkit.objectives.sft.objective import SFT


class Preference(SFT):
    """A preference objective (`toolkit.objectives.base.Objective`): SFT's rows, its own loss."""

    loss: PreferenceLoss

    def make_loss(self, hooks: LayoutHooks) -> PreferenceLoss:
        self.loss = PreferenceLoss.from_config(self.cfg, hooks)
        return self.loss

    def tokenizer_problems(self, tokenizer) -> list[str]:
        return []

    def layout_problems(self, kind: str, dims) -> list[str]:
        return one_process_pipeline(self.cfg, kind)

    def before_training(self, ctx: Context, loader, rows, eval_rows, steps_per_epoch: int, resuming: bool) -> None:
        """A full finetune's reference (and a LoRA's on an SFT adapter): the rows' log-probabilities under the
        model as loaded; a resume reads its saved ones, never a new pass."""
        if not self.loss.reference_pass:
            return
        from toolkit.data.loader import rows_read
        from toolkit.objectives.preference.reference import attach_reference

        # the training rows the run's steps read (of a 15-step run, 15 global batches' worth, not the file)
        read = rows_read(loader, self.cfg.train.grad_accum, steps_per_epoch, ctx.total_steps)
        for held, name, needed in ((rows, "train", read), (eval_rows, "eval", None)):
            if held:
                attach_reference(ctx, held, name, ctx.log, resuming, needed, self.unit)

    def extra_forwards(self) -> int:
        return extra_forwards(self.name, self.cfg.model.method)

    def evaluate(self, ctx: Context, rows) -> dict[str, float]:
        from toolkit.objectives.preference.evaluate import eval_preference

        return eval_preference(ctx.strategy, ctx.model, rows, self.cfg.train.micro_batch_size,
                               ctx.tokenizer.pad_token_id, self.loss)


def one_process_pipeline(cfg, kind: str) -> list[str]:
    """An objective other than SFT on the one-process pipeline (each stage needs its own process)."""
    if kind != "pipeline_one_process":
        return []
    par = cfg.parallel
    return [f"--objective {cfg.train.objective} with --pp {par.pp} runs one process per stage: launch {par.pp} "
            f"(torchrun --nproc_per_node {par.pp})"]
