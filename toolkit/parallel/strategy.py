"""The strategy seam: everything the training loop, checkpoints and evaluation ask of a parallel
layout, so that none of them branches on which layout runs (torchtitan's `parallelize` split).

`Strategy` is the typed face. A strategy runs the step and nothing else: how a micro-batch's forward and
backward run, the gradient norm, the pipeline's schedule, DeepSpeed's engine. What shapes the model is
`toolkit.parallel.parallelize`'s; what every layout is built from (`Parts`: the data shard, the
context-parallel slices, the loss head with its objective, what `parallelize` applies) is made once, by
`toolkit.parallel.build.make_strategy`, from `toolkit.layout.rules.runtime`. One class per runtime:

- `accelerated.AccelerateStrategy`: DDP, or one process, through accelerate (x cp on the mesh);
- `accelerated.DeepSpeedStrategy`: DeepSpeed ZeRO-0..3 (+ offload) through accelerate; every
  DeepSpeed quirk lives there;
- `sharded.MeshStrategy`: FSDP2 (`--fsdp`, `--dp-shard`, HSDP) or DDP over the mesh, with the project's TP
  layers, expert parallel and context parallel inside;
- `pp.strategy.PipelineStrategy`: one stage per rank over the mesh's `pp` groups; in one process, the
  naive pipeline with every stage.

No strategy derives from another: each is its `Parts` and its step, and the few defaults most of them
keep are `Strategy`'s own.
"""

from __future__ import annotations

from abc import abstractmethod
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Protocol

import torch

from toolkit.layout.dims import ParallelDims
from toolkit.objectives.head import LossCheck, LossHead, LossMetrics
from toolkit.model.load import ModelShape
from toolkit.objectives.base import LayoutHooks

if TYPE_CHECKING:
    from toolkit.objectives.base import Objective
    from toolkit.parallel.parallelize import Parallelism, Parallelized


@dataclass(frozen=True)
class Settings:
    """What the strategies and `parallelize` read of the run's config, taken once by `of` (in
    `toolkit.parallel.build.make_strategy`): no strategy carries the config."""
    # --loss
    loss: str = "auto"
    # --gradient-checkpointing
    checkpointing: bool = False
    # --compile given (auto compiles later, from the loop)
    compile: bool = False
    # --fsdp-sharding full (grad_op keeps parameters gathered from forward to backward)
    reshard: bool = True
    # --seq-len: a pipeline times its stage split on the longest row it reads
    seq_len: int = 2048
    # the kernels and adapters `parallelize` applies first
    model: ModelShape = ModelShape()
    # DeepSpeed's engine divides by its configured accumulation; a --deepspeed file's optimizer and schedule
    # fill their "auto"s with the run's values
    grad_accum: int = 1
    micro_batch: int = 1
    lr: float = 2e-5
    weight_decay: float = 0.0
    warmup_steps: int = 0
    max_grad_norm: float = 1.0
    # --deepspeed
    deepspeed_file: str = ""
    # the pipeline's (--pp, --pp-*): in one process --pp stages, which the world's dimensions do not count
    pp: int = 1
    pp_microbatches: int = 1
    pp_schedule: str = "gpipe"
    pp_balance: str = "params"
    pp_devices: str = ""

    @classmethod
    def of(cls, cfg) -> "Settings":
        """From a `toolkit.config.Config`."""
        t, par = cfg.train, cfg.parallel
        return cls(t.loss, t.gradient_checkpointing, t.compile is True, par.fsdp_sharding != "grad_op",
                   cfg.data.seq_len, ModelShape.of(cfg), t.grad_accum, t.micro_batch_size, cfg.lr, t.weight_decay,
                   t.warmup_steps, t.max_grad_norm, par.deepspeed or "", par.pp, par.pp_microbatches,
                   par.pp_schedule, par.pp_balance, par.pp_devices or "")


@dataclass(eq=False)
class Parts:
    """What every strategy is built from, made once by `toolkit.parallel.build.compose`: a strategy class
    derives from `Parts` and `Strategy` and adds its step only. Left out, a part is one process's: the
    whole world data parallel, the token loss, nothing cut."""
    accelerator: Any
    dims: ParallelDims | None = None
    settings: Settings = Settings()
    # which shard of every global batch this rank reads
    data: "DataShard | None" = None
    # the loss of one micro-batch, with the run's objective (given at construction)
    loss: LossHead | None = None
    # what `parallelize` applies (`shard_model`)
    parallelism: "Parallelism | None" = None
    # what the layout decides for an objective (its whole rows' forward)
    hooks: LayoutHooks = LayoutHooks()
    # context parallel's slices (the identity where cp = 1)
    context: "ContextSlices | None" = None
    # `toolkit.parallel.mesh.Mesh`, where the layout has one
    mesh: Any = None
    # how `shard_model` cut the model (nothing, until it runs)
    parallelized: "Parallelized | None" = None
    # the run's objective (`toolkit.objectives.build.build_objective`): the loop asks it, the head runs its loss
    objective: "Objective | None" = None

    def __post_init__(self):
        from toolkit.parallel.parallelize import Parallelism, Parallelized

        a, n = self.accelerator, self.accelerator.num_processes
        self.dims = self.dims or ParallelDims(n, dp_replicate=n)
        self.data = self.data or DataShard(a, self.dims)
        self.loss = self.loss or LossHead(device_type=a.device.type, precision=a.mixed_precision)
        self.parallelism = self.parallelism or Parallelism(self.settings.model)
        self.context = self.context or ContextSlices(None, self.dims)
        self.parallelized = self.parallelized or Parallelized()


class Strategy(Protocol):
    """What a parallel layout does for a run. Required: the attributes (`Parts`') and the abstract methods
    (a class that leaves one out cannot be built); the rest are defaults that layouts keep unless they
    differ."""

    accelerator: Any
    dims: ParallelDims
    settings: Settings
    data: "DataShard"
    loss: LossHead
    parallelism: "Parallelism"
    hooks: LayoutHooks
    context: "ContextSlices"
    # how `parallelize` cut the model (nothing cut before `shard_model`, or without TP/EP)
    parallelized: "Parallelized"
    # the run's (`toolkit.objectives.base.Objective`)
    objective: "Objective"
    # toolkit.layout.rules.checkpoint_format
    checkpoint_format: str = "sharded"
    # a micro-batch reaches the model as collated (not cut into stages' or cp's pieces) the optimizer must step even on
    # a non-finite loss (DeepSpeed's engine)
    whole_batches: bool = True
    always_steps: bool = False
    # gradients are freed inside backward, so none can be measured after it
    frees_grads: bool = False

    @property
    def experts(self):
        """What expert parallel cut (`toolkit.parallel.ep.ExpertShards`), or None."""
        return self.parallelized.experts

    # --- model and optimizer
    def shard_model(self, model):
        """Applied right after loading, before `prepare`: the layout's one `toolkit.parallel.parallelize`."""
        from toolkit.parallel.parallelize import parallelize

        model, self.parallelized = parallelize(model, self.parallelism)
        return model

    @abstractmethod
    def prepare(self, model, optimizer_fn: Callable, loader) -> tuple[Any, Any, Any]:
        """(model, optimizer, this rank's loader), ready to train; the loss head chosen on the model."""

    def scheduler(self, optimizer, total_steps: int):
        """The learning-rate schedule the layout brings (a --deepspeed file's), or None for --lr-schedule."""
        return None

    def schedule_words(self) -> str:
        """What the start-up line calls the schedule `scheduler` brought."""
        return "the layout's schedule"

    @abstractmethod
    def describe(self) -> str:
        """The log lines that say how this layout runs (after `prepare`)."""

    # --- one optimizer step
    @abstractmethod
    def forward_backward(self, model, micro: list[dict], scale: float | torch.Tensor) -> torch.Tensor:
        """Forward and backward of one global batch's micro-batches on this rank, each micro-batch's
        summed loss times `scale` (1 / the global batch's target count) and `loss_scale`'s correction
        for this layout's backend; returns the summed loss (float64, on the device, no host sync).
        Gradients are synchronised: the gradient of the global batch's mean token loss."""

    def take_metrics(self) -> LossMetrics:
        """What the loss gathered over the micro-batches since the last call, on the device: a step's one
        read of its loss head (`toolkit.objectives.head.LossHead.take_metrics`)."""
        return self.loss.take_metrics(self.accelerator.device)

    @abstractmethod
    def clip_grad_norm(self, model, max_norm: float) -> torch.Tensor | None:
        """The whole model's gradient norm, clipped to `max_norm` (a tensor on the device)."""

    def step_applied(self, model) -> bool:
        """Whether the optimizer step just taken changed the weights (DeepSpeed skips fp16 overflows)."""
        return True

    # --- evaluation and generation
    def eval_device(self, model) -> torch.device:
        """Where evaluation inputs go."""
        return next(model.parameters()).device

    def eval_loss_sum(self, model, batch: dict) -> torch.Tensor:
        from toolkit.data.packing import model_inputs

        # an image-text batch's image inputs too
        logits = model(**model_inputs(batch)).logits
        return self.loss.loss_fn(logits, batch["labels"])

    def sequence_logps(self, model, batch: dict, reference: bool = False) -> torch.Tensor:
        """Each whole row's summed target log-probability, without gradients (a preference objective's
        reference pass, KL estimate and evaluation; under context parallel the rows are whole, as in
        evaluation); `reference`: the base model, LoRA's adapters disabled. Every rank gets them."""
        return self.hooks.forward_logps(model, batch, reference)

    def loss_check(self, model, batch: dict, full_logits: bool = False) -> LossCheck:
        """The loss this layout trains, per target token, against the model's own `model(input_ids,
        labels=...)` loss on `batch`, without gradients: they must agree before step 1
        (`toolkit.train.loss_check.check_loss`). `full_logits`: the LM head restored first, for the rest of
        the run (--loss auto after a fused head failed it). Every rank calls it (sharded forwards are
        collective)."""
        from toolkit.data.labels import check_window

        if full_logits:
            self.loss.full_logits()
        vocab = self.unwrap(model).config.get_text_config().vocab_size
        ours, own = self.loss.check(model, check_window(batch, vocab), self.context)
        return LossCheck(ours, own, self.loss.describe().removeprefix("loss: "), self.loss.head is not None)

    @contextmanager
    def generating(self, model) -> Iterator[torch.nn.Module]:
        """The HF module to sample from (`toolkit.objectives.grpo.sampling.sample`), its parameters gathered once
        for the whole block, not once per token (`gathered`), compiled blocks run eagerly. Every rank enters it
        together. Forwards inside may still be collective (the TP layers' all-reduces, among TP peers that
        hold the same prompts; expert parallel's all-to-alls, among ranks that hold others): give `sample`
        an `any_unfinished` that asks every rank. Training after it runs as it would have without it."""
        # said first by `rules.generation_problems`
        if self.parallelism.stages is not None or self.dims.cp > 1:
            raise RuntimeError("sampling does not run under --pp / --cp yet")
        with torch.no_grad(), torch.compiler.set_stance("force_eager"), self.gathered(model) as module:
            yield module

    def host_max(self, value: float) -> float:
        """The max of `value` over every rank, on the CPU (no wait for the work queued on a GPU): how the ranks
        agree on host facts (a row still sampling, a signal) at the same point."""
        from toolkit.parallel import host_all_reduce_max

        return host_all_reduce_max(value)

    def gather_objects(self, value) -> list:
        """`value` from every rank, in rank order (a CPU all-gather of picklable objects)."""
        from toolkit.parallel import host_gather

        return host_gather(value)

    def gathered(self, model):
        """A context yielding the unwrapped model with its parameters whole (`generating`): the model as
        it is where no parameter is sharded (one process, DDP, ZeRO-1/2, the TP layers: each rank holds
        its slices, exchanged inside their forwards, expert parallel likewise)."""
        return nullcontext(self.unwrap(model))

    # --- saving and loading
    def unwrap(self, model):
        return self.accelerator.unwrap_model(model)

    def export(self, model, final: bool = True):
        """The model to save (and, when `final`, to evaluate and return after training)."""
        return model

    @abstractmethod
    def state_dict(self, model) -> dict:
        """The full state dict (collective where the layout is sharded); complete on the main process."""

    def named_trainable(self, model) -> list:
        """(full-model name, this rank's parameter, its cut: `toolkit.parallel.cut.Cut` or None) of each
        trainable parameter this rank holds: what a sharded checkpoint saves, the optimizer state keyed by
        the same names."""
        cuts = self.parallelized.cuts
        return [(n, p, cuts.get(n)) for n, p in self.unwrap(model).named_parameters() if p.requires_grad]

    def save_run_config(self, out_dir: Path) -> None:
        """Write what the layout ran with beside the metrics (DeepSpeed's JSON), if anything."""

    def optimizer_state(self, model, optimizer) -> dict:
        """The optimizer's per-rank state for a checkpoint in the layout's own format
        (`checkpoint_format` "hf"; sharded checkpoints save `named_trainable` instead)."""
        raise NotImplementedError(f"{type(self).__name__} writes sharded checkpoints")

    def load_optimizer_state(self, model, optimizer, saved: dict) -> None:
        """Undo `optimizer_state`."""
        raise NotImplementedError(f"{type(self).__name__} writes sharded checkpoints")


class DataShard:
    """Which shard of every global batch this rank reads: data-parallel ranks read their own,
    model-parallel peers (TP, PP, CP: `dims.replicas` of them) read the same one."""

    def __init__(self, accelerator, dims: ParallelDims, rank: int | None = None):
        self.accelerator, self.dims = accelerator, dims
        self.rank = accelerator.process_index if rank is None else rank

    @property
    def ranks(self) -> int:
        return self.dims.dp

    @property
    def replicas(self) -> int:
        """Ranks that read the same shard: world-wide sums count it this many times."""
        return self.dims.replicas

    def loader(self, loader):
        """`loader` sharded by data-parallel rank (each rank reads its own micro-batches)."""
        from accelerate.data_loader import prepare_data_loader

        a = self.accelerator
        return prepare_data_loader(loader, a.device, num_processes=self.ranks, process_index=self.rank,
                                   put_on_device=True, even_batches=a.even_batches, dispatch_batches=False,
                                   non_blocking=a.non_blocking)


class ContextSlices:
    """Context parallel: each rank of a cp group holds a slice of every sequence (`toolkit.parallel.cp`),
    attention exchanged with Ulysses all-to-alls; absent (cp = 1) every method is the identity."""

    def __init__(self, mesh, dims: ParallelDims):
        self.group = mesh.group("cp") if mesh is not None and dims.cp > 1 else None
        self.cp, self.context = dims.cp, None

    def attach(self, model):
        """Swap in the Ulysses attention (same weights), once the model is loaded."""
        if self.group is not None:
            from toolkit.parallel.cp import ContextParallel, use_ulysses

            use_ulysses(model)
            self.context = ContextParallel(self.group, model.config, model.get_input_embeddings().weight.dtype)
        return model

    def slice(self, batch: dict):
        """This rank's slice of `batch`, with the whole sequences' attention mask set for the forward and
        backward run inside (else the batch as it is)."""
        return self.context.shard(batch) if self.context is not None else nullcontext(batch)

    def total(self, total: torch.Tensor) -> torch.Tensor:
        """Every cp rank reports the whole sequences' loss, as model-parallel replicas do."""
        if self.context is not None:
            import torch.distributed as dist

            dist.all_reduce(total, group=self.group)
        return total

    def describe(self) -> str:
        return (f"context parallel: {self.cp} ranks per sequence (Ulysses all-to-all attention)\n" if self.context
                else "")


def loss_scale(scale: float | torch.Tensor, averaged_over: int, divided_by: int) -> float | torch.Tensor:
    """What a micro-batch's summed token loss is multiplied by before backward, in one place: `scale`
    (1 / the global batch's target count: the loop's), times the ranks whose gradients the backend
    averages (DDP's and DeepSpeed's mean over their data-parallel group, dp x cp under context
    parallel, where the true gradient is the sum of the ranks' tokens; 1 where the reductions are sums:
    FSDP2 with its gradient division off, `toolkit.parallel.fsdp`, and the pipeline's own all-reduce),
    times the accumulation steps it divides the loss by (accelerate's `backward`: the step's
    micro-batches; DeepSpeed's engine: its configured --grad-accum). So the gradient is the global
    batch's mean token loss's, however the batch is split over ranks and accumulation steps."""
    return scale * (averaged_over * divided_by)


def accumulate(accelerator, model, micro: list[dict], scale: float | torch.Tensor, loss: LossHead,
               context: ContextSlices, averaged_over: int, divided_by: int | None = None) -> torch.Tensor:
    """Forward and backward of each micro-batch under accelerate's `accumulate` (gradients sync on the
    last), each summed loss times `loss_scale(scale, averaged_over, divided_by)`; the summed loss
    (float64, on the device). accelerate divides the loss by gradient_accumulation_steps and syncs on
    the last micro-batch: both are this step's count (`divided_by` by default), which keeps a short
    last step right."""
    accelerator.gradient_accumulation_steps, accelerator.step = len(micro), 0
    factor = loss_scale(scale, averaged_over, len(micro) if divided_by is None else divided_by)
    total = torch.zeros((), dtype=torch.float64, device=accelerator.device)
    for batch in micro:
        with accelerator.accumulate(model), context.slice(batch) as batch:
            step_loss = loss(model, batch)
            accelerator.backward(step_loss * factor)
            total += step_loss.detach().double()
    return context.total(total)
