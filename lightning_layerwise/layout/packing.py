"""Packing parameters into shard-aligned buckets: :func:`plan_layout`.

Note [size matching]
    Shards of one bucket must have equal length, so the planner fills all
    ``group_size`` shards in lock-step *rounds*. A round starts with the next
    parameter in backward order (the *seed*); its length is the seed's aligned size.
    The other ``group_size - 1`` shards of the round take parameters of the same
    size (*peers*), nearest in backward order first; a stack of identical
    transformer blocks therefore packs with zero padding when ``group_size`` divides
    the number of blocks. A shard that finds no peer is filled greedily with smaller
    parameters that fit (next in backward order first), and only what is left is
    padding. Note [leftovers] decides which parameters may be peers and which are
    kept for filling.

Note [leftovers]
    Backward-order filling alone strands parameters: when a large seed's round (an untied head) fills its free
    shards with whole layers, every size class is left with a count ``group_size`` does not divide, and each
    class ends in a short round mostly of padding (Llama-3 70B at 64 ranks: 14%). So the planner also tries a
    packing by *size class* first (:func:`_reserve_leftovers`): largest class first, a class of ``c`` parameters
    needs ``c // group_size`` full rounds, and its ``c % group_size`` leftovers are *reserved* as fill if they fit
    the free shards of larger classes' short rounds (simulated first-fit decreasing); otherwise they form a
    short round whose free shards smaller classes may use. Whole groups of ``group_size`` parameters then move
    from full rounds into free shards while everything still fits.

    The packing pass then runs as before, except that a seed's peers are never reserved parameters, and shards
    without a peer are filled with reserved parameters only (those after the seed in backward order), largest
    class first, each into the first shards with room. A class's reserved ones are its *last* in backward order,
    so full rounds keep the nearest peers and bucket starts move monotonically through backward order; a
    reserved parameter no round had room for seeds a round when backward order reaches it. Both packings (each
    with its solo seeds, Note [tail gaps]) are computed and the reserved one is kept only if it pads less.

    Limit: free shards come only from rounds formed *before* the parameters in backward order, so a large
    parameter last in backward order (GPT-2's tied embedding) is reached only by its solo seed's tail fill.

Note [tail gaps]
    Greedy filling only draws on parameters *after* the seed in backward
    order, so a large parameter without peers near the end of backward (the
    token embedding, typically) would leave ``group_size - 1`` empty shards. Such a
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

    Greedy filling decides *which* parameters a round takes (and so the padding),
    but packs them first-fit, shard after shard. When a huge parameter (an
    embedding) seeds a round at large ``group_size``, the round's other shards have
    room for most of the model, and first-fit would pile it onto a few ranks. So a
    round whose shards hold several parameters is re-packed for balance: its
    parameters, costliest first, each go to the least loaded rank whose shard still
    has room (a parameter the size of the whole shard needs an empty shard, and
    enough empty shards are kept for those). Same parameters, same round length, so
    padding is unchanged. If that packing does not fit (first-fit can succeed where
    it fails), the round keeps its first-fit shards.

Note [element-wise fill]
    Whole ownership pads: a parameter owned whole needs a round of ``group_size`` shards of its size, so a model
    whose largest tensor is a large share of the whole pads most of every buffer at large ``group_size`` (Note
    [shard alignment] in ``layout/plan.py``). Parameters whose update is element-wise (``ParamSpec.elementwise``:
    Muon's AdamW groups, AdamW, SGD...) need no whole tensor, so the planner places them after the whole ones:

    1. *Pour*: largest first, each goes whole into the smallest gap a whole-parameter bucket left that holds it,
       only into a bucket whose last parameter in backward order comes at or after it (no bucket completes later).
    2. *Flat buckets*: the rest are laid back to back in backward order (each on a 64-element boundary) into
       buckets of ``bucket_size`` elements, rounded up to a multiple of ``group_size * 64`` (``group_size *
       lcm(64, 16 R)`` with ``R`` owner groups: Note [replica sharing] in ``layout/sharing.py``) and split into
       ``group_size`` equal shards, as ZeRO-1 splits its buffer. A parameter crossing a shard boundary is split:
       its :class:`Piece` on each rank is the part inside that rank's shard, which that rank steps (Note
       [pieces] in ``engine/data_parallel.py``). With ``follow_layers`` a flat bucket also closes where a layer
       ends (Note [flat layers] in ``layout/flat.py``).

    The planner also packs the element-wise parameters owned whole (as peers and fill of rounds) and keeps that
    layout when its buffer is smaller. Every element is stepped by exactly one rank, every piece lies inside its
    owner's shard, and a parameter that is not element-wise never crosses a shard boundary. An element-wise
    parameter's cost is its element count (a piece costs its share). The flat buckets follow all whole buckets in
    the buffer; the wrapper orders collectives by each bucket's first parameter, so that changes only when a flat
    bucket's reduce-scatter can start, never correctness.

Note [backward order]
    Gradients become ready in roughly reverse registration order, so buffers
    are filled from the last registered parameter to the first and buckets are
    numbered in that order: bucket 0 completes first in backward and its
    reduce-scatter can start while the rest of backward runs. Forward needs the
    buckets in the opposite order (highest index first), which is the order
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import heapq
import math
from collections import defaultdict
from dataclasses import dataclass
from itertools import islice
from types import MappingProxyType
from typing import Callable, Iterable, Iterator, Mapping, Sequence

import torch

from .plan import (ALIGNMENT, DEFAULT_BUCKET_SIZE, BucketPlan, BufferPlan, Layout, ParamSlot, ParamSpec, Piece, aligned,
                   is_bucket_size, newton_schulz_cost, numel_cost)
from .flat import CHUNK_ALIGNMENT, plan_flat
from .sharing import share_among_replicas


def _validate(specs: Sequence[ParamSpec], ranks: int, bucket_size: int, what: str = "group_size") -> None:
    """``what``: the name ``ranks`` has for the caller (``group_size``: the ranks a plan is made for; ``dp``: the
    data-parallel size an owner group size is chosen in)."""
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"{what}={ranks!r} is not a valid number of ranks; pass an integer >= 1.")
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
    group_size: int,
    bucket_size: int = DEFAULT_BUCKET_SIZE,
    cost: Callable[[ParamSpec], float] = newton_schulz_cost,
    expert_group_size: int | None = None,
    replicas: int = 1,
    expert_replicas: int = 1,
    *,
    follow_layers: bool = False,
) -> Layout:
    """Plans buffers, buckets, shards and owners for ``specs`` given in registration order, for an owner group of
    ``group_size`` ranks (the whole data-parallel group without owner groups).

    See the notes in this module's docstring for the guarantees. ``cost`` weighs
    the parameters owned whole; an element-wise one costs its element count.
    ``expert_group_size``: plan ``kind="expert"`` buffers for this many ranks (the expert
    data-parallel group, Note [expert parallelism] in ``engine/process_groups.py``)
    instead of ``group_size``; owner indices in those buffers are positions in that group.
    ``replicas``: the data-parallel group has ``group_size * replicas`` ranks, and the dense buffers' stepping
    is shared among the ``replicas`` owner groups (:func:`share_among_replicas`); ``expert_replicas``: the
    same for the expert buffers, ``expert_group_size`` then being the size of an owner group of the expert
    data-parallel group.
    """
    with _without_cycle_collection():
        return _plan_layout(list(specs), group_size, bucket_size, cost, expert_group_size, replicas,
                            expert_replicas, follow_layers)


def _plan_layout(specs: list[ParamSpec], group_size: int, bucket_size: int, cost: Callable[[ParamSpec], float],
                 expert_group_size: int | None, replicas: int, expert_replicas: int,
                 follow_layers: bool = False) -> Layout:
    _validate(specs, group_size, bucket_size)
    experts = expert_group_size
    if experts is not None and (isinstance(experts, bool) or not isinstance(experts, int) or experts < 1):
        raise ValueError(f"expert_group_size={experts!r} is not a valid number of ranks; pass an integer >= 1.")
    costs = {s.name: float(numel_cost(s) if s.elementwise else cost(s)) for s in specs}

    # One buffer per (dtype, kind), in order of first appearance.
    groups: dict[tuple[torch.dtype, str], list[ParamSpec]] = {}
    for spec in specs:
        groups.setdefault((spec.dtype, spec.kind), []).append(spec)

    buffers: list[BufferPlan] = []
    slots: dict[str, ParamSlot] = {}
    rank_costs: dict[int, list[float]] = {}  # per group size, carried across buffers (Note [owner balancing])
    for buffer_index, ((dtype, kind), members) in enumerate(groups.items()):
        expert_family = kind == "expert" and expert_group_size is not None
        ranks = expert_group_size if expert_family else group_size
        queue = list(reversed(members))  # backward order
        rank_cost = rank_costs.get(ranks, [0.0] * ranks)
        buckets, located, pieces, rank_costs[ranks] = _plan_buffer_with_fill(
            queue, ranks, bucket_size, costs, rank_cost, expert_replicas if expert_family else replicas, follow_layers)
        by_name = {s.name: s for s in members}
        for name, (bucket_index, offset) in located.items():
            slots[name] = ParamSlot(name, by_name[name].shape, buffer_index, bucket_index, offset, pieces[name])
        numel = buckets[-1].end if buckets else 0
        buffers.append(BufferPlan(buffer_index, dtype, kind, numel, tuple(buckets), ranks))

    ordered = {s.name: slots[s.name] for s in specs}
    layout = Layout(group_size, bucket_size, tuple(buffers), MappingProxyType(ordered), MappingProxyType(costs))
    return share_among_replicas(layout, specs, replicas, expert_groups=expert_group_size is not None,
                                expert_replicas=expert_replicas)


def _plan_buffer_with_fill(queue: list[ParamSpec], group_size: int, bucket_size: int, costs: Mapping[str, float],
                           rank_cost: list[float], replicas: int = 1, follow_layers: bool = False):
    """One buffer (``queue`` in backward order): whole parameters packed, element-wise ones poured
    into the gaps and the rest in flat buckets (Note [element-wise fill]). Returns the buckets, per
    name ``(bucket, offset)`` and pieces, and the rank costs after this buffer. ``replicas``: the owner
    groups that will share the buffer's stepping (Note [replica sharing] in ``layout/sharing.py``), so that
    each flat shard splits into that many equal aligned chunks.

    Packing the element-wise parameters whole, as peers and fill of the rounds, sometimes pads
    less (an embedding as large as the MLP matrices is their peer); both are planned and the one
    with the smaller buffer is kept, the split one on a tie.
    """
    def plan(whole: list[ParamSpec], elementwise: list[ParamSpec]):
        cost = list(rank_cost)
        buckets, placed, cost = _plan_buffer(whole, group_size, bucket_size, costs, cost) if whole else ([], {}, cost)
        numel = {s.name: s.numel for s in queue}
        pieces = {name: (Piece(owner, 0, numel[name]),) for name, (_, _, owner) in placed.items()}
        located = {name: (bucket, offset) for name, (bucket, offset, _) in placed.items()}
        if elementwise:
            buckets, rest = _pour(buckets, elementwise, queue, located, pieces, cost, costs)
            start = buckets[-1].end if buckets else 0
            buckets = buckets + plan_flat(rest, group_size, bucket_size, start, len(buckets), located, pieces, cost,
                                          costs, replicas, follow_layers)
        return buckets, located, pieces, cost

    elementwise = [s for s in queue if s.elementwise]
    filled = plan([s for s in queue if not s.elementwise], elementwise)
    if not elementwise or group_size == 1:
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
        for rank in range(b.shards):
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
    poured = [BucketPlan(b.index, b.start, b.end, b.shards,
                         tuple(sorted(b.params + tuple(added[b.index]), key=lambda n: located[n][1])))
              if added[b.index] else b for b in buckets]
    return poured, rest


def _plan_buffer(
    queue: list[ParamSpec], group_size: int, bucket_size: int, costs: Mapping[str, float], rank_cost: Sequence[float]
) -> tuple[list[BucketPlan], dict[str, tuple[int, int, int]], list[float]]:
    """Packs one buffer; ``queue`` is in backward order. See Note [tail gaps].

    ``rank_cost`` is the cost each rank already carries from earlier buffers.
    Returns the buckets, per parameter name (bucket, offset, owner), and the
    rank costs including this buffer.
    """
    best = _search(queue, group_size, bucket_size, costs, rank_cost, frozenset())
    # Note [leftovers]: the same search with size-class leftovers reserved as fill; kept only if
    # it pads less.
    reserved = _reserve_leftovers(queue, group_size)
    if reserved:
        candidate = _search(queue, group_size, bucket_size, costs, rank_cost, reserved)
        if candidate.padding < best.padding:
            best = candidate
    return best.buckets, best.placed, best.rank_cost


def _search(queue: list[ParamSpec], group_size: int, bucket_size: int, costs: Mapping[str, float],
            rank_cost: Sequence[float], reserved: frozenset[str]) -> _Packing:
    """One packing pass, then solo seeds one by one while total padding drops. See Note [tail gaps]."""
    position = {s.name: i for i, s in enumerate(queue)}
    solo: tuple[str, ...] = ()
    best = _pack(queue, group_size, bucket_size, costs, solo, len(queue), rank_cost, reserved)
    for _ in range(_MAX_SOLO_SEEDS):
        # Only seeds inside the last bucket, after its first parameter, may move to the tail.
        tail_start = min(position[n] for n in best.buckets[-1].params)
        seed, gap = max(((n, g) for n, g in best.gaps.items() if n not in solo and position[n] > tail_start
                         and best.placed[n][0] == len(best.buckets) - 1),
                        key=lambda kv: kv[1], default=(None, 0))
        if seed is None or gap == 0:
            break
        candidate = _pack(queue, group_size, bucket_size, costs, solo + (seed,), tail_start, rank_cost, reserved)
        if candidate.padding >= best.padding:
            break
        best, solo = candidate, solo + (seed,)
    return best


_MAX_SOLO_SEEDS = 8


def _fill_fits(sizes: list[int], count: Mapping[int, int], fill: Mapping[int, int], group_size: int) -> bool:
    """Whether ``fill[z]`` parameters of each size class ``z`` in ``sizes`` (largest first) fit into the free
    shards of the short rounds before them, packed first shard first (Note [leftovers])."""
    bins: list[list[int]] = []  # [room, number of shards with that room], in order of creation
    for z in sizes:
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
        short = (count[z] - fill[z]) % group_size
        if short:
            bins.append([z, group_size - short])
    return True


def _reserve_leftovers(queue: list[ParamSpec], group_size: int) -> frozenset[str]:
    """Which parameters to keep out of rounds of their own and use as fill. See Note [leftovers].

    Simulates rounds by size class, largest first: a class of ``c`` parameters
    makes ``c // group_size`` full rounds, and its ``c % group_size`` leftovers either fit into
    the free shards of larger classes' short rounds or form a short round whose
    free shards smaller classes can use. Then, largest class first, whole
    groups of ``group_size`` are moved from full rounds into free shards while
    everything still fits. Returns the reserved names: per class, the last ones
    in backward order.
    """
    if group_size == 1:
        return frozenset()
    classes: dict[int, list[str]] = defaultdict(list)
    for s in queue:
        classes[aligned(s.numel)].append(s.name)
    sizes = sorted(classes, reverse=True)
    count = {z: len(classes[z]) for z in sizes}
    fill = {z: 0 for z in sizes}

    def fits(upto: int) -> bool:
        return _fill_fits(sizes[:upto], count, fill, group_size)

    for i, z in enumerate(sizes):
        fill[z] = count[z] % group_size
        if not fits(i + 1):
            fill[z] = 0
    leftover = dict(fill)

    def add_groups(start: int) -> None:
        for z in sizes[start:]:
            while fill[z] + group_size <= count[z]:
                fill[z] += group_size
                if not fits(len(sizes)):
                    fill[z] -= group_size
                    break

    def rounds_length() -> int:
        return sum(-(-(count[z] - fill[z]) // group_size) * z for z in sizes)

    add_groups(0)
    # Greedy largest-first can spend free shards on a large class and leave a smaller one a
    # round of its own that a better mix avoids: give back one group of a class and refill
    # the smaller classes; keep it if the rounds get shorter.
    best, improved = rounds_length(), True
    while improved:
        improved = False
        for j, z in enumerate(sizes):
            if fill[z] - group_size < leftover[z]:
                continue
            saved = dict(fill)
            fill[z] -= group_size
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


def _pack(queue: list[ParamSpec], group_size: int, bucket_size: int, costs: Mapping[str, float],
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
    packer = _Packer(queue, group_size, bucket_size, costs, initial_cost, reserved)
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

    def __init__(self, queue: list[ParamSpec], group_size: int, bucket_size: int, costs: Mapping[str, float],
                 initial_cost: Sequence[float] | None, reserved: frozenset[str]) -> None:
        self._queue = queue
        self._group_size = group_size
        self._bucket_size = bucket_size
        self._costs = costs
        self._reserved = reserved
        self._position = {s.name: i for i, s in enumerate(queue)}
        # Still to pack. Insertion order = backward order; ordered sets (dicts) per aligned
        # size make removal O(1), which keeps large models fast.
        self._pending: dict[str, ParamSpec] = {s.name: s for s in queue}
        self._by_size: dict[int, dict[str, None]] = defaultdict(dict)
        self._spare: dict[int, dict[str, None]] = defaultdict(dict)  # the reserved ones, by size
        self._holes: dict[tuple[bool, int], int] = {}  # names taken from each pool since it was last compacted
        for s in queue:
            (self._spare if s.name in reserved else self._by_size)[aligned(s.numel)][s.name] = None
        self._cursor = 0  # every parameter before queue[cursor] is packed
        # What the pass returns (see _Packing).
        self.rank_cost = [0.0] * group_size if initial_cost is None else list(initial_cost)
        self.placed: dict[str, tuple[int, int, int]] = {}  # name -> (bucket, offset, owner)
        self.gaps: dict[str, int] = {}
        self.buckets: list[BucketPlan] = []
        # The open bucket.
        self._bucket_start = 0  # its offset in the buffer
        self._shard_fill = 0  # elements used in each of its shards (equal across shards)
        self._open_rounds: list[tuple[int, _Round]] = []  # (round length, contents per rank)

    # --- the queue ---------------------------------------------------------------------------------
    def take(self, name: str) -> ParamSpec:
        """Removes ``name`` from what is still to pack and returns its spec."""
        spec = self._pending.pop(name)
        size = aligned(spec.numel)
        key = (name in self._reserved, size)
        pools = self._spare if key[0] else self._by_size
        pool = pools[size]
        del pool[name]
        # A deleted key leaves a hole that iterating the dict walks over again, and peers are read from the front
        # of their pool every round: a pool compacted once its holes outnumber its names stays linear in its size.
        holes = self._holes[key] = self._holes.get(key, 0) + 1
        if holes > len(pool):
            pools[size] = dict(pool)
            self._holes[key] = 0
        return spec

    def first(self) -> str:
        """The next name still to pack in backward order (the first of :meth:`backward`), without a generator:
        one is asked for every round."""
        queue, pending = self._queue, self._pending
        cursor = self._cursor
        while queue[cursor].name not in pending:
            cursor += 1
        self._cursor = cursor
        return queue[cursor].name

    def backward(self) -> Iterator[str]:
        """Names still to pack, in backward order; safe while the caller takes them.

        On the first ``next``, moves ``_cursor`` past the packed start of the queue.
        """
        queue, pending = self._queue, self._pending
        cursor = self._cursor
        while cursor < len(queue) and queue[cursor].name not in pending:
            cursor += 1
        self._cursor = cursor
        for i in range(cursor, len(queue)):
            if queue[i].name in pending:
                yield queue[i].name

    def tail(self, after: int) -> list[str]:
        """Names still to pack after position ``after``, the end of the queue first."""
        position = self._position
        return [n for n in reversed(self._pending) if position[n] > after]

    # --- forming rounds ----------------------------------------------------------------------------
    def solo_rounds(self, solo: tuple[str, ...], tail_start: int) -> list[_Round]:
        """Rounds of the ``solo`` seeds, formed before all others from the tail of the queue
        (after position ``tail_start``), where they will sit. See Note [tail gaps]."""
        tail_rounds = []
        for name in solo:
            if name not in self._pending:  # already packed into an earlier solo round
                continue
            seed = self.take(name)
            contents = [[seed]]
            self.fill(seed, contents, lambda: self.tail(tail_start), tail_start)
            tail_rounds.append(contents)
        return tail_rounds

    def rounds(self, tail_rounds: list[_Round]) -> Iterator[_Round]:
        """Every round in buffer order: one per seed in backward order while parameters are
        left, then ``tail_rounds``, the first solo seed's last. See Note [backward order]."""
        while self._pending:
            yield self.seed_round()
        yield from reversed(tail_rounds)

    def seed_round(self) -> _Round:
        """The round of the next parameter in backward order: the seed, its peers, then fill.
        See Note [size matching]."""
        seed = self.take(self.first())
        contents = [[seed]]
        size = aligned(seed.numel)
        # Peers: unreserved parameters of the seed's size; a reserved seed (one no earlier
        # round had room for) also takes reserved peers, first. See Note [leftovers].
        pools = (self._spare[size], self._by_size[size]) if seed.name in self._reserved else (self._by_size[size],)
        take = self.take
        for peers in pools:
            for name in list(islice(peers, self._group_size - len(contents))):
                contents.append([take(name)])
        # Shards without a peer: pack smaller parameters greedily, in backward order.
        self.fill(seed, contents, self.backward, self._position[seed.name])
        return contents

    def fill(self, seed: ParamSpec, contents: _Round, candidates: Callable[[], Iterable[str]],
             after: int) -> None:
        """Fills the shards of ``seed``'s round that have no peer and appends them to
        ``contents``; records the padding the round leaves in ``gaps``.

        With reserved parameters, only those after position ``after`` fill
        (:meth:`fill_reserved`); otherwise ``candidates`` do (:meth:`fill_greedy`).
        """
        length = aligned(seed.numel)
        free = self._group_size - len(contents)
        if free == 0:  # every shard has a peer (most rounds at scale): nothing to fill, nothing to scan
            self.gaps[seed.name] = 0
            return
        if self._reserved:
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
        position, spare, take = self._position, self._spare, self.take
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
        pending, take = self._pending, self.take
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
        group_size, costs, rank_cost = self._group_size, self._costs, self.rank_cost
        length = aligned(contents[0][0].numel)  # the seed's
        if length * group_size > self._bucket_size:
            self.close_bucket()  # the round alone exceeds the bucket size: a bucket of its own
        assigned, shard_cost = _assign_round(length, contents, rank_cost, costs, self._position)
        for rank, cost in enumerate(shard_cost):
            rank_cost[rank] += cost
        self._open_rounds.append((length, assigned))
        self._shard_fill += length
        if self._shard_fill * group_size >= self._bucket_size:
            self.close_bucket()

    def close_bucket(self) -> None:
        """Makes the open rounds a bucket: rank ``r``'s shard holds shard ``r`` of each round,
        one round after the other, so every parameter lies inside its owner's shard
        (Note [shard alignment] in ``layout/plan.py``). Records each parameter's (bucket, offset, owner)."""
        if not self._open_rounds:
            return
        index = len(self.buckets)
        start, shard_size, group_size, placed = self._bucket_start, self._shard_fill, self._group_size, self.placed
        used = [0] * group_size  # elements used in each rank's shard
        names: list[tuple[int, str]] = []
        for length, contents in self._open_rounds:
            for rank, members in enumerate(contents):
                offset = start + rank * shard_size + used[rank]
                for spec in members:
                    placed[spec.name] = (index, offset, rank)
                    names.append((offset, spec.name))
                    offset += aligned(spec.numel)
                used[rank] += length
        end = start + group_size * shard_size
        self.buckets.append(BucketPlan(index, start, end, group_size, tuple(n for _, n in sorted(names))))
        self._bucket_start, self._shard_fill, self._open_rounds = end, 0, []


def _assign_round(length: int, contents: list[list[ParamSpec]], rank_cost: Sequence[float],
                  costs: Mapping[str, float], position: Mapping[str, int]) -> tuple[list[list[ParamSpec]], list[float]]:
    """Which rank's shard holds what in one round: the contents per rank, and the cost of each rank's contents.
    See Note [owner balancing].

    ``contents`` are the round's shards as greedy filling packed them. A round of
    one parameter per shard only chooses ranks (costliest shard to the least
    loaded rank); a round with fuller shards is re-packed by :func:`_balance_round`.
    """
    group_size = len(rank_cost)
    if any(len(members) > 1 for members in contents):
        balanced = _balance_round(length, [s for ms in contents for s in ms], rank_cost, costs, position)
        if balanced is not None:
            return balanced, [sum(costs[s.name] for s in members) for members in balanced]
    shard_cost = [sum(costs[s.name] for s in members) for members in contents]
    order = sorted(range(group_size), key=lambda i: (-shard_cost[i], i))
    ranks = sorted(range(group_size), key=lambda r: (rank_cost[r], r))
    assigned: list[list[ParamSpec]] = [[] for _ in range(group_size)]
    assigned_cost = [0.0] * group_size
    for rank, i in zip(ranks, order):
        assigned[rank], assigned_cost[rank] = contents[i], shard_cost[i]
    return assigned, assigned_cost


def _balance_round(length: int, members: list[ParamSpec], rank_cost: Sequence[float],
                   costs: Mapping[str, float], position: Mapping[str, int]) -> list[list[ParamSpec]] | None:
    """Packs ``members`` into ``len(rank_cost)`` shards of ``length`` elements, costliest first,
    each to the least loaded rank with room; ``None`` if some parameter finds no room.

    A parameter as long as the whole shard takes an empty shard; a smaller one
    may open an empty shard only while enough stay empty for the whole-shard
    parameters still to come. Each shard keeps its parameters in backward order.
    """
    group_size = len(rank_cost)
    whole = sum(aligned(s.numel) == length for s in members)
    room = [length] * group_size
    load = list(rank_cost)
    empty = group_size
    assigned: list[list[ParamSpec]] = [[] for _ in range(group_size)]
    heap = [(load[r], r) for r in range(group_size)]  # one entry per rank with room left
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
