"""The parameter side of the engine: all-gather after the step, overlapped with the next forward.

:class:`ParameterSync` all-gathers buckets from each rank's shard of the param buffer
after the optimizer step: across the owner groups the chunks first (Note [replica
sharing] in ``layout/sharing.py``), then inside the group, dispatched in forward order
(Note [bucket order] in ``engine/data_parallel.py``) and awaited by the forward pre-hook
of the first module that needs a bucket, by a read of a pending parameter (Note [stale
reads] in ``engine/data_parallel.py``), or by :meth:`~ParameterSync.finish`. It is built
from the buckets alone and holds its own state (the queue, what is in flight); the
buckets' states move only through their own methods (Note [bucket states] in
``engine/buffers.py``).

Note [cross-group gathers]
    With owner groups each bucket is gathered twice after the step: its shard's chunks
    across the groups (the replicas), then the shards inside the group. Both follow the
    forward order and the prefetch window: the cross-group all-gathers are dispatched in
    bucket order, at most ``prefetch_depth`` buckets ahead of the in-group all-gather being
    dispatched (not all of them at the step), and each in-group all-gather waits for its
    own bucket's cross-group one only. On a GPU that wait and the in-group dispatch run on
    a side stream, so the stream the forward computes on waits only for the in-group
    all-gather of a bucket its next module needs (in the forward pre-hook). Where a wait
    blocks the host (CPU tensors, gloo), prefetching never waits: a bucket whose
    cross-group gather has not landed yet is left, with those after it, for a later hook
    or the module that needs it, and the forward computes meanwhile.

Note [compiled pre-hooks]
    ``torch.compile`` traces the forward pre-hooks with the module (Note [compiled
    wrapper] in ``engine/data_parallel.py``), and dynamo guards the graph on the Python state
    the hook reads: ``_next`` (an integer attribute, so specialized to its value), the
    lengths of ``_queue`` and ``_in_flight``. Compiled models
    run with every bucket synced (the strategies complete the all-gather inside the step
    under ``overlap_param_gather="auto"``). A finished sync that left
    ``_next == len(_queue)`` at the number of buckets the step gathered, not the 0 of
    the first forward, would compile every model twice (and again whenever a step
    gathered another number of buckets), so the last bucket to land
    empties the queue (:meth:`ParameterSync._wait_oldest`): "synced" is one
    state, ``([], 0, [])``, and the graph compiles once. The hook stays traceable rather
    than ``torch.compiler.disable``d: a disabled hook would break the graph at every
    module that holds parameters and fail ``fullgraph=True``; and a forward that does
    find buckets in flight (``overlap_param_gather=True``) fails the guards, recompiles
    and waits for them as an eager forward would.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, ContextManager, Iterable, Literal, Protocol

import torch
from torch import nn

from . import collectives, read_guard
from .buffers import Bucket, ParamState
from .read_guard import StaleParameterReadError
from .waiter import Waiter


class ParameterSide(Protocol):
    """What the wrapper asks of its parameter side: :class:`ParameterSync`, or with sharded parameters
    :class:`~lightning_layerwise.engine.sharded.ShardedParameterSync`. The wrapper picks one when it builds its parts
    and calls it alike afterwards."""

    gather_order: list[Bucket]
    """Every bucket, in the order all-gathers are dispatched (forward order, Note [bucket order] in
    ``engine/data_parallel.py``)."""
    split_buckets: list[Bucket]
    """The buckets holding a split parameter, in :attr:`gather_order` (the same on every rank)."""
    names: dict[nn.Parameter, str]
    """Every parameter the layout places (the trainable ones), and its name."""
    prefetch_depth: int
    overlap: bool
    guarded_reads: int
    holds_whole: bool
    """Whether every rank holds every parameter whole between steps (sharded: only its shards)."""

    @property
    def pending(self) -> bool: ...
    def start(self, buckets: Iterable[Bucket] | None = None, force_sync: bool = False) -> None: ...
    def finish(self) -> None: ...
    def ensure_gathered(self, bucket: Bucket) -> None: ...
    def forward_pre_hook(self, buckets: list[Bucket]) -> Callable: ...
    def before_backward_of(self, buckets: list[Bucket]) -> Callable | None: ...
    def on_pending_read(self, param: nn.Parameter, func: Callable) -> None: ...
    def check_forward(self, compiled: bool) -> None: ...
    def run_forward(self, call: Callable[[], object]) -> object: ...
    def grads_done(self, bucket: Bucket) -> None: ...
    def end_of_backward(self) -> None: ...
    def held(self, buckets: list[Bucket]) -> ContextManager[None]: ...
    def held_full(self) -> ContextManager[None]: ...
    def release(self, wait: bool = True) -> None: ...


class ParameterSync:
    """The all-gathers of a set of buckets, in a fixed order, with at most ``prefetch_depth`` in flight.

    Args:
        gather_order: every bucket, in the order all-gathers are dispatched (forward order).
        names: each parameter's name, for errors.
        waiter: waits (errors, timing, tracing) shared with the gradient side.
        prefetch_depth: how many all-gathers may be in flight at once.
        overlap: all-gather asynchronously, waited for by forward pre-hooks and reads (otherwise
            :meth:`start` completes every gather before returning).
        read_guard: ``"wait"``, ``"strict"`` or ``"off"`` (Note [stale reads] in ``engine/data_parallel.py``).
        gathers: whether there is anything to gather from (``False`` on one process).
        split_buckets: the buckets holding a split parameter, in ``gather_order``.
    """

    def __init__(self, gather_order: list[Bucket], names: dict[nn.Parameter, str], waiter: Waiter, *,
                 prefetch_depth: int = 2, overlap: bool = True, read_guard: Literal["wait", "strict", "off"] = "wait",
                 gathers: bool = True, split_buckets: list[Bucket] | None = None) -> None:
        self.gather_order = gather_order
        self.split_buckets = list(split_buckets or [])
        self.names = names
        self.waiter = waiter
        self.prefetch_depth = prefetch_depth
        self.overlap = overlap
        self.read_guard = read_guard
        self.gathers = gathers
        self.guarded_reads = 0
        """Reads that had to wait for their bucket outside a forward pre-hook (Note [stale reads] in
        ``engine/data_parallel.py``)."""
        self._bucket_by_id = {id(p): b for b in gather_order for p in b.params}  # no hashing inside the read guard
        self._queue: list[Bucket] = []  # the buckets the current sync gathers, in order
        self._next = 0  # position in _queue of the next bucket to dispatch
        self._next_replica = 0  # position in _queue of the next bucket whose chunks to gather across the groups
        self._in_flight: list[Bucket] = []
        self._side_stream = collectives.SideStream()  # Note [cross-group gathers]

    @property
    def pending(self) -> bool:
        """Whether an all-gather is queued or in flight."""
        return self._next < len(self._queue) or bool(self._in_flight)

    def start(self, buckets: Iterable[Bucket] | None = None, force_sync: bool = False) -> None:
        """Starts all-gathering ``buckets`` (default: all) from each rank's shard of the param buffer.

        With ``overlap`` the first ``prefetch_depth`` buckets are dispatched now and the rest by
        forward pre-hooks (and by reads, Note [stale reads] in ``engine/data_parallel.py``); with ``force_sync`` (or
        without
        overlap) everything is gathered before returning. ``buckets`` must be given in
        :attr:`gather_order` and be the same on every rank.
        """
        self.finish()  # a previous gather must land before a new one reads the shards
        if not self.gathers:
            return
        overlap = self.overlap and not force_sync
        strict = overlap and self.read_guard == "strict"
        queue = self.gather_order if buckets is None else list(buckets)
        for bucket in queue:
            if overlap and self.read_guard != "off":
                for p in bucket.params:
                    if read_guard.can_guard(p):
                        read_guard.mark_pending(p)
            if strict:
                _poison_others_shards(bucket)
            bucket.param.queue_gather()
        self._queue, self._next, self._next_replica = queue, 0, 0
        if not overlap:
            self.finish()
        elif not strict:  # strict dispatches each gather only when something waits for it
            self._top_up()

    def on_pending_read(self, param: nn.Parameter, func: Callable) -> None:
        """The read guard's callback: makes ``param`` current, or raises in strict mode."""
        bucket = self._bucket_by_id[id(param)]
        if bucket.param.state is ParamState.READY:  # landed in the meantime
            read_guard.restore(param)
            return
        if self.read_guard == "strict":
            raise StaleParameterReadError(
                f"{self.names[param]!r} was read by {read_guard.describe(func)} while its all-gather "
                f"(bucket {bucket.name}) had not landed, outside the forward pre-hook of the module that holds it. "
                "With param_read_guard='wait' (the default) this read waits for the bucket and is correct, but "
                "it may cost overlap: call the module itself, or read parameters after "
                "strategy.sync_parameters() (wrapper.param_sync.finish())."
            )
        self.guarded_reads += 1
        self.ensure_gathered(bucket)

    def finish(self) -> None:
        """Dispatches and waits for every outstanding all-gather (before eval, checkpoints, a step)."""
        while self._in_flight or self._next < len(self._queue):
            if self._in_flight and (len(self._in_flight) >= self.prefetch_depth or self._next >= len(self._queue)):
                self._wait_oldest()
            else:
                self._dispatch_next()

    def ensure_gathered(self, bucket: Bucket) -> None:
        """Waits until ``bucket`` is ready, dispatching and waiting earlier buckets in order."""
        while bucket.param.state is not ParamState.READY:
            if bucket.param.state is ParamState.STEPPED and len(self._in_flight) < self.prefetch_depth:
                self._dispatch_next()
            else:
                self._wait_oldest()
        if self.read_guard != "strict":
            self._top_up()

    def forward_pre_hook(self, buckets: list[Bucket]) -> Callable:
        """A forward pre-hook that makes ``buckets`` (in :attr:`gather_order`) ready before the module runs."""
        def hook(_module, _args):
            if self._next < len(self._queue) or self._in_flight:
                for b in buckets:
                    self.ensure_gathered(b)
        return hook

    # Every rank holds every parameter whole: what the sharded side does around a forward, a backward and a
    # hold is only waiting for the all-gathers in flight here.
    holds_whole = True

    def check_forward(self, compiled: bool) -> None:
        """Before a training forward: any forward runs, compiled or not."""

    def run_forward(self, call: Callable[[], object]) -> object:
        """Runs the wrapped module's forward, ``call``."""
        return call()

    def before_backward_of(self, buckets: list[Bucket]) -> Callable | None:
        """No hook: buckets stay whole from the forward to the backward."""
        return None

    def grads_done(self, bucket: Bucket) -> None:
        """Nothing to free."""

    def end_of_backward(self) -> None:
        """Nothing to free."""

    @contextlib.contextmanager
    def held(self, buckets: list[Bucket]):
        """``buckets`` whole inside: the all-gathers in flight are waited for."""
        self.finish()
        yield

    def held_full(self) -> ContextManager[None]:
        """Every bucket whole inside."""
        return self.held(self.gather_order)

    def release(self, wait: bool = True) -> None:
        """Completes (``wait``) or abandons every all-gather; the buckets are not used afterwards."""
        if wait:
            self.finish()
        self._queue, self._next, self._next_replica, self._in_flight = [], 0, 0, []

    def _dispatch_next(self) -> None:
        bucket = self._queue[self._next]
        self._next += 1
        self._dispatch_replica_gathers(through=self._next - 1 + self.prefetch_depth)
        if bucket.param.replica_gather is None:
            bucket.param.start_gather()
        else:  # the owner group gathers the shards the replicas completed (Note [cross-group gathers])
            with self._side_stream(bucket.param.data):
                self.waiter.wait(bucket.param.replica_gather, "replica_all_gather")
                self.waiter.trace("replica_ag_wait", bucket)
                bucket.param.start_gather()
        self._in_flight.append(bucket)
        self.waiter.trace("ag_dispatch", bucket)

    def _dispatch_replica_gathers(self, through: int) -> None:
        """Note [cross-group gathers]: the chunks' all-gathers across the groups, in bucket order, up to position
        ``through`` of the queue."""
        while self._next_replica <= min(through, len(self._queue) - 1):
            bucket = self._queue[self._next_replica]
            self._next_replica += 1
            if bucket.chunks is not None:
                bucket.param.start_replica_gather()
                self.waiter.trace("replica_ag_dispatch", bucket)

    def _wait_oldest(self) -> None:
        bucket = self._in_flight.pop(0)
        self.waiter.wait(bucket.param.gather, "all_gather")
        bucket.param.finish_gather()
        for p in bucket.params:
            read_guard.restore(p)
        self.waiter.trace("ag_wait", bucket)
        if not self._in_flight and self._next >= len(self._queue):
            self._queue, self._next, self._next_replica = [], 0, 0  # Note [compiled pre-hooks]: synced is one state

    def _top_up(self) -> None:
        while len(self._in_flight) < self.prefetch_depth and self._next < len(self._queue):
            if not self._can_prefetch(self._queue[self._next]):
                return
            self._dispatch_next()

    def _can_prefetch(self, bucket: Bucket) -> bool:
        """Whether ``bucket``'s in-group all-gather can be dispatched ahead of need without blocking the host
        (Note [cross-group gathers]): always on a GPU (the wait is a side stream's), on CPU once its cross-group
        gather has landed. Issues the cross-group gathers of the window first, as a dispatch would."""
        if bucket.chunks is None or bucket.param.data.is_cuda:
            return True
        self._dispatch_replica_gathers(through=self._next - 1 + self.prefetch_depth)
        return bucket.param.replica_gather is None or bucket.param.replica_gather.done


def _poison_others_shards(bucket: Bucket) -> None:
    """Strict mode: what other ranks stepped (their shards, the other chunks of this rank's) reads NaN until its
    all-gather lands."""
    if bucket.param.data.is_floating_point():
        begin, end = bucket.stepped_range
        with torch.no_grad():
            bucket.param.data[:begin].fill_(math.nan)
            bucket.param.data[end:].fill_(math.nan)
