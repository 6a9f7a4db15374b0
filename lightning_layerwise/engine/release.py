"""The end of a wrapper's run: :meth:`LayerwiseDataParallel.release` makes its module an ordinary one again.

Pending collectives are waited for (or abandoned after a failure), every hook is removed, each parameter gets
its own storage and the flat buffers are freed. With sharded parameters the whole values are gathered first,
bucket by bucket (Note [sharded release] in ``engine/sharded.py``).
"""

from __future__ import annotations

import math
import warnings
from typing import TYPE_CHECKING, Callable, Protocol

import torch
from torch import nn

from . import read_guard
from .buffers import Bucket, FlatBuffer
from .live_wrappers import _LIVE, wrapper_of

if TYPE_CHECKING:
    from .grad_sync import GradientSync
    from .param_records import ParamRecords
    from .param_sync import ParameterSync
    from .sharded import ShardedParameterSync


class Releasing(Protocol):
    """What the release reads and clears of the :class:`~.data_parallel.LayerwiseDataParallel` it ends (which
    imports this module: described here, not imported)."""

    module: nn.Module
    shard_parameters: bool
    grad_sync: GradientSync
    param_sync: ParameterSync | ShardedParameterSync
    ended_by: Callable[[], object] | None
    records: ParamRecords
    _buckets: list[Bucket]
    _flat_buffers: list[FlatBuffer]
    _hook_handles: list
    _registered: list[torch.Tensor]


def release_wrapper(wrapper: Releasing, wait: bool = True, whole: bool = True) -> nn.Module:
    """Releases ``wrapper`` (:meth:`LayerwiseDataParallel.release`, whose arguments these are); returns its
    module."""
    own: set[nn.Parameter] = set()
    if wrapper.shard_parameters and wait and whole:
        own = _unshard_for_release(wrapper)
    wrapper.param_sync.release(wait)
    for h in wrapper._hook_handles:
        h.remove()
    wrapper._hook_handles = []
    try:
        wrapper.grad_sync.release(wait)  # a clipping list's disagreement raises last, once the rest is released
    finally:
        with torch.no_grad():
            for record in wrapper.records:
                p = record.param
                if p in own:
                    continue
                read_guard.detach(p)
                kept = (not wrapper.shard_parameters or record.held) and (whole or not wrapper.shard_parameters)
                p.data = p.data.clone() if kept else _unheld(p, failed=not wait)
            wrapper.records.release()  # this rank steps nothing now; pieces and masters are no longer its tensors
        wrapper._flat_buffers, wrapper._buckets = [], []
        for t in wrapper._registered:
            if wrapper_of(t) is wrapper:
                _LIVE.pop(id(t), None)
        wrapper._registered = []
        wrapper.ended_by = None
    return wrapper.module


def _unshard_for_release(wrapper: Releasing) -> set[nn.Parameter]:
    """``release()`` with sharded parameters (Note [sharded release] in ``engine/sharded.py``): every trainable
    parameter gets its own storage holding its full value, bucket by bucket (collective). Returns them."""
    wrapper.grad_sync.zero_grad_buffer()  # a released module has no gradient: the shards go before the gather
    params = list(wrapper.records.names)
    nbytes = sum(p.numel() * p.element_size() for p in params)
    target = _release_device(params[0].device, nbytes) if params else torch.device("cpu")
    own: set[nn.Parameter] = set()

    def into_own_storage(bucket: Bucket) -> None:
        with torch.no_grad():
            for p in bucket.params:
                read_guard.detach(p)
                p.data = p.data.to(target, copy=True)
                own.add(p)

    wrapper.param_sync.gather_each(into_own_storage)
    return own


def _unheld(p: nn.Parameter, failed: bool) -> torch.Tensor:
    """What a released parameter holds where this rank has no values for it: after a failed collective NaN, never
    freed memory; at interpreter exit (nothing gathered) one element broadcast to its shape, which holds almost no
    memory (a meta tensor would hold none, but ``p.data`` refuses another device type)."""
    if failed:
        return torch.full(p.shape, math.nan, dtype=p.dtype, device=p.device)
    return torch.empty(1, dtype=p.dtype, device=p.device).expand(p.shape)


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
        stacklevel=4)  # the wrapper's release()
    return torch.device("cpu")
