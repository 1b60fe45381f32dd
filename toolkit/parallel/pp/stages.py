"""Multi-process pipeline: one stage per rank on `torch.distributed.pipelining` (GPipe or 1F1B),
composed with data parallelism: world = pp x dp.

Ranks are laid out pp-outer (Megatron's order): with pp=2, dp=2 stage 0 is ranks {0,1}, stage 1
ranks {2,3}; the pipeline groups are {0,2} and {1,3}, the data-parallel groups {0,1} and {2,3}.
Every rank of a pipeline group reads the same micro-batches (stage 0 needs the ids, the last
stage the labels, every stage the mask); the data is sharded by dp rank. The project supplies the
stage split and the HF adaptation (`DecoderStage`); sends, receives and schedules are PyTorch's.

A tied embedding / LM head lives on both the first and the last stage: its two gradient halves
are summed over the {first, last} pair (Megatron's embedding group) so both copies stay equal.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from toolkit.parallel.grad_norm import clip_grad_norm, full, local
from toolkit.parallel.pp.naive import bubble_fraction, stage_inputs
from toolkit.parallel.pp.split import DecoderStage, autocast, decoder_parts, own_loss
from toolkit.planner.stages import stage_bounds
from toolkit.data.labels import count_targets
from toolkit.objectives.sft.loss import token_loss_sum

# sequences are padded to a multiple of this: a pipeline stage is built per shape
PAD_MULTIPLE = 64
# (B, T): what the stages are given
SEQUENCE_KEYS = ("input_ids", "attention_mask", "labels", "position_ids")


@dataclass(frozen=True)
class PipelineLayout:
    pp: int
    dp: int
    pp_rank: int
    dp_rank: int
    pp_group: Any
    dp_group: Any
    # {first stage, last stage} of this pipeline
    tie_group: Any


def make_pipeline_layout(pp: int, mesh=None) -> PipelineLayout:
    """The pipeline, data-parallel and tied-embedding groups: views of `mesh` (by default one over the
    whole world with this pipeline depth; built collectively, every rank in the same order)."""
    from toolkit.parallel.mesh import local_mesh

    mesh = mesh if mesh is not None else local_mesh(pp=pp)
    return PipelineLayout(mesh.size("pp"), mesh.size("batch"), mesh.local_rank("pp"), mesh.local_rank("batch"),
                          mesh.group("pp"), mesh.group("batch"), mesh.group("pp_ends"))


def pack_rows(batch: dict) -> tuple[torch.Tensor, tuple]:
    """Every per-row tensor of `batch` ((B, T) or (B,)) as columns of one float64 (B, n) tensor, and how to
    read them back (`unpack_rows`): what a schedule hands the last stage's loss besides the logits, split
    by rows into pipeline micro-batches with them (token ids, masks, -100 and a row's log-probability are
    exact in float64). An objective's rows reach its `logits_loss` as they reach its own forward."""
    rows = len(batch["input_ids"])
    keys = tuple((k, v.shape[1] if v.dim() == 2 else 0, v.dtype) for k, v in batch.items()
                 if torch.is_tensor(v) and v.dim() in (1, 2) and len(v) == rows)
    return torch.cat([batch[k].double().reshape(rows, max(w, 1)) for k, w, _ in keys], 1), keys


def unpack_rows(target: torch.Tensor, keys: tuple) -> dict[str, torch.Tensor]:
    """`pack_rows`' tensors back, from (a micro-batch's rows of) its columns."""
    out, at = {}, 0
    for k, w, dtype in keys:
        column = target[:, at:at + max(w, 1)]
        out[k], at = (column if w else column[:, 0]).to(dtype), at + max(w, 1)
    return out


def pad_to_multiple(batch: dict[str, torch.Tensor], multiple: int, pad_id: int) -> dict[str, torch.Tensor]:
    """The stages' (B, T) tensors (`SEQUENCE_KEYS`; a batch's others are per row or a preference
    objective's KL sequences), right-padded to a multiple of `multiple` tokens: masked, label -100,
    positions continuing (packed rows' padding is its own block)."""
    batch = {k: v for k, v in batch.items() if k in SEQUENCE_KEYS}
    t = batch["input_ids"].shape[1]
    extra = -t % multiple
    if not extra:
        return batch
    fill = {"input_ids": pad_id, "attention_mask": 0, "labels": -100}
    out = {}
    for k, v in batch.items():
        if k == "position_ids":
            more = v[:, -1:] + torch.arange(1, extra + 1, device=v.device)
            out[k] = torch.cat([v, more], dim=1)
        else:
            out[k] = torch.nn.functional.pad(v, (0, extra), value=fill[k])
    return out


class StagePipeline(nn.Module):
    """This rank's stage of the model, and the schedule that runs it."""

    def __init__(self, model: nn.Module, layout: PipelineLayout, sizes: list[int], microbatches: int,
                 schedule: str, device: torch.device, pad_id: int, compute_dtype: torch.dtype | None = None,
                 loss_fn=token_loss_sum, sharded: bool = False):
        """This rank's stage of `model`, blocks by `sizes`; `sharded`: FSDP2 shards the stage
        (`toolkit.parallel.parallelize.apply_stages`, after this), and its policy is the mixed precision."""
        super().__init__()
        # (logits, labels) -> summed loss, computed on the last stage
        self.loss_fn = loss_fn
        parts = decoder_parts(model)
        # not a submodule: parameters() are this rank's stage only
        self.__dict__["model"] = model
        self.layout, self.sizes, self.microbatches = layout, sizes, microbatches
        self.schedule_name, self.device, self.pad_id = schedule, device, pad_id
        start, stop = stage_bounds(sizes)[layout.pp_rank]
        self.first, self.last = layout.pp_rank == 0, layout.pp_rank == layout.pp - 1
        # mixed precision: FSDP2's policy where the stage is sharded, else autocast (fp32 weights)
        self.stage = DecoderStage(parts, start, stop, self.first, self.last,
                                  None if sharded else compute_dtype).to(device)
        self.sharded, self._tied = sharded, parts.head.weight is parts.embed.weight and layout.pp > 1
        self._schedules: dict[tuple, Any] = {}
        self._losses: list[torch.Tensor] = []
        self._scale = 1.0
        # what the last stage computes from the logits: the token loss, an objective's (its `logits_loss` on
        # the rows `pack_rows` carried, with its metrics' sums per micro-batch), or each row's log-probability
        self._objective, self._metrics, self._logps_only, self._rows = None, [], False, ()

    @cached_property
    def tied(self) -> nn.Parameter | None:
        """The tied embedding / LM head weight as this stage holds it (FSDP2 replaced the parameters it
        shards: read after the stage is sharded), or None."""
        if not self._tied:
            return None
        return self.stage.embed.weight if self.first else self.stage.head.weight if self.last else None

    @cached_property
    def names(self) -> dict[str, nn.Parameter]:
        """This stage's parameters by the full model's names (read after the stage is sharded)."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        return {n: p for p in self.stage.parameters() if (n := names.get(id(p)))}

    def describe(self) -> str:
        bounds = ", ".join(f"stage {i}: blocks {a}-{b - 1}" for i, (a, b) in enumerate(stage_bounds(self.sizes)))
        return (f"pipeline: {self.layout.pp} stages x {self.layout.dp} data-parallel ({bounds}); "
                f"{self.schedule_name}, {self.microbatches} micro-batches, expected bubble "
                f"(p-1)/(m+p-1) = {bubble_fraction(self.layout.pp, self.microbatches):.1%}")

    def _loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # a row's log-probability per record; nothing to back-propagate
        if self._logps_only:
            from toolkit.objectives.logps import sequence_logps

            self._losses.append(sequence_logps(logits, target)[0].detach().double())
            return logits.new_zeros(())
        if self._objective is not None:
            rows = unpack_rows(target, self._rows)
            loss = self._objective.logits_loss(logits, rows, rows.get("ref_logps"))
            self._metrics.append(self._objective.take_metrics())
        else:
            loss = self.loss_fn(logits, target)
        self._losses.append(loss.detach().double())
        return loss * (self._scale.to(loss.device) if torch.is_tensor(self._scale) else self._scale)

    def _schedule(self, shape: tuple[int, int], m: int, keys: tuple[str, ...], train: bool):
        """One PipelineStage + schedule per (batch shape, micro-batches, inputs, training or not): the
        stage infers the shapes it sends and receives on its first step and keeps them, and a first
        step without gradients (a reference or KL forward, evaluation) infers buffers without them."""
        key = (shape, m, keys, train)
        if key not in self._schedules:
            from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

            stage = PipelineStage(self.stage, self.layout.pp_rank, self.layout.pp, self.device,
                                  group=self.layout.pp_group)
            cls = Schedule1F1B if self.schedule_name == "1f1b" and m >= self.layout.pp else ScheduleGPipe
            self._schedules[key] = cls(stage, n_microbatches=m, loss_fn=self._loss, scale_grads=False)
        return self._schedules[key]

    def _run(self, batch: dict[str, torch.Tensor], m: int, train: bool, rows: bool = False) -> torch.Tensor:
        """The summed loss of `batch` (or, `rows`, each row's record) as the last stage computed it, on
        every rank of the pipeline."""
        given = batch
        batch = pad_to_multiple(batch, PAD_MULTIPLE, self.pad_id)
        extra = {k: v.to(self.device) for k, v in stage_inputs(batch).items()}
        # every stage builds its mask from the same positions
        if "position_ids" not in extra:
            b, t = batch["input_ids"].shape
            extra["position_ids"] = torch.arange(t, device=self.device).unsqueeze(0).expand(b, t).contiguous()
        schedule = self._schedule(tuple(batch["input_ids"].shape), m, tuple(sorted(extra)), train)
        args = (batch["input_ids"].to(self.device),) if self.first else ()
        target = None
        if self.last:
            target = batch["labels"]
            # the padded sequences, and the rows' own values (a reference's)
            if self._objective is not None:
                target, self._rows = pack_rows({**given, **batch})
            target = target.to(self.device)
        self._losses, self._metrics = [], []
        kept = None
        # the step's sums so far, apart from this batch's (`_loss` takes them)
        if self._objective is not None:
            kept = self._objective.take_metrics()
        (schedule.step if train else schedule.eval)(*args, target=target, losses=[] if self.last else None,
                                                    return_outputs=False, **extra)
        # the last m records are this step's micro-batches (a schedule's first step also calls the
        # loss function once on a stand-in output, to set up backward)
        if rows:
            total = (torch.cat(self._losses[-m:]) if self.last
                     else torch.zeros(len(given["input_ids"]), dtype=torch.float64, device=self.device))
        else:
            total = (torch.stack(self._losses[-m:]).sum() if self.last
                     else torch.zeros((), dtype=torch.float64, device=self.device))
        # every rank of the pipeline reports the loss the last stage computed
        dist.broadcast(total, group=self.layout.pp_group, group_src=self.layout.pp - 1)
        # and the objective's metrics, for the step's record
        if self._objective is not None:
            sums = (torch.stack(self._metrics[-m:]).sum(0).to(self.device) if self.last
                    else torch.zeros(self._objective.metric_width, dtype=torch.float64, device=self.device))
            dist.broadcast(sums, group=self.layout.pp_group, group_src=self.layout.pp - 1)
            self._objective.state.add(sums if kept is None else kept + sums)
        return total

    def train_step(self, batch: dict[str, torch.Tensor], scale: float | torch.Tensor, objective=None) -> torch.Tensor:
        """Forward and backward of one batch in m micro-batches; gradients accumulate. `scale` may be a
        tensor (the loop's global target count stays on the device). `objective`: a preference
        objective computed on the last stage instead of the token loss (m splits keep pairs whole:
        `toolkit.config.objectives.objective_problems`)."""
        self._scale, self._objective = scale, objective
        try:
            return self._run(batch, self.microbatches, train=True)
        finally:
            self._objective = None

    @torch.no_grad()
    def sequence_logps(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Each row's summed target log-probability (float64), on every rank of the pipeline: a
        forward in the run's pipeline micro-batches where they divide the rows."""
        self._logps_only = True
        try:
            rows = len(batch["input_ids"])
            return self._run(batch, self.microbatches if rows % self.microbatches == 0 else 1, train=False, rows=True)
        finally:
            self._logps_only = False

    @torch.no_grad()
    def loss_sum(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self._run(batch, 1, train=False)

    @torch.no_grad()
    def loss_check(self, batch: dict[str, torch.Tensor]) -> tuple[float, float] | None:
        """(the loss per target token as the last stage computes it, the model's own loss on the same
        final hidden states: `split.own_loss`) on `batch`, on the last stage; None on the others. One
        pipeline forward: every rank of the pipeline group calls it."""
        # as `_run` pads it: the kept states' length
        batch = pad_to_multiple(batch, PAD_MULTIPLE, self.pad_id)
        self.stage.keep_hidden = self.last
        try:
            total = self._run(batch, 1, train=False)
        finally:
            self.stage.keep_hidden = False
        if not self.last:
            return None
        hidden, self.stage.kept = self.stage.kept, None
        # the LM head whole while the model's own forward runs it (collective over the shard group)
        if self.sharded:
            self.stage.unshard()
        try:
            with autocast(self.device, self.stage.autocast_dtype):
                own = own_loss(self.model, hidden, batch["input_ids"], batch["labels"])
        finally:
            if self.sharded:
                self.stage.reshard()
        return (total / count_targets(batch["labels"]).clamp(min=1)).item(), own.item()

    def named_trainable(self, cuts: dict) -> list:
        """(full-model name, parameter, its cut) of this stage's trainable parameters, a sharded checkpoint's
        pieces; a tied LM head under its embedding's name, as a model without stages names it."""
        embed = self.model.get_input_embeddings().weight
        embed_name = next((n for n, p in self.model.named_parameters() if p is embed), None)
        out = []
        for n, p in self.names.items():
            if p.requires_grad:
                name = embed_name if self.tied is not None and p is self.tied and embed_name else n
                out.append((name, p, cuts.get(n, cuts.get(name))))
        return out

    def finish_grads(self) -> None:
        """Sum the tied embedding's two halves; sum gradients over data-parallel replicas (the loss is
        already divided by the global batch's target count: `toolkit.parallel.strategy.loss_scale`;
        FSDP2 has summed them already when the stage is sharded)."""
        if self.tied is not None and self.tied.grad is not None:
            dist.all_reduce(local(self.tied.grad), group=self.layout.tie_group)
        if self.layout.dp > 1 and not self.sharded:
            grads = [p.grad for p in self.stage.parameters() if p.grad is not None]
            if grads:
                flat = torch._utils._flatten_dense_tensors(grads)
                dist.all_reduce(flat, group=self.layout.dp_group)
                for g, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                    g.copy_(synced)

    def clip_grad_norm(self, max_norm: float, parallelized, shard_group=None,
                       expert_groups: tuple = ()) -> torch.Tensor:
        """The full model's gradient norm: squares summed over the stages (a tied weight once), and
        over the groups that hold the rest of each parameter (`toolkit.parallel.parallelize.
        Parallelized.norm_parts`: TP slices over the TP group, FSDP2 shards over `shard_group`, the
        experts over `expert_groups`)."""
        params = list(self.stage.parameters())
        counted = {n: p for n, p in self.names.items()
                   if not (self.tied is not None and p is self.tied and not self.first)}
        shard = (shard_group,) if shard_group is not None else ()
        parts = parallelized.norm_parts(counted, shard, outer=(self.layout.pp_group,), expert_groups=expert_groups)
        return clip_grad_norm(params, max_norm, parts)

    def _unshard_outside_blocks(self) -> None:
        """Plain whole parameters in place of the stage root's FSDP2 shards (collective over the shard
        group): the HF model's own forward never calls the stage root, whose hook would gather them."""
        in_blocks = {id(m) for block in self.stage.layers for m in block.modules()}
        for module in self.stage.modules():
            if id(module) in in_blocks:
                continue
            for name, p in list(module._parameters.items()):
                if p is not None and hasattr(p, "full_tensor"):
                    module._parameters[name] = nn.Parameter(p.full_tensor(), requires_grad=p.requires_grad)

    def gather(self, to_cpu: bool = True) -> nn.Module:
        """Every rank's full HF model with the trained weights of every stage (collective over the
        pipeline group): what `save_final` writes. Moved to CPU after training (the integrity reload
        and exact match run it there); left in place for a mid-run save, so training goes on."""
        mine = {n: full(p).detach().cpu() for n, p in self.names.items() if p.requires_grad}
        every: list[dict] = [None] * self.layout.pp  # type: ignore[list-item]
        dist.all_gather_object(every, mine, group=self.layout.pp_group)
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for state in every:
                for n, v in state.items():
                    # this rank's own are current
                    if n not in self.names:
                        params[n].copy_(v)
        # stays where it is: after training the weights the stage holds outside its blocks (embedding, norm, head)
        # become whole tensors; blocks gather theirs in every forward
        if self.sharded:
            if to_cpu:
                self._unshard_outside_blocks()
            return self.model
        return self.model.to("cpu") if to_cpu else self.model
