"""torch's and Lightning's gradient utilities, global over sharded gradients.

Note [gradient utilities]
    A rank holds the reduced gradient only of what it steps, so ``clip_grad_norm_(model.parameters(), max_norm)``
    would compute a different norm on every rank and clip each by a different factor, and Lightning's
    ``grad_norm`` would log this rank's part. While a :class:`GradientUtilities` hold is alive (a session holds
    one from ``wrap`` to ``release``; a hand-built loop takes ``with lightning_layerwise.gradient_utilities():``)
    these functions see through the sharding:

    * ``clip_grad_norm_`` over the wrapper's parameters computes the norm of their *full* gradient (one
      all-reduce, Note [norm from shards] in ``engine/clip.py``) and scales every rank's part by the same
      coefficient: the one-process result. Collective, as every ``ddp`` rank calls it.
    * ``clip_grads_with_norm_`` and ``clip_grad_value_`` act on the owned gradients, masters included (local).
    * Lightning's ``grad_norm(module, norm_type)`` returns each parameter's full-gradient norm and their total,
      with ``ddp``'s keys: one all-reduce of one number per parameter. Collective too.
    * ``get_total_norm(tensors)`` takes gradients: a rank owning none of them cannot know to take part in a
      collective, so given a handed-out gradient it raises, naming ``clip_grad_norm_(params, float("inf"))``
      and :func:`lightning_layerwise.grad_norm`.
    * ``nn.Module.zero_grad`` also clears what the optimizer holds where that is not the parameter itself (a
      piece, a master), as ``optimizer.zero_grad()`` does (Note [gradient lifecycle] in ``engine/grad_sync.py``).

    Anything else passes to the original: a call on no live wrapper's tensors costs one dictionary test. Nothing
    is patched by importing the package or building the engine: the first hold installs the patches, the last
    one released puts every original back (scope ``GRADIENT_UTILITIES`` of Note [patches] in
    ``engine/patches.py``). Names bound before the import (``from torch.nn.utils import clip_grad_norm_``) are
    covered too: torch's functions are replaced behind their ``no_grad`` wrapper (the closure cell), Lightning's
    ``grad_norm`` by its code object, ``zero_grad`` on the ``nn.Module`` class.
"""

from __future__ import annotations

import functools
import math
import weakref
from typing import Callable

import torch
from torch import nn

from . import clip, collectives, patches
from .data_parallel import LayerwiseDataParallel
from .live_wrappers import _LIVE, live_wrappers, wrapper_of
from .tensor_parallel import is_sharded, sum_over_mesh, tensor_parallel_group
from .patches import patched_functions  # noqa: F401  an import path of it (Note [patches] in patches.py)

_ORIGINAL: dict[str, Callable] = {}  # torch's implementations, while patched

_TORCH = {name: patches.register(f"torch.nn.utils.{name}", "gradient utilities")
          for name in ("clip_grad_norm_", "clip_grad_value_", "get_total_norm", "clip_grads_with_norm_")}
_ZERO_GRAD = patches.register("torch.nn.Module.zero_grad", "gradient utilities")


class GradientUtilities:
    """A hold on the patches of Note [gradient utilities]: installed with the first live hold, removed with the
    last. :class:`~lightning_layerwise.LayerwiseSession` holds one from :meth:`wrap` to :meth:`release`; a loop
    that builds :class:`LayerwiseDataParallel` itself takes one as a context manager::

        with lightning_layerwise.gradient_utilities():
            ...  # torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0) clips by the global norm

    :meth:`release` is idempotent, and a hold that is garbage-collected releases itself.
    """

    def __init__(self) -> None:
        patches.GRADIENT_UTILITIES.hold()
        self._finalizer = weakref.finalize(self, patches.GRADIENT_UTILITIES.release)

    def release(self) -> None:
        self._finalizer()

    def __enter__(self) -> "GradientUtilities":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def gradient_utilities() -> GradientUtilities:
    """A hold on the patched gradient utilities (Note [gradient utilities]); see :class:`GradientUtilities`."""
    return GradientUtilities()


def installed() -> bool:
    """Whether the patches are in place (some hold is alive)."""
    return patches.GRADIENT_UTILITIES.holds > 0


def _install_torch(name: str, replacement: Callable) -> Callable[[], patches.Undo]:
    """The install of torch's ``name`` (its public name in ``torch.nn.utils``); see Note [gradient utilities]."""
    private = {"get_total_norm": "_get_total_norm", "clip_grads_with_norm_": "_clip_grads_with_norm_"}.get(name, name)

    def install() -> patches.Undo:
        from torch.nn.utils import clip_grad as torch_clip

        function = getattr(torch_clip, private, None)
        if function is None:
            return lambda: None
        cell = _implementation_cell(function)
        if cell is not None:
            _ORIGINAL[private] = original = cell.cell_contents
            return _TORCH[name].set_cell(cell, functools.wraps(original)(replacement))
        # another release's layout: replace the module attributes (names bound earlier keep the original)
        _ORIGINAL[private] = function
        patched = functools.wraps(function)(_no_grad(replacement))
        undo_private = _TORCH[name].set_attribute(torch_clip, private, patched)
        undo_public = _TORCH[name].set_attribute(torch.nn.utils, name, patched)

        def undo() -> None:
            undo_public()
            undo_private()
        return undo
    return install


def _install_zero_grad() -> patches.Undo:
    _ORIGINAL["zero_grad"] = zero_grad = nn.Module.__dict__["zero_grad"]
    return _ZERO_GRAD.set_attribute(nn.Module, "zero_grad", functools.wraps(zero_grad)(_module_zero_grad))


def _implementation_cell(function: Callable):
    """The closure cell of torch's ``_no_grad`` wrapper that holds the implementation, if it has that form."""
    code = getattr(function, "__code__", None)
    closure = getattr(function, "__closure__", None)
    if code is None or closure is None or "func" not in code.co_freevars:
        return None
    return closure[code.co_freevars.index("func")]


def _no_grad(function: Callable) -> Callable:
    def run(*args, **kwargs):
        with torch.no_grad():
            return function(*args, **kwargs)
    return run


# --- which wrapper ---------------------------------------------------------------------------------------------

def synced_wrapper(tensors: list) -> LayerwiseDataParallel | None:
    """The live wrapper among ``tensors`` whose gradients are reduced now, or ``None`` (then the original runs).

    A list naming no tensor of any wrapper still goes to the live wrapper whose gradients were reduced last, if
    any: a list filtered by ``p.grad is not None`` is empty on a rank that steps none of the listed parameters
    while the other ranks' lists are not, and that rank must take part in the norm's collective (Note [parameter
    lists] in ``engine/clip.py``). Every rank makes the same choice: all ranks reduced the same wrapper last.
    Counting the live wrappers instead would not be safe: a wrapper nobody released lives until the garbage
    collector finds it, which happens at another moment on each rank (a forked worker inherits its parent's
    uncollected wrappers), and ranks that saw different counts once chose differently and hung. A call about
    other tensors only then adds one small all-reduce and gives torch's result.
    """
    found = None
    for t in tensors:
        wrapper = wrapper_of(t)
        if wrapper is None or wrapper is found:
            continue
        if found is not None:
            raise ValueError("these parameters are trained by two different layer-wise wrappers at once; clip the "
                             "parameters of each wrapper separately.")
        found = wrapper
    if found is None:
        synced = [w for w in live_wrappers() if w.grad_sync.grads_synced]
        found = max(synced, key=lambda w: w.grad_sync.synced_at) if synced else None
    return found if found is not None and found.grad_sync.grads_synced else None


def _as_list(parameters) -> list:
    return [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)


# --- torch.nn.utils --------------------------------------------------------------------------------------------

def _clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
    original = _ORIGINAL["clip_grad_norm_"]
    if not _LIVE:
        return original(parameters, max_norm, norm_type, error_if_nonfinite, foreach)
    params = _as_list(parameters)
    wrapper = synced_wrapper(params)
    if wrapper is None:
        return original(params, max_norm, norm_type, error_if_nonfinite, foreach)
    foreign = [p for p in params if wrapper.records.of(p) is None]
    total = clip.grad_norm(wrapper, norm_type, parameters=params)
    foreign_grads = [p.grad for p in foreign if p.grad is not None]
    if foreign_grads:  # tensors the wrapper does not train: this rank's own values, as torch computes them
        local = _ORIGINAL["_get_total_norm"](foreign_grads, norm_type, False, foreach).to(total.device)
        p = float(norm_type)
        total = torch.maximum(total, local) if math.isinf(p) else (total.pow(p) + local.pow(p)).pow(1.0 / p)
    if error_if_nonfinite and not torch.isfinite(total).item():
        raise RuntimeError(
            f"The total norm of order {float(norm_type)} for gradients from `parameters` is non-finite, so it "
            "cannot be clipped. To disable this error and scale the gradients by the non-finite norm anyway, "
            "set `error_if_nonfinite=False`")
    clip.scale_grads_by_norm_(wrapper, max_norm, total, parameters=params)
    if foreign:
        _ORIGINAL["_clip_grads_with_norm_"](foreign, max_norm, total, foreach)
    return total


def _clip_grads_with_norm_(parameters, max_norm, total_norm, foreach=None):
    original = _ORIGINAL["_clip_grads_with_norm_"]
    if not _LIVE:
        return original(parameters, max_norm, total_norm, foreach)
    params = _as_list(parameters)
    wrapper = synced_wrapper(params)
    if wrapper is None:
        return original(params, max_norm, total_norm, foreach)
    clip.scale_grads_by_norm_(wrapper, max_norm, total_norm, parameters=params)
    foreign = [p for p in params if wrapper.records.of(p) is None]
    if foreign:
        original(foreign, max_norm, total_norm, foreach)
    return None


def _clip_grad_value_(parameters, clip_value, foreach=None):
    original = _ORIGINAL["clip_grad_value_"]
    if not _LIVE:
        return original(parameters, clip_value, foreach)
    params = _as_list(parameters)
    wrapper = synced_wrapper(params)
    if wrapper is None:
        return original(params, clip_value, foreach)
    clip.clip_grad_value_(wrapper, clip_value, parameters=params)
    foreign = [p for p in params if wrapper.records.of(p) is None]
    if foreign:
        original(foreign, clip_value, foreach)
    return None


def _get_total_norm(tensors, norm_type=2.0, error_if_nonfinite=False, foreach=None):
    original = _ORIGINAL["_get_total_norm"]
    if _LIVE:
        listed = _as_list(tensors)
        if any(_handed_out_by_live_wrapper(t) for t in listed):
            raise ValueError(
                "torch.nn.utils.get_total_norm was given gradients that strategy='layerwise' shards across ranks: "
                "it would return the norm of this rank's shards only, and a rank that owns none of them gets an "
                "empty list and cannot take part in computing the global norm. Use "
                "torch.nn.utils.clip_grad_norm_(parameters, float('inf')) (collective: returns the norm of the "
                "full gradient and leaves it unchanged), or lightning_layerwise.grad_norm(wrapper).")
        tensors = listed
    return original(tensors, norm_type, error_if_nonfinite, foreach)


def _handed_out_by_live_wrapper(tensor: torch.Tensor) -> bool:
    return any(w.ranks.dp_size > 1 and w.grad_sync.handed_out_gradient(tensor) for w in live_wrappers())


def _module_zero_grad(self: nn.Module, set_to_none: bool = True) -> None:
    _ORIGINAL["zero_grad"](self, set_to_none)
    if _LIVE:
        for p in self.parameters():
            wrapper = wrapper_of(p)
            if wrapper is not None:
                wrapper.grad_sync.clear_stepped_grad(p, set_to_none)


for _name, _replacement in (("clip_grad_norm_", _clip_grad_norm_), ("clip_grad_value_", _clip_grad_value_),
                            ("get_total_norm", _get_total_norm), ("clip_grads_with_norm_", _clip_grads_with_norm_)):
    patches.GRADIENT_UTILITIES.add(_install_torch(_name, _replacement))
patches.GRADIENT_UTILITIES.add(_install_zero_grad)


def per_parameter_norms(wrapper: LayerwiseDataParallel, named: list, p: float) -> dict[str, torch.Tensor]:
    """Each parameter's full gradient norm, for the parameters that have a gradient on some rank (collective:
    one all-reduce of a value and a flag per parameter, per kind of group)."""
    infinite = math.isinf(p)
    device = wrapper.grad_sync.flat_buffers[0].grads.device
    groups = wrapper.process_groups
    kinds: dict[bool, list] = {False: [], True: []}  # expert? -> [(name, local value, has gradient)]
    local_norms: dict[str, torch.Tensor] = {}
    named_params: dict[str, torch.Tensor] = {}
    for name, param in named:
        record = wrapper.records.of(param)
        if record is not None:
            named_params[name] = record.param
        if record is None:
            if param.grad is not None:  # not trained by the wrapper: this rank's value, as Lightning computes it
                local_norms[name] = param.grad.detach().norm(p)
            continue
        unit = record.unit
        held = unit is not None and unit.stepped.grad is not None
        if held:
            g = unit.slot.detach().float()
            value = g.abs().amax() if infinite and g.numel() else (g.abs().pow(p).sum() if not infinite
                                                                  else torch.zeros((), device=g.device))
        else:
            value = torch.zeros((), device=device)
        expert = record.bucket.expert
        kinds[expert].append((name, value.to(device), 1.0 if held else 0.0))
    out: dict[str, torch.Tensor] = {}
    for expert, entries in kinds.items():
        if not entries:
            continue
        values = torch.stack([v for _, v, _ in entries])
        flags = torch.tensor([f for _, _, f in entries], device=device)
        both = torch.cat([values, flags])
        if expert:
            group = groups.expert_dp
        else:
            group = groups.dp if infinite else wrapper.grad_sync.layout_group
        if infinite:
            collectives.all_reduce_max(both, group)
        else:
            collectives.all_reduce_sum(both, group)
        n = len(entries)
        tp_group = tensor_parallel_group(record.param for record in wrapper.records)
        if tp_group is not None:  # Note [norms over the mesh] in engine/tensor_parallel.py
            both = _over_mesh(both, [is_sharded(named_params[name]) for name, _, _ in entries], infinite, tp_group)
        has_gradient = both[n:].tolist()  # one host transfer for all of them
        for i, (name, _, _) in enumerate(entries):
            if has_gradient[i] > 0:
                out[name] = both[i] if infinite else both[i].pow(1.0 / p)
    out.update(local_norms)
    return {name: out[name] for name, _ in named if name in out}


def _over_mesh(both: torch.Tensor, sharded: list[bool], infinite: bool, group) -> torch.Tensor:
    """Per-parameter values and flags of one data-parallel position made the whole gradient's: sharded
    parameters' sums added over the tensor-parallel group, replicated ones kept (the same on every rank of it);
    maxima taken over the group."""
    import torch.distributed as dist

    n = len(sharded)
    if infinite:
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
        return both
    mask = torch.tensor(sharded, dtype=both.dtype, device=both.device)
    values = both[:n]
    summed = sum_over_mesh(values * mask, torch.zeros_like(values), group)
    return torch.cat([summed + values * (1 - mask), both[n:]])
