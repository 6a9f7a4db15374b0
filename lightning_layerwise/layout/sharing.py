"""Owner groups sharing the stepping of each shard: :func:`share_among_replicas`
(Note [replica sharing]
    With ``dp = g * R`` ranks in ``R`` owner groups of ``g``, the layout is planned
    for ``g`` ranks (Note [owner groups] in ``engine/process_groups.py``) and the ranks at
    position ``p`` of every group (its *replicas*) hold the same shard ``p`` of every
    bucket. Each such shard is cut into ``R`` consecutive *chunks*, chunk ``k``
    stepped by replica ``k`` alone (world rank ``k * g + p``): its reduced gradient
    is reduced to it across the replicas, it runs the optimizer on the chunk only
    (Newton–Schulz once per matrix in the world, optimizer state once in the world)
    and the chunks are gathered across the replicas before the owner group
    all-gathers the shards. Two kinds of cut, each two operations per bucket across
    the groups, both of kinds NCCL runs as one collective (Note [uneven chunks] in
    ``engine/collectives.py``):

    * a shard holding only element-wise elements (the flat buckets) is cut into
      ``R`` *equal* chunks, parameters crossing a cut being stepped in pieces: one
      ``reduce_scatter_tensor`` and one ``all_gather_into_tensor``. The planner rounds
      flat shards to a multiple of ``16 R`` elements for it (Note [element-wise fill] in
      ``layout/packing.py``), so the chunks are equal and aligned; the rare element-wise shard of
      a whole-parameter bucket whose length ``R`` does not divide is stepped whole, as
      below;
    * any other shard (at scale almost always one matrix) is stepped *whole* by one
      replica, chosen by longest processing time first over all the buckets of a
      position (the cost of its matrices; its element-wise parts break ties by their
      optimizer state), improved by moves and swaps while the busiest replica is above the bound
      (:func:`_rebalance`): one rooted ``reduce`` to that replica and one ``broadcast``
      from it. Then consecutive shards of a position get different replicas where a
      swap with an identical shard allows (:func:`_rotate`), which changes no load.
      Where the busiest replica of a position stays above :data:`SPLIT_ABOVE` times the
      bound and holds a shard of several whole parameters (a bucket holding many small
      matrices), that shard is split: its parameters are balanced one by one and laid
      out again, each replica's consecutively, so a chunk is still one range (two
      operations per replica that steps some of it). Fewer, larger buckets with some
      split shards take fewer operations in all than a bucket per matrix would; at
      scale a shard is one matrix and nothing is split;
    * a shard of padding only has no chunk: nothing is sent for it.

    Only a split shard moves parameters inside it; buckets, shards and every other
    offset are the owner group's plan, so the in-group collectives are those of ``g``
    ranks. Pure and deterministic: every rank computes the same.

    Stepping whole shards instead of single matrices trades balance for operations:
    a shard holding several small matrices is stepped by one replica (two
    operations) where spreading its matrices over ``k`` replicas cost ``2 k``. At
    scale a shard is one matrix and nothing is traded (``benchmarks/layout_scale.py``
    checks the Newton–Schulz balance on published models).
"""

from __future__ import annotations

import bisect
import heapq
from collections import defaultdict
from types import MappingProxyType
from typing import Callable, Mapping, Sequence

from .plan import BucketPlan, BufferPlan, Layout, ParamSlot, ParamSpec, Piece, aligned

ELEMENTWISE_STATE = 2


"""Optimizer state of an element-wise element against a matrix element's, as replica sharing balances it:
AdamW keeps two moments where Muon keeps one momentum (Note [replica sharing])."""


def share_among_replicas(layout: Layout, specs: Sequence[ParamSpec], replicas: int,
                         expert_groups: bool = False, expert_replicas: int = 1) -> Layout:
    """``layout`` (planned for an owner group) with the stepping of its dense buffers shared among
    ``replicas`` owner groups: every element stepped by exactly one rank of the world (Note [replica sharing]).
    """
    for what, value in (("replicas", replicas), ("expert_replicas", expert_replicas)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{what}={value!r}: pass the number of owner groups, an integer >= 1.")
    if replicas == 1 and (expert_replicas == 1 or not expert_groups):
        return layout
    if layout.replicas != 1 or layout.expert_replicas != 1:
        raise ValueError(f"the layout is already shared among {layout.replicas} replicas.")
    elementwise = {s.name: s.elementwise for s in specs}
    offsets: dict[str, int] = {}
    world_pieces: dict[str, list[Piece]] = defaultdict(list)
    experts = [plan for plan in layout.buffers if plan.kind == "expert" and expert_groups]
    dense = [plan for plan in layout.buffers if not (plan.kind == "expert" and expert_groups)]
    shared: dict[int, BufferPlan] = {}
    families = ((dense, layout.group_size, replicas), (experts, experts[0].shards if experts else 1, expert_replicas))
    for plans, g, count in families:
        if plans and count > 1:
            shared.update(_share_family(layout, plans, g, count, elementwise, offsets, world_pieces))
    params = {}
    for name, slot in layout.params.items():
        if name in world_pieces:
            pieces = world_pieces[name]
            pieces = tuple(sorted(pieces, key=lambda q: q.start) if len(pieces) > 1 else pieces)
            slot = ParamSlot(name, slot.shape, slot.buffer, slot.bucket, offsets.get(name, slot.offset), pieces)
        params[name] = slot
    buffers = tuple(shared.get(plan.index, plan) for plan in layout.buffers)
    return Layout(layout.group_size, layout.bucket_size, buffers, MappingProxyType(params), layout.costs, replicas,
                  expert_replicas if experts else 1)


def _share_family(layout: Layout, plans: list[BufferPlan], g: int, replicas: int, elementwise: Mapping[str, bool],
                  offsets: dict[str, int], world_pieces: dict[str, list[Piece]]) -> dict[int, BufferPlan]:
    """The buffers ``plans`` (all planned for ``g`` ranks) shared among ``replicas`` (Note [replica sharing]);
    records the new offsets of split shards' parameters and the pieces, whose owners are
    ``replica * g + position``."""
    # Per bucket (buffer, bucket), per position: "empty", "even" (element-wise only, cut into equal chunks) or
    # "whole" (stepped by one replica, unless the balancing below splits it into its parameters).
    shards: dict[tuple[int, int], list[tuple[str, list[tuple[str, ParamSlot, Piece]]]]] = {}
    whole: list[list[tuple[tuple[int, int, int], list]]] = [[] for _ in range(g)]  # per position, bucket order
    slots = layout.params
    for plan in plans:
        for bp in plan.buckets:
            by_position: list[list[tuple[str, ParamSlot, Piece]]] = [[] for _ in range(g)]
            for name in bp.params:
                slot = slots[name]
                for piece in slot.pieces:
                    by_position[piece.owner].append((name, slot, piece))
            cuts_evenly = bp.shard_size % replicas == 0
            modes = shards[plan.index, bp.index] = []
            for p, items in enumerate(by_position):
                if not items:
                    mode = "empty"
                elif cuts_evenly and elementwise.get(items[0][0], False) \
                        and all(elementwise.get(n, False) for n, _, _ in items):
                    mode = "even"
                else:
                    mode = "whole"
                    whole[p].append(((plan.index, bp.index, p), items))
                modes.append((mode, items))

    def job(key: tuple[int, int, int], items: list[tuple[str, ParamSlot, Piece]], name: str = "") -> _Job:
        # Balanced on the matrices' cost alone (the planner's cost function, e.g. Newton–Schulz flops or seconds):
        # an element-wise parameter's cost is its element count, another unit (Note [element-wise fill] in
        # layout/packing.py); it counts in the state, the second key.
        if len(items) == 1:  # most shards at scale: one matrix
            n, _, piece = items[0]
            if elementwise.get(n, False):
                return 0, (piece.stop - piece.start) * ELEMENTWISE_STATE, (*key, name)
            return 0 + costs[n], piece.stop - piece.start, (*key, name)
        cost, state = 0, 0  # summed in item order, as sum() would
        for n, _, piece in items:
            if elementwise.get(n, False):
                state += (piece.stop - piece.start) * ELEMENTWISE_STATE
            else:
                cost += costs[n]
                state += piece.stop - piece.start
        return cost, state, (*key, name)

    # A parameter's own cost, as job(key, [item]) gives it (0 for an element-wise one), without building the jobs.
    costs = layout.costs
    every = [0 if elementwise.get(n, False) else 0 + costs[n]
             for position in whole for _, items in position for n, _, _ in items]
    floor = max([sum(every) / (g * replicas)] + every)  # no placement of whole matrices goes below
    replica_of: dict[tuple, int] = {}
    split: set[tuple[int, int, int]] = set()
    for position in whole:
        replica_of.update(_assign_position(position, job, replicas, floor, split))
    return {plan.index: _cut_buffer(layout, plan, g, shards, split, replica_of, replicas, offsets, world_pieces)
            for plan in plans}


def _cut_buffer(layout: Layout, plan: BufferPlan, g: int, shards: Mapping, split: set[tuple[int, int, int]],
                replica_of: Mapping[tuple, int], replicas: int, offsets: dict[str, int],
                world_pieces: dict[str, list[Piece]]) -> BufferPlan:
    """``plan`` with every shard cut as :func:`_share_family` decided (``shards``: each one's mode and items); records
    the pieces and the new offsets of split shards' parameters."""
    buckets = []
    for bp in plan.buckets:
        cuts, moved = [], False
        for p, (mode, items) in enumerate(shards[plan.index, bp.index]):
            if mode == "empty":  # padding only: nothing to step, nothing to send
                cuts.append(())
            elif split and (plan.index, bp.index, p) in split:
                moved = True
                cuts.append(_relay(items, {n: replica_of[plan.index, bp.index, p, n] for n, _, _ in items},
                                   bp.shard_range(p)[0], p, g, offsets, world_pieces))
            elif mode == "whole":
                k = replica_of[plan.index, bp.index, p, ""]
                owner = k * g + p
                for name, _, piece in items:
                    world_pieces[name].append(Piece(owner, piece.start, piece.stop))
                cuts.append(((k, 0),))
            else:
                cuts.append(_cut_evenly(items, bp.shard_range(p)[0], bp.shard_size // replicas, replicas, p, g,
                                        world_pieces))
        # Only a split shard moves parameters; otherwise they stay in the planner's order, which is by offset.
        params = tuple(sorted(bp.params, key=lambda n: offsets.get(n, layout.params[n].offset))) if moved \
            else bp.params
        buckets.append(BucketPlan(bp.index, bp.start, bp.end, bp.shards, params, tuple(cuts), replicas))
    return BufferPlan(plan.index, plan.dtype, plan.kind, plan.numel, tuple(buckets), plan.shards)


_Job = tuple  # (cost, state, (buffer, bucket, position, name)): a shard ("" as name) or one of its parameters

SPLIT_ABOVE = 1.05
"""A position's busiest replica above this many times the bound (Note [replica sharing]) splits its costliest shard
of several parameters into those parameters, each stepped by the replica the balancing gives it."""


def _assign_position(position: list[tuple[tuple[int, int, int], list]], job: Callable, replicas: int, floor: float,
                     split: set[tuple[int, int, int]]) -> dict[tuple, int]:
    """Replicas for one position's whole shards (Note [replica sharing]): longest processing time first, moves
    and swaps (:func:`_rebalance`), shards of several parameters split one at a time while the busiest replica
    stays above :data:`SPLIT_ABOVE` times ``floor`` and holds one, then :func:`_rotate`. Adds the split shards'
    keys to ``split``; returns the replica of every job key."""
    divisible = {key: items for key, items in position
                 if len(items) > 1 and all(piece.start == 0 and piece.stop == slot.numel for _, slot, piece in items)}
    shard_jobs = {key: job(key, items) for key, items in position}
    # The jobs in LPT order, kept sorted as shards split: a split replaces one job by its parameters' and leaves
    # every other job's place, so the jobs are costed and sorted once, not again for every split.
    order = sorted(shard_jobs.values(), key=_lpt_order)
    mine: set[tuple[int, int, int]] = set()
    while True:
        bins, loads, states = _longest_first(order, replicas)
        _rebalance(bins, loads, states, floor)
        busiest = max(range(replicas), key=lambda k: (loads[k], k))
        candidates = [j for j in bins[busiest] if j[2][3] == "" and j[2][:3] in divisible]
        if loads[busiest] <= SPLIT_ABOVE * floor or not candidates:
            break
        key = max(candidates, key=lambda j: (j[0], j[2]))[2][:3]
        mine.add(key)
        order.remove(shard_jobs[key])
        for item in divisible[key]:
            bisect.insort(order, job(key, [item], item[0]), key=_lpt_order)
    split |= mine
    replica_of = {j[2]: k for k, bin_k in enumerate(bins) for j in bin_k}
    _rotate(sorted((j for key, j in shard_jobs.items() if key not in mine), key=lambda j: j[2]), replica_of)
    return replica_of


def _lpt_order(j: _Job) -> tuple:
    """Longest processing time first: costliest, then most state, then by key (unique, so the order is total)."""
    return -j[0], -j[1], j[2]


def _longest_first(order: list[_Job], replicas: int) -> tuple[list[list[_Job]], list[float], list[int]]:
    """``order`` (in :func:`_lpt_order`) assigned longest processing time first: each job to the replica with the
    least cost so far (then the least state, then the lowest index). Returns the bins, loads and states."""
    heap = [(0.0, 0, k) for k in range(replicas)]
    bins: list[list[_Job]] = [[] for _ in range(replicas)]
    for j in order:
        cost, state, k = heapq.heappop(heap)
        bins[k].append(j)
        heapq.heappush(heap, (cost + j[0], state + j[1], k))
    loads, states = [0.0] * replicas, [0] * replicas
    for cost, state, k in heap:
        loads[k], states[k] = cost, state
    return bins, loads, states


def _relay(items: list[tuple[str, ParamSlot, Piece]], replica: Mapping[str, int], lo: int, position: int, g: int,
           offsets: dict[str, int], world_pieces: dict[str, list[Piece]]) -> tuple[tuple[int, int], ...]:
    """A split shard starting at buffer offset ``lo``: its parameters laid out again, each replica's
    consecutively, in replica order; returns ``(replica, offset)`` per replica stepping some of them."""
    starts, cursor = [], lo
    for k in sorted(set(replica.values())):
        starts.append((k, cursor - lo))
        for name, slot, _ in sorted((it for it in items if replica[it[0]] == k), key=lambda it: it[1].offset):
            offsets[name] = cursor
            world_pieces[name].append(Piece(k * g + position, 0, slot.numel))
            cursor += aligned(slot.numel)
    return tuple(starts)


def _cut_evenly(items: list[tuple[str, ParamSlot, Piece]], lo: int, chunk: int, replicas: int, position: int,
                g: int, world_pieces: dict[str, list[Piece]]) -> tuple[tuple[int, int], ...]:
    """An element-wise shard starting at buffer offset ``lo`` cut into ``replicas`` chunks of ``chunk`` elements,
    its pieces cut where the chunks meet; returns every replica's ``(replica, offset)``."""
    for name, slot, piece in items:
        begin, end = slot.offset + piece.start, slot.offset + piece.stop
        while begin < end:
            k = (begin - lo) // chunk
            stop = min(end, lo + (k + 1) * chunk)
            world_pieces[name].append(Piece(k * g + position, begin - slot.offset, stop - slot.offset))
            begin = stop
    return tuple((k, k * chunk) for k in range(replicas))


def _rotate(order: list[_Job], replica_of: dict[tuple, int], tries: int = 32) -> None:
    """Where two consecutive shards of ``order`` (one position's whole shards, in bucket order) are stepped by
    the same replica, swaps the second's replica with that of another shard of identical cost and state whose
    neighbours allow it (among the ``tries`` nearest later ones, then earlier ones): every replica keeps its
    load, and consecutive cross-group operations change root."""
    keys = [j[2] for j in order]
    alike: dict[tuple[float, int], list[int]] = defaultdict(list)
    for i, j in enumerate(order):
        alike[j[0], j[1]].append(i)

    def root(i: int) -> int | None:
        return replica_of[keys[i]] if 0 <= i < len(keys) else None

    for i in range(1, len(keys)):
        mine = root(i)
        if mine != root(i - 1):
            continue
        same = alike[order[i][0], order[i][1]]
        start = bisect.bisect_right(same, i + 1)  # later shards first, then earlier ones; never a neighbour
        for j in same[start:start + tries] + same[max(0, start - 3 - tries):max(0, start - 3)][::-1]:
            if abs(j - i) <= 1:
                continue
            theirs = root(j)
            if theirs not in (mine, root(i + 1)) and mine not in (root(j - 1), root(j + 1)):
                replica_of[keys[i]], replica_of[keys[j]] = theirs, mine
                break


def _rebalance(bins: list[list[tuple[float, int, str]]], cost: list[float], numel: list[int], floor: float,
               rounds: int = 1000) -> None:
    """Improves a longest-processing-time assignment of shards ``(cost, state, key)`` in place: while the busiest
    replica is above ``floor`` (no assignment can go below it), move one of its shards to another replica, or
    swap it for a cheaper one there, choosing the change that lowers the larger of the two loads the most.
    Candidates are taken one per distinct cost, so a stack of identical layers stays quick."""
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
