"""Step checkpoints as sharded state (`torch.distributed.checkpoint`, DCP): every rank writes the
pieces of the full model's tensors it holds, named by the full model's parameter names and placed
at their offsets in the full tensor. A later run on another layout asks for the pieces it holds
there and DCP reads every saved chunk that overlaps them (resharding on load); no rank ever holds
the whole model.

Where a rank's piece sits in the full tensor follows from the layout that cut it:
- DDP, context parallel, one process: the whole tensor at offset 0 (replicas write it once: DCP's
  planner keeps one copy of identical chunks);
- FSDP2: a DTensor, placed by DTensor's own `compute_local_shape_and_global_offset`;
- the TP layers (`toolkit.parallel.tp`): the slice its `Cut` names (`toolkit.parallel.cut.Slice`: this
  rank's of the TP degree along a dim; a packed projection's: that slice of each part, one box per part),
  the FSDP2 shard (if any) inside it;
- pipeline stages: only the stage's own parameters, under the full model's names;
- expert parallel: the experts' slice its `Cut` names (dim 0; LoRA's B by its expert columns), placed
  as a TP slice, the FSDP2 shard (over the ranks holding the same experts) inside it.

Saved: the trainable parameters (all for a full finetune, the adapter for LoRA/QLoRA: the frozen
base is never written) and the optimizer's per-parameter state keyed by the same names, so Adam's
moments reshard exactly as their parameters do.
"""

from __future__ import annotations

import io
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from toolkit.parallel.cut import Cut


@dataclass
class Piece:
    """A rank's boxes of a full tensor of `shape`: each (offsets, view of `local`) holds the elements
    [offsets, offsets + view.shape) (one box, but a packed TP projection's slice is one box per part).
    Implements the hooks DCP's planners call on DTensor (`__create_write_items__`,
    `__create_chunk_list__`, `__get_tensor_shard__`)."""

    local: torch.Tensor
    shape: torch.Size
    boxes: list[tuple[torch.Size, torch.Tensor]]

    def size(self) -> torch.Size:
        return self.shape

    def __create_write_items__(self, fqn: str, _obj) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=offsets, sizes=view.size()),
                                                      size=self.shape,
                                                      properties=TensorProperties.create_from_tensor(self.local)))
                for offsets, view in self.boxes]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=offsets, sizes=view.size()) for offsets, view in self.boxes]

    def __get_tensor_shard__(self, index) -> torch.Tensor:
        return next(view for offsets, view in self.boxes if offsets == index.offset)


def piece(t: torch.Tensor, cut: Cut | None = None) -> Piece:
    """Where this rank's `t` (a parameter or its optimizer state) sits in the full tensor. `cut`: how
    the parameter was cut (`toolkit.parallel.cut.Cut`: a TP slice along a dim, a packed projection's
    slice of each part, an expert slice, each with this rank's place); None: whole."""
    from torch.distributed.tensor import DTensor

    # FSDP2: the shard within what the DTensor calls the full tensor
    if isinstance(t, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        # the storage itself, so a load writes into the parameter
        local = t._local_tensor
        _, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        offsets, shape = list(offsets), list(t.shape)
    else:
        local, offsets, shape = t.detach(), [0] * t.dim(), list(t.shape)
    # a TP or an expert slice (never both), placed alike
    cut_slice = cut.slice if cut is not None else None
    if cut_slice is None or cut_slice.size == 1:
        return Piece(local, torch.Size(shape), [(torch.Size(offsets), local)])
    tp_dim, tp_rank, tp = cut_slice.split, cut_slice.rank, cut_slice.size
    # contiguous: slice tp_rank of tp equal ones
    if isinstance(tp_dim, int):
        offsets[tp_dim] += tp_rank * shape[tp_dim]
        shape[tp_dim] *= tp
        return Piece(local, torch.Size(shape), [(torch.Size(offsets), local)])
    # packed: one run per part the local rows cross
    d, boxes = tp_dim.dim, []
    for at, full_at, n in tp_dim.runs(offsets[d], local.shape[d], tp_rank, tp):
        boxes.append((torch.Size(offsets[:d] + [full_at] + offsets[d + 1:]), local.narrow(d, at - offsets[d], n)))
    shape[d] = sum(tp_dim.parts)
    return Piece(local, torch.Size(shape), boxes)


class _RankFileWriter(HuggingFaceStorageWriter):
    """Each rank's pieces in one safetensors file (`shard-RRRRR.safetensors`; a packed TP projection's
    further boxes in `shard-RRRRR-K.safetensors`), each piece's offsets in the file's metadata: the
    layout `HuggingFaceStorageReader` reads back and reshards. Written
    with `save_file` straight from the tensors; the parent writer serializes the whole rank's
    state into one bytes object first (measured: twice the state in host RAM)."""

    def write_data(self, plan, planner):
        import json
        import os

        from safetensors.torch import save_file
        from torch.distributed.checkpoint.filesystem import _StorageInfo
        from torch.distributed.checkpoint.storage import WriteResult

        rank = plan.storage_data.get("shard_index", 1)

        def names(k: int) -> str:
            return f"shard-{rank:05d}.safetensors" if k == 0 else f"shard-{rank:05d}-{k}.safetensors"

        # (tensors, offsets) per file, a name at most once in each (the reader takes one box per name and
        # file): a packed TP projection's further boxes go to further files
        files: list[tuple[dict, dict]] = []
        results = []
        for item in plan.items:
            fqn = item.index.fqn
            k = next((i for i, (tensors, _) in enumerate(files) if fqn not in tensors), len(files))
            if k == len(files):
                files.append(({}, {}))
            # no copy when already so
            t = planner.resolve_data(item).detach().cpu().contiguous()
            files[k][0][fqn] = t
            files[k][1][fqn] = {"saved_offsets": list(item.tensor_data.chunk.offsets)}
            size = t.numel() * t.element_size()
            results.append(WriteResult(index=item.index, size_in_bytes=size,
                                       storage_data=_StorageInfo(relative_path=names(k), offset=0, length=size)))
        for k, (tensors, offsets) in enumerate(files):
            path = Path(str(self.path)) / names(k)
            save_file(tensors, path, metadata={"DCP_SHARDING_INFO": json.dumps(offsets), "DCP_VERSION": "1.0",
                                               "format": "pt"})
            fd = os.open(path, os.O_RDONLY)
            try:
                # on disk before the rename that publishes the checkpoint
                os.fsync(fd)
            finally:
                os.close(fd)
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(results)
        return done


class _SavePlanner(DefaultSavePlanner):
    def lookup_object(self, index: MetadataIndex):
        obj = self.state_dict[index.fqn]
        return obj.__get_tensor_shard__(index) if isinstance(obj, Piece) else super().lookup_object(index)


class _LoadPlanner(DefaultLoadPlanner):
    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        """DefaultLoadPlanner's, less `_init_state_dict` (which maps objects it does not know, a Piece,
        to None; it only materialises meta tensors, and ours never are)."""
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict

        self.original_state_dict = state_dict
        if self.flatten_state_dict:
            state_dict, self.mappings = flatten_state_dict(state_dict)
        self.state_dict, self.metadata, self.is_coordinator = state_dict, metadata, is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict[index.fqn]
        return obj.__get_tensor_shard__(index) if isinstance(obj, Piece) else super().lookup_tensor(index)

    # DCP would unpickle (weights_only=False)
    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        raise ValueError(f"{read_item.dest_index.fqn}: a sharded checkpoint holds tensors only")


def _named_state(named: Iterable[tuple[str, torch.Tensor, Cut | None]], optimizer, create_from=None) -> dict:
    """{"model": {name: Piece}, "optimizer": {name: {key: Piece or scalar tensor}}}. `create_from`: a
    checkpoint's metadata, from which missing optimizer state (before the first step) is created."""
    model, optim = {}, {}
    for name, p, cut in named:
        model[name] = piece(p, cut)
        state = optimizer.state[p]
        if create_from is not None and not state:
            for key, md in create_from.items():
                prefix = f"optimizer.{name}."
                if key.startswith(prefix) and isinstance(md, TensorStorageMetadata):
                    # a moment
                    state[key[len(prefix):]] = (torch.zeros_like(p) if md.size == model[name].shape
                                                # step
                                                else torch.zeros(md.size, dtype=md.properties.dtype))
        optim[name] = {k: piece(v, cut) if v.dim() and v.shape == p.shape else v
                       for k, v in state.items() if isinstance(v, torch.Tensor)}
    return {"model": model, "optimizer": optim}


def _drop_empty(state: dict) -> dict:
    """Pieces with no elements (an FSDP2 rank past the end of an uneven split) hold nothing to write."""
    return {k: _drop_empty(v) if isinstance(v, dict) else v for k, v in state.items()
            if not (isinstance(v, Piece) and v.local.numel() == 0)}


@contextmanager
def _dcp():
    """DCP warns that it runs "in a single process" whenever no process group exists: our intent
    there. Yields whether to pass `no_dist`."""
    import torch.distributed as dist

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield not (dist.is_available() and dist.is_initialized())


def save_sharded(folder: Path, named, optimizer) -> None:
    """Collective over every rank: each writes its pieces of `named` = [(name, parameter, cut)]
    and of their optimizer state under `folder` (DCP: one file per rank, `.metadata` from rank 0)."""
    state = _drop_empty(_named_state(named, optimizer))
    with _dcp() as no_dist:
        dcp.save(state, storage_writer=_RankFileWriter(str(folder), save_distributed=True),
                 planner=_SavePlanner(), no_dist=no_dist)


def read_metadata(folder: Path):
    return HuggingFaceStorageReader(str(folder)).read_metadata().state_dict_metadata


def load_sharded(folder: Path, named, optimizer, meta=None) -> list[str]:
    """Collective: read this layout's pieces of `named` and of their optimizer state from `folder`,
    whatever layout wrote it, in place. Returns the names the checkpoint lacks (it does not fit).
    `meta`: `read_metadata(folder)` where the caller has it (it opens every rank file's header)."""
    named = list(named)
    meta = read_metadata(folder) if meta is None else meta
    missing = [n for n, _, _ in named if f"model.{n}" not in meta]
    if missing:
        return missing
    state = _drop_empty(_named_state(named, optimizer, create_from=meta))
    with torch.no_grad(), _dcp() as no_dist:
        dcp.load(state, storage_reader=HuggingFaceStorageReader(str(folder)), planner=_LoadPlanner(), no_dist=no_dist)
    return []


def full_tensors(folder: Path, prefix: str = "model.") -> dict[str, torch.Tensor]:
    """Every tensor under `prefix`, whole, read on one process (for convert-checkpoint)."""
    meta = read_metadata(folder)
    state = {k: torch.empty(md.size, dtype=md.properties.dtype) for k, md in meta.items()
             if k.startswith(prefix) and isinstance(md, TensorStorageMetadata)}
    with _dcp():
        dcp.load(state, storage_reader=HuggingFaceStorageReader(str(folder)),
                 planner=_LoadPlanner(flatten_state_dict=False), no_dist=True)
    return {k[len(prefix):]: v for k, v in state.items()}
