"""The parallel flags, declared once: every degree and sharding switch of a run, with finetune.py's
defaults and help (`--tp`, `--dp-shard`, ...). The config's `parallel` section is this class, and the
layout rules (`toolkit.layout.rules`) and the planner read and build it. Pure Python: no torch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


def _f(default: Any, help: str, choices: tuple | None = None) -> Any:
    """A field with its help text and choices (`toolkit.config` turns each into a flag and a YAML key)."""
    return field(default=default, metadata={"help": help, **({"choices": choices} if choices else {})})


@dataclass(frozen=True)
class ParallelConfig:
    """How a run is laid out over its ranks (`toolkit.layout.rules` says which layouts may run)."""

    strategy: str = _f("manual", "auto: let the planner pick the layout (DDP/ZeRO/FSDP/offload or a tp/pp/cp/dp-shard "
                                 "mesh), checkpointing and batch sizes",
                       ("manual", "auto"))
    zero_stage: Optional[int] = _f(None, "DeepSpeed ZeRO stage (unset = plain DDP)", (0, 1, 2, 3))
    offload: str = _f("none", "DeepSpeed CPU offload (param offload needs ZeRO-3)",
                      ("none", "optimizer", "optimizer+param"))
    fsdp: bool = _f(False, "shard with PyTorch FSDP2 over the data-parallel ranks (--dp-shard inferred; composes with "
                           "--tp, --pp and --cp); under bf16 each block is gathered in bf16 and gradients reduce in "
                           "fp32, with no autocast (also on one GPU)")
    fsdp_sharding: str = _f("full", "FSDP2: full = ZeRO-3-like, grad_op = ZeRO-2-like, hybrid = shard within a "
                                    "node and replicate across nodes (HSDP: --dp-replicate nodes)",
                            ("full", "grad_op", "hybrid"))
    dp_shard: int = _f(0, "ranks that shard the weights with FSDP2 on the device mesh (0 = inferred); composes "
                          "with --tp and --dp-replicate")
    dp_replicate: int = _f(0, "replicas of the sharded (or DDP) data-parallel group (0 = inferred); with "
                              "--dp-shard: HSDP")
    tp: int = _f(1, "tensor-parallel degree: split every block over this many ranks of a node "
                    "(world = tp x data-parallel) as the config's base_model_tp_plan says (an MoE block's experts: "
                    "each expert's intermediate), with DDP, --dp-shard or --ep")
    cp: int = _f(1, "context-parallel degree: each of this many ranks holds 1/cp of every sequence "
                    "(Ulysses all-to-all attention; heads must divide by tp x cp); with DDP, --dp-shard or --tp")
    ep: int = _f(1, "expert-parallel degree: every MoE layer's experts split over this many of the --dp-shard ranks, "
                    "tokens sent to their experts' ranks and back by all-to-all (FSDP2 on the mesh, inferred "
                    "--dp-shard; composes with --cp, --tp and --pp)")
    pp: int = _f(1, "pipeline stages: one process splits the model over --pp-devices (naive pipeline); "
                    "several processes run one stage each (world = pp x data-parallel)")
    pp_microbatches: int = _f(1, "pipeline micro-batches per --micro-batch-size batch (must divide it); "
                                 "bubble fraction (pp-1)/(m+pp-1)")
    pp_schedule: str = _f("gpipe", "multi-process pipeline schedule (torch.distributed.pipelining)", ("gpipe", "1f1b"))
    pp_balance: str = _f("params", "split blocks into stages by parameter count or by measured block time",
                         ("params", "time"))
    pp_devices: str = _f("", "single process: comma-separated stage devices (default cuda:0..pp-1, "
                             "or cpu for every stage on a machine without GPUs)")
    nproc_per_node: int = _f(0, "start this many processes on this machine, each running this command, as torchrun "
                                "--standalone --nproc_per_node N does: a signal to this process reaches every rank "
                                "(each saves a checkpoint) and it exits with the ranks' code after their one line, "
                                "with no launcher traceback (0: this process alone, or the processes a launcher "
                                "started)")
    deepspeed: str = _f("", "your own DeepSpeed JSON (transformers Trainer's convention): its \"auto\" values are "
                            "filled from these settings; what it sets wins over their defaults, and a flag that "
                            "disagrees with it is an error")
