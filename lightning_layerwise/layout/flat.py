"""Flat buckets: element-wise parameters laid back to back and split into equal shards (:func:`plan_flat`).

Note [flat layers]
    Flat buckets follow the model's layers: a parameter's *layer* (:func:`layer_of`) is its name up
    to the first numbered part (``transformer.h.3`` for ``transformer.h.3.mlp.c_fc.weight``: one block
    of a ``ModuleList`` or ``Sequential``), and a flat bucket that holds at least half of
    ``bucket_size`` closes before a parameter of another layer, unless rounding it up to equal
    shards would pad more than 1/32 of it (tiny layers at many ranks). With sharded parameters a bucket is what a forward
    gathers, so a bucket that ended mid-layer would keep two layers full while either runs; with
    ``bucket_size="auto"`` (``SHARDED_BUCKET_SIZE``) and layers smaller than it, each bucket is then
    one layer, as FSDP2's per-block groups are. The planner does this only when asked
    (``plan_layout(follow_layers=True)``, which the wrapper and the session ask for with sharded
    parameters): without sharding a bucket is never gathered for a forward, and layouts stay as
    they were.
"""

from __future__ import annotations

import math
from typing import Mapping

from .plan import ALIGNMENT, BucketPlan, ParamSpec, Piece, aligned

CHUNK_ALIGNMENT = 16
"""Elements a flat shard's equal chunks are aligned to across owner groups (64 bytes of fp32, 32 of bf16): smaller
than :data:`ALIGNMENT`, so that the rounding, sent across the groups as padding, stays small at many replicas."""


def plan_flat(queue: list[ParamSpec], group_size: int, bucket_size: int, start: int, first_index: int,
              located: dict[str, tuple[int, int]], pieces: dict[str, tuple[Piece, ...]], rank_cost: list[float],
              costs: Mapping[str, float], replicas: int = 1, follow_layers: bool = False) -> list[BucketPlan]:
    """Element-wise parameters packed back to back, in backward order, into buckets split into
    ``group_size`` equal shards; a parameter crossing a shard boundary is stepped in pieces. With ``replicas`` owner
    groups sharing the stepping, a shard is rounded up to a multiple of ``replicas * 16`` elements too, so that it
    cuts into ``replicas`` equal chunks aligned to :data:`CHUNK_ALIGNMENT` (Note [replica sharing] in
    ``layout/sharing.py``).
    See Note [element-wise fill]."""
    buckets: list[BucketPlan] = []
    members: list[ParamSpec] = []
    bucket_start = cursor = start

    rounding = group_size * math.lcm(ALIGNMENT, replicas * CHUNK_ALIGNMENT)

    def layer_ends(spec: ParamSpec) -> bool:
        """Whether to close before ``spec`` (Note [flat layers]): a layer ended, the bucket is half full and
        rounding it up pads at most 1/32 of it."""
        held = cursor - bucket_start
        return (held >= bucket_size // 2 and 32 * (aligned(held, rounding) - held) <= held
                and layer_of(spec.name) != layer_of(members[-1].name))

    def close() -> None:
        nonlocal bucket_start
        length = aligned(cursor - bucket_start, rounding)
        shard = length // group_size
        for spec in members:
            offset = located[spec.name][1]
            owned = []
            for rank in range(group_size):
                lo = bucket_start + rank * shard
                a, b = max(offset, lo), min(offset + spec.numel, lo + shard)
                if a < b:
                    owned.append(Piece(rank, a - offset, b - offset))
                    rank_cost[rank] += costs[spec.name] * (b - a) / spec.numel
            pieces[spec.name] = tuple(owned)
        buckets.append(BucketPlan(first_index + len(buckets), bucket_start, bucket_start + length, group_size,
                                  tuple(s.name for s in members)))
        bucket_start += length
        members.clear()

    for spec in queue:
        if follow_layers and members and layer_ends(spec):
            close()
            cursor = bucket_start
        located[spec.name] = (first_index + len(buckets), cursor)
        members.append(spec)
        cursor += aligned(spec.numel)
        if cursor - bucket_start >= bucket_size:
            close()
            cursor = bucket_start
    if members:
        close()
    return buckets


def layer_of(name: str) -> str:
    """The repeated layer a parameter belongs to: its name up to the first numbered part (``h.3`` of
    ``transformer.h.3.attn.c_attn.weight``); the whole name for a parameter outside any numbered container."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:i + 1])
    return name
