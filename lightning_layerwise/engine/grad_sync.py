"""The gradient side of :class:`~lightning_layerwise.LayerwiseDataParallel`: accumulate, reduce, hand out.

:class:`GradientSync` is the part of the engine between the forward and the optimizer
step: the gradient buffer each backward adds into (Note [in-place gradients]), the
reduce-scatters dispatched in a fixed order as buckets complete (Note [bucket order] in
``engine/data_parallel.py``), across the owner groups the reduce-scatter into chunks (Note
[replica sharing] in ``layout/sharing.py``), the reduced gradient handed to what this rank
steps (its units: whole parameters, pieces, float32 masters; Note [pieces] in
``engine/data_parallel.py``, Note [gradient lifecycle]), and the collective reductions over it
(finite check, norms: ``engine/clip_reductions.py``). A split parameter's ``.grad`` marks that
it has a gradient without holding one (Note [split gradients] in ``engine/split_gradient.py``).
It is built from buckets, the parameter records (Note [the per-parameter record] in
``engine/param_records.py``) and a process group alone; the wrapper composes it with the parameter side.

Note [gradient lifecycle]
    Gradients behave as ``.grad`` does under ``DistributedDataParallel``: every backward adds to them, whether or
    not it reduces, until the user clears them (``optimizer.zero_grad()``). A rank holds the reduced gradient only
    of what it steps, its *units* (:class:`GradUnit`: an owned whole parameter, or its piece of a split one), so
    "adds to them" needs care: the buffer's own shard holds the reduced sum so far, and every other element holds
    local gradients already sent.

    So each backward after a sync first *restarts accumulation* (:meth:`prepare_backward`, called by the strategies
    before every backward, else by the gradient hook or :meth:`finish`; or by the forward, Note [in-place gradients]). A
    unit whose gradient is still held (the tensor the optimizer steps, or its master, has a ``.grad``) is
    *carried*: its reduced gradient is set aside (a ``.grad`` zeroed in place carries zero; one the user replaced
    carries its value). Then the buffer is zeroed and every ``.grad`` set to ``None``, so autograd never adds into
    a view of the reduced shard. The next reducing backward reduces only the new local gradients, and the carried
    ones are added back after the reduction: every rank sends what ``ddp`` would, and the result is the sum of
    every backward's mean gradient. When every unit was cleared (the usual loop) nothing is carried.
    :meth:`zero_grad_buffer` drops everything.

    A bare ``loss.backward()`` that bypasses the strategy adds the first gradient into whatever ``.grad`` holds:
    harmless when it was cleared, and on several processes refused by name when it was the gradient handed out
    (on one process the handed-out gradient is the local one, and the restart carries it). Fabric refuses a bare
    ``backward``; the Trainer's hooks always go through the strategy.

    A unit whose optimizer-side tensor (a piece, a master) has ``requires_grad=False`` (``toggle_optimizer``
    switches off what the *optimizer* holds) gets no gradient, as the model parameter would not under ``ddp``:
    every rank drops its local gradient of that parameter, so the reduction stays consistent.

Note [in-place gradients]
    A restart makes each parameter's slot of the zeroed buffer its ``.grad`` (where the buffer has the
    parameter's dtype and the optimizer steps the parameter itself), so autograd adds every gradient straight
    into the bucket, as ``ddp``'s ``gradient_as_bucket_view`` does: no per-parameter copy, and the hook only
    marks the bucket. Other parameters, and a ``.grad`` that arrives as a new tensor, take the copy path. A new
    tensor where the slot was assigned is the whole gradient since the restart (the user cleared or set
    ``.grad``; ``backward(create_graph=True)`` summed out of place), so it is copied, not added. After the sync
    every ``.grad`` but those handed out is ``None`` again. So the restart must come before autograd makes a
    ``.grad``: when every gradient was cleared (``zero_grad()`` before the forward, the usual loop) the training
    forward restarts (:meth:`GradientSync.before_forward`); a step with no backward since then drops the zeroed
    slots (:meth:`GradientSync.before_step`), so it finds no gradient, as under ``ddp``.

    The ``.grad`` given is an alias of the slot's memory (``GradRecord.grad``), not a view of the buffer, with a
    version counter of its own that autograd's in-place add bumps. On one process, which reduces nothing, such
    a parameter needs no hook (a Python call per parameter and step): the sync (and ``grads_pending``) reads the
    counters to tell which parameters received a gradient, and takes a ``.grad`` that is another tensor as the
    copy path would. Hooks remain where they do work: on several processes (bucket readiness, overlapped
    reduce-scatters, the errors below) and for copy-path parameters. So on one process a second gradient in one
    backward (reentrant checkpointing) and a sparse gradient just add into the slot, as plain autograd would;
    several processes refuse them by name, since a reduced bucket cannot take another gradient.

Note [sharded gradients]
    With sharded parameters (Note [sharded parameters] in ``engine/buffers.py``) a bucket's full gradient buffer
    exists only while it is needed: the first gradient of a backward to reach the bucket allocates it (zeroed), the
    hook adds each gradient into it (the copy path: autograd's own ``.grad`` is dropped at once, as there is no slot
    to accumulate into beforehand), and the reduce-scatter averages it in place. A bucket that is one parameter
    exactly takes autograd's gradient itself as that buffer (``BucketGradient.take``; autograd stores a gradient no one
    else holds, or a copy, and the hook drops its ``.grad``), so nothing is allocated or copied. This rank's shard
    of the mean is then *added* into the bucket's gradient shard and the full buffer freed. The gradient shard has
    storage of its own per bucket: freed when the gradients are dropped (a backward after ``zero_grad``, gradients
    carried aside first), allocated zeroed when the bucket's first reduction lands, so a backward holds the shards
    of the buckets reduced so far, as FSDP2's per-parameter sharded gradients. At most ``prefetch_depth`` full
    gradient buffers exist at once, filling or in flight: before a bucket's buffer is allocated, the oldest
    reduce-scatter in flight is waited for and folded in, so it overlaps the computation of the gradient whose
    arrival waits for it. Every reducing backward reduces every bucket by its end (a callback autograd's engine runs
    when the backward ends), so micro-batches accumulated without ``no_sync`` each send their gradients and add into
    the shard: the shard holds the sum of the means, as ``ddp``'s buffer would. Inside ``no_sync`` the full buffers
    instead keep the local sum until the reducing backward, trading memory for bytes as FSDP2 does. What the
    optimizer reads (owned parameters' ``.grad``, pieces, norms, the finite check) lies in the shard, so the
    hand-out is unchanged.

Note [replica reduce in backward]
    With owner groups (Note [replica sharing] in ``layout/sharing.py``) a bucket's gradient is reduced twice: inside
    its owner group (a reduce-scatter), then across the groups to the replica that steps it, or into equal chunks
    (Note [uneven chunks] in ``engine/collectives.py``). Whenever a bucket's in-group reduce-scatter is dispatched,
    the cross-group reduce of every earlier bucket with chunks is issued, behind that bucket's own reduce-scatter:
    the backward goes on computing while the groups exchange, and the end of the backward issues only the last
    bucket's. The point of issue is a fixed place in the order of dispatches, the same on every rank, so every
    communicator sees its operations in one global order (as NCCL requires of ranks using several communicators).
    The cross-group reduce needs the in-group result: on CPU the host waits for that reduce-scatter, dispatched one
    bucket earlier; on a GPU the wait and the issue happen on a side stream, so the stream the backward computes on
    never waits for them.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import torch
from torch import nn

from . import collectives
from .buffers import Bucket, GradState, free
from .clip_reductions import ParameterLists, all_finite, shard_sum
from .grad_records import GradRecord, GradUnit
from .live_wrappers import _SYNCS
from .param_records import ParamRecord, ParamRecords
from .split_gradient import SplitGradient, make_split_gradient
from .waiter import Waiter


class GradientSync:
    """Gradient accumulation, reduction and hand-out over a set of buckets.

    Built from the buckets and the parameter records, without a module wrapper; it moves every piece of gradient
    state (the records' gradient parts and units, carried gradients, the split flags) and the buckets' gradient
    states through their own methods (Note [bucket states] in ``engine/buffers.py``).

    Args:
        buckets: every bucket, in layout order; their parameters are the ones this side tracks.
        flat_buffers: the buffers the buckets slice (zeroed together at each restart).
        records: every trained parameter's record (Note [the per-parameter record] in ``engine/param_records.py``):
            its gradient record, and what this rank steps of it.
        waiter: waits (errors, timing, tracing) shared with the parameter side.
        groups: the process groups; ``layout_group``: the group whose ranks own the dense pieces.
        experts: the names of expert parameters; ``expert_parallel_size``: ranks holding different experts.
        overlap_grad_reduce: dispatch a bucket's reduce-scatter as soon as its gradients are complete.
        before_reduce: called before the reductions are completed (the parameter side finishes its gathers).
        sharded: sharded parameters (Note [sharded gradients]); then ``on_backward`` is called at every
            gradient's arrival (the wrapper queues its end-of-backward callback), ``grads_done`` with a bucket
            whose parameters all received their gradient in a reducing backward, and at most
            ``reduces_in_flight`` full gradient buffers exist at once (filling or in flight).
    """

    def __init__(self, buckets: list[Bucket], flat_buffers: list, records: ParamRecords, waiter: Waiter, *, groups,
                 layout_group=None, experts: frozenset = frozenset(), expert_parallel_size: int = 1,
                 overlap_grad_reduce: bool = True, before_reduce: Callable[[], None] = lambda: None,
                 sharded: bool = False, on_backward: Callable[[], None] = lambda: None,
                 grads_done: Callable[[Bucket], None] = lambda b: None, reduces_in_flight: int = 2) -> None:
        self._buckets, self.flat_buffers, self._records = buckets, flat_buffers, records
        self.waiter, self._groups, self.layout_group = waiter, groups, layout_group
        self._expert_parallel_size, self._overlap_grad_reduce = expert_parallel_size, overlap_grad_reduce
        self._before_reduce = before_reduce
        self._sharded, self._on_backward, self._grads_done = sharded, on_backward, grads_done
        self._reduces_in_flight = reduces_in_flight
        self._reducing: list[Bucket] = []  # sharded: reduce-scatters in flight, oldest first
        self._unreduced = False  # sharded: local gradients arrived since the last flush
        self._flushed = False  # sharded: a reducing backward reduced every bucket since the restart
        self._gather_order = sorted(buckets, key=lambda b: b.first_param)
        self._reduce_order = list(reversed(self._gather_order))
        # Whether each split parameter got a gradient here this step, kept on the device so that agreeing on it
        # (Note [pieces] in ``engine/data_parallel.py``) needs no host transfer; set by the gradient hook, zeroed with
        # the buffers.
        split = [r for r in records if r.slot.split]
        self._split_by_group = [(ps, group) for ps, group in (
            ([r.param for r in split if r.name not in experts], groups.dp),
            ([r.param for r in split if r.name in experts], groups.expert_group)) if ps]
        self._split_flags = [torch.zeros(len(ps), device=self._device()) for ps, _ in self._split_by_group]
        self._flag_reduces: list[collectives.Collective] = []  # their all-reduces in flight, one per group
        self.parameter_lists = ParameterLists(records, self._device)
        """The lists of parameters a norm is given, and their votes (Note [parameter lists] in ``engine/clip.py``)."""
        self._micro_batch_is_last = True
        self._grads_handed_out = False
        self._restarted_before_forward = False  # by before_forward, and no sync since
        self._any_seen = False  # a gradient arrived this accumulation (per parameter: GradRecord.seen)
        self._next_reduce = 0  # position in _reduce_order of the next bucket to dispatch
        # Note [replica reduce in backward]: buckets with chunks whose in-group reduce-scatter is dispatched and
        # whose cross-group reduce is not, in dispatch order; and those whose cross-group reduce is under way.
        self._replica_queue: list[Bucket] = []
        self._replica_started: set[int] = set()
        self._side_stream = collectives.SideStream()
        self.synced_at = 0
        """When this side last handed out reduced gradients, in this process's count of syncs (0: never)."""
        self._gradients = [r.gradient for r in records]
        for (ps, _), flags in zip(self._split_by_group, self._split_flags):
            for i, p in enumerate(ps):
                records[p].gradient.split_flag = flags[i]
        self._unhooked: list[GradRecord] = []  # in-place gradients on one process: no hook (Note [in-place gradients])
        self._units_stepped_apart: list[GradUnit] = []  # units whose optimizer tensor is not the parameter
        self.hook_gradients()
        self._mark_split_gradients()
        self._copies: set[int] = set()  # gradients the last sync handed out as copies (another dtype)
        # By storage object, not address: a sharded bucket's gradient shard is freed and allocated again.
        self._grad_storages = {flat.grads.untyped_storage()._cdata for flat in flat_buffers} | {
            b.grad.shard.untyped_storage()._cdata for b in buckets if b.grad.shard is not None}
        self._carry: list[tuple[torch.Tensor, torch.Tensor]] = []  # (own shard, carried values) to add back

    def _device(self) -> torch.device:
        return self.flat_buffers[0].grads.device

    @property
    def reduces_on_backward(self) -> bool:
        """False inside :meth:`no_sync`: backward then only accumulates locally."""
        return self._micro_batch_is_last

    @property
    def grads_pending(self) -> bool:
        """True between a backward that only accumulated (inside :meth:`no_sync`) and the reducing one:
        gradients exist that :meth:`finish` has not reduced, so no optimizer may step yet."""
        if self._grads_handed_out:
            return False
        self._collect_unhooked()
        return self._any_seen

    def release(self, wait: bool = True) -> None:
        """Waits for (``wait``) or abandons the reductions in flight, removes every hook and gradient this side
        gave, and gives the pieces their own storage; the buffers are not used afterwards."""
        if wait:
            self._wait_pending_reduces()  # no collective may still read or write the buffers freed by the caller
        else:
            self._flag_reduces = []
            for bucket in self._buckets:
                bucket.abandon()
        for rec in self._gradients:
            for handle in (rec.hook, rec.split_hook):
                if handle is not None:
                    handle.remove()
            rec.hook = rec.split_hook = rec.split_grad = None
        self._unhooked = []
        with torch.no_grad():
            for rec in self._gradients:
                rec.param.grad = None
                if hasattr(rec.param, "main_grad"):
                    del rec.param.main_grad
            for shard in self._records.pieces.values():
                shard.grad = None
                shard.data = shard.data.clone()  # no longer a view of the freed buffer
        self._units_stepped_apart, self._carry = [], []
        self._grads_handed_out = False
        if wait:  # the wrapper's callbacks go: no cycle keeps its buffers (after a failure, see Note [sharded release])
            self._before_reduce = self._on_backward = self._grads_done = lambda *_: None
            self.parameter_lists.resolve_votes()  # a disagreement raises after the rest is released
        self.parameter_lists.discard_votes()
        if wait:
            self.parameter_lists = None  # it calls back into this side

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside accumulate gradients locally; the next one outside reduces the sum."""
        previous = self._micro_batch_is_last
        self._micro_batch_is_last = False
        try:
            yield
        finally:
            self._micro_batch_is_last = previous

    def zero_grad_buffer(self) -> None:
        """Drops every gradient: zeros the gradient buffers and sets every ``.grad`` this wrapper gave to ``None``.

        A reduce-scatter still in flight (a step abandoned after its backward) is waited
        for first: its collective reads and writes the buffer being zeroed.
        """
        self._restart_accumulation(carry=False, assign=False)

    def before_forward(self) -> None:
        """Call before a training forward: after a sync whose gradients were all cleared (the usual loop clears
        them before the forward), restarts accumulation now, so that the slots are the ``.grad`` autograd adds
        into (Note [in-place gradients]). While a gradient is held, :meth:`prepare_backward` restarts, carrying it.
        """
        if self._grads_handed_out and self._has_inplace_gradients and not self._any_gradient_held():
            self._restart_accumulation(carry=False)
            self._restarted_before_forward = True

    def before_step(self) -> None:
        """Call before an optimizer step: if no backward ran since :meth:`before_forward` restarted, every
        ``.grad`` is ``None`` again, so the step finds no gradient, as it would have without that restart."""
        if self._restarted_before_forward and not self._grads_handed_out and not self.grads_pending:
            self.zero_grad_buffer()
            self._restarted_before_forward = False

    def _any_gradient_held(self) -> bool:
        """Whether any unit's optimizer-side tensor has a ``.grad`` (Note [gradient lifecycle])."""
        with torch._C.DisableTorchFunctionSubclass():  # .grad of a guarded parameter without its Python hook
            return any(unit.stepped.grad is not None for unit in self._records.units)

    def prepare_backward(self) -> None:
        """Call before a backward: after a sync, restarts accumulation (Note [gradient lifecycle]).

        Gradients still held (their optimizer tensor has a ``.grad``) are carried into the next
        reduction; cleared ones are dropped. A no-op while gradients accumulate. The strategies call
        it before every backward; without it the gradient hook does, after the first gradient arrived
        (on one process, where in-place gradients have no hook, the sync does).
        """
        if self._grads_handed_out:
            self._restart_accumulation(carry=True)

    def _restart_accumulation(self, carry: bool, assign: bool = True) -> None:
        """``assign``: a backward follows, so the slots become the ``.grad`` it adds into (Note [in-place
        gradients]); otherwise every ``.grad`` is ``None``."""
        self._wait_pending_reduces()
        carried: list[GradUnit] = []
        if carry and self._grads_handed_out:
            for unit in self._records.units:
                grad = unit.stepped.grad
                if grad is None:
                    continue
                if not unit.is_slot(grad):  # a copy in another dtype, or a tensor the user set
                    with torch.no_grad():
                        unit.slot.copy_(grad)
                carried.append(unit)
        self._carry = []
        if carried:
            keep = {id(u) for u in carried}
            for bucket in {u.bucket: None for u in carried}:
                own = self.own_shard(bucket)
                for unit in self._records.units:
                    if unit.bucket is bucket and id(unit) not in keep:
                        unit.slot.zero_()  # a cleared gradient is not carried
                self._carry.append((own, own.clone()))
        for rec in self._gradients:
            p = rec.param
            # Note [in-place gradients]: autograd adds the next gradients straight into the (zeroed) slot.
            rec.assigned = assign and rec.inplace and p.requires_grad
            p.grad = rec.grad if rec.assigned else None
            rec.version = rec.grad._version if rec.grad is not None else 0
            rec.seen = rec.carried = False
            rec.handed = None
            if hasattr(p, "main_grad"):
                del p.main_grad
        for unit in carried:
            unit.record.carried = True
        for unit in self._units_stepped_apart:  # pieces and masters: the other units are parameters
            for t in (unit.tensor, unit.master):
                if t is not None and t is not unit.param:
                    t.grad = None
                    if hasattr(t, "main_grad"):
                        del t.main_grad
        self._copies.clear()
        for flat in self.flat_buffers:
            flat.grads.zero_()
        for b in self._buckets:
            b.grad.restart()
            if self._sharded:
                b.grad.drop_full()
                b.grad.drop_shard()  # carried values are in self._carry, added back after the reduction
        self._reducing, self._unreduced, self._flushed = [], False, False
        self._next_reduce = 0
        self._replica_queue, self._replica_started = [], set()
        self._grads_handed_out = False
        self._any_seen = False
        for flags in self._split_flags:
            flags.zero_()
        for unit in carried:
            flag = unit.record.split_flag
            if flag is not None:
                flag.fill_(1.0)  # a carried piece: the parameter has a gradient this step on every rank

    def _wait_pending_reduces(self) -> None:
        for bucket in self._reduce_order:
            if bucket.grad.reduce is not None:
                self.waiter.wait(bucket.grad.reduce, "reduce_scatter")
                bucket.grad.reduce = None
        self._reducing = []
        for flags_reduce in self._flag_reduces:  # the flags are zeroed next: their all-reduce must have landed
            self.waiter.wait(flags_reduce, "split_flags")
        self._flag_reduces = []

    def _collect_unhooked(self) -> None:
        """Accounts for the gradients autograd added, unhooked, into the slots since the last call (one process;
        Note [in-place gradients]): an add bumped the slot alias's version counter; a ``.grad`` that is another
        tensor (cleared or replaced since the restart, or ``backward(create_graph=True)``'s out-of-place sum,
        which already holds the slot) is the parameter's whole gradient this accumulation, copied in."""
        arrived = False
        with torch._C.DisableTorchFunctionSubclass():  # .grad of a guarded parameter without its Python hook
            for rec in self._unhooked:
                param, alias = rec.param, rec.grad
                grad = param.grad
                if grad is not alias and grad is not None:
                    with torch.no_grad():
                        if rec.assigned:
                            rec.view.copy_(grad)
                        else:
                            rec.view.add_(grad)
                    rec.assigned = param.requires_grad
                    param.grad = alias if rec.assigned else None
                elif alias._version == rec.version:
                    continue
                rec.version = alias._version
                rec.seen = arrived = True
        if arrived:
            self._any_seen = True  # once: nn.Module.__setattr__ is a Python call

    def _before_split_accumulation(self, grad: torch.Tensor, rec: GradRecord) -> None:
        """A hook on a split parameter, run before autograd adds ``grad`` into its ``.grad``: a marker still
        there from the last sync is no gradient to add to, so accumulation restarts first (Note [split
        gradients] in ``engine/split_gradient.py``)."""
        if rec.param.grad is rec.split_grad:
            self.prepare_backward()

    def _on_grad_ready(self, param: nn.Parameter, record: ParamRecord) -> None:
        rec = record.gradient
        if self._sharded:
            self._on_backward()
        grad = param.grad
        in_place = grad is rec.grad and rec.assigned  # autograd added into the slot (Note [in-place gradients])
        if not in_place:
            param.grad = None  # autograd must never accumulate into a gradient the wrapper handed out
        if self._grads_handed_out:
            if grad is not None and grad is rec.handed:
                raise RuntimeError(
                    f"a backward started while {record.name!r} still held the gradient of the last "
                    "sync, without the strategy's backward (fabric.backward, self.manual_backward) or "
                    "wrapper.prepare_backward() before it, so autograd added the new gradient into the reduced "
                    "one. Run backward through the strategy, call wrapper.prepare_backward() before "
                    "loss.backward(), or clear the gradients first (optimizer.zero_grad())."
                )
            self.prepare_backward()
            rec.assigned = False  # this gradient arrived before the restart, into no slot
        if grad is None:
            return
        if grad.is_sparse:
            raise RuntimeError(
                f"{record.name!r} received a sparse gradient (an embedding looked up with "
                "sparse=True); strategy='layerwise' reduces dense gradient buckets. Use sparse=False.")
        if not rec.inplace:
            unit = record.unit
            if unit is not None and unit.stepped is not param and not unit.stepped.requires_grad:
                # Switched off on the optimizer's tensor (toggle_optimizer): see Note [gradient lifecycle].
                return
        bucket = rec.bucket
        if bucket.grad.state is not GradState.ACCUMULATING:
            raise RuntimeError(
                f"a gradient for {record.name!r} arrived after its bucket was reduced in the same backward (a "
                "reentrant activation checkpoint, or a second backward inside one); use non-reentrant "
                "checkpointing (use_reentrant=False)."
            )
        if not rec.seen:
            rec.seen = True
            if not self._any_seen:
                self._any_seen = True  # once: nn.Module.__setattr__ is a Python call
            if rec.split_flag is not None:
                rec.split_flag.fill_(1.0)
        if self._sharded:  # Note [sharded gradients]: autograd's gradient may be the full buffer itself
            self._unreduced = True
            in_place = self._micro_batch_is_last and bucket.grad.take(grad)
            if not bucket.grad.full_held:  # a new full buffer: the oldest in flight is folded in first
                self._fold_beyond(self._reduces_in_flight - 1)
                bucket.grad.ensure_full()
        if not in_place:
            view = rec.view
            if rec.assigned:
                # .grad was replaced since the slot was assigned (cleared, set by the user, or the out-of-place
                # sum of backward(create_graph=True), which already holds the slot): it is the whole gradient.
                view.copy_(grad.detach())
            else:
                view.add_(grad)
            rec.assigned = rec.inplace and param.requires_grad
            if rec.assigned:
                param.grad = rec.grad  # later backward passes of this accumulation add in place
        if not self._micro_batch_is_last:
            return
        bucket.grad.ready.add(id(param))
        if bucket.grad.complete:
            if self._sharded:
                self._grads_done(bucket)
            if self._overlap_grad_reduce:
                self._dispatch_ready_reduces()

    def _dispatch_ready_reduces(self, force: bool = False) -> None:
        """Dispatches reduce-scatters in the fixed order, up to the first bucket not yet complete."""
        while self._next_reduce < len(self._reduce_order):
            bucket = self._reduce_order[self._next_reduce]
            if not force and not bucket.grad.complete:
                return
            self._dispatch_reduce(bucket)
            self._next_reduce += 1

    def _dispatch_reduce(self, bucket: Bucket) -> None:
        if self._sharded:
            self._fold_beyond(self._reduces_in_flight - 1)  # each holds a full gradient buffer
            bucket.grad.ensure_full()  # a bucket no gradient reached here still takes part
        bucket.grad.start_reduce()
        self.waiter.trace("rs_dispatch", bucket)
        if self._sharded:  # its fold issues the cross-group reduce (Note [sharded gradients])
            self._reducing.append(bucket)
            return
        for earlier in self._replica_queue:  # Note [replica reduce in backward]
            self._start_replica_reduce(earlier)
        self._replica_queue = [bucket] if bucket.chunks is not None else []

    def _start_replica_reduce(self, bucket: Bucket) -> None:
        """Note [replica reduce in backward]: ``bucket``'s cross-group reduce, behind its in-group reduce-scatter."""
        with self._side_stream(bucket.grad.data):
            self.waiter.wait(bucket.grad.reduce, "reduce_scatter")
            self.waiter.trace("rs_wait", bucket)
            bucket.grad.start_replica_reduce()
        self._replica_started.add(id(bucket))
        self.waiter.trace("replica_rs_dispatch", bucket)

    # --- sharded parameters (Note [sharded gradients]) ----------------------------------------------------------
    def _fold(self, bucket: Bucket) -> None:
        """Waits for ``bucket``'s reduce-scatter and adds this rank's shard of it into the gradient shard."""
        self.waiter.wait(bucket.grad.reduce, "reduce_scatter")
        self.waiter.trace("rs_wait", bucket)
        if bucket.chunks is not None:  # then across the owner groups, into the chunk this rank steps
            bucket.grad.start_replica_reduce()
            self.waiter.wait(bucket.grad.reduce, "replica_reduce_scatter")
        bucket.grad.fold_reduce()
        self._reducing.remove(bucket)

    def _fold_beyond(self, limit: int) -> None:
        while len(self._reducing) > limit:
            self._fold(self._reducing[0])

    def _flush(self) -> None:
        """Reduce-scatters every bucket not yet reduced in this backward, in order, and folds every one in."""
        self._dispatch_ready_reduces(force=True)
        while self._reducing:
            self._fold(self._reducing[0])
        for bucket in self._buckets:
            bucket.grad.accumulate_again()
        self._next_reduce = 0
        self._unreduced, self._flushed = False, True

    def end_of_backward(self) -> None:
        """Sharded parameters: a backward ended (autograd's engine calls back). A reducing one reduces every bucket
        now, so that the full gradient buffers are freed and the next backward starts from the shards."""
        if self._micro_batch_is_last and self._unreduced:
            self._flush()

    def finish(self) -> None:
        """Waits for every reduce-scatter, then hands owned parameters their reduced gradient.

        Buckets never completed during backward (unused parameters, no overlap)
        are dispatched first, in order. Afterwards each owned parameter's
        ``.grad`` (and ``.main_grad``, the buffer-dtype view) is a view of the
        reduced shard, plus any gradient carried from before (Note [gradient
        lifecycle]); every other parameter's ``.grad`` is ``None``.
        """
        self.prepare_backward()  # a reducing backward that gave this rank no gradient still takes part
        self._collect_unhooked()
        self._before_reduce()
        if self._sharded:
            self._finish_sharded()
        else:
            self._finish_reductions()
        for own, carried in self._carry:
            own.add_(carried)
        self._carry = []
        used = self._split_parameters_used()
        for rec in self._gradients:
            rec.param.grad = None
            rec.assigned = False
        for unit in self._records.units:
            rec = unit.record
            if unit.split:
                if not used[unit.param]:
                    continue
            elif not rec.seen and not rec.carried and not unit.slot.any():
                # Unused on every rank: no gradient, as without the wrapper (an optimizer
                # must not decay or add momentum to a parameter the loss never touched).
                continue
            self._hand_out(unit)
        self._grads_handed_out = True
        self._restarted_before_forward = False
        self.synced_at = next(_SYNCS)

    def _start_flag_reduces(self) -> None:
        # Note [pieces] in ``engine/data_parallel.py``: which split parameters got a gradient anywhere, behind the
        # reduce-scatters' waits.
        self._flag_reduces = [collectives.start_all_reduce_max(flags, group)
                              for (_, group), flags in zip(self._split_by_group, self._split_flags)]

    def _finish_sharded(self) -> None:
        """Note [sharded gradients]: what no reducing backward reduced yet (the local sums of ``no_sync``, or
        nothing on a rank no gradient reached) is reduced now; every bucket's shard then holds the sum of every
        reducing backward's mean."""
        if self._unreduced or not self._flushed:
            self._flush()
        self._start_flag_reduces()
        for bucket in self._buckets:
            if bucket.expert:  # the expert data-parallel mean (Note [expert parallelism] in engine/process_groups.py)
                self.own_shard(bucket).div_(self._expert_parallel_size)
            bucket.grad.mark_reduced()

    def _finish_reductions(self) -> None:
        self._dispatch_ready_reduces(force=True)
        self._start_flag_reduces()
        started, self._replica_queue, self._replica_started = self._replica_started, [], set()
        for bucket in self._reduce_order:
            if id(bucket) in started:  # its cross-group reduce went out during the backward
                continue
            if bucket.grad.reduce is not None:
                self.waiter.wait(bucket.grad.reduce, "reduce_scatter")
                bucket.grad.reduce = None
                self.waiter.trace("rs_wait", bucket)
            if bucket.chunks is not None:
                bucket.grad.start_replica_reduce()
                self.waiter.trace("replica_rs_dispatch", bucket)
        for bucket in self._reduce_order:
            if bucket.grad.reduce is not None:
                self.waiter.wait(bucket.grad.reduce, "replica_reduce_scatter")
                bucket.grad.reduce = None
                self.waiter.trace("replica_rs_wait", bucket)
            if bucket.expert:
                # Note [expert parallelism] in ``engine/process_groups.py``: the expert data-parallel mean, over the E
                # ranks that sent tokens.
                self.own_shard(bucket).div_(self._expert_parallel_size)
            bucket.grad.finish_reduce()

    def _hand_out(self, unit: GradUnit) -> None:
        """Gives ``unit`` its reduced gradient: ``main_grad`` (the buffer view) and ``.grad`` in its dtype;
        its master (if any) the same gradient in float32."""
        slot, tensor = unit.slot, unit.tensor
        if unit.split:  # Note [split gradients] in ``engine/split_gradient.py``
            unit.param.grad = unit.record.handed = unit.record.split_grad
        tensor.main_grad = slot
        tensor.grad = slot if slot.dtype == tensor.dtype else slot.to(tensor.dtype)
        if tensor is unit.param:
            unit.record.handed = tensor.grad
        if slot.dtype != tensor.dtype:
            self._copies.add(id(tensor.grad))
        if unit.master is not None:
            unit.master.grad = slot if slot.dtype == torch.float32 else slot.float()
            if slot.dtype != torch.float32:
                self._copies.add(id(unit.master.grad))

    # --- the gradient hooks ----------------------------------------------------------------------------------------
    def _mark_split_gradients(self) -> None:
        """Each split parameter this rank steps a piece of gets its ``.grad`` marker and the hook that clears it
        (Note [split gradients] in ``engine/split_gradient.py``)."""
        for record in self._records:
            if record.piece is not None:
                rec = record.gradient
                rec.split_grad = make_split_gradient(record.param, record.name)
                rec.split_hook = record.param.register_hook(functools.partial(self._before_split_accumulation, rec=rec))

    def hook_gradients(self) -> None:
        """Decides whose gradients autograd adds in place, and hooks the parameters whose gradient needs the hook
        (Note [in-place gradients]); run again when a master takes a parameter's place in the optimizer
        (:meth:`~lightning_layerwise.engine.param_records.ParamRecords.set_master`)."""
        self._units_stepped_apart = [u for u in self._records.units if u.stepped is not u.param]
        for record in self._records:
            p, rec, unit = record.param, record.gradient, record.unit
            stepped_apart = unit is not None and unit.stepped is not p
            # sharded: the full gradient buffer exists only from a bucket's first gradient (Note [sharded gradients])
            rec.inplace = not self._sharded and rec.view.dtype == p.dtype and not stepped_apart
            # Note [in-place gradients]: one process reduces nothing, so an in-place gradient needs no hook.
            hooked = not (rec.inplace and self._groups.dp is None)
            if hooked and rec.hook is None:
                rec.hook = p.register_post_accumulate_grad_hook(functools.partial(self._on_grad_ready, record=record))
            elif not hooked and rec.hook is not None:
                rec.hook.remove()
                rec.hook = None
        self._unhooked = [rec for rec in self._gradients if rec.hook is None]
        self._has_inplace_gradients = any(rec.inplace for rec in self._gradients)

    def handed_out_gradient(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is a gradient the last sync handed out (a ``.grad`` or ``main_grad``)."""
        if not self._grads_handed_out:
            return False
        return isinstance(tensor, SplitGradient) or id(tensor) in self._copies \
            or tensor.untyped_storage()._cdata in self._grad_storages

    def clear_stepped_grad(self, param: nn.Parameter, set_to_none: bool = True) -> None:
        """``param.grad`` was cleared: clear the gradient of the tensor the optimizer holds in its place (a piece,
        a master), as ``optimizer.zero_grad`` would (Note [gradient lifecycle])."""
        record = self._records.of(param)
        unit = record.unit if record is not None and record.param is param else None
        if unit is None or unit.stepped is param:
            return
        stepped = unit.stepped
        if stepped.grad is None:
            return
        if set_to_none:
            stepped.grad = None
        else:
            stepped.grad.requires_grad_(False)
            stepped.grad.zero_()

    @property
    def grads_synced(self) -> bool:
        """True from :meth:`finish` until the next backward restarts accumulation."""
        return self._grads_handed_out

    def _split_parameters_used(self) -> dict[nn.Parameter, bool]:
        """Whether each split parameter got a gradient on any rank this step (one small all-reduce, started by
        :meth:`finish` before it waits for the reduce-scatters).

        A piece's own gradient may be zero while the parameter was used (an embedding's
        rows no token looked up), so every piece follows the whole parameter: all of its
        pieces are stepped or none, as one process would step it or not.
        """
        used = {}
        for (params, _), flags, flags_reduce in zip(self._split_by_group, self._split_flags, self._flag_reduces):
            # experts: only their expert data-parallel ranks hold them
            if all(self._records[p].gradient.seen for p in params):
                # A maximum is 1 where ours is: no read back and no wait (the next restart waits).
                used.update((p, True) for p in params)
            else:
                self.waiter.wait(flags_reduce, "split_flags")
                used.update(zip(params, flags.bool().tolist()))
        return used

    def own_shard(self, bucket: Bucket) -> torch.Tensor:
        """What this rank steps of ``bucket``'s gradient (its shard, or its chunk of it with replica sharing):
        after the sync, the mean over every rank."""
        return bucket.grad.stepped()

    def grads_are_finite(self) -> bool:
        """Whether every rank's reduced gradients are finite (``all_finite`` in ``engine/clip_reductions.py``, over
        this rank's shards: one all-reduce; after :meth:`finish`)."""
        return all_finite((self.own_shard(b) for b in self._buckets), self._device(), self._groups.dp)

    def grad_norm_squared(self) -> torch.Tensor:
        """Sum of squares of the full reduced gradient, from owned shards (one all-reduce).

        Valid after :meth:`finish`. The shards hold exactly the owned
        parameters' gradients plus zero padding, so no per-parameter loop is needed.
        """
        return self.shard_sum(lambda shard: shard.float().square().sum())

    def shard_sum(self, fn: Callable[[torch.Tensor], torch.Tensor], units: list[GradUnit] | None = None,
                  extra: torch.Tensor | None = None) -> torch.Tensor:
        """``fn`` (a float32 scalar per gradient shard) summed over the whole reduced gradient, once per element
        (:func:`~lightning_layerwise.engine.clip_reductions.shard_sum`).

        ``units`` (each rank its own, ``ParamRecord.unit``): sum ``fn`` of those units' gradients
        instead of whole shards, i.e. the part of the gradient a set of parameters holds.
        ``extra`` (float32, on the buffers' device) is summed over the data-parallel group in the same
        all-reduce, in place. Collective (one all-reduce, two with expert parallelism).
        """
        parts = ((self.own_shard(b), b.expert) for b in self._buckets) if units is None \
            else ((u.slot, u.bucket.expert) for u in units)
        return shard_sum(parts, fn, self._device(), self.layout_group, self._groups.dp,
                         self._expert_parallel_size, self.waiter, extra)
