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

Note [stale reads]
    Forward pre-hooks wait for the buckets of a module's own parameters. Every
    other read of a parameter whose bucket is still in flight (a module that is
    never called, a parent reading ``child.weight``, a hook or ``training_step``
    code before the forward, a callback between steps) is caught by the read
    guard, Note [read guard] in ``engine/read_guard.py``: with ``param_read_guard="wait"``
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

Note [conditional experts]
    All-gathers are dispatched lazily, in bucket order, by the forward pre-hooks of the
    modules that hold the buckets, and a rank waits for a bucket before its module runs.
    A mixture of experts calls an expert only where its tokens reach it
    (``examples/moe.py``, Hugging Face's MoE blocks), so ranks run different pre-hooks; a
    rank that skipped its last experts can then enter the layer's own collective (the
    token all-to-all) without having issued the gathers another rank waits for in an
    expert's pre-hook, and each waits for the other. So the buckets of a marked expert
    container (``llw.mark_experts``) are gathered by the pre-hook of the layer holding it,
    which runs on every rank: every rank issues the same gathers at the same point of the
    forward. Unmarked experts keep their own pre-hooks (every module must then run on
    every rank, as under FSDP); sharded parameters require the mark (Note [sharded
    experts] in ``engine/sharded.py``).

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
    A split parameter (Note [element-wise fill] in ``layout/packing.py``) is stepped in
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
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import operator
import warnings
import weakref
from collections.abc import Callable, Iterator
from itertools import chain
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

from . import collectives
from .buffers import (Bucket, FlatBuffer, ParamState, allocate, allocate_buffers, allocate_shards, build_buckets,
                      cut_shard, free, is_dense_permutation, meta_buffers, single_device, view_of)
from .materialize import check_materializable, has_meta_tensors, materialize
from .sharded_init import ParameterPublisher
from .grad_records import GradUnit
from .grad_sync import GradientSync
from .live_wrappers import _LIVE, _forget, wrapper_of
from .param_sync import ParameterSync
from .sharded import ShardedParameterSync
from .waiter import CollectiveError, Waiter  # noqa: F401  CollectiveError: its import path since 0.1
from ..experts import marked_containers
from ..layout import (DEFAULT_BUCKET_SIZE, Layout, ParamSpec, is_bucket_size, newton_schulz_cost, param_specs,
                      plan_layout, resolve_bucket_size, resolve_prefetch_depth)
from ..optim.matrices import matrix_shapes, matrix_views
from .process_groups import ProcessGroups, Ranks
from .read_guard import READ_GUARDS, ReadGuard
from . import read_guard


class LayerwiseDataParallel(nn.Module):
    """Data-parallel wrapper with shard-aligned buckets and layer-wise ownership.

    Args:
        module: the model. Its trainable parameters become views into flat buffers.
        process_groups: the groups to talk over; default: :meth:`ProcessGroups.create`.
        bucket_size: bucket length in elements; ``"auto"``: ``layout.resolve_bucket_size``'s.
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
            stepped in pieces (Note [element-wise fill] in ``layout/packing.py``, Note [pieces]).
            Default: none, every parameter is owned whole.
        expert: which parameters are expert parameters, as a predicate on ``(name, parameter)``:
            they get buffers of their own, reduced and gathered over the expert
            data-parallel group of ``process_groups`` (Note [expert parallelism] in
            ``engine/process_groups.py``). Default: none.
        layout: the plan to use, made once by the caller (the session chooses the owner group
            size by planning, and hands that plan down); it must be planned from
            :func:`layout_specs` of ``module`` for the owner group of ``process_groups``.
            Default: planned here.
        shard_parameters: keep only this rank's shard of every bucket's parameters and gradients between
            uses (Note [sharded parameters] in ``engine/buffers.py``); buckets are gathered for each forward
            and backward (Note [when a bucket is full] in ``engine/sharded.py``).
        reshard_after_forward: with ``shard_parameters``, free buckets during the forward and gather them
            again for the backward (``False``: keep them from the forward to the backward).
        device: where a model built on the meta device is materialized (Note [meta-device models] in
            ``engine/materialize.py``); default: the current CUDA device under NCCL, else the CPU.
    """

    def __init__(
        self,
        module: nn.Module,
        process_groups: ProcessGroups | None = None,
        bucket_size: int | Literal["auto"] = "auto",
        overlap_grad_reduce: bool = True,
        overlap_param_gather: bool = True,
        prefetch_depth: int | Literal["auto"] = "auto",
        grad_reduce_dtype: torch.dtype | None = None,
        broadcast_buffers: bool = True,
        cost: Callable[[ParamSpec], float] = newton_schulz_cost,
        trace: bool = False,
        param_read_guard: ReadGuard = "wait",
        elementwise: Callable[[str, nn.Parameter], bool] | None = None,
        expert: Callable[[str, nn.Parameter], bool] | None = None,
        layout: Layout | None = None,
        shard_parameters: bool = False,
        reshard_after_forward: bool = True,
        device: torch.device | None = None,
    ) -> None:
        init_args = {k: v for k, v in locals().items() if k not in ("self", "__class__")}
        super().__init__()
        bucket_size = resolve_bucket_size(bucket_size, shard_parameters)
        prefetch_depth = resolve_prefetch_depth(prefetch_depth, shard_parameters)
        _check_arguments(bucket_size, prefetch_depth, param_read_guard)
        self._init_args = init_args  # rebuild() wraps the same module again with a new layout
        self.on_new_trainable: Callable[[list[str]], None] | None = None
        # what ends this wrapper's run (its session's release, which also destroys the groups): llw.release calls it
        self.ended_by: Callable[[], object] | None = None
        """Called with their names when parameters outside the layout became trainable (Note [re-planning] in
        ``session.py``); ``None``: that raises."""
        self.module, self.param_read_guard, self.broadcast_buffers = module, param_read_guard, broadcast_buffers
        self.overlap_grad_reduce, self.prefetch_depth = overlap_grad_reduce, prefetch_depth
        self.process_groups = process_groups if process_groups is not None else ProcessGroups.create()
        self.ranks = Ranks.of(self.process_groups)
        reject_sparse_gradients(module)
        specs = layout_specs(module, elementwise=elementwise, expert=expert)
        if not specs:
            raise ValueError(
                f"{type(module).__name__} has no trainable parameter (none with requires_grad=True); "
                "there is nothing to train data-parallel. Unfreeze a parameter or do not wrap the module.")
        _check_same_module_on_all_ranks(module, self.process_groups.dp, expert)
        self.layout: Layout = self._layout_for(specs, layout, bucket_size, cost)
        self.expert_names = frozenset(s.name for s in specs if s.kind == "expert") | (
            {n for n, p in module.named_parameters() if expert(n, p)} if expert is not None else set())
        """The expert parameters' names (frozen ones included): reduced over the expert data-parallel group."""
        self.shard_parameters = shard_parameters and self.process_groups.dp is not None
        """Whether each rank holds only its shard of the parameters (one process holds everything anyway)."""
        self.replaced_parameters: dict[int, nn.Parameter] = {}
        """A model built on the meta device (Note [meta-device models] in ``engine/materialize.py``): ``id`` of each
        meta parameter -> the parameter that replaced it (optimizers holding the former must take the latter)."""
        meta = has_meta_tensors(module)
        if meta and shard_parameters:
            check_materializable(module, self._materialize_device(device))  # before any collective, every rank alike
            if not self.shard_parameters:  # one process: nothing to shard, the whole model is materialized
                self.replaced_parameters = materialize(module, self._materialize_device(device))
        elif meta and all(p.is_meta for p in module.parameters() if p.requires_grad):
            raise ValueError(
                "the module's parameters are on the meta device; strategy='layerwise' materializes a meta-device "
                "model only with shard_parameters=True (bucket by bucket, Note [meta-device models] in "
                "engine/materialize.py). Pass shard_parameters=True, or build the model on its device.")
        named = dict(module.named_parameters())
        self._param_names: dict[nn.Parameter, str] = {named[s.name]: s.name for s in specs}
        if self.shard_parameters:
            _check_sharding(self.layout, param_read_guard, named, self._param_names)
        if self.shard_parameters:
            # Bucket by bucket (Note [sharded parameters] in ``engine/buffers.py``): no full buffer of the whole
            # model is ever made; the buckets start as shapes on the meta device.
            self._flat_buffers = meta_buffers(self.layout, grad_reduce_dtype)
        else:
            self._flat_buffers = allocate_buffers(self.layout, {s.name: named[s.name] for s in specs},
                                                  grad_reduce_dtype)
        self._buckets = build_buckets(self.layout, self._flat_buffers, named, [s.name for s in specs],
                                      self.process_groups, self.ranks)
        if self.shard_parameters:
            if meta:
                self._flat_buffers = self._materialize_sharded(named, self._materialize_device(device))
                named = dict(module.named_parameters())
                self._param_names = {named[s.name]: s.name for s in specs}
            else:
                self._flat_buffers = self._shard_bucket_by_bucket(named)
            self._broadcast_from_rank0(layout_buffers=False)
        self._bucket_of: dict[nn.Parameter, Bucket] = {p: b for b in self._buckets for p in b.params}
        if not self.shard_parameters:
            self._broadcast_from_rank0()
        # Which groups average in the reduction, tried on each once (Note [averaging] in engine/collectives.py).
        averaged = {id(g): g for b in self._buckets for g in (b.group, b.replica_group) if g is not None}
        for group in averaged.values():
            collectives.probe_averaging(group, self._flat_buffers[0].grads.device)
        self._waiter = Waiter(self.dp_rank, self.dp_size, trace)
        self._end_of_backward_queued = False
        self.grad_sync = self._gradient_side(overlap_grad_reduce)
        every_read_guarded = self._guard_reads(named)
        gather_order = sorted(self._buckets, key=lambda b: b.first_param)
        if self.shard_parameters:
            self.param_sync = ShardedParameterSync(
                gather_order, self._param_names, self._waiter, stepped_whole=self.grad_sync.stepped_whole,
                prefetch_depth=prefetch_depth, reshard_after_forward=reshard_after_forward,
                read_guard=param_read_guard, on_backward=self._backward_started, write_back=self._write_back_pieces)
        else:
            self.param_sync = ParameterSync(
                gather_order, self._param_names, self._waiter,
                prefetch_depth=prefetch_depth, overlap=overlap_param_gather and every_read_guarded,
                read_guard=param_read_guard, gathers=self.process_groups.dp is not None)
        self._record_structure()
        self.compiled_forward = False
        """Whether this wrapper's forward has run inside ``torch.compile`` (Note [compiled wrapper])."""
        self._register_live()
        self._hook_handles = self._register_forward_pre_hooks() if self.process_groups.dp is not None else []

    # --- set-up ------------------------------------------------------------------------------------------------------
    def _layout_for(self, specs: list[ParamSpec], layout: Layout | None, bucket_size: int,
                    cost: Callable[[ParamSpec], float]) -> Layout:
        """The layout planned here for the owner group, or the one handed in, checked to fit."""
        r = self.ranks
        if layout is None:
            return plan_layout(specs, r.owner_size, bucket_size, cost, expert_dp=r.expert_owner_size,
                               follow_layers=self._init_args["shard_parameters"],
                               replicas=r.replicas, expert_replicas=r.expert_replicas)
        _check_layout(layout, specs, r.owner_size, bucket_size, r.expert_owner_size, r.replicas, r.expert_replicas)
        return layout

    def _gradient_side(self, overlap_grad_reduce: bool) -> GradientSync:
        """The gradient side over this layout: what this rank steps whole, and its pieces of split parameters
        as parameters of their own viewing the param buffer (Note [pieces])."""
        grad_views, owned, split, pieces = {}, set(), [], {}
        stepped_slots = {} if self.shard_parameters else None
        if self.shard_parameters:
            grad_views = self._full_gradient_views()
        for p, name in self._param_names.items():
            slot = self.layout.params[name]
            bucket = self._bucket_of[p]
            if self.shard_parameters:
                # Note [sharded parameters] in ``engine/buffers.py``: local gradients go to the full buffer; what
                # this rank steps is handed its slot of the shard.
                params_of, grads_of, base = bucket.param_shard, bucket.grad_shard, bucket.start + bucket.shard[0]
            else:
                # Strided as the parameter, so the reduced gradient keeps its memory format (Note [memory format]
                # in ``engine/buffers.py``).
                grad_views[p] = view_of(self._flat_buffers[slot.buffer].grads, slot, like=p)
                flat = self._flat_buffers[slot.buffer]
                params_of, grads_of, base = flat.params, flat.grads, 0
            if not slot.split:
                if slot.owner == self.rank_for(name):
                    owned.add(p)
                    if stepped_slots is not None:
                        stepped_slots[p] = view_of(grads_of, slot, like=p, offset=slot.offset - base)
                continue
            split.append(p)
            piece = slot.piece_of(self.rank_for(name))
            if piece is not None:
                begin, end = slot.offset + piece.start - base, slot.offset + piece.stop - base
                pieces[p] = (nn.Parameter(params_of[begin:end], requires_grad=p.requires_grad), grads_of[begin:end])
        return GradientSync(
            self._buckets, self._flat_buffers, self._param_names, grad_views, owned, split, pieces, self._waiter,
            groups=self.process_groups, layout_group=self.layout_group, experts=self.expert_names,
            expert_parallel_size=self.expert_parallel_size, overlap_grad_reduce=overlap_grad_reduce,
            before_reduce=self.finish_param_sync, sharded=self.shard_parameters, stepped_slots=stepped_slots,
            on_backward=self._backward_started, grads_done=self._grads_done,
            reduces_in_flight=self.prefetch_depth)

    def _materialize_device(self, device: torch.device | None) -> torch.device:
        if device is not None:
            return torch.device(device)
        group = self.process_groups.dp
        if group is not None and dist.get_backend(group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _materialize_sharded(self, named: dict[str, nn.Parameter], device: torch.device) -> list[FlatBuffer]:
        """A meta-device model with sharded parameters (Note [meta-device models] in ``engine/materialize.py``):
        each parameter is published into the shards as soon as its value is final, and each bucket pointed at its
        shard once complete (Note [publishing parameters one by one] in ``engine/sharded_init.py``). Returns the
        buffers of the shards."""
        plans = [bp for plan in self.layout.buffers for bp in plan.buckets]  # build_buckets' order
        dtypes = [(flat.params.dtype, flat.grads.dtype) for flat in self._flat_buffers]
        sharded = allocate_shards(self.layout, self._buckets, dtypes, device)
        groups = self.process_groups
        publisher = ParameterPublisher(
            self.layout, self._buckets, {id(b): bp for b, bp in zip(self._buckets, plans)},
            {id(p): n for n, p in named.items()}, [d for d, _ in dtypes], self._stepped_whole_names(), device,
            group_of=lambda bucket: groups.expert_dp if bucket.expert else groups.dp)
        self.replaced_parameters = materialize(self.module, device, publisher.final, publisher.memory_for)
        publisher.check_complete()
        for bucket in self._buckets:
            bucket.params = [self.replaced_parameters.get(id(p), p) for p in bucket.params]
        return sharded

    def _full_gradient_views(self) -> dict[nn.Parameter, torch.Tensor]:
        """Each parameter's slot of its bucket's full gradient buffer, strided as the parameter, made bucket by
        bucket (a view of a freed storage cannot be made; the buffer is freed again at once)."""
        views = {}
        for bucket in self._buckets:
            allocate(bucket.grad_data)
            for p in bucket.params:
                slot = self.layout.params[self._param_names[p]]
                views[p] = view_of(bucket.grad_data, slot, like=p, offset=slot.offset - bucket.start)
            free(bucket.grad_data)
        return views

    def _shard_bucket_by_bucket(self, named: dict[str, nn.Parameter]) -> list[FlatBuffer]:
        """Sharded parameters of a model built on its device: each bucket is filled from its parameters, broadcast
        from the first rank of its group, cut to this rank's shard and freed in turn, so a rank holds the model as
        built plus one bucket (Note [sharded parameters] in ``engine/buffers.py``). Returns the shards' buffers."""
        trainable = [named[n] for n in self._param_names.values()]
        device = single_device(trainable, "the trainable parameters")
        relaid = [n for n in self._param_names.values() if not named[n].is_contiguous()
                  and not is_dense_permutation(named[n])]
        if relaid:
            warnings.warn(f"parameters {relaid[:3]} have strides with gaps or overlaps; strategy='layerwise' keeps "
                          "them contiguous in its buffers (Note [memory format]).", stacklevel=4)
        plans = [bp for plan in self.layout.buffers for bp in plan.buckets]  # build_buckets' order
        dtypes = [(flat.params.dtype, flat.grads.dtype) for flat in self._flat_buffers]
        sharded = allocate_shards(self.layout, self._buckets, dtypes, device)
        stepped = self._stepped_whole_names()
        with torch.no_grad():
            for bucket, bp in zip(self._buckets, plans):
                full = torch.zeros(bp.numel, dtype=dtypes[bucket.buffer][0], device=device)
                for name in bp.params:
                    p, slot = named[name], self.layout.params[name]
                    view_of(full, slot, like=p, offset=slot.offset - bp.start).copy_(p.detach())
                self._publish_bucket(bucket, bp, named, stepped, full)  # the parameters' own memory goes
        return sharded

    def _publish_bucket(self, bucket: Bucket, bp, named: dict[str, nn.Parameter], stepped: set[str],
                        full: torch.Tensor) -> None:
        """Set-up with sharded parameters: ``full`` (the bucket's parameters) is broadcast from the first rank of
        the bucket's group, so every replica holds the same values, then cut to this rank's shard and freed."""
        group = self.process_groups.expert_dp if bucket.expert else self.process_groups.dp
        collectives.broadcast_tensors([full], group)
        cut_shard(bucket, bp, self.layout, named, stepped, full)

    def _stepped_whole_names(self) -> set[str]:
        """The parameters this rank steps whole (with sharded parameters they view their bucket's shard)."""
        return {n for n in self._param_names.values()
                if not self.layout.params[n].split and self.layout.params[n].owner == self.rank_for(n)}

    # --- sharded parameters (Note [when a bucket is full] in ``engine/sharded.py``) ---------------------------
    def _backward_started(self) -> None:
        """A backward reached this wrapper (a gradient arrived or a saved parameter was unpacked): the end of the
        backward frees what it gathered and reduces what it accumulated."""
        if not self._end_of_backward_queued:
            self._end_of_backward_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self._end_of_backward_queued = False
        self.grad_sync.end_of_backward()
        self.param_sync.end_of_backward()

    def _grads_done(self, bucket: Bucket) -> None:
        self.param_sync.grads_done(bucket)

    @contextlib.contextmanager
    def full_parameters(self):
        """Every parameter whole on this rank inside (collective: every rank enters it). With sharded parameters
        it gathers every bucket, and frees them on exit; writes inside persist where they land in this rank's
        shard (a parameter it steps whole, its piece of a split one), so a write every rank makes alike (loading
        a state dict) persists. Without sharding, it waits for the all-gathers in flight."""
        if not self.shard_parameters:
            self.finish_param_sync()
            yield
            return
        with self.param_sync.held_full():
            yield

    def _write_back_pieces(self) -> None:
        """Sharded parameters: what was written into a split parameter whose bucket is full reaches this rank's
        piece of it (whole parameters this rank steps view its shard: nothing to do)."""
        with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
            for p, piece in self.grad_sync.pieces.items():
                if self._bucket_of[p].param_state is ParamState.READY:
                    where = self.piece_of(p)
                    piece.copy_(p.reshape(-1)[where.start:where.stop])

    def held_full(self, buckets: list[Bucket]):
        """Sharded parameters: a context inside which ``buckets`` are full (collective; every rank names the same
        buckets). Writes into their split parameters reach this rank's pieces on exit."""
        return self.param_sync.held(buckets)

    @property
    def split_buckets(self) -> list[Bucket]:
        """The buckets holding a split parameter, in all-gather order (the same on every rank)."""
        split = {id(self._bucket_of[p]) for p, n in self._param_names.items() if self.layout.params[n].split}
        return [b for b in self.param_sync.gather_order if id(b) in split]

    def _unshard_for_release(self) -> set[nn.Parameter]:
        """``release()`` with sharded parameters (Note [sharded release] in ``engine/sharded.py``): every trainable
        parameter gets its own storage holding its full value, bucket by bucket (collective). Returns them."""
        self.grad_sync.zero_grad_buffer()  # a released module has no gradient: the shards go before the gather
        params = list(self._param_names)
        nbytes = sum(p.numel() * p.element_size() for p in params)
        target = _release_device(params[0].device, nbytes) if params else torch.device("cpu")
        own: set[nn.Parameter] = set()

        def into_own_storage(bucket: Bucket) -> None:
            with torch.no_grad():
                for p in bucket.params:
                    read_guard.detach(p)
                    p.data = p.data.to(target, copy=True)
                    own.add(p)

        self.param_sync.gather_each(into_own_storage)
        return own

    def _readable(self, p: nn.Parameter) -> bool:
        """Whether ``p``'s values are held on this rank now (always, unless sharded and its bucket is freed)."""
        return not self.shard_parameters or p in self.grad_sync.stepped_whole \
            or self._bucket_of[p].param_state is ParamState.READY

    def _guard_reads(self, named: dict[str, nn.Parameter]) -> bool:
        """Attaches the read guard to the parameters (Note [stale reads]); whether all-gathers may overlap the
        forward, which needs every parameter guarded."""
        if self.param_read_guard == "off":
            return True
        unguardable = [n for p, n in self._param_names.items() if not read_guard.can_guard(p)]
        if unguardable and self._init_args["overlap_param_gather"]:
            warnings.warn(
                f"parameters {unguardable[:3]} are of class {type(named[unguardable[0]]).__name__}, not "
                "nn.Parameter, so reads of them outside their module cannot be made to wait for the "
                "all-gather; parameters are all-gathered before start_param_sync() returns instead "
                "(overlap_param_gather=False).", stacklevel=3)
        for p in self._param_names:
            if read_guard.can_guard(p):
                read_guard.attach(p, self._on_pending_read)
        return not unguardable

    def _register_live(self) -> None:
        """Lets the gradient utilities find this wrapper behind its parameters and pieces (``engine/grad_utils.py``)."""
        self._registered = [*self._param_names, *self.grad_sync.pieces.values()]
        self._live = weakref.ref(self, _forget)
        for t in self._registered:
            _LIVE[id(t)] = self._live

    def _on_pending_read(self, param: nn.Parameter, func: Callable) -> None:
        self.param_sync.on_pending_read(param, func)

    def _record_structure(self) -> None:
        """What every training forward checks is still so (Note [fixed module])."""
        self._all_params = list(self.module.parameters())
        self._modules_checked = list(self.module.modules())
        self._structure = _structure_of(self._modules_checked)
        self._trainable = list(self._param_names)
        self._data_ptrs = self._places_of(self._trainable)
        self._outside = [p for p in self._all_params if p not in self._param_names]  # frozen when wrapped

    def _register_forward_pre_hooks(self) -> list:
        """One pre-hook per module holding parameters: its buckets are ready before it runs. The buckets of marked
        experts (``llw.mark_experts``) are gathered by the layer that holds them, which runs on every rank whichever
        experts its tokens reach (Note [conditional experts]; with sharded parameters Note [sharded experts] in
        ``engine/sharded.py``)."""
        handles = []
        order = {id(b): i for i, b in enumerate(self.param_sync.gather_order)}
        by_layer = self._expert_buckets_by_layer(every=self.shard_parameters)
        routed = {id(b) for buckets in by_layer.values() for b in buckets}
        for module in self.module.modules():
            own = [b for b in map(self._bucket_of.get, module.parameters(recurse=False))
                   if b is not None and id(b) not in routed]
            buckets = list({id(b): b for b in own + by_layer.get(module, [])}.values())
            if buckets:
                buckets.sort(key=lambda b: order[id(b)])
                handles.append(module.register_forward_pre_hook(self.param_sync.forward_pre_hook(buckets)))
            if module in by_layer and self.shard_parameters:
                handles.append(module.register_forward_hook(self.param_sync.before_backward_of(by_layer[module])))
        return handles

    def _expert_buckets_by_layer(self, every: bool) -> dict[nn.Module, list[Bucket]]:
        """The expert buckets of each layer holding a marked expert container (``llw.mark_experts``): its
        parent, which runs on every rank whichever experts its tokens reach. ``every``: every expert bucket must
        be in a marked container (sharded parameters)."""
        layers: dict[nn.Module, list[Bucket]] = {}
        for path, container in marked_containers(self.module).items():
            parent = self.module.get_submodule(path.rpartition(".")[0]) if path else self.module
            buckets = {id(b): b for b in map(self._bucket_of.get, container.parameters()) if b is not None}
            layers.setdefault(parent, []).extend(b for b in buckets.values() if b.expert)
        unmarked = sorted({b.name for b in self._buckets if b.expert}
                          - {b.name for buckets in layers.values() for b in buckets})
        if unmarked and every:
            raise ValueError(
                f"shard_parameters=True with expert parameters outside a container marked with llw.mark_experts "
                f"(buckets {unmarked[:3]}): their layer must gather them whichever experts its tokens reach. "
                "Mark each layer's expert container with llw.mark_experts(experts, num_experts=...).")
        return layers

    # --- ranks -------------------------------------------------------------------------------------------------------
    dp_size = property(lambda self: self.ranks.dp_size, doc="Ranks in the data-parallel group.")
    dp_rank = property(lambda self: self.ranks.dp_rank, doc="This rank's position in the data-parallel group.")
    owner_size = property(lambda self: self.ranks.owner_size,
                          doc="Ranks in an owner group (Note [owner groups] in ``engine/process_groups.py``).")
    owner_rank = property(lambda self: self.ranks.owner_rank, doc="This rank's position in its owner group.")
    replicas = property(lambda self: self.ranks.replicas, doc="Owner groups sharing each shard's stepping.")
    layout_rank = property(lambda self: self.ranks.layout_rank,
                           doc="Which dense pieces this rank steps: ``replica * g + position`` (Note [replica "
                               "sharing] in ``layout/sharing.py``).")
    expert_parallel_size = property(lambda self: self.ranks.expert_parallel_size,
                                    doc="Ranks holding different experts (1: no expert parallelism).")
    expert_dp_rank = property(lambda self: self.ranks.expert_dp_rank,
                              doc="This rank's position in its expert data-parallel group.")
    expert_replicas = property(lambda self: self.ranks.expert_replicas,
                               doc="Expert owner groups sharing each expert shard's stepping.")
    expert_owner_rank = property(lambda self: self.ranks.expert_owner_rank,
                                 doc="This rank's position in its expert owner group.")

    def rank_for(self, name: str) -> int:
        """This rank's index among the owners of parameter ``name``'s pieces: its position in the expert
        data-parallel group for experts, else :attr:`layout_rank`."""
        return self.expert_dp_rank if name in self.expert_names and self.expert_parallel_size > 1 \
            else self.layout_rank

    @property
    def layout_group(self) -> dist.ProcessGroup | None:
        """The group whose ranks, in order, are the owners of the dense pieces (Note [replica sharing] in
        ``layout/sharing.py``)."""
        return self.process_groups.dp if self.replicas > 1 else self.process_groups.owner_group

    # --- public queries -------------------------------------------------------------
    def owns(self, param: nn.Parameter) -> bool:
        """True if this rank steps all of ``param`` (its whole gradient lands in this rank's shard)."""
        return self.grad_sync.owns(param)

    def owned_parameters(self) -> Iterator[nn.Parameter]:
        """What this rank steps: its whole parameters and its pieces of split ones (Note [pieces])."""
        return (n_p[1] for n_p in self.named_owned_parameters())

    def named_owned_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """:meth:`owned_parameters` with the name of the model parameter each is (part of)."""
        for p, n in self._param_names.items():
            unit = self.grad_sync.unit_of(p)
            if unit is not None:
                yield n, unit.tensor

    def shard_of(self, param: nn.Parameter) -> nn.Parameter | None:
        """This rank's piece of a split parameter, as a flat parameter viewing the param buffer
        (``None`` if ``param`` is not split or this rank steps none of it). See Note [pieces]."""
        return self.grad_sync.piece(param)

    def piece_of(self, param: nn.Parameter):
        """The :class:`~lightning_layerwise.layout.Piece` of ``param`` this rank steps, or ``None``."""
        name = self._param_names.get(param)
        return self.layout.params[name].piece_of(self.rank_for(name)) if name is not None \
            else None

    def use_shards_in(self, optimizer: torch.optim.Optimizer) -> None:
        """Puts this rank's pieces of split parameters in ``optimizer`` in place of the parameters.

        A split parameter this rank steps none of stays: it never gets a gradient here, so
        the optimizer skips it. Optimizer state created before the swap follows its parameter
        (sliced to the piece). See Note [pieces].
        """
        pieces = self.grad_sync.pieces
        for group in optimizer.param_groups:
            group["params"] = [pieces.get(p, p) for p in group["params"]]
        for p, shard in pieces.items():
            if p in optimizer.state:
                piece = self.piece_of(p)
                cut = {k: (v, piece.cut(v, p.shape)) for k, v in optimizer.state.pop(p).items()}
                optimizer.state[shard] = {k: c.clone() if c is not v else v for k, (v, c) in cut.items()}

    def named_layout_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """``(name, parameter)`` of every parameter the layout places (the trainable ones), as
        ``named_parameters()`` gives them."""
        return ((n, p) for p, n in self._param_names.items())

    def named_parameters_in_layout(self) -> Iterator[tuple[nn.Parameter, str]]:
        """The former form of :meth:`named_layout_parameters`, ``(parameter, name)``."""
        return iter(self._param_names.items())

    @property
    def buckets(self) -> list[Bucket]:
        return list(self._buckets)

    @property
    def flat_buffers(self) -> list[FlatBuffer]:
        """The flat param and grad tensors, one pair per layout buffer."""
        return list(self._flat_buffers)

    # --- the gradient side (GradientSync) ----------------------------------------------------------------------
    def no_sync(self):
        """Backward passes inside accumulate gradients locally; the next one outside reduces the sum."""
        return self.grad_sync.no_sync()

    def prepare_backward(self) -> None:
        """Call before a backward: after a sync, restarts accumulation (Note [gradient lifecycle] in
        ``engine/grad_sync.py``)."""
        self.grad_sync.prepare_backward()

    def finish_grad_sync(self) -> None:
        """Waits for every reduce-scatter, then hands what this rank steps its reduced gradient
        (:meth:`GradientSync.finish`)."""
        self.grad_sync.finish()

    def zero_grad_buffer(self) -> None:
        """Drops every gradient: zeros the gradient buffers and sets every ``.grad`` this wrapper gave to ``None``."""
        self.grad_sync.zero_grad_buffer()

    @property
    def reduces_on_backward(self) -> bool:
        """False inside :meth:`no_sync`: backward then only accumulates locally."""
        return self.grad_sync.reduces_on_backward

    @property
    def grads_pending(self) -> bool:
        """Gradients exist that :meth:`finish_grad_sync` has not reduced, so no optimizer may step yet."""
        return self.grad_sync.grads_pending

    @property
    def grads_synced(self) -> bool:
        """True from :meth:`finish_grad_sync` until the next backward restarts accumulation."""
        return self.grad_sync.grads_synced

    def set_master(self, tensor: torch.Tensor, master: torch.Tensor) -> None:
        """Declares ``master`` the float32 tensor the optimizer steps for ``tensor`` (``bf16-true``)."""
        self.grad_sync.set_master(tensor, master)
        _LIVE[id(master)] = self._live
        self._registered.append(master)

    def grads_are_finite(self) -> bool:
        """Whether every rank's reduced gradients are finite (collective)."""
        return self.grad_sync.grads_are_finite()

    def grad_norm_squared(self) -> torch.Tensor:
        """Sum of squares of the full reduced gradient (collective)."""
        return self.grad_sync.grad_norm_squared()

    def shard_sum(self, fn: Callable[[torch.Tensor], torch.Tensor], units: list[GradUnit] | None = None,
                  extra: torch.Tensor | None = None) -> torch.Tensor:
        """``fn`` summed over the whole reduced gradient, once per element (:meth:`GradientSync.shard_sum`)."""
        return self.grad_sync.shard_sum(fn, units, extra)

    def own_shard(self, bucket: Bucket) -> torch.Tensor:
        """What this rank steps of ``bucket``'s gradient; after the sync, the mean over every rank."""
        return self.grad_sync.own_shard(bucket)

    @property
    def owned_units(self) -> list[GradUnit]:
        """Everything this rank steps, in registration order."""
        return self.grad_sync.owned_units

    def unit_of(self, tensor: torch.Tensor) -> GradUnit | None:
        """What this rank steps of ``tensor`` (a parameter, a piece or a master), or ``None``."""
        return self.grad_sync.unit_of(tensor)

    def units_of(self, tensors) -> list[GradUnit]:
        """What this rank steps of ``tensors`` (each unit once, in list order)."""
        return self.grad_sync.parameter_lists.units_of(tensors)

    def units_and_votes(self, tensors) -> tuple[list[GradUnit], torch.Tensor]:
        """:meth:`units_of` ``tensors`` and this rank's vote on the list (Note [parameter lists] in
        ``engine/clip.py``)."""
        return self.grad_sync.parameter_lists.units_and_votes(tensors)

    def check_list_votes(self, votes: torch.Tensor, what: str) -> None:
        """Raises on every rank alike if the summed votes show lists that disagree
        (:meth:`ParameterLists.check_votes`)."""
        self.grad_sync.parameter_lists.check_votes(votes, what)

    def resolve_list_votes(self) -> None:
        """Reads a verdict left on an accelerator by :meth:`check_list_votes`, raising as it would have."""
        self.grad_sync.parameter_lists.resolve_votes()

    def layout_parameter_of(self, tensor: torch.Tensor) -> nn.Parameter | None:
        """The model parameter ``tensor`` is, or is this rank's piece or master of; ``None`` outside the layout."""
        return self.grad_sync.layout_parameter_of(tensor)

    def owns_tensor(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is one this wrapper trains: a parameter in its layout, a piece or a master."""
        return self.grad_sync.owns_tensor(tensor)

    def is_expert(self, param: nn.Parameter) -> bool:
        """Whether ``param`` is an expert parameter reduced over its expert data-parallel group."""
        return self.grad_sync.is_expert(param)

    def handed_out_gradient(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is a gradient the last sync handed out (a ``.grad`` or ``main_grad``)."""
        return self.grad_sync.handed_out_gradient(tensor)

    def clear_stepped_grad(self, param: nn.Parameter, set_to_none: bool = True) -> None:
        """``param.grad`` was cleared: clear what the optimizer holds in its place (a piece, a master)."""
        self.grad_sync.clear_stepped_grad(param, set_to_none)

    def buckets_of(self, tensors) -> list[Bucket]:
        """The buckets holding any of ``tensors`` (parameters, pieces or masters), in all-gather order."""
        return self.grad_sync.buckets_of(tensors)

    # --- the parameter side (ParameterSync) --------------------------------------------------------------------
    def start_param_sync(self, force_sync: bool = False, tensors=None) -> None:
        """Starts all-gathering the buckets (those holding ``tensors``, the same set on every rank, if given)
        from each rank's shard of the param buffer (:meth:`ParameterSync.start`)."""
        self.param_sync.start(None if tensors is None else self.buckets_of(tensors), force_sync)

    def finish_param_sync(self) -> None:
        """Dispatches and waits for every outstanding all-gather (before eval, checkpoints, a step)."""
        self.param_sync.finish()

    @property
    def overlap_param_gather(self) -> bool:
        """All-gathers overlap the next forward (else :meth:`start_param_sync` completes them)."""
        return self.param_sync.overlap

    @property
    def guarded_reads(self) -> int:
        """Reads that had to wait for their bucket outside a forward pre-hook (Note [stale reads])."""
        return self.param_sync.guarded_reads

    @property
    def comm_wait_seconds(self) -> dict[str, float] | None:
        """Seconds blocked in waits, by collective; ``None``: not timed. See Note [timing communication waits] in
        ``engine/waiter.py``; set it to ``{}`` to start timing."""
        return self._waiter.seconds

    @comm_wait_seconds.setter
    def comm_wait_seconds(self, value: dict[str, float] | None) -> None:
        self._waiter.seconds = value

    @property
    def events(self) -> list[tuple[str, str]] | None:
        """The collective events, ``(event, bucket)``, when built with ``trace=True``."""
        return self._waiter.events

    @events.setter
    def events(self, value: list[tuple[str, str]] | None) -> None:
        self._waiter.events = value

    def forward(self, *args, **kwargs):
        if torch.compiler.is_compiling():
            self.compiled_forward = True  # Note [compiled wrapper]
        self._before_forward()
        if not self.shard_parameters:
            return self.module(*args, **kwargs)
        # Note [when a bucket is full] in ``engine/sharded.py``: reads inside gather on demand; what autograd saves
        # of a bucket is gathered again for the backward.
        with self.param_sync.reads_allowed():
            if not torch.is_grad_enabled():  # no backward follows: nothing stays full after it
                try:
                    return self.module(*args, **kwargs)
                finally:
                    self.param_sync.reshard_all()
            with self.param_sync.saved_tensors_hooks():
                return self.module(*args, **kwargs)

    @torch.compiler.disable
    def _before_forward(self) -> None:
        """The step's bookkeeping before a training forward, always run eagerly (Note [compiled wrapper])."""
        if self.shard_parameters and self.compiled_forward:
            raise RuntimeError(
                "shard_parameters=True does not support a model compiled around the strategy's wrapper yet "
                "(fabric.setup of a torch.compile'd model): compile the model's blocks instead, or turn "
                "shard_parameters off.")
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
        if self._places_of(self._trainable) == self._data_ptrs:
            return
        for p, now, ptr in zip(self._trainable, self._places_of(self._trainable), self._data_ptrs):
            if now != ptr:
                raise RuntimeError(
                        f"parameter {self._param_names[p]!r} no longer lives in its bucket: its .data, dtype or "
                        "device was changed after the module was wrapped (model.half(), .to(), or an assignment "
                        "to .data during training). Convert or move the model before fit, or use the Trainer's "
                        "precision= argument."
                    )

    def _places_of(self, params: list[nn.Parameter]) -> list[int]:
        """Where each parameter lives: its data pointer, or with sharded parameters (whose full buffers move when
        gathered again) its storage's identity and offset."""
        if not self.shard_parameters:
            return _data_ptrs_of(params)
        with torch._C.DisableTorchFunctionSubclass():
            return [hash((p.untyped_storage()._cdata, p.storage_offset())) for p in params]

    def _new_trainable(self) -> None:
        """Parameters frozen when the module was wrapped train now: re-plan, or refuse (Note [re-planning] in
        ``session.py``)."""
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
        """Wraps the same module again, in place, with ``layout`` (Note [re-planning] in ``session.py``); collective.

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
        if self.shard_parameters:  # each rank holds its own shard of the rest: nothing to compare
            names = {p: n for p, n in names.items() if p not in self._param_names}
            if not names:
                return
        params = list(names)
        with torch._C.DisableTorchFunctionSubclass():
            sums = torch.stack([_bit_sum(p.detach()) for p in params])
        gathered = collectives.all_gather_stacked(sums, group)
        # Each rank against the first rank holding the same values: rank 0, or for an expert parameter the
        # first of its expert data-parallel group (rank r mod E, Note [expert parallelism] in
        # ``engine/process_groups.py``).
        E = self.expert_parallel_size
        expert = torch.tensor([E > 1 and names[p] in self.expert_names for p in params], device=gathered.device)
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
            place = f"bucket {bucket.name}" if bucket else "frozen, never all-gathered"
            where.append(f"{names[params[i]]!r} ({place})")
        raise ReplicaDivergenceError(
            f"ranks hold different parameters after the all-gather: {', '.join(where)}"
            f"{' and more' if len(differs) > 5 else ''} differ between rank 0 and rank(s) {ranks}. Training stops "
            "here because the replicas would drift apart. Causes: a rank-local in-place write to a parameter (a "
            "hook or callback run on some ranks only), a frozen parameter set differently per rank, or a faulty "
            "device or link; resume from the last checkpoint."
        )

    # --- set-up --------------------------------------------------------------------
    def _broadcast_from_rank0(self, layout_buffers: bool = True) -> None:
        """Every rank starts from rank 0's values; expert parameters from the first rank holding the same
        experts (Note [expert parallelism] in ``engine/process_groups.py``). ``layout_buffers=False``: the
        parameters in the layout were broadcast bucket by bucket already (Note [meta-device models])."""
        group = self.process_groups.dp
        if group is None:
            return
        experts = self.expert_parallel_size > 1
        expert_buffers = {i for i, plan in enumerate(self.layout.buffers) if experts and plan.kind == "expert"}
        frozen = [(n, p) for n, p in self.module.named_parameters() if p not in self._param_names]
        flats = self._flat_buffers if layout_buffers else []
        dense = [flat.params for i, flat in enumerate(flats) if i not in expert_buffers]
        dense += [p.data for n, p in frozen if not (experts and n in self.expert_names)]
        dense += [b for b in self.module.buffers()]
        expert = [flat.params for i, flat in enumerate(flats) if i in expert_buffers]
        expert += [p.data for n, p in frozen if experts and n in self.expert_names]
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

    def release(self, wait: bool = True, whole: bool = True) -> nn.Module:
        """Waits for pending all-gathers, removes every hook and gives parameters their own storage.

        Afterwards the module is an ordinary one again (as after unwrapping
        ``DistributedDataParallel``) and the flat buffers are freed. ``wait=False``
        abandons pending collectives instead of waiting for them: only after a
        collective failed (a dead rank), when waiting would raise the same error again.
        ``whole=False`` (sharded parameters, at interpreter exit): nothing is gathered, and a
        parameter this rank does not hold becomes a meta tensor of its shape (Note [sharded release]).
        """
        own: set[nn.Parameter] = set()
        if self.shard_parameters and wait and whole:
            own = self._unshard_for_release()
        self.param_sync.release(wait)
        for h in self._hook_handles:
            h.remove()
        self._hook_handles = []
        try:
            self.grad_sync.release(wait)  # a clipping list's disagreement raises last, once the rest is released
        finally:
            with torch.no_grad():
                for p in self._param_names:
                    if p in own:
                        continue
                    read_guard.detach(p)
                    kept = self._readable(p) and (whole or not self.shard_parameters)
                    p.data = p.data.clone() if kept else _unheld(p, failed=not wait)
            self._flat_buffers, self._buckets = [], []
            for t in self._registered:
                if wrapper_of(t) is self:
                    del _LIVE[id(t)]
            self._registered = []
            self.ended_by = None
        return self.module


def _unheld(p: nn.Parameter, failed: bool) -> torch.Tensor:
    """What a released parameter holds where this rank has no values for it: after a failed collective NaN, never
    freed memory; at interpreter exit (nothing gathered) a meta tensor, which holds no memory."""
    if failed:
        return torch.full(p.shape, math.nan, dtype=p.dtype, device=p.device)
    return torch.empty(p.shape, dtype=p.dtype, device="meta")


def _release_device(device: torch.device, nbytes: int) -> torch.device:
    """Where a sharded module's parameters go when its wrapper is released (Note [sharded release] in
    ``engine/sharded.py``)."""
    if device.type != "cuda":
        return device
    free, _ = torch.cuda.mem_get_info(device)
    if nbytes <= free:
        return device
    warnings.warn(
        f"shard_parameters=True: the whole model ({nbytes / 2**30:.2f} GiB of parameters) does not fit in the "
        f"{free / 2**30:.2f} GiB free on {device} now that the run is over, so the module's parameters are "
        "gathered into CPU memory instead (Note [sharded release] in lightning_layerwise/engine/sharded.py). "
        "Call module.to(device) to move them back where they fit; a sharded checkpoint "
        "(checkpoint_format='sharded') saves without gathering.",
        stacklevel=3)
    return torch.device("cpu")


def _check_sharding(layout: Layout, param_read_guard: str, named: dict[str, nn.Parameter],
                    trainable: dict[nn.Parameter, str]) -> None:
    """What ``shard_parameters=True`` does not support yet raises before anything is built."""
    unguardable = [n for p, n in trainable.items() if not read_guard.can_guard(p)]
    problem = (
        "with param_read_guard='off': a read of a freed parameter would read freed memory; use 'wait'"
        if param_read_guard == "off" else
        f"with parameters of class {type(named[unguardable[0]]).__name__} ({unguardable[:3]}), not nn.Parameter: "
        "their reads cannot be made to gather their bucket" if unguardable else None)
    if problem is not None:
        raise ValueError(f"shard_parameters=True is not supported {problem}.")


def wrappers_of(module: nn.Module) -> list[LayerwiseDataParallel]:
    """The live wrappers training ``module``'s parameters (the model or a part of it, a LightningModule, Fabric's
    module or the wrapper itself), each once, in parameter order."""
    if isinstance(module, LayerwiseDataParallel):
        return [module]
    wrappers: list[LayerwiseDataParallel] = []
    for p in module.parameters():
        w = wrapper_of(p)
        if w is not None and all(w is not x for x in wrappers):
            wrappers.append(w)
    return wrappers


@contextlib.contextmanager
def full_parameters(module: nn.Module):
    """Inside, every parameter of ``module`` is whole on this rank (collective: every rank enters it).

    With ``shard_parameters=True`` each rank holds only its shard of the parameters outside a step
    (Note [sharded reads] in ``engine/sharded.py``): this gathers them all, and frees them on exit.
    Writes inside persist where they land in this rank's shard, so a write every rank makes alike
    (``load_state_dict``) persists; a copy of a value to keep must be taken inside. Without sharding
    it waits for the all-gathers in flight. ``module``: the model (or a part of it), a LightningModule,
    Fabric's module or the wrapper; a module that is not trained by the strategy passes through.
    """
    wrappers = wrappers_of(module)
    with contextlib.ExitStack() as stack:
        for w in wrappers:
            stack.enter_context(w.full_parameters())
        yield


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


def _check_arguments(bucket_size, prefetch_depth, param_read_guard) -> None:
    """The wrapper's own arguments, before anything is built."""
    if not is_bucket_size(bucket_size):
        raise ValueError(f"bucket_size={bucket_size!r} must be a positive number of elements, "
                         f"e.g. {DEFAULT_BUCKET_SIZE}, or 'auto'.")
    if not isinstance(prefetch_depth, int) or prefetch_depth < 1:
        raise ValueError(f"prefetch_depth={prefetch_depth!r} must be an integer >= 1 "
                         "(1 overlaps one bucket's all-gather with the module before it).")
    if param_read_guard not in READ_GUARDS:
        raise ValueError(f"param_read_guard={param_read_guard!r}: use 'wait' (reads wait for their all-gather), "
                         "'strict' (such reads raise, for debugging) or 'off' (stale reads, measurements only).")


def layout_specs(module: nn.Module, elementwise: Callable[[str, nn.Parameter], bool] | None = None,
                 expert: Callable[[str, nn.Parameter], bool] | None = None) -> list[ParamSpec]:
    """The specs the wrapper plans ``module`` from; a layout handed to the wrapper must be planned from these.

    ``elementwise`` may split only contiguous parameters: a piece is a range of the parameter's storage, cut
    and joined in checkpoints as a range of its logical elements, and the two agree only for a contiguous
    parameter (Note [memory format] in ``engine/buffers.py`` in buffers.py)."""
    if elementwise is not None:
        user_elementwise = elementwise
        elementwise = lambda name, p: p.is_contiguous() and user_elementwise(name, p)  # noqa: E731
    views = matrix_views(module)

    def matrices(name: str, p: nn.Parameter) -> tuple[tuple[int, int], ...] | None:
        shapes = matrix_shapes(p.shape, views[id(p)]) if id(p) in views else []
        return tuple(shapes) if len(shapes) > 1 else None  # one matrix: the cost's own (shape[0], rest) rule

    return param_specs(module, expert=expert, elementwise=elementwise, matrices=matrices)


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
    expert_ranks = sorted({b.shards for b in layout.buffers if b.kind == "expert"} - {expert_dp or owner_size})
    g = layout.group_size
    problem = (f"planned for {g} ranks per owner group, not {owner_size}" if g != owner_size else
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
                         "lightning_layerwise.engine.data_parallel.layout_specs(module, ...) for these process "
                         "groups, or pass layout=None to plan here.")


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
