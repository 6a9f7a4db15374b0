"""Checkpoints under tensor parallelism: every tensor saved whole, by name, whatever mesh wrote it or reads it.

Note [tensor-parallel checkpoints]
    Under ``tensor_parallel_size=T`` a rank trains the local shard of each tensor-parallel matrix under the
    matrix's own name (Note [local parameters] in ``engine/tensor_parallel.py``), and the engine runs one
    data-parallel run per tensor-parallel position. Written as they are, those shards would sit in a full file
    as if they were whole. So a full file joins them: the optimizer state is first gathered over the
    data-parallel group of each position (to data-parallel rank 0, as without tensor parallelism), then those
    ``T`` ranks all-gather each tensor of a ``Shard(dim)`` parameter (its value, every per-element state
    tensor, its float32 master) over the tensor-parallel group and concatenate the shards along ``dim`` in
    tensor-parallel rank order; a replicated parameter is the same on every position and stays as it is, and
    so do scalars (``step``). The file is then the one a single process would write (parameter names, full
    shapes): ``torch.load`` or ``load_state_dict`` of a plain model reads it. On load every rank takes its
    shard of each full tensor of a ``Shard(dim)`` parameter (``chunk(T, dim)[t]``) before the data-parallel
    load path cuts its pieces, so a file resumes under any (data-parallel, tensor-parallel) shape, with or
    without tensor parallelism, and a file written without it resumes under it.

    A sharded directory holds the global tensors too (:func:`global_sharded_tensor`): each rank writes what it
    owns of its shard as chunks of the global tensor, at the shard's offset along the sharded dimension; a
    data-parallel piece of a shard is a few boxes of the shard (Note [pieces in checkpoints] in
    ``checkpoint/ownership.py``), each shifted by that offset. A replicated tensor is written by position 0
    only. On load each rank reads its shard, or its piece of it, out of the global tensors, so a directory also
    resumes under any shape and consolidates into the file a full save writes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..engine.tensor_parallel import TensorParallelSpec, spec_of
from ..layout import Piece
from .named_state import gather_named_state, to_cpu, transfer_device
from .ownership import MERGED_KEYS, boxes


@dataclass(frozen=True)
class TensorParallelCheckpoint:
    """How a rank under tensor parallelism joins its shards into full tensors and takes its shard back (Note
    [tensor-parallel checkpoints])."""

    specs: Mapping[str, TensorParallelSpec]
    """The spec of every parameter with a ``Shard`` placement, by checkpoint name (each name of a tied one)."""
    data_parallel: Any
    """The data-parallel group of this rank's tensor-parallel position (``None``: one data-parallel rank)."""
    joins: bool
    """Whether this rank is data-parallel rank 0 of its position: it holds the gathered state and joins it."""
    position: int
    """This rank's tensor-parallel position: a replicated tensor is written by position 0 only."""

    @classmethod
    def of(cls, module: nn.Module, data_parallel: Any, joins: bool) -> "TensorParallelCheckpoint":
        specs, position = {}, 0
        for name, p in module.named_parameters(remove_duplicate=False):
            spec = spec_of(p)
            if spec is not None:
                position = dist.get_rank(spec.group)
                if spec.shard_dim is not None:
                    specs[name] = spec
        return cls(specs, data_parallel, joins, position)

    # --- saving: full tensors --------------------------------------------------------------------------------------
    def gather(self, part: dict[str, Any]) -> Optional[dict[str, Any]]:
        """Every data-parallel rank's part of a named optimizer state on data-parallel rank 0 of this position
        (collective over that group); ``None`` elsewhere."""
        return to_cpu(part) if self.data_parallel is None else gather_named_state(part, self.data_parallel)

    def join_state_dict(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """A module's state dict with every shard joined into its full tensor (collective over the
        tensor-parallel group, on the ranks that :attr:`joins`; the others, which write nothing, keep theirs)."""
        if not self.joins:
            return state_dict
        joined = {key: self._join(key, state_dict[key]) for key in sorted(state_dict)}
        return {key: joined[key] for key in state_dict}

    def join_optimizer_state(self, named: dict[str, Any]) -> dict[str, Any]:
        """A gathered named optimizer state (and masters) with every shard joined (collective, as
        :meth:`join_state_dict`)."""
        out = dict(named)
        if "state" in named:
            out["state"] = {name: {k: self._join(name, entry[k]) for k in sorted(entry)}
                            for name, entry in sorted(named["state"].items())}
        if "master_weights" in named:
            out["master_weights"] = {name: self._join(name, value)
                                     for name, value in sorted(named["master_weights"].items())}
        return out

    def _join(self, name: str, value: Any) -> Any:
        spec = self.specs.get(name)
        if spec is None or not torch.is_tensor(value) or tuple(value.shape) != local_shape(spec):
            return value  # replicated, or not per-element (``step``)
        device = transfer_device(spec.group)
        local = value.detach().to(device).contiguous()
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(spec.group))]
        dist.all_gather(parts, local, group=spec.group)
        return torch.cat(parts, dim=shard_dim(spec)).to(value.device)

    # --- loading: this rank's shard --------------------------------------------------------------------------------
    def local(self, name: Optional[str], value: Any) -> Any:
        """``value`` (a full tensor of parameter ``name``, or a dict of its state) as this rank's shard of it;
        anything not of the parameter's full shape as it is."""
        spec = self.specs.get(name) if name is not None else None
        if spec is None:
            return value
        if isinstance(value, dict):
            return {k: self.local(name, v) for k, v in value.items()}
        if torch.is_tensor(value) and tuple(value.shape) == tuple(spec.shape):
            size, rank = dist.get_world_size(spec.group), dist.get_rank(spec.group)
            return value.chunk(size, dim=shard_dim(spec))[rank]
        return value

    def local_state_dict(self, state_dict: Mapping[str, Any]) -> dict[str, Any]:
        """A full state dict with each tensor-parallel parameter's entry cut to this rank's shard."""
        return {key: self.local(key, value) for key, value in state_dict.items()}

    # --- the sharded format: chunks of the global tensors ---------------------------------------------------------
    def sharded_model_entries(self, entries: Mapping[str, Any]) -> dict[str, Any]:
        """The model entries this rank writes to a sharded directory: each shard as its chunk of the global
        tensor; a replicated one by position 0 only."""
        out = {}
        for key, value in entries.items():
            if key in self.specs and torch.is_tensor(value):
                out[key] = global_sharded_tensor(value.detach(), self.specs[key])
            elif self.position == 0:
                out[key] = value
        return out

    def sharded_optimizer_state(self, named: dict[str, Any], converted: dict[str, Any], ownership) -> dict[str, Any]:
        """This rank's named optimizer state for a sharded directory: ``converted`` (``named`` with the pieces of
        replicated parameters as ``ShardedTensor``s) with every per-element tensor of a tensor-parallel
        parameter as its chunk of the global tensor (a piece as a few boxes of it); replicated parameters' state
        from position 0 only."""
        out = dict(converted)
        for key in MERGED_KEYS:
            if key not in named:
                continue
            section = {}
            for name, value in named[key].items():
                if name in self.specs:
                    section[name] = ({k: self._global(name, v, ownership) for k, v in value.items()}
                                     if isinstance(value, dict) else self._global(name, value, ownership))
                elif self.position == 0:
                    section[name] = converted[key][name]
            out[key] = section
        return out

    def _global(self, name: str, value: Any, ownership) -> Any:
        spec, piece = self.specs[name], ownership.piece(name)
        if not torch.is_tensor(value) or value.dim() == 0:
            return value  # ``step``: the same on every position
        if piece is not None and value.numel() == piece.numel:
            return global_sharded_tensor(value.reshape(-1), spec, ownership.split[name], *ownership.placement(name))
        return global_sharded_tensor(value, spec) if tuple(value.shape) == local_shape(spec) else value

    def loadable(self, key: str, tensor: torch.Tensor) -> Any:
        """What a sharded directory's entry ``key`` loads into: this rank's shard as its chunk of the global
        tensor, or ``tensor`` itself."""
        return global_sharded_tensor(tensor, self.specs[key]) if key in self.specs else tensor

    def read_view(self, name: str, item: Any, ownership) -> Optional[tuple[torch.Tensor, Any]]:
        """For an optimizer entry of a tensor-parallel parameter saved at its global shape: ``(buffer, loadable)``,
        the tensor this rank keeps (its shard, or its piece of it, flat) and the ``ShardedTensor`` DCP loads
        it through; ``None`` for anything else."""
        spec = self.specs.get(name)
        if spec is None or tuple(getattr(item, "size", ())) != tuple(spec.shape):
            return None
        piece, dtype = ownership.piece(name), item.properties.dtype
        if piece is None:
            local = torch.empty(local_shape(spec), dtype=dtype)
            return local, global_sharded_tensor(local, spec)
        flat = torch.empty(piece.numel, dtype=dtype)
        return flat, global_sharded_tensor(flat, spec, ownership.split[name], *ownership.placement(name))


def global_sharded_tensor(local: torch.Tensor, spec: TensorParallelSpec, slot: Any = None, owner: int = 0,
                          group_ranks: Sequence[int] = ()):
    """A ``ShardedTensor`` of ``spec``'s global shape whose local shard is ``local``: this rank's whole
    tensor-parallel shard (``slot`` ``None``), or its piece of it, flat, as owner ``owner`` of the layout slot
    ``slot`` (piece ``r`` lives on global rank ``group_ranks[r]`` at this position). The other positions hold
    the same pieces of their shards, on the ranks ``T`` apart (Note [identical layouts] in
    ``engine/tensor_parallel.py``), offset by the shard's width along the sharded dimension. No collective."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

    shape, dim, position = local_shape(spec), shard_dim(spec), dist.get_rank(spec.group)
    if slot is None:
        pieces, ranks = (Piece(0, 0, math.prod(shape)),), (dist.get_rank(),)
    else:
        pieces, ranks = slot.pieces, tuple(group_ranks)
    metadata, shards = [], []
    for other in range(dist.get_world_size(spec.group)):
        for piece in pieces:
            cursor = 0
            for offsets, sizes in boxes(shape, piece.start, piece.stop):
                offsets = list(offsets)
                offsets[dim] += other * shape[dim]
                where = f"rank:{ranks[piece.owner] + other - position}/{local.device}"
                metadata.append(ShardMetadata(offsets, list(sizes), where))
                if other == position and (slot is None or piece.owner == owner):
                    n = math.prod(sizes)
                    view = local if slot is None else local[cursor:cursor + n].view(sizes)
                    shards.append(Shard(view, metadata[-1]))
                    cursor += n
    properties = TensorProperties(dtype=local.dtype, layout=local.layout, requires_grad=False,
                                  memory_format=torch.contiguous_format, pin_memory=False)
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        shards, ShardedTensorMetadata(metadata, torch.Size(spec.shape), properties))


def shard_dim(spec: TensorParallelSpec) -> int:
    return spec.shard_dim % len(spec.shape)


def local_shape(spec: TensorParallelSpec) -> tuple[int, ...]:
    """The shape of one rank's shard (the group divides the dimension: Note [identical layouts])."""
    shape, dim = list(spec.shape), shard_dim(spec)
    shape[dim] //= dist.get_world_size(spec.group)
    return tuple(shape)
