"""The gradient parts of a parameter's record (Note [the per-parameter record] in ``engine/param_records.py``).

:class:`GradRecord` is one parameter's gradient path (its slot of the grad buffer, the ``.grad`` autograd adds
into, the hooks) and what arrived of it in this accumulation; :class:`GradUnit` is what this rank steps of a
parameter (the parameter whole, or its piece of a split one, and a float32 master) and where its reduced gradient
lives. The wrapper builds both with the record; :class:`~lightning_layerwise.engine.grad_sync.GradientSync` moves
them (Note [gradient lifecycle] and Note [in-place gradients] in ``engine/grad_sync.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from .buffers import Bucket
from .split_gradient import SplitGradient

if TYPE_CHECKING:
    from ..layout import Piece

__all__ = ["GradRecord", "GradUnit"]


@dataclass(eq=False)
class GradUnit:
    """What this rank steps of one parameter, and where its reduced gradient lives (Note [gradient lifecycle] in
    ``engine/grad_sync.py``)."""

    param: nn.Parameter
    """The model's parameter."""
    tensor: nn.Parameter
    """What the wrapper hands the gradient to: ``param`` itself (owned whole) or this rank's piece of it."""
    slot: torch.Tensor
    """Its elements of the grad buffer (the buffer's dtype): ``main_grad``."""
    bucket: Bucket
    record: GradRecord
    """The parameter's gradient record (what arrived this accumulation)."""
    split: bool = False
    """``tensor`` is a piece of a split parameter (Note [pieces] in ``engine/data_parallel.py``)."""
    master: torch.Tensor | None = None
    """A float32 master the optimizer steps in place of ``tensor`` (``bf16-true``), set by
    :meth:`~lightning_layerwise.engine.param_records.ParamRecords.set_master`."""
    piece: Piece | None = None
    """With ``split``: where the piece lies in ``param``, as the layout plans it."""

    @property
    def stepped(self) -> torch.Tensor:
        """The tensor the optimizer holds for this unit."""
        return self.master if self.master is not None else self.tensor

    def is_slot(self, grad: torch.Tensor) -> bool:
        """Whether ``grad`` is :attr:`slot` itself: the same elements of the same memory (one a view of the other,
        or equal), not a copy in another dtype or a tensor the user set."""
        slot = self.slot
        return grad is slot or (grad.dtype == slot.dtype and grad.shape == slot.shape
                                and grad.data_ptr() == slot.data_ptr() and grad.stride() == slot.stride())


class GradRecord:
    """One parameter's gradient path and what arrived of it this accumulation, bound (with its record) to its hook
    so the hook looks nothing up (Note [in-place gradients] in ``engine/grad_sync.py``); flags here, not sets of
    parameters: a tensor hashes in Python."""

    __slots__ = ("param", "view", "grad", "bucket", "inplace", "assigned", "version", "seen", "carried", "handed",
                 "split_flag", "hook", "split_grad", "split_hook")

    def __init__(self, param: nn.Parameter, view: torch.Tensor, bucket: Bucket) -> None:
        self.param = param
        self.view = view
        """Its slot of the grad buffer, strided as the parameter."""
        self.grad = _alias(view) if not bucket.sharded else None
        """The ``.grad`` autograd adds into: ``view``'s memory with a version counter of its own (a view shares its
        buffer's), so an add into it shows in :attr:`version` without a hook. ``None`` with sharded parameters:
        the full buffer exists only while a backward fills it (Note [sharded gradients] in
        ``engine/grad_sync.py``)."""
        self.bucket = bucket
        self.inplace = False
        """Autograd may accumulate into ``grad`` (same dtype; the optimizer steps the parameter itself)."""
        self.assigned = False
        """``grad`` was made the parameter's ``.grad`` at the last restart (or since)."""
        self.version = self.grad._version if self.grad is not None else 0
        """``grad._version`` when arrivals were last accounted for."""
        self.seen = False
        """A gradient arrived this accumulation."""
        self.carried = False
        """A reduced gradient was carried into this accumulation (Note [gradient lifecycle] in
        ``engine/grad_sync.py``)."""
        self.handed: torch.Tensor | None = None
        """The ``.grad`` the last sync handed out (a parameter stepped whole)."""
        self.split_flag: torch.Tensor | None = None
        """Its element of the on-device flags of split parameters (Note [pieces] in ``engine/data_parallel.py``)."""
        self.hook = None
        """Its post-accumulate-grad hook's handle; ``None`` on one process where it adds in place."""
        self.split_grad: SplitGradient | None = None
        """A split parameter this rank steps a piece of: the ``.grad`` it is handed (Note [split gradients] in
        ``engine/split_gradient.py``)."""
        self.split_hook = None
        """The handle of the hook that clears :attr:`split_grad` before autograd accumulates into it."""


def _alias(view: torch.Tensor) -> torch.Tensor:
    """A tensor on ``view``'s memory, not a view of anything: its version counter is its own."""
    alias = torch.empty(0, dtype=view.dtype, device=view.device)
    return alias.set_(view.untyped_storage(), view.storage_offset(), view.size(), view.stride())
