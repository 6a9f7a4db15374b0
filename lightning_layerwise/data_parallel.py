"""The bucketed data-parallel wrapper: reduce-scatter gradients, all-gather parameters.

:class:`LayerwiseDataParallel` knows nothing of Lightning. One optimizer step,
driven by its owner (the Lightning strategy, Fabric, or a plain loop)::

    out = wrapper(batch)             # pre-hooks wait for each bucket's all-gather
    out.loss.backward()              # autograd adds grads into the grad buffer in place;
                                     # hooks dispatch a bucket's reduce-scatter when complete
    wrapper.finish_grad_sync()       # wait; owned params get .grad, others None
    optimizer.step()                 # any torch optimizer: steps only owned params
    wrapper.start_param_sync()       # async all-gather from each rank's shard

Note [bucket order]
    Collectives on one group must be issued in the same order on every rank.
    Bucket readiness can differ between ranks (an unused parameter, a data-
    dependent branch), so the wrapper never dispatches a bucket out of turn: it
    keeps one fixed reduce-scatter sequence and one fixed all-gather sequence and
    dispatches a bucket only after every bucket before it in that sequence. The
    all-gather sequence is forward order (buckets sorted by the first registered
    parameter they hold), the reduce-scatter sequence its reverse.

Note [timing communication waits]
    :attr:`LayerwiseDataParallel.comm_wait_seconds` is ``None`` by default and
    then nothing is timed (one ``is None`` test per wait). Setting it to a dict
    (``wrapper.comm_wait_seconds = {}``) makes every wait of the wrapper add its
    wall-clock seconds under ``"reduce_scatter"``, ``"all_gather"`` or
    ``"norm_all_reduce"`` (the synchronous all-reduce of
    :meth:`grad_norm_squared`): the time this process was blocked on
    communication that compute did not hide. On CUDA a ``wait()`` only orders
    streams, so host wall time there does not measure exposed communication.

Note [stale reads]
    Forward pre-hooks wait for the buckets of a module's own parameters. Every
    other read of a parameter whose bucket is still in flight (a module that is
    never called, a parent reading ``child.weight``, a hook or ``training_step``
    code before the forward, a callback between steps) is caught by the read
    guard, Note [read guard] in ``read_guard.py``: with ``param_read_guard="wait"``
    (default) it waits for that bucket, with ``"strict"`` it raises, naming the
    parameter. Either way no read sees a previous step's value.

Note [replica check]
    After the all-gather every rank must hold bitwise the same parameters.
    :meth:`LayerwiseDataParallel.check_replicas` tests that with one small
    collective: each rank sums the bits of every parameter, frozen ones included
    (the values viewed as integers of their width, summed in int64: any change of
    one element, one ulp included, changes the sum), and all-gathers that vector
    of one int64 per parameter. A mismatch names the parameters, their buckets and
    the ranks. Every rank sees the same gathered values and raises the same error,
    so none hangs. Padding is not compared: it holds no parameter.
    Non-owned parameters are rewritten by every all-gather, so a rank-local
    corruption of one lives until the next gather; what the check sees is the
    state right after it (a faulty transfer, a rank-local write after it, a
    frozen parameter that differs: frozen parameters are never re-sent).

Note [fixed module]
    The layout is planned once, from the parameters the module has when it is
    wrapped. Every training forward checks, before any collective of the step,
    that the module still has exactly those parameter objects, in the same order,
    and that each trainable one still views its slot in the param buffer
    (``data_ptr``): a parameter added, removed or replaced (a module assigned
    anew), or re-typed or moved (``model.half()``, ``p.data = ...``), raises a
    ``RuntimeError`` naming it on every rank that made the change, instead of
    a collective over a layout that no longer matches. Only identities and
    pointers are compared; no tensor is read. The parameters a module yields are
    those of its modules' ``_parameters`` dicts, reached through their ``_modules``
    dicts, so the check compares the identities in each of those dicts, recorded at
    wrapping, instead of walking ``module.parameters()`` (a recursive generator: 0.7
    ms per forward for 192 parameters in 145 modules, the largest part of the
    wrapper's forward overhead in ``benchmarks/bench_host_overhead.py``). The wrapper
    holds every recorded object (``_all_params``, ``_structure``), so no identity is
    reused while it compares them.

Note [compiled wrapper]
    Lightning Fabric compiles the module the strategy returns, so with
    ``fabric.setup(torch.compile(model), ...)`` this wrapper's own forward runs under
    ``torch.compile``. Its bookkeeping (the module check, zeroing the gradient buffers,
    the buffer broadcast) mutates Python state and tensor attributes that a traced graph
    cannot, so it runs in :meth:`_before_forward`, excluded from compilation
    (``torch.compiler.disable``); the inner module is compiled as the user asked. The
    forward notes that it ran compiled (:attr:`compiled_forward`), and the strategies
    then complete the all-gather inside each optimizer step under
    ``overlap_param_gather="auto"``: a graph traced while no bucket was in flight
    does not wait for one in the forward pre-hooks. ``True`` is refused at the first
    step: traced with buckets in flight, dynamo fails on the read guard's parameters.

Note [pieces]
    A split parameter (Note [element-wise fill] in ``layout.py``) is stepped in
    pieces: rank ``r`` steps the elements of its :class:`~lightning_layerwise.layout.Piece`,
    the part of the parameter inside its shard. For that the wrapper makes, per
    split parameter with a piece here, a flat ``nn.Parameter`` viewing the piece's
    range of the param buffer (:meth:`LayerwiseDataParallel.shard_of`), and
    :meth:`LayerwiseDataParallel.use_shards_in` puts it in the optimizer in place of
    the parameter; its ``.grad`` and ``.main_grad`` are the piece's range of the
    reduced grad buffer. An element-wise optimizer then computes exactly the
    elements one process would, and the all-gather spreads them. Whether a piece
    gets a gradient follows the whole parameter, agreed by one small all-reduce of
    flags the gradient hook sets on the device (read back to the host only on a rank
    that did not itself see a gradient for every split parameter, so the usual step
    has no host synchronization for it): a
    piece's own gradient can be all zero while the parameter was used (embedding
    rows no token looked up), and one process steps all of a used parameter and
    nothing of an unused one. Clipping, inf checks and norms read the shards, which
    hold exactly the elements each rank steps, so nothing changes for them.

Note [gradient lifecycle]
    Gradients behave as ``.grad`` does under ``DistributedDataParallel``: every
    backward adds to them, whether or not it reduces, until the user clears them
    (``optimizer.zero_grad()``). A rank holds the reduced gradient only of what it
    steps, its *units* (:class:`GradUnit`: an owned whole parameter, or its piece
    of a split one), so "adds to them" needs care: the buffer's own shard holds
    the reduced sum so far, and every other element holds local gradients that
    were already sent.

    So each backward after a sync first *restarts accumulation*
    (:meth:`LayerwiseDataParallel.prepare_backward`, which the strategies call
    before every backward; the gradient hook and :meth:`finish_grad_sync` call it
    when nobody did). A unit whose gradient is still held (the tensor the
    optimizer steps, its float32 master where there is one, has a ``.grad``) is
    *carried*: its reduced gradient is set aside (``.grad`` zeroed in place by
    ``zero_grad(set_to_none=False)`` carries zero; a ``.grad`` the user replaced
    carries its value). Then the buffer is zeroed and every ``.grad`` is set to
    ``None``, so autograd never accumulates into a view of the reduced shard.
    The next reducing backward reduces only the new local gradients, and the
    carried ones are added back to the reduced shard after the reduction: every
    rank sends exactly what ``ddp`` would, and the result is the sum of every
    backward's mean gradient. When every unit was cleared (``zero_grad`` before
    each step: the usual loop) nothing is carried and no memory is used for it.
    :meth:`LayerwiseDataParallel.zero_grad_buffer` drops everything.

    A bare ``loss.backward()`` that bypasses the strategy runs autograd before
    anything can restart accumulation: the first parameter to receive a gradient
    has it added into whatever ``.grad`` holds. That is harmless when its
    ``.grad`` was cleared and detected (an error naming the fix) when it was
    still the gradient handed out. Fabric refuses a bare ``backward`` anyway, and
    the Trainer's hooks always go through the strategy.

    Note [in-place gradients]: a restart before a backward makes each
    parameter's slot of the zeroed buffer its ``.grad`` (where the buffer has the
    parameter's dtype and the optimizer steps the parameter itself, not a piece
    or a master), so autograd adds every gradient straight into the bucket, as
    ``ddp``'s ``gradient_as_bucket_view`` does: no per-parameter copy, and the
    hook only marks the bucket. Other parameters, and a ``.grad`` that arrives
    as a new tensor (cleared meanwhile, or ``backward(create_graph=True)``, which
    sums out of place: then it already includes the slot and is copied, not
    added), take the copy path. After the sync every ``.grad`` but those handed
    out is ``None`` again, so between steps nothing differs from the copy path.

    A unit whose optimizer-side tensor (a piece or a master) has
    ``requires_grad=False`` gets no gradient, as the model parameter would not
    under ``ddp``: ``LightningModule.toggle_optimizer`` switches off the tensors
    the *optimizer* holds, and on ranks where those are pieces or masters the
    model parameter itself keeps ``requires_grad=True``. Every rank then drops
    its local gradient of that parameter, so the reduction stays consistent.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import hashlib
import math
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from . import collectives
from .buffers import FlatBuffer, allocate_buffers, view_of
from .collectives import Collective
from .layout import (DEFAULT_BUCKET_SIZE, Layout, ParamSpec, is_bucket_size, newton_schulz_cost, param_specs,
                     plan_layout)
from .process_groups import ProcessGroups
from .read_guard import READ_GUARDS, ReadGuard, StaleParameterReadError
from . import read_guard


class BucketState(enum.Enum):
    """Where a bucket is in one optimizer step."""

    ACCUMULATING = "accumulating"  # gradients of this step are being added
    REDUCING = "reducing"  # reduce-scatter dispatched, not waited
    REDUCED = "reduced"  # this rank's shard holds the averaged gradient
    GATHERING = "gathering"  # all-gather dispatched, not waited
    SYNCED = "synced"  # every rank holds the bucket's current parameters


@dataclass(eq=False)
class Bucket:
    """Run-time state of one planned bucket."""

    buffer: int
    index: int
    params: list[nn.Parameter]
    param_data: torch.Tensor
    grad_data: torch.Tensor
    first_param: int
    """Registration index of the earliest parameter in the bucket (forward order key)."""
    group: dist.ProcessGroup | None = None
    """Group its shards are spread over (reduce-scatter); ``gather_group``: its all-gather communicator."""
    gather_group: dist.ProcessGroup | None = None
    shards: int = 1
    """Ranks in ``group``; ``rank``: this rank's shard."""
    rank: int = 0
    expert: bool = False
    """Expert parameters (Note [expert parallelism] in ``process_groups.py``)."""
    chunks: list[tuple[int, int]] | None = None
    """Replica sharing (Note [replica sharing] in ``layout.py``): this rank's shard cut into one range per
    replica (from the shard's start), exchanged over ``replica_group``; ``None``: the rank steps its whole shard."""
    replica_group: dist.ProcessGroup | None = None
    replica_rank: int = 0
    state: BucketState = BucketState.SYNCED
    grads_state: BucketState = BucketState.ACCUMULATING
    ready: set[int] = field(default_factory=set)
    reduce: Collective | None = None
    gather: Collective | None = None
    replica_gather: Collective | None = None
    """The all-gather of the shard's chunks across the replicas, which the owner group's all-gather follows."""

    @property
    def name(self) -> str:
        return f"{self.buffer}.{self.index}"

    @property
    def shard(self) -> tuple[int, int]:
        """This rank's shard, as a range of the bucket."""
        size = self.grad_data.numel() // self.shards
        return self.rank * size, (self.rank + 1) * size

    @property
    def stepped_range(self) -> tuple[int, int]:
        """What this rank steps of the bucket (its shard, or its chunk of it), as a range of the bucket."""
        begin, end = self.shard
        if self.chunks is None:
            return begin, end
        a, b = self.chunks[self.replica_rank]
        return begin + a, begin + b


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
    master: torch.Tensor | None = None
    """A float32 master the optimizer steps in place of ``tensor`` (``bf16-true``), set by :meth:`set_master`."""

    @property
    def stepped(self) -> torch.Tensor:
        """The tensor the optimizer holds for this unit."""
        return self.master if self.master is not None else self.tensor


class _GradRecord:
    """One parameter's gradient path, bound to its hook so the hook looks nothing up (Note [in-place gradients])."""

    __slots__ = ("param", "view", "bucket", "inplace", "assigned")

    def __init__(self, param: nn.Parameter, view: torch.Tensor, bucket: Bucket) -> None:
        self.param = param
        self.view = view
        """Its slot of the grad buffer, strided as the parameter."""
        self.bucket = bucket
        self.inplace = False
        """Autograd may accumulate into ``view`` (same dtype; the optimizer steps the parameter itself)."""
        self.assigned = False
        """``view`` was made the parameter's ``.grad`` at the last restart (or by the hook since)."""


_LIVE: dict[int, "weakref.ref[LayerwiseDataParallel]"] = {}
"""``id(tensor)`` -> the live wrapper that trains it (its parameters, pieces and masters). Lets torch's
gradient utilities find the wrapper behind the tensors they are given (``grad_utils.py``)."""


def wrapper_of(tensor) -> "LayerwiseDataParallel | None":
    """The live wrapper training ``tensor`` (a parameter in its layout, a piece or a master), else ``None``."""
    ref = _LIVE.get(id(tensor))
    return ref() if ref is not None else None


class LayerwiseDataParallel(nn.Module):
    """Data-parallel wrapper with shard-aligned buckets and layer-wise ownership.

    Args:
        module: the model. Its trainable parameters become views into flat buffers.
        process_groups: the groups to talk over; default: :meth:`ProcessGroups.create`.
        bucket_size: bucket length in elements.
        overlap_grad_reduce: dispatch a bucket's reduce-scatter during backward as
            soon as its gradients are complete (otherwise all at :meth:`finish_grad_sync`).
        overlap_param_gather: all-gather parameters asynchronously and wait per bucket
            in forward pre-hooks (otherwise :meth:`start_param_sync` blocks).
        prefetch_depth: how many buckets' all-gathers may be in flight at once.
        grad_reduce_dtype: dtype of the gradient buffers and of the reduce-scatter
            (default: the parameter dtype). ``torch.float32`` keeps bf16 gradients exact.
        broadcast_buffers: broadcast module buffers (e.g. BatchNorm statistics) from
            rank 0 at every training forward, as ``DistributedDataParallel`` does.
        cost: optimizer cost per parameter used to balance owners.
        trace: record collective events in :attr:`events` (for tests and debugging).
        param_read_guard: what a read of a parameter whose all-gather has not landed
            does when it happens outside its module's forward pre-hook (Note [stale
            reads]): ``"wait"`` waits for the bucket, ``"strict"`` raises
            :class:`StaleParameterReadError` naming the parameter and poisons other
            ranks' shards with NaN until they arrive (a debugging mode), ``"off"``
            reads whatever the buffer holds (stale; for measurements only).
        elementwise: which parameters the optimizer updates element-wise (AdamW, SGD…),
            as a predicate on ``(name, parameter)``; those may be split across shards and
            stepped in pieces (Note [element-wise fill] in ``layout.py``, Note [pieces]).
            Default: none, every parameter is owned whole.
        expert: which parameters are expert parameters, as a predicate on ``(name, parameter)``:
            they get buffers of their own, reduced and gathered over the expert
            data-parallel group of ``process_groups`` (Note [expert parallelism] in
            ``process_groups.py``). Default: none.
        layout: the plan to use, made once by the caller (the session chooses the owner group
            size by planning, and hands that plan down); it must be planned from
            :func:`layout_specs` of ``module`` for the owner group of ``process_groups``.
            Default: planned here.
    """

    def __init__(
        self,
        module: nn.Module,
        process_groups: ProcessGroups | None = None,
        bucket_size: int = DEFAULT_BUCKET_SIZE,
        overlap_grad_reduce: bool = True,
        overlap_param_gather: bool = True,
        prefetch_depth: int = 2,
        grad_reduce_dtype: torch.dtype | None = None,
        broadcast_buffers: bool = True,
        cost: Callable[[ParamSpec], float] = newton_schulz_cost,
        trace: bool = False,
        param_read_guard: ReadGuard = "wait",
        elementwise: Callable[[str, nn.Parameter], bool] | None = None,
        expert: Callable[[str, nn.Parameter], bool] | None = None,
        layout: Layout | None = None,
    ) -> None:
        super().__init__()
        if not is_bucket_size(bucket_size):
            raise ValueError(f"bucket_size={bucket_size!r} must be a positive number of elements, "
                             f"e.g. {DEFAULT_BUCKET_SIZE}.")
        if not isinstance(prefetch_depth, int) or prefetch_depth < 1:
            raise ValueError(f"prefetch_depth={prefetch_depth!r} must be an integer >= 1 "
                             "(1 overlaps one bucket's all-gather with the module before it).")
        if param_read_guard not in READ_GUARDS:
            raise ValueError(f"param_read_guard={param_read_guard!r}: use 'wait' (reads wait for their all-gather), "
                             "'strict' (such reads raise, for debugging) or 'off' (stale reads, measurements only).")
        self.module = module
        self.param_read_guard = param_read_guard
        self.guarded_reads = 0
        """Reads that had to wait for their bucket outside a forward pre-hook (Note [stale reads])."""
        self.process_groups = process_groups if process_groups is not None else ProcessGroups.create()
        self.overlap_grad_reduce = overlap_grad_reduce
        self.overlap_param_gather = overlap_param_gather
        self.prefetch_depth = prefetch_depth
        self.broadcast_buffers = broadcast_buffers
        self.events: list[tuple[str, str]] | None = [] if trace else None
        self.comm_wait_seconds: dict[str, float] | None = None
        """Seconds blocked in waits, by collective; ``None``: not timed. See Note [timing communication waits]."""
        self.dp_size = self.process_groups.dp_size
        self.dp_rank = self.process_groups.dp_rank
        # The layout is planned for the owner group, Note [owner groups] in process_groups.py.
        self.owner_size = self.process_groups.owner_size
        self.owner_rank = self.process_groups.owner_rank
        # Note [replica sharing] in layout.py: the owner groups share the stepping of each shard.
        self.replicas = self.dp_size // self.owner_size if self.process_groups.replica is not None else 1
        self.layout_rank = self.process_groups.replica_rank * self.owner_size + self.owner_rank
        """Which dense pieces this rank steps: ``replica * g + position`` (the position without replicas)."""

        reject_sparse_gradients(module)
        specs = layout_specs(module, elementwise=elementwise, expert=expert)
        if not specs:
            raise ValueError(
                f"{type(module).__name__} has no trainable parameter (none with requires_grad=True); "
                "there is nothing to train data-parallel. Unfreeze a parameter or do not wrap the module."
            )
        _check_same_module_on_all_ranks(module, self.process_groups.dp, expert)
        groups = self.process_groups
        self.expert_parallel_size = groups.expert_parallel_size
        expert_dp = dist.get_world_size(groups.expert_dp) if groups.expert_parallel is not None else None
        self.expert_dp_rank = dist.get_rank(groups.expert_dp) if expert_dp is not None else self.owner_rank
        # Note [expert owner groups] in process_groups.py: expert buffers planned for an owner group of the
        # expert data-parallel ranks, their stepping shared by its replicas.
        expert_owner = groups.expert_owner_size if expert_dp is not None else None
        self.expert_replicas = expert_dp // expert_owner if expert_dp is not None else 1
        self.expert_owner_rank = dist.get_rank(groups.expert_owner_group) if expert_dp is not None else 0
        if layout is None:
            layout = plan_layout(specs, self.owner_size, bucket_size, cost, expert_dp=expert_owner,
                                 replicas=self.replicas, expert_replicas=self.expert_replicas)
        else:
            _check_layout(layout, specs, self.owner_size, bucket_size, expert_owner, self.replicas,
                          self.expert_replicas)
        self.layout: Layout = layout
        self._expert_names = frozenset(s.name for s in specs if s.kind == "expert")
        if expert is not None:  # frozen expert parameters: outside the layout, but held per expert rank
            self._expert_names |= {n for n, p in module.named_parameters() if expert(n, p)}

        named = dict(module.named_parameters())
        self._param_names: dict[nn.Parameter, str] = {named[s.name]: s.name for s in specs}
        self._flat_buffers: list[FlatBuffer] = allocate_buffers(self.layout, {s.name: named[s.name] for s in specs},
                                                           grad_reduce_dtype)
        order = {s.name: i for i, s in enumerate(specs)}
        self._buckets: list[Bucket] = []
        self._bucket_of: dict[nn.Parameter, Bucket] = {}
        for b_index, plan in enumerate(self.layout.buffers):
            flat = self._flat_buffers[b_index]
            expert_buffer = plan.kind == "expert" and groups.expert_parallel is not None
            if expert_buffer:
                group, position = groups.expert_owner_group, self.expert_owner_rank
                gather_group = groups.expert_owner_all_gather or groups.expert_dp_all_gather
                replica_group, replica_rank = groups.expert_replica, groups.expert_replica_rank
            else:
                group, gather_group, position = groups.owner_group, groups.dp_all_gather, self.owner_rank
                replica_group, replica_rank = groups.replica, groups.replica_rank
            for bp in plan.buckets:
                params = [named[n] for n in bp.params]
                chunks = None
                if bp.chunks:
                    begin = bp.shard_range(position)[0]
                    chunks = [(a - begin, b - begin) for a, b in bp.chunk_ranges(position)]
                bucket = Bucket(b_index, bp.index, params, flat.params[bp.start:bp.end], flat.grads[bp.start:bp.end],
                                first_param=min(order[n] for n in bp.params), group=group, gather_group=gather_group,
                                shards=bp.dp, rank=position, expert=expert_buffer, chunks=chunks,
                                replica_group=replica_group, replica_rank=replica_rank)
                self._buckets.append(bucket)
                for p in params:
                    self._bucket_of[p] = bucket
        # Each parameter's slot in its grad buffer, made once: the backward hook runs per parameter per step.
        # Strided as the parameter, so the reduced gradient keeps its memory format (Note [memory format]).
        self._grad_views: dict[nn.Parameter, torch.Tensor] = {
            p: view_of(self._flat_buffers[self.layout.params[n].buffer].grads, self.layout.params[n], like=p)
            for p, n in self._param_names.items()
        }
        self._gather_order = sorted(self._buckets, key=lambda b: b.first_param)
        self._reduce_order = list(reversed(self._gather_order))
        self._owned = {p for p, name in self._param_names.items()
                       if not self.layout.params[name].split and self.layout.params[name].owner == self._rank_for(name)}
        # Note [pieces]: this rank's piece of each split parameter, as a parameter of its own.
        self._shards: dict[nn.Parameter, nn.Parameter] = {}
        self._shard_grad_views: dict[nn.Parameter, torch.Tensor] = {}
        for p, name in self._param_names.items():
            slot = self.layout.params[name]
            piece = slot.piece_of(self._rank_for(name)) if slot.split else None
            if piece is None:
                continue
            flat = self._flat_buffers[slot.buffer]
            begin, end = slot.offset + piece.start, slot.offset + piece.stop
            self._shards[p] = nn.Parameter(flat.params[begin:end], requires_grad=p.requires_grad)
            self._shard_grad_views[p] = flat.grads[begin:end]
        split = [p for p, name in self._param_names.items() if self.layout.params[name].split]
        experts = [self._param_names[p] in self._expert_names for p in split]
        self._split = split
        self._split_by_group = [(group_params, group) for group_params, group in (
            ([p for p, e in zip(split, experts) if not e], self.process_groups.dp),
            ([p for p, e in zip(split, experts) if e], self.process_groups.expert_group)) if group_params]
        # Whether each split parameter got a gradient here this step, kept on the device so that agreeing
        # on it (Note [pieces]) needs no host transfer; set by the gradient hook, zeroed with the buffers.
        self._split_flags = [torch.zeros(len(ps), device=self._device()) for ps, _ in self._split_by_group]
        self._split_flag = {p: flags[i] for (ps, _), flags in zip(self._split_by_group, self._split_flags)
                            for i, p in enumerate(ps)}
        self._bucket_by_id = {id(p): b for p, b in self._bucket_of.items()}  # no hashing inside the read guard
        self._guarded = self.param_read_guard != "off"
        if self._guarded:
            unguardable = [n for p, n in self._param_names.items() if not read_guard.can_guard(p)]
            if unguardable and self.overlap_param_gather:
                warnings.warn(
                    f"parameters {unguardable[:3]} are of class {type(named[unguardable[0]]).__name__}, not "
                    "nn.Parameter, so reads of them outside their module cannot be made to wait for the "
                    "all-gather; parameters are all-gathered before start_param_sync() returns instead "
                    "(overlap_param_gather=False).", stacklevel=2)
                self.overlap_param_gather = False
            for p in self._param_names:
                if read_guard.can_guard(p):
                    read_guard.attach(p, self._on_pending_read)

        # What every training forward checks is still so (Note [fixed module]).
        self._all_params = list(module.parameters())
        self._structure = [(m, _ids(m._parameters), _ids(m._modules)) for m in module.modules()]
        self._data_ptrs = {p: p.data_ptr() for p in self._param_names}

        self._micro_batch_is_last = True
        self._grads_handed_out = False
        self.compiled_forward = False
        """Whether this wrapper's forward has run inside ``torch.compile`` (Note [compiled wrapper])."""
        self._seen: set[nn.Parameter] = set()  # parameters whose gradient arrived this step
        self._next_reduce = 0  # position in _reduce_order of the next bucket to dispatch
        self._gather_queue: list[Bucket] = []  # the buckets the current parameter sync gathers, in order
        self._next_gather = 0  # position in _gather_queue of the next bucket to dispatch
        self._in_flight: list[Bucket] = []

        self._broadcast_from_rank0()
        # What this rank steps, in registration order (Note [gradient lifecycle]).
        self._units: list[GradUnit] = []
        for p in self._param_names:
            if p in self._owned:
                self._units.append(GradUnit(p, p, self._grad_views[p], self._bucket_of[p]))
            elif p in self._shards:
                self._units.append(GradUnit(p, self._shards[p], self._shard_grad_views[p], self._bucket_of[p]))
        self._unit_of: dict[torch.Tensor, GradUnit] = {u.tensor: u for u in self._units}
        self._unit_of.update((u.param, u) for u in self._units)
        self._records: dict[nn.Parameter, _GradRecord] = {
            p: _GradRecord(p, self._grad_views[p], self._bucket_of[p]) for p in self._param_names}
        self._stepped_apart: dict[nn.Parameter, GradUnit] = {}  # units whose optimizer tensor is not the param
        self._refresh_stepped_apart()
        self._handed: dict[nn.Parameter, torch.Tensor] = {}  # param -> the .grad tensor the last sync gave it
        self._copies: set[int] = set()  # gradients the last sync handed out as copies (another dtype)
        self._grad_storages = {flat.grads.untyped_storage().data_ptr() for flat in self._flat_buffers}
        self._carry: list[tuple[torch.Tensor, torch.Tensor]] = []  # (own shard, carried values) to add back
        self._carried: set[nn.Parameter] = set()  # parameters with a carried gradient this accumulation
        self._registered = [*self._param_names, *self._shards.values()]
        for t in self._registered:
            _LIVE[id(t)] = weakref.ref(self)
        from . import grad_utils  # imports this module

        grad_utils.install()

        self._hook_handles = [p.register_post_accumulate_grad_hook(functools.partial(self._on_grad_ready, rec=rec))
                              for p, rec in self._records.items()]
        if self.process_groups.dp is not None:  # one process gathers nothing: no forward ever waits
            self._hook_handles += self._register_forward_pre_hooks()

    def _rank_for(self, name: str) -> int:
        """This rank's index among the owners of parameter ``name``'s pieces: its position in the expert
        data-parallel group for experts, else :attr:`layout_rank`."""
        return self.expert_dp_rank if name in self._expert_names and self.expert_parallel_size > 1 \
            else self.layout_rank

    @property
    def layout_group(self) -> dist.ProcessGroup | None:
        """The group whose ranks, in order, are the owners of the dense pieces (Note [replica sharing])."""
        return self.process_groups.dp if self.replicas > 1 else self.process_groups.owner_group

    # --- public queries -------------------------------------------------------------
    def owns(self, param: nn.Parameter) -> bool:
        """True if this rank steps all of ``param`` (its whole gradient lands in this rank's shard)."""
        return param in self._owned

    def owned_parameters(self) -> Iterator[nn.Parameter]:
        """What this rank steps: its whole parameters and its pieces of split ones (Note [pieces])."""
        return (n_p[1] for n_p in self.named_owned_parameters())

    def named_owned_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """:meth:`owned_parameters` with the name of the model parameter each is (part of)."""
        for p, n in self._param_names.items():
            if p in self._owned:
                yield n, p
            elif p in self._shards:
                yield n, self._shards[p]

    def shard_of(self, param: nn.Parameter) -> nn.Parameter | None:
        """This rank's piece of a split parameter, as a flat parameter viewing the param buffer
        (``None`` if ``param`` is not split or this rank steps none of it). See Note [pieces]."""
        return self._shards.get(param)

    def piece_of(self, param: nn.Parameter):
        """The :class:`~lightning_layerwise.layout.Piece` of ``param`` this rank steps, or ``None``."""
        name = self._param_names.get(param)
        return self.layout.params[name].piece_of(self._rank_for(name)) if name is not None \
            else None

    def use_shards_in(self, optimizer: torch.optim.Optimizer) -> None:
        """Puts this rank's pieces of split parameters in ``optimizer`` in place of the parameters.

        A split parameter this rank steps none of stays: it never gets a gradient here, so
        the optimizer skips it. Optimizer state created before the swap follows its parameter
        (sliced to the piece). See Note [pieces].
        """
        for group in optimizer.param_groups:
            group["params"] = [self._shards.get(p, p) for p in group["params"]]
        for p, shard in self._shards.items():
            if p in optimizer.state:
                piece = self.piece_of(p)
                cut = {k: (v, piece.cut(v, p.shape)) for k, v in optimizer.state.pop(p).items()}
                optimizer.state[shard] = {k: c.clone() if c is not v else v for k, (v, c) in cut.items()}

    def named_parameters_in_layout(self) -> Iterator[tuple[nn.Parameter, str]]:
        """Every parameter the layout places (the trainable ones), with its name."""
        return iter(self._param_names.items())

    @property
    def buckets(self) -> list[Bucket]:
        return list(self._buckets)

    @property
    def reduces_on_backward(self) -> bool:
        """False inside :meth:`no_sync`: backward then only accumulates locally."""
        return self._micro_batch_is_last

    @property
    def grads_pending(self) -> bool:
        """True between a backward that only accumulated (inside :meth:`no_sync`) and the reducing one:
        gradients exist that :meth:`finish_grad_sync` has not reduced, so no optimizer may step yet."""
        return bool(self._seen) and not self._grads_handed_out

    @property
    def flat_buffers(self) -> list[FlatBuffer]:
        """The flat param and grad tensors, one pair per layout buffer."""
        return list(self._flat_buffers)

    def forward(self, *args, **kwargs):
        if torch.compiler.is_compiling():
            self.compiled_forward = True  # Note [compiled wrapper]
        self._before_forward()
        return self.module(*args, **kwargs)

    @torch.compiler.disable
    def _before_forward(self) -> None:
        """The step's bookkeeping before a training forward, always run eagerly (Note [compiled wrapper])."""
        if torch.is_grad_enabled() and self.module.training:
            self._check_module_unchanged()
            if self.broadcast_buffers:
                self._broadcast_module_buffers()

    def _check_module_unchanged(self) -> None:
        """Raises before any collective of the step if the module's parameters changed since wrapping.

        See Note [fixed module]. Identity and storage pointers only: no tensor is read.
        """
        for m, params, children in self._structure:
            if _ids(m._parameters) != params or _ids(m._modules) != children:
                self._raise_changed()
        with torch._C.DisableTorchFunctionSubclass():
            for p, ptr in self._data_ptrs.items():
                if p.data_ptr() != ptr:
                    raise RuntimeError(
                        f"parameter {self._param_names[p]!r} no longer lives in its bucket: its .data, dtype or "
                        "device was changed after the module was wrapped (model.half(), .to(), or an assignment "
                        "to .data during training). Convert or move the model before fit, or use the Trainer's "
                        "precision= argument."
                    )

    def _raise_changed(self) -> None:
        before = {id(p): n for p, n in self._param_names.items()}
        now = dict(self.module.named_parameters())
        added = [n for n, p in now.items() if p.requires_grad and id(p) not in before]
        removed = [n for p, n in self._param_names.items() if all(q is not p for q in now.values())]
        raise RuntimeError(
            "the module's parameters changed after it was wrapped for data-parallel training (the layout is "
            f"planned once, at setup): added or replaced {added[:5]}, removed or replaced {removed[:5]}. Create "
            "every parameter (and module) before fit, e.g. in __init__ or configure_model, and do not assign "
            "new modules or parameters during training."
        )

    # --- gradients -----------------------------------------------------------------
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
        it before every backward; without it the gradient hook does, after the first gradient arrived.
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
        self._carried = {u.param for u in carried}
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
            p.grad = rec.view if rec.assigned else None
            if hasattr(p, "main_grad"):
                del p.main_grad
        for unit in self._stepped_apart.values():  # pieces and masters: the other units are parameters
            for t in (unit.tensor, unit.master):
                if t is not None and t is not unit.param:
                    t.grad = None
                    if hasattr(t, "main_grad"):
                        del t.main_grad
        self._handed.clear()
        self._copies.clear()
        for flat in self._flat_buffers:
            flat.grads.zero_()
        for b in self._buckets:
            b.ready.clear()
            b.grads_state = BucketState.ACCUMULATING
            b.reduce = None
        self._next_reduce = 0
        self._grads_handed_out = False
        self._seen.clear()
        for flags in self._split_flags:
            flags.zero_()
        for param in self._carried:
            flag = self._split_flag.get(param)
            if flag is not None:
                flag.fill_(1.0)  # a carried piece: the parameter has a gradient this step on every rank

    def _wait_pending_reduces(self) -> None:
        for bucket in self._reduce_order:
            if bucket.reduce is not None:
                self._wait(bucket.reduce, "reduce_scatter")
                bucket.reduce = None

    def _on_grad_ready(self, param: nn.Parameter, rec: _GradRecord | None = None) -> None:
        if rec is None:
            rec = self._records[param]
        grad = param.grad
        view = rec.view
        in_place = grad is view and rec.assigned  # autograd added into the slot (Note [in-place gradients])
        if not in_place:
            param.grad = None  # autograd must never accumulate into a gradient the wrapper handed out
        if self._grads_handed_out:
            if grad is not None and grad is self._handed.get(param):
                raise RuntimeError(
                    f"a backward started while {self._param_names[param]!r} still held the gradient of the last "
                    "sync, without the strategy's backward (fabric.backward, self.manual_backward) or "
                    "wrapper.prepare_backward() before it, so autograd added the new gradient into the reduced "
                    "one. Run backward through the strategy, call wrapper.prepare_backward() before "
                    "loss.backward(), or clear the gradients first (optimizer.zero_grad())."
                )
            assigned = rec.assigned
            self.prepare_backward()
            rec.assigned = assigned  # this gradient arrived before the restart: as it was then
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
        if param not in self._seen:
            self._seen.add(param)
            flag = self._split_flag.get(param)
            if flag is not None:
                flag.fill_(1.0)
        if not in_place:
            if rec.assigned and torch.is_grad_enabled():
                # backward(create_graph=True) sums out of place: the new .grad already holds the slot's value.
                view.copy_(grad.detach())
            else:
                view.add_(grad)
            rec.assigned = rec.inplace and param.requires_grad
            if rec.assigned:
                param.grad = view  # later backward passes of this accumulation add in place
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
            param = unit.param
            if param in self._shards:
                if not used[param]:
                    continue
            elif param not in self._seen and param not in self._carried and not unit.slot.any():
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
            self._handed[tensor] = tensor.grad
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
        _LIVE[id(master)] = weakref.ref(self)
        self._registered.append(master)
        self._refresh_stepped_apart()

    def _refresh_stepped_apart(self) -> None:
        self._stepped_apart = {u.param: u for u in self._units if u.stepped is not u.param}
        for p, rec in self._records.items():
            rec.inplace = rec.view.dtype == p.dtype and p not in self._stepped_apart

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
            if all(p in self._seen for p in params):
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

    # --- parameters ----------------------------------------------------------------
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

    # --- replica check (Note [replica check]) ------------------------------------------
    def check_replicas(self) -> None:
        """Raises :class:`ReplicaDivergenceError` on every rank unless all ranks hold bitwise-equal parameters.

        Collective: every rank calls it at the same point. Waits for outstanding
        all-gathers first.
        """
        group = self.process_groups.dp
        if group is None:
            return
        self.finish_param_sync()
        names = {p: n for n, p in self.module.named_parameters()}  # frozen ones too: never all-gathered
        params = list(names)
        with torch._C.DisableTorchFunctionSubclass():
            sums = torch.stack([_bit_sum(p.detach()) for p in params])
        gathered = collectives.all_gather_stacked(sums, group)
        # Each rank against the first rank holding the same values: rank 0, or for an expert parameter the
        # first of its expert data-parallel group (rank r mod E, Note [expert parallelism]).
        E = self.expert_parallel_size
        expert = torch.tensor([E > 1 and names[p] in self._expert_names for p in params], device=gathered.device)
        rows = torch.arange(gathered.size(0), device=gathered.device).unsqueeze(1)
        source = torch.where(expert, rows % E, torch.zeros_like(rows))  # (ranks, parameters)
        mismatch = gathered != gathered.gather(0, source)
        differs = mismatch.any(0).nonzero().flatten().tolist()
        if not differs:
            return
        ranks = sorted({r for i in differs for r in range(gathered.size(0)) if mismatch[r, i]})
        where = []
        for i in differs[:5]:
            bucket = self._bucket_of.get(params[i])
            where.append(f"{names[params[i]]!r} ({'bucket ' + bucket.name if bucket else 'frozen, never all-gathered'})")
        raise ReplicaDivergenceError(
            f"ranks hold different parameters after the all-gather: {', '.join(where)}"
            f"{' and more' if len(differs) > 5 else ''} differ between rank 0 and rank(s) {ranks}. Training stops "
            "here because the replicas would drift apart. Causes: a rank-local in-place write to a parameter (a "
            "hook or callback run on some ranks only), a frozen parameter set differently per rank, or a faulty "
            "device or link; resume from the last checkpoint."
        )

    def _device(self) -> torch.device:
        return self._flat_buffers[0].params.device

    # --- set-up --------------------------------------------------------------------
    def _broadcast_from_rank0(self) -> None:
        """Every rank starts from rank 0's values; expert parameters from the first rank holding the same
        experts (Note [expert parallelism])."""
        group = self.process_groups.dp
        if group is None:
            return
        experts = self.expert_parallel_size > 1
        expert_buffers = {i for i, plan in enumerate(self.layout.buffers) if experts and plan.kind == "expert"}
        frozen = [(n, p) for n, p in self.module.named_parameters() if p not in self._param_names]
        dense = [flat.params for i, flat in enumerate(self._flat_buffers) if i not in expert_buffers]
        dense += [p.data for n, p in frozen if not (experts and n in self._expert_names)]
        dense += [b for b in self.module.buffers()]
        expert = [flat.params for i, flat in enumerate(self._flat_buffers) if i in expert_buffers]
        expert += [p.data for n, p in frozen if experts and n in self._expert_names]
        with torch.no_grad():
            collectives.broadcast_tensors(dense, group)
            if expert:
                collectives.broadcast_tensors(expert, self.process_groups.expert_dp)

    def _broadcast_module_buffers(self) -> None:
        """Rank 0's module buffers to every rank, as one collective (every training forward)."""
        if self.process_groups.dp is None:
            return
        # The modules are those recorded at wrapping (the forward's check has just confirmed it); their
        # buffers are read now, since a model may replace a buffer object at any step. Each once, in
        # module.buffers() order.
        buffers = list({id(b): b for m, _, _ in self._structure for b in m._buffers.values()
                        if b is not None}.values())
        if buffers:
            with torch.no_grad():
                collectives.broadcast_coalesced(buffers, self.process_groups.dp)

    def _wait(self, collective: collectives.Collective, kind: str) -> None:
        """Waits for ``collective``, timed under ``kind`` if requested (Note [timing communication waits]).

        A failed collective (a dead or hung rank) raises :class:`CollectiveError` naming the
        phase, chained to the backend's error (which names the peer's address, not its rank).
        """
        t0 = time.perf_counter() if self.comm_wait_seconds is not None else 0.0
        try:
            collective.wait()
        except RuntimeError as error:
            phase = _PHASES.get(kind, kind)
            raise CollectiveError(
                f"the {phase} failed on rank {self.dp_rank} of {self.dp_size}: another rank died, hung past the "
                f"collective timeout, or left the job ({type(error).__name__}: {str(error)[:300]}). Check the other "
                "ranks' logs for the first error; resume from the last checkpoint.") from error
        if self.comm_wait_seconds is not None:
            self._add_wait(kind, t0)

    def _add_wait(self, kind: str, t0: float) -> None:
        waits = self.comm_wait_seconds
        waits[kind] = waits.get(kind, 0.0) + time.perf_counter() - t0

    def _trace(self, event: str, bucket: Bucket) -> None:
        if self.events is not None:
            self.events.append((event, bucket.name))

    def release(self, wait: bool = True) -> nn.Module:
        """Waits for pending all-gathers, removes every hook and gives parameters their own storage.

        Afterwards the module is an ordinary one again (as after unwrapping
        ``DistributedDataParallel``) and the flat buffers are freed. ``wait=False``
        abandons pending collectives instead of waiting for them: only after a
        collective failed (a dead rank), when waiting would raise the same error again.
        """
        if wait:
            self.finish_param_sync()
            self._wait_pending_reduces()  # no collective may still read or write the buffers freed below
        else:
            self._in_flight = []
            self._gather_queue, self._next_gather = [], 0
            for bucket in self._buckets:
                bucket.gather = bucket.reduce = None
        for h in self._hook_handles:
            h.remove()
        self._hook_handles = []
        with torch.no_grad():
            for p in self._param_names:
                read_guard.detach(p)
                p.data = p.data.clone()
                p.grad = None
                if hasattr(p, "main_grad"):
                    del p.main_grad
        for shard in self._shards.values():
            shard.grad = None
            shard.data = shard.data.clone()  # no longer a view of the freed buffer
        self._flat_buffers = []
        self._buckets = []
        self._grad_views = {}
        self._shard_grad_views = {}
        for t in self._registered:
            if wrapper_of(t) is self:
                del _LIVE[id(t)]
        self._registered = []
        self._units, self._unit_of, self._stepped_apart, self._handed, self._carry = [], {}, {}, {}, []
        self._grads_handed_out = False
        return self.module


def _ids(entries: dict) -> tuple[int, ...]:
    """The identities of a module's ``_parameters`` or ``_modules`` values, in order (Note [fixed module]).

    The objects stay alive while the wrapper holds them, so an identity is never reused for another."""
    return tuple(map(id, entries.values()))


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are the same elements of the same memory (one a view of the other, or equal)."""
    return a is b or (a.dtype == b.dtype and a.shape == b.shape and a.data_ptr() == b.data_ptr()
                      and a.stride() == b.stride())


def layout_specs(module: nn.Module, elementwise: Callable[[str, nn.Parameter], bool] | None = None,
                 expert: Callable[[str, nn.Parameter], bool] | None = None) -> list[ParamSpec]:
    """The specs the wrapper plans ``module`` from; a layout handed to the wrapper must be planned from these.

    ``elementwise`` may split only contiguous parameters: a piece is a range of the parameter's storage, cut
    and joined in checkpoints as a range of its logical elements, and the two agree only for a contiguous
    parameter (Note [memory format] in buffers.py)."""
    if elementwise is not None:
        user_elementwise = elementwise
        elementwise = lambda name, p: p.is_contiguous() and user_elementwise(name, p)  # noqa: E731
    return param_specs(module, expert=expert, elementwise=elementwise)


def _check_layout(layout: Layout, specs: list[ParamSpec], owner_size: int, bucket_size: int,
                  expert_dp: int | None, replicas: int = 1, expert_replicas: int = 1) -> None:
    """A layout handed in (planned once, by the caller) must fit this module, these groups and this bucket size."""
    shapes = {s.name: s.shape for s in specs}
    planned = {n: slot.shape for n, slot in layout.params.items()}
    whole = {s.name for s in specs if not s.elementwise}
    split_whole = sorted(n for n, slot in layout.params.items() if slot.split and n in whole)
    kinds = {s.name: s.kind for s in specs}
    other_kind = sorted(n for n, slot in layout.params.items()
                        if n in kinds and layout.buffers[slot.buffer].kind != kinds[n])
    expert_ranks = sorted({b.dp for b in layout.buffers if b.kind == "expert"} - {expert_dp or owner_size})
    problem = (f"planned for {layout.dp} ranks per owner group, not {owner_size}" if layout.dp != owner_size else
               f"shared among {layout.replicas} owner groups, not {replicas}" if layout.replicas != replicas else
               f"shared among {layout.expert_replicas} expert owner groups, not {expert_replicas}"
               if layout.expert_replicas != expert_replicas and any(b.kind == "expert" for b in layout.buffers) else
               f"planned with bucket_size={layout.bucket_size}, not {bucket_size}"
               if layout.bucket_size != bucket_size else
               f"planned for other parameters ({sorted(set(planned) ^ set(shapes))[:3]} differ, or their shapes)"
               if planned != shapes else
               f"splits {split_whole[:3]}, which this wrapper owns whole" if split_whole else
               f"planned with {other_kind[:3]} in buffers of another kind (expert or dense)" if other_kind else
               f"planned with expert buffers over {expert_ranks[0]} ranks, not {expert_dp or owner_size}"
               if expert_ranks else None)
    if problem is not None:
        raise ValueError(f"LayerwiseDataParallel(layout=...) does not fit: the layout was {problem}. Plan it with "
                         "lightning_layerwise.data_parallel.layout_specs(module, ...) for these process groups, or "
                         "pass layout=None to plan here.")


def reject_sparse_gradients(module: nn.Module) -> None:
    """Raises naming the first embedding that would produce sparse gradients (they cannot be reduce-scattered
    into dense buckets); before any collective, on every rank alike."""
    for name, child in module.named_modules():
        if isinstance(child, (nn.Embedding, nn.EmbeddingBag)) and child.sparse and child.weight.requires_grad:
            where = f"{name}.weight" if name else "weight"
            raise ValueError(
                f"{where!r} belongs to {type(child).__name__}(sparse=True), whose gradients are sparse; "
                "strategy='layerwise' reduces gradients in dense buckets. Build it with sparse=False (the "
                "default; torch.optim.SparseAdam then needs replacing by Adam or AdamW), or freeze it.")


class CollectiveError(RuntimeError):
    """A collective of the wrapper failed: usually another rank died or hung (the message names the phase)."""


_PHASES = {
    "reduce_scatter": "gradient reduce-scatter (end of backward)",
    "replica_reduce_scatter": "gradient reduce-scatter across owner groups (end of backward)",
    "replica_all_gather": "parameter all-gather across owner groups (before the owner group's all-gather)",
    "all_gather": "parameter all-gather (forward pre-hook, a parameter read, or a sync before eval/checkpoint)",
}


class ReplicaDivergenceError(RuntimeError):
    """Ranks hold different parameters after the all-gather (:meth:`LayerwiseDataParallel.check_replicas`)."""


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_BIT_SUM_CHUNK = 1 << 22  # elements summed at once: bounds the int64 temporary


def _bit_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum of ``tensor``'s elements read as integers of the same width, in int64 (0-d tensor)."""
    flat = tensor.reshape(-1)
    if flat.dtype.is_floating_point or flat.dtype.is_complex:
        flat = flat.view(_INT_OF_SIZE[flat.element_size()]) if not flat.dtype.is_complex else flat.view(torch.int32)
    total = torch.zeros((), dtype=torch.int64, device=tensor.device)
    for chunk in flat.split(_BIT_SUM_CHUNK):
        total += chunk.sum(dtype=torch.int64)
    return total


def _check_same_module_on_all_ranks(module: nn.Module, group, expert=None) -> None:
    """Raises on every rank if the parameters differ in name, shape, dtype, requires_grad, device type or
    expert mark across ranks.

    Device *type* only: each rank has its own GPU index.
    """
    if group is None:
        return
    mine = [(n, tuple(p.shape), str(p.dtype), p.requires_grad, p.device.type) for n, p in module.named_parameters()]
    if expert is not None:
        mine = [(*entry, "expert" if expert(n, p) else "dense")
                for entry, (n, p) in zip(mine, module.named_parameters())]
    # First a digest per rank (a few bytes: the full lists of a large model on a thousand ranks would be
    # megabytes per rank, on NCCL in GPU memory); the lists themselves only when the digests differ.
    digest = hashlib.sha256(repr(mine).encode()).hexdigest()
    digests: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(digests, digest, group=group)
    if all(d == digest for d in digests):
        return
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    for rank, theirs in enumerate(gathered):
        if theirs != mine:
            diff = next(((a, b) for a, b in zip(mine, theirs) if a != b), None)
            detail = (f"first difference: this rank has {diff[0]}, rank {rank} has {diff[1]}" if diff
                      else f"this rank has {len(mine)} parameters, rank {rank} has {len(theirs)}")
            raise ValueError(
                "the module's parameters differ across ranks (name, shape, dtype, requires_grad or device type"
                f"{', or expert mark' if expert is not None else ''}); "
                f"{detail}. Build the same model on every rank (same config and seed) before wrapping it."
            )
