"""The bucketed data-parallel wrapper: reduce-scatter gradients, all-gather parameters.

:class:`LayerwiseDataParallel` knows nothing of Lightning. One optimizer step,
driven by its owner (the Lightning strategy, Fabric, or a plain loop)::

    out = wrapper(batch)             # pre-hooks wait for each bucket's all-gather
    out.loss.backward()              # autograd adds grads into the grad buffer in place;
                                     # hooks dispatch a bucket's reduce-scatter when complete
    wrapper.finish_grad_sync()       # wait; owned params get .grad, others None
    optimizer.step()                 # any torch optimizer: steps only owned params
    wrapper.start_param_sync()       # async all-gather from each rank's shard

The wrapper builds its parts and registers the hooks; beside it live its set-up (``engine/wrapper_setup.py``, with
sharded parameters ``engine/sharded_init.py``), the checks of the module (``engine/module_checks.py``, Note [fixed
module]), the replica check (``engine/replica_check.py``) and the release (``engine/release.py``).

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
    range of the param buffer (:meth:`ParamRecords.piece_of`), and
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
import warnings
from collections.abc import Callable, Iterator
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

from . import collectives, read_guard, replica_check
from .buffers import Bucket, ParamState, allocate_buffers, build_buckets, meta_buffers
from .grad_sync import GradientSync
from .live_wrappers import _LIVE, wrapper_of
from .materialize import check_materializable, has_meta_tensors, materialize
from .module_checks import FixedModule, check_same_module_on_all_ranks, reject_sparse_gradients
from .param_sync import ParameterSide, ParameterSync
from .process_groups import ProcessGroups, Ranks
from .read_guard import ReadGuard
from .release import release_wrapper
from .sharded import ShardedParameterSync
from .sharded_init import materialize_sharded, shard_bucket_by_bucket
from .tensor_parallel import is_sharded, tensor_parallel_group
from .waiter import CollectiveError, Waiter  # noqa: F401  CollectiveError: its import path since 0.1
from .wrapper_setup import (broadcast_from_rank0, check_arguments, check_sharding, expert_buckets_by_layer,
                            layout_specs, materialize_device, param_records, plan_or_check_layout)
from ..layout import Layout, ParamSpec, newton_schulz_cost, resolve_bucket_size, resolve_prefetch_depth


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
        trace: record collective events in ``grad_sync.waiter.events`` (for tests and debugging).
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
        check_arguments(bucket_size, prefetch_depth, param_read_guard)
        self._init_args = init_args  # rebuild() wraps the same module again with a new layout
        self.on_new_trainable: Callable[[list[str]], None] | None = None
        """Called with their names when parameters outside the layout became trainable (Note [re-planning] in
        ``session.py``); ``None``: that raises."""
        # what ends this wrapper's run (its session's release, which also destroys the groups): llw.release calls it
        self.ended_by: Callable[[], object] | None = None
        self.module, self._param_read_guard, self._broadcast_buffers = module, param_read_guard, broadcast_buffers
        self._overlap_grad_reduce, self._prefetch_depth = overlap_grad_reduce, prefetch_depth
        self.process_groups = process_groups if process_groups is not None else ProcessGroups.create()
        self.ranks = Ranks.of(self.process_groups)
        reject_sparse_gradients(module)
        specs = layout_specs(module, elementwise=elementwise, expert=expert)
        if not specs:
            raise ValueError(
                f"{type(module).__name__} has no trainable parameter (none with requires_grad=True); "
                "there is nothing to train data-parallel. Unfreeze a parameter or do not wrap the module.")
        check_same_module_on_all_ranks(module, self.process_groups.dp, expert)
        self.layout = plan_or_check_layout(specs, layout, self.ranks, bucket_size, cost, follow_layers=shard_parameters)
        self.expert_names = frozenset(s.name for s in specs if s.kind == "expert") | (
            {n for n, p in module.named_parameters() if expert(n, p)} if expert is not None else set())
        """The expert parameters' names (frozen ones included): reduced over the expert data-parallel group."""
        self.shard_parameters = shard_parameters and self.process_groups.dp is not None
        """Whether each rank holds only its shard of the parameters (one process holds everything anyway)."""
        self.replaced_parameters: dict[int, nn.Parameter] = {}
        """A model built on the meta device (Note [meta-device models] in ``engine/materialize.py``): ``id`` of each
        meta parameter -> the parameter that replaced it (optimizers holding the former must take the latter)."""
        named, names = self._build_buffers(specs, grad_reduce_dtype, device)
        # Which groups average in the reduction, tried on each once (Note [averaging] in engine/collectives.py).
        averaged = {id(g): g for b in self._buckets for g in (b.group, b.replica_group) if g is not None}
        for group in averaged.values():
            collectives.probe_averaging(group, self._flat_buffers[0].grads.device)
        self._waiter = Waiter(self.ranks.dp_rank, self.ranks.dp_size, trace)
        self._end_of_backward_queued = False
        self.records = param_records(self.layout, self._buckets, self._flat_buffers, names, self._rank_for,
                                     self.shard_parameters)
        """What the engine knows of each trained parameter (Note [the per-parameter record] in
        ``engine/param_records.py``)."""
        self.grad_sync = self._gradient_side(overlap_grad_reduce)
        self.param_sync: ParameterSide = self._parameter_side(named, overlap_param_gather, reshard_after_forward)
        self._fixed_module = FixedModule(module, self.records.names, self.shard_parameters)
        """What every training forward checks is still so (Note [fixed module] in ``engine/module_checks.py``)."""
        self.compiled_forward = False
        """Whether this wrapper's forward has run inside ``torch.compile`` (Note [compiled wrapper])."""
        self._register_live()
        self._hook_handles = self._register_forward_pre_hooks() if self.process_groups.dp is not None else []

    # --- set-up ------------------------------------------------------------------------------------------------------
    def _build_buffers(self, specs: list[ParamSpec], grad_reduce_dtype: torch.dtype | None,
                       device: torch.device | None) -> dict[str, nn.Parameter]:
        """The flat buffers and buckets over the layout, every rank starting from rank 0's values. With sharded
        parameters bucket by bucket (Note [sharded parameters] in ``engine/buffers.py``): no full buffer of the
        whole model is ever made; the buckets start as shapes on the meta device. A model built on the meta device
        is materialized on ``device`` (Note [meta-device models] in ``engine/materialize.py``). Returns the
        module's parameters by name, and each trained parameter's name."""
        module, sharded, groups = self.module, self.shard_parameters, self.process_groups
        meta = has_meta_tensors(module)
        if meta and self._init_args["shard_parameters"]:
            check_materializable(module, materialize_device(device, groups.dp))  # before any collective, alike
            if not sharded:  # one process: nothing to shard, the whole model is materialized
                self.replaced_parameters = materialize(module, materialize_device(device, groups.dp))
        elif meta and all(p.is_meta for p in module.parameters() if p.requires_grad):
            raise ValueError(
                "the module's parameters are on the meta device; strategy='layerwise' materializes a meta-device "
                "model only with shard_parameters=True (bucket by bucket, Note [meta-device models] in "
                "engine/materialize.py). Pass shard_parameters=True, or build the model on its device.")
        named = dict(module.named_parameters())
        names: dict[nn.Parameter, str] = {named[s.name]: s.name for s in specs}
        if sharded:
            check_sharding(self._param_read_guard, named, names)
            self._flat_buffers = meta_buffers(self.layout, grad_reduce_dtype)
        else:
            self._flat_buffers = allocate_buffers(self.layout, {s.name: named[s.name] for s in specs},
                                                  grad_reduce_dtype)
        self._buckets = build_buckets(self.layout, self._flat_buffers, named, [s.name for s in specs], groups,
                                      self.ranks)
        if sharded:
            dtypes = [(flat.params.dtype, flat.grads.dtype) for flat in self._flat_buffers]
            stepped = self._stepped_whole_names(names)
            if meta:
                self._flat_buffers, self.replaced_parameters = materialize_sharded(
                    module, self.layout, self._buckets, dtypes, named, stepped,
                    materialize_device(device, groups.dp), groups)
                named = dict(module.named_parameters())
                names = {named[s.name]: s.name for s in specs}
            else:
                self._flat_buffers = shard_bucket_by_bucket(self.layout, self._buckets, dtypes, named,
                                                            list(names.values()), stepped, groups)
        broadcast_from_rank0(module, self.layout, [] if sharded else self._flat_buffers, names,
                             self.expert_names, self.ranks.expert_parallel_size, groups)
        return named, names

    def _gradient_side(self, overlap_grad_reduce: bool) -> GradientSync:
        """The gradient side over this layout's records."""
        return GradientSync(
            self._buckets, self._flat_buffers, self.records, self._waiter, groups=self.process_groups,
            layout_group=self._layout_group(), experts=self.expert_names,
            expert_parallel_size=self.ranks.expert_parallel_size, overlap_grad_reduce=overlap_grad_reduce,
            sharded=self.shard_parameters, on_backward=self._backward_started, reduces_in_flight=self._prefetch_depth,
            # the parameter side is built next: looked up when called
            before_reduce=lambda: self.param_sync.finish(), grads_done=lambda b: self.param_sync.grads_done(b))

    def _parameter_side(self, named: dict[str, nn.Parameter], overlap_param_gather: bool,
                        reshard_after_forward: bool) -> ParameterSide:
        """The parameter side over the buckets, gathering in forward order (Note [bucket order]), with the read guard
        on the parameters (Note [stale reads])."""
        every_read_guarded = self._all_guardable(named)
        guarded = [p for p in self.records.names if read_guard.can_guard(p)] if self._param_read_guard != "off" else []
        gather_order = sorted(self._buckets, key=lambda b: b.first_param)
        split = {id(r.bucket) for r in self.records if r.slot.split}
        split_buckets = [b for b in gather_order if id(b) in split]
        side: ParameterSide
        if self.shard_parameters:
            side = ShardedParameterSync(
                gather_order, self.records.names, self._waiter, split_buckets=split_buckets,
                stepped_whole=self.records.stepped_whole,
                prefetch_depth=self._prefetch_depth, reshard_after_forward=reshard_after_forward,
                read_guard=self._param_read_guard, on_backward=self._backward_started,
                write_back=self._write_back_pieces)
        else:
            side = ParameterSync(
                gather_order, self.records.names, self._waiter, split_buckets=split_buckets,
                prefetch_depth=self._prefetch_depth, overlap=overlap_param_gather and every_read_guarded,
                read_guard=self._param_read_guard, gathers=self.process_groups.dp is not None)
        for p in guarded:  # Note [stale reads]
            read_guard.attach(p, side.on_pending_read)
        return side

    def _stepped_whole_names(self, names: dict[nn.Parameter, str]) -> set[str]:
        """The parameters this rank steps whole (with sharded parameters they view their bucket's shard)."""
        return {n for n in names.values()
                if not self.layout.params[n].split and self.layout.params[n].owner == self._rank_for(n)}

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

    @contextlib.contextmanager
    def full_parameters(self):
        """Every parameter whole on this rank inside (collective: every rank enters it). With sharded parameters
        it gathers every bucket, and frees them on exit; writes inside persist where they land in this rank's
        shard (a parameter it steps whole, its piece of a split one), so a write every rank makes alike (loading
        a state dict) persists. Without sharding, it waits for the all-gathers in flight."""
        with self.param_sync.held_full():
            yield

    def _write_back_pieces(self) -> None:
        """Sharded parameters: what was written into a split parameter whose bucket is full reaches this rank's
        piece of it (whole parameters this rank steps view its shard: nothing to do)."""
        with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
            for record in self.records:
                piece = record.piece
                if piece is not None and record.bucket.param.state is ParamState.READY:
                    where = record.unit.piece
                    piece.copy_(record.param.reshape(-1)[where.start:where.stop])

    def _all_guardable(self, named: dict[str, nn.Parameter]) -> bool:
        """Whether the read guard can be attached to every parameter (Note [stale reads]), which all-gathers
        overlapping the forward need; warns where it cannot."""
        if self._param_read_guard == "off":
            return True
        unguardable = [n for p, n in self.records.names.items() if not read_guard.can_guard(p)]
        if unguardable and self._init_args["overlap_param_gather"]:
            warnings.warn(
                f"parameters {unguardable[:3]} are of class {type(named[unguardable[0]]).__name__}, not "
                "nn.Parameter, so reads of them outside their module cannot be made to wait for the "
                "all-gather; parameters are all-gathered before start_param_sync() returns instead "
                "(overlap_param_gather=False).", stacklevel=4)
        return not unguardable

    def _register_live(self) -> None:
        """Lets the gradient utilities find this wrapper behind its parameters and pieces (``engine/grad_utils.py``)."""
        self._registered = [*self.records.names, *self.records.pieces.values()]
        for t in self._registered:
            _LIVE[id(t)] = self

    def _register_forward_pre_hooks(self) -> list:
        """One pre-hook per module holding parameters: its buckets are ready before it runs. The buckets of marked
        experts (``llw.mark_experts``) are gathered by the layer that holds them, which runs on every rank whichever
        experts its tokens reach (Note [conditional experts]; with sharded parameters Note [sharded experts] in
        ``engine/sharded.py``)."""
        handles = []
        order = {id(b): i for i, b in enumerate(self.param_sync.gather_order)}
        by_layer = expert_buckets_by_layer(self.module, self.records, self._buckets, every=self.shard_parameters)
        routed = {id(b) for buckets in by_layer.values() for b in buckets}
        for module in self.module.modules():
            own = [r.bucket for r in map(self.records.of, module.parameters(recurse=False))
                   if r is not None and id(r.bucket) not in routed]
            buckets = list({id(b): b for b in own + by_layer.get(module, [])}.values())
            if buckets:
                buckets.sort(key=lambda b: order[id(b)])
                handles.append(module.register_forward_pre_hook(self.param_sync.forward_pre_hook(buckets)))
            hook = self.param_sync.before_backward_of(by_layer[module]) if module in by_layer else None
            if hook is not None:
                handles.append(module.register_forward_hook(hook))
        return handles

    def _rank_for(self, name: str) -> int:
        """This rank's index among the owners of parameter ``name``'s pieces: its position in the expert
        data-parallel group for experts, else ``ranks.layout_rank``."""
        return self.ranks.expert_dp_rank if name in self.expert_names and self.ranks.expert_parallel_size > 1 \
            else self.ranks.layout_rank

    def _layout_group(self) -> dist.ProcessGroup | None:
        """The group whose ranks, in order, are the owners of the dense pieces (Note [replica sharing] in
        ``layout/sharing.py``)."""
        return self.process_groups.dp if self.ranks.replicas > 1 else self.process_groups.owner_group

    # --- public queries -------------------------------------------------------------
    def named_owned_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """What this rank steps, its whole parameters and its pieces of split ones (Note [pieces]), each with the
        name of the model parameter it is (part of)."""
        for record in self.records:
            if record.unit is not None:
                yield record.name, record.unit.tensor

    def use_shards_in(self, optimizer: torch.optim.Optimizer) -> None:
        """Puts this rank's pieces of split parameters in ``optimizer`` in place of the parameters.

        A split parameter this rank steps none of stays: it never gets a gradient here, so
        the optimizer skips it. Optimizer state created before the swap follows its parameter
        (sliced to the piece). See Note [pieces].
        """
        pieces = self.records.pieces
        for group in optimizer.param_groups:
            group["params"] = [pieces.get(p, p) for p in group["params"]]
        for p, shard in pieces.items():
            if p in optimizer.state:
                piece = self.records[p].unit.piece
                cut = {k: (v, piece.cut(v, p.shape)) for k, v in optimizer.state.pop(p).items()}
                optimizer.state[shard] = {k: c.clone() if c is not v else v for k, (v, c) in cut.items()}

    @property
    def buckets(self) -> list[Bucket]:
        return list(self._buckets)

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

    def set_master(self, tensor: torch.Tensor, master: torch.Tensor) -> None:
        """Declares ``master`` the float32 tensor the optimizer steps for ``tensor`` (``bf16-true``): it gets the
        reduced gradient in float32 at each sync, so ``tensor``'s gradient is no longer added in place."""
        self.records.set_master(tensor, master)
        self.grad_sync.hook_gradients()
        _LIVE[id(master)] = self
        self._registered.append(master)

    # --- the parameter side (ParameterSync) --------------------------------------------------------------------
    def start_param_sync(self, force_sync: bool = False, tensors=None) -> None:
        """Starts all-gathering the buckets (those holding ``tensors``, the same set on every rank, if given)
        from each rank's shard of the param buffer (:meth:`ParameterSync.start`)."""
        self.param_sync.start(None if tensors is None else self._buckets_of(tensors), force_sync)

    def _buckets_of(self, tensors) -> list[Bucket]:
        """The buckets holding any of ``tensors`` (parameters, pieces or masters), in all-gather order."""
        wanted = {id(r.bucket) for r in map(self.records.of, tensors) if r is not None}
        return sorted((b for b in self._buckets if id(b) in wanted), key=lambda b: b.first_param)

    def forward(self, *args, **kwargs):
        if torch.compiler.is_compiling():
            self.compiled_forward = True  # Note [compiled wrapper]
        self._before_forward()
        return self.param_sync.run_forward(lambda: self.module(*args, **kwargs))

    @torch.compiler.disable
    def _before_forward(self) -> None:
        """The step's bookkeeping before a training forward, always run eagerly (Note [compiled wrapper])."""
        self.param_sync.check_forward(self.compiled_forward)
        if torch.is_grad_enabled() and self.module.training:
            new = self._fixed_module.check()  # Note [fixed module] in ``engine/module_checks.py``
            if new:
                self._new_trainable(new)
            self.grad_sync.before_forward()  # Note [in-place gradients] in ``engine/grad_sync.py``
            if self._broadcast_buffers:
                self._broadcast_module_buffers()

    def _broadcast_module_buffers(self) -> None:
        """Rank 0's module buffers to every rank, as one collective (every training forward)."""
        if self.process_groups.dp is None:
            return
        # The modules are those recorded at wrapping (the forward's check has just confirmed it); their
        # buffers are read now, since a model may replace a buffer object at any step. Each once, in
        # module.buffers() order.
        buffers = list({id(b): b for m in self._fixed_module.modules for b in m._buffers.values()
                        if b is not None}.values())
        if buffers:
            with torch.no_grad():
                collectives.broadcast_coalesced(buffers, self.process_groups.dp)

    def _new_trainable(self, new: list[str]) -> None:
        """Parameters ``new``, frozen when the module was wrapped, train now: re-plan, or refuse (Note [re-planning]
        in ``session.py``)."""
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
        waiter = self._waiter
        keep = {"training": self.training, "compiled_forward": self.compiled_forward,
                "on_new_trainable": self.on_new_trainable}
        args = dict(self._init_args, layout=layout, elementwise=elementwise, process_groups=self.process_groups)
        self.release()
        LayerwiseDataParallel.__init__(self, **args)
        for name, value in keep.items():
            setattr(self, name, value)
        self._waiter.seconds, self._waiter.events = waiter.seconds, waiter.events

    # --- replica check (Note [replica check] in ``engine/replica_check.py``) ------------------------------------
    def check_replicas(self) -> None:
        """Raises :class:`~lightning_layerwise.engine.replica_check.ReplicaDivergenceError` on every rank unless all
        ranks hold bitwise-equal parameters (Note [replica check] in ``engine/replica_check.py``).

        Collective: every rank calls it at the same point. Waits for outstanding
        all-gathers first.
        """
        group = self.process_groups.dp
        across = tensor_parallel_group(self.module.parameters())
        if group is None and across is None:
            return
        self.param_sync.finish()
        names = {p: n for n, p in self.module.named_parameters()}  # frozen ones too: never all-gathered
        if not self.param_sync.holds_whole:  # each rank holds its own shard of the rest: nothing to compare
            names = {p: n for p, n in names.items() if p not in self.records.names}
        if group is not None:
            replica_check.check_replicas(names, group, self.records, self.expert_names,
                                         self.ranks.expert_parallel_size)
        if across is not None:  # what every rank of a tensor-parallel group holds whole must be equal over it
            replicated = {p: n for p, n in names.items() if not is_sharded(p)}
            replica_check.check_replicas(replicated, across, self.records, (), 1, ranks="tensor-parallel rank")

    def release(self, wait: bool = True, whole: bool = True) -> nn.Module:
        """Waits for pending all-gathers, removes every hook and gives parameters their own storage.

        Afterwards the module is an ordinary one again (as after unwrapping
        ``DistributedDataParallel``) and the flat buffers are freed. ``wait=False``
        abandons pending collectives instead of waiting for them: only after a
        collective failed (a dead rank), when waiting would raise the same error again.
        ``whole=False`` (sharded parameters, at interpreter exit): nothing is gathered, and a
        parameter this rank does not hold becomes a meta tensor of its shape (Note [sharded release] in
        ``engine/sharded.py``).
        """
        return release_wrapper(self, wait, whole)


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
