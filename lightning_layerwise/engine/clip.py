"""Global gradient norm and clipping over the gradient shards of a :class:`LayerwiseDataParallel`.

After :meth:`~lightning_layerwise.LayerwiseDataParallel.finish_grad_sync` each
rank holds the reduced gradient of the parameters it owns and nothing else, so
``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` would see only this
rank's part of the gradient and compute a different norm (and scale) on every
rank. The functions here compute the norm of the *full* gradient from the owned
shards with one all-reduce, and scale or clamp only the owned gradients, so
every rank applies the same coefficient a single process would. No Lightning
here: the strategy (or Fabric, or a plain loop) calls these.

Note [norm from shards]
    Shard ``rank`` of every bucket holds exactly the owned parameters'
    gradients plus padding, which is always zero. A zero adds nothing to a sum
    of ``|g|^p`` (p > 0) or to a maximum of ``|g|``, so these norms are
    reduced from whole shards without a per-parameter loop: a sum (2-norm via
    :meth:`~lightning_layerwise.engine.grad_sync.GradientSync.grad_norm_squared`,
    other p) or a maximum (inf-norm) over ranks. Norms built from a minimum
    (negative p, ``-inf``) would see the padding's zeros, and torch's p = 0
    "norm" counts the non-zero *tensors* (not elements), which has no
    layout-independent meaning; both are rejected.
    The norm is accumulated in float32 (float64 for float64 gradients is
    rounded to float32 too, as ``grad_norm_squared`` does) and is the norm of
    the gradient *buffer*, i.e. of ``main_grad``.

Note [parameter lists]
    Given a list of parameters, each rank counts (and clips) what it steps of the
    listed parameters, named directly or through a piece or master. That is the
    one-process answer when every rank lists the same parameters, and also when
    each rank filters its list by ``p.grad is not None``, the usual way to pick
    "the parameters that have a gradient": a whole parameter has a ``.grad`` on
    its owner, the rank that counts it, and a split one on every rank stepping a
    piece (Note [split gradients] in ``engine/split_gradient.py``). Lists that differ in
    any other way have no one-process answer, so the norm's all-reduce carries a
    vote: per dense layout parameter, whether this rank holds its gradient and
    left it out, and whether this rank named it. Summed (or maximized, for the
    inf-norm) over the ranks, a parameter both left out by a holder and named
    somewhere raises the same ``ValueError`` on every rank, naming it. Two rows
    of floats per dense parameter ride along in the norm's one collective; no
    collective is added. Expert parameters are not voted on (each
    expert-parallel rank holds different experts under the same names); each is
    counted by its holders' lists. ``clip_grad_value_`` communicates nothing and
    clamps what each rank's list names of what it steps. On CPU the verdict is
    read at once. On an accelerator reading it would stop the host every step until
    the backward and the all-reduce ran, so it is copied to the host without
    waiting and read at the next norm of the wrapper (or when it is released): a
    disagreement raises there, on every rank, one call late.

Note [scaling owned gradients]
    An owned parameter's ``.grad`` is a view of its slot in the grad buffer
    (``main_grad``) when the buffer has the parameter's dtype, and a copy when
    it does not (``grad_reduce_dtype=torch.float32`` for bf16 parameters).
    Clipping scales (or clamps) ``main_grad`` and, when ``.grad`` is a separate
    tensor, ``.grad`` as well, so the optimizer (which reads ``.grad``) and
    anything that reads ``main_grad`` (a master-weight optimizer, the next norm)
    agree. Padding is never touched, so it stays zero even when the norm is
    not finite.
"""

from __future__ import annotations

import math
from typing import Union

import torch

from . import collectives
from .buffers import GradState
from .data_parallel import LayerwiseDataParallel
from .tensor_parallel import is_sharded, sum_over_mesh, tensor_parallel_group

__all__ = ["clip_grad_norm_", "clip_grad_value_", "grad_norm"]

NormType = Union[float, int, str]


def grad_norm(wrapper: LayerwiseDataParallel, norm_type: NormType = 2.0, parameters=None) -> torch.Tensor:
    """The ``norm_type``-norm of the full reduced gradient, computed from this rank's shards.

    Collective over the wrapper's data-parallel group: every rank must call it,
    and every rank gets the same float32 scalar. Equals the total norm
    ``torch.nn.utils.clip_grad_norm_`` computes on one process over all the
    parameters' gradients. See Note [norm from shards].

    Args:
        wrapper: the wrapper, after :meth:`~LayerwiseDataParallel.finish_grad_sync`.
        norm_type: ``p > 0`` of the p-norm, or ``float('inf')`` (also ``'inf'``)
            for the largest absolute value.
        parameters: only the gradient of these (model parameters, or what an optimizer holds:
            pieces, masters), e.g. one optimizer's parameters: the same set on every rank, or
            that set filtered by ``p.grad is not None`` (Note [parameter lists]); other lists
            raise ``ValueError`` on every rank. Default: every parameter the wrapper trains.
    """
    p = _check_norm_type(norm_type)
    _check_reduced(wrapper)
    units = votes = None
    if parameters is not None:  # Note [parameter lists]
        units, votes = wrapper.grad_sync.parameter_lists.units_and_votes(_as_list(parameters))
        if len(units) == len(wrapper.records.units):
            units = None  # all of this rank's gradient: whole shards (padding is zero), fewer kernels
    tp_group = tensor_parallel_group(record.param for record in wrapper.records)
    if tp_group is not None and not math.isinf(p):
        return _norm_over_mesh(wrapper, p, units, votes, tp_group)
    if math.isinf(p):
        device = wrapper.grad_sync.flat_buffers[0].grads.device
        total = torch.zeros((), dtype=torch.float32, device=device)
        sync = wrapper.grad_sync
        tensors = [sync.own_shard(b) for b in wrapper.buckets] if units is None else [u.slot for u in units]
        for tensor in tensors:
            if tensor.numel():
                total = torch.maximum(total, tensor.abs().amax().float().to(total.device))
        if votes is not None:  # a maximum of the votes decides as their sum does
            payload = _all_reduce_max(torch.cat([total.reshape(1), votes]), wrapper.process_groups.dp)
            total, votes = payload[0], payload[1:]
        else:
            total = _all_reduce_max(total, wrapper.process_groups.dp)  # a maximum may count elements twice
        if tp_group is not None:  # Note [norms over the mesh]: the maximum of the whole gradient
            total = _all_reduce_max(total, tp_group)
    elif p == 2.0 and units is None and votes is None:
        total = wrapper.grad_sync.grad_norm_squared().sqrt()
    elif p == 2.0:
        total = wrapper.grad_sync.shard_sum(lambda g: g.float().square().sum(), units, extra=votes).sqrt()
    else:
        total = wrapper.grad_sync.shard_sum(lambda g: g.float().abs().pow(p).sum(), units, extra=votes).pow(1.0 / p)
    if votes is not None:
        wrapper.grad_sync.parameter_lists.check_votes(votes, "clipping (or a gradient norm)")
    return total


def _norm_over_mesh(wrapper: LayerwiseDataParallel, p: float, units, votes, tp_group) -> torch.Tensor:
    """The ``p``-norm (finite ``p``) under tensor parallelism: the sharded parameters' part summed over the
    tensor-parallel group, the replicated part counted once (Note [norms over the mesh] in
    ``engine/tensor_parallel.py``)."""
    units = list(wrapper.records.units) if units is None else units
    sync = wrapper.grad_sync
    fn = (lambda g: g.float().square().sum()) if p == 2.0 else (lambda g: g.float().abs().pow(p).sum())
    sharded = sync.shard_sum(fn, [u for u in units if is_sharded(u.param)], extra=votes)
    replicated = sync.shard_sum(fn, [u for u in units if not is_sharded(u.param)])
    total = sum_over_mesh(sharded, replicated, tp_group)
    if votes is not None:
        sync.parameter_lists.check_votes(votes, "clipping (or a gradient norm)")
    return total.sqrt() if p == 2.0 else total.pow(1.0 / p)


def clip_grad_norm_(
    wrapper: LayerwiseDataParallel,
    max_norm: float,
    norm_type: NormType = 2.0,
    error_if_nonfinite: bool = False,
    parameters=None,
) -> torch.Tensor:
    """Scales the owned gradients so that the full gradient's norm is at most ``max_norm``.

    Like ``torch.nn.utils.clip_grad_norm_`` on one process: the coefficient is
    ``min(max_norm / (total_norm + 1e-6), 1)``, applied to every owned gradient
    (see Note [scaling owned gradients]). Collective: every rank must call it.

    Args:
        wrapper: the wrapper, after :meth:`~LayerwiseDataParallel.finish_grad_sync`.
        max_norm: the largest allowed norm, ``>= 0``.
        norm_type: as in :func:`grad_norm`.
        error_if_nonfinite: raise ``RuntimeError`` (on every rank) if the total
            norm is NaN or infinite instead of scaling by it.
        parameters: as in :func:`grad_norm`: clip the gradient of these only.

    Returns:
        The total norm before clipping (float32 scalar, the same on every rank).
    """
    _check_nonnegative("max_norm", max_norm, "max_norm=1.0")
    total_norm = grad_norm(wrapper, norm_type, parameters)
    if error_if_nonfinite and not torch.isfinite(total_norm).item():
        raise RuntimeError(
            f"the total norm of order {float(norm_type)} of the gradients is {total_norm.item()}, so it "
            "cannot be clipped. Find the source of the non-finite gradient (e.g. a too high learning rate or "
            "an fp16 overflow), or pass error_if_nonfinite=False to scale by the non-finite norm anyway."
        )
    scale_grads_by_norm_(wrapper, max_norm, total_norm, parameters)
    return total_norm


def scale_grads_by_norm_(wrapper: LayerwiseDataParallel, max_norm: float, total_norm: torch.Tensor,
                         parameters=None) -> None:
    """Multiplies the owned gradients (of ``parameters``) by ``min(max_norm / (total_norm + 1e-6), 1)``.

    Element-wise given the total norm, so no communication. See Note [scaling owned gradients].
    """
    # Same arithmetic as torch.nn.utils.clip_grad_norm_ (multiplying by a coefficient clamped
    # to 1 even when nothing needs clipping avoids a host sync on accelerators).
    clip_coef = torch.clamp(float(max_norm) / (total_norm + 1e-6), max=1.0)
    grouped: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in _owned_grad_tensors(wrapper, parameters):
        grouped.setdefault((t.device, t.dtype), []).append(t)
    with torch.no_grad():
        for (device, _), tensors in grouped.items():
            torch._foreach_mul_(tensors, clip_coef.to(device))


def clip_grad_value_(wrapper: LayerwiseDataParallel, clip_value: float, parameters=None) -> None:
    """Clamps every owned gradient into ``[-clip_value, clip_value]``, like ``torch.nn.utils.clip_grad_value_``.

    Element-wise, so no communication: each rank clamps the gradients it owns.
    See Note [scaling owned gradients].

    Args:
        wrapper: the wrapper, after :meth:`~LayerwiseDataParallel.finish_grad_sync`.
        clip_value: the largest allowed absolute value, ``>= 0``.
        parameters: as in :func:`grad_norm`: clamp the gradient of these only.
    """
    _check_nonnegative("clip_value", clip_value, "clip_value=1.0")
    _check_reduced(wrapper)  # before finish_grad_sync no gradient is owned yet
    value = float(clip_value)
    with torch.no_grad():
        for t in _owned_grad_tensors(wrapper, parameters):
            t.clamp_(min=-value, max=value)


# --- helpers -----------------------------------------------------------------------------

def _check_reduced(wrapper: LayerwiseDataParallel) -> None:
    """Raises unless the wrapper's gradients are reduced (its shards hold the owned gradients)."""
    if not isinstance(wrapper, LayerwiseDataParallel):
        raise TypeError(
            f"expected the LayerwiseDataParallel wrapper, got {type(wrapper).__name__}. Pass the wrapper "
            "(its gradients are sharded across ranks); for an unwrapped module use torch.nn.utils.clip_grad_norm_."
        )
    if any(b.grad.state is not GradState.REDUCED for b in wrapper.buckets):
        raise RuntimeError(
            "the gradients are not reduced yet: call wrapper.finish_grad_sync() after the last backward of "
            "the step and before computing a gradient norm or clipping."
        )


def _as_list(parameters) -> list:
    return [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)


def _owned_grad_tensors(wrapper: LayerwiseDataParallel, parameters=None) -> list[torch.Tensor]:
    """Every tensor holding an owned gradient: ``main_grad`` and, where they are copies, ``.grad`` of the
    parameter or piece and of its master."""
    sync = wrapper.grad_sync
    units = wrapper.records.units if parameters is None else sync.parameter_lists.units_of(_as_list(parameters))
    tensors = []
    for unit in units:
        holders = [t.grad for t in (unit.tensor, unit.master) if t is not None and t.grad is not None]
        if not holders:
            continue
        tensors.append(unit.slot)
        tensors.extend(g for g in holders if not unit.is_slot(g))
    return tensors


def _all_reduce_max(tensor: torch.Tensor, group) -> torch.Tensor:
    """The maximum of ``tensor`` over the data-parallel group (in place; a no-op on one process)."""
    return collectives.all_reduce_max(tensor, group)


def _check_norm_type(norm_type: NormType) -> float:
    try:
        p = float(norm_type)
    except (TypeError, ValueError):
        p = math.nan
    if isinstance(norm_type, bool) or math.isnan(p) or p <= 0:
        raise ValueError(
            f"norm_type={norm_type!r} is not supported: use a number > 0 (e.g. norm_type=2.0) or "
            "norm_type=float('inf'). Norms that take a minimum (negative p, -inf) would count the zero "
            "padding of the gradient shards, and p=0 counts tensors, not elements."
        )
    return p


def _check_nonnegative(name: str, value: float, example: str) -> None:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"{name}={value!r} is invalid: it must be a number >= 0, e.g. {example}.")
