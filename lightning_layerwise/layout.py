"""The layout planner: which parameter goes where, decided once, without a process group.

A *layout* assigns every trainable parameter a buffer, a bucket, an offset and an
owner rank. Everything the data-parallel wrapper does at run time (views into
the param buffer, reduce-scatter into shards, all-gather from shards, which rank
steps which parameter) follows from it. The planner is pure: it sees only
:class:`ParamSpec` records (name, shape, dtype, dense or expert), so it is tested
exhaustively without torch.distributed.

Note [shard alignment]
    A bucket of length ``L`` is split into ``dp`` shards of ``L / dp`` elements;
    rank ``r`` reduces into and gathers from shard ``r``. Layer-wise optimizers
    such as Muon need a *whole* matrix on one rank, so no parameter may cross a
    shard boundary: each parameter lies inside exactly one shard, and that
    shard's rank is its *owner*. Every parameter starts on a 64-element boundary
    (:data:`ALIGNMENT`) so views into the buffer stay aligned for vectorized
    kernels and NCCL.

Note [size matching]
    Shards of one bucket must have equal length, so the planner fills all ``dp``
    shards in lock-step *rounds*. A round starts with the next parameter in
    backward order (the *seed*); its length is the seed's aligned size. The
    other ``dp - 1`` shards of the round take parameters of the same size
    (*peers*), nearest in backward order first; a stack of identical
    transformer blocks therefore packs with zero padding when ``dp`` divides
    the number of blocks. A shard that finds no peer is filled greedily with
    smaller parameters that fit (next in backward order first), and only what
    is left is padding. Note [leftovers] decides which parameters may be peers
    and which are kept for filling.

Note [leftovers]
    Backward-order filling alone strands parameters: when a large seed's round
    (an untied output head, first in backward order) fills its free shards
    with whole layers, every size class is left with a count that ``dp`` does
    not divide, and each class ends in a short round of single matrices, most
    of whose shards are padding (Llama-3 70B at dp 64: 14% padding). So the
    planner also tries a second packing that plans by *size class* first
    (:func:`_reserve_leftovers`): largest class first, a class of ``c``
    parameters needs ``c // dp`` full rounds, and its ``c % dp`` leftovers are
    *reserved* as fill if they fit into the free shards of larger classes'
    short rounds (simulated first-fit decreasing); otherwise they form a short
    round whose free shards smaller classes may use. Then whole groups of
    ``dp`` parameters of a class move from full rounds into free shards while
    everything still fits (largest class first; giving one group back to make
    room for smaller classes is kept when the rounds get shorter). Moving fewer
    than ``dp`` would only turn a full round into a short one of the same length.

    The packing pass then runs as before, except that a seed's peers are never
    reserved parameters, and shards without a peer are filled with reserved
    parameters only (those after the seed in backward order), largest size
    class first, each class into the first shards with room. The reserved ones
    of a class are its *last* in backward order, so the full rounds keep the
    nearest peers and bucket starts still move monotonically through backward
    order. A reserved parameter that no round had room for seeds a round when
    backward order reaches it, as any other parameter. Both packings (each
    with its solo seeds, Note [tail gaps]) are computed and the reserved one is
    kept only if its total padding is lower, so no layout pads more than the
    plain pass. The reserved fill takes parameters from anywhere after the seed,
    not the next ones: a head round that holds leftovers of the first layers
    completes only when they do, which it does anyway (the embedding in the
    same round is the last gradient of backward).

    Limit: free shards come only from rounds formed *before* the parameters in
    backward order. A large parameter that is last in backward order (GPT-2's
    tied embedding) gets its round last, and reserved parameters cannot reach
    it; only the solo seed's tail fill can.

Note [tail gaps]
    Greedy filling only draws on parameters *after* the seed in backward
    order, so a large parameter without peers near the end of backward (the
    token embedding, typically) would leave ``dp - 1`` empty shards. Such a
    seed becomes *solo*: its round is formed first, filled from the *tail* of
    the queue (the parameters nearest to it in backward order), and placed
    last, so the tail's gradients and the seed's complete together. The planner
    keeps a solo seed only if total padding drops.

Note [owner balancing]
    Inside a round all shards have the same length, so which rank gets which
    shard's contents is free. The planner gives the most expensive contents to
    the rank with the least accumulated optimizer cost (longest-processing-time
    greedy). The default cost is Newton–Schulz's, about ``min(m, n)^2 * max(m, n)``
    for an ``m x n`` matrix, and the element count for everything else.
    Accumulated costs carry over from one buffer to the next, so a rank that
    got much of the dense buffer's work gets less of the expert buffer's.

    Greedy filling decides *which* parameters a round takes (and so the
    padding), but packs them first-fit, shard after shard. When a huge
    parameter (an embedding) seeds a round at large ``dp``, the round's other
    shards have room for most of the model, and first-fit would pile it onto
    a few ranks. So a round whose shards hold several parameters is re-packed
    for balance: its parameters, costliest first, each go to the least loaded
    rank whose shard still has room (a parameter the size of the whole shard
    needs an empty shard, and enough empty shards are kept for those). Same
    parameters, same round length, so padding is unchanged. If that packing
    does not fit (first-fit can succeed where it fails), the round keeps its
    first-fit shards.

Note [element-wise fill]
    Whole ownership pads: a parameter owned whole needs a round of ``dp`` shards
    of its size, so a model whose largest tensor is a large share of the whole (an
    embedding) pads most of every buffer at large ``dp`` (Note [shard alignment]).
    Parameters whose optimizer update is element-wise (``ParamSpec.elementwise``:
    the AdamW groups of Muon, AdamW, SGD…) need no whole tensor, so the planner
    places them after the whole ones, in two steps:

    1. *Pour*: largest first, each goes whole into the smallest gap a
       whole-parameter bucket left (padding inside a shard) that holds it, and only
       into a bucket whose last parameter in backward order comes at or after it, so
       that no bucket's gradients complete later than without it.
    2. *Flat buckets*: the rest are laid back to back in backward order (each on a
       64-element boundary) into buckets of ``bucket_size`` elements, rounded up to
       a multiple of ``dp * 64`` and split into ``dp`` equal shards, as a ZeRO-1
       optimizer splits its buffer. A parameter crossing a shard boundary is split:
       its :class:`Piece` on each rank is the part inside that rank's shard, and
       that rank steps that part (Note [pieces] in ``data_parallel.py``).

    The planner also packs the buffer with the element-wise parameters owned whole
    (as peers and fill of the rounds, as before) and keeps that layout when its
    buffer is smaller: an embedding the size of the MLP matrices is their peer.

    Every element is then stepped by exactly one rank, every piece lies inside its
    owner's shard, and a parameter that is not element-wise never crosses a shard
    boundary. Padding left: what whole parameters leave that no element-wise
    parameter fits, plus alignment (at most 63 elements per parameter and
    ``dp * 64`` per flat bucket). An element-wise parameter's cost is its element
    count whatever ``cost`` says (a piece costs its share). The flat buckets keep
    backward order among themselves but follow all whole buckets in the buffer;
    the wrapper orders collectives by each bucket's first parameter, so that only
    changes when a flat bucket's reduce-scatter can start, never correctness.

Note [backward order]
    Gradients become ready in roughly reverse registration order, so buffers
    are filled from the last registered parameter to the first and buckets are
    numbered in that order: bucket 0 completes first in backward and its
    reduce-scatter can start while the rest of backward runs. Forward needs the
    buckets in the opposite order (highest index first), which is the order
    in which all-gathers are dispatched.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import gc
import heapq
import math
from collections import defaultdict
from itertools import islice
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Callable, Iterable, Iterator, Literal, Mapping, NamedTuple, Optional, Sequence

import torch

ALIGNMENT = 64
"""Every parameter starts on a multiple of this many elements inside its buffer."""

DEFAULT_BUCKET_SIZE = 40_000_000
"""Default bucket length in elements (about 160 MB of fp32 gradients)."""

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
    (Note [element-wise fill]); otherwise it is owned whole."""

    @functools.cached_property
    def numel(self) -> int:  # computed once: the planner asks often (frozen: the cache bypasses __setattr__)
        return math.prod(self.shape)


def newton_schulz_cost(spec: ParamSpec) -> float:
    """Approximate optimizer work for one parameter.

    A matrix (or a higher-dim kernel viewed as ``out x rest``) is orthogonalized
    by Newton–Schulz, whose matmuls cost about ``min(m, n)^2 * max(m, n)``; any
    other parameter is updated element-wise.
    """
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
    parameter is element-wise and crosses a shard boundary (Note [element-wise fill])."""

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
    dp: int
    params: tuple[str, ...]
    """Names of the parameters in this bucket, by offset."""
    chunks: tuple[tuple[tuple[int, int], ...], ...] = ()
    """With replica sharing (Note [replica sharing]): per shard position, ``(replica, offset)`` for each
    replica whose chunk is not empty, by offset from the shard's start (the first at 0); a chunk ends
    where the next begins, the last at the shard's end. Empty without replica sharing."""
    replicas: int = 1

    @property
    def numel(self) -> int:
        return self.end - self.start

    @property
    def shard_size(self) -> int:
        return self.numel // self.dp

    def shard_range(self, rank: int) -> tuple[int, int]:
        """Buffer range ``[start, end)`` of rank ``rank``'s shard."""
        begin = self.start + rank * self.shard_size
        return begin, begin + self.shard_size

    def chunk_ranges(self, rank: int) -> list[tuple[int, int]]:
        """Buffer ranges of the chunks of position ``rank``'s shard, one per replica (Note [replica sharing]);
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
    dp: int = 0
    """Ranks its shards are spread over: the layout's ``dp``, or ``expert_dp`` for expert buffers."""


@dataclass(frozen=True)
class Layout:
    """The immutable plan for a set of parameters at a data-parallel size ``dp``."""

    dp: int
    bucket_size: int
    buffers: tuple[BufferPlan, ...]
    params: Mapping[str, ParamSlot]
    costs: Mapping[str, float] = field(repr=False)
    replicas: int = 1
    """Owner groups that share the stepping of the dense buffers (Note [replica sharing]): a dense
    piece's owner is then ``replica * dp + position``, a rank of the whole data-parallel group."""
    expert_replicas: int = 1
    """The same for the expert buffers, inside the expert data-parallel group: an expert piece's owner is
    ``replica * g_e + position`` for expert buffers planned for ``g_e`` ranks."""

    @property
    def ranks(self) -> int:
        """How many ranks step something: ``dp * replicas``."""
        return self.dp * self.replicas

    @property
    def expert_group_size(self) -> int | None:
        """The ranks the expert buffers are planned for (their owner group), ``None`` without expert buffers."""
        return next((b.dp for b in self.buffers if b.kind == "expert"), None)

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
            f"layout: dp={self.dp} bucket_size={self.bucket_size:,} params={len(self.params)} "
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


def _validate(specs: Sequence[ParamSpec], dp: int, bucket_size: int) -> None:
    if not isinstance(dp, int) or dp < 1:
        raise ValueError(f"dp={dp!r} is not a valid data-parallel size; pass an integer >= 1.")
    if not is_bucket_size(bucket_size):
        raise ValueError(
            f"bucket_size={bucket_size!r} must be a positive number of elements; "
            f"pass e.g. bucket_size={DEFAULT_BUCKET_SIZE}."
        )
    seen: set[str] = set()
    for spec in specs:
        if spec.name in seen:
            raise ValueError(
                f"parameter {spec.name!r} appears twice; pass each tensor once "
                "(module.named_parameters() already skips tied duplicates)."
            )
        seen.add(spec.name)
        if spec.numel == 0:
            raise ValueError(f"parameter {spec.name!r} has no elements (shape {spec.shape}); remove it "
                             "or set requires_grad=False.")
        if spec.kind not in ("dense", "expert"):
            raise ValueError(f"parameter {spec.name!r} has kind={spec.kind!r}; use 'dense' or 'expert'.")


@contextlib.contextmanager
def _without_cycle_collection():
    """Planning allocates many small objects and makes no reference cycles; the cyclic collector, run again
    and again over a large process's objects meanwhile, would take a third of the time at 45,000 tensors."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def plan_layout(
    specs: Iterable[ParamSpec],
    dp: int,
    bucket_size: int = DEFAULT_BUCKET_SIZE,
    cost: Callable[[ParamSpec], float] = newton_schulz_cost,
    expert_dp: int | None = None,
    replicas: int = 1,
    expert_replicas: int = 1,
) -> Layout:
    """Plans buffers, buckets, shards and owners for ``specs`` given in registration order.

    See the notes in this module's docstring for the guarantees. ``cost`` weighs
    the parameters owned whole; an element-wise one costs its element count.
    ``expert_dp``: plan ``kind="expert"`` buffers for this many ranks (the expert
    data-parallel group, Note [expert parallelism] in ``process_groups.py``)
    instead of ``dp``; owner indices in those buffers are positions in that group.
    ``replicas``: ``dp`` is an owner group of ``dp * replicas`` ranks, and the dense buffers' stepping is
    shared among the ``replicas`` owner groups (:func:`share_among_replicas`); ``expert_replicas``: the
    same for the expert buffers, ``expert_dp`` then being an owner group of the expert data-parallel group.
    """
    with _without_cycle_collection():
        return _plan_layout(list(specs), dp, bucket_size, cost, expert_dp, replicas, expert_replicas)


def _plan_layout(specs: list[ParamSpec], dp: int, bucket_size: int, cost: Callable[[ParamSpec], float],
                 expert_dp: int | None, replicas: int, expert_replicas: int) -> Layout:
    _validate(specs, dp, bucket_size)
    if expert_dp is not None and (isinstance(expert_dp, bool) or not isinstance(expert_dp, int) or expert_dp < 1):
        raise ValueError(f"expert_dp={expert_dp!r} is not a valid expert data-parallel size; pass an integer >= 1.")
    costs = {s.name: float(numel_cost(s) if s.elementwise else cost(s)) for s in specs}

    # One buffer per (dtype, kind), in order of first appearance.
    groups: dict[tuple[torch.dtype, str], list[ParamSpec]] = {}
    for spec in specs:
        groups.setdefault((spec.dtype, spec.kind), []).append(spec)

    buffers: list[BufferPlan] = []
    slots: dict[str, ParamSlot] = {}
    rank_costs: dict[int, list[float]] = {}  # per group size, carried across buffers (Note [owner balancing])
    for buffer_index, ((dtype, kind), members) in enumerate(groups.items()):
        ranks = expert_dp if kind == "expert" and expert_dp is not None else dp
        queue = list(reversed(members))  # backward order
        rank_cost = rank_costs.get(ranks, [0.0] * ranks)
        buckets, located, pieces, rank_costs[ranks] = _plan_buffer_with_fill(queue, ranks, bucket_size, costs,
                                                                             rank_cost)
        by_name = {s.name: s for s in members}
        for name, (bucket_index, offset) in located.items():
            slots[name] = ParamSlot(name, by_name[name].shape, buffer_index, bucket_index, offset, pieces[name])
        numel = buckets[-1].end if buckets else 0
        buffers.append(BufferPlan(buffer_index, dtype, kind, numel, tuple(buckets), ranks))

    ordered = {s.name: slots[s.name] for s in specs}
    layout = Layout(dp, bucket_size, tuple(buffers), MappingProxyType(ordered), MappingProxyType(costs))
    return share_among_replicas(layout, specs, replicas, expert_groups=expert_dp is not None,
                                expert_replicas=expert_replicas)


DEFAULT_STATE_BYTES = 8
"""Optimizer state per stepped element assumed by :func:`choose_owner_group_size`: AdamW's two
float32 moments (Muon keeps one; float32 masters of ``bf16-true`` add four)."""


def estimated_rank_bytes(layout: Layout, grad_bytes: int | None = None,
                         state_bytes: int = DEFAULT_STATE_BYTES) -> int:
    """Bytes one rank holds for ``layout``: the param and grad buffers (padding included) and the
    optimizer state of the busiest rank's elements. ``grad_bytes``: per gradient element
    (default: the parameter's)."""
    buffers = sum(b.numel * (b.dtype.itemsize + (grad_bytes or b.dtype.itemsize)) for b in layout.buffers)
    # Dense owners are positions in the owner group, expert owners in the expert data-parallel group
    # (Note [expert parallelism]): each kind's busiest position, added, bounds a rank's state.
    by_kind: dict[str, dict[int, int]] = {}
    kinds = {name: plan.kind for plan in layout.buffers for bucket in plan.buckets for name in bucket.params}
    for name, slot in layout.params.items():
        owners = by_kind.setdefault(kinds[name], {})
        for piece in slot.pieces:
            owners[piece.owner] = owners.get(piece.owner, 0) + piece.numel
    return buffers + sum(max(owners.values()) for owners in by_kind.values() if owners) * state_bytes


DEFAULT_RANKS_PER_NODE = 8
"""Ranks per node :func:`choose_owner_group_size` assumes when it is not told."""

PADDING_TOLERANCE = 0.01
"""Buffer growth (padding beyond alignment) :func:`choose_owner_group_size` accepts for a larger owner group."""


def choose_owner_group_size(specs: Sequence[ParamSpec], dp: int, bucket_size: int = DEFAULT_BUCKET_SIZE,
                            cost: Callable[[ParamSpec], float] = newton_schulz_cost, ranks_per_node: int | None = None,
                            grad_bytes: int | None = None, state_bytes: int = DEFAULT_STATE_BYTES,
                            expert_dp: int | None = None) -> tuple[int, Layout]:
    """The owner group size ``g`` (a divisor of ``dp``) and its layout, shared among the ``dp / g`` groups.

    Note [choosing the owner group size]
        With replica sharing (Note [replica sharing]) every element is stepped by one
        rank of the world whatever ``g`` is, so the optimizer state is about ``1/dp``
        of the model per rank and Newton–Schulz runs once per matrix for every ``g``.
        What ``g`` still decides is padding and where the traffic goes: the buffers
        are planned for ``g`` ranks (whole matrices pad once a size class has fewer
        than ``g``), the even reduce-scatter and all-gather run inside the group, and
        the uneven ones across the ``dp / g`` replicas. So the planner takes the
        largest ``g`` that divides the ranks per node (the in-group collectives stay on
        the node's fast links, and fewer replicas mean fewer pieces in the uneven
        collectives) whose buffers exceed the unpadded parameters by at most
        :data:`PADDING_TOLERANCE`, trying sizes from the largest down; if none does,
        the one whose busiest rank holds the fewest bytes (:func:`estimated_rank_bytes`:
        buffers with padding plus that rank's optimizer state). On one node
        (``dp <= ranks_per_node``) it keeps one group. ``ranks_per_node=None`` assumes
        :data:`DEFAULT_RANKS_PER_NODE`. With one rank per node no group can stay inside a
        node, and a group of one would make every collective an uneven one across the
        replicas, so one group of all ranks is tried first there, then groups of one.
        Expert parameters (``kind="expert"``, with
        ``expert_dp``) are planned inside their expert data-parallel group whatever ``g``
        is (their owner group size chosen by :func:`choose_expert_group_size`), so the
        choice weighs the dense parameters alone, as the wrapper then plans them. Pure:
        every rank computes the same answer.
    """
    specs = list(specs)
    _validate(specs, dp, bucket_size)
    ge = choose_expert_group_size(specs, expert_dp, bucket_size, cost) if expert_dp is not None else None
    shared = {"expert_dp": ge, "expert_replicas": expert_dp // ge if ge else 1}
    per_node = ranks_per_node or DEFAULT_RANKS_PER_NODE
    if dp <= per_node:
        return dp, plan_layout(specs, dp, bucket_size, cost, **shared)
    expert_groups = expert_dp is not None
    dense = [s for s in specs if not (expert_groups and s.kind == "expert")]
    unpadded = sum(aligned(s.numel) for s in dense)

    def dense_elements(layout: Layout) -> int:
        return sum(b.numel for b in layout.buffers if not (expert_groups and b.kind == "expert"))

    planned: dict[int, tuple[int, Layout]] = {}
    for g in _group_candidates(dp, per_node):
        layout = plan_layout(specs, g, bucket_size, cost, replicas=dp // g, **shared)
        if dense_elements(layout) <= (1 + PADDING_TOLERANCE) * unpadded:
            return g, layout
        planned[g] = (estimated_rank_bytes(layout, grad_bytes, state_bytes), layout)
    g = min(planned, key=lambda k: (planned[k][0], -k))
    return g, planned[g][1]


def _group_candidates(dp: int, per_node: int) -> list[int]:
    """Owner group sizes :func:`choose_owner_group_size` tries, in order (Note [choosing the owner group size])."""
    if per_node == 1:
        return [dp, 1]
    return sorted((g for g in range(1, dp + 1) if dp % g == 0 and per_node % g == 0), reverse=True)


def choose_expert_group_size(specs: Sequence[ParamSpec], expert_dp: int, bucket_size: int = DEFAULT_BUCKET_SIZE,
                             cost: Callable[[ParamSpec], float] = newton_schulz_cost) -> int:
    """The owner group size for the expert buffers inside an expert data-parallel group of ``expert_dp`` ranks
    (Note [expert owner groups] in ``process_groups.py``): the largest divisor of ``expert_dp`` whose expert
    buffers exceed the unpadded expert parameters by at most :data:`PADDING_TOLERANCE`, else the one that pads
    least. The experts' own rule of Note [choosing the owner group size]: their replicas share the stepping,
    so only padding is at stake. Pure."""
    experts = [s for s in specs if s.kind == "expert"]
    if not experts:
        return expert_dp
    unpadded = sum(aligned(s.numel) for s in experts)
    planned = {}
    for ge in sorted((d for d in range(1, expert_dp + 1) if expert_dp % d == 0), reverse=True):
        total = plan_layout(experts, ge, bucket_size, cost).total_numel
        if total <= (1 + PADDING_TOLERANCE) * unpadded:
            return ge
        planned[ge] = total
    return min(planned, key=lambda d: (planned[d], -d))


ELEMENTWISE_STATE = 2
"""Optimizer state of an element-wise element against a matrix element's, as replica sharing balances it:
AdamW keeps two moments where Muon keeps one momentum (Note [replica sharing])."""


def share_among_replicas(layout: Layout, specs: Sequence[ParamSpec], replicas: int,
                         expert_groups: bool = False, expert_replicas: int = 1) -> Layout:
    """``layout`` (planned for an owner group) with the stepping of its dense buffers shared among
    ``replicas`` owner groups: every element stepped by exactly one rank of the world.

    Note [replica sharing]
        With ``dp = g * R`` ranks in ``R`` owner groups of ``g``, the layout is planned
        for ``g`` ranks (Note [owner groups] in ``process_groups.py``) and the ranks at
        position ``p`` of every group (its *replicas*) hold the same shard ``p`` of every
        bucket. Each such shard is cut into ``R`` consecutive *chunks*, chunk ``k``
        stepped by replica ``k`` alone (world rank ``k * g + p``): its reduced gradient
        is reduce-scattered to it across the replicas, it runs the optimizer on the
        chunk only (Newton–Schulz once per matrix in the world, optimizer state once in
        the world) and the chunks are all-gathered across the replicas before the
        owner group all-gathers the shards. A chunk holds whole parameters that are
        not element-wise (Muon matrices) and any part of element-wise ones:

        * a shard holding only element-wise elements (the flat buckets) keeps its
          order and is cut where the water level of the optimizer state each replica
          already holds asks (water-filling; an element-wise element counts
          :data:`ELEMENTWISE_STATE` times a matrix element), parameters crossing a cut
          being stepped in pieces;
        * a shard of whole parameters is reordered: matrices go to replicas by
          longest processing time first on their Newton–Schulz cost, over all the
          buckets of a position at once, then improved by moves and swaps while the
          busiest replica is above the bound (:func:`_rebalance`); element-wise ones
          whole, to the replica holding the least state; and each replica's parameters
          are then laid out consecutively in the shard (offsets within a shard are
          free: nothing else depends on them);
        * anything else (a custom layout mixing pieces and matrices in one shard) goes
          whole to the least loaded replica.

        Chunks tile the shard; they may differ in length and be empty, so the
        collectives across replicas are the uneven forms (``collectives.py``). Buffers,
        buckets and shards are the owner group's, so padding and the in-group
        collectives are unchanged. Pure and deterministic: every rank computes the same.
    """
    for what, value in (("replicas", replicas), ("expert_replicas", expert_replicas)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{what}={value!r}: pass the number of owner groups, an integer >= 1.")
    if replicas == 1 and (expert_replicas == 1 or not expert_groups):
        return layout
    if layout.replicas != 1 or layout.expert_replicas != 1:
        raise ValueError(f"the layout is already shared among {layout.replicas} replicas.")
    elementwise = {s.name: s.elementwise for s in specs}
    numel = {s.name: s.numel for s in specs}
    offsets: dict[str, int] = {}
    world_pieces: dict[str, list[Piece]] = defaultdict(list)
    experts = [plan for plan in layout.buffers if plan.kind == "expert" and expert_groups]
    dense = [plan for plan in layout.buffers if not (plan.kind == "expert" and expert_groups)]
    shared: dict[int, BufferPlan] = {}
    for plans, g, count in ((dense, layout.dp, replicas), (experts, experts[0].dp if experts else 1, expert_replicas)):
        if plans and count > 1:
            shared.update(_share_family(layout, plans, g, count, elementwise, numel, offsets, world_pieces))
    params = {}
    for name, slot in layout.params.items():
        if name in world_pieces:
            pieces = tuple(sorted(world_pieces[name], key=lambda q: q.start))
            slot = ParamSlot(name, slot.shape, slot.buffer, slot.bucket, offsets.get(name, slot.offset), pieces)
        params[name] = slot
    buffers = tuple(shared.get(plan.index, plan) for plan in layout.buffers)
    return Layout(layout.dp, layout.bucket_size, buffers, MappingProxyType(params), layout.costs, replicas,
                  expert_replicas if experts else 1)


def _share_family(layout: Layout, plans: list[BufferPlan], g: int, replicas: int, elementwise: Mapping[str, bool],
                  numel: Mapping[str, int], offsets: dict[str, int], world_pieces: dict[str, list[Piece]]
                  ) -> dict[int, BufferPlan]:
    """The buffers ``plans`` (all planned for ``g`` ranks) shared among ``replicas`` (Note [replica sharing]);
    records the new offsets and the pieces, whose owners are ``replica * g + position``."""
    # Per shard: its (name, slot, piece) items and how it is cut ("cut", "reorder" or "one").
    shards: dict[tuple[int, int], list[tuple[list[tuple[str, ParamSlot, Piece]], str]]] = {}
    matrices: list[list[tuple[float, int, int, int, str]]] = [[] for _ in range(g)]
    for plan in plans:
        for bp in plan.buckets:
            by_position: list[list[tuple[str, ParamSlot, Piece]]] = [[] for _ in range(g)]
            for name in bp.params:
                slot = layout.params[name]
                for piece in slot.pieces:
                    by_position[piece.owner].append((name, slot, piece))
            described = []
            for p, items in enumerate(by_position):
                whole = [n for n, _, _ in items if not elementwise.get(n, False)]
                if not whole:
                    mode = "cut"
                elif all(piece.start == 0 and piece.stop == numel[n] for n, _, piece in items):
                    mode = "reorder"  # matrices first, each position over its replicas, below
                    matrices[p] += [(-layout.costs[n], -numel[n], slot.buffer, slot.offset, n)
                                    for n, slot, _ in items if not elementwise.get(n, False)]
                else:
                    mode = "one"
                described.append((items, mode))
            shards[plan.index, bp.index] = described
    # Matrices by longest processing time first over all buckets, then improved by moves and swaps.
    acc_cost = [[0.0] * replicas for _ in range(g)]
    acc_numel = [[0] * replicas for _ in range(g)]
    replica_of: dict[str, int] = {}
    total = sum(-job[0] for jobs in matrices for job in jobs)
    floor = max([total / (g * replicas)] + [-job[0] for jobs in matrices for job in jobs])
    for p, jobs in enumerate(matrices):
        heap = [(0.0, 0, k) for k in range(replicas)]
        bins: list[list[tuple[float, int, str]]] = [[] for _ in range(replicas)]
        for negative_cost, negative_numel, _, _, name in sorted(jobs):
            cost, count, k = heapq.heappop(heap)
            bins[k].append((-negative_cost, -negative_numel, name))
            heapq.heappush(heap, (cost - negative_cost, count - negative_numel, k))
        for cost, count, k in heap:
            acc_cost[p][k], acc_numel[p][k] = cost, count
        _rebalance(bins, acc_cost[p], acc_numel[p], floor)
        for k, jobs_k in enumerate(bins):
            for _, _, name in jobs_k:
                replica_of[name] = k
    out = {}
    for plan in plans:
        buckets = []
        for bp in plan.buckets:
            cuts = tuple(_share_shard(items, mode, bp.shard_range(p), p, g, replicas, elementwise, layout.costs,
                                      replica_of, acc_cost[p], acc_numel[p], offsets, world_pieces)
                         for p, (items, mode) in enumerate(shards[plan.index, bp.index]))
            params = tuple(sorted(bp.params, key=lambda n: offsets.get(n, layout.params[n].offset)))
            buckets.append(BucketPlan(bp.index, bp.start, bp.end, bp.dp, params, cuts, replicas))
        out[plan.index] = BufferPlan(plan.index, plan.dtype, plan.kind, plan.numel, tuple(buckets), plan.dp)
    return out


def _rebalance(bins: list[list[tuple[float, int, str]]], cost: list[float], numel: list[int], floor: float,
               rounds: int = 1000) -> None:
    """Improves a longest-processing-time assignment in place: while the busiest replica is above ``floor``
    (no assignment can go below it), move one of its matrices to another replica, or swap it for a
    cheaper one there, choosing the change that lowers the larger of the two loads the most. Candidates
    are taken one per distinct cost, so a stack of identical layers stays quick."""
    replicas = len(bins)
    for _ in range(rounds):
        b = max(range(replicas), key=lambda k: (cost[k], k))
        top = cost[b]
        if top <= floor * (1 + 1e-9):
            return
        mine = {c: (c, n, name) for c, n, name in bins[b]}
        best = (top, None)
        for r in range(replicas):
            if r == b or cost[r] >= top:
                continue
            theirs = {c: (c, n, name) for c, n, name in bins[r]}
            for x in mine:
                for y in [0.0, *theirs]:  # 0.0: a move
                    delta = x - y
                    if delta <= 0:
                        continue
                    pair = max(top - delta, cost[r] + delta)
                    if pair < best[0] - 1e-9 * top:
                        best = (pair, (r, mine[x], theirs.get(y)))
        if best[1] is None:
            return
        r, out, back = best[1]
        for job, source, target in ((out, b, r), (back, r, b)):
            if job is not None:
                bins[source].remove(job)
                bins[target].append(job)
                cost[source] -= job[0]
                cost[target] += job[0]
                numel[source] -= job[1]
                numel[target] += job[1]


def _water_fill(levels: Sequence[int], total: int) -> list[int]:
    """Integer amounts adding up to ``total`` that raise the lowest ``levels`` as evenly as possible."""
    order = sorted(range(len(levels)), key=lambda k: (levels[k], k))
    prefix, count = 0, len(order)
    for c in range(1, len(order) + 1):  # raise the lowest c together while they stay below the next
        prefix += levels[order[c - 1]]
        if c == len(order) or total + prefix <= c * levels[order[c]]:
            count = c
            break
    level = (total + prefix) // count
    amounts = [0] * len(levels)
    for j in order[:count]:
        amounts[j] = level - levels[j]
    for j in order[:total - sum(amounts)]:  # the rounding remainder, lowest first
        amounts[j] += 1
    return amounts


def _share_shard(items: list[tuple[str, ParamSlot, Piece]], mode: str, shard: tuple[int, int], position: int, g: int,
                 replicas: int, elementwise: Mapping[str, bool], costs: Mapping[str, float],
                 replica_of: Mapping[str, int], acc_cost: list[float], acc_numel: list[int], offsets: dict[str, int],
                 world_pieces: dict[str, list[Piece]]) -> tuple[tuple[int, int], ...]:
    """One shard cut into chunks (Note [replica sharing]): returns ``(replica, offset)`` per non-empty chunk
    (:attr:`BucketPlan.chunks`) and records the new offsets and the world pieces."""
    lo = shard[0]
    if not items:
        return ((0, 0),)
    if len(items) == 1 and mode == "reorder" and not elementwise.get(items[0][0], False):
        name, slot, _ = items[0]  # the common case at scale: one matrix
        k = replica_of[name]
        offsets[name] = lo
        world_pieces[name].append(Piece(k * g + position, 0, items[0][2].stop))
        return ((k, 0),)
    if mode == "cut":
        # Cut in place where the water level asks: pieces of element-wise parameters.
        items = sorted(items, key=lambda it: it[1].offset + it[2].start)
        quotas = _water_fill([a // ELEMENTWISE_STATE for a in acc_numel], sum(piece.numel for _, _, piece in items))
        order = [k for k in range(replicas) if quotas[k]]
        starts, stream, i = [(order[0], 0)], 0, 0
        target = quotas[order[0]]
        for name, slot, piece in items:
            begin = slot.offset + piece.start
            done = 0
            while done < piece.numel:
                if stream >= target:  # this replica is full: the next begins here
                    i += 1
                    starts.append((order[i], begin + done - lo))
                    target += quotas[order[i]]
                k = order[i]
                take = min(piece.numel - done, target - stream)
                world_pieces[name].append(Piece(k * g + position, piece.start + done, piece.start + done + take))
                acc_numel[k] += take * ELEMENTWISE_STATE
                acc_cost[k] += costs[name] * take / slot.numel
                done += take
                stream += take
        return tuple(starts)
    if mode == "reorder":
        # Reorder: matrices where the longest-processing-time pass put them (their cost is counted there),
        # element-wise parameters whole to the replica stepping the fewest elements.
        region: dict[int, list[tuple[str, ParamSlot]]] = defaultdict(list)
        vectors = []
        for name, slot, _ in items:
            if elementwise.get(name, False):
                vectors.append((name, slot))
            else:
                region[replica_of[name]].append((name, slot))
        for name, slot in sorted(vectors, key=lambda it: (-it[1].numel, it[1].offset)):
            k = min(range(replicas), key=lambda r: (acc_numel[r], r))
            region[k].append((name, slot))
            acc_cost[k] += costs[name]
            acc_numel[k] += slot.numel * ELEMENTWISE_STATE
        starts, cursor = [], lo
        for k in sorted(region):
            starts.append((k, cursor - lo))
            for name, slot in sorted(region[k], key=lambda it: it[1].offset):
                offsets[name] = cursor
                world_pieces[name].append(Piece(k * g + position, 0, slot.numel))
                cursor += aligned(slot.numel)
        if cursor > shard[1]:
            raise AssertionError(f"replica sharing overflowed a shard by {cursor - shard[1]} elements")  # invariant
        return tuple(starts)
    # A shard mixing pieces and matrices (not planned here): all of it to the least loaded replica.
    k = min(range(replicas), key=lambda r: (acc_cost[r], acc_numel[r], r))
    for name, slot, piece in items:
        world_pieces[name].append(Piece(k * g + position, piece.start, piece.stop))
        acc_cost[k] += costs[name] * piece.numel / slot.numel
        acc_numel[k] += piece.numel * (ELEMENTWISE_STATE if elementwise.get(name, False) else 1)
    return ((k, 0),)


def _plan_buffer_with_fill(queue: list[ParamSpec], dp: int, bucket_size: int, costs: Mapping[str, float],
                           rank_cost: list[float]):
    """One buffer (``queue`` in backward order): whole parameters packed, element-wise ones poured
    into the gaps and the rest in flat buckets (Note [element-wise fill]). Returns the buckets, per
    name ``(bucket, offset)`` and pieces, and the rank costs after this buffer.

    Packing the element-wise parameters whole, as peers and fill of the rounds, sometimes pads
    less (an embedding as large as the MLP matrices is their peer); both are planned and the one
    with the smaller buffer is kept, the split one on a tie.
    """
    def plan(whole: list[ParamSpec], elementwise: list[ParamSpec]):
        cost = list(rank_cost)
        buckets, placed, cost = _plan_buffer(whole, dp, bucket_size, costs, cost) if whole else ([], {}, cost)
        numel = {s.name: s.numel for s in queue}
        pieces = {name: (Piece(owner, 0, numel[name]),) for name, (_, _, owner) in placed.items()}
        located = {name: (bucket, offset) for name, (bucket, offset, _) in placed.items()}
        if elementwise:
            buckets, rest = _pour(buckets, elementwise, queue, located, pieces, cost, costs)
            start = buckets[-1].end if buckets else 0
            buckets = buckets + _plan_flat(rest, dp, bucket_size, start, len(buckets), located, pieces, cost, costs)
        return buckets, located, pieces, cost

    elementwise = [s for s in queue if s.elementwise]
    filled = plan([s for s in queue if not s.elementwise], elementwise)
    if not elementwise or dp == 1:
        return filled
    whole = plan(queue, [])
    return whole if whole[0][-1].end < filled[0][-1].end else filled


def _pour(buckets: list[BucketPlan], elementwise: list[ParamSpec], queue: list[ParamSpec],
          located: dict[str, tuple[int, int]], pieces: dict[str, tuple[Piece, ...]], rank_cost: list[float],
          costs: Mapping[str, float]) -> tuple[list[BucketPlan], list[ParamSpec]]:
    """Places element-wise parameters whole into the padding of the whole-parameter buckets.

    Largest first, each into the smallest gap that holds it, and only into a bucket
    whose gradients complete no earlier without it (its last parameter in backward
    order comes at or after the poured one), so no reduce-scatter waits longer.
    Returns the buckets with the poured parameters added and the parameters left
    for the flat buckets. See Note [element-wise fill].
    """
    if not buckets:
        return buckets, elementwise
    position = {s.name: i for i, s in enumerate(queue)}
    numel = {s.name: s.numel for s in queue}
    gaps: list[tuple[int, int, int, int]] = []  # (length, offset, bucket, rank)
    completes = []  # per bucket: backward position of its last parameter
    for b in buckets:
        completes.append(max(position[n] for n in b.params))
        taken = sorted((located[n][1], located[n][1] + aligned(numel[n])) for n in b.params)
        for rank in range(b.dp):
            lo, hi = b.shard_range(rank)
            cursor = lo
            for begin, end in taken:
                if end <= lo or begin >= hi:
                    continue
                if begin > cursor:
                    gaps.append((begin - cursor, cursor, b.index, rank))
                cursor = max(cursor, end)
            if hi > cursor:
                gaps.append((hi - cursor, cursor, b.index, rank))
    if not gaps:
        return buckets, elementwise
    gaps.sort()
    added: dict[int, list[str]] = defaultdict(list)
    rest = []
    for spec in sorted(elementwise, key=lambda s: (-s.numel, position[s.name])):
        need = aligned(spec.numel)
        i = bisect.bisect_left(gaps, (need, -1, -1, -1))
        while i < len(gaps) and completes[gaps[i][2]] < position[spec.name]:
            i += 1
        if i == len(gaps):
            rest.append(spec)
            continue
        length, offset, bucket, rank = gaps.pop(i)
        located[spec.name] = (bucket, offset)
        pieces[spec.name] = (Piece(rank, 0, spec.numel),)
        rank_cost[rank] += costs[spec.name]
        added[bucket].append(spec.name)
        if length > need:
            bisect.insort(gaps, (length - need, offset + need, bucket, rank))
    rest.sort(key=lambda s: position[s.name])
    poured = [BucketPlan(b.index, b.start, b.end, b.dp,
                         tuple(sorted(b.params + tuple(added[b.index]), key=lambda n: located[n][1])))
              if added[b.index] else b for b in buckets]
    return poured, rest


def _plan_flat(queue: list[ParamSpec], dp: int, bucket_size: int, start: int, first_index: int,
               located: dict[str, tuple[int, int]], pieces: dict[str, tuple[Piece, ...]], rank_cost: list[float],
               costs: Mapping[str, float]) -> list[BucketPlan]:
    """Element-wise parameters packed back to back, in backward order, into buckets split into
    ``dp`` equal shards; a parameter crossing a shard boundary is stepped in pieces.
    See Note [element-wise fill]."""
    buckets: list[BucketPlan] = []
    members: list[ParamSpec] = []
    bucket_start = cursor = start

    def close() -> None:
        nonlocal bucket_start
        length = aligned(cursor - bucket_start, dp * ALIGNMENT)
        shard = length // dp
        for spec in members:
            offset = located[spec.name][1]
            owned = []
            for rank in range(dp):
                lo = bucket_start + rank * shard
                a, b = max(offset, lo), min(offset + spec.numel, lo + shard)
                if a < b:
                    owned.append(Piece(rank, a - offset, b - offset))
                    rank_cost[rank] += costs[spec.name] * (b - a) / spec.numel
            pieces[spec.name] = tuple(owned)
        buckets.append(BucketPlan(first_index + len(buckets), bucket_start, bucket_start + length, dp,
                                  tuple(s.name for s in members)))
        bucket_start += length
        members.clear()

    for spec in queue:
        located[spec.name] = (first_index + len(buckets), cursor)
        members.append(spec)
        cursor += aligned(spec.numel)
        if cursor - bucket_start >= bucket_size:
            close()
            cursor = bucket_start
    if members:
        close()
    return buckets


def _plan_buffer(
    queue: list[ParamSpec], dp: int, bucket_size: int, costs: Mapping[str, float], rank_cost: Sequence[float]
) -> tuple[list[BucketPlan], dict[str, tuple[int, int, int]], list[float]]:
    """Packs one buffer; ``queue`` is in backward order. See Note [tail gaps].

    ``rank_cost`` is the cost each rank already carries from earlier buffers.
    Returns the buckets, per parameter name (bucket, offset, owner), and the
    rank costs including this buffer.
    """
    best = _search(queue, dp, bucket_size, costs, rank_cost, frozenset())
    # Note [leftovers]: the same search with size-class leftovers reserved as fill; kept only if
    # it pads less.
    reserved = _reserve_leftovers(queue, dp)
    if reserved:
        candidate = _search(queue, dp, bucket_size, costs, rank_cost, reserved)
        if candidate.padding < best.padding:
            best = candidate
    return best.buckets, best.placed, best.rank_cost


def _search(queue: list[ParamSpec], dp: int, bucket_size: int, costs: Mapping[str, float],
            rank_cost: Sequence[float], reserved: frozenset[str]) -> _Packing:
    """One packing pass, then solo seeds one by one while total padding drops. See Note [tail gaps]."""
    position = {s.name: i for i, s in enumerate(queue)}
    solo: tuple[str, ...] = ()
    best = _pack(queue, dp, bucket_size, costs, solo, len(queue), rank_cost, reserved)
    for _ in range(_MAX_SOLO_SEEDS):
        # Only seeds inside the last bucket, after its first parameter, may move to the tail.
        tail_start = min(position[n] for n in best.buckets[-1].params)
        seed, gap = max(((n, g) for n, g in best.gaps.items() if n not in solo and position[n] > tail_start
                         and best.placed[n][0] == len(best.buckets) - 1),
                        key=lambda kv: kv[1], default=(None, 0))
        if seed is None or gap == 0:
            break
        candidate = _pack(queue, dp, bucket_size, costs, solo + (seed,), tail_start, rank_cost, reserved)
        if candidate.padding >= best.padding:
            break
        best, solo = candidate, solo + (seed,)
    return best


_MAX_SOLO_SEEDS = 8


def _reserve_leftovers(queue: list[ParamSpec], dp: int) -> frozenset[str]:
    """Which parameters to keep out of rounds of their own and use as fill. See Note [leftovers].

    Simulates rounds by size class, largest first: a class of ``c`` parameters
    makes ``c // dp`` full rounds, and its ``c % dp`` leftovers either fit into
    the free shards of larger classes' short rounds or form a short round whose
    free shards smaller classes can use. Then, largest class first, whole
    groups of ``dp`` are moved from full rounds into free shards while
    everything still fits. Returns the reserved names: per class, the last ones
    in backward order.
    """
    if dp == 1:
        return frozenset()
    classes: dict[int, list[str]] = defaultdict(list)
    for s in queue:
        classes[aligned(s.numel)].append(s.name)
    sizes = sorted(classes, reverse=True)
    count = {z: len(classes[z]) for z in sizes}
    fill = {z: 0 for z in sizes}

    def fits(upto: int) -> bool:
        """Whether the fill of the first ``upto`` classes fits, packed largest first, first shard first."""
        bins: list[list[int]] = []  # [room, number of shards with that room], in order of creation
        for z in sizes[:upto]:
            left = fill[z]
            i = 0
            while left and i < len(bins):
                room, n = bins[i]
                k = room // z
                if k == 0:
                    i += 1
                    continue
                full = min(n, left // k)
                parts = []
                if full:
                    parts.append([room - k * z, full])
                    left -= full * k
                if full < n and left:
                    parts.append([room - left * z, 1])
                    left = 0
                    full += 1
                if full < n:
                    parts.append([room, n - full])
                bins[i:i + 1] = parts
                i += len(parts) - (full < n)
            if left:
                return False
            short = (count[z] - fill[z]) % dp
            if short:
                bins.append([z, dp - short])
        return True

    for i, z in enumerate(sizes):
        fill[z] = count[z] % dp
        if not fits(i + 1):
            fill[z] = 0
    leftover = dict(fill)

    def add_groups(start: int) -> None:
        for z in sizes[start:]:
            while fill[z] + dp <= count[z]:
                fill[z] += dp
                if not fits(len(sizes)):
                    fill[z] -= dp
                    break

    def rounds_length() -> int:
        return sum(-(-(count[z] - fill[z]) // dp) * z for z in sizes)

    add_groups(0)
    # Greedy largest-first can spend free shards on a large class and leave a smaller one a
    # round of its own that a better mix avoids: give back one group of a class and refill
    # the smaller classes; keep it if the rounds get shorter.
    best, improved = rounds_length(), True
    while improved:
        improved = False
        for j, z in enumerate(sizes):
            if fill[z] - dp < leftover[z]:
                continue
            saved = dict(fill)
            fill[z] -= dp
            for y in sizes[j + 1:]:
                fill[y] = leftover[y]
            add_groups(j + 1)
            if fits(len(sizes)) and rounds_length() < best:
                best, improved = rounds_length(), True
                break
            fill.update(saved)
    return frozenset(n for z in sizes if fill[z] for n in classes[z][len(classes[z]) - fill[z]:])


@dataclass
class _Packing:
    buckets: list[BucketPlan]
    placed: dict[str, tuple[int, int, int]]
    gaps: dict[str, int]
    """Padding each round leaves, keyed by the round's seed."""
    rank_cost: list[float]
    """Cost each rank carries after this buffer (earlier buffers included)."""

    @property
    def padding(self) -> int:
        return sum(self.gaps.values())


_Round = list[list[ParamSpec]]
"""A round's contents: the parameters of each shard."""


def _pack(queue: list[ParamSpec], dp: int, bucket_size: int, costs: Mapping[str, float],
          solo: tuple[str, ...], tail_start: int, initial_cost: Sequence[float] | None = None,
          reserved: frozenset[str] = frozenset()) -> _Packing:
    """One packing pass over ``queue`` (backward order); the steps are :class:`_Packer`'s.

    ``solo`` seeds get rounds filled from the tail of the queue, never from
    before position ``tail_start`` (Note [tail gaps]). ``initial_cost`` is what
    each rank carries from earlier buffers (default: nothing). ``reserved``
    parameters (see Note [leftovers]) are never peers of a seed that is not
    reserved, and when there are any, shards without a peer are filled with
    reserved parameters only, largest first.
    """
    packer = _Packer(queue, dp, bucket_size, costs, initial_cost, reserved)
    tail_rounds = packer.solo_rounds(solo, tail_start)
    for contents in packer.rounds(tail_rounds):
        packer.place(contents)
    packer.close_bucket()
    return _Packing(packer.buckets, packer.placed, packer.gaps, packer.rank_cost)


class _Packer:
    """The state of one packing pass and its steps, which :func:`_pack` runs.

    Forming a round takes its parameters out of what is still to pack
    (:meth:`take`); placing it gives its shards to ranks and appends it to the
    open bucket, which closes when full. Rounds are placed one at a time, as
    they are formed; the two sides share nothing but the rounds.
    """

    def __init__(self, queue: list[ParamSpec], dp: int, bucket_size: int, costs: Mapping[str, float],
                 initial_cost: Sequence[float] | None, reserved: frozenset[str]) -> None:
        self.queue = queue
        self.dp = dp
        self.bucket_size = bucket_size
        self.costs = costs
        self.reserved = reserved
        self.position = {s.name: i for i, s in enumerate(queue)}
        # Still to pack. Insertion order = backward order; ordered sets (dicts) per aligned
        # size make removal O(1), which keeps large models fast.
        self.pending: dict[str, ParamSpec] = {s.name: s for s in queue}
        self.by_size: dict[int, dict[str, None]] = defaultdict(dict)
        self.spare: dict[int, dict[str, None]] = defaultdict(dict)  # the reserved ones, by size
        for s in queue:
            (self.spare if s.name in reserved else self.by_size)[aligned(s.numel)][s.name] = None
        self.cursor = 0  # every parameter before queue[cursor] is packed
        # What the pass returns (see _Packing).
        self.rank_cost = [0.0] * dp if initial_cost is None else list(initial_cost)
        self.placed: dict[str, tuple[int, int, int]] = {}  # name -> (bucket, offset, owner)
        self.gaps: dict[str, int] = {}
        self.buckets: list[BucketPlan] = []
        # The open bucket.
        self.bucket_start = 0  # its offset in the buffer
        self.shard_fill = 0  # elements used in each of its shards (equal across shards)
        self.open_rounds: list[tuple[int, _Round]] = []  # (round length, contents per rank)

    # --- the queue ---------------------------------------------------------------------------------
    def take(self, name: str) -> ParamSpec:
        """Removes ``name`` from what is still to pack and returns its spec."""
        spec = self.pending.pop(name)
        size = aligned(spec.numel)
        self.by_size[size].pop(name, None)
        self.spare[size].pop(name, None)
        return spec

    def backward(self) -> Iterator[str]:
        """Names still to pack, in backward order; safe while the caller takes them.

        On the first ``next``, moves ``cursor`` past the packed start of the queue.
        """
        queue, pending = self.queue, self.pending
        cursor = self.cursor
        while cursor < len(queue) and queue[cursor].name not in pending:
            cursor += 1
        self.cursor = cursor
        for i in range(cursor, len(queue)):
            if queue[i].name in pending:
                yield queue[i].name

    def tail(self, after: int) -> list[str]:
        """Names still to pack after position ``after``, the end of the queue first."""
        position = self.position
        return [n for n in reversed(self.pending) if position[n] > after]

    # --- forming rounds ----------------------------------------------------------------------------
    def solo_rounds(self, solo: tuple[str, ...], tail_start: int) -> list[_Round]:
        """Rounds of the ``solo`` seeds, formed before all others from the tail of the queue
        (after position ``tail_start``), where they will sit. See Note [tail gaps]."""
        tail_rounds = []
        for name in solo:
            if name not in self.pending:  # already packed into an earlier solo round
                continue
            seed = self.take(name)
            contents = [[seed]]
            self.fill(seed, contents, lambda: self.tail(tail_start), tail_start)
            tail_rounds.append(contents)
        return tail_rounds

    def rounds(self, tail_rounds: list[_Round]) -> Iterator[_Round]:
        """Every round in buffer order: one per seed in backward order while parameters are
        left, then ``tail_rounds``, the first solo seed's last. See Note [backward order]."""
        while self.pending:
            yield self.seed_round()
        yield from reversed(tail_rounds)

    def seed_round(self) -> _Round:
        """The round of the next parameter in backward order: the seed, its peers, then fill.
        See Note [size matching]."""
        seed = self.take(next(self.backward()))
        contents = [[seed]]
        size = aligned(seed.numel)
        # Peers: unreserved parameters of the seed's size; a reserved seed (one no earlier
        # round had room for) also takes reserved peers, first. See Note [leftovers].
        pools = (self.spare[size], self.by_size[size]) if seed.name in self.reserved else (self.by_size[size],)
        take = self.take
        for peers in pools:
            for name in list(islice(peers, self.dp - len(contents))):
                contents.append([take(name)])
        # Shards without a peer: pack smaller parameters greedily, in backward order.
        self.fill(seed, contents, self.backward, self.position[seed.name])
        return contents

    def fill(self, seed: ParamSpec, contents: _Round, candidates: Callable[[], Iterable[str]],
             after: int) -> None:
        """Fills the shards of ``seed``'s round that have no peer and appends them to
        ``contents``; records the padding the round leaves in ``gaps``.

        With reserved parameters, only those after position ``after`` fill
        (:meth:`fill_reserved`); otherwise ``candidates`` do (:meth:`fill_greedy`).
        """
        length = aligned(seed.numel)
        free = self.dp - len(contents)
        if self.reserved:
            shards, gap = self.fill_reserved(length, free, after)
        else:
            shards, gap = self.fill_greedy(length, free, candidates)
        contents.extend(shards)
        self.gaps[seed.name] = gap

    def fill_reserved(self, length: int, free: int, after: int) -> tuple[_Round, int]:
        """``free`` shards of ``length`` elements filled with the reserved parameters after
        position ``after``: largest size class first, each class into the first shards with
        room. Returns the shards (each in backward order) and the padding they leave.
        See Note [leftovers]."""
        position, spare, take = self.position, self.spare, self.take
        rooms = [length] * free
        shards: _Round = [[] for _ in range(free)]
        for size in sorted((z for z, names in spare.items() if names and z <= length), reverse=True):
            names = [n for n in spare[size] if position[n] > after]
            k = 0
            for i in range(free):
                while k < len(names) and rooms[i] >= size:
                    shards[i].append(take(names[k]))
                    rooms[i] -= size
                    k += 1
                if k == len(names):
                    break
        for members in shards:
            members.sort(key=lambda s: position[s.name])
        return shards, sum(rooms)

    def fill_greedy(self, length: int, free: int, candidates: Callable[[], Iterable[str]]
                    ) -> tuple[_Round, int]:
        """``free`` shards of ``length`` elements, each packed with the parameters that fit,
        in the order ``candidates()`` gives afresh for each shard. Returns the shards and the
        padding they leave. See Note [size matching]."""
        pending, take = self.pending, self.take
        shards: _Round = []
        gap = 0
        for _ in range(free):
            room, members = length, []
            for name in candidates():
                need = aligned(pending[name].numel)
                if need <= room:
                    members.append(take(name))
                    room -= need
                    if room < ALIGNMENT:
                        break
            gap += room
            shards.append(members)
        return shards, gap

    # --- placing rounds ----------------------------------------------------------------------------
    def place(self, contents: _Round) -> None:
        """Adds a round to the open bucket, its shards given to ranks by :func:`_assign_round`
        (Note [owner balancing]). A round that alone exceeds the bucket size gets a bucket of
        its own; a bucket closes once it reaches the bucket size."""
        dp, costs, rank_cost = self.dp, self.costs, self.rank_cost
        length = aligned(contents[0][0].numel)  # the seed's
        if length * dp > self.bucket_size:
            self.close_bucket()  # the round alone exceeds the bucket size: a bucket of its own
        assigned = _assign_round(length, contents, rank_cost, costs, self.position)
        for rank, members in enumerate(assigned):
            rank_cost[rank] += sum(costs[s.name] for s in members)
        self.open_rounds.append((length, assigned))
        self.shard_fill += length
        if self.shard_fill * dp >= self.bucket_size:
            self.close_bucket()

    def close_bucket(self) -> None:
        """Makes the open rounds a bucket: rank ``r``'s shard holds shard ``r`` of each round,
        one round after the other, so every parameter lies inside its owner's shard
        (Note [shard alignment]). Records each parameter's (bucket, offset, owner)."""
        if not self.open_rounds:
            return
        index = len(self.buckets)
        start, shard_size, dp, placed = self.bucket_start, self.shard_fill, self.dp, self.placed
        used = [0] * dp  # elements used in each rank's shard
        names: list[tuple[int, str]] = []
        for length, contents in self.open_rounds:
            for rank, members in enumerate(contents):
                offset = start + rank * shard_size + used[rank]
                for spec in members:
                    placed[spec.name] = (index, offset, rank)
                    names.append((offset, spec.name))
                    offset += aligned(spec.numel)
                used[rank] += length
        end = start + dp * shard_size
        self.buckets.append(BucketPlan(index, start, end, dp, tuple(n for _, n in sorted(names))))
        self.bucket_start, self.shard_fill, self.open_rounds = end, 0, []


def _assign_round(length: int, contents: list[list[ParamSpec]], rank_cost: Sequence[float],
                  costs: Mapping[str, float], position: Mapping[str, int]) -> list[list[ParamSpec]]:
    """Which rank's shard holds what in one round: the contents per rank. See Note [owner balancing].

    ``contents`` are the round's shards as greedy filling packed them. A round of
    one parameter per shard only chooses ranks (costliest shard to the least
    loaded rank); a round with fuller shards is re-packed by :func:`_balance_round`.
    """
    dp = len(rank_cost)
    if any(len(members) > 1 for members in contents):
        balanced = _balance_round(length, [s for ms in contents for s in ms], rank_cost, costs, position)
        if balanced is not None:
            return balanced
    order = sorted(range(dp), key=lambda i: (-sum(costs[s.name] for s in contents[i]), i))
    ranks = sorted(range(dp), key=lambda r: (rank_cost[r], r))
    assigned: list[list[ParamSpec]] = [[] for _ in range(dp)]
    for rank, i in zip(ranks, order):
        assigned[rank] = contents[i]
    return assigned


def _balance_round(length: int, members: list[ParamSpec], rank_cost: Sequence[float],
                   costs: Mapping[str, float], position: Mapping[str, int]) -> list[list[ParamSpec]] | None:
    """Packs ``members`` into ``len(rank_cost)`` shards of ``length`` elements, costliest first,
    each to the least loaded rank with room; ``None`` if some parameter finds no room.

    A parameter as long as the whole shard takes an empty shard; a smaller one
    may open an empty shard only while enough stay empty for the whole-shard
    parameters still to come. Each shard keeps its parameters in backward order.
    """
    dp = len(rank_cost)
    whole = sum(aligned(s.numel) == length for s in members)
    room = [length] * dp
    load = list(rank_cost)
    empty = dp
    assigned: list[list[ParamSpec]] = [[] for _ in range(dp)]
    heap = [(load[r], r) for r in range(dp)]  # one entry per rank with room left
    heapq.heapify(heap)
    for spec in sorted(members, key=lambda s: (-costs[s.name], -s.numel, position[s.name])):
        need = aligned(spec.numel)
        is_whole = need == length
        whole -= is_whole
        skipped = []
        rank = None
        while heap:
            entry = heapq.heappop(heap)
            r = entry[1]
            fresh = room[r] == length
            if need <= room[r] and (not is_whole or fresh) and (is_whole or not fresh or empty > whole):
                rank = r
                break
            skipped.append(entry)
        for entry in skipped:
            heapq.heappush(heap, entry)
        if rank is None:
            return None
        empty -= room[rank] == length
        room[rank] -= need
        load[rank] += costs[spec.name]
        assigned[rank].append(spec)
        if room[rank] >= ALIGNMENT:
            heapq.heappush(heap, (load[rank], rank))
    for shard in assigned:
        shard.sort(key=lambda s: position[s.name])
    return assigned


def param_specs(module: torch.nn.Module, expert: Callable[[str, torch.nn.Parameter], bool] | None = None,
                elementwise: Callable[[str, torch.nn.Parameter], bool] | None = None) -> list[ParamSpec]:
    """Specs of ``module``'s trainable parameters in registration order (tied ones once).

    ``expert`` and ``elementwise`` are predicates on ``(name, parameter)`` that mark
    expert parameters and those whose optimizer update is element-wise.
    """
    specs = []
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        kind: Kind = "expert" if expert is not None and expert(name, p) else "dense"
        specs.append(ParamSpec(name, tuple(p.shape), p.dtype, kind,
                               elementwise=bool(elementwise is not None and elementwise(name, p))))
    return specs


def describe_layout(module: torch.nn.Module, dp: int, bucket_size: int = DEFAULT_BUCKET_SIZE,
                    cost: Callable[[ParamSpec], float] = newton_schulz_cost,
                    elementwise: Callable[[str, torch.nn.Parameter], bool] | None = None) -> str:
    """Plans ``module`` at ``dp`` ranks and returns the layout's summary (``elementwise``: which
    parameters may be split, as for :func:`param_specs`)."""
    return plan_layout(param_specs(module, elementwise=elementwise), dp, bucket_size, cost).summary()


def _main(argv: Sequence[str] | None = None) -> None:
    import argparse
    import importlib

    parser = argparse.ArgumentParser(
        prog="python -m lightning_layerwise",
        description="Print the shard-aligned layout (padding, buckets, per-rank cost) of a model.",
        epilog="Also: python -m lightning_layerwise consolidate SRC DST writes a sharded checkpoint directory "
               "as one file (for load_from_checkpoint, strategy='ddp', torch.load).",
    )
    parser.add_argument("model", nargs="?", default="examples.gpt:example_gpt",
                        help="'module:callable' returning an nn.Module when called with no "
                             "arguments (default: the example GPT; run from the repository root)")
    parser.add_argument("--dp", type=int, nargs="+", default=[1, 2, 3, 4, 8])
    parser.add_argument("--bucket-size", type=int, default=DEFAULT_BUCKET_SIZE)
    parser.add_argument("--cost", choices=["newton_schulz", "numel"], default="newton_schulz")
    parser.add_argument("--optimizer", choices=["muon", "adamw", "other"], default="muon",
                        help="which parameters element-wise fill may split, as LayerwiseStrategy decides it: the "
                             "AdamW groups of lightning_layerwise.Muon (default), every parameter (AdamW, SGD…), "
                             "or none (an optimizer not known to be element-wise, or elementwise_fill=False)")
    args = parser.parse_args(argv)
    module_name, _, attr = args.model.partition(":")
    model = getattr(importlib.import_module(module_name), attr)()
    cost_fn = newton_schulz_cost if args.cost == "newton_schulz" else numel_cost
    elementwise = None
    if args.optimizer == "muon":
        from .optim.param_groups import route_parameters

        adamw = {r.name for r in route_parameters(model) if not r.use_muon}
        elementwise = lambda name, p: name in adamw  # noqa: E731
    elif args.optimizer == "adamw":
        elementwise = lambda name, p: True  # noqa: E731
    for dp in args.dp:
        print(describe_layout(model, dp, args.bucket_size, cost_fn, elementwise))
        print()


if __name__ == "__main__":
    _main()
