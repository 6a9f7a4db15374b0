"""What each rank writes and reads: :class:`Ownership`, and split parameters' pieces as sharded tensors.

Note [checkpoint ownership]
    Which entries a rank writes and reads follows from the layout alone, described
    by an :class:`Ownership`: a parameter in the layout is written and read by its
    owner only (its optimizer state and float32 master with it); everything else
    (buffers, frozen parameters, the param groups) is written by rank 0 and read by
    every rank. Without a wrapper (evaluation before any fit) a rank owns everything.
    The strategy builds one from the wrapper and hands it to
    :func:`model_entries_to_write`, :func:`read_sharded_checkpoint` and
    :func:`local_optimizer_state`; nothing here knows of Lightning's loops.


Note [expert checkpoints]
    With expert parallelism (Note [expert parallelism] in ``engine/process_groups.py``) the
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

Note [pieces in checkpoints]
    A split parameter's optimizer state (and float32 master) exists in pieces, one per
    rank that steps part of it (Note [pieces] in ``engine/data_parallel.py``): flat tensors of the
    piece's length. A checkpoint never holds pieces: both formats store every per-element
    state tensor at the parameter's full shape, as one process would, so a checkpoint is
    the same whatever split it was saved from and loads at any other (and into ``ddp``).
    The sharded format writes the pieces of one tensor as the shards of a
    ``ShardedTensor`` of the full shape (a flat range of a row-major tensor is a few
    rectangular boxes, :func:`boxes`); torch.distributed.checkpoint stores them as chunks
    of one tensor and reads any other set of boxes from them. The full format gathers the
    pieces to rank 0 and joins them. On load, each rank keeps the elements of its piece.
    A state value is per-element when it is a tensor with at least one dimension and as
    many elements as the piece (AdamW's ``exp_avg``); anything else (``step``) is the same
    on every piece's owner and is written once.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

MODEL_KEY = "model"


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
    """Which pieces this rank steps (:attr:`~lightning_layerwise.engine.process_groups.Ranks.layout_rank`)."""
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
    tensor_parallel: Any = None
    """Under tensor parallelism, how this rank's tensors are shards of the saved ones: a
    :class:`~lightning_layerwise.checkpoint.tensor_parallel.TensorParallelCheckpoint`; ``None`` without it."""

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

        experts = wrapper.ranks.expert_parallel_size > 1
        expert_local = wrapper.expert_names if experts else frozenset()
        expert_names = frozenset(rename(n) for n in expert_local)
        local = dict(wrapper.param_sync.names)
        stepped = [p for _, p in wrapper.named_owned_parameters()]  # whole parameters and pieces
        masters = list(masters)
        split = {rename(n): slots[n] for n in local.values() if slots[n].split}
        partly = [p for p, n in local.items() if slots[n].split and wrapper.records.piece_of(p) is not None]
        first = [p for p in partly if wrapper.records[p].unit.piece is slots[local[p]].pieces[0]]
        # Each element is stepped, and written, by one rank of the world, owner groups or not (Note [replica
        # sharing] in layout.py).
        written = stepped + first + masters
        return cls(frozenset(list(local) + stepped), frozenset(stepped + partly + masters), frozenset(written),
                   frozenset(rename(n) for n, _ in wrapper.named_owned_parameters()), is_global_zero, split,
                   wrapper.ranks.layout_rank, global_ranks(wrapper.grad_sync.layout_group), expert_names,
                   wrapper.ranks.expert_dp_rank, global_ranks(groups.expert_dp) if experts else (0,),
                   frozenset(expert_outside), experts and wrapper.ranks.expert_dp_rank == 0)

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
    for key in MERGED_KEYS:
        if key in named:
            out[key] = {((n, ownership.piece(n).start) if ownership.piece(n) is not None else n): v
                        for n, v in named[key].items()}
    return out


def join_pieces(merged: dict[str, Any], split: Mapping[str, Any]) -> dict[str, Any]:
    """Joins the pieces :func:`mark_pieces` keyed into full-shape tensors, keyed by name again."""
    out = dict(merged)
    for key in MERGED_KEYS:
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


MERGED_KEYS = ("state", "master_weights")
