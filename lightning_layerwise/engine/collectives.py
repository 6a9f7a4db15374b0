"""Bucket collectives as free functions with explicit group, input and output.

Every function returns a :class:`Collective` (the output tensor and the work
handle, ``None`` when nothing was sent), so callers decide when to wait. The
only torch.distributed calls of the package that move tensors live here, with
the shims for names that differ between torch releases. Every collective goes
through :data:`_issue`, which calls torch at once; the timing fuzzer of the tests
replaces it once per process (Note [late collectives] in
``testing/late_collectives.py``), so the training path reads no setting.

Note [averaging]
    Inputs are never divided before the reduction: in bf16 or fp16, ``g / world``
    rounds every rank's gradient once more (and can underflow), and the sum of
    the rounded parts differs from the mean. Where the backend has it, the mean is
    taken in the reduction (``ReduceOp.AVG``); otherwise the sum is reduced and
    :meth:`Collective.wait` divides this rank's shard (1/world of the bucket, so
    also fewer elements to divide). Whether a backend has it is found by trying, not
    from its name (:func:`probe_averaging`, run by set-up on every group it averages
    over): NCCL averages all three reductions, gloo does in torch 2.13 and may not in
    another release, and a backend registered under another name is taken for what it
    does. The sum of ``world`` values can only overflow where their mean is within a
    factor ``world`` of the dtype's largest value: possible only in fp16, where the
    ``16-mixed`` grad scaler then skips the step and lowers its scale.

Note [uneven chunks]
    Across owner groups a shard is cut into one chunk per replica (Note [replica
    sharing] in ``layout/sharing.py``). The list forms of reduce-scatter and all-gather
    would take unequal chunks, but NCCL runs them as one rooted reduce or broadcast per
    rank of the group, empty chunks included (``ProcessGroupNCCL::reduce_scatter`` and
    ``allgather`` coalesce one ``ncclReduce`` / ``ncclBroadcast`` per rank when the sizes
    differ), and gloo's all-gather needs equal sizes. So no list form is used: equal
    consecutive chunks that tile the shard (the flat shards) take the single-tensor
    reduce-scatter and all-gather; any other chunk set is moved as one ``reduce`` to, and
    after the step one ``broadcast`` from, each replica with a non-empty chunk, nothing
    for the empty ones. The planner cuts every shard so that this is two operations: one
    replica steps a shard of whole parameters (one reduce, one broadcast) and a flat shard
    is cut evenly (one of each single-tensor form); only a shard it splits for balance
    costs two per replica that steps some of it. Each moves the chunk's bytes once, as
    the list form did.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

# torch 2.13 renames the single-tensor collectives and deprecates the old names;
# 2.11 has only the old ones. Same signatures.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _direct(group: ProcessGroup, call: Callable[[bool], "dist.Work | None"], async_op: bool):
    """``call(async_op)``: the collective now. Returns the work handle of an asynchronous call, ``None``
    after a synchronous one."""
    return call(async_op)


_issue = _direct
"""How every collective of this module is issued, ``(group, call, async_op) -> work``. Only a testing tool
replaces it (:func:`set_dispatch`; Note [late collectives] in ``testing/late_collectives.py``)."""


def set_dispatch(dispatch: Callable | None) -> None:
    """Issues every later collective through ``dispatch(group, call, async_op)`` (``None``: at once again)."""
    global _issue
    _issue = dispatch if dispatch is not None else _direct


@dataclass
class Collective:
    """An output tensor and the handle of the collective that fills it.

    ``divide_by``: the output holds a sum that :meth:`wait` turns into a mean (the
    averaging fallback of :func:`reduce_scatter_bucket`).
    """

    output: torch.Tensor
    work: object | None  # a torch.distributed Work, or any handle with wait()
    divide_by: int | None = None

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
        if self.divide_by is not None:
            self.output.div_(self.divide_by)
            self.divide_by = None
        return self.output

    @property
    def pending(self) -> bool:
        return self.work is not None

    @property
    def done(self) -> bool:
        """Whether the collective has completed (waiting would not block); asks the handle, never waits."""
        return self.work is None or self.work.is_completed()


class SideStream:
    """A CUDA stream beside the one the model computes on, made at first use, in which a wait for one collective and
    the dispatch of the next that depends on it stay off that stream (Note [replica reduce in backward] in
    ``engine/grad_sync.py``, Note [cross-group gathers] in ``engine/param_sync.py``). Off a GPU, no context."""

    def __init__(self) -> None:
        self._stream = None

    def __call__(self, tensor: torch.Tensor):
        if not tensor.is_cuda:
            return contextlib.nullcontext()
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=tensor.device)
        return torch.cuda.stream(self._stream)


_AVERAGING: "weakref.WeakKeyDictionary[ProcessGroup, dict[str, frozenset[str]]]" = weakref.WeakKeyDictionary()
"""Per group (held weakly: a probe dies with its group), per device type: the reductions :func:`probe_averaging`
found averaging in the reduction."""

AVERAGED = ("all_reduce", "reduce_scatter", "reduce")


def probe_averaging(group: ProcessGroup | None, device: torch.device) -> frozenset[str]:
    """Which of :data:`AVERAGED` ``group`` runs with ``ReduceOp.AVG`` on ``device`` tensors, found by trying each
    on a tiny tensor (Note [averaging]): a backend is taken for what it does, not for its name. Every rank of
    ``group`` must call this at the same point (set-up does, for each group it averages over); one reduction that
    raises, or averages wrongly, is then not used with ``AVG``. The result is kept for :func:`supports_average`."""
    if group is None:
        return frozenset(AVERAGED)
    probes = _AVERAGING.setdefault(group, {})
    kind = torch.device(device).type
    if kind in probes:
        return probes[kind]
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    mean = (world + 1) / 2  # rank r contributes r + 1
    root = dist.get_global_rank(group, 0)
    calls = {
        "all_reduce": lambda t, out: (lambda a: dist.all_reduce(t, op=dist.ReduceOp.AVG, group=group, async_op=a),
                                      t[:1]),
        "reduce_scatter": lambda t, out: (lambda a: _reduce_scatter_single(out, t, op=dist.ReduceOp.AVG, group=group,
                                                                           async_op=a), out),
        "reduce": lambda t, out: (lambda a: dist.reduce(t, dst=root, op=dist.ReduceOp.AVG, group=group, async_op=a),
                                  t[:1] if rank == 0 else None),
    }
    failed = torch.zeros(len(AVERAGED), device=device)
    for i, name in enumerate(AVERAGED):
        tensor = torch.full((world,), float(rank + 1), device=device)
        call, result = calls[name](tensor, torch.empty(1, device=device))
        try:
            _issue(group, call, False)
            if result is not None and abs(float(result[0]) - mean) > 1e-6 * mean:
                failed[i] = 1
        except (RuntimeError, ValueError):  # the backend refuses AVG here (a not-implemented one is a RuntimeError)
            failed[i] = 1
    _issue(group, lambda a: dist.all_reduce(failed, op=dist.ReduceOp.SUM, group=group, async_op=a), False)
    found = frozenset(name for name, bad in zip(AVERAGED, failed.tolist()) if bad == 0)
    probes[kind] = found
    return found


def forget_probes(group: ProcessGroup) -> None:
    """Drops what :func:`probe_averaging` found for ``group`` (it is being destroyed; a group collected without
    :meth:`ProcessGroups.destroy` takes its probes with it)."""
    _AVERAGING.pop(group, None)


def supports_average(group: ProcessGroup, op: str = "reduce_scatter", device: torch.device | str = "cpu") -> bool:
    """Whether ``group`` averages ``op`` (one of :data:`AVERAGED`) in the reduction, as :func:`probe_averaging` found
    for ``device`` tensors; a group never probed sums, and :meth:`Collective.wait` divides (always correct)."""
    probes = _AVERAGING.get(group) if group is not None else None
    return probes is not None and op in probes.get(torch.device(device).type, ())


def reduce_scatter_bucket(bucket: torch.Tensor, group: ProcessGroup | None, async_op: bool = True,
                          average: bool = False) -> Collective:
    """Sums (or with ``average``, averages) ``bucket`` over ``group`` into this rank's shard of it, in place.

    ``bucket`` is split into ``group`` size equal shards; after the wait, shard
    ``rank`` of ``bucket`` holds the sum (mean) over ranks and the other shards hold
    partial results that must not be read. Returns the shard. See Note [averaging].
    """
    if group is None:
        return Collective(bucket, None)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    shard = bucket.chunk(world)[rank]
    in_reduction = average and supports_average(group, "reduce_scatter", bucket.device)
    op = dist.ReduceOp.AVG if in_reduction else dist.ReduceOp.SUM
    work = _issue(group, lambda a: _reduce_scatter_single(shard, bucket, op=op, group=group, async_op=a), async_op)
    result = Collective(shard, work if async_op else None,
                        divide_by=world if average and not in_reduction else None)
    if not async_op:
        result.wait()
    return result


def all_reduce_bucket(tensor: torch.Tensor, group: ProcessGroup | None, async_op: bool = True,
                      average: bool = False) -> Collective:
    """Sums (with ``average``, averages; Note [averaging]) ``tensor`` over ``group`` in place."""
    if group is None:
        return Collective(tensor, None)
    in_reduction = average and supports_average(group, "all_reduce", tensor.device)
    op = dist.ReduceOp.AVG if in_reduction else dist.ReduceOp.SUM
    work = _issue(group, lambda a: dist.all_reduce(tensor, op=op, group=group, async_op=a), async_op)
    result = Collective(tensor, work if async_op else None,
                        divide_by=dist.get_world_size(group) if average and not in_reduction else None)
    if not async_op:
        result.wait()
    return result


def all_gather_bucket(bucket: torch.Tensor, group: ProcessGroup | None, async_op: bool = True) -> Collective:
    """Fills every shard of ``bucket`` from the rank that owns it, in place (no staging copy)."""
    if group is None:
        return Collective(bucket, None)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    shard = bucket.chunk(world)[rank]
    work = _issue(group, lambda a: _all_gather_single(bucket, shard, group=group, async_op=a), async_op)
    return Collective(bucket, work if async_op else None)


def all_gather_into(output: torch.Tensor, shard: torch.Tensor, group: ProcessGroup | None,
                    async_op: bool = True) -> Collective:
    """Fills ``output`` with every rank's ``shard``, in rank order (sharded parameters: the shard is kept apart
    from the full buffer, Note [sharded parameters] in ``engine/buffers.py``)."""
    if group is None:
        output.copy_(shard)
        return Collective(output, None)
    work = _issue(group, lambda a: _all_gather_single(output, shard, group=group, async_op=a), async_op)
    return Collective(output, work if async_op else None)


def _even(ranges: list[tuple[int, int]]) -> bool:
    """Whether ``ranges`` are the equal consecutive shards ``tensor.chunk(len(ranges))`` would give."""
    length = ranges[0][1] - ranges[0][0]
    return all(a == i * length and b == a + length for i, (a, b) in enumerate(ranges))


class _Works:
    """Several work handles waited as one."""

    def __init__(self, works: list) -> None:
        self.works = works

    def wait(self, timeout=None) -> bool:
        """Waits for each; a ``timeout`` (as torch's ``Work.wait``) that passes raises and leaves them waitable."""
        for work in self.works:
            if work is not None:
                work.wait() if timeout is None else work.wait(timeout)
        self.works = []
        return True

    def is_completed(self) -> bool:
        return all(work is None or work.is_completed() for work in self.works)


def reduce_scatter_chunks(tensor: torch.Tensor, ranges: list[tuple[int, int]], group: ProcessGroup | None,
                          async_op: bool = True, average: bool = False) -> Collective:
    """Sums (averages, Note [averaging]) ``tensor`` over ``group`` into chunk ``rank`` of it, in place.

    ``ranges[r]`` is group rank ``r``'s chunk, ``[start, end)`` of ``tensor``; the chunks tile it in any
    order and may differ in length or be empty (Note [replica sharing] in ``layout/sharing.py``). Equal
    consecutive chunks take the single-tensor reduce-scatter; others one reduce per non-empty chunk, rooted
    at the rank that steps it (Note [uneven chunks]). After the wait, the other chunks of ``tensor`` hold
    partial results that must not be read. Returns the chunk.
    """
    rank = 0 if group is None else dist.get_rank(group)
    mine = tensor[ranges[rank][0]:ranges[rank][1]]
    if group is None:
        return Collective(mine, None)
    if _even(ranges) and ranges[-1][1] == tensor.numel():
        return reduce_scatter_bucket(tensor, group, async_op, average)
    in_reduction = average and supports_average(group, "reduce", tensor.device)
    op = dist.ReduceOp.AVG if in_reduction else dist.ReduceOp.SUM
    works = [_issue(group, lambda a, c=tensor[b:e], d=dist.get_global_rank(group, r):
                    dist.reduce(c, dst=d, op=op, group=group, async_op=a), async_op)
             for r, (b, e) in enumerate(ranges) if e > b]
    result = Collective(mine, _Works(works) if async_op else None,
                        divide_by=dist.get_world_size(group) if average and not in_reduction else None)
    if not async_op:
        result.wait()
    return result


def all_gather_chunks(tensor: torch.Tensor, ranges: list[tuple[int, int]], group: ProcessGroup | None,
                      async_op: bool = True) -> Collective:
    """Fills every chunk ``ranges[r]`` of ``tensor`` from group rank ``r``, in place (the chunks as in
    :func:`reduce_scatter_chunks`). Equal consecutive chunks take the single-tensor all-gather; others one
    broadcast per non-empty chunk from the rank that stepped it (Note [uneven chunks])."""
    if group is None:
        return Collective(tensor, None)
    if _even(ranges) and ranges[-1][1] == tensor.numel():
        return all_gather_bucket(tensor, group, async_op)
    works = [_issue(group, lambda a, c=tensor[b:e], s=dist.get_global_rank(group, r):
                    dist.broadcast(c, src=s, group=group, async_op=a), async_op)
             for r, (b, e) in enumerate(ranges) if e > b]
    return Collective(tensor, _Works(works) if async_op else None)


def all_gather_stacked(tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Every rank's ``tensor`` stacked along a new first dimension, in group rank order (synchronously)."""
    if group is None:
        return tensor.unsqueeze(0)
    out = torch.empty((dist.get_world_size(group), *tensor.shape), dtype=tensor.dtype, device=tensor.device)
    flat = tensor.contiguous().view(-1)
    _issue(group, lambda a: _all_gather_single(out.view(-1), flat, group=group, async_op=a), False)
    return out


def all_reduce_sum(tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Sums ``tensor`` in place over ``group`` (synchronously)."""
    if group is not None:
        _issue(group, lambda a: dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=a), False)
    return tensor


def all_reduce_max(tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Maximum of ``tensor`` in place over ``group`` (synchronously)."""
    if group is not None:
        _issue(group, lambda a: dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group, async_op=a), False)
    return tensor


def start_all_reduce_max(tensor: torch.Tensor, group: ProcessGroup | None) -> Collective:
    """Starts the maximum of ``tensor`` in place over ``group``; ``wait()`` the result before reading it."""
    if group is None:
        return Collective(tensor, None)
    work = _issue(group, lambda a: dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group, async_op=a), True)
    return Collective(tensor, work)


_PACK_ALIGN = 16  # bytes: every packed tensor starts where any dtype may be viewed


def broadcast_coalesced(tensors: list[torch.Tensor], group: ProcessGroup | None, src_rank: int = 0) -> None:
    """Copies ``tensors`` (any dtypes, one device) from group rank ``src_rank`` to every rank with one collective.

    The tensors' bytes are packed into one ``uint8`` buffer (each at a 16-byte aligned
    offset), broadcast, and unpacked on the receiving ranks.
    """
    if group is None or not tensors:
        return
    if len(tensors) == 1 or len({t.device for t in tensors}) > 1:
        broadcast_tensors(tensors, group, src_rank)
        return
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += -(-t.numel() * t.element_size() // _PACK_ALIGN) * _PACK_ALIGN
    packed = torch.empty(total, dtype=torch.uint8, device=tensors[0].device)
    sender = dist.get_rank(group) == src_rank
    if sender:
        for t, offset in zip(tensors, offsets):
            packed[offset:offset + t.numel() * t.element_size()].view(t.dtype).view(t.shape).copy_(t)
    src = dist.get_global_rank(group, src_rank)
    _issue(group, lambda a: dist.broadcast(packed, src=src, group=group, async_op=a), False)
    if not sender:
        for t, offset in zip(tensors, offsets):
            t.copy_(packed[offset:offset + t.numel() * t.element_size()].view(t.dtype).view(t.shape))


def broadcast_tensors(tensors: list[torch.Tensor], group: ProcessGroup | None, src_rank: int = 0) -> None:
    """Copies ``tensors`` from group rank ``src_rank`` to every rank, in place."""
    if group is None:
        return
    src = dist.get_global_rank(group, src_rank)
    for t in tensors:
        _issue(group, lambda a, t=t: dist.broadcast(t, src=src, group=group, async_op=a), False)
