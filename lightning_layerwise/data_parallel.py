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
    :meth:`shard_sum`, behind every gradient norm): the time this process was blocked on
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
    dicts, so the check compares the sizes of those dicts and the identities of their
    values, recorded at wrapping, instead of walking ``module.parameters()`` (a
    recursive generator: 0.7 ms per forward for 192 parameters in 145 modules, the
    largest part of the wrapper's forward overhead in
    ``benchmarks/bench_host_overhead.py``); both comparisons, and the storage pointers,
    are lists built by ``map`` in C (60 µs there, from 105 µs for a Python loop over
    the modules). The wrapper holds every recorded object (``_all_params``,
    ``_modules_checked``), so no identity is reused while it compares them. Still
    O(parameters): an assignment to ``.data`` runs no hook, so only reading every
    pointer sees it.

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

Note [split gradients]
    Under ``ddp`` every parameter that received a gradient has a ``.grad``, and code
    relies on that: ``[p for p in model.parameters() if p.grad is not None]`` is how
    many loops pick what to clip. Here a rank holds the reduced gradient only of what
    it steps. A whole parameter's ``.grad`` exists on its owner, which is enough: the
    owner decides whether it counts. A split parameter's gradient exists on no rank,
    only in pieces, so without more it would be ``None`` everywhere and every such
    filter would drop it (the parameters ended 0.06-0.28 away from ``ddp`` that way).
    So on each rank that steps a piece of a split parameter that received a gradient,
    the sync sets the parameter's ``.grad`` to a marker, :class:`~lightning_layerwise.grad_sync.SplitGradient`:
    a tensor whose metadata reads as the parameter's gradient's would (``is not
    None``, shape, dtype, device) but which holds one element broadcast to that shape
    and whose elements cannot be read: any operation on them raises
    :class:`~lightning_layerwise.grad_sync.SplitGradientError`, naming the parameter
    and the ways to get what the reader wants (this rank's piece, a global norm,
    ``elementwise_fill=False``). Returning partial values instead would be silently
    wrong. ``zero_grad(set_to_none=False)`` passes (there is nothing to zero), and a
    deep copy of the model carries ``None``. The gradient utilities count the parameter
    through its piece (Note [parameter lists] in ``clip.py``). A hook run before
    autograd accumulates into the parameter restarts accumulation when it finds the
    marker still there (a bare ``backward()`` after ``optimizer.zero_grad()``
    cleared the pieces but not the marker), so autograd never adds into it.

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
    ``.grad`` was cleared, and on several processes detected (an error naming the
    fix) when it was still the gradient handed out. On one process the handed-out
    gradient is the local one, so that add is plain accumulation: the sync's
    restart carries it. Fabric refuses a bare ``backward`` anyway, and the
    Trainer's hooks always go through the strategy.

    Note [in-place gradients]: a restart before a backward makes each
    parameter's slot of the zeroed buffer its ``.grad`` (where the buffer has the
    parameter's dtype and the optimizer steps the parameter itself, not a piece
    or a master), so autograd adds every gradient straight into the bucket, as
    ``ddp``'s ``gradient_as_bucket_view`` does: no per-parameter copy, and the
    hook only marks the bucket. Other parameters, and a ``.grad`` that arrives
    as a new tensor, take the copy path. A new tensor where the slot was assigned
    is the parameter's whole gradient since the restart (the user cleared or set
    ``.grad``, as in plain autograd only what follows counts; or
    ``backward(create_graph=True)`` summed out of place, already including the
    slot), so it is copied, not added. After the sync every ``.grad`` but those
    handed out is ``None`` again, so between steps nothing differs from the copy
    path.

    The ``.grad`` given is not a view of the buffer but an alias of the slot's
    memory (``_GradRecord.grad``), with a version counter of its own: autograd's
    in-place add bumps it. On one process, which reduces nothing, a parameter
    whose gradient is added in place therefore needs no hook at all (a Python
    hook costs about 1.3 µs per parameter in the call from autograd alone): the
    sync (and ``grads_pending``) reads the counters to tell which parameters
    received a gradient, and takes a ``.grad`` that is another tensor as the
    copy path would. Hooks remain where they do work: on several processes
    (bucket readiness, overlapped reduce-scatters, the errors below) and for
    copy-path parameters (masters, other dtypes). So on one process a second
    gradient in one backward (reentrant checkpointing) and a sparse gradient
    just add into the slot, as plain autograd would; several processes refuse
    them by name, since there a reduced bucket cannot take another gradient.

    A unit whose optimizer-side tensor (a piece or a master) has
    ``requires_grad=False`` gets no gradient, as the model parameter would not
    under ``ddp``: ``LightningModule.toggle_optimizer`` switches off the tensors
    the *optimizer* holds, and on ranks where those are pieces or masters the
    model parameter itself keeps ``requires_grad=True``. Every rank then drops
    its local gradient of that parameter, so the reduction stays consistent.
"""

from __future__ import annotations

import hashlib
import operator
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from itertools import chain

import torch
import torch.distributed as dist
from torch import nn

from . import collectives
from .buffers import Bucket, FlatBuffer, allocate_buffers, view_of
from .grad_sync import _LIVE, GradientSync, GradUnit, _forget, _GradRecord, wrapper_of
from .param_sync import ParameterSync
from .layout import (DEFAULT_BUCKET_SIZE, Layout, ParamSpec, is_bucket_size, newton_schulz_cost, param_specs,
                     plan_layout)
from .process_groups import ProcessGroups
from .read_guard import READ_GUARDS, ReadGuard
from . import read_guard


class LayerwiseDataParallel(GradientSync, ParameterSync, nn.Module):
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
        init_args = {k: v for k, v in locals().items() if k not in ("self", "__class__")}
        super().__init__()
        self._init_args = init_args  # rebuild() wraps the same module again with a new layout
        self.on_new_trainable: Callable[[list[str]], None] | None = None
        """Called with their names when parameters outside the layout became trainable (Note [re-planning]);
        ``None``: that raises."""
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
        self._flag_reduces: list[collectives.Collective] = []  # their all-reduces in flight, one per group
        self._list_verdict = None  # a clipping list's vote not read yet (on an accelerator; Note [parameter lists])
        split_flag = {p: flags[i] for (ps, _), flags in zip(self._split_by_group, self._split_flags)
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
        self._modules_checked = list(module.modules())
        self._structure = _structure_of(self._modules_checked)
        self._trainable = list(self._param_names)
        self._data_ptrs = _data_ptrs_of(self._trainable)
        self._outside = [p for p in self._all_params if p not in self._param_names]  # frozen when wrapped

        self._micro_batch_is_last = True
        self._grads_handed_out = False
        self.compiled_forward = False
        """Whether this wrapper's forward has run inside ``torch.compile`` (Note [compiled wrapper])."""
        self._any_seen = False  # a gradient arrived this accumulation (per parameter: _GradRecord.seen)
        self._next_reduce = 0  # position in _reduce_order of the next bucket to dispatch
        self._gather_queue: list[Bucket] = []  # the buckets the current parameter sync gathers, in order
        self._next_gather = 0  # position in _gather_queue of the next bucket to dispatch
        self._in_flight: list[Bucket] = []

        self._broadcast_from_rank0()
        # What this rank steps, in registration order (Note [gradient lifecycle]).
        self._records: dict[nn.Parameter, _GradRecord] = {
            p: _GradRecord(p, self._grad_views[p], self._bucket_of[p]) for p in self._param_names}
        for p, flag in split_flag.items():
            self._records[p].split_flag = flag
        self._units: list[GradUnit] = []
        for p in self._param_names:
            if p in self._owned:
                self._units.append(GradUnit(p, p, self._grad_views[p], self._bucket_of[p], self._records[p]))
            elif p in self._shards:
                self._units.append(GradUnit(p, self._shards[p], self._shard_grad_views[p], self._bucket_of[p],
                                            self._records[p], split=True))
        self._unit_of: dict[torch.Tensor, GradUnit] = {u.tensor: u for u in self._units}
        self._unit_of.update((u.param, u) for u in self._units)
        self._stepped_apart: dict[nn.Parameter, GradUnit] = {}  # units whose optimizer tensor is not the param
        self._unhooked: list[_GradRecord] = []  # in-place gradients on one process: no hook (Note [in-place gradients])
        self._refresh_stepped_apart()  # registers the gradient hooks
        self._mark_split_gradients()
        self._copies: set[int] = set()  # gradients the last sync handed out as copies (another dtype)
        self._grad_storages = {flat.grads.untyped_storage().data_ptr() for flat in self._flat_buffers}
        self._carry: list[tuple[torch.Tensor, torch.Tensor]] = []  # (own shard, carried values) to add back
        self._registered = [*self._param_names, *self._shards.values()]
        self._live = weakref.ref(self, _forget)
        for t in self._registered:
            _LIVE[id(t)] = self._live
        from . import grad_utils  # imports this module

        grad_utils.install()

        self._hook_handles = []
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
        if self._grads_handed_out:
            return False
        self._collect_unhooked()
        return self._any_seen

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
        if _structure_of(self._modules_checked) != self._structure:
            self._raise_changed()
        if self._outside and any(map(_REQUIRES_GRAD, self._outside)):
            self._new_trainable()
        if _data_ptrs_of(self._trainable) == self._data_ptrs:
            return
        for p, now, ptr in zip(self._trainable, _data_ptrs_of(self._trainable), self._data_ptrs):
            if now != ptr:
                raise RuntimeError(
                        f"parameter {self._param_names[p]!r} no longer lives in its bucket: its .data, dtype or "
                        "device was changed after the module was wrapped (model.half(), .to(), or an assignment "
                        "to .data during training). Convert or move the model before fit, or use the Trainer's "
                        "precision= argument."
                    )

    def _new_trainable(self) -> None:
        """Parameters frozen when the module was wrapped train now: re-plan, or refuse (Note [re-planning])."""
        names = {id(p): n for n, p in self.module.named_parameters()}
        new = [names[id(p)] for p in self._outside if p.requires_grad and id(p) in names]
        if self.on_new_trainable is None:
            raise RuntimeError(
                f"parameters {new[:5]} became trainable (requires_grad=True) after the module was wrapped, and "
                "the layout has no place for their gradients. LayerwiseStrategy, LayerwiseFabricStrategy and "
                "LayerwiseSession re-plan the layout for them by themselves; a LayerwiseDataParallel built by "
                "hand must be rebuilt: wrapper.rebuild(layout) with a layout planned for the new parameters.")
        self.on_new_trainable(new)

    def rebuild(self, layout: Layout, elementwise: Callable[[str, nn.Parameter], bool] | None = None) -> None:
        """Wraps the same module again, in place, with ``layout`` (Note [re-planning]); collective.

        The parameters keep their objects and values; this object stays the one callers hold.
        Buffers, buckets, pieces and hooks are made anew, so optimizers must be given the new
        pieces (:meth:`use_shards_in`) and gradients still held are dropped. Parameter all-gathers
        in flight are completed first.
        """
        keep = {"training": self.training, "comm_wait_seconds": self.comm_wait_seconds,
                "compiled_forward": self.compiled_forward, "events": self.events,
                "on_new_trainable": self.on_new_trainable}
        args = dict(self._init_args, layout=layout, elementwise=elementwise, process_groups=self.process_groups)
        self.release()
        LayerwiseDataParallel.__init__(self, **args)
        for name, value in keep.items():
            setattr(self, name, value)

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
        buffers = list({id(b): b for m in self._modules_checked for b in m._buffers.values()
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
            self._flag_reduces = []
            for bucket in self._buckets:
                bucket.gather = bucket.reduce = None
        for h in self._hook_handles:
            h.remove()
        self._hook_handles = []
        for rec in self._records.values():
            for handle in (rec.hook, rec.split_hook):
                if handle is not None:
                    handle.remove()
            rec.hook = rec.split_hook = rec.split_grad = None
        self._unhooked = []
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
        self._units, self._unit_of, self._stepped_apart, self._carry = [], {}, {}, []
        self._grads_handed_out = False
        if wait:
            self.resolve_list_votes()  # the module is released first: a disagreement raises after that
        self._list_verdict = None
        return self.module


_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_PARAMETERS_OF = operator.attrgetter("_parameters")
_CHILDREN_OF = operator.attrgetter("_modules")


def _structure_of(modules: list[nn.Module]) -> tuple[list[int], ...]:
    """The sizes of ``modules``' ``_parameters`` and ``_modules`` dicts and the identities of their values, in order
    (Note [fixed module]); every loop in C. The objects stay alive while the wrapper holds them, so an identity is
    never reused for another."""
    params = list(map(_PARAMETERS_OF, modules))
    children = list(map(_CHILDREN_OF, modules))
    return (list(map(len, params)), list(map(id, chain.from_iterable(map(dict.values, params)))),
            list(map(len, children)), list(map(id, chain.from_iterable(map(dict.values, children)))))


def _data_ptrs_of(params: list[nn.Parameter]) -> list[int]:
    with torch._C.DisableTorchFunctionSubclass():  # a guarded parameter's Python hook is not needed for a pointer
        return list(map(torch._C.TensorBase.data_ptr, params))


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
    "split_flags": "all-reduce of which split parameters got a gradient (end of backward)",
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
