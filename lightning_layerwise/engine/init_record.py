"""What a model's construction does to its tensors on the meta device, recorded to be replayed on real memory.

Under :func:`record_init` (entered by ``init_module(empty_init=True)`` with sharded parameters) every operation
that creates or writes a meta tensor is kept, in order, as an :class:`Op`: its function, its arguments (a meta
tensor as a :class:`TensorRef`: its storage and its place in it; real tensors as they are), what it reads,
writes and overwrites whole. Views are not kept: a tensor is found by its storage and its geometry. Every
random operation also draws, at once, the same numbers from the same generator as a build on ``device`` would
(on a scratch tensor of the same geometry, thrown away), so the generators go on as after an eager build; an op
that starts where the previous one did not end (a re-seed, draws of real tensors in between) keeps the
generator state it starts from. Replaying the ops from those states gives what an eager build gives (Note
[meta-device models] in ``materialize.py``). Nothing here imports Lightning.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import types
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import Tensor, nn
from torch.nn.modules import module as module_hooks
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from . import patches

aten = torch.ops.aten

OVERWRITES = frozenset({aten.normal_, aten.uniform_, aten.fill_, aten.zero_, aten.copy_, aten.random_,
                        aten.bernoulli_, aten.exponential_, aten.cauchy_, aten.log_normal_, aten.geometric_})
"""In-place ops that write their target without reading it: where the target covers its storage, the storage's
earlier value is dead."""
UNINITIALIZED = frozenset({aten.empty, aten.empty_strided, aten.empty_like, aten.new_empty, aten.new_empty_strided})
"""Ops whose result holds no value: they are never replayed (the storage gets memory when first written)."""
_METADATA = frozenset({aten.set_, aten.resize_, aten.resize_as_})
"""In-place ops that change which memory a tensor views, not the memory: like views, not kept."""
_DRAWS_BY_SHAPE = frozenset({
    aten.normal_, aten.uniform_, aten.bernoulli_, aten.bernoulli, aten.exponential_, aten.cauchy_,
    aten.log_normal_, aten.geometric_, aten.random_, aten.randn, aten.randn_like, aten.rand, aten.rand_like,
    aten.randint, aten.randint_like, aten.randperm, aten.normal, aten.native_dropout})
"""Random ops whose draws depend on the shapes only, not on the values read: the draws made while recording (on
scratch tensors of ones) are those of the eager build. Any other random op on a meta tensor is refused."""


def skipping_meta() -> list[types.FunctionType]:
    """The functions of ``torch.nn.init`` that return at once on a meta tensor (``trunc_normal_``'s helper,
    ``orthogonal_``, ``dirac_``, ``sparse_`` in torch 2.13): no op to record, no draw. While recording, each call
    on a meta tensor is kept as one op, run whole on a scratch tensor for its draws and on real memory when
    replayed (:func:`_intercept`)."""
    return [f for f in vars(torch.nn.init).values() if isinstance(f, types.FunctionType)
            and f.__module__ == "torch.nn.init" and "is_meta" in f.__code__.co_names and not f.__code__.co_freevars]


_sequence = itertools.count()
_RECORDINGS: "weakref.WeakKeyDictionary[nn.Module, list[Recording]]" = weakref.WeakKeyDictionary()
"""Each module that got a parameter, buffer or submodule under :func:`record_init` -> the recordings it was
built in; the model's modules find their recording here (it lives as long as one of them)."""
_active: list[Recording] = []


class _MetaDevice:
    """Stands for ``torch.device("meta")`` in a kept op's arguments: the device replays it on real memory."""

    def __repr__(self) -> str:
        return "META"


META = _MetaDevice()


@dataclass(frozen=True)
class TensorRef:
    """A meta tensor of a kept op: its storage (``key``) and its place in it."""

    key: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype

    @classmethod
    def of(cls, t: Tensor) -> TensorRef:
        return cls(storage_key(t), tuple(t.size()), tuple(t.stride()), t.storage_offset(), t.dtype)


@dataclass
class Op:
    """One kept operation: ``func(*args, **kwargs)`` with :class:`TensorRef` and :data:`META` in place of meta
    tensors and devices. ``outputs``: the storages it creates, each with its place among the tensors of the
    result (``tree_leaves``); ``reads``/``writes``: storage keys; ``kills``: the written storages it overwrites
    whole without reading them. ``generator``: what a random op draws from;
    ``rng_state``: the state it starts from, where that is not where the previous draw of this recording left
    the generator."""

    func: Callable
    args: tuple
    kwargs: dict
    outputs: tuple[tuple[int, TensorRef], ...]
    reads: frozenset[int]
    writes: frozenset[int]
    kills: frozenset[int]
    generator: torch.Generator | None = None
    rng_state: Tensor | None = None
    refusal: str | None = None

    @property
    def uninitialized(self) -> bool:
        return getattr(self.func, "overloadpacket", None) in UNINITIALIZED

    @property
    def name(self) -> str:
        packet = getattr(self.func, "overloadpacket", None)
        return f"aten.{packet.__name__}" if packet is not None else f"torch.nn.init.{self.func.__name__}"


def storage_key(t: Tensor) -> int:
    return t.untyped_storage()._cdata


def covers(t: Tensor) -> bool:
    """Whether ``t`` is its whole storage (an in-place write to an overlapping view raises, so equal size is)."""
    return t.numel() * t.element_size() == t.untyped_storage().nbytes()


def default_generator(device: torch.device) -> torch.Generator:
    if device.type == "cuda":
        torch.cuda.init()
        return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    return torch.default_generator


def scratch(ref: TensorRef | Tensor, device: torch.device) -> Tensor:
    """A real tensor of ``ref``'s geometry holding ones: what a random op draws into while recording."""
    size, stride = (ref.size, ref.stride) if isinstance(ref, TensorRef) else (ref.size(), ref.stride())
    return torch.empty_strided(size, stride, dtype=ref.dtype, device=device).fill_(1)


@dataclass(eq=False)
class Recording:
    """The ops of one :func:`record_init` block, in order, for models built on the meta device."""

    device: torch.device
    ops: list[Op] = field(default_factory=list)
    storages: dict[int, torch.UntypedStorage] = field(default_factory=dict)
    """Every meta storage a kept op names, held so that no other storage takes its key."""
    sequence: int = field(default_factory=lambda: next(_sequence))
    _after: dict[torch.Generator, Tensor] = field(default_factory=dict)

    def ref(self, t: Tensor) -> TensorRef:
        ref = TensorRef.of(t)
        self.storages.setdefault(ref.key, t.untyped_storage())
        return ref

    def keep(self, func: Callable, args: tuple, kwargs: dict, *, outputs: tuple[tuple[int, Tensor], ...] = (),
             reads=(), writes=(), kills=(), generator: torch.Generator | None = None,
             draw: Callable[[], Any] | None = None, refusal: str | None = None) -> None:
        """Keeps an op; ``draw`` makes its draws on scratch memory now (a random op: ``generator``)."""
        def as_ref(x):
            if isinstance(x, Tensor) and x.is_meta:
                return self.ref(x)
            return META if isinstance(x, torch.device) and x.type == "meta" else x
        args, kwargs = tree_map(as_ref, (args, kwargs))
        state = None
        if generator is not None:
            start = generator.get_state()
            last = self._after.get(generator)
            state = None if last is not None and torch.equal(start, last) else start
            draw()
            self._after[generator] = generator.get_state()
        self.ops.append(Op(func, args, kwargs, tuple((i, self.ref(t)) for i, t in outputs),
                           frozenset(storage_key(t) for t in reads), frozenset(storage_key(t) for t in writes),
                           frozenset(storage_key(t) for t in kills), generator, state, refusal))

    def generator_of(self, kwargs: dict) -> torch.Generator:
        return kwargs.get("generator") or default_generator(self.device)


def _mutated(func, args: tuple, kwargs: dict) -> list[tuple[Tensor, bool]]:
    """The tensors ``func`` writes in place, each with whether it is an ``out=`` argument."""
    found = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        for t in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(t, Tensor):
                found.append((t, arg.is_out))
    return found


class _RecordOps(TorchDispatchMode):
    """Keeps every aten op that creates or writes a meta tensor (Note [meta-device models])."""

    def __init__(self, recording: Recording) -> None:
        super().__init__()
        self.recording = recording

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        metas_in = [t for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor) and t.is_meta]
        metas_out = [(i, t) for i, t in enumerate(t for t in tree_leaves(out) if isinstance(t, Tensor)) if t.is_meta]
        if (metas_in or metas_out) and func.overloadpacket not in _METADATA \
                and torch.Tag.inplace_view not in func.tags:
            self._keep(func, args, kwargs, metas_in, metas_out)
        return out

    def _keep(self, func, args, kwargs, metas_in, metas_out) -> None:
        mutated = _mutated(func, args, kwargs)
        known = {storage_key(t) for t in metas_in}
        fresh = tuple((i, t) for i, t in metas_out if storage_key(t) not in known)
        if not mutated and not fresh:
            return  # a view
        overwrites = func.overloadpacket in OVERWRITES
        created = [t for _, t in fresh]
        writes = [t for t, _ in mutated if t.is_meta] + created
        kills = [t for t, is_out in mutated if t.is_meta and (overwrites or is_out) and covers(t)] + created
        written = {id(t) for t, _ in mutated}
        reads = [t for t in metas_in if id(t) not in written]
        reads += [t for t, is_out in mutated if t.is_meta and not (overwrites or is_out)]
        random = torch.Tag.nondeterministic_seeded in func.tags
        rec = self.recording
        generator = rec.generator_of(kwargs) if random else None
        refusal = None
        if random and func.overloadpacket not in _DRAWS_BY_SHAPE:
            refusal = (f"aten.{func.overloadpacket.__name__} draws a number of random values that depends on the "
                       "values it reads")

        def draw():
            real = tree_map(lambda x: scratch(x, generator.device) if isinstance(x, Tensor) and x.is_meta
                            else generator.device if isinstance(x, torch.device) and x.type == "meta" else x,
                            (args, kwargs))
            if refusal is None:
                func(*real[0], **real[1])
        rec.keep(func, args, kwargs, outputs=fresh, reads=reads, writes=writes, kills=kills,
                 generator=generator, draw=draw if random else None, refusal=refusal)


class _RecordData(TorchFunctionMode):
    """``torch.tensor``'s data, which the dispatcher does not see. An empty ``torch.tensor`` is made on the device,
    as an eager build makes it: libraries that probe the build's device with one (Hugging Face's
    ``init_weights`` skips its initialization on the meta device) then initialize as in an eager build."""

    def __init__(self, recording: Recording) -> None:
        super().__init__()
        self.recording = recording

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in (torch.tensor, torch.as_tensor) and isinstance(out, Tensor) and out.is_meta \
                and not (args and isinstance(args[0], Tensor)):
            value = func(*args, **{**kwargs, "device": "cpu"})
            if value.numel() == 0:
                return value.to(self.recording.device)
            self.recording.keep(aten._to_copy.default, (value,), {"dtype": out.dtype, "device": out.device},
                                outputs=((0, out),), writes=(out,), kills=(out,))
        return out


def _keep_whole(recording: Recording, fn: types.FunctionType, original: types.FunctionType, args, kwargs):
    """A call of a :func:`skipping_meta` function: kept whole where its tensor is meta, else run."""
    call = inspect.signature(original).bind(*args, **kwargs).arguments
    first = next(iter(call))
    target = call[first]
    if not (isinstance(target, Tensor) and target.is_meta):
        return original(*args, **kwargs)
    generator = call.get("generator") or default_generator(recording.device)

    def draw():
        with torch.device(generator.device):  # its own tensors (sparse_'s randperm) where an eager build has them
            original(**{**call, first: scratch(target, generator.device)})
    recording.keep(fn, (), call, writes=(target,), kills=(target,) if covers(target) else (),
                   generator=generator, draw=draw)
    return target


def _patch_of(fn: types.FunctionType) -> patches.Patch:
    return patches.register(f"torch.nn.init.{fn.__name__}", "init record")


for _fn in skipping_meta():  # registered at import: patched_functions lists them
    _patch_of(_fn)


@contextlib.contextmanager
def _intercept(fn: types.FunctionType, handler: Callable) -> Iterator[None]:
    """Every call of ``fn``, by whoever holds it, calls ``handler(original, args, kwargs)`` inside the block:
    ``fn``'s code is swapped for a stub calling the handler and restored at the end (a copy of the original runs
    meanwhile; Note [patches] in ``patches.py``). Module attributes would miss references taken at import (Hugging
    Face keeps torch's)."""
    original = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__)
    original.__kwdefaults__ = fn.__kwdefaults__
    name = f"_layerwise_recorded_{fn.__name__}"
    fn.__globals__[name] = lambda args, kwargs: handler(original, args, kwargs)
    stub: dict = {}
    exec(f"def {fn.__name__}(*args, **kwargs):\n    return {name}(args, kwargs)\n", fn.__globals__, stub)
    undo = _patch_of(fn).swap_code(fn, stub[fn.__name__].__code__)
    try:
        yield
    finally:
        undo()
        fn.__globals__.pop(name, None)


@contextlib.contextmanager
def record_init(device: torch.device | str) -> Iterator[Recording | None]:
    """Records the block's operations on meta tensors for the modules built in it (module docstring). Yields
    ``None`` (records nothing) on a device other than the CPU or CUDA, or inside another recording."""
    device = torch.device(device)
    if device.type not in ("cpu", "cuda") or _active:
        yield None
        return
    recording = Recording(device)

    def built_here(module: nn.Module, name: str, value: Any) -> None:
        held = _RECORDINGS.setdefault(module, [])
        if recording not in held:
            held.append(recording)
    handles = [module_hooks.register_module_parameter_registration_hook(built_here),
               module_hooks.register_module_buffer_registration_hook(built_here),
               module_hooks.register_module_module_registration_hook(built_here)]
    _active.append(recording)
    try:
        with contextlib.ExitStack() as stack:
            for fn in skipping_meta():
                stack.enter_context(_intercept(fn, lambda original, args, kwargs, fn=fn:
                                               _keep_whole(recording, fn, original, args, kwargs)))
            stack.enter_context(_RecordData(recording))
            stack.enter_context(_RecordOps(recording))
            yield recording
    finally:
        _active.remove(recording)
        for handle in handles:
            handle.remove()


def recordings_of(module: nn.Module) -> list[Recording]:
    """The recordings ``module``'s modules were built in, oldest first."""
    found = {r.sequence: r for m in module.modules() for r in _RECORDINGS.get(m, ())}
    return [found[k] for k in sorted(found)]


def forget(module: nn.Module) -> None:
    """Drops the recordings of ``module``'s modules (materialized: nothing will replay them again)."""
    for m in module.modules():
        _RECORDINGS.pop(m, None)
