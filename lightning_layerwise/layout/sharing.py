"""Owner groups sharing the stepping of each shard: :func:`share_among_replicas`
(Note [replica sharing] on that function).

Note [replica sharing]
    With ``dp = g * R`` ranks in ``R`` owner groups of ``g``, the layout is planned
    for ``g`` ranks (Note [owner groups] in ``engine/process_groups.py``) and the ranks at
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

from __future__ import annotations

import heapq
from collections import defaultdict
from types import MappingProxyType
from typing import Mapping, Sequence

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
    numel = {s.name: s.numel for s in specs}
    offsets: dict[str, int] = {}
    world_pieces: dict[str, list[Piece]] = defaultdict(list)
    experts = [plan for plan in layout.buffers if plan.kind == "expert" and expert_groups]
    dense = [plan for plan in layout.buffers if not (plan.kind == "expert" and expert_groups)]
    shared: dict[int, BufferPlan] = {}
    families = ((dense, layout.group_size, replicas), (experts, experts[0].shards if experts else 1, expert_replicas))
    for plans, g, count in families:
        if plans and count > 1:
            shared.update(_share_family(layout, plans, g, count, elementwise, numel, offsets, world_pieces))
    params = {}
    for name, slot in layout.params.items():
        if name in world_pieces:
            pieces = tuple(sorted(world_pieces[name], key=lambda q: q.start))
            slot = ParamSlot(name, slot.shape, slot.buffer, slot.bucket, offsets.get(name, slot.offset), pieces)
        params[name] = slot
    buffers = tuple(shared.get(plan.index, plan) for plan in layout.buffers)
    return Layout(layout.group_size, layout.bucket_size, buffers, MappingProxyType(params), layout.costs, replicas,
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
            buckets.append(BucketPlan(bp.index, bp.start, bp.end, bp.shards, params, cuts, replicas))
        out[plan.index] = BufferPlan(plan.index, plan.dtype, plan.kind, plan.numel, tuple(buckets), plan.shards)
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
