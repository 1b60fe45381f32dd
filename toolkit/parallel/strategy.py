"""The strategy seam: everything the training loop, checkpoints and evaluation ask of a parallel
layout, so that none of them branches on which layout runs (torchtitan's `parallelize` split).

`Strategy` is the typed face. One class per runtime implements it, built by
`toolkit.parallel.build.make_strategy` from `toolkit.layout.rules.runtime`:

- `accelerated.AccelerateStrategy`: DDP, or one process, through accelerate (x cp on the mesh);
- `accelerated.DeepSpeedStrategy`: DeepSpeed ZeRO-0..3 (+ offload) through accelerate; every
  DeepSpeed quirk lives there;
- `sharded.MeshStrategy`: the project's TP layers over the mesh's `tp` groups, then FSDP2 over its
  data-parallel dimensions (`--fsdp`, `--dp-shard`, HSDP: `toolkit.parallel.fsdp`) or DDP over `dp`;
- `pp.strategy.PipelineStrategy`: one stage per rank over the mesh's `pp` groups; in one process, the
  naive pipeline with every stage.

No strategy derives from another: what several share is composed from the parts below (which shard
of the data a rank reads, the context-parallel slice, the loss head, the accumulation loop, the TP
shards in `toolkit.parallel.tp`), and the few defaults most of them keep are `Strategy`'s own.
"""

from __future__ import annotations

from abc import abstractmethod
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable, Protocol

import torch

from toolkit.layout.dims import ParallelDims
from toolkit.loss import target_loss_sum, token_loss_sum
from toolkit.parallel.tp import TPShards

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (logits, labels) -> summed loss


class Strategy(Protocol):
    """What a parallel layout does for a run. Required: the attributes and the abstract methods (a class
    that leaves one out cannot be built); the rest are defaults that layouts keep unless they differ."""

    accelerator: Any
    dims: ParallelDims
    data: "DataShard"  # which shard of every global batch this rank reads
    loss: "LossHead"  # the loss of one micro-batch (full logits, or a head that returns the loss sum)
    tp: TPShards  # the parameters TP split, by name (none where the layout has no TP)
    checkpoint_format: str = "sharded"  # toolkit.layout.rules.checkpoint_format
    whole_batches: bool = True  # a micro-batch reaches the model as collated (not cut into stages' or cp's pieces)
    always_steps: bool = False  # the optimizer must step even on a non-finite loss (DeepSpeed's engine)
    frees_grads: bool = False  # gradients are freed inside backward, so none can be measured after it

    # --- model and optimizer
    @abstractmethod
    def shard_model(self, model):
        """Applied right after loading, before `prepare` (splits, attention swaps)."""

    @abstractmethod
    def prepare(self, model, optimizer_fn: Callable, loader) -> tuple[Any, Any, Any]:
        """(model, optimizer, this rank's loader), ready to train."""

    def scheduler(self, optimizer, total_steps: int):
        """The learning-rate schedule the layout brings (a --deepspeed file's), or None for --lr-schedule."""
        return None

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

    @abstractmethod
    def clip_grad_norm(self, model, max_norm: float) -> torch.Tensor | None:
        """The whole model's gradient norm, clipped to `max_norm` (a tensor on the device)."""

    def step_applied(self, model) -> bool:
        """Whether the optimizer step just taken changed the weights (DeepSpeed skips fp16 overflows)."""
        return True

    # --- evaluation
    def eval_device(self, model) -> torch.device:
        """Where evaluation inputs go."""
        return next(model.parameters()).device

    def eval_loss_sum(self, model, batch: dict) -> torch.Tensor:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        return self.loss.loss_fn(logits, batch["labels"])

    def sequence_logps(self, model, batch: dict, reference: bool = False) -> torch.Tensor:
        """Each whole row's summed target log-probability, without gradients (a preference objective's
        reference pass, KL estimate and evaluation; under context parallel the rows are whole, as in
        evaluation); `reference`: the base model, LoRA's adapters disabled. Every rank gets them."""
        from toolkit.preference import whole_row_logps

        return whole_row_logps(model, batch, reference)

    def loss_check(self, model, batch: dict) -> tuple[float, float] | None:
        """(the loss this layout trains, per target token, the model's own `model(input_ids,
        labels=...)` loss) on `batch`, without gradients: they must agree before step 1
        (`toolkit.train.loss_check.check_loss`). None where this rank computes no loss (a pipeline's
        earlier stages). Every rank calls it (sharded forwards are collective)."""
        from toolkit.data.labels import check_window

        vocab = self.unwrap(model).config.get_text_config().vocab_size
        return self.loss.check(model, check_window(batch, vocab), getattr(self, "context", None))

    # --- saving and loading
    def unwrap(self, model):
        return self.accelerator.unwrap_model(model)

    def export(self, model, final: bool = True):
        """The model to save (and, when `final`, to evaluate and return after training)."""
        return model

    @abstractmethod
    def state_dict(self, model) -> dict:
        """The full state dict (collective where the layout is sharded); complete on the main process."""

    def named_trainable(self, model) -> list[tuple[str, torch.nn.Parameter, int | None]]:
        """(full-model name, this rank's parameter, TP split dim) of each trainable parameter this rank
        holds: what a sharded checkpoint saves, the optimizer state keyed by the same names."""
        return [(n, p, self.tp.split.get(n)) for n, p in self.unwrap(model).named_parameters() if p.requires_grad]

    def tp_coordinates(self) -> tuple[int, int]:
        """(this rank's TP rank, TP degree): where its TP slices sit in the full tensors."""
        return self.tp.coordinates()

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
        self.group = mesh.get_group("cp") if mesh is not None and dims.cp > 1 else None
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
        return f"context parallel: {self.cp} ranks per sequence (Ulysses all-to-all attention)\n" if self.context else ""


class LossHead:
    """One micro-batch's summed token loss: full logits and `loss_fn`, or the LM head replaced by a
    fused loss head (`toolkit.loss.loss_head_for`) that returns the sum itself, so (B, T, V) logits
    never exist. Context parallel batches carry labels already shifted (`targets`)."""

    def __init__(self, loss_fn: LossFn = token_loss_sum, device_type: str = "cpu", precision: str = "no"):
        self.loss_fn, self.device_type, self.head, self.rows_given = loss_fn, device_type, None, False
        self.precision = precision  # the run's mixed precision: the dtype a fused kernel must take
        self.choice, self.aux_coef, self.aux_sum = "full", 0.0, None
        self.objective = None  # a preference objective (`toolkit.preference.PreferenceLoss`): pairs, full logits
        self.router_load = None  # an MoE model's tokens per expert (`toolkit.router_load.RouterLoad`)

    def choose(self, model, choice: str) -> None:
        """`--loss` on the unwrapped model: a fused head where `choice`, the device and the model allow
        one (only for the standard token loss, which it computes exactly); and the model's router
        load-balancing loss, which its forward returns where its config sets `output_router_logits`.
        A preference objective keeps full logits and turns the model's dropout off (`prepare`)."""
        from toolkit.loss import loss_head_for

        self.choice = choice
        if self.objective is not None:
            self.objective.prepare(model)
        if self.loss_fn is token_loss_sum and self.objective is None:
            self.head = loss_head_for(model, choice, self.device_type, precision=self.precision)
        self.aux_coef = router_aux_coef(model.config)
        if self.router_load is None:
            from toolkit.router_load import RouterLoad

            self.router_load = RouterLoad.attach(model)  # tokens per expert, for the metrics

    def full_logits(self) -> None:
        """Back to full logits (`--loss auto` after a failed loss check): the LM head restored."""
        if self.head is not None:
            self.head.restore()
            self.head = None

    @property
    def fused(self) -> bool:
        """The head computes the loss on target tokens only (fewer LM-head FLOPs: the MFU count): on a CPU it
        finds them itself, on a GPU it is handed them (`target_rows`, whole batches only)."""
        return self.head is not None and (self.device_type != "cuda" or self.rows_given)

    def __call__(self, model, batch: dict) -> torch.Tensor:
        if self.objective is None:
            return self.token_sum(model, batch)
        from toolkit.data.packing import model_inputs

        from toolkit.preference import pairs_in

        inputs = batch["inputs"] if "targets" in batch else model_inputs(batch)  # a context-parallel slice's
        total, out = self.objective(model, batch, inputs)
        return total + self.aux(out, batch.get("labels"), False, count=pairs_in(batch))

    def token_sum(self, model, batch: dict) -> torch.Tensor:
        """The summed token loss of `batch` (and the router's, x its target tokens)."""
        from toolkit.data.packing import model_inputs

        if "targets" in batch:  # context parallel: this rank's slice, labels shifted before the split
            inputs, labels, shifted = batch["inputs"], batch["targets"], True
        else:
            inputs, labels, shifted = model_inputs(batch), batch["labels"], False
        if self.head is not None:  # the head returns the loss sum in place of logits
            rows = batch.get("target_rows")  # found by the collate on the CPU: no read-back to skip the others
            self.rows_given = rows is not None
            with self.head.labels(labels, shifted, rows=rows):
                out = model(**inputs)
            total = out.logits
        else:
            out = model(**inputs)
            total = (target_loss_sum if shifted else self.loss_fn)(out.logits, labels)
        return total + self.aux(out, labels, shifted)

    def aux(self, out, labels: torch.Tensor, shifted: bool, count: int | None = None) -> torch.Tensor | float:
        """coef x the router load-balancing loss x this micro-batch's target tokens: what the model adds to
        its mean loss when given labels, as a sum, so the global-token normalisation gives the model's
        own loss on one micro-batch (and over several, their aux losses weighted by target tokens). Its
        sum is kept for the metrics (`take_aux`)."""
        value = out.get("aux_loss") if self.aux_coef else None
        if value is None:
            return 0.0
        from toolkit.data.labels import count_targets

        n = count if count is not None else (labels != -100).sum() if shifted else count_targets(labels)
        weighted = value.float() * n
        self.aux_sum = weighted.detach().double() + (self.aux_sum if self.aux_sum is not None else 0.0)
        return self.aux_coef * weighted

    def take_aux(self) -> torch.Tensor | None:
        """The summed aux loss x target tokens of the micro-batches since the last call (None: no aux loss)."""
        taken, self.aux_sum = self.aux_sum, None
        return taken

    @torch.no_grad()
    def check(self, model, few: dict, context: ContextSlices | None = None) -> tuple[float, float]:
        """(this head's loss per target token, the model's own loss) on `few` rows (`check_window`):
        under context parallel the slices' losses summed over the cp group, against the model's own
        forward on the whole rows (outside a slice the Ulysses wrapper is the model's own attention)."""
        from toolkit.data.labels import count_targets
        from toolkit.data.packing import model_inputs

        if context is not None and context.context is not None:
            with context.slice(few) as part:
                ours = context.total(self.token_sum(model, part).double().reshape(1)).squeeze(0)
        else:
            ours = self.token_sum(model, few)
        ours = ours / count_targets(few["labels"]).clamp(min=1)
        self.take_aux()
        own = model(**model_inputs(few), labels=few["labels"]).loss
        return ours.item(), own.item()

    def describe(self) -> str:
        aux = f"; the router load-balancing loss x {self.aux_coef:g} added (aux_loss)" if self.aux_coef else ""
        if self.objective is not None:
            return f"loss: {self.objective.describe()}{aux}"
        return "loss: " + (self.head.describe() if self.head else "full logits + cross-entropy") + aux


def router_aux_coef(config) -> float:
    """The coefficient of the router load-balancing loss the model adds to its loss when given labels:
    `router_aux_loss_coef` where the config asks for router logits (`output_router_logits`), else 0."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if not getattr(text, "output_router_logits", False):
        return 0.0
    return float(getattr(text, "router_aux_loss_coef", 0.0) or 0.0)


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
