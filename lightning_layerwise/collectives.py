"""Bucket collectives as free functions with explicit group, input and output.

Every function returns a :class:`Collective` (the output tensor and the work
handle, ``None`` when nothing was sent), so callers decide when to wait. The
only torch.distributed calls of the package that move tensors live here, with
the shims for names that differ between torch releases.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

# torch 2.13 renames the single-tensor collectives and deprecates the old names;
# 2.11 has only the old ones. Same signatures.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class Collective:
    """An output tensor and the handle of the collective that fills it."""

    output: torch.Tensor
    work: dist.Work | None

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self.output

    @property
    def pending(self) -> bool:
        return self.work is not None


def reduce_scatter_bucket(bucket: torch.Tensor, group: ProcessGroup | None, async_op: bool = True) -> Collective:
    """Sums ``bucket`` over ``group`` into this rank's shard of it, in place.

    ``bucket`` is split into ``group`` size equal shards; after the wait, shard
    ``rank`` of ``bucket`` holds the sum over ranks and the other shards hold
    partial sums that must not be read. Returns the shard.
    """
    if group is None:
        return Collective(bucket, None)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    shard = bucket.chunk(world)[rank]
    work = _reduce_scatter_single(shard, bucket, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
    return Collective(shard, work if async_op else None)


def all_gather_bucket(bucket: torch.Tensor, group: ProcessGroup | None, async_op: bool = True) -> Collective:
    """Fills every shard of ``bucket`` from the rank that owns it, in place (no staging copy)."""
    if group is None:
        return Collective(bucket, None)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    shard = bucket.chunk(world)[rank]
    work = _all_gather_single(bucket, shard, group=group, async_op=async_op)
    return Collective(bucket, work if async_op else None)


def all_reduce_sum(tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Sums ``tensor`` in place over ``group`` (synchronously)."""
    if group is not None:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def all_reduce_max(tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Maximum of ``tensor`` in place over ``group`` (synchronously)."""
    if group is not None:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor


def broadcast_tensors(tensors: list[torch.Tensor], group: ProcessGroup | None, src_rank: int = 0) -> None:
    """Copies ``tensors`` from group rank ``src_rank`` to every rank, in place."""
    if group is None:
        return
    src = dist.get_global_rank(group, src_rank)
    for t in tensors:
        dist.broadcast(t, src=src, group=group)
