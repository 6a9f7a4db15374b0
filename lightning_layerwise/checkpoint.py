"""Checkpoints keyed by parameter name, in two formats, written so that a crash loses nothing.

Every trainable parameter has exactly one owner and a name, so a checkpoint
never needs to know the world size, the bucket size or the layout that wrote
it: it is a set of named tensors. This module is the engine half (plain torch
and ``torch.distributed.checkpoint``); the formats (``formats.py``) call it for the
session, whichever front door (Trainer, Fabric, a plain loop) drives it.

Note [checkpoint keys]
    The optimizer state is saved in *named form*: ``{"state": {name: {...}},
    "param_groups": [{..., "params": [name, ...]}]}``, the names being those of
    ``module.named_parameters()`` (a tied parameter under its first name). torch's
    ``Optimizer.load_state_dict`` pairs saved and current parameters by position
    within the param groups and never looks at what the saved ids are, so a
    named state dict loads into a plain optimizer (``ddp``) too; loading here
    pairs them the same way and additionally checks that the names agree, so a
    changed grouping is an error instead of silently crossed state. An indexed
    state dict (written by ``ddp``) loads by position, as torch does.

Note [sharded layout]
    A sharded checkpoint is a directory written by ``torch.distributed.checkpoint``
    with the state dict ``{"model": {key: tensor}, "optimizer_0": named form}``,
    plus Lightning's ``meta.pt`` with everything else (loops, callbacks, LR
    schedulers, precision scaler) and a ``"layerwise"`` record. Each parameter
    and its optimizer state are written once, by the parameter's owner; buffers,
    frozen parameters and the param groups by rank 0. This is the layout of
    Lightning's own sharded checkpoints, so
    ``python -m lightning.pytorch.utilities.consolidate_checkpoint DIR`` turns one
    into a single ordinary file. On load each rank reads only the parameters and
    the optimizer state it owns under the *new* layout, and an all-gather spreads
    the parameters; no rank ever holds the whole optimizer state.

Note [gathering a full checkpoint]
    A full checkpoint needs every rank's owned optimizer state on rank 0. Pickling
    it through ``gather_object`` would stage every rank's pickled tensors in one
    buffer, and on NCCL that buffer lives in GPU memory (world_size times the
    largest rank's state on rank 0's GPU). :func:`gather_named_state` therefore
    splits each rank's part into a *skeleton* (the nested dicts with every tensor
    replaced by a :class:`TensorSlot`: its index, shape and dtype) and the list of
    its tensors. Only skeletons go through ``gather_object``; the tensors travel
    one at a time as raw bytes, point to point (``batch_isend_irecv`` with a single
    op, which on NCCL reuses the group's communicator instead of creating one per
    pair of ranks), on the device the group's backend communicates on. Rank 0
    receives each tensor into a buffer of exactly its bytes, copies it to CPU and
    drops the buffer before the next, so its device holds at most one extra tensor
    at a time; a sender moves a tensor to that device (a no-op for GPU state on
    NCCL) only while it sends it.

Note [expert checkpoints]
    With expert parallelism (Note [expert parallelism] in ``process_groups.py``) the
    experts of a layer have the same *local* names on every expert-parallel rank. A
    checkpoint names them as a model holding every expert would
    (``experts.j`` of the rank at position ``r`` is ``experts.{r * n/E + j}``,
    :func:`lightning_layerwise.experts.expert_key_map`), model entries and optimizer
    state alike. Each expert tensor is written once, by its owner in its expert
    data-parallel group (buffers and frozen expert parameters by the first rank of
    that group), and on load each rank reads the global names of the experts it
    holds under the *new* expert-parallel size. The optimizer's param groups, written
    by rank 0, list only rank 0's experts, so with experts the named form is matched
    by name rather than by position. The sharded format only: a full checkpoint
    would need every rank's experts gathered to rank 0.

Note [weights_only]
    Everything this module reads back from a checkpoint it wrote is unpickled
    with ``weights_only=True`` semantics unless the caller passes
    ``weights_only=False`` (Lightning's ``fit(..., weights_only=False)``): ``meta.pt``
    with ``torch.load(weights_only=True)`` (:func:`load_meta`), the Python objects
    inside the ``torch.distributed.checkpoint`` files (the param groups), which
    DCP's default planner would unpickle with ``weights_only=False``, are first
    loaded with ``weights_only=True``, and DCP's ``.metadata`` index, a plain
    pickle, through an unpickler that allows only torch.distributed.checkpoint's
    classes, ``torch.Size``, dtypes, layouts and paths (:func:`read_dcp_index`).
    A refused object raises :class:`CheckpointError` naming its class.

Note [checkpoint ownership]
    Which entries a rank writes and reads follows from the layout alone, described
    by an :class:`Ownership`: a parameter in the layout is written and read by its
    owner only (its optimizer state and float32 master with it); everything else
    (buffers, frozen parameters, the param groups) is written by rank 0 and read by
    every rank. Without a wrapper (evaluation before any fit) a rank owns everything.
    The strategy builds one from the wrapper and hands it to
    :func:`model_entries_to_write`, :func:`read_sharded_checkpoint` and
    :func:`local_optimizer_state`; nothing here knows of Lightning's loops.

Note [atomic save]
    A checkpoint is written aside (``.NAME.partial``) and renamed into place when
    complete, so a process killed while saving leaves the previous checkpoint
    under ``NAME`` intact. A directory cannot replace another in one rename: the
    old one is first renamed to ``.NAME.old``, the new one into place, and then
    the old one is deleted. Should the process die between the two renames,
    loading ``NAME`` finds ``.NAME.old`` and loads it. ``meta.pt`` is written last:
    a directory without it is an interrupted save, never a checkpoint.
"""

from __future__ import annotations

import functools
import io
import math
import os
import pickle
import re
import shutil
from collections import defaultdict
from itertools import chain
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist

FORMAT = "lightning_layerwise.sharded"
FORMAT_VERSION = 1
META_FILENAME = "meta.pt"  # the name Lightning's sharded checkpoints and consolidate_checkpoint use
DCP_METADATA_FILENAME = ".metadata"
README_FILENAME = "README.txt"  # for whoever finds the directory where one file was expected
MODEL_KEY = "model"
CONSOLIDATE_COMMAND = "python -m lightning_layerwise consolidate"


@dataclass(frozen=True)
class Ownership:
    """What this rank writes to and reads from a checkpoint; see Note [checkpoint ownership]."""

    sharded: frozenset
    """Tensors in the layout (parameters and this rank's pieces of split ones): each has owners."""
    owned: frozenset
    """What this rank steps (whole parameters, pieces, float32 masters), and the split parameters it
    steps a piece of: it reads all of those."""
    written: frozenset
    """The tensors in the layout this rank writes: its whole parameters and pieces, and a split
    parameter's full value when this rank steps its first piece. Each is written by one rank."""
    owned_names: frozenset
    """Names of the parameters this rank steps, whole or in part (optimizer state and masters are keyed by them)."""
    writes_shared: bool
    """Whether this rank writes what lies outside the layout (rank 0)."""
    split: Mapping[str, Any] = field(default_factory=dict)
    """The layout slot of every split parameter, by name (Note [pieces in checkpoints])."""
    rank: int = 0
    """Which pieces this rank steps (:attr:`~lightning_layerwise.LayerwiseDataParallel.layout_rank`)."""
    group_ranks: tuple[int, ...] = (0,)
    """Global ranks of the ranks owning pieces, by owner index (where each piece lives)."""
    expert_names: frozenset = frozenset()
    """Names of the expert parameters this rank holds, in a model holding every expert (Note [expert
    checkpoints]); their state is always written by their owner."""
    expert_rank: int = 0
    """This rank's position in its expert data-parallel group."""
    expert_group_ranks: tuple[int, ...] = (0,)
    """Global ranks of that group, by position."""
    expert_outside: frozenset = frozenset()
    """Tensors of this rank's experts outside the layout (buffers, frozen parameters)."""
    writes_expert_shared: bool = False
    """Whether this rank writes ``expert_outside`` (the first rank of its expert data-parallel group)."""

    @classmethod
    def of(cls, wrapper, names: Mapping[torch.Tensor, str], is_global_zero: bool,
           masters: Iterable[torch.Tensor] = (), rename: Callable[[str], str] = lambda name: name,
           expert_outside: Iterable[torch.Tensor] = ()) -> "Ownership":
        """From a :class:`~lightning_layerwise.LayerwiseDataParallel` (``None``: this rank owns everything).

        ``names`` map tensors to checkpoint names; ``rename`` turns the wrapper's (local) names
        into those (global expert names, Note [expert checkpoints]).
        """
        if wrapper is None:
            return cls(frozenset(), frozenset(names), frozenset(), frozenset(names.values()), is_global_zero)
        slots, groups = wrapper.layout.params, wrapper.process_groups

        def global_ranks(group) -> tuple[int, ...]:
            return (0,) if group is None else tuple(dist.get_global_rank(group, r)
                                                    for r in range(dist.get_world_size(group)))

        experts = wrapper.expert_parallel_size > 1
        expert_local = wrapper._expert_names if experts else frozenset()
        expert_names = frozenset(rename(n) for n in expert_local)
        local = dict(wrapper.named_parameters_in_layout())
        stepped = list(wrapper.owned_parameters())  # whole parameters and pieces
        masters = list(masters)
        split = {rename(n): slots[n] for n in local.values() if slots[n].split}
        partly = [p for p, n in local.items() if slots[n].split and wrapper.shard_of(p) is not None]
        first = [p for p in partly if slots[local[p]].pieces[0].owner == wrapper._rank_for(local[p])]
        # Each element is stepped, and written, by one rank of the world, owner groups or not (Note [replica
        # sharing] in layout.py).
        written = stepped + first + masters
        return cls(frozenset(list(local) + stepped), frozenset(stepped + partly + masters), frozenset(written),
                   frozenset(rename(n) for n, _ in wrapper.named_owned_parameters()), is_global_zero, split,
                   wrapper.layout_rank, global_ranks(wrapper.layout_group), expert_names,
                   wrapper.expert_dp_rank, global_ranks(groups.expert_dp) if experts else (0,),
                   frozenset(expert_outside), experts and wrapper.expert_dp_rank == 0)

    def writes(self, tensor: Optional[torch.Tensor]) -> bool:
        if tensor in self.sharded:
            return tensor in self.written
        return self.writes_expert_shared if tensor in self.expert_outside else self.writes_shared

    def reads(self, tensor: torch.Tensor) -> bool:
        """Model entries and optimizer state this rank keeps: the owned ones and everything shared."""
        return tensor not in self.sharded or tensor in self.owned

    def placement(self, name: str) -> tuple[int, tuple[int, ...]]:
        """This rank's position among the owners of parameter ``name``, and their global ranks."""
        if name in self.expert_names:
            return self.expert_rank, self.expert_group_ranks
        return self.rank, self.group_ranks

    def piece(self, name: str):
        """This rank's :class:`~lightning_layerwise.layout.Piece` of split parameter ``name``, or ``None``."""
        slot = self.split.get(name)
        return None if slot is None else slot.piece_of(self.placement(name)[0])


# --- pieces of split parameters ------------------------------------------------------------
#
# Note [pieces in checkpoints]
#     A split parameter's optimizer state (and float32 master) exists in pieces, one per
#     rank that steps part of it (Note [pieces] in data_parallel.py): flat tensors of the
#     piece's length. A checkpoint never holds pieces: both formats store every per-element
#     state tensor at the parameter's full shape, as one process would, so a checkpoint is
#     the same whatever split it was saved from and loads at any other (and into ``ddp``).
#     The sharded format writes the pieces of one tensor as the shards of a
#     ``ShardedTensor`` of the full shape (a flat range of a row-major tensor is a few
#     rectangular boxes, :func:`boxes`); torch.distributed.checkpoint stores them as chunks
#     of one tensor and reads any other set of boxes from them. The full format gathers the
#     pieces to rank 0 and joins them. On load, each rank keeps the elements of its piece.
#     A state value is per-element when it is a tensor with at least one dimension and as
#     many elements as the piece (AdamW's ``exp_avg``); anything else (``step``) is the same
#     on every piece's owner and is written once.


def boxes(shape: Sequence[int], start: int, stop: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The flat elements ``[start, stop)`` of a row-major tensor of ``shape`` as rectangular boxes
    ``(offsets, sizes)``, in element order; concatenated flat, the boxes are the range."""
    if start >= stop:
        return []
    if len(shape) <= 1:
        return [((start,), (stop - start,))]
    row = math.prod(shape[1:])
    first, begin = divmod(start, row)
    last, end = divmod(stop, row)
    if first == last:
        return [((first, *o), (1, *z)) for o, z in boxes(shape[1:], begin, end)]
    out = []
    if begin:
        out += [((first, *o), (1, *z)) for o, z in boxes(shape[1:], begin, row)]
        first += 1
    if last > first:
        out.append(((first,) + (0,) * (len(shape) - 1), (last - first, *shape[1:])))
    if end:
        out += [((last, *o), (1, *z)) for o, z in boxes(shape[1:], 0, end)]
    return out


def _is_per_element(value: Any, piece) -> bool:
    return torch.is_tensor(value) and value.dim() >= 1 and value.numel() == piece.numel


def piece_sharded_tensor(flat: torch.Tensor, slot, rank: int, group_ranks: Sequence[int]):
    """A ``ShardedTensor`` of ``slot``'s full shape whose local shards view ``flat``, the piece of
    owner ``rank``; the piece of owner ``r`` lives on global rank ``group_ranks[r]`` (every rank that
    steps a piece of ``slot`` builds its own; no collective). See Note [pieces in checkpoints]."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

    shards_metadata, local = [], []
    for piece in slot.pieces:
        cursor = 0
        for offsets, sizes in boxes(slot.shape, piece.start, piece.stop):
            metadata = ShardMetadata(list(offsets), list(sizes), f"rank:{group_ranks[piece.owner]}/{flat.device}")
            shards_metadata.append(metadata)
            if piece.owner == rank:
                n = math.prod(sizes)
                local.append(Shard(flat[cursor:cursor + n].view(sizes), metadata))
                cursor += n
    properties = TensorProperties(dtype=flat.dtype, layout=flat.layout, requires_grad=False,
                                  memory_format=torch.contiguous_format, pin_memory=False)
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        local, ShardedTensorMetadata(shards_metadata, torch.Size(slot.shape), properties))


def pieces_as_sharded_tensors(named: dict[str, Any], ownership: Ownership) -> dict[str, Any]:
    """``named`` (this rank's named optimizer state) with every per-element piece of a split
    parameter's state and master as a ``ShardedTensor`` of the full shape, for the sharded format."""
    def convert(name: str, value: Any) -> Any:
        piece = ownership.piece(name)
        if piece is None or not _is_per_element(value, piece):
            return value
        return piece_sharded_tensor(value.reshape(-1), ownership.split[name], *ownership.placement(name))

    out = dict(named)
    if "state" in named:
        out["state"] = {n: {k: convert(n, v) for k, v in entry.items()} for n, entry in named["state"].items()}
    if "master_weights" in named:
        out["master_weights"] = {n: convert(n, v) for n, v in named["master_weights"].items()}
    return out


def mark_pieces(named: dict[str, Any], ownership: Ownership) -> dict[str, Any]:
    """Keys this rank's pieces by ``(name, start)`` so that gathering keeps every rank's (full format)."""
    out = dict(named)
    for key in _MERGED_KEYS:
        if key in named:
            out[key] = {((n, ownership.piece(n).start) if ownership.piece(n) is not None else n): v
                        for n, v in named[key].items()}
    return out


def join_pieces(merged: dict[str, Any], split: Mapping[str, Any]) -> dict[str, Any]:
    """Joins the pieces :func:`mark_pieces` keyed into full-shape tensors, keyed by name again."""
    out = dict(merged)
    for key in _MERGED_KEYS:
        if key not in merged:
            continue
        entries, pieces = {}, defaultdict(list)
        for k, v in merged[key].items():
            if isinstance(k, tuple):
                pieces[k[0]].append((k[1], v))
            else:
                entries[k] = v
        for name, parts in pieces.items():
            parts.sort(key=lambda part: part[0])
            shape = tuple(split[name].shape)
            if key == "master_weights":
                entries[name] = torch.cat([v.reshape(-1) for _, v in parts]).reshape(shape)
                continue
            joined = {}
            for k, v in parts[0][1].items():
                if torch.is_tensor(v) and v.dim() >= 1:
                    joined[k] = torch.cat([part[k].reshape(-1) for _, part in parts]).reshape(shape)
                else:
                    joined[k] = v
            entries[name] = joined
        out[key] = dict(sorted(entries.items()))
    return out


def model_entries_to_write(state_dict: Mapping[str, Any], tensors: Mapping[str, torch.Tensor],
                           ownership: Ownership) -> dict[str, Any]:
    """The entries of ``state_dict`` this rank writes to a sharded checkpoint.

    ``tensors`` is ``module.state_dict(keep_vars=True)``: the live tensor of each key.
    """
    return {key: value for key, value in state_dict.items() if ownership.writes(tensors.get(key))}


def optimizer_key(index: int) -> str:
    return f"optimizer_{index}"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded: incomplete, foreign or not matching the model/optimizer."""


# --- named optimizer state ---------------------------------------------------------------


def named_optimizer_state(optimizer: torch.optim.Optimizer, names: Mapping[torch.Tensor, str]) -> dict[str, Any]:
    """``optimizer.state_dict()`` with parameter names in place of indices (Note [checkpoint keys])."""
    local = optimizer.state_dict()
    params = list(chain.from_iterable(g["params"] for g in optimizer.param_groups))
    ids = list(chain.from_iterable(g["params"] for g in local["param_groups"]))
    unnamed = [tuple(p.shape) for p in params if p not in names]
    if unnamed:
        raise CheckpointError(f"the optimizer holds {len(unnamed)} tensor(s) that are not parameters of the model "
                              f"(shapes {unnamed[:3]}); only the model's parameters can be checkpointed by name.")
    id_to_name = {i: names[p] for i, p in zip(ids, params)}
    return {
        "state": {id_to_name[i]: value for i, value in local["state"].items()},
        "param_groups": [{**g, "params": [id_to_name[i] for i in g["params"]]} for g in local["param_groups"]],
    }


def local_optimizer_state(saved: Mapping[str, Any], optimizer: torch.optim.Optimizer,
                          names: Mapping[torch.Tensor, str], keep: Callable[[torch.Tensor], bool],
                          pieces: Optional[Mapping[torch.Tensor, tuple[Any, Sequence[int]]]] = None,
                          is_expert: Callable[[str], bool] = lambda name: False) -> dict[str, Any]:
    """A saved state dict (named or indexed) as ``optimizer.load_state_dict`` input, state only where ``keep``.

    ``pieces`` maps each piece of a split parameter the optimizer steps to its
    ``(Piece, full shape)``: its per-element state is cut to the piece (Note [pieces in
    checkpoints]). Raises :class:`CheckpointError` if the param groups do not line up.
    With expert parameters (``is_expert`` of a name), the named form is matched by name:
    each rank holds other experts than the rank that wrote the param groups (Note
    [expert checkpoints]); the dense names of each group must still agree.
    """
    saved_groups, groups = saved["param_groups"], optimizer.param_groups
    if len(saved_groups) != len(groups):
        raise CheckpointError(f"the checkpoint's optimizer has {len(saved_groups)} param group(s), this optimizer "
                              f"{len(groups)}; build the param groups as in the run that saved it.")
    by_saved_id: dict[Any, torch.Tensor] = {}
    named_form = all(isinstance(i, str) for g in saved_groups for i in g["params"])
    if named_form and any(is_expert(names.get(p, "")) for g in groups for p in g["params"]):
        for g_index, (saved_group, group) in enumerate(zip(saved_groups, groups)):
            saved_dense = [n for n in saved_group["params"] if not is_expert(n)]
            dense = [names.get(p) for p in group["params"] if not is_expert(names.get(p, ""))]
            if saved_dense != dense:
                raise CheckpointError(f"param group {g_index}: the checkpoint's dense parameters "
                                      f"{saved_dense[:3]}... differ from this optimizer's {dense[:3]}...; build the "
                                      "param groups as in the run that saved it.")
            by_saved_id.update((names[p], p) for p in group["params"])
    else:
        for g_index, (saved_group, group) in enumerate(zip(saved_groups, groups)):
            if len(saved_group["params"]) != len(group["params"]):
                raise CheckpointError(f"param group {g_index} has {len(saved_group['params'])} parameters in the "
                                      f"checkpoint and {len(group['params'])} in this optimizer.")
            for position, (saved_id, p) in enumerate(zip(saved_group["params"], group["params"])):
                if isinstance(saved_id, str) and saved_id != names.get(p):
                    raise CheckpointError(f"param group {g_index}, position {position}: the checkpoint has "
                                          f"{saved_id!r} where this optimizer has {names.get(p)!r}; build the param "
                                          "groups in the same order as the run that saved it.")
                by_saved_id[saved_id] = p
    local_id = {p: i for i, p in enumerate(chain.from_iterable(g["params"] for g in groups))}
    pieces = pieces or {}
    state = {}
    for k, v in saved.get("state", {}).items():
        if k in by_saved_id and keep(by_saved_id[k]):
            p = by_saved_id[k]
            if p in pieces:
                piece, shape = pieces[p]
                v = {key: piece.cut(value, shape) for key, value in v.items()}
            state[local_id[p]] = v
    param_groups = [{**sg, "params": [local_id[p] for p in g["params"]]} for sg, g in zip(saved_groups, groups)]
    return {"state": state, "param_groups": param_groups}


def to_cpu(value: Any) -> Any:
    if torch.is_tensor(value):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: to_cpu(v) for k, v in value.items()}
    if isinstance(value, list):
        return [to_cpu(v) for v in value]
    return value


_MERGED_KEYS = ("state", "master_weights")


class TensorSlot(NamedTuple):
    """A tensor's place in a skeleton (Note [gathering a full checkpoint]): what rank 0 allocates for it."""

    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def _map_leaves(value: Any, leaf: Callable[[Any], Any]) -> Any:
    """``value`` with ``leaf`` applied to everything that is not a dict, a list or a plain tuple."""
    if isinstance(value, dict):
        return {k: _map_leaves(v, leaf) for k, v in value.items()}
    if isinstance(value, list):
        return [_map_leaves(v, leaf) for v in value]
    if type(value) is tuple:
        return tuple(_map_leaves(v, leaf) for v in value)
    return leaf(value)


def split_tensors(value: Any, tensors: list[torch.Tensor]) -> Any:
    """``value`` with each tensor replaced by a :class:`TensorSlot`; the tensors are appended to ``tensors``."""
    def slot(leaf: Any) -> Any:
        if not torch.is_tensor(leaf):
            return leaf
        tensors.append(leaf)
        return TensorSlot(len(tensors) - 1, tuple(leaf.shape), leaf.dtype)

    return _map_leaves(value, slot)


def fill_tensors(value: Any, tensors: list[torch.Tensor]) -> Any:
    """The inverse of :func:`split_tensors`: each :class:`TensorSlot` replaced by ``tensors[slot.index]``."""
    return _map_leaves(value, lambda leaf: tensors[leaf.index] if isinstance(leaf, TensorSlot) else leaf)


def _slots(value: Any) -> list[TensorSlot]:
    found: list[TensorSlot] = []
    _map_leaves(value, lambda leaf: found.append(leaf) if isinstance(leaf, TensorSlot) else None)
    return found


def transfer_device(group=None) -> torch.device:
    """The device tensors must be on to be sent over ``group``: CPU for gloo (and MPI), else the accelerator."""
    backend = str(dist.get_backend(group)).lower()
    if "gloo" in backend or "mpi" in backend:
        return torch.device("cpu")
    accelerator = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
    if accelerator is not None:
        return torch.device(accelerator.type, torch.accelerator.current_device_index())
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of ``tensor``'s elements (copied only if not contiguous, conjugated or negated)."""
    flat = tensor.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
    return flat.view(torch.uint8)


def _exchange(op: Callable, buffer: torch.Tensor, peer: int, group) -> None:
    for work in dist.batch_isend_irecv([dist.P2POp(op, buffer, peer, group)]):
        work.wait()


def send_tensor(tensor: torch.Tensor, dst: int, device: torch.device, group=None) -> None:
    """Sends one tensor's bytes to global rank ``dst`` (matched by :func:`receive_tensor`); empty ones are not sent."""
    if tensor.numel() == 0:
        return
    _exchange(dist.isend, _as_bytes(tensor.detach().to(device)), dst, group)


def receive_tensor(slot: TensorSlot, src: int, device: torch.device, group=None) -> torch.Tensor:
    """Receives the tensor ``slot`` describes from global rank ``src``, on ``device``; returns it on CPU."""
    numel = math.prod(slot.shape)
    if numel == 0:
        return torch.empty(slot.shape, dtype=slot.dtype)
    buffer = torch.empty(numel * slot.dtype.itemsize, dtype=torch.uint8, device=device)
    _exchange(dist.irecv, buffer, src, group)
    received = buffer.cpu()  # one device buffer at a time: it is dropped on return
    return received.view(slot.dtype).reshape(slot.shape)


def gather_named_state(part: dict[str, Any], group=None) -> Optional[dict[str, Any]]:
    """Every rank's disjoint named optimizer state merged on rank 0 (collective); ``None`` elsewhere.

    ``state`` and ``master_weights`` are merged; ``param_groups`` are identical on
    every rank and taken from rank 0. The result is on CPU. Only skeletons (names,
    shapes, dtypes, hyperparameters) are pickled; tensors move one at a time with
    point-to-point tensor transfers (Note [gathering a full checkpoint]).
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return to_cpu(part)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    global_rank = (lambda r: dist.get_global_rank(group, r)) if group is not None else (lambda r: r)
    device = transfer_device(group)
    if rank != 0:
        tensors: list[torch.Tensor] = []
        skeleton = {key: split_tensors(part[key], tensors) for key in _MERGED_KEYS if key in part}
        dist.gather_object(skeleton, None, dst=global_rank(0), group=group)
        for tensor in tensors:
            send_tensor(tensor, global_rank(0), device, group)
        return None
    skeletons: list = [None] * world
    dist.gather_object(None, skeletons, dst=global_rank(0), group=group)
    merged = to_cpu(part)
    parts = [merged]
    for src in range(1, world):
        slots = sorted(_slots(skeletons[src]), key=lambda slot: slot.index)
        received = [receive_tensor(slot, global_rank(src), device, group) for slot in slots]
        parts.append(fill_tensors(skeletons[src], received))
    for key in _MERGED_KEYS:
        if any(key in p for p in parts):
            entries = chain.from_iterable(p.get(key, {}).items() for p in parts)
            merged[key] = dict(sorted(entries, key=lambda kv: repr(kv[0])))  # names, or (name, start) of pieces
    return merged


# --- files -----------------------------------------------------------------------------------


def is_local_path(path: Any) -> bool:
    """Whether ``path`` (a string as the user gave it: URLs keep their ``//``) is on the local filesystem.

    Decided on the string: ``Path("s3://b/x")`` would read ``s3:/b/x``, a local path."""
    text = str(path)
    try:
        from fsspec.core import url_to_fs
        from fsspec.implementations.local import LocalFileSystem
    except ImportError:  # without fsspec only local paths and file:// URLs are local
        return "://" not in text or text.startswith("file://")
    return isinstance(url_to_fs(text)[0], LocalFileSystem)


class TorchFileIO:
    """One checkpoint file through ``torch.save`` / ``torch.load``, for a loop without Lightning (Lightning's
    ``CheckpointIO`` plugins have the same three methods and are used in its place)."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise TypeError("TorchFileIO.save_checkpoint takes no storage_options; pass a CheckpointIO plugin that "
                            "writes to remote storage.")
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        torch.save(checkpoint, path)

    def load_checkpoint(self, path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        if not Path(path).exists():
            raise FileNotFoundError(f"Checkpoint file not found: {path}")
        return torch.load(path, map_location="cpu", weights_only=True if weights_only is None else weights_only)

    def remove_checkpoint(self, path: Any) -> None:
        _remove(Path(path))


# --- atomic writes -----------------------------------------------------------------------


def partial_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.partial")


def aside_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.old")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def commit(written: Path, path: Path) -> None:
    """Moves the complete checkpoint ``written`` to ``path``, replacing what was there (Note [atomic save])."""
    if written.is_file():
        with open(written, "rb") as f:
            os.fsync(f.fileno())
    old = aside_path(path)
    if path.is_dir() and not path.is_symlink():
        _remove(old)
        os.rename(path, old)
        os.rename(written, path)
        _fsync_dir(path.parent)
        shutil.rmtree(old)
    else:
        os.replace(written, path)  # atomic for a file, and over a file or a symlink
        _fsync_dir(path.parent)


def resolve(path: Path) -> Path:
    """``path``, or the previous checkpoint a save interrupted between its two renames left aside."""
    if not path.exists() and aside_path(path).is_dir():
        return aside_path(path)
    return path


# --- sharded format ----------------------------------------------------------------------


def save_sharded(path: Path, state: dict[str, Any], meta: Optional[dict[str, Any]], group=None) -> None:
    """Writes ``state`` with ``torch.distributed.checkpoint`` and ``meta`` (from rank 0) atomically (collective).

    ``state`` is this rank's part (Note [sharded layout]); ``meta`` is only used on rank 0.
    """
    from torch.distributed.checkpoint import FileSystemWriter, save

    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    tmp = partial_path(path)
    if rank == 0:
        _remove(tmp)  # left over by an interrupted save
        tmp.mkdir(parents=True)
    if distributed:
        dist.barrier(group)
    save(state, storage_writer=FileSystemWriter(tmp, sync_files=True), process_group=group,
         no_dist=not distributed)
    if rank == 0:
        torch.save(meta, tmp / META_FILENAME)
        with open(tmp / META_FILENAME, "rb") as f:
            os.fsync(f.fileno())
        (tmp / README_FILENAME).write_text(readme_text(path.name))
        commit(tmp, path)
    if distributed:
        dist.barrier(group)


def readme_text(name: str) -> str:
    """What a sharded checkpoint directory says of itself (``README.txt``)."""
    return (f"{name} is a sharded lightning-layerwise checkpoint: each rank wrote the parameters\n"
            "it owned and their optimizer state (torch.distributed.checkpoint files), and rank 0\n"
            "wrote meta.pt.\n\n"
            "Resume it with strategy=\"layerwise\" at any number of processes:\n\n"
            f"    trainer.fit(model, ckpt_path=\"{name}\")     # or fabric.load(\"{name}\", state)\n\n"
            "LightningModule.load_from_checkpoint, strategy=\"ddp\" and torch.load read one file.\n"
            "Convert it first (one process, no GPU needed):\n\n"
            f"    {CONSOLIDATE_COMMAND} {name} {Path(name).stem}.full.ckpt\n")


def consolidate(src: Path, dst: Path, weights_only: Optional[bool] = None) -> Path:
    """Converts the sharded checkpoint ``src`` into one file ``dst`` (one process, no process group).

    The file is what ``checkpoint_format="full"`` would have written: a Trainer checkpoint (``state_dict``,
    ``optimizer_states`` and the rest of ``meta.pt``), or for a ``fabric.save`` directory the keys Fabric saved
    under. Tensors are read whole, pieces joined; written aside and renamed into place (Note [atomic save]).
    """
    src, dst = resolve(Path(src)), Path(dst)
    meta, metadata = read_sharded_metadata(src, weights_only)
    state = nest({path: empty_like_item(item) for path, item in checkpoint_items(metadata).items()})
    load_sharded(src, state, weights_only=weights_only)
    record = meta.pop("layerwise", {})
    optimizers = [state.get(optimizer_key(i)) for i in range(len(state)) if optimizer_key(i) in state]
    fabric = record.get("fabric")
    if fabric:
        out = {fabric["module"]: state.get(MODEL_KEY, {}), **dict(zip(fabric.get("optimizers", []), optimizers)),
               **meta}
    else:
        out = {"state_dict": state.get(MODEL_KEY, {}), **({"optimizer_states": optimizers} if optimizers else {}),
               **meta}
    dst.parent.mkdir(parents=True, exist_ok=True)
    partial = partial_path(dst)
    torch.save(out, partial)
    commit(partial, dst)
    return dst


def _consolidate_main(argv: Optional[list[str]] = None) -> None:
    """``python -m lightning_layerwise consolidate SRC DST``."""
    import argparse

    parser = argparse.ArgumentParser(prog=CONSOLIDATE_COMMAND, description=(
        "Convert a sharded lightning-layerwise checkpoint directory into one file that "
        "LightningModule.load_from_checkpoint, strategy='ddp' and torch.load read."))
    parser.add_argument("src", help="the sharded checkpoint directory")
    parser.add_argument("dst", help="the file to write")
    parser.add_argument("--trust-pickles", action="store_true", help=(
        "read Python objects in meta.pt with torch.load(weights_only=False) (e.g. hyperparameters of a class "
        "of your own); only for checkpoints you trust"))
    args = parser.parse_args(argv)
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)  # torch.distributed.checkpoint's ShardedTensor notice
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process is the intent
    if not Path(args.src).is_dir():
        parser.error(f"{args.src!r} is not a directory; a sharded checkpoint is one (a file needs no conversion).")
    dst = consolidate(Path(args.src), Path(args.dst), weights_only=False if args.trust_pickles else None)
    print(f"wrote {dst} ({dst.stat().st_size / 2**20:.1f} MiB)")


def load_meta(file: Path, weights_only: Optional[bool] = None) -> Any:
    """``torch.load`` of a ``meta.pt``, with ``weights_only=True`` unless the caller passes ``False``.

    Everything this package and Lightning write there (loops, callbacks, schedulers,
    the scaler, plain hyperparameters, the ``"layerwise"`` record) loads with
    ``weights_only=True``. Objects of other classes, e.g. a dataclass saved by
    ``save_hyperparameters``, are refused with a :class:`CheckpointError` that names
    the class and both ways to accept it.
    """
    try:
        return torch.load(file, map_location="cpu", weights_only=True if weights_only is None else weights_only)
    except pickle.UnpicklingError as err:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(err))
        what = f"an object of {found.group(1)}" if found else f"an object it refuses ({err})"
        raise CheckpointError(
            f"{str(file)!r} holds {what}, which torch.load(weights_only=True) does not load. If the checkpoint "
            "comes from a source you trust, allow it with torch.serialization.add_safe_globals([...]) or load with "
            "weights_only=False, e.g. trainer.fit(model, ckpt_path=..., weights_only=False)."
        ) from err


# What a torch.distributed.checkpoint index (``.metadata``, a plain pickle) refers to besides the classes
# of torch.distributed.checkpoint's own modules and torch's dtypes, layouts and memory formats.
_INDEX_GLOBALS = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict")}
_PATH_CLASSES = {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"}


class _IndexUnpickler(pickle.Unpickler):
    """Unpickles a torch.distributed.checkpoint index, refusing any other global (as ``weights_only`` would)."""

    def find_class(self, module: str, name: str) -> Any:
        found = None
        if module.split(".")[0] in ("torch", "collections", "pathlib"):  # imports nothing else
            try:
                found = super().find_class(module, name)
            except (ImportError, AttributeError):
                pass
        allowed = found is not None and (
            (module, name) in _INDEX_GLOBALS
            or (module.split(".")[0] == "pathlib" and name in _PATH_CLASSES)  # pathlib._local on Python 3.13
            or (module.startswith("torch.distributed.checkpoint.") and isinstance(found, type))
            or (module == "torch" and isinstance(found, (torch.dtype, torch.layout, torch.memory_format))))
        if not allowed:
            raise pickle.UnpicklingError(f"Unsupported global: GLOBAL {module}.{name}")
        return found


def read_dcp_index(path: Path):
    """The ``.metadata`` index of a sharded checkpoint, unpickled with an allowlist (Note [weights_only])."""
    file = path / DCP_METADATA_FILENAME
    with open(file, "rb") as f:
        try:
            return _IndexUnpickler(f).load()
        except pickle.UnpicklingError as err:
            raise CheckpointError(
                f"{str(file)!r} refers to {str(err).replace('Unsupported global: GLOBAL ', '')}, which a "
                "torch.distributed.checkpoint index does not hold; it was not written by torch.distributed."
                "checkpoint. Load it with weights_only=False only if it comes from a source you trust."
            ) from err


@functools.cache
def _weights_only_load_planner() -> type:
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
        """DCP's default planner, but a saved Python object (e.g. the param groups) must load with weights_only."""

        def load_bytes(self, read_item, value) -> None:
            data = value.read()
            try:  # DefaultLoadPlanner unpickles with weights_only=False; refuse first what True would refuse
                torch.load(io.BytesIO(data), weights_only=True)
            except pickle.UnpicklingError as err:
                found = re.search(r"Unsupported global: GLOBAL (\S+)", str(err))
                raise CheckpointError(
                    f"the checkpoint entry {read_item.dest_index.fqn!r} holds "
                    f"{f'an object of {found.group(1)}' if found else 'an object'}, which "
                    "torch.load(weights_only=True) does not load. If the checkpoint comes from a source you "
                    "trust, allow it with torch.serialization.add_safe_globals([...])."
                ) from err
            super().load_bytes(read_item, io.BytesIO(data))

    return WeightsOnlyLoadPlanner


def read_sharded_metadata(path: Path, weights_only: Optional[bool] = None):
    """``(meta, dcp_metadata)`` of a sharded checkpoint, after checking that every file it needs is complete."""
    from torch.distributed.checkpoint import FileSystemReader

    where = f"sharded checkpoint {str(path)!r}"
    if not (path / META_FILENAME).is_file():
        hint = (" It looks like a save that was interrupted (the partial directory of a save is renamed into "
                "place only when complete); load the previous checkpoint instead."
                if (path / DCP_METADATA_FILENAME).exists() or any(path.glob("*.distcp")) else "")
        raise CheckpointError(f"{where} has no {META_FILENAME}: it is not a complete checkpoint.{hint}")
    if not (path / DCP_METADATA_FILENAME).is_file():
        raise CheckpointError(f"{where} has no {DCP_METADATA_FILENAME} (torch.distributed.checkpoint's index); "
                              "the directory is incomplete or was not written by torch.distributed.checkpoint.")
    meta = load_meta(path / META_FILENAME, weights_only)
    record = meta.get("layerwise") if isinstance(meta, dict) else None
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise CheckpointError(f"{where} was not written by LayerwiseStrategy (its {META_FILENAME} has no "
                              "'layerwise' record). Convert it into one file with `python -m "
                              "lightning.pytorch.utilities.consolidate_checkpoint DIR` and load that file.")
    if record.get("version", 0) > FORMAT_VERSION:
        raise CheckpointError(f"{where} has format version {record['version']}; this lightning_layerwise reads "
                              f"up to version {FORMAT_VERSION}. Upgrade lightning_layerwise.")
    metadata = FileSystemReader(path).read_metadata() if weights_only is False else read_dcp_index(path)
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{where} is missing the data file {name!r} that its index refers to; copy "
                                  "the whole directory.")
        if file.stat().st_size < size:
            raise CheckpointError(f"{where}: data file {name!r} is truncated ({file.stat().st_size} bytes, its "
                                  f"index needs {size}).")
    return meta, metadata


def checkpoint_items(metadata) -> dict[tuple, Any]:
    """The checkpoint's entries by their path in the nested state dict, e.g. ``("model", "fc.weight")``."""
    by_fqn = metadata.state_dict_metadata
    return {tuple(path): by_fqn[fqn] for fqn, path in metadata.planner_data.items() if fqn in by_fqn}


def empty_like_item(item) -> Any:
    """A tensor to load a saved tensor into (on CPU), or ``None`` for a saved Python object."""
    size = getattr(item, "size", None)
    if size is None:
        return None
    return torch.empty(size, dtype=item.properties.dtype)


def nest(entries: Mapping[tuple, Any]) -> dict[str, Any]:
    """A nested dict/list state dict from ``{path: leaf}`` (integer path parts become list indices)."""
    root: dict = {}
    for path, leaf in entries.items():
        node: Any = root
        for part, following in zip(path[:-1], path[1:]):
            empty = [] if isinstance(following, int) else {}
            if isinstance(node, list):
                while len(node) <= part:
                    node.append(None)
                if node[part] is None:
                    node[part] = empty
                node = node[part]
            else:
                node = node.setdefault(part, empty)
        if isinstance(node, list):
            while len(node) <= path[-1]:
                node.append(None)
        node[path[-1]] = leaf
    return root


def read_sharded_checkpoint(path: Path, tensors: Mapping[str, torch.Tensor], ownership: Ownership,
                            n_optimizers: int, strict: bool, model_name: str,
                            weights_only: Optional[bool] = None,
                            other_experts: Callable[[str], bool] = lambda key: False,
                            strict_hint: str = "Set `strict_loading = False` on the LightningModule to load the keys "
                                               "that match."
                            ) -> tuple[dict[str, Any], Optional[list]]:
    """Reads this rank's part of a sharded checkpoint into ``tensors`` (in place) and returns what else it holds.

    ``tensors`` is ``module.state_dict(keep_vars=True)``; each rank reads the model
    entries it owns or shares (the caller all-gathers the rest). With
    ``n_optimizers > 0`` (fitting) it also reads the owned optimizer state and the
    param groups of that many optimizers. Returns Lightning's meta dict and the
    optimizer states in named form (``None`` without optimizers). Collective.
    """
    meta, metadata = read_sharded_metadata(path, weights_only)
    items = checkpoint_items(metadata)
    saved_keys = {p[1] for p in items if p[0] == MODEL_KEY and len(p) == 2}
    if strict:  # the experts other ranks hold are neither missing nor unexpected (Note [expert checkpoints])
        missing = sorted(set(tensors) - saved_keys)
        unexpected = sorted(k for k in saved_keys - set(tensors) if not other_experts(k))
        if missing or unexpected:
            raise CheckpointError(
                f"sharded checkpoint {str(path)!r} does not match {model_name}: missing keys {missing[:10]}, "
                f"unexpected keys {unexpected[:10]}. {strict_hint}")
    entries: dict[tuple, Any] = {(MODEL_KEY, key): tensor.detach() for key, tensor in tensors.items()
                                 if key in saved_keys and ownership.reads(tensor)}
    pieces: dict[tuple, torch.Tensor] = {}  # optimizer entries read as this rank's piece only
    if n_optimizers:
        saved_optimizers = len({p[0] for p in items if p[0].startswith("optimizer_")})
        if saved_optimizers != n_optimizers:
            raise CheckpointError(
                f"sharded checkpoint {str(path)!r} holds {saved_optimizers} optimizer state(s) and the model "
                f"configures {n_optimizers}; it was saved without optimizer state "
                "(ModelCheckpoint(save_weights_only=True)?) or for another set of optimizers.")
        for item_path, item in items.items():
            if not item_path[0].startswith("optimizer_"):
                continue
            part = item_path[1] if len(item_path) > 1 else None
            if part == "param_groups" or (part in ("state", "master_weights")
                                          and item_path[2] in ownership.owned_names):
                entries[item_path] = empty_like_item(item)
                piece = ownership.piece(item_path[2]) if part != "param_groups" else None
                slot = ownership.split.get(item_path[2]) if piece is not None else None
                if slot is not None and tuple(getattr(item, "size", ())) == tuple(slot.shape):
                    # Only this rank's piece is read (Note [pieces in checkpoints]).
                    flat = torch.empty(piece.numel, dtype=item.properties.dtype)
                    pieces[item_path] = flat
                    entries[item_path] = piece_sharded_tensor(flat, slot, *ownership.placement(item_path[2]))
    state = nest(entries)
    with torch.no_grad():
        load_sharded(path, state, weights_only=weights_only)
    for item_path, flat in pieces.items():
        node = state
        for part in item_path[:-1]:
            node = node[part]
        node[item_path[-1]] = flat
    optimizer_states = [state[optimizer_key(i)] for i in range(n_optimizers)] if n_optimizers else None
    return meta, optimizer_states


def load_sharded(path: Path, state: dict[str, Any], group=None, weights_only: Optional[bool] = None) -> None:
    """Loads the entries of ``state`` (nested; tensors are filled in place) from ``path`` (collective).

    Unless ``weights_only=False``, the index and every saved Python object are read as
    ``torch.load(weights_only=True)`` would (Note [weights_only]).
    """
    from torch.distributed.checkpoint import FileSystemReader, load
    from torch.distributed.checkpoint.api import CheckpointException

    planner = None
    if weights_only is not False:
        read_dcp_index(path)  # refuses a foreign global before torch.distributed.checkpoint unpickles the index
        planner = _weights_only_load_planner()()
    distributed = dist.is_available() and dist.is_initialized()
    try:
        load(state, storage_reader=FileSystemReader(path), planner=planner, process_group=group,
             no_dist=not distributed)
    except CheckpointException as err:  # DCP wraps every rank's failure; surface a refused object as ours
        refused = [exc for exc, _ in err.failures.values() if isinstance(exc, CheckpointError)]
        if refused:
            raise CheckpointError(str(refused[0])) from err
        raise
