"""Counting the aten operations of training steps: how many device copies a step makes, and which of them touch
the engine's buffers.

:class:`OpCounts` is a ``TorchDispatchMode``: inside it every aten call (below autograd, on any device) is counted
by name. A copy (``aten.copy_``, ``aten.clone``) whose input or output lies in a watched wrapper's parameter or
gradient buffers is counted apart, in :attr:`OpCounts.buffer_copies`: a steady-state step of an in-place gradient
makes none (Note [in-place gradients] in ``engine/grad_sync.py``). Steps are told apart by :meth:`OpCounts.mark`
at each step's start; :meth:`OpCounts.per_step` is what happened between two marks. It slows every operation
down (one Python call each): for tests and ``benchmarks/bench_gpu.py --profile``, not for timing.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..engine.data_parallel import LayerwiseDataParallel

COPIES = ("aten.copy_", "aten.clone")
"""The operations counted as device copies."""

BUFFER_COPIES = "buffer copies"
"""The key of :attr:`OpCounts.buffer_copies` in a :meth:`OpCounts.mark` and in :meth:`OpCounts.per_step`."""


class OpCounts(TorchDispatchMode):
    """Counts every aten operation run inside it, by name (``"aten.copy_"``), and the copies touching the buffers
    of the wrappers it watches (:meth:`watch`)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()
        """Every operation so far, by name."""
        self.buffer_copies = 0
        """The copies so far whose input or output is in a watched wrapper's parameter or gradient buffers."""
        self.marks: list[Counter[str]] = []
        """The counts at each :meth:`mark`, with :data:`BUFFER_COPIES`."""
        self._storages: set[int] = set()

    def watch(self, wrapper: LayerwiseDataParallel) -> None:
        """Counts the copies that read or write ``wrapper``'s flat parameter and gradient buffers."""
        for flat in wrapper.grad_sync.flat_buffers:
            self._storages |= {flat.params.untyped_storage()._cdata, flat.grads.untyped_storage()._cdata}

    def mark(self) -> None:
        """A step starts here."""
        now = self.calls + Counter({BUFFER_COPIES: self.buffer_copies})
        self.marks.append(now)

    def per_step(self, first: int, last: int | None = None) -> Counter[str]:
        """What ran from mark ``first`` to mark ``last`` (default: the one after ``first``), per step."""
        last = first + 1 if last is None else last
        total = self.marks[last].copy()
        total.subtract(self.marks[first])
        steps = last - first
        return Counter({name: n / steps for name, n in total.items() if n > 0})

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        self.calls[name] += 1
        if name in COPIES and self._storages:
            tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            if any(t.untyped_storage()._cdata in self._storages for t in tensors):
                self.buffer_copies += 1
        return func(*args, **(kwargs or {}))


def copies(counts: Counter[str]) -> float:
    """The device copies among ``counts`` (:data:`COPIES`)."""
    return sum(counts.get(name, 0) for name in COPIES)
