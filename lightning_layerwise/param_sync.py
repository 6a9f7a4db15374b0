"""The parameter side of :class:`~lightning_layerwise.LayerwiseDataParallel`: all-gather after the step.

:class:`ParameterSync` all-gathers every bucket from each rank's shard of the param
buffer after the optimizer step: across the owner groups the chunks first (Note
[replica sharing] in ``layout.py``), then inside the group, dispatched in forward
order (Note [bucket order]) and awaited by the forward pre-hook of the first module
that needs a bucket, by a read of a pending parameter (Note [stale reads]), or by
:meth:`~ParameterSync.finish_param_sync`. A mixin: the state it reads is built by the
wrapper's ``__init__`` in ``data_parallel.py``, where the notes named here are.

Note [compiled pre-hooks]
    ``torch.compile`` traces the forward pre-hooks with the module (Note [compiled
    wrapper] in ``data_parallel.py``), and dynamo guards the graph on the Python state
    the hook reads: ``_next_gather`` (an integer attribute of a module, so specialized
    to its value), the lengths of ``_gather_queue`` and ``_in_flight``. Compiled models
    run with every bucket synced (the strategies complete the all-gather inside the step
    under ``overlap_param_gather="auto"``), but a finished sync used to leave
    ``_next_gather == len(_gather_queue)`` at the number of buckets the step gathered,
    not the 0 of the first forward, so every compiled model compiled twice (and again
    whenever a step gathered another number of buckets). The last bucket to land now
    empties the queue (:meth:`ParameterSync._wait_oldest_gather`): "synced" is one
    state, ``([], 0, [])``, and the graph compiles once. The hook stays traceable rather
    than ``torch.compiler.disable``d: a disabled hook would break the graph at every
    module that holds parameters and fail ``fullgraph=True``; and a forward that does
    find buckets in flight (``overlap_param_gather=True``) fails the guards, recompiles
    and waits for them as an eager forward would.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn

from . import collectives, read_guard
from .buffers import Bucket, BucketState
from .read_guard import StaleParameterReadError


class ParameterSync:
    """Parameter all-gathers of :class:`~lightning_layerwise.LayerwiseDataParallel`."""

    def start_param_sync(self, force_sync: bool = False, tensors=None) -> None:
        """Starts all-gathering every bucket from each rank's shard of the param buffer.

        With ``overlap_param_gather`` the first ``prefetch_depth`` buckets are
        dispatched now and the rest by forward pre-hooks (and by reads, Note
        [stale reads]); with ``force_sync`` (or without overlap) everything is
        gathered before returning. ``tensors`` (the parameters, pieces or masters
        an optimizer just stepped; the same set on every rank) limits the gather to
        the buckets holding them: the others did not change.
        """
        self.finish_param_sync()  # a previous gather must land before a new one reads the shards
        if self.process_groups.dp is None:
            return
        overlap = self.overlap_param_gather and not force_sync
        strict = overlap and self.param_read_guard == "strict"
        queue = self._gather_order if tensors is None else self.buckets_of(tensors)
        for bucket in queue:
            bucket.state = BucketState.GATHERING
            bucket.gather = None
            if overlap and self._guarded:
                for p in bucket.params:
                    if read_guard.can_guard(p):
                        read_guard.mark_pending(p)
            if strict:
                self._poison_others_shards(bucket)
            if bucket.chunks is not None:  # Note [replica sharing]: the chunks first, across the replicas
                begin, end = bucket.shard
                bucket.replica_gather = collectives.all_gather_chunks(bucket.param_data[begin:end], bucket.chunks,
                                                                      bucket.replica_group, async_op=True)
                self._trace("replica_ag_dispatch", bucket)
        self._gather_queue = queue
        self._next_gather = 0
        if not overlap:
            self.finish_param_sync()
        elif not strict:  # strict dispatches each gather only when something waits for it
            self._top_up_gathers()

    def _poison_others_shards(self, bucket: Bucket) -> None:
        """Strict mode: what other ranks stepped (their shards, the other chunks of this rank's) reads NaN
        until its all-gather lands."""
        if bucket.param_data.is_floating_point():
            begin, end = bucket.stepped_range
            with torch.no_grad():
                bucket.param_data[:begin].fill_(math.nan)
                bucket.param_data[end:].fill_(math.nan)

    def _on_pending_read(self, param: nn.Parameter, func: Callable) -> None:
        """The read guard's callback: makes ``param`` current, or raises in strict mode."""
        bucket = self._bucket_by_id[id(param)]
        if bucket.state is BucketState.SYNCED:  # landed in the meantime
            read_guard.restore(param)
            return
        if self.param_read_guard == "strict":
            raise StaleParameterReadError(
                f"{self._param_names[param]!r} was read by {read_guard.describe(func)} while its all-gather "
                f"(bucket {bucket.name}) had not landed, outside the forward pre-hook of the module that holds it. "
                "With param_read_guard='wait' (the default) this read waits for the bucket and is correct, but "
                "it may cost overlap: call the module itself, or read parameters after "
                "strategy.sync_parameters() (wrapper.finish_param_sync())."
            )
        self.guarded_reads += 1
        self._ensure_gathered(bucket)

    def finish_param_sync(self) -> None:
        """Dispatches and waits for every outstanding all-gather (before eval, checkpoints, a step)."""
        while self._in_flight or self._next_gather < len(self._gather_queue):
            if self._in_flight and (len(self._in_flight) >= self.prefetch_depth
                                    or self._next_gather >= len(self._gather_queue)):
                self._wait_oldest_gather()
            else:
                self._dispatch_next_gather()

    def _dispatch_next_gather(self) -> None:
        bucket = self._gather_queue[self._next_gather]
        self._next_gather += 1
        if bucket.replica_gather is not None:  # the owner group gathers the shards the replicas completed
            self._wait(bucket.replica_gather, "replica_all_gather")
            bucket.replica_gather = None
            self._trace("replica_ag_wait", bucket)
        bucket.gather = collectives.all_gather_bucket(bucket.param_data, bucket.gather_group,
                                                      async_op=True)
        self._in_flight.append(bucket)
        self._trace("ag_dispatch", bucket)

    def _wait_oldest_gather(self) -> None:
        bucket = self._in_flight.pop(0)
        self._wait(bucket.gather, "all_gather")
        bucket.gather = None
        bucket.state = BucketState.SYNCED
        for p in bucket.params:
            read_guard.restore(p)
        self._trace("ag_wait", bucket)
        if not self._in_flight and self._next_gather >= len(self._gather_queue):
            self._gather_queue, self._next_gather = [], 0  # Note [compiled pre-hooks]: synced is one state

    def _top_up_gathers(self) -> None:
        while len(self._in_flight) < self.prefetch_depth and self._next_gather < len(self._gather_queue):
            self._dispatch_next_gather()

    def _ensure_gathered(self, bucket: Bucket) -> None:
        """Waits until ``bucket`` is synced, dispatching and waiting earlier buckets in order."""
        while bucket.state is not BucketState.SYNCED:
            if bucket.gather is None and len(self._in_flight) < self.prefetch_depth:
                self._dispatch_next_gather()
            else:
                self._wait_oldest_gather()
        if self.param_read_guard != "strict":
            self._top_up_gathers()

    def _register_forward_pre_hooks(self) -> list:
        handles = []
        for module in self.module.modules():
            buckets = []
            for p in module.parameters(recurse=False):
                b = self._bucket_of.get(p)
                if b is not None and b not in buckets:
                    buckets.append(b)
            if not buckets:
                continue
            buckets.sort(key=self._gather_order.index)

            def hook(_module, _args, buckets=buckets):
                if self._next_gather < len(self._gather_queue) or self._in_flight:
                    for b in buckets:
                        self._ensure_gathered(b)

            handles.append(module.register_forward_pre_hook(hook))
        return handles
