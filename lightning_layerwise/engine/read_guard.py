"""Parameter reads that wait for their all-gather: the read guard.

Note [read guard]
    With the overlapped all-gather, a parameter's new value lands some time after ``optimizer.step``: when the
    forward pre-hook of its module waits for its bucket. A read from anywhere else (``out_proj.weight`` read by
    ``nn.MultiheadAttention`` without calling ``out_proj``; a parametrization; ``training_step`` code or a hook
    before the forward) would see the previous step's value, or half of the new one.

    So while its bucket is in flight, every parameter of the bucket carries the class :class:`PendingParameter`
    (an ``nn.Parameter`` subclass swapped in with ``__class__``: optimizer state, hooks and names untouched). Its
    ``__torch_function__`` sees every torch operation that takes the parameter, directly or in a list: it asks
    the wrapper to wait for the bucket (which restores ``nn.Parameter`` on each parameter of every bucket that
    lands), then runs the operation. Operations that read no element (``shape``, ``dtype``, ``grad``,
    ``requires_grad``, ``numel``...) pass without waiting, so ``zero_grad`` and Lightning's bookkeeping keep the
    overlap. Cost: nothing once the bucket landed, one Python call per operation on a pending parameter, two
    attribute stores per parameter per step. ``copy.deepcopy`` is a read and gives a plain ``nn.Parameter``.

    What it cannot see: a tensor taken from a parameter *before* the all-gather started and kept (``w =
    layer.weight.data`` stored at set-up); reads inside a graph compiled while the parameters were plain (the
    strategy completes the all-gather inside the step for compiled models); parameters whose class is not
    exactly ``nn.Parameter`` (the wrapper completes the all-gather inside the step for those).

    ``"strict"`` turns the wait into :class:`StaleParameterReadError`, to find every read not made by the
    parameter's own module, and poisons the other ranks' shards with NaN until they arrive, so a read the guard
    cannot see shows up as NaN.
"""

from __future__ import annotations

import weakref
from typing import Callable, Literal

import torch
from torch import nn
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

ReadGuard = Literal["wait", "strict", "off"]
READ_GUARDS: tuple[str, ...] = ("wait", "strict", "off")


class StaleParameterReadError(RuntimeError):
    """A parameter was read while its all-gather had not landed (``param_read_guard="strict"``)."""


def _metadata_functions() -> frozenset:
    """Tensor operations that read no element of the tensor: they never wait."""
    base = torch._C.TensorBase
    getters = ("shape", "dtype", "device", "layout", "ndim", "requires_grad", "is_leaf", "grad_fn", "grad",
               "is_cuda", "is_cpu", "is_meta", "is_sparse", "is_quantized", "is_nested", "itemsize", "nbytes",
               "name", "output_nr", "_version", "_backward_hooks", "_post_accumulate_grad_hooks")
    methods = ("size", "dim", "numel", "nelement", "element_size", "stride", "is_floating_point", "is_complex",
               "is_contiguous", "get_device", "__len__", "requires_grad_", "register_hook",
               "register_post_accumulate_grad_hook")
    funcs = set()
    for name in getters:
        descriptor = getattr(base, name, None)
        if descriptor is not None and hasattr(descriptor, "__get__"):
            funcs.add(descriptor.__get__)
            if name in ("grad", "requires_grad") and hasattr(descriptor, "__set__"):
                funcs.add(descriptor.__set__)
    for name in methods:
        for owner in (base, torch.Tensor):
            method = getattr(owner, name, None)
            if method is not None:
                funcs.add(method)
    return frozenset(funcs)


METADATA_FUNCTIONS = _metadata_functions()
"""Tensor operations that read no element (also what a split gradient allows, ``split_gradient.SplitGradient``)."""
_calls = 0  # operations that read a pending parameter so far: see call_index()
_ON_READ: WeakIdKeyDictionary = WeakIdKeyDictionary()
"""Each guarded parameter (held weakly, by identity) -> its parameter side's ``callback(param, func)`` that makes
it current or raises. Kept out of the parameter itself so that ``copy.deepcopy`` and pickling of a model never
reach the wrapper."""


class PendingParameter(nn.Parameter):
    """The class of a parameter whose all-gather is in flight; see Note [read guard]."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in METADATA_FUNCTIONS:
            global _calls
            _calls += 1
            for leaf in tree_leaves((args, kwargs)):
                if type(leaf) is PendingParameter:  # still pending: an earlier wait may have landed it
                    ref = _ON_READ.get(leaf)
                    on_read = ref() if ref is not None else None
                    if on_read is not None:
                        on_read(leaf, func)
                    else:  # a copy (deepcopy), or its wrapper is gone: nothing to wait for
                        leaf.__class__ = nn.Parameter
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    def __deepcopy__(self, memo):
        """A plain ``nn.Parameter`` holding the current values (taking ``data`` is a read: it waits or gathers)."""
        if id(self) not in memo:
            memo[id(self)] = nn.Parameter(self.data.clone(memory_format=torch.preserve_format), self.requires_grad)
        return memo[id(self)]


def call_index() -> int:
    """Which operation the current read belongs to: the reads of one operation (``torch.stack(params)``) share
    it, so that a wrapper keeps every parameter they gathered until the operation ran."""
    return _calls


def can_guard(param: nn.Parameter) -> bool:
    """Only plain ``nn.Parameter`` objects can take the pending class (see Note [read guard])."""
    return type(param) is nn.Parameter


def attach(param: nn.Parameter, on_read: Callable[[nn.Parameter, Callable], None]) -> None:
    """Routes reads of ``param`` while pending to ``on_read`` (a bound method, held weakly)."""
    _ON_READ[param] = weakref.WeakMethod(on_read)


def detach(param: nn.Parameter) -> None:
    restore(param)
    _ON_READ.pop(param, None)


def mark_pending(param: nn.Parameter) -> None:
    param.__class__ = PendingParameter


def restore(param: nn.Parameter) -> None:
    if type(param) is PendingParameter:
        param.__class__ = nn.Parameter


def describe(func: Callable) -> str:
    """A readable name for the torch operation that read a parameter."""
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None)
    accessor = name.rsplit(".", 1)[-1] if name else None
    if accessor in ("__get__", "__set__"):  # an attribute's descriptor: Tensor.data (get)
        owner = getattr(getattr(func, "__self__", None), "__name__", "attribute")
        return f"Tensor.{owner} ({accessor.strip('_')})"
    return name or repr(func)
