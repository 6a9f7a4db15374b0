"""The plan's types: what the planner decides and the wrapper reads.

A :class:`Layout` holds, per buffer, its buckets and, per parameter, its
:class:`ParamSlot` (buffer, offset, owner, and for split parameters its pieces).
The planner sees parameters only as :class:`ParamSpec` records.

Note [shard alignment]
    A bucket of length ``L`` is split into ``n`` shards of ``L / n`` elements, ``n`` the
    ranks it is planned for (:attr:`BucketPlan.shards`); rank ``r`` reduces into and
    gathers from shard ``r``. Layer-wise optimizers such as Muon need a *whole* matrix
    on one rank, so a parameter that is not element-wise never crosses a shard boundary:
    it lies inside exactly one shard, and that shard's rank is its *owner*. An element-wise
    one may be split across shards into pieces, each stepped by its shard's rank (Note
    [element-wise fill] in ``layout/packing.py``). Every parameter starts on a 64-element boundary
    (:data:`ALIGNMENT`) so views into the buffer stay aligned for vectorized
    kernels and NCCL.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Callable, Literal, Mapping, NamedTuple, Optional, Sequence

import torch

ALIGNMENT = 64


"""Every parameter starts on a multiple of this many elements inside its buffer."""


DEFAULT_BUCKET_SIZE = 40_000_000


"""Default bucket length in elements (about 160 MB of fp32 gradients)."""


SHARDED_BUCKET_SIZE = 1 << 22


"""Bucket length in elements with ``shard_parameters=True`` and ``bucket_size="auto"`` (16 MiB of fp32).

With sharded parameters a bucket is also the unit gathered for a forward and a backward, so it
sets the working set (Note [when a bucket is full] in ``engine/sharded.py``): a bucket closes as
soon as it holds this many elements, which makes most buckets one round of the planner (``group_size``
matrices of one size from neighbouring layers) or one layer's element-wise parameters.
"""


Kind = Literal["dense", "expert"]


def aligned(numel: int, alignment: int = ALIGNMENT) -> int:
    """Rounds ``numel`` up to a multiple of ``alignment``."""
    return -(-numel // alignment) * alignment


@dataclass(frozen=True)
class ParamSpec:
    """What the planner needs to know about one trainable parameter."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32
    kind: Kind = "dense"
    elementwise: bool = False
    """Its optimizer update is element-wise (AdamW, SGD…), so it may be split across shards
    (Note [element-wise fill] in ``layout/packing.py``); otherwise it is owned whole."""
    matrices: tuple[tuple[int, int], ...] | None = None
    """The shapes of the matrices Newton–Schulz sees in it (a stack, blocks: Note [matrix views] in
    ``optim/matrices.py``); ``None``: one ``(shape[0], rest)`` matrix."""

    @functools.cached_property
    def numel(self) -> int:  # computed once: the planner asks often (frozen: the cache bypasses __setattr__)
        return math.prod(self.shape)


def newton_schulz_cost(spec: ParamSpec) -> float:
    """Approximate optimizer work for one parameter.

    A matrix (or a higher-dim kernel viewed as ``out x rest``) is orthogonalized
    by Newton–Schulz, whose matmuls cost about ``min(m, n)^2 * max(m, n)``; a stack
    or blocks (``spec.matrices``) cost the sum over their matrices; any other
    parameter is updated element-wise.
    """
    if spec.matrices is not None:
        return float(sum(min(m, n) ** 2 * max(m, n) for m, n in spec.matrices))
    if len(spec.shape) >= 2:
        m = spec.shape[0]
        n = spec.numel // max(m, 1)
        return float(min(m, n) ** 2 * max(m, n))
    return float(spec.numel)


def numel_cost(spec: ParamSpec) -> float:
    """Element-wise optimizer work (AdamW, SGD): the element count."""
    return float(spec.numel)


class Piece(NamedTuple):
    """The elements ``[start, stop)`` of a parameter (flattened) that rank ``owner`` steps."""

    owner: int
    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start

    def cut(self, value, shape: Sequence[int]):
        """``value`` cut to this piece (a flat view) if it is a per-element tensor of the whole
        parameter (``shape``); anything else (a scalar such as AdamW's ``step``, a value already
        the piece's) as is."""
        if torch.is_tensor(value) and value.dim() >= 1 and tuple(value.shape) == tuple(shape) \
                and value.numel() != self.numel:
            return value.reshape(-1)[self.start:self.stop]
        return value


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lives: its buffer, bucket, offset and owner(s)."""

    name: str
    shape: tuple[int, ...]
    buffer: int
    bucket: int
    offset: int
    """First element of the parameter inside its buffer."""
    pieces: tuple[Piece, ...]
    """Who steps which elements, in element order: one piece (the whole parameter) unless the
    parameter is element-wise and crosses a shard boundary (Note [element-wise fill] in ``layout/packing.py``)."""

    @property
    def owner(self) -> int:
        """Rank that steps the parameter's first element (for a whole parameter: all of it)."""
        return self.pieces[0].owner

    @property
    def split(self) -> bool:
        """Whether several ranks step parts of this parameter."""
        return len(self.pieces) > 1

    def piece_of(self, rank: int) -> Optional[Piece]:
        """The piece rank ``rank`` steps, if any (a rank has at most one piece of a parameter)."""
        return next((p for p in self.pieces if p.owner == rank), None)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def end(self) -> int:
        return self.offset + self.numel


@dataclass(frozen=True)
class BucketPlan:
    """A contiguous range of a buffer communicated as one collective."""

    index: int
    """Index inside its buffer, in backward order."""
    start: int
    end: int
    shards: int
    """Ranks its shards are spread over (the buffer's :attr:`BufferPlan.shards`)."""
    params: tuple[str, ...]
    """Names of the parameters in this bucket, by offset."""
    chunks: tuple[tuple[tuple[int, int], ...], ...] = ()
    """With replica sharing (Note [replica sharing] in ``layout/sharing.py``): per shard position, ``(replica, offset)``
    for each replica whose chunk is not empty, by offset from the shard's start (the first at 0); a chunk ends
    where the next begins, the last at the shard's end. A shard of padding only has none. Empty without replica
    sharing."""
    replicas: int = 1

    @property
    def numel(self) -> int:
        return self.end - self.start

    @property
    def shard_size(self) -> int:
        return self.numel // self.shards

    def shard_range(self, rank: int) -> tuple[int, int]:
        """Buffer range ``[start, end)`` of rank ``rank``'s shard."""
        begin = self.start + rank * self.shard_size
        return begin, begin + self.shard_size

    def chunk_ranges(self, rank: int) -> list[tuple[int, int]]:
        """Buffer ranges of the chunks of position ``rank``'s shard, one per replica (Note [replica sharing] in
        ``layout/sharing.py``);
        the whole shard as one chunk without replica sharing."""
        begin, end = self.shard_range(rank)
        if not self.chunks:
            return [(begin, end)]
        starts = self.chunks[rank]
        ranges: list = [None] * self.replicas
        for i, (k, offset) in enumerate(starts):
            ranges[k] = (begin + offset, begin + starts[i + 1][1] if i + 1 < len(starts) else end)
        following = end
        for k in range(self.replicas - 1, -1, -1):  # an empty chunk sits where the next one begins
            if ranges[k] is None:
                ranges[k] = (following, following)
            following = ranges[k][0]
        return ranges


@dataclass(frozen=True)
class BufferPlan:
    """One contiguous tensor of parameters of one dtype and one kind."""

    index: int
    dtype: torch.dtype
    kind: Kind
    numel: int
    buckets: tuple[BucketPlan, ...]
    shards: int = 0
    """Ranks its buckets' shards are spread over: the layout's :attr:`Layout.group_size` for dense buffers,
    the expert owner group's size for expert buffers."""


@dataclass(frozen=True)
class Layout:
    """The immutable plan for a set of parameters, made for an owner group of ``group_size`` ranks (the whole
    data-parallel group without owner groups; Note [owner groups] in ``engine/process_groups.py``)."""

    group_size: int
    """Ranks the plan is made for: every bucket's dense shards are spread over them."""
    bucket_size: int
    buffers: tuple[BufferPlan, ...]
    params: Mapping[str, ParamSlot]
    costs: Mapping[str, float] = field(repr=False)
    replicas: int = 1
    """Owner groups that share the stepping of the dense buffers (Note [replica sharing] in ``layout/sharing.py``): a
    dense
    piece's owner is then ``replica * group_size + position``, a rank of the whole data-parallel group."""
    expert_replicas: int = 1
    """The same for the expert buffers, inside the expert data-parallel group: an expert piece's owner is
    ``replica * g_e + position`` for expert buffers planned for ``g_e`` ranks."""

    @property
    def ranks(self) -> int:
        """How many ranks step something: ``group_size * replicas``."""
        return self.group_size * self.replicas

    @property
    def expert_group_size(self) -> int | None:
        """The ranks the expert buffers are planned for (their owner group), ``None`` without expert buffers."""
        return next((b.shards for b in self.buffers if b.kind == "expert"), None)

    # --- queries -------------------------------------------------------------------
    def slot(self, name: str) -> ParamSlot:
        return self.params[name]

    def owned_by(self, rank: int) -> tuple[str, ...]:
        """Names of the parameters rank ``rank`` steps, whole or in part, in layout order."""
        return tuple(n for n, s in self.params.items() if any(p.owner == rank for p in s.pieces))

    @property
    def total_numel(self) -> int:
        """Elements in all buffers, padding included."""
        return sum(b.numel for b in self.buffers)

    @property
    def param_numel(self) -> int:
        return sum(s.numel for s in self.params.values())

    @property
    def padding_fraction(self) -> float:
        """Share of buffer elements that hold no parameter (alignment included)."""
        total = self.total_numel
        return 0.0 if total == 0 else 1.0 - self.param_numel / total

    def rank_costs(self) -> list[float]:
        """Optimizer cost each rank carries, by the cost function the plan used."""
        costs = [0.0] * self.ranks  # expert buffers planned for fewer ranks count at their positions
        for name, slot in self.params.items():
            for piece in slot.pieces:  # a split (element-wise) parameter's cost is per element
                costs[piece.owner] += self.costs[name] * piece.numel / slot.numel
        return costs

    def rank_numels(self) -> list[int]:
        """Parameter elements each rank owns (its share of optimizer state)."""
        numels = [0] * self.ranks
        for slot in self.params.values():
            for piece in slot.pieces:
                numels[piece.owner] += piece.numel
        return numels

    @property
    def imbalance(self) -> float:
        """Max rank cost over mean rank cost (1.0 is perfect balance)."""
        costs = self.rank_costs()
        mean = sum(costs) / len(costs)
        return 1.0 if mean == 0 else max(costs) / mean

    def summary(self) -> str:
        """A human-readable report: buffers, buckets, padding and per-rank cost."""
        lines = [
            f"layout: group_size={self.group_size} bucket_size={self.bucket_size:,} params={len(self.params)} "
            f"elements={self.param_numel:,} buffer elements={self.total_numel:,} "
            f"padding={100 * self.padding_fraction:.2f}%"
        ]
        for buf in self.buffers:
            lines.append(f"  buffer {buf.index}: {buf.kind} {str(buf.dtype).removeprefix('torch.')} "
                         f"{buf.numel:,} elements, {len(buf.buckets)} buckets")
            for b in buf.buckets:
                used = sum(self.params[n].numel for n in b.params)
                lines.append(f"    bucket {b.index}: [{b.start:,}, {b.end:,}) shard={b.shard_size:,} "
                             f"params={len(b.params)} padding={100 * (1 - used / max(b.numel, 1)):.2f}%")
        costs, numels = self.rank_costs(), self.rank_numels()
        total = sum(costs) or 1.0
        lines.append(f"  owner balance (max/mean cost): {self.imbalance:.3f}")
        for r in range(self.ranks):
            lines.append(f"    rank {r}: params={len(self.owned_by(r))} elements={numels[r]:,} "
                         f"cost share={100 * costs[r] / total:.2f}%")
        return "\n".join(lines)


def is_bucket_size(value) -> bool:
    """The one rule for a bucket size, wherever it is given: an ``int`` (not a ``bool``) >= 1."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def resolve_prefetch_depth(prefetch_depth: int | Literal["auto"], shard_parameters: bool) -> int:
    """The all-gathers in flight at once: ``prefetch_depth``, or for ``"auto"`` 1 with sharded parameters (each
    prefetched bucket is held full, and one hides a gather behind a bucket's compute, as FSDP2's default does)
    and 2 without (nothing is held beyond the parameters)."""
    if prefetch_depth == "auto":
        return 1 if shard_parameters else 2
    return prefetch_depth


def resolve_bucket_size(bucket_size: int | Literal["auto"], shard_parameters: bool) -> int:
    """The bucket length a plan uses: ``bucket_size``, or for ``"auto"`` :data:`SHARDED_BUCKET_SIZE` with sharded
    parameters and :data:`DEFAULT_BUCKET_SIZE` without."""
    if bucket_size == "auto":
        return SHARDED_BUCKET_SIZE if shard_parameters else DEFAULT_BUCKET_SIZE
    return bucket_size


def param_specs(module: torch.nn.Module, expert: Callable[[str, torch.nn.Parameter], bool] | None = None,
                elementwise: Callable[[str, torch.nn.Parameter], bool] | None = None,
                matrices: Callable[[str, torch.nn.Parameter], tuple[tuple[int, int], ...] | None] | None = None,
                ) -> list[ParamSpec]:
    """Specs of ``module``'s trainable parameters in registration order (tied ones once).

    ``expert`` and ``elementwise`` are predicates on ``(name, parameter)`` that mark
    expert parameters and those whose optimizer update is element-wise; ``matrices``
    gives the matrix shapes Newton–Schulz sees in a parameter (:attr:`ParamSpec.matrices`).
    """
    specs = []
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        kind: Kind = "expert" if expert is not None and expert(name, p) else "dense"
        specs.append(ParamSpec(name, tuple(p.shape), p.dtype, kind,
                               elementwise=bool(elementwise is not None and elementwise(name, p)),
                               matrices=matrices(name, p) if matrices is not None else None))
    return specs
