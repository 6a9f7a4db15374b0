"""The parameter side with sharded parameters: gather a bucket before it is used, free it after.

With ``shard_parameters=True`` (Note [sharded parameters] in ``engine/buffers.py``) a rank holds
only its shard of each bucket between uses. :class:`ShardedParameterSync` takes the place of
:class:`~lightning_layerwise.engine.param_sync.ParameterSync` and decides when each bucket's full
parameters exist.

Note [when a bucket is full]
    Forward. A module's forward pre-hook waits for its buckets (gathering a freed one) and dispatches the
    all-gathers of the next ``prefetch_depth`` buckets in forward order. With ``reshard_after_forward`` (the
    default) it first frees every full bucket the forward has moved past: all but the module's own, those
    prefetched after its last, and those a module registered after it also holds (a bucket can hold parameters
    of distant modules: equal-shape matrices batched for Newton-Schulz, a tied embedding). Registration order
    stands in for call order; where they differ a bucket is freed earlier or later, and a read of a freed one
    gathers it again. Without it, buckets stay full from their forward to their backward. A forward without
    autograd (validation) frees as it goes.

    Backward. During the wrapper's forward, a saved-tensor hook packs every tensor autograd saves on a bucket's
    full storage with its bucket; unpacking it gathers the bucket if freed and prefetches the ``prefetch_depth``
    buckets before it in forward order. A bucket is freed once each of its parameters received its gradient,
    and every bucket still full when the backward ends is freed then (a callback on autograd's engine). Forward
    pre-hooks inside a backward (activation checkpointing) gather but never free.

    Order. Every decision depends only on the sequence of modules called and nodes run, the same on every rank
    for the same code, so every rank issues the same all-gathers in the same order. A model whose modules run
    differently on different ranks must call every module on every rank, as under FSDP.

Note [sharded experts]
    Which experts a rank's tokens reach differs between ranks, so a rank may not call an
    expert (``examples/moe.py`` skips experts without tokens) and autograd then saves
    nothing of it: gathering expert buckets from the experts' own pre-hooks or from saved
    tensors would issue different collectives on different ranks. So the layer that holds
    a marked expert container (``llw.mark_experts``), which runs on every rank, gathers
    all its expert buckets in its forward pre-hook, and, through a hook on its outputs'
    gradients (autograd runs it before the layer's backward, on every rank), again before
    its backward. A saved expert tensor is then always found full; unpacking it never
    gathers or prefetches. The buckets are freed as dense ones are.

Note [sharded reads]
    A parameter outside this rank's shard views its bucket's full buffer; while the bucket is freed it carries
    the read guard's pending class (Note [read guard] in ``engine/read_guard.py``), so a torch operation on it
    (``.sum()``, ``.data``, ``state_dict()``, ``copy.deepcopy``) comes here first. The innermost read scope decides:

    * a step (the wrapper's forward; under Lightning ``training_step``...) or a backward: every rank runs the
      same code, so the read gathers the bucket;
    * a hook (:meth:`ShardedParameterSync.hook_reads`, entered by the Trainer strategy around each hook):
      every rank runs the same hooks, but code may read on some ranks only, so the ranks agree first (Note
      [collective reads] in ``engine/collective_reads.py``), then gather. A hook's buckets are freed at its next
      read that finds nothing viewing them, and when it ends, once what was written into their split
      parameters reached this rank's pieces (``WeightAveraging`` swaps the average in);
    * this rank's own (:meth:`ShardedReads.local`: the optimizer's step, the checkpoint formats' gathers) or
      none (a plain loop between steps): a parameter this rank steps whole is read from its shard; any other
      read raises :class:`ShardedParameterReadError` (:class:`ReadRules`) instead of waiting for a collective
      that may never come.

    Inside :meth:`held` nothing is gathered on demand. An error raised here is posted for the other ranks first
    (Note [failing together] in ``engine/collective_reads.py``). Metadata (shape, dtype) is always readable.

Note [sharded release]
    A sharded run does not end when ``trainer.fit`` returns: the module stays sharded, as
    after FSDP, and ``trainer.test``/``validate``/``predict`` and ``trainer.save_checkpoint``
    run on it. Gathering it whole there would hold the model on every rank beside the
    optimizer state, above the training's peak. The wrapper is released (the module gets
    every parameter back whole, in its own storage, as after ``ddp``) by ``llw.release(model)``,
    ``session.release()``, ``fabric.strategy.teardown()`` or the next ``trainer.fit``. The
    buckets are then gathered in forward order, each copied out and freed before the next:
    the model plus two buckets above what the run held. Where the device's free memory is
    less than the parameters' bytes the copies go to CPU memory, with a warning. At
    interpreter exit nothing is gathered: the groups are destroyed and a parameter this rank
    does not hold becomes a meta tensor. A run that failed issues no collective when
    released (the other ranks may have failed elsewhere, or not at all): each parameter
    keeps what this rank holds of it and NaN for the rest (``LayerwiseSession.release``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import warnings
from typing import Callable, Iterable, Iterator, Literal, NoReturn

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from . import read_guard
from .buffers import Bucket, ParamState
from .collective_reads import ReadAgreement, ReadNotShared, ShardedParameterReadError
from .read_guard import StaleParameterReadError
from .waiter import Waiter


@dataclasses.dataclass(frozen=True)
class ReadRules:
    """How the front end driving the wrapper names the places where every rank runs the same code, and how the
    module gets its parameters back whole: the words of :class:`ShardedParameterReadError` (Note [sharded reads])."""

    steps: str = "the wrapper's forward"
    whole_again: str = "After wrapper.release() the module holds every parameter again."


class _HookScope:
    """Reads inside one hook of the front end (Note [sharded reads]): where, and the buckets they gathered, each
    with the operation that read it (``read_guard.call_index``)."""

    __slots__ = ("where", "gathered")

    def __init__(self, where: str) -> None:
        self.where = where
        self.gathered: list[tuple[Bucket, int]] = []


_STEP, _LOCAL = "step", "local"  # the other read scopes: a step (the wrapper's forward); this rank's own reads


def _references(bucket: Bucket) -> int:
    """References to ``bucket``'s full storage: its buffer, its parameters, any view taken of them, and for a while
    after an all-gather, the backend's own."""
    return torch._C._storage_Use_Count(bucket.param.data.untyped_storage()._cdata)


def in_backward() -> bool:
    """Whether the caller runs inside an autograd backward."""
    return torch._C._current_graph_task_id() != -1


class _SavedFromBucket:
    """A tensor autograd saved on a bucket's full parameters, and that bucket."""

    __slots__ = ("bucket", "tensor")

    def __init__(self, bucket: Bucket, tensor: torch.Tensor) -> None:
        self.bucket, self.tensor = bucket, tensor


class ShardedReads:
    """Where each read of a sharded parameter happens, and what it may do there (Note [sharded reads]): the read
    scopes, innermost last; the front end's words for errors; the ranks' agreement before a read in a hook; which
    buckets a hook's reads gathered and may be freed. It decides; its :class:`ShardedParameterSync`
    (``param_sync.reads``) gathers and frees.

    Args:
        gather_order: every bucket, in forward order.
        names: each parameter's name, for errors.
        waiter: this rank and the failure board, for errors.
        stepped_whole: the parameters that view their bucket's shard (this rank steps them whole).
        read_guard: ``"wait"`` or ``"strict"`` (reads outside a module's pre-hook raise).
    """

    def __init__(self, gather_order: list[Bucket], names: dict[nn.Parameter, str], waiter: Waiter,
                 stepped_whole: set, read_guard: Literal["wait", "strict"]) -> None:
        self.rules = ReadRules()
        """The front end's words for errors (set by the session that drives the wrapper)."""
        self.agreement: ReadAgreement | None = None
        """Every rank's agreement before a read in a hook gathers (Note [collective reads]); ``None``: such reads
        gather without it (a wrapper no front end drives)."""
        self._gather_order, self._names, self._waiter = gather_order, names, waiter
        self._index = {id(b): i for i, b in enumerate(gather_order)}
        self._stepped_whole = {id(p) for p in stepped_whole}
        self._strict = read_guard == "strict"
        self._scopes: list = []  # innermost last: _STEP, _LOCAL or a _HookScope
        self._warned_views = False  # a view outlived a hook (warned once)
        # References to each bucket's storage with no view taken (measured now: nothing in flight holds one)
        self._unviewed = {id(b): _references(b) for b in gather_order}

    @contextlib.contextmanager
    def in_step(self):
        """Inside, reads of sharded parameters gather their bucket (the wrapper's forward: every rank runs the same
        code there)."""
        with self._scope(_STEP):
            yield

    @contextlib.contextmanager
    def local(self):
        """Inside, reads are this rank's own (the optimizer's step, inside a hook): nothing is gathered on demand,
        a parameter this rank steps whole is read from its shard."""
        with self._scope(_LOCAL):
            yield

    @contextlib.contextmanager
    def in_hook(self, where: str):
        """Inside, reads are a hook's that every rank runs in the same order (``where``: its name); yields the
        hook's scope, which keeps the buckets its reads gathered."""
        scope = _HookScope(where)
        with self._scope(scope):
            yield scope

    @contextlib.contextmanager
    def _scope(self, scope):
        self._scopes.append(scope)
        try:
            yield
        finally:
            self._scopes.pop()

    def admits(self, param: nn.Parameter, func: Callable, bucket: Bucket, held: bool) -> bool:
        """Whether a read of ``param``, whose ``bucket`` is not full, gathers the bucket: raises where it may not,
        and False where it reads this rank's shard (``held``: inside :meth:`ShardedParameterSync.held`)."""
        # Inside a step or a backward every rank reads alike, so a read may gather; inside held() (checkpoints)
        # each rank reads what it owns, so nothing is gathered on demand there; in a hook, after an agreement.
        scope = self._scopes[-1] if self._scopes else None
        if held or not (scope is _STEP or isinstance(scope, _HookScope) or in_backward()):
            if id(param) in self._stepped_whole:
                # its values are here (the optimizer's step); it stays marked for the next forward's reads
                return False
            rules = self.rules
            self._fail(ShardedParameterReadError(
                f"{self._names[param]!r} was read by {read_guard.describe(func)} on rank {self._waiter.rank} while "
                f"its bucket ({bucket.name}) is sharded: with shard_parameters=True this rank holds only its shard "
                f"of it outside {rules.steps}. Read it inside `with llw.full_parameters(model):`, which every rank "
                f"must enter (it gathers every parameter), or inside {rules.steps}. {rules.whole_again}"))
        if self._strict:
            self._fail(StaleParameterReadError(
                f"{self._names[param]!r} was read by {read_guard.describe(func)} outside the forward pre-hook of the "
                f"module that holds it, while its bucket ({bucket.name}) was not gathered. With "
                "param_read_guard='wait' (the default) this read gathers the bucket and is correct, but costs an "
                "all-gather that is not overlapped: call the module itself."))
        return True

    def hook_scope(self) -> _HookScope | None:
        """The innermost scope if it is a hook's and no backward runs (a read there is a collective the ranks agree
        on), else ``None``."""
        scope = self._scopes[-1] if self._scopes else None
        return scope if isinstance(scope, _HookScope) and not in_backward() else None

    def agree(self, scope: _HookScope, bucket: Bucket, param: nn.Parameter, func: Callable) -> None:
        """Every rank agrees on this read in a hook before it gathers ``bucket`` (Note [collective reads])."""
        if self.agreement is not None:
            try:
                self.agreement.agree(self._index[id(bucket)], scope.where)
            except ReadNotShared as failure:
                self._fail(ShardedParameterReadError(self._not_shared(param, func, bucket, scope, failure)))

    def keep(self, scope: _HookScope, bucket: Bucket) -> None:
        """A read in the hook of ``scope`` gathered ``bucket``: kept with the operation reading it, once the backend
        let go of the all-gather's own views."""
        scope.gathered.append((bucket, read_guard.call_index()))
        deadline = time.perf_counter() + 0.005
        while _references(bucket) > self._unviewed[id(bucket)] and time.perf_counter() < deadline:
            time.sleep(0)  # the backend's thread lets go of the all-gather's own views (microseconds)

    def unused(self, scope: _HookScope, everything: bool) -> Iterator[Bucket]:
        """The buckets reads in ``scope`` gathered that may be freed, one at a time as the caller frees them: those
        full that nothing views now (``everything``: the hook ended). The rest stay the scope's."""
        kept, call = [], read_guard.call_index()
        for bucket, read_by in scope.gathered:
            if bucket.param.state is not ParamState.READY:
                continue
            viewed = _references(bucket) > self._unviewed[id(bucket)]  # a read's result, or the backend, views it
            if not everything and (read_by == call or viewed):  # or the operation reading now reads it too
                kept.append((bucket, read_by))
                continue
            if viewed and not self._warned_views:
                self._warned_views = True
                warnings.warn(
                    f"shard_parameters=True: a view of parameters of bucket {bucket.name} taken in {scope.where} "
                    "outlives it (p.detach() or p.data kept on an object); the bucket is freed as the hook ends, "
                    "and the view then holds no values (reading it may crash). Keep a copy: p.detach().clone().",
                    stacklevel=3)
            yield bucket
        scope.gathered = kept

    def _not_shared(self, param: nn.Parameter, func: Callable, bucket: Bucket, scope: _HookScope,
                    failure: ReadNotShared) -> str:
        """The error of a read in a hook that not every rank makes alike (Note [collective reads])."""
        read = (f"{self._names[param]!r} was read by {read_guard.describe(func)} in {scope.where} on rank "
                f"{self._waiter.rank}, which gathers its bucket ({bucket.name}) from every rank")
        if failure.rows is not None:
            here = failure.rows[self.agreement.board.rank][1]
            reads = ", ".join(f"rank {r}: bucket {self._gather_order[b].name}{'' if h == here else ' in another hook'}"
                              for r, (b, h) in enumerate(failure.rows))
            what = f"; the ranks read differently at this point ({reads})"
        else:
            what = (f", but the other ranks did not make this read within {failure.waited:.0f} s (they wait in "
                    "another collective, or went on without it)")
        return (f"{read}{what}. A read of a sharded parameter in a hook is a collective: every rank must read the "
                "same parameters in the same order (not under `if trainer.is_global_zero:`). To read on some ranks "
                "only, enter `with llw.full_parameters(model):` on every rank and read inside.")

    def _fail(self, error: RuntimeError) -> NoReturn:
        """Raises ``error`` after posting it for the other ranks (Note [failing together])."""
        board = self._waiter.board
        if board is not None:
            board.post(str(error))
        raise error


class ShardedParameterSync:
    """When each bucket's full parameters exist (Note [when a bucket is full]).

    Args:
        gather_order: every bucket, in forward order.
        names: each parameter's name, for errors.
        waiter: waits (errors, timing, tracing) shared with the gradient side.
        stepped_whole: the parameters that view their bucket's shard (this rank steps them whole).
        split_buckets: the buckets holding a split parameter, in ``gather_order``.
        prefetch_depth: how many all-gathers may be in flight at once.
        reshard_after_forward: free buckets during the forward, gathering them again for the backward.
        read_guard: ``"wait"`` or ``"strict"`` (reads outside a module's pre-hook raise).
    """

    overlap = True
    holds_whole = False

    def __init__(self, gather_order: list[Bucket], names: dict[nn.Parameter, str], waiter: Waiter, *,
                 stepped_whole: set, split_buckets: list[Bucket] | None = None, prefetch_depth: int = 2,
                 reshard_after_forward: bool = True, read_guard: Literal["wait", "strict"] = "wait",
                 on_backward: Callable[[], None] = lambda: None, write_back: Callable[[], None] = lambda: None) -> None:
        self.gather_order = gather_order
        self.split_buckets = list(split_buckets or [])
        self.names = names
        self.waiter = waiter
        self.prefetch_depth = prefetch_depth
        self._reshard_after_forward = reshard_after_forward
        self._on_backward = on_backward
        self._write_back = write_back  # full parameters -> this rank's pieces of split ones (held_full)
        self.guarded_reads = 0
        """Reads that gathered their bucket outside a forward pre-hook (Note [sharded reads])."""
        self._index = {id(b): i for i, b in enumerate(gather_order)}
        self._bucket_by_id = {id(p): b for b in gather_order for p in b.params}
        # Tensors on a bucket's full parameters, or on its shard (the parameters this rank steps whole): both are
        # gathered for, so that every rank gathers the same buckets (Note [when a bucket is full]).
        self._by_storage = {b.param.data.untyped_storage()._cdata: b for b in gather_order}
        self._shard_ranges: dict[int, list[tuple[int, int, Bucket]]] = {}
        for b in gather_order:
            begin = b.param.shard.storage_offset()
            self._shard_ranges.setdefault(b.param.shard.untyped_storage()._cdata, []).append(
                (begin, begin + b.param.shard.numel(), b))
        self._in_flight: list[Bucket] = []
        self._full: dict[int, Bucket] = {}  # ready buckets, by id
        self.reads = ShardedReads(gather_order, names, waiter, stepped_whole, read_guard)
        """Where reads of sharded parameters happen and what they may do (Note [sharded reads])."""
        self._held = 0  # full_parameters depth: nothing is freed inside
        self._last_unpacked: Bucket | None = None
        self._hooks_made = 0  # forward pre-hooks made so far: the next one's position in registration order
        self._last_holder: dict[int, int] = {}  # id(bucket) -> position of the last module holding its parameters
        for bucket in gather_order:
            self._guard(bucket)

    # --- the ParameterSync interface ---------------------------------------------------------------------------
    @property
    def pending(self) -> bool:
        return bool(self._in_flight)

    def start(self, buckets: Iterable[Bucket] | None = None, force_sync: bool = False) -> None:
        """After an optimizer step: the shards of ``buckets`` (default: all) changed, so a full copy of any of
        them is stale and is freed. Nothing is gathered before the next forward asks (between steps a rank
        holds only its shards). Inside :meth:`held_full` the stale buckets are gathered again instead."""
        self.finish()
        if self._held:  # what was written into the full parameters (a loaded state dict) reaches the shards first
            self._write_back()
        stepped = self.gather_order if buckets is None else list(buckets)
        for bucket in stepped:
            if bucket.chunks is not None:
                bucket.param.share_chunks()
        stale = [b for b in stepped if b.param.state is not ParamState.FREED]
        for bucket in stale:
            self._free(bucket)
        if self._held:
            for bucket in stale:
                self._dispatch(bucket)
            self.finish()

    def finish(self) -> None:
        """Waits for every all-gather in flight (before a step writes the shards they read)."""
        while self._in_flight:
            self._wait(self._in_flight[0])

    def ensure_gathered(self, bucket: Bucket) -> None:
        """Makes ``bucket`` full: waits for its all-gather, dispatching it first if it is freed."""
        if bucket.param.state is ParamState.FREED:
            self._dispatch(bucket)
        if bucket.param.state is ParamState.GATHERING:
            self._wait(bucket)

    def forward_pre_hook(self, buckets: list[Bucket]) -> Callable:
        """A forward pre-hook that makes ``buckets`` (in :attr:`gather_order`) full before the module runs. Made for
        the modules in their registration order, which gives each its position (Note [when a bucket is full])."""
        last = self._index[id(buckets[-1])]
        position = self._hooks_made
        self._hooks_made += 1
        for b in buckets:
            self._last_holder[id(b)] = position

        def hook(_module, _args):
            backward = in_backward()
            if not backward and self._held == 0 and (self._reshard_after_forward or not torch.is_grad_enabled()):
                self._free_outside(buckets, position, last)
            for b in buckets:
                self.ensure_gathered(b)
            if not backward:
                self._prefetch(last, +1)
        return hook

    def on_pending_read(self, param: nn.Parameter, func: Callable) -> None:
        """The read guard's callback (Note [sharded reads])."""
        bucket = self._bucket_by_id[id(param)]
        if bucket.param.state is ParamState.READY:
            read_guard.restore(param)
            return
        if not self.reads.admits(param, func, bucket, held=self._held > 0):
            return
        scope = self.reads.hook_scope()
        if scope is not None:
            self._read_in_hook(scope, bucket, param, func)
            return
        self.guarded_reads += 1
        self.ensure_gathered(bucket)

    def _read_in_hook(self, scope: _HookScope, bucket: Bucket, param: nn.Parameter, func: Callable) -> None:
        """A read in a hook every rank runs alike: the buckets earlier reads of the hook gathered are freed unless
        something views them, every rank agrees on this read, and its bucket is gathered (Note [sharded reads])."""
        self._free_read(scope, everything=False)
        if bucket.param.state is ParamState.GATHERING:  # dispatched alike on every rank: waiting is this rank's own
            self.ensure_gathered(bucket)
            return
        self.reads.agree(scope, bucket, param, func)
        self.guarded_reads += 1
        self.ensure_gathered(bucket)
        self.reads.keep(scope, bucket)

    def _free_read(self, scope: _HookScope, everything: bool) -> None:
        """Frees the buckets reads in ``scope`` gathered, once what was written into their split parameters reached
        this rank's pieces: those nothing views now (``everything``: the hook ended). Inside held(), none."""
        if self._held:
            return
        for bucket in self.reads.unused(scope, everything):
            self._write_back()
            self._free(bucket)

    def release(self, wait: bool = True) -> None:
        """Completes (``wait``) or abandons every all-gather; the buckets are not used afterwards."""
        if wait:
            self.finish()
            self._on_backward = self._write_back = lambda: None  # the wrapper's callbacks go: no cycle keeps it
        self._in_flight = []

    # --- the backward (Note [when a bucket is full]) -----------------------------------------------------------
    def _pack(self, tensor: torch.Tensor):
        """Saved-tensor pack hook: a tensor on a bucket's full parameters remembers its bucket."""
        with torch._C.DisableTorchFunctionSubclass():
            storage = tensor.untyped_storage()._cdata
            bucket = self._by_storage.get(storage)
            if bucket is None and storage in self._shard_ranges:
                offset = tensor.storage_offset()
                bucket = next((b for begin, end, b in self._shard_ranges[storage] if begin <= offset < end), None)
        return tensor if bucket is None else _SavedFromBucket(bucket, tensor)

    def _unpack(self, saved):
        """Saved-tensor unpack hook: the bucket of a saved parameter is full before its node runs."""
        if type(saved) is not _SavedFromBucket:
            return saved
        self._on_backward()
        bucket = saved.bucket
        if bucket.expert:  # Note [sharded experts]: their layer gathered them; no collective depends on tokens
            if bucket.param.state is not ParamState.READY:
                raise RuntimeError(f"bucket {bucket.name} of experts was not gathered before their backward")
            return saved.tensor
        if bucket.param.state is not ParamState.READY:
            self.ensure_gathered(bucket)
        if bucket is not self._last_unpacked:  # the backward reached another bucket: prefetch the ones before it
            self._last_unpacked = bucket
            self._prefetch(self._index[id(bucket)], -1)
        return saved.tensor

    def before_backward_of(self, buckets: list[Bucket]) -> Callable:
        """A forward hook for a layer holding experts: before the layer's backward, its expert ``buckets`` are
        full (Note [sharded experts])."""
        def gather(_grads) -> None:
            self._on_backward()
            for b in buckets:
                if b.param.state is ParamState.FREED:
                    self._dispatch(b)
            for b in buckets:
                self.ensure_gathered(b)

        def hook(_module, _args, output) -> None:
            if torch.is_grad_enabled():
                outputs = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
                if outputs:
                    torch.autograd.graph.register_multi_grad_hook(outputs, gather, mode="any")
        return hook

    def check_forward(self, compiled: bool) -> None:
        """Before a training forward: a wrapper compiled around is refused (Note [compiled wrapper] in
        ``engine/data_parallel.py``)."""
        if compiled:
            raise RuntimeError(
                "shard_parameters=True does not support a model compiled around the strategy's wrapper yet "
                "(fabric.setup of a torch.compile'd model): compile the model's blocks instead, or turn "
                "shard_parameters off.")

    def run_forward(self, call: Callable[[], object]) -> object:
        """Runs the wrapped module's forward, ``call``: reads inside gather on demand; what autograd saves of a
        bucket is gathered again for the backward (Note [when a bucket is full])."""
        with self.reads.in_step():
            if not torch.is_grad_enabled():  # no backward follows: nothing stays full after it
                try:
                    return call()
                finally:
                    self._reshard_all()
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                return call()

    def grads_done(self, bucket: Bucket) -> None:
        """Every parameter of ``bucket`` received its gradient in this backward: nothing later reads it."""
        if self._held == 0 and bucket.param.state is ParamState.READY:
            self._free(bucket)

    def end_of_backward(self) -> None:
        """A backward ended: every bucket still full is freed."""
        self._last_unpacked = None
        self._reshard_all()

    def _reshard_all(self) -> None:
        """Frees every full bucket (after a backward, or a forward no backward follows), unless held full."""
        self.finish()
        if self._held == 0:
            for bucket in list(self._full.values()):
                self._free(bucket)

    # --- reads and full_parameters (Note [sharded reads]) ----------------------------------------------------
    @contextlib.contextmanager
    def hook_reads(self, where: str):
        """Inside, reads are a hook's that every rank runs in the same order (``where``: its name): a read gathers
        its bucket once every rank agreed on it, and the buckets it gathered are freed when the hook ends, or at
        the next read when nothing views them (Note [sharded reads])."""
        with self.reads.in_hook(where) as scope:
            try:
                yield
            finally:
                self._free_read(scope, everything=True)

    @contextlib.contextmanager
    def held_full(self):
        """Every bucket full inside, and none freed (collective: every rank enters it). On exit, and before a
        step's :meth:`start` inside, what was written into split parameters reaches this rank's pieces."""
        with self.held(self.gather_order):
            yield

    @contextlib.contextmanager
    def held(self, buckets: list[Bucket]):
        """``buckets`` (in :attr:`gather_order`) full inside, and nothing freed (collective: every rank holds the
        same buckets). On exit what was written into their split parameters reaches this rank's pieces, and every
        bucket full is freed."""
        self._held += 1
        try:
            for bucket in buckets:
                if bucket.param.state is ParamState.FREED:
                    self._dispatch(bucket)
            self.finish()
            yield
        finally:
            self._held -= 1
            if self._held == 0:
                self.finish()
                self._write_back()
                for bucket in list(self._full.values()):
                    self._free(bucket)

    def gather_each(self, use: Callable[[Bucket], None]) -> None:
        """Makes each bucket full in forward order, hands it to ``use`` and frees it (collective; the wrapper is
        being released): at most two buckets are full at once, the one in use and the next one's all-gather."""
        order = self.gather_order
        for i, bucket in enumerate(order):
            self.ensure_gathered(bucket)
            if i + 1 < len(order) and order[i + 1].param.state is ParamState.FREED:
                self._dispatch(order[i + 1])
            use(bucket)
            bucket.param.reshard()
            self._full.pop(id(bucket), None)

    # --- moves -------------------------------------------------------------------------------------------------
    def _dispatch(self, bucket: Bucket) -> None:
        bucket.param.start_unshard()
        self._in_flight.append(bucket)
        self.waiter.trace("ag_dispatch", bucket)

    def _wait(self, bucket: Bucket) -> None:
        self.waiter.wait(bucket.param.gather, "all_gather")
        bucket.param.finish_gather()
        self._in_flight.remove(bucket)
        self._full[id(bucket)] = bucket
        for p in bucket.params:
            read_guard.restore(p)
        self.waiter.trace("ag_wait", bucket)

    def _free(self, bucket: Bucket) -> None:
        if bucket.param.state is ParamState.GATHERING:
            self._wait(bucket)
        bucket.param.reshard()
        self._full.pop(id(bucket), None)
        self._guard(bucket)
        self.waiter.trace("free", bucket)

    def _guard(self, bucket: Bucket) -> None:
        """Every parameter of a freed bucket is marked, those this rank holds whole too: a read of one in a
        step gathers the bucket on every rank, its owner included (Note [sharded reads])."""
        for p in bucket.params:
            read_guard.mark_pending(p)

    def _free_outside(self, keep: list[Bucket], position: int, last: int) -> None:
        """Frees the full buckets a forward has moved past: not the module's own (``keep``, up to position ``last``
        of the forward order), not those prefetched for the modules after it, and not those a later module holds
        (the module at ``position`` of the registration order comes first; Note [when a bucket is full])."""
        for bucket in list(self._full.values()):
            i = self._index[id(bucket)]
            if (self._last_holder.get(id(bucket), -1) < position and not last < i <= last + self.prefetch_depth
                    and bucket not in keep):
                self._free(bucket)

    def _prefetch(self, index: int, step: int) -> None:
        """Dispatches the all-gathers of up to ``prefetch_depth`` freed buckets after (``step=+1``) or before
        (``-1``) position ``index`` of the forward order, while fewer than ``prefetch_depth`` are in flight."""
        i = index + step
        for _ in range(self.prefetch_depth):
            if not 0 <= i < len(self.gather_order) or len(self._in_flight) >= self.prefetch_depth:
                return
            bucket = self.gather_order[i]
            if bucket.param.state is ParamState.FREED:
                self._dispatch(bucket)
            i += step
