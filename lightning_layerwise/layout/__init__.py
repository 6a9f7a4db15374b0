"""The layout planner: which parameter goes where, decided once, without a process group.

A *layout* assigns every trainable parameter a buffer, a bucket, an offset and an
owner rank. Everything the data-parallel wrapper does at run time (views into
the param buffer, reduce-scatter into shards, all-gather from shards, which rank
steps which parameter) follows from it. The planner is pure: it sees only
:class:`ParamSpec` records (name, shape, dtype, dense or expert), so it is tested
exhaustively without torch.distributed.

The package, by layer: the plan's types (``plan``), packing parameters into buckets
(``packing``; element-wise ones back to back: ``flat``), owner groups sharing each shard's
stepping (``sharing``), choosing the owner group size (``group_size``) and a model's layout as
text (``describe``).
"""

from .describe import describe_layout
from .group_size import (DEFAULT_RANKS_PER_NODE, DEFAULT_STATE_BYTES, PADDING_TOLERANCE, choose_expert_group_size,
                         choose_owner_group_size, estimated_rank_bytes)
from .packing import plan_layout
from .plan import (ALIGNMENT, DEFAULT_BUCKET_SIZE, SHARDED_BUCKET_SIZE, BucketPlan, BufferPlan, Kind, Layout, ParamSlot,
                   ParamSpec, Piece, aligned, is_bucket_size, newton_schulz_cost, numel_cost, param_specs,
                   resolve_bucket_size, resolve_prefetch_depth)
from .sharing import ELEMENTWISE_STATE, share_among_replicas

__all__ = [
    "ALIGNMENT", "DEFAULT_BUCKET_SIZE", "DEFAULT_RANKS_PER_NODE", "DEFAULT_STATE_BYTES", "ELEMENTWISE_STATE",
    "PADDING_TOLERANCE", "SHARDED_BUCKET_SIZE", "BucketPlan", "BufferPlan", "Kind", "Layout", "ParamSlot",
    "ParamSpec", "Piece", "aligned",
    "choose_expert_group_size", "choose_owner_group_size", "describe_layout", "estimated_rank_bytes",
    "is_bucket_size", "newton_schulz_cost", "numel_cost", "param_specs", "plan_layout", "resolve_bucket_size",
    "resolve_prefetch_depth",
    "share_among_replicas",
]
