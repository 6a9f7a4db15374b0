"""Replaying a recorded initialization on real memory (Note [meta-device models] in ``materialize.py``).

:func:`plan_replay` is pure: from the kept ops (``init_record.py``) and the storages the model holds at the end
(its roots) it finds which ops matter (an op matters if something it writes is read later or is a root's final
value; the others only draw their random numbers), whether each storage ends with a value the replay
reproduces, and the last op touching each storage. :class:`Replay` runs a plan on a device.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor
from torch.utils._pytree import tree_leaves, tree_map

from .init_record import META, Op, TensorRef, scratch

OK, NONE, BAD = "ok", "none", "bad"
"""What a storage holds after the replay: the eager build's value; no value (never written, or created by
``torch.empty`` and left so); a value the replay cannot reproduce (computed from a storage with no value, or
written in part over no value)."""


@dataclass
class ReplayPlan:
    ops: list[Op]
    live: list[bool]
    """Whether each op's result is needed (the others only draw their random numbers, on scratch memory)."""
    state: dict[int, str]
    """Storage key -> :data:`OK` or :data:`BAD` where a needed op wrote it; absent: :data:`NONE`."""
    cause: dict[int, int]
    """Storage key (:data:`BAD`) -> the op that left it so."""
    last: dict[int, int]
    """Storage key -> the last needed op that reads or writes it: its memory is final (or unneeded) after it."""
    problems: list[str]
    """Ops that cannot be replayed at all; a model with any is refused."""


def plan_replay(ops: list[Op], roots: set[int], device: torch.device) -> ReplayPlan:
    """The plan for replaying ``ops`` on ``device`` so that the storages ``roots`` hold their eager values."""
    live, needed = [False] * len(ops), set(roots)
    for i in range(len(ops) - 1, -1, -1):  # backward: which values are still read, or final
        op = ops[i]
        if op.writes & needed:
            live[i] = True
            needed = (needed - op.kills) | op.reads
    state: dict[int, str] = {}
    cause: dict[int, int] = {}
    last: dict[int, int] = {}
    for i, op in enumerate(ops):
        if not live[i]:
            continue
        if op.uninitialized:
            for key in op.writes:
                state.pop(key, None)
            continue
        read_ok = op.refusal is None and all(state.get(r) == OK for r in op.reads)
        inherited = next((cause[r] for r in op.reads if state.get(r) == BAD), i)  # the first op that went wrong
        for key in op.writes:
            if read_ok and (key in op.kills or state.get(key) == OK):
                state[key] = OK
            else:
                state[key], cause[key] = BAD, inherited
        for key in op.reads | op.writes:
            last[key] = i
    named = {cause[k] for k in roots if state.get(k) == BAD}  # named with the values they leave wrong
    problems = [op.refusal for i, op in enumerate(ops) if op.refusal and i not in named]
    problems += [f"{op.name} draws from a generator on {op.generator.device}, the model is materialized on {device}"
                 for i, op in enumerate(ops) if live[i] and op.generator is not None
                 and op.generator.device.type != device.type]
    return ReplayPlan(ops, live, state, cause, last, problems)


class Replay:
    """Runs a :class:`ReplayPlan` on ``device``. Each storage gets real memory when an op first needs it:
    ``home(key)`` (a parameter's slot in its bucket: its storage and byte shift) or, where that is ``None``, memory
    of its own; it is dropped after its last op unless ``keep`` holds its key."""

    def __init__(self, plan: ReplayPlan, device: torch.device, storages: dict[int, torch.UntypedStorage],
                 home: Callable[[int], tuple[torch.UntypedStorage, int] | None], keep: set[int]) -> None:
        self.plan, self.device, self.storages, self.home, self.keep = plan, device, storages, home, keep
        self.bound: dict[int, tuple[torch.UntypedStorage, int]] = {}
        self._last_at: dict[int, list[int]] = {}
        for key, i in plan.last.items():
            self._last_at.setdefault(i, []).append(key)

    def view(self, ref: TensorRef) -> Tensor:
        """The real tensor ``ref`` stands for."""
        storage, shift = self._binding(ref.key)
        itemsize = ref.dtype.itemsize
        return torch.empty(0, dtype=ref.dtype, device=self.device).set_(
            storage, (ref.offset * itemsize + shift) // itemsize, ref.size, ref.stride)

    def _binding(self, key: int) -> tuple[torch.UntypedStorage, int]:
        if key not in self.bound:
            home = self.home(key)
            if home is None:
                nbytes = self.storages[key].nbytes()
                home = (torch.empty(nbytes, dtype=torch.uint8, device=self.device).untyped_storage(), 0)
            self.bound[key] = home
        return self.bound[key]

    def run(self, on_last: Callable[[list[int]], None]) -> None:
        """Every op in order; after each, ``on_last(keys)`` with the storages it touched last."""
        generators = {op.generator for op in self.plan.ops if op.generator is not None}
        saved = {g: g.get_state() for g in generators}  # the replay leaves every generator as it found it
        try:
            with torch.no_grad():
                for i, op in enumerate(self.plan.ops):
                    if op.rng_state is not None:
                        op.generator.set_state(op.rng_state)
                    if self.plan.live[i] and not op.uninitialized:
                        self._execute(op)
                    elif not self.plan.live[i] and op.generator is not None:
                        self._draw(op)
                    done = self._last_at.get(i, [])
                    on_last(done)
                    for key in done:
                        if key not in self.keep:
                            self.bound.pop(key, None)
        finally:
            for g, state in saved.items():
                g.set_state(state)

    def _execute(self, op: Op) -> None:
        args, kwargs = tree_map(lambda x: self.view(x) if isinstance(x, TensorRef) else self.device if x is META
                                else x, (op.args, op.kwargs))
        composite = not hasattr(op.func, "overloadpacket")
        try:
            with torch.device(self.device) if composite else contextlib.nullcontext():
                out = op.func(*args, **kwargs)
        except Exception as err:  # the same op fails on every rank, before the next collective
            raise RuntimeError(f"replaying the model's initialization on {self.device} failed at {op.name} (Note "
                               f"[meta-device models]): {err}. Build the model on the device (init_module() "
                               "without empty_init=True) or initialize it in reset_parameters().") from err
        results = [t for t in tree_leaves(out) if isinstance(t, Tensor)]
        for index, ref in op.outputs:
            real = results[index]
            if ref.key not in self.bound:
                home = self.home(ref.key)
                if home is None and (tuple(real.size()), tuple(real.stride()), real.dtype) == \
                        (ref.size, ref.stride, ref.dtype):
                    shift = (real.storage_offset() - ref.offset) * ref.dtype.itemsize
                    self.bound[ref.key] = (real.untyped_storage(), shift)  # the result is the storage's memory
                    continue
                if home is not None:
                    self.bound[ref.key] = home
            self.view(ref).copy_(real)

    def _draw(self, op: Op) -> None:
        """An op whose result is overwritten unread: only its random numbers are drawn, on scratch memory."""
        device = op.generator.device
        args, kwargs = tree_map(lambda x: scratch(x, device) if isinstance(x, TensorRef) else device if x is META
                                else x, (op.args, op.kwargs))
        with torch.device(device):
            op.func(*args, **kwargs)
