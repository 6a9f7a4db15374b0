"""The gradient side of :class:`~lightning_layerwise.LayerwiseDataParallel`: accumulate, reduce, hand out.

:class:`GradientSync` is the part of the wrapper between the forward and the optimizer
step: the gradient buffer each backward adds into (Note [in-place gradients]), the
reduce-scatters dispatched in a fixed order as buckets complete (Note [bucket order]),
across the owner groups the reduce-scatter into chunks (Note [replica sharing] in
``layout.py``), the reduced gradient handed to what this rank steps (its units: whole
parameters, pieces, float32 masters; Note [pieces], Note [gradient lifecycle]), and the
collective reductions over it (finite check, norms). It is a mixin: the state it reads
(buckets, records, units, groups) is built by the wrapper's ``__init__`` in
``data_parallel.py``, where the notes named here are.
"""

from __future__ import annotations

import contextlib
import functools
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from . import collectives
from .buffers import Bucket, BucketState

if TYPE_CHECKING:
    from .data_parallel import LayerwiseDataParallel


@dataclass(eq=False)
class GradUnit:
    """What this rank steps of one parameter, and where its reduced gradient lives (Note [gradient lifecycle])."""

    param: nn.Parameter
    """The model's parameter."""
    tensor: nn.Parameter
    """What the wrapper hands the gradient to: ``param`` itself (owned whole) or this rank's piece of it."""
    slot: torch.Tensor
    """Its elements of the grad buffer (the buffer's dtype): ``main_grad``."""
    bucket: Bucket
    record: "_GradRecord"
    """The parameter's gradient record (what arrived this accumulation)."""
    split: bool = False
    """``tensor`` is a piece of a split parameter (Note [pieces])."""
    master: torch.Tensor | None = None
    """A float32 master the optimizer steps in place of ``tensor`` (``bf16-true``), set by :meth:`set_master`."""

    @property
    def stepped(self) -> torch.Tensor:
        """The tensor the optimizer holds for this unit."""
        return self.master if self.master is not None else self.tensor


class _GradRecord:
    """One parameter's gradient path and what arrived of it this accumulation, bound to its hook so the hook looks
    nothing up (Note [in-place gradients]); flags here, not sets of parameters: a tensor hashes in Python."""

    __slots__ = ("param", "view", "grad", "bucket", "inplace", "assigned", "version", "seen", "carried", "handed",
                 "split_flag", "hook")

    def __init__(self, param: nn.Parameter, view: torch.Tensor, bucket: Bucket) -> None:
        self.param = param
        self.view = view
        """Its slot of the grad buffer, strided as the parameter."""
        self.grad = _alias(view)
        """The ``.grad`` autograd adds into: ``view``'s memory with a version counter of its own (a view shares its
        buffer's), so an add into it shows in :attr:`version` without a hook."""
        self.bucket = bucket
        self.inplace = False
        """Autograd may accumulate into ``grad`` (same dtype; the optimizer steps the parameter itself)."""
        self.assigned = False
        """``grad`` was made the parameter's ``.grad`` at the last restart (or since)."""
        self.version = self.grad._version
        """``grad._version`` when arrivals were last accounted for."""
        self.seen = False
        """A gradient arrived this accumulation."""
        self.carried = False
        """A reduced gradient was carried into this accumulation (Note [gradient lifecycle])."""
        self.handed: torch.Tensor | None = None
        """The ``.grad`` the last sync handed out (a parameter stepped whole)."""
        self.split_flag: torch.Tensor | None = None
        """Its element of the on-device flags of split parameters (Note [pieces])."""
        self.hook = None
        """Its post-accumulate-grad hook's handle; ``None`` on one process where it adds in place."""


def _alias(view: torch.Tensor) -> torch.Tensor:
    """A tensor on ``view``'s memory, not a view of anything: its version counter is its own."""
    alias = torch.empty(0, dtype=view.dtype, device=view.device)
    return alias.set_(view.untyped_storage(), view.storage_offset(), view.size(), view.stride())


_LIVE: dict[int, "weakref.ref[LayerwiseDataParallel]"] = {}
"""``id(tensor)`` -> the live wrapper that trains it (its parameters, pieces and masters). Lets torch's
gradient utilities find the wrapper behind the tensors they are given (``grad_utils.py``)."""


def _forget(ref: "weakref.ref[LayerwiseDataParallel]") -> None:
    """A wrapper was collected without :meth:`~LayerwiseDataParallel.release`: its entries in :data:`_LIVE` go too."""
    for key in [key for key, value in _LIVE.items() if value is ref]:
        del _LIVE[key]


def live_wrappers() -> list["LayerwiseDataParallel"]:
    """Every wrapper with an entry in :data:`_LIVE` that is still alive."""
    refs = {id(ref): ref for ref in list(_LIVE.values())}  # by identity: a dead weak reference cannot be hashed
    return [w for w in (ref() for ref in refs.values()) if w is not None]


def wrapper_of(tensor) -> "LayerwiseDataParallel | None":
    """The live wrapper training ``tensor`` (a parameter in its layout, a piece or a master), else ``None``."""
    ref = _LIVE.get(id(tensor))
    return ref() if ref is not None else None


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are the same elements of the same memory (one a view of the other, or equal)."""
    return a is b or (a.dtype == b.dtype and a.shape == b.shape and a.data_ptr() == b.data_ptr()
                      and a.stride() == b.stride())


class GradientSync:
    """Gradient accumulation, reduction and hand-out of :class:`~lightning_layerwise.LayerwiseDataParallel`."""

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
            for unit in self._units:
                grad = unit.stepped.grad
                if grad is None:
                    continue
                if not _same_memory(grad, unit.slot):  # a copy in another dtype, or a tensor the user set
                    with torch.no_grad():
                        unit.slot.copy_(grad)
                carried.append(unit)
        self._carry = []
        if carried:
            keep = {id(u) for u in carried}
            for bucket in {u.bucket: None for u in carried}:
                own = self._own_shard(bucket)
                for unit in self._units:
                    if unit.bucket is bucket and id(unit) not in keep:
                        unit.slot.zero_()  # a cleared gradient is not carried
                self._carry.append((own, own.clone()))
        for p, rec in self._records.items():
            # Note [in-place gradients]: autograd adds the next gradients straight into the (zeroed) slot.
            rec.assigned = assign and rec.inplace and p.requires_grad
            p.grad = rec.grad if rec.assigned else None
            rec.version = rec.grad._version
            rec.seen = rec.carried = False
            rec.handed = None
            if hasattr(p, "main_grad"):
                del p.main_grad
        for unit in carried:
            unit.record.carried = True
        for unit in self._stepped_apart.values():  # pieces and masters: the other units are parameters
            for t in (unit.tensor, unit.master):
                if t is not None and t is not unit.param:
                    t.grad = None
                    if hasattr(t, "main_grad"):
                        del t.main_grad
        self._copies.clear()
        for flat in self._flat_buffers:
            flat.grads.zero_()
        for b in self._buckets:
            b.ready.clear()
            b.grads_state = BucketState.ACCUMULATING
            b.reduce = None
        self._next_reduce = 0
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
            if bucket.reduce is not None:
                self._wait(bucket.reduce, "reduce_scatter")
                bucket.reduce = None

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

    def _on_grad_ready(self, param: nn.Parameter, rec: _GradRecord) -> None:
        grad = param.grad
        in_place = grad is rec.grad and rec.assigned  # autograd added into the slot (Note [in-place gradients])
        if not in_place:
            param.grad = None  # autograd must never accumulate into a gradient the wrapper handed out
        if self._grads_handed_out:
            if grad is not None and grad is rec.handed:
                raise RuntimeError(
                    f"a backward started while {self._param_names[param]!r} still held the gradient of the last "
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
                f"{self._param_names[param]!r} received a sparse gradient (an embedding looked up with "
                "sparse=True); strategy='layerwise' reduces dense gradient buckets. Use sparse=False.")
        if not rec.inplace:
            apart = self._stepped_apart.get(param)
            if apart is not None and not apart.stepped.requires_grad:
                # Switched off on the optimizer's tensor (toggle_optimizer): see Note [gradient lifecycle].
                return
        bucket = rec.bucket
        if bucket.grads_state is not BucketState.ACCUMULATING:
            name = self._param_names[param]
            raise RuntimeError(
                f"a gradient for {name!r} arrived after its bucket was reduced in the same backward (a "
                "reentrant activation checkpoint, or a second backward inside one); use non-reentrant "
                "checkpointing (use_reentrant=False)."
            )
        if not rec.seen:
            rec.seen = True
            if not self._any_seen:
                self._any_seen = True  # once: nn.Module.__setattr__ is a Python call
            if rec.split_flag is not None:
                rec.split_flag.fill_(1.0)
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
        bucket.ready.add(id(param))
        if self.overlap_grad_reduce and len(bucket.ready) == len(bucket.params):
            self._dispatch_ready_reduces()

    def _dispatch_ready_reduces(self, force: bool = False) -> None:
        """Dispatches reduce-scatters in the fixed order, up to the first bucket not yet complete."""
        while self._next_reduce < len(self._reduce_order):
            bucket = self._reduce_order[self._next_reduce]
            if not force and len(bucket.ready) < len(bucket.params):
                return
            self._dispatch_reduce(bucket)
            self._next_reduce += 1

    def _dispatch_reduce(self, bucket: Bucket) -> None:
        # Averaged in the reduction or after it, never by dividing inputs first (Note [averaging]).
        bucket.reduce = collectives.reduce_scatter_bucket(bucket.grad_data, bucket.group, async_op=True,
                                                          average=True)
        bucket.grads_state = BucketState.REDUCING
        self._trace("rs_dispatch", bucket)

    def finish_grad_sync(self) -> None:
        """Waits for every reduce-scatter, then hands owned parameters their reduced gradient.

        Buckets never completed during backward (unused parameters, no overlap)
        are dispatched first, in order. Afterwards each owned parameter's
        ``.grad`` (and ``.main_grad``, the buffer-dtype view) is a view of the
        reduced shard, plus any gradient carried from before (Note [gradient
        lifecycle]); every other parameter's ``.grad`` is ``None``.
        """
        self.prepare_backward()  # a reducing backward that gave this rank no gradient still takes part
        self._collect_unhooked()
        self.finish_param_sync()
        self._dispatch_ready_reduces(force=True)
        for bucket in self._reduce_order:
            if bucket.reduce is not None:
                self._wait(bucket.reduce, "reduce_scatter")
                bucket.reduce = None
                self._trace("rs_wait", bucket)
            if bucket.chunks is not None:
                # Note [replica sharing]: the owner group's mean, averaged over the owner groups into the
                # chunk this rank steps.
                begin, end = bucket.shard
                bucket.reduce = collectives.reduce_scatter_chunks(bucket.grad_data[begin:end], bucket.chunks,
                                                                  bucket.replica_group, async_op=True, average=True)
                self._trace("replica_rs_dispatch", bucket)
        for bucket in self._reduce_order:
            if bucket.reduce is not None:
                self._wait(bucket.reduce, "replica_reduce_scatter")
                bucket.reduce = None
                self._trace("replica_rs_wait", bucket)
            if bucket.expert:
                # Note [expert parallelism]: the expert data-parallel mean, over the E ranks that sent tokens.
                self._own_shard(bucket).div_(self.expert_parallel_size)
            bucket.grads_state = BucketState.REDUCED
        for own, carried in self._carry:
            own.add_(carried)
        self._carry = []
        used = self._split_parameters_used()
        for param, rec in self._records.items():
            param.grad = None
            rec.assigned = False
        for unit in self._units:
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

    def _hand_out(self, unit: GradUnit) -> None:
        """Gives ``unit`` its reduced gradient: ``main_grad`` (the buffer view) and ``.grad`` in its dtype;
        its master (if any) the same gradient in float32."""
        slot, tensor = unit.slot, unit.tensor
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

    # --- the optimizer's side of each unit ----------------------------------------------------------
    def set_master(self, tensor: torch.Tensor, master: torch.Tensor) -> None:
        """Declares ``master`` the tensor the optimizer steps for ``tensor`` (an owned parameter or piece):
        it gets the reduced gradient in float32 at each sync (``bf16-true``, :class:`MasterWeights`)."""
        unit = self._unit_of[tensor]
        unit.master = master
        self._unit_of[master] = unit
        _LIVE[id(master)] = self._live
        self._registered.append(master)
        self._refresh_stepped_apart()

    def _refresh_stepped_apart(self) -> None:
        """Which parameters' gradients autograd adds in place, and which need the gradient hook for that."""
        self._stepped_apart = {u.param: u for u in self._units if u.stepped is not u.param}
        for p, rec in self._records.items():
            rec.inplace = rec.view.dtype == p.dtype and p not in self._stepped_apart
            # Note [in-place gradients]: one process reduces nothing, so an in-place gradient needs no hook.
            hooked = not (rec.inplace and self.process_groups.dp is None)
            if hooked and rec.hook is None:
                rec.hook = p.register_post_accumulate_grad_hook(functools.partial(self._on_grad_ready, rec=rec))
            elif not hooked and rec.hook is not None:
                rec.hook.remove()
                rec.hook = None
        self._unhooked = [rec for rec in self._records.values() if rec.hook is None]

    def handed_out_gradient(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is a gradient the last sync handed out (a ``.grad`` or ``main_grad``)."""
        if not self._grads_handed_out:
            return False
        return id(tensor) in self._copies or tensor.untyped_storage().data_ptr() in self._grad_storages

    def clear_stepped_grad(self, param: nn.Parameter, set_to_none: bool = True) -> None:
        """``param.grad`` was cleared: clear the gradient of the tensor the optimizer holds in its place (a piece,
        a master), as ``optimizer.zero_grad`` would (Note [gradient lifecycle])."""
        unit = self._stepped_apart.get(param)
        if unit is None:
            return
        stepped = unit.stepped
        if stepped.grad is None:
            return
        if set_to_none:
            stepped.grad = None
        else:
            stepped.grad.requires_grad_(False)
            stepped.grad.zero_()

    def is_expert(self, param: nn.Parameter) -> bool:
        """Whether ``param`` is an expert parameter reduced over its expert data-parallel group."""
        bucket = self._bucket_of.get(param)
        return bucket is not None and bucket.expert

    def unit_of(self, tensor: torch.Tensor) -> GradUnit | None:
        """What this rank steps of ``tensor`` (a parameter, a piece or a master), or ``None`` if nothing."""
        return self._unit_of.get(tensor)

    def owns_tensor(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is one this wrapper trains: a parameter in its layout, a piece or a master."""
        return tensor in self._param_names or tensor in self._unit_of

    @property
    def grads_synced(self) -> bool:
        """True from :meth:`finish_grad_sync` until the next backward restarts accumulation."""
        return self._grads_handed_out

    def buckets_of(self, tensors) -> list[Bucket]:
        """The buckets holding any of ``tensors`` (parameters, pieces or masters), in all-gather order."""
        wanted = set()
        for t in tensors:
            bucket = self._bucket_of.get(t)
            if bucket is None:
                unit = self._unit_of.get(t)
                bucket = unit.bucket if unit is not None else None
            if bucket is not None:
                wanted.add(id(bucket))
        return [b for b in self._gather_order if id(b) in wanted]

    def _split_parameters_used(self) -> dict[nn.Parameter, bool]:
        """Whether each split parameter got a gradient on any rank this step (one small all-reduce).

        A piece's own gradient may be zero while the parameter was used (an embedding's
        rows no token looked up), so every piece follows the whole parameter: all of its
        pieces are stepped or none, as one process would step it or not.
        """
        used = {}
        for (params, group), flags in zip(self._split_by_group, self._split_flags):
            # experts: only their expert data-parallel ranks hold them
            collectives.all_reduce_max(flags, group)
            if all(self._records[p].seen for p in params):
                used.update((p, True) for p in params)  # a maximum is 1 where ours is: no read back, no sync
            else:
                used.update(zip(params, flags.bool().tolist()))
        return used

    def _own_shard(self, bucket: Bucket) -> torch.Tensor:
        """What this rank steps of ``bucket``'s gradient (its shard, or its chunk of it with replica sharing):
        after the sync, the mean over every rank."""
        begin, end = bucket.stepped_range
        return bucket.grad_data[begin:end]

    def grads_are_finite(self) -> bool:
        """Whether every rank's reduced gradients are finite (one all-reduce; after :meth:`finish_grad_sync`).

        Each rank checks its own shards (every gradient element lies in exactly one),
        so all ranks return the same verdict.
        """
        device = self._device()
        bad = torch.zeros((), dtype=torch.float32, device=device)
        for bucket in self._buckets:
            bad = torch.maximum(bad, (~torch.isfinite(self._own_shard(bucket))).any().float())
        collectives.all_reduce_max(bad, self.process_groups.dp)
        return not bool(bad.item())

    def grad_norm_squared(self) -> torch.Tensor:
        """Sum of squares of the full reduced gradient, from owned shards (one all-reduce).

        Valid after :meth:`finish_grad_sync`. The shards hold exactly the owned
        parameters' gradients plus zero padding, so no per-parameter loop is needed.
        """
        t0 = time.perf_counter()
        total = self.shard_sum(lambda shard: shard.float().square().sum())
        if self.comm_wait_seconds is not None:
            self._add_wait("norm_all_reduce", t0)
        return total

    def shard_sum(self, fn: Callable[[torch.Tensor], torch.Tensor], units: list[GradUnit] | None = None
                  ) -> torch.Tensor:
        """``fn`` (a float32 scalar per gradient shard) summed over the whole reduced gradient, once per element.

        Each owner group holds the dense gradient once (with replica sharing, the world does: each
        element in the chunk of one rank); each expert element lies in the shard of one rank of its
        expert data-parallel group, and those groups cover every rank.
        ``units`` (each rank its own, :meth:`unit_of`): sum ``fn`` of those units' gradients
        instead of whole shards, i.e. the part of the gradient a set of parameters holds.
        Collective (one all-reduce, two with expert parallelism).
        """
        device = self._device()
        dense = torch.zeros((), dtype=torch.float32, device=device)
        expert = torch.zeros((), dtype=torch.float32, device=device)
        parts = ((self._own_shard(b), b.expert) for b in self._buckets) if units is None \
            else ((u.slot, u.bucket.expert) for u in units)
        for tensor, is_expert in parts:
            value = fn(tensor).to(device)
            if is_expert:
                expert += value
            else:
                dense += value
        collectives.all_reduce_sum(dense, self.layout_group)
        if self.expert_parallel_size > 1:
            collectives.all_reduce_sum(expert, self.process_groups.dp)
            dense += expert
        return dense
