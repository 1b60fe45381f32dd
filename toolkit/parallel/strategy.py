"""One strategy seam: everything the training loop, checkpoints and evaluation ask of a parallel
layout, so that none of them branches on which layout runs (torchtitan's `parallelize` /
`pipelining_fn` split).

- `AccelerateStrategy`: DDP, DeepSpeed ZeRO-0..3 (+ offload) and FSDP2, all through accelerate.
  Every DeepSpeed quirk lives here.
- `TensorParallelStrategy`: the project's TP layers over the mesh's `tp` dimension, DDP over `dp`.
- `MeshShardedStrategy`: FSDP2 over the mesh's `dp_shard` (HSDP: `dp_replicate` x `dp_shard`),
  the TP layers inside when tp > 1.
- `PipelineStrategy`: one stage per rank over the mesh's `pp` dimension, each stage TP-split and/or
  FSDP2-sharded, data parallel over `dp`; in one process, the naive pipeline with every stage.

`make_strategy` decides the layout once (`ParallelDims`), checks it against the model's config
before any weights are read, and builds the device mesh where a layout needs one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch

from toolkit.config import Config
from toolkit.errors import UserError
from toolkit.layout.dims import ParallelDims
from toolkit.loss import token_loss_sum

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (logits, labels) -> summed loss


class AccelerateStrategy:
    """DDP / DeepSpeed / FSDP2: accelerate prepares the model and shards the data over every rank."""

    def __init__(self, accelerator, dims: ParallelDims | None = None, cfg: Config | None = None,
                 loss_fn: LossFn = token_loss_sum, mesh=None):
        self.accelerator, self.cfg, self.loss_fn = accelerator, cfg, loss_fn
        n = accelerator.num_processes
        self.dims = dims or ParallelDims(n, dp_replicate=n)
        self.deepspeed = accelerator.distributed_type == "DEEPSPEED"
        self.chunked = None  # the LM head that returns the loss sum itself (toolkit.loss)
        # context parallel: each rank of a cp group holds a slice of every sequence (toolkit.parallel.cp)
        self.cp_group = mesh.get_group("cp") if mesh is not None and self.dims.cp > 1 else None
        self.context = None  # its ContextParallel, once the model is known
        self._dp_rank = mesh["dp"].get_local_rank() if mesh is not None else None
        self.tp_split: dict[str, int] = {}  # parameter name -> the dim its TP slice was cut along
        self.file_schedule: dict | None = None  # a --deepspeed file's "scheduler", as it runs

    # --- data: which shard of every global batch this rank reads
    @property
    def data_rank(self) -> int:
        return self.accelerator.process_index if self._dp_rank is None else self._dp_rank

    @property
    def data_ranks(self) -> int:
        return self.dims.dp

    @property
    def replicas(self) -> int:
        """Ranks that read the same shard: world-wide sums count it this many times."""
        return self.dims.replicas

    def shard_loader(self, loader):
        from accelerate.data_loader import prepare_data_loader

        a = self.accelerator
        return prepare_data_loader(loader, a.device, num_processes=self.data_ranks, process_index=self.data_rank,
                                   put_on_device=True, even_batches=a.even_batches, dispatch_batches=False)

    # --- model and optimizer
    def shard_model(self, model):
        """Applied right after loading (ZeRO-3 partitions inside `from_pretrained` itself). Context
        parallel swaps in the Ulysses attention (same weights)."""
        if self.cp_group is not None:
            from toolkit.parallel.cp import ContextParallel, use_ulysses

            use_ulysses(model)
            self.context = ContextParallel(self.cp_group, model.config, model.get_input_embeddings().weight.dtype)
        return model

    def prepare(self, model, optimizer_fn: Callable, loader):
        optimizer = self._file_optimizer(model) or optimizer_fn(model)
        if self.context is not None:  # accelerate would shard the data over every rank, cp peers included
            model, optimizer = self.accelerator.prepare(model, optimizer)
            loader = self.shard_loader(loader)
        else:
            model, optimizer, loader = self.accelerator.prepare(model, optimizer, loader)
        self._choose_loss(model)
        return model, optimizer, loader

    def _file_optimizer(self, model):
        """A --deepspeed file that names an optimizer: DeepSpeed builds it (accelerate's DummyOptim
        stands in for it in `prepare`), with the file's values ("auto" ones filled in)."""
        ds = self.accelerator.state.deepspeed_plugin.deepspeed_config if self.deepspeed else {}
        if "optimizer" not in ds:
            return None
        from accelerate.utils import DummyOptim

        params, decay = [p for p in model.parameters() if p.requires_grad], self.cfg.train.weight_decay
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": decay},  # as make_optimizer:
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]  # no decay on norms, biases
        return DummyOptim([g for g in groups if g["params"]], lr=self.cfg.lr, weight_decay=decay)

    def scheduler(self, optimizer, total_steps: int):
        """The learning-rate schedule a --deepspeed file names (DeepSpeed's own class, built here on the
        prepared optimizer and stepped once per optimizer step by the loop, as DeepSpeed's engine steps
        it), or None for the toolkit's (--lr-schedule)."""
        if not (self.deepspeed and self.cfg is not None and self.cfg.parallel.deepspeed):
            return None
        from toolkit.parallel.zero import file_scheduler

        self.file_schedule, scheduler = file_scheduler(self.cfg, optimizer, total_steps)
        return scheduler

    def _choose_loss(self, model) -> None:
        from toolkit.loss import chunked_head_for

        if self.loss_fn is token_loss_sum:  # the chunked head computes exactly this loss
            self.chunked = chunked_head_for(self.unwrap(model), self.cfg.train.loss if self.cfg else "auto")

    def describe(self) -> str:
        """The log lines that say how this layout runs (after `prepare`)."""
        mesh = f"device mesh: {self.dims.describe()} (DDP over dp x cp)\n" if self.context else ""
        return mesh + self._step_lines()

    def _step_lines(self) -> str:
        cp = f"context parallel: {self.dims.cp} ranks per sequence (Ulysses all-to-all attention)\n" if self.context else ""
        return cp + "loss: " + ("chunked LM head + cross-entropy on target tokens" if self.chunked else "full logits + cross-entropy")

    def unwrap(self, model):
        return self.accelerator.unwrap_model(model)

    def save_run_config(self, out_dir: Path) -> None:
        """What DeepSpeed ran with, accelerate's "auto"s filled in."""
        if self.deepspeed and self.accelerator.is_main_process:
            config = dict(self.accelerator.state.deepspeed_plugin.deepspeed_config)
            if self.file_schedule:  # stepped by the loop, not by the engine
                config["scheduler"] = self.file_schedule
            if config.get("steps_per_print") == float("inf"):  # accelerate's "never", which JSON cannot hold
                config["steps_per_print"] = 2**31 - 1
            (out_dir / "ds_config.json").write_text(json.dumps(config, indent=2))

    # --- one optimizer step
    def _loss(self, model, batch: dict) -> torch.Tensor:
        from toolkit.data.packing import model_inputs
        from toolkit.loss import target_loss_sum

        if "targets" in batch:  # context parallel: this rank's slice, labels shifted before the split
            inputs, labels, shifted = batch["inputs"], batch["targets"], True
        else:
            inputs, labels, shifted = model_inputs(batch), batch["labels"], False
        if self.chunked is not None:  # the head returns the loss sum in place of logits
            with self.chunked.labels(labels, shifted):
                return model(**inputs).logits
        return (target_loss_sum if shifted else self.loss_fn)(model(**inputs).logits, labels)

    def forward_backward(self, model, micro: list[dict], scale: float) -> torch.Tensor:
        """Forward and backward of one global batch's micro-batches on this rank, each micro-batch's
        summed loss times `scale`; returns the summed loss (float64). Gradients are synchronised."""
        a = self.accelerator
        # accelerate divides the loss by gradient_accumulation_steps and syncs on the last micro-batch;
        # setting both to this step's count keeps a short last step right. DeepSpeed's engine divides
        # by its configured --grad-accum instead.
        a.gradient_accumulation_steps, a.step = len(micro), 0
        divisor = self.cfg.train.grad_accum if self.deepspeed else len(micro)
        # Context parallel: a rank's loss covers its slice of the tokens, and gradients are averaged
        # over dp x cp ranks, where the true gradient sums the cp slices: x cp undoes that mean.
        scale *= self.dims.cp
        total = torch.zeros((), dtype=torch.float64, device=a.device)
        for batch in micro:
            with a.accumulate(model), self._slice(batch) as batch:
                loss = self._loss(model, batch)
                a.backward(loss * (scale * divisor))
                total += loss.detach().double()
        if self.context is not None:  # every cp rank reports the whole sequences' loss, as replicas do
            import torch.distributed as dist

            dist.all_reduce(total, group=self.cp_group)
        return total

    def _slice(self, batch: dict):
        """Context parallel: this rank's slice of `batch`, with the whole sequences' attention mask set
        for the forward and backward run inside (else the batch as it is)."""
        from contextlib import nullcontext

        return self.context.shard(batch) if self.context is not None else nullcontext(batch)

    def clip_grad_norm(self, model, max_norm: float):
        return self.accelerator.clip_grad_norm_(model.parameters(), max_norm)

    def step_applied(self, model) -> bool:
        """Whether the optimizer step just taken changed the weights: DeepSpeed skips one on an fp16
        overflow, and then its schedule must not advance either."""
        return model.was_step_applied() if self.deepspeed and hasattr(model, "was_step_applied") else True

    @property
    def always_steps(self) -> bool:
        """DeepSpeed's engine must step every time (a non-finite step there only counts as skipped)."""
        return self.deepspeed

    def grads_held(self, model) -> int | None:
        """Gradient bytes this rank holds after backward (None: DeepSpeed freed them in backward)."""
        from toolkit.parallel.memory import grad_bytes

        return None if self.deepspeed else grad_bytes(model)

    # --- evaluation
    def eval_device(self, model) -> torch.device:
        """Where inputs go: the model's device (a gathered pipeline model sits on CPU after training);
        DeepSpeed's partitioned parameters can report CPU under offload, so it gets the rank's device."""
        return self.accelerator.device if self.deepspeed else next(model.parameters()).device

    def eval_loss_sum(self, model, batch: dict) -> torch.Tensor:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        return self.loss_fn(logits, batch["labels"])

    # --- saving
    @property
    def sharded_checkpoints(self) -> bool:
        """Step checkpoints as sharded DCP state any layout can read; DeepSpeed keeps its own per-rank
        ZeRO format (resumed on the same layout only)."""
        return not self.deepspeed

    @property
    def tp_group(self):
        return None

    def tp_coordinates(self) -> tuple[int, int]:
        """(this rank's TP rank, TP degree): where its TP slices sit in the full tensors."""
        import torch.distributed as dist

        group = self.tp_group
        return (dist.get_rank(group), dist.get_world_size(group)) if group is not None else (0, 1)

    def named_trainable(self, model) -> list[tuple[str, torch.nn.Parameter, int | None]]:
        """(full-model name, this rank's parameter, TP split dim) of each trainable parameter this
        rank holds: what a sharded checkpoint saves, with the optimizer state keyed by the same names."""
        return [(n, p, self.tp_split.get(n)) for n, p in self.unwrap(model).named_parameters() if p.requires_grad]

    def export(self, model, final: bool = True):
        """The model to save (and, when `final`, to evaluate and return after training)."""
        return model

    def state_dict(self, model) -> dict:
        """The full state dict (collective: sharded strategies gather it); complete on the main process.
        ZeRO-3 gathers it even where a --deepspeed file sets stage3_gather_16bit_weights_on_model_save
        false (accelerate then refuses; the final folder needs the whole model)."""
        if self.deepspeed and hasattr(model, "zero_gather_16bit_weights_on_model_save") and \
                model.zero_optimization_stage() == 3 and not model.zero_gather_16bit_weights_on_model_save():
            return model._zero3_consolidated_16bit_state_dict()
        return self.accelerator.get_state_dict(model)

    def optimizer_state(self, model, optimizer) -> dict:
        """DeepSpeed's checkpoints (the others are sharded): the ZeRO optimizer's own per-rank state
        (fp32 master partition, Adam moments) as weights_only-loadable values."""
        from toolkit.parallel.zero import plain

        return plain(optimizer.optimizer.state_dict())

    def load_optimizer_state(self, model, optimizer, saved: dict) -> None:
        """Undo `optimizer_state`. The model weights are already restored."""
        from toolkit.parallel.zero import load_partitioned, restore_loss_scaler

        zero = optimizer.optimizer
        load_partitioned(zero, restore_loss_scaler(zero, saved), self.accelerator.process_index,
                         self.accelerator.num_processes)


class TensorParallelStrategy(AccelerateStrategy):
    """TP layers over the mesh's `tp` groups; DDP over `dp`; the loader sharded by dp rank."""

    def __init__(self, accelerator, dims: ParallelDims, mesh, cfg: Config | None = None,
                 loss_fn: LossFn = token_loss_sum):
        super().__init__(accelerator, dims, cfg, loss_fn, mesh)
        from toolkit.parallel.mesh import grad_dim
        from toolkit.parallel.tp import make_layout

        self.layout = make_layout(dims.tp, mesh, grad_dim(dims))

    def shard_model(self, model):
        """Every rank loads the full weights and keeps its slice (LoRA adapters are created first, so
        TP=1 and TP=t start from the same adapter init)."""
        from toolkit.parallel.tp import apply_tensor_parallel

        model = apply_tensor_parallel(super().shard_model(model), self.layout.tp_group)
        self.tp_split = tp_names(model)[0]
        return model

    @property
    def tp_group(self):
        return self.layout.tp_group

    def prepare(self, model, optimizer_fn: Callable, loader):
        from toolkit.parallel.tp import prepare_tensor_parallel

        model, optimizer = prepare_tensor_parallel(self.accelerator, self.layout, model, optimizer_fn(model))
        self._choose_loss(model)
        return model, optimizer, self.shard_loader(loader)

    def describe(self) -> str:
        over = "dp x cp" if self.dims.cp > 1 else "dp"
        return f"device mesh: {self.dims.describe()} (TP layers, DDP over {over})\n{self._step_lines()}"

    def clip_grad_norm(self, model, max_norm: float):
        from toolkit.parallel.tp import clip_grad_norm

        return clip_grad_norm(model.parameters(), max_norm, self.layout)

    def state_dict(self, model) -> dict:
        """The TP shards gathered back into the full tensors a non-TP run would save."""
        from toolkit.parallel.tp import gather_state_dict

        return gather_state_dict(self.unwrap(model), self.layout.tp_group)


class MeshShardedStrategy(TensorParallelStrategy):
    """FSDP2 `fully_shard` over the mesh's data-parallel dimensions (`dp_shard`; HSDP: `dp_replicate`
    x `dp_shard`, replicated across the outer and sharded within), with the TP layers inside when
    tp > 1 (torchtitan's 2-D layout). Each TP rank's FSDP group holds the ranks of the same TP
    coordinate, so it shards that rank's TP slices; gradients reduce-scatter over `dp_shard` and
    all-reduce over `dp_replicate`."""

    def __init__(self, accelerator, dims: ParallelDims, mesh, cfg: Config, loss_fn: LossFn = token_loss_sum):
        super().__init__(accelerator, dims, mesh, cfg, loss_fn)
        from toolkit.parallel.mesh import fsdp_mesh, grad_dim

        self.shard_mesh, self.shard_group = fsdp_mesh(mesh, dims), mesh.get_group(grad_dim(dims, sharded=True))
        self.tp_partial: list[str] = []  # TP-replicated parameters whose gradient is a per-rank partial sum

    def shard_model(self, model):
        model = super().shard_model(model) if self.dims.tp > 1 else AccelerateStrategy.shard_model(self, model)
        self.tp_split, self.tp_partial = tp_names(model)
        return model

    def prepare(self, model, optimizer_fn: Callable, loader):
        from torch.distributed.fsdp import fully_shard

        from toolkit.parallel.tp.plan import decoder_blocks

        a = self.accelerator
        model = model.to(a.device)
        reshard = self.cfg.parallel.fsdp_sharding != "grad_op"
        for block in decoder_blocks(model):
            fully_shard(block, mesh=self.shard_mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=self.shard_mesh, reshard_after_forward=reshard)
        if a.mixed_precision == "bf16":  # fp32 weights and reductions, bf16 compute (as the other layouts)
            from toolkit.parallel.tp import autocast_forward

            autocast_forward(a, model)
        optimizer = a.prepare_optimizer(optimizer_fn(model))  # over this rank's shards
        self._choose_loss(model)
        return model, optimizer, self.shard_loader(loader)

    def describe(self) -> str:
        inside = ", TP layers inside" if self.dims.tp > 1 else ""
        return f"device mesh: {self.dims.describe()} (FSDP2 over {self.shard_mesh.mesh_dim_names}{inside})\n" \
            + self._step_lines()

    def forward_backward(self, model, micro: list[dict], scale: float) -> torch.Tensor:
        total = super().forward_backward(model, micro, scale)
        all_reduce_partial_grads(self.unwrap(model), self.tp_partial, self.layout.tp_group)
        return total

    def clip_grad_norm(self, model, max_norm: float):
        from toolkit.parallel.grad_norm import clip_grad_norm

        named = list(self.unwrap(model).named_parameters())
        split = [p for n, p in named if n in self.tp_split]
        rest = [p for n, p in named if n not in self.tp_split]
        return clip_grad_norm([p for _, p in named], max_norm,
                              [(split, (self.layout.tp_group, self.shard_group)), (rest, (self.shard_group,))])

    def state_dict(self, model) -> dict:
        return gathered_state_dict(self.unwrap(model), self.tp_split, self.layout.tp_group)


class PipelineStrategy(AccelerateStrategy):
    """Stages over the mesh's `pp` groups (`layout`), or every stage in this process (no layout)."""

    def __init__(self, accelerator, dims: ParallelDims, mesh, cfg: Config, loss_fn: LossFn = token_loss_sum):
        super().__init__(accelerator, dims, cfg, loss_fn)
        from toolkit.parallel.pp import make_pipeline_layout, pipeline_devices

        self.layout = make_pipeline_layout(dims.pp, mesh) if mesh is not None else None
        if self.layout is None:
            pipeline_devices(cfg)  # a missing GPU fails now, before any weights are read
        self.tp_layout = None
        if dims.tp > 1:  # pp x tp: every stage holds TP layers over the mesh's tp groups
            from toolkit.parallel.tp import make_layout

            self.tp_layout = make_layout(dims.tp, mesh)
        self.shard_mesh = self.shard_group = None
        if dims.dp_shard > 1:  # pp x dp_shard: each stage FSDP2-sharded over its dp group
            from toolkit.parallel.mesh import fsdp_mesh

            self.shard_mesh, self.shard_group = fsdp_mesh(mesh, dims), mesh.get_group("dp_shard")
        self.tp_partial: list[str] = []
        self.pipe = None  # built in prepare(); None again once exported

    @property
    def data_rank(self) -> int:
        return self.layout.dp_rank if self.layout else 0

    def prepare(self, model, optimizer_fn: Callable, loader):
        from toolkit.data import longest_row
        from toolkit.parallel.pp import build_pipeline

        # the stage split may be timed on a real micro-batch's shape; padding as the loader pads
        sample = (loader.batch_size, longest_row(loader.dataset, self.cfg.data.seq_len))
        fn = loader.collate_fn  # a partial of collate, or a stream's StreamCollate
        pad_id = fn.pad_id if hasattr(fn, "pad_id") else fn.keywords["pad_id"]
        self.pipe = build_pipeline(self.cfg, self.accelerator, self.layout, model, sample, pad_id, self.loss_fn,
                                   self.shard_mesh)
        return self.pipe, optimizer_fn(self.pipe), self.shard_loader(loader)

    def describe(self) -> str:
        mesh = f"device mesh: {self.dims.describe()}\n" if self.layout is not None else ""
        return f"{mesh}{self.pipe.describe()}\nloss: full logits + cross-entropy on the last stage"

    def unwrap(self, model):
        return self.pipe.model if self.pipe is not None else model

    def forward_backward(self, model, micro: list[dict], scale: float) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float64, device=self.accelerator.device)
        for batch in micro:  # the stages run forward and backward themselves
            total += self.pipe.train_step(batch, scale=scale).to(total.device)
        self.pipe.finish_grads()  # tied embedding halves summed; gradients averaged over dp
        if self.shard_mesh is not None:  # the TP gradient hooks went with the parameters FSDP2 replaced
            all_reduce_partial_grads(self.pipe.model, self.tp_partial, self.tp_group)
        return total

    def shard_model(self, model):
        if self.tp_layout is not None:
            from toolkit.parallel.tp import apply_tensor_parallel

            model = apply_tensor_parallel(model, self.tp_layout.tp_group)
        self.tp_split, self.tp_partial = tp_names(model)
        return model

    @property
    def tp_group(self):
        return self.tp_layout.tp_group if self.tp_layout else None

    def clip_grad_norm(self, model, max_norm: float):
        if self.layout is None:  # the naive pipeline: every stage in this process
            return self.pipe.clip_grad_norm(max_norm)
        return self.pipe.clip_grad_norm(max_norm, self.tp_group, self.tp_split, self.shard_group)

    def eval_device(self, model) -> torch.device:
        return self.accelerator.device if self.pipe is not None else next(model.parameters()).device

    def eval_loss_sum(self, model, batch: dict) -> torch.Tensor:
        if self.pipe is not None:  # logits exist on the last stage only
            return self.pipe.loss_sum(batch)
        return super().eval_loss_sum(model, batch)

    def named_trainable(self, model) -> list[tuple[str, torch.nn.Parameter, int | None]]:
        """This stage's trainable parameters under the full model's names; a tied LM head is saved
        under its embedding's name, as a model without stages names it."""
        if self.layout is None:  # the naive pipeline: every stage in this process
            return super().named_trainable(model)
        embed = self.pipe.model.get_input_embeddings().weight
        embed_name = next((n for n, p in self.pipe.model.named_parameters() if p is embed), None)
        out = []
        for n, p in self.pipe.names.items():
            if p.requires_grad:
                name = embed_name if self.pipe.tied is not None and p is self.pipe.tied and embed_name else n
                out.append((name, p, self.tp_split.get(n, self.tp_split.get(name))))
        return out

    def export(self, model, final: bool = True):
        """Every stage's weights back in one HF model on every rank (collective). After training it
        moves to CPU and the pipeline is done; a mid-run save leaves it in place."""
        exported = self.pipe.gather(to_cpu=final)
        if final:
            self.pipe = None
        return exported

    def state_dict(self, model) -> dict:
        return gathered_state_dict(model, self.tp_split, self.tp_group)


# --- what the mesh layouts share: TP slices and FSDP2 shards, by parameter name (FSDP2 replaces
# the parameters, and with them the attributes and gradient hooks the TP plan put on them)

def tp_names(model) -> tuple[dict[str, int], list[str]]:
    """({name: dim its TP slice was cut along}, [names of TP-replicated parameters whose gradient is
    a per-rank partial sum]) of a model the TP plan has split (both empty otherwise)."""
    split = {n: p.tp_split_dim for n, p in model.named_parameters() if hasattr(p, "tp_split_dim")}
    partial = [n for n, p in model.named_parameters() if getattr(p, "tp_partial_grad", False)]
    return split, partial


def all_reduce_partial_grads(model, names: list[str], tp_group) -> None:
    """What the TP plan's gradient hooks do, on FSDP2's reduced shards: the sum over the TP group
    commutes with the mean over data-parallel ranks, and TP peers hold the same shard of these."""
    if not names or tp_group is None:
        return
    import torch.distributed as dist

    from toolkit.parallel.grad_norm import local

    params = dict(model.named_parameters())
    for name in names:
        if name in params and params[name].grad is not None:
            dist.all_reduce(local(params[name].grad), group=tp_group)


def gathered_state_dict(model, tp_split: dict[str, int], tp_group) -> dict:
    """Full tensors (collective): FSDP2 shards all-gathered, then TP slices concatenated."""
    import torch.distributed as dist

    from toolkit.parallel.grad_norm import full

    tp = dist.get_world_size(tp_group) if tp_group is not None else 1
    out = {}
    for key, v in model.state_dict().items():
        v = full(v)
        if key in tp_split and tp > 1:
            parts = [torch.empty_like(v) for _ in range(tp)]
            dist.all_gather(parts, v.contiguous(), group=tp_group)
            v = torch.cat(parts, dim=tp_split[key])
        out[key] = v.detach()
    return out


def make_strategy(cfg: Config, accelerator, model_path: str | None = None, loss_fn: LossFn = token_loss_sum):
    """Decide the layout once from the flags and the launched world (`toolkit.layout.rules`), check it
    against the model's config (one line for every problem, before any weights are read), build the
    mesh it needs."""
    import os

    from toolkit.layout import rules

    par, world = cfg.parallel, accelerator.num_processes
    problems = _model_problems(cfg, model_path, world) + rules.world_problems(par, world)
    dims, dim_problems = rules.dims_for(par, world, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    problems += [p for p in dim_problems if not problems]  # the model checks above name the world size already
    if problems:
        raise UserError("; ".join(problems))
    kind = rules.runtime(par, dims)
    if kind in ("accelerate", "deepspeed"):
        return AccelerateStrategy(accelerator, dims, cfg, loss_fn)
    if kind == "naive_pipeline":
        return PipelineStrategy(accelerator, dims, None, cfg, loss_fn)
    from toolkit.parallel.mesh import build_mesh

    mesh = build_mesh(dims, accelerator.device.type)
    if kind == "pipeline":
        return PipelineStrategy(accelerator, dims, mesh, cfg, loss_fn)
    if kind == "mesh_sharded":
        return MeshShardedStrategy(accelerator, dims, mesh, cfg, loss_fn)
    if kind == "tensor_parallel":
        return TensorParallelStrategy(accelerator, dims, mesh, cfg, loss_fn)
    return AccelerateStrategy(accelerator, dims, cfg, loss_fn, mesh)  # cp x DDP: accelerate's DDP over every rank


def _model_problems(cfg: Config, model_path: str | None, world: int) -> list[str]:
    """What the model's architecture refuses for --tp / --pp / --cp (read from its config, no weights)."""
    par = cfg.parallel
    if not model_path or (par.tp == 1 and par.pp == 1 and par.cp == 1):
        return []
    from transformers import AutoConfig

    from toolkit.layout.rules import model_problems

    config = AutoConfig.from_pretrained(model_path, trust_remote_code=cfg.model.trust_remote_code)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    problems = model_problems(text.to_dict(), par.tp, par.pp, par.cp, world)
    if par.pp > 1 and not problems:
        from toolkit.parallel.pp import pipeline_problems

        problems += pipeline_problems(config, cfg.model.trust_remote_code)
    return problems


