"""The ``.grad`` of a split parameter: a tensor that reads as a gradient and holds none to read.

Note [split gradients]
    Under ``ddp`` every parameter that received a gradient has a ``.grad``, and code
    relies on that: ``[p for p in model.parameters() if p.grad is not None]`` is how
    many loops pick what to clip. Here a rank holds the reduced gradient only of what
    it steps. A whole parameter's ``.grad`` exists on its owner, which is enough: the
    owner decides whether it counts. A split parameter's gradient exists on no rank,
    only in pieces, so without more it would be ``None`` everywhere and every such
    filter would drop it (the parameters ended 0.06-0.28 away from ``ddp`` that way).
    So on each rank that steps a piece of a split parameter that received a gradient,
    the sync (``engine/grad_sync.py``) sets the parameter's ``.grad`` to a marker,
    :class:`SplitGradient`: a tensor whose metadata reads as the parameter's gradient's
    would (``is not None``, shape, dtype, device) but which holds one element broadcast
    to that shape and whose elements cannot be read: any operation on them raises
    :class:`SplitGradientError`, naming the parameter and the ways to get what the
    reader wants (this rank's piece, a global norm, ``elementwise_fill=False``).
    Returning partial values instead would be silently wrong.
    ``zero_grad(set_to_none=False)`` passes (there is nothing to zero), and a deep copy of
    the model carries ``None``. The gradient utilities count the parameter through its
    piece (Note [parameter lists] in ``engine/clip.py``). A hook run before
    autograd accumulates into the parameter restarts accumulation when it finds the
    marker still there (a bare ``backward()`` after ``optimizer.zero_grad()``
    cleared the pieces but not the marker), so autograd never adds into it.
"""

from __future__ import annotations

import torch
from torch import nn

from .read_guard import METADATA_FUNCTIONS, describe

__all__ = ["SplitGradient", "SplitGradientError", "make_split_gradient"]


class SplitGradientError(RuntimeError):
    """The values of a split parameter's ``.grad`` were read (Note [split gradients])."""


class SplitGradient(torch.Tensor):
    """The ``.grad`` of a split parameter on a rank that steps a piece of it: see Note [split gradients].

    Its metadata reads as a gradient's (shape, dtype, device, ``is not None``); any operation that would read
    its elements raises :class:`SplitGradientError`. ``zero_`` and ``requires_grad_`` pass (``zero_grad``), and
    a deep copy of it is ``None`` (a copied model carries no gradient it cannot read)."""

    param_name: str = "a split parameter"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in _SPLIT_GRAD_CLEARS:
            return args[0]  # it holds no values to clear (one element, broadcast to the shape)
        if func in _SPLIT_GRAD_PASSES:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        if func is torch.Tensor.__deepcopy__:
            return None
        name = next((t.param_name for t in args if isinstance(t, SplitGradient)), cls.param_name)
        raise SplitGradientError(
            f"{describe(func)} read the gradient of {name!r}, which strategy='layerwise' splits across ranks "
            "(element-wise fill): no rank holds all of it, so its .grad only marks that it has a gradient this step "
            "(as `p.grad is not None` does under ddp). Read this rank's piece as "
            "wrapper.records.piece_of(param).grad, take norms with torch.nn.utils.clip_grad_norm_ or lightning's "
            "grad_norm (both global under the strategy), or keep the parameter whole with elementwise_fill=False.")


def _split_grad_passes() -> frozenset:
    """What a split gradient lets through: every attribute of a tensor but those that hand out its values
    (``data``, ``real``, ``imag`` and the transposes), and the methods that read no element. torch.compile
    inspects gradients this way when it (re)compiles."""
    base = torch._C.TensorBase
    values = {"data", "real", "imag", "T", "H", "mT", "mH"}
    getters = {v.__get__ for n, v in base.__dict__.items()
               if type(v).__name__ == "getset_descriptor" and n not in values}
    reads = {"is_nonzero", "_is_all_true", "_is_any_true"}  # predicates on the values
    names = {n for n in dir(base) if (n.startswith("is_") or n.startswith("_is_")) and n not in reads}
    names |= {"detach_", "data_ptr", "untyped_storage", "storage_offset", "dim", "size", "stride", "numel",
              "nelement", "element_size", "get_device", "__len__"}
    methods = {getattr(owner, name) for owner in (base, torch.Tensor) for name in names if hasattr(owner, name)}
    return METADATA_FUNCTIONS | getters | methods


_SPLIT_GRAD_CLEARS = frozenset({torch.Tensor.zero_, torch._C.TensorBase.zero_})
_SPLIT_GRAD_PASSES = _split_grad_passes()


def make_split_gradient(param: nn.Parameter, name: str) -> SplitGradient:
    """A marker of ``param``'s shape, dtype and device, one element broadcast: it holds nothing to read."""
    one = torch.zeros((), dtype=param.dtype, device=param.device).expand(param.shape)
    marker = torch.Tensor._make_subclass(SplitGradient, one)
    marker.param_name = name
    return marker
