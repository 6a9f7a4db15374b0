"""Every collective one training step issues across owner groups, recorded at 6 ranks as 3 groups of 2 and at 8 as
4 groups of 2 (Note [replica sharing] in ``layout/sharing.py``, Note [uneven chunks] in ``engine/collectives.py``).

The example GPT with Muon (matrices) and AdamW (the rest, element-wise fill on) in small buckets, so that there are
shards of whole parameters and flat shards of element-wise pieces. In each worker the collectives of
``torch.distributed`` are wrapped to record the operation, its group and its tensors' sizes for two optimizer steps
(after the set-up's broadcasts), once with every collective up to ``LATE_MS`` late (the timing fuzzer). Checked
against the buckets' chunks:

* no list-form reduce-scatter or all-gather on any group;
* across the owner groups, per bucket at most two operations: a shard one replica steps whole is one rooted reduce
  and one broadcast, a flat shard one reduce-scatter and one all-gather of equal chunks, a padding-only shard
  nothing;
* the elements moved across the groups: each non-empty shard twice (reduced, then gathered), nothing more.

A mutation that puts the list form back fails the first check. Parity of these steps with one process is the
replica-sharing tests' (``test_elementwise_fill.py``, ``test_sharded_parameters.py``, ``test_trainer.py``).

Two tests of when they go out: each step's first cross-group reduce is issued while the backward still runs
(Note [replica reduce in backward] in ``engine/grad_sync.py``), and after the step the cross-group all-gathers
follow the forward order within the prefetch window (Note [cross-group gathers] in ``engine/param_sync.py``);
a mutation that restores the old timing fails each.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import lightning_layerwise as llw
from _dist import LATE_MS, run_distributed
from lightning_layerwise.engine import collectives

STEPS = 2
GROUP = 2  # ranks per owner group
VOCAB, BLOCK = 48, 8


def _gpt_session(n_layer: int, **config):
    """The example GPT (same start on every rank), Muon and AdamW, owner groups of ``GROUP``, small buckets."""
    from gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB, block_size=BLOCK, n_layer=n_layer, n_head=2, n_embd=32))
    session = llw.LayerwiseSession(llw.LayerwiseConfig(bucket_size=4000, owner_group_size=GROUP, **config))
    optimizer = llw.Muon(llw.muon_param_groups(model), lr=0.02, adamw_lr=1e-3, ns_dtype=torch.float32)
    return model, session, optimizer, session.wrap(model, optimizer)


def _backward(session, wrapped, g: torch.Generator) -> torch.Tensor:
    """One micro-batch of this rank's tokens through forward and backward; returns the tokens."""
    idx = torch.randint(0, VOCAB, (2, BLOCK), generator=g)
    logits, _ = wrapped(idx)
    session.backward(F.cross_entropy(logits.reshape(-1, VOCAB), idx.reshape(-1)))
    return idx


def _record(log: list) -> None:
    """Wraps the collectives the package calls so that each call appends (op, group ranks, sizes, list form)."""
    def wrap(name, fn, sizes_of, listed):
        def recorded(*args, **kwargs):
            group = kwargs.get("group")
            ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(
                range(dist.get_world_size()))
            log.append((name, ranks, sizes_of(*args, **kwargs), listed))
            return fn(*args, **kwargs)
        return recorded

    def first(*args, **kwargs):
        return [args[0].numel()]

    def listed(position):
        return lambda *args, **kwargs: [t.numel() for t in args[position]]

    dist.reduce = wrap("reduce", dist.reduce, first, False)
    dist.broadcast = wrap("broadcast", dist.broadcast, first, False)
    dist.reduce_scatter = wrap("reduce_scatter", dist.reduce_scatter, listed(1), True)
    dist.all_gather = wrap("all_gather", dist.all_gather, listed(0), True)
    collectives._reduce_scatter_single = wrap("reduce_scatter_single", collectives._reduce_scatter_single,
                                              lambda *a, **k: [a[1].numel()], False)
    collectives._all_gather_single = wrap("all_gather_single", collectives._all_gather_single,
                                          lambda *a, **k: [a[0].numel()], False)


def _list_form_chunks(tensor, ranges, group, async_op=True, average=False):
    """The mutation: the chunks through the list form again (NCCL: one rooted reduce per replica)."""
    rank = dist.get_rank(group)
    mine = tensor[ranges[rank][0]:ranges[rank][1]]
    work = dist.reduce_scatter(mine, [tensor[a:b] for a, b in ranges], group=group, async_op=async_op)
    return collectives.Collective(mine, work if async_op else None,
                                  divide_by=dist.get_world_size(group) if average else None)


def _worker(rank, world, mutation):
    if mutation == "list-form":
        collectives.reduce_scatter_chunks = _list_form_chunks
    model, session, optimizer, wrapped = _gpt_session(2)
    log: list = []
    _record(log)
    g = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        _backward(session, wrapped, g)
        session.step(optimizer)
        optimizer.zero_grad()
    session.sync_parameters()
    # Per bucket with chunks: how its shard is cut (sizes of the non-empty chunks) and its length.
    cuts = [([b - a for a, b in bucket.chunks if b > a], bucket.shard[1] - bucket.shard[0])
            for bucket in wrapped.buckets if bucket.chunks is not None]
    session.release()
    return log, cuts


def _expected_ops(sizes: list[int], replicas: int) -> dict[str, int]:
    """The cross-group operations of one step for a shard whose non-empty chunks have ``sizes``."""
    if not sizes:
        return {}
    if len(sizes) == 1:
        return {"reduce": 1, "broadcast": 1}
    if len(sizes) == replicas and len(set(sizes)) == 1:
        return {"reduce_scatter_single": 1, "all_gather_single": 1}
    return {"reduce": len(sizes), "broadcast": len(sizes)}


@pytest.mark.parametrize("world, mutation, late", [(6, None, None), (6, None, LATE_MS), (8, None, None),
                                                  (6, "list-form", None)])
def test_across_owner_groups_each_bucket_is_two_operations_nccl_runs_whole(world, mutation, late):
    """Each shard one replica steps whole: one rooted reduce and one broadcast; each flat (element-wise) shard: one
    reduce-scatter and one all-gather of equal chunks; a padding-only shard: nothing. No list form anywhere, and
    exactly the shard's elements moved, twice (reduced, then gathered)."""
    replicas = world // GROUP
    listed_across = []
    for rank, (log, cuts) in enumerate(run_distributed(_worker, world, mutation, timeout=400, late_ms=late)):
        across = [(op, sizes) for op, ranks, sizes, _ in log if len({r // GROUP for r in ranks}) > 1]
        listed_across += [(rank, op, sizes) for op, _, sizes, listed in log if listed]
        if mutation is not None:
            continue
        # The model has both kinds of shards on every rank, and no shard needs more than two operations.
        assert any(len(sizes) == 1 for sizes, _ in cuts) and any(len(sizes) == replicas for sizes, _ in cuts), cuts
        assert all(len(sizes) in (0, 1, replicas) for sizes, _ in cuts), cuts
        expected: dict[str, int] = {}
        for sizes, _ in cuts:
            for op, n in _expected_ops(sizes, replicas).items():
                expected[op] = expected.get(op, 0) + STEPS * n
        ops = {op: sum(1 for o, _ in across if o == op) for op, _ in across}
        assert ops == expected, (rank, ops, expected)
        moved = sum(sizes[0] for _, sizes in across)
        assert moved == 2 * STEPS * sum(length for sizes, length in cuts if sizes), (rank, moved, cuts)
        print(f"rank {rank}: {len(cuts)} buckets across {replicas} groups, per step {sum(expected.values()) // STEPS} "
              f"operations and {moved // STEPS} elements")
    if mutation is None:
        assert not listed_across, listed_across[:3]
    else:
        assert listed_across, "the list form went unnoticed: the test cannot fail"


# --- the cross-group reduce during the backward (Note [replica reduce in backward] in engine/grad_sync.py) -----------

def _order_worker(rank, world, mutation):
    """The order in which one step issues its in-group reduce-scatters and cross-group reduces, as the buckets
    call them (before any timing fuzzer delays the collective itself)."""
    from lightning_layerwise.engine import buffers, grad_sync

    if mutation == "at-the-end":
        grad_sync.GradientSync._start_replica_reduce = lambda self, bucket: None
    model, session, optimizer, wrapped = _gpt_session(3)
    order: list[str] = []
    in_group, across = buffers.BucketGradient.start_reduce, buffers.BucketGradient.start_replica_reduce
    buffers.BucketGradient.start_reduce = lambda self: (order.append("in-group"), in_group(self))[1]
    buffers.BucketGradient.start_replica_reduce = lambda self: (order.append("across"), across(self))[1]
    g = torch.Generator().manual_seed(rank)
    steps = []
    for _ in range(STEPS):
        order.clear()
        _backward(session, wrapped, g)
        session.step(optimizer)
        optimizer.zero_grad()
        steps.append(list(order))
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    session.release()
    return steps, params


@pytest.mark.parametrize("late, mutation", [(None, None), (LATE_MS, None), (None, "at-the-end")])
def test_the_cross_group_reduce_starts_while_the_backward_runs(late, mutation):
    """At 6 ranks as 3 groups of 2, each step's first cross-group reduce is issued before its last in-group
    reduce-scatter, with and without the timing fuzzer; the parameters are those of issuing every cross-group
    reduce at the end of the backward (the mutation), bit for bit. The mutation fails the order check."""
    results = run_distributed(_order_worker, 6, mutation, late_ms=late)
    reference = None if mutation is not None else run_distributed(_order_worker, 6, "at-the-end")
    for rank, (steps, params) in enumerate(results):
        for order in steps:
            assert order.count("across") >= 2 and order.count("in-group") >= 3, order
            early = order.index("across") < len(order) - 1 - order[::-1].index("in-group")
            assert early == (mutation is None), (rank, order)
        if reference is not None:
            for name, value in params.items():
                assert torch.equal(value, reference[rank][1][name]), (rank, name)


# --- the cross-group gathers after the step (Note [cross-group gathers] in engine/param_sync.py) --------------------

DEPTH = 1


def _gather_worker(rank, world, mutation):
    from lightning_layerwise.engine import buffers

    from lightning_layerwise.engine.param_sync import ParameterSync

    if mutation == "all-at-the-step":  # every bucket's cross-group gather dispatched at the step, as before
        start = ParameterSync.start

        def start_all(self, buckets=None, force_sync=False):
            start(self, buckets, force_sync)
            self._dispatch_replica_gathers(through=len(self._queue))
        ParameterSync.start = start_all
    model, session, optimizer, wrapped = _gpt_session(3, prefetch_depth=DEPTH, overlap_param_gather=True)
    order = wrapped.param_sync.gather_order
    position = {id(b.param): i for i, b in enumerate(order)}
    events: list[tuple[str, int]] = []
    across, in_group = buffers.BucketParameters.start_replica_gather, buffers.BucketParameters.start_gather
    buffers.BucketParameters.start_replica_gather = lambda self: (events.append(("across", position[id(self)])),
                                                                  across(self))[1]
    buffers.BucketParameters.start_gather = lambda self: (events.append(("in-group", position[id(self)])),
                                                          in_group(self))[1]
    g = torch.Generator().manual_seed(rank)
    steps = []
    for _ in range(STEPS):
        idx = _backward(session, wrapped, g)
        events.clear()
        session.step(optimizer)
        optimizer.zero_grad()
        wrapped(idx)  # the next forward, whose pre-hooks wait for the gathers
        session.sync_parameters()
        steps.append(list(events))
    chunked = [position[id(b.param)] for b in order if b.chunks is not None]
    session.release()
    return steps, chunked, len(order)


@pytest.mark.parametrize("mutation", [None, "all-at-the-step"])
def test_cross_group_gathers_follow_the_forward_within_the_prefetch_window(mutation):
    """At 6 ranks as 3 groups of 2 with ``prefetch_depth=1``: the cross-group all-gathers go out in bucket order,
    each at most ``prefetch_depth`` buckets ahead of the in-group all-gather being dispatched, and each bucket's
    before its in-group one. Dispatching every cross-group gather at the step (as before) breaks the window."""
    outside = []
    for rank, (steps, chunked, n_buckets) in enumerate(run_distributed(_gather_worker, 6, mutation)):
        assert len(chunked) > DEPTH + 2, (chunked, n_buckets)
        for events in steps:
            across = [i for kind, i in events if kind == "across"]
            assert across == chunked, (rank, events)  # each once, in bucket order
            dispatched = -1  # the position of the last in-group all-gather dispatched
            for kind, i in events:
                if kind == "in-group":
                    if i in chunked:
                        assert ("across", i) in events[:events.index((kind, i))], (rank, events)
                    dispatched = i
                elif i > dispatched + 1 + DEPTH:
                    outside.append((rank, i, dispatched))
    if mutation is None:
        assert not outside, outside[:4]
    else:
        assert outside, "dispatching every cross-group gather at the step stayed in the window: the test cannot fail"


def _prefetch_worker(rank, world, mutation):
    """Every in-group all-gather dispatch of two steps, with the bucket's position, why it was dispatched (the position
    of the bucket a pre-hook needs, or "finish" for a full sync, or "step" for the prefetch after the step) and
    whether the host blocked on the bucket's cross-group gather first."""
    from lightning_layerwise.engine.param_sync import ParameterSync

    if mutation == "blocking-prefetch":  # prefetch as before: wait for the cross-group gather whatever the need
        ParameterSync._can_prefetch = lambda self, bucket: True
    model, session, optimizer, wrapped = _gpt_session(3, prefetch_depth=2, overlap_param_gather=True)
    position = {id(b): i for i, b in enumerate(wrapped.param_sync.gather_order)}
    context: list = []
    records: list = []
    ensure, finish, dispatch = ParameterSync.ensure_gathered, ParameterSync.finish, ParameterSync._dispatch_next

    def within(fn, why):
        def wrapped_fn(self, *args):
            context.append(why(args))
            try:
                return fn(self, *args)
            finally:
                context.pop()
        return wrapped_fn

    def traced(self):
        bucket = self._queue[self._next]
        self._dispatch_replica_gathers(through=self._next - 1 + self.prefetch_depth)  # what the dispatch does first
        blocks = bucket.param.replica_gather is not None and not bucket.param.replica_gather.done
        records.append((position[id(bucket)], context[-1] if context else "step", blocks))
        return dispatch(self)

    ParameterSync.ensure_gathered = within(ensure, lambda args: position[id(args[0])])
    ParameterSync.finish = within(finish, lambda args: "finish")
    ParameterSync._dispatch_next = traced
    g = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        idx = _backward(session, wrapped, g)
        session.step(optimizer)
        optimizer.zero_grad()
        wrapped(idx)
        session.sync_parameters()
    session.release()
    return records


@pytest.mark.parametrize("mutation", [None, "blocking-prefetch"])
def test_a_cpu_prefetch_never_blocks_on_a_cross_group_gather(mutation):
    """At 6 ranks as 3 groups of 2, with collectives up to ``LATE_MS`` late (so a cross-group gather is rarely done
    when the next bucket could be prefetched): the host blocks on a bucket's cross-group gather only for a bucket a
    pre-hook needs (or one before it, in order) or in a full sync, never to prefetch (Note [cross-group gathers]).
    Prefetching as before (waiting whatever the need) blocks ahead of need, and fails."""
    ahead = []
    for rank, records in enumerate(run_distributed(_prefetch_worker, 6, mutation, late_ms=LATE_MS)):
        assert records, rank
        ahead += [(rank, pos, why) for pos, why, blocks in records
                  if blocks and why != "finish" and (why == "step" or pos > why)]
    if mutation is None:
        assert not ahead, ahead[:4]
    else:
        assert ahead, "prefetching that blocks went unnoticed: the test cannot fail"


# --- how many groups set-up creates at scale -----------------------------------------------------------------------

def test_the_number_of_new_group_calls_at_1024_ranks(monkeypatch):
    """``ProcessGroups.create`` at dp 1024 with owner groups of 8 (what ``owner_group_size="auto"`` picks with 8
    GPUs per node), counted with ``torch.distributed`` replaced by a recorder: one data-parallel group, an owner
    group and its all-gather communicator for each of the 128 groups, one replica group for each of the 8
    positions. Without splitting (gloo, or no device bound to the default group) every rank makes every call
    (torch requires it): 265 ``new_group`` calls, each a round-trip over the world. With 64 experts on top (expert
    owner groups of 8 inside each expert data-parallel group of 16) it makes more. With a device bound and
    ``dist.split_group`` (Note [splitting groups] in ``engine/process_groups.py``), one call per family of disjoint
    groups: 4, and 10 with the experts, covering the same groups. Quoted in docs/design.md."""
    from lightning_layerwise.engine import process_groups
    from lightning_layerwise.engine.process_groups import ProcessGroups

    calls: list[tuple[int, ...]] = []
    splits: list[list[list[int]]] = []
    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1024)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "new_group", lambda ranks=None, **kwargs: calls.append(tuple(ranks)) or object())
    monkeypatch.setattr(dist, "split_group", lambda split_ranks=None, **kwargs: splits.append(split_ranks) or object(),
                        raising=False)
    monkeypatch.setattr(process_groups, "can_split", lambda kwargs: False)
    groups = ProcessGroups.create(owner_group_size=8)
    assert len(calls) == 1 + 2 * 128 + 8 == 265, len(calls)
    assert sorted(map(len, calls)) == [8] * 256 + [128] * 8 + [1024]
    assert groups.owner is not None and groups.replica is not None
    unsplit_dense = sorted(calls)
    calls.clear()
    ProcessGroups.create(owner_group_size=8, expert_parallel_size=64, expert_group_size=8)
    # dense as above; expert: 16 expert-parallel groups of 64, 64 expert data-parallel groups of 16 (+ their
    # all-gather communicators), and in each, 2 owner groups of 8 (+ all-gather) and 8 replica groups of 2
    assert len(calls) == 265 + 16 + 2 * 64 + 64 * (2 * 2 + 8), len(calls)
    unsplit_all = sorted(calls)
    calls.clear()
    # Split from a bound default group: the same groups, one call per family, none with new_group.
    monkeypatch.setattr(process_groups, "can_split", lambda kwargs: True)
    groups = ProcessGroups.create(owner_group_size=8)
    assert not calls and len(splits) == 4, (len(calls), len(splits))
    assert sorted(tuple(ranks) for family in splits for ranks in family) == unsplit_dense
    assert all(sorted(r for ranks in family for r in ranks) == list(range(1024)) for family in splits), "disjoint"
    splits.clear()
    ProcessGroups.create(owner_group_size=8, expert_parallel_size=64, expert_group_size=8)
    assert not calls and len(splits) == 10, len(splits)
    assert sorted(tuple(ranks) for family in splits for ranks in family) == unsplit_all


def test_groups_are_split_only_from_a_bound_default_group_whose_backend_splits(monkeypatch):
    """``can_split``: torch's ``split_group``, a device bound to the default group, a backend for that device that
    says it supports splitting, and no other backend asked for."""
    from types import SimpleNamespace

    from lightning_layerwise.engine.process_groups import can_split

    def world(bound, splits):
        backend = SimpleNamespace(supports_splitting=splits)
        return SimpleNamespace(WORLD=SimpleNamespace(bound_device_id=bound, _get_backend=lambda device: backend))

    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(dist, "split_group", lambda **kwargs: None, raising=False)
    monkeypatch.setattr(dist, "group", world(None, True))
    assert not can_split({"backend": None})
    monkeypatch.setattr(dist, "group", world(cuda, False))  # gloo over CUDA tensors: bound, but no splitting
    assert not can_split({"backend": None})
    monkeypatch.setattr(dist, "group", world(cuda, True))
    assert can_split({"backend": None}) and not can_split({"backend": "gloo"})
