"""Models built on the meta device, materialized by the wrapper.

Note [meta-device models]
    With ``shard_parameters=True``, ``init_module(empty_init=True)`` builds the model on the meta device under
    ``record_init`` (``init_record.py``): each op that creates or writes a meta tensor is kept in order, and each
    random op draws at once, on scratch memory, what an eager build on the device draws. The wrapper plans the
    layout from the meta parameters, replays the ops on real memory (``init_replay.py``) from the generator
    states they started from, and leaves the generators as it found them. The eager build with the same seed is
    reproduced bitwise: constructors' ``reset_parameters``, ``apply(_init_weights)``, re-inits by name, Hugging
    Face's ``post_init``, every ``torch.nn.init`` function, buffers computed in ``__init__``, re-seeding,
    torchmetrics' states.

    Memory: an op whose result is overwritten unread only draws its numbers. A parameter holds memory from the
    first op that writes a lasting value of it to the last op that touches it, then is published into the shards
    (Note [publishing parameters one by one] in ``sharded_init.py``): a rank holds its shards, the parameters in
    flight, one bucket and one scratch tensor (``tests/engine/test_sharded_memory.py``).

    Meta tensors no recorded op wrote (a plain ``torch.device("meta")`` build) get memory module by module and
    their module's ``reset_parameters()`` in ``modules()`` order. Refused before any collective, by name: such a
    module without an initializer; a ``torch.empty`` parameter beside recorded ones; a value computed from a
    tensor with no recorded value; a random op whose number of draws depends on values (``torch.poisson``); a
    Hugging Face model whose ``init_weights`` was skipped; a recording made on another device. Every rank decides
    alike from its own recording; each parameter is broadcast from the first rank of its bucket's group.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from itertools import chain
from typing import Callable

import torch
from torch import Tensor, nn

from .init_record import Recording, TensorRef, covers, forget, recordings_of, storage_key
from .init_replay import BAD, NONE, OK, Replay, ReplayPlan, plan_replay

SUPPORTED = ("Supported: (a) each module fills its own parameters and buffers in reset_parameters(); (b) the model "
             "initializes itself in __init__ (self.apply(self._init_weights), re-inits by parameter name, Hugging "
             "Face's post_init) and is built under trainer.init_module(empty_init=True) or fabric.init_module("
             "empty_init=True), which record it; (c) the model is built on the device: init_module() without "
             "empty_init=True (Note [meta-device models] in lightning_layerwise/engine/materialize.py).")


def has_meta_tensors(module: nn.Module) -> bool:
    return any(t.is_meta for t in chain(module.parameters(), module.buffers()))


def _initializer(module: nn.Module) -> Callable[[], None] | None:
    return getattr(module, "reset_parameters", None) or getattr(module, "_reset_parameters", None)


def _overrides_apply(module: nn.Module) -> bool:
    """A module that also moves tensors of its own in ``_apply`` (torchmetrics' states and their defaults)."""
    return type(module)._apply is not nn.Module._apply


def _apply_to(module: nn.Module, fn: Callable[[Tensor], Tensor]) -> None:
    if _overrides_apply(module):
        module._apply(fn)  # its own signature: no `recurse`; its children see `fn` again, which is idempotent
    else:
        module._apply(fn, recurse=False)


@dataclass
class _Root:
    """A meta tensor the model holds at the end of its build, and where."""

    tensor: Tensor
    holders: list[tuple[nn.Module, str, str]] = field(default_factory=list)
    """(module, name, kind): kind ``parameter``, ``buffer``, ``attribute`` (a tensor in the module's ``__dict__``)
    or ``state`` (found through an overridden ``_apply``)."""

    @property
    def is_parameter(self) -> bool:
        return self.holders[0][2] == "parameter"


def _find_roots(module: nn.Module) -> tuple[dict[int, list[_Root]], dict[int, str]]:
    """The model's meta tensors by storage key (in ``modules()`` order: the same on every rank) and their names."""
    roots: dict[int, list[_Root]] = {}
    by_id: dict[int, _Root] = {}
    names: dict[int, str] = {}

    def add(t: Tensor, m: nn.Module, name: str, kind: str, qualified: str) -> None:
        if id(t) not in by_id:
            by_id[id(t)] = _Root(t)
            roots.setdefault(storage_key(t), []).append(by_id[id(t)])
            names[id(t)] = qualified
        if kind != "state":
            by_id[id(t)].holders.append((m, name, kind))
        elif not by_id[id(t)].holders:
            by_id[id(t)].holders.append((m, "", kind))
    named = list(module.named_modules(remove_duplicate=False))
    for prefix, m in named:
        attributes = [(k, v) for k, v in vars(m).items() if isinstance(v, Tensor)]
        for kind, items in (("parameter", m._parameters.items()), ("buffer", m._buffers.items()),
                            ("attribute", attributes)):
            for name, t in items:
                if t is not None and t.is_meta:
                    add(t, m, name, kind, f"{prefix}.{name}" if prefix else name)
    for prefix, m in named:
        if _overrides_apply(m):
            found: list[Tensor] = []
            m._apply(lambda t: found.append(t) or t)
            for t in found:
                if t.is_meta:
                    add(t, m, "", "state", f"a tensor of {prefix or 'the root'} ({type(m).__name__})")
    return roots, names


@dataclass
class _Materialization:
    """One model's way from the meta device to ``device``: planned (and refused) before any memory is used."""

    module: nn.Module
    device: torch.device | None
    roots: dict[int, list[_Root]]
    names: dict[int, str]
    recordings: list[Recording]
    plan: ReplayPlan | None
    reset: list[nn.Module]
    """Modules initialized by their own ``reset_parameters()``, in ``modules()`` order."""
    order: dict[int, int]
    """Storage key -> its position among the roots: finals of one op are published in this order on every rank."""

    @classmethod
    def of(cls, module: nn.Module, device: torch.device | None) -> _Materialization:
        roots, names = _find_roots(module)
        recordings = recordings_of(module)
        plan = None
        if recordings:
            ops = [op for r in recordings for op in r.ops]
            plan = plan_replay(ops, set(roots), device or recordings[0].device)
        job = cls(module, device, roots, names, recordings, plan, [], {k: i for i, k in enumerate(roots)})
        job._classify()
        return job

    def value(self, key: int) -> str:
        return self.plan.state.get(key, NONE) if self.plan is not None else NONE

    def _classify(self) -> None:
        """Finds the modules of the reset route; raises naming what cannot be reproduced."""
        refused = list(self.plan.problems) if self.plan is not None else []
        refused += [f"the build was recorded on {r.device} but is materialized on {self.device}"
                    for r in self.recordings if self.device is not None and not _same_device(r.device, self.device)]
        refused += _skipped_hugging_face_init(self.module) if self.recordings else []
        for key, roots in self.roots.items():
            if self.value(key) == BAD:
                op = self.plan.ops[self.plan.cause[key]]
                why = op.refusal or (f"{op.name} computes it from a tensor with no recorded value (made before "
                                     "the recording, torch.empty read before written, or written in parts)")
                refused += [f"{self.names[id(r.tensor)]}: {why}" for r in roots]
            elif self.value(key) == NONE:
                refused += [f"{self.names[id(r.tensor)]}: a tensor on the meta device with no recorded value"
                            for r in roots if r.holders[0][2] in ("attribute", "state")]
        for prefix, m in self.module.named_modules():
            direct = [(name, t) for name, t in chain(m._parameters.items(), m._buffers.items())
                      if t is not None and t.is_meta]
            empty = [name for name, t in direct if self.value(storage_key(t)) == NONE]
            if not empty:
                continue
            kept = any(self.value(storage_key(t)) == OK for t in m._parameters.values() if t is not None and t.is_meta)
            missing = [name for name in empty if name in m._parameters]
            named = [f"{prefix}.{n}" if prefix else n for n in (missing if kept else empty)]
            where = f"{', '.join(named[:3])} ({type(m).__name__})"
            if kept and missing:
                refused.append(f"{where}: left without a value by the build (torch.empty, never written)")
            elif not kept and _initializer(m) is None:
                refused.append(f"{where}: no recorded value (built outside init_module(empty_init=True), or "
                               "torch.empty never written) and no reset_parameters() to give one")
            elif not kept:
                self.reset.append(m)
        if refused:
            raise ValueError(f"{type(self.module).__name__} on the meta device cannot start from the values an eager "
                             f"build gives it: {refused[:4]}"
                             f"{f' and {len(refused) - 4} more' if len(refused) > 4 else ''}. " + SUPPORTED)

    def run(self, on_final: Callable[[nn.Parameter, nn.Parameter], None],
            memory_for: Callable[[nn.Parameter], Tensor]) -> dict[int, nn.Parameter]:
        replaced: dict[int, nn.Parameter] = {}
        replay = self._replay(on_final, memory_for, replaced) if self.plan is not None else None
        with torch.no_grad():
            self._assign(replay)
            self._reset_route(on_final, memory_for, replaced)
            self._move(replay)
        return replaced

    def _replay(self, on_final, memory_for, replaced) -> Replay:
        """Replays the recording: each parameter is final (and handed to ``on_final``) after its last op."""
        homes: dict[int, Tensor] = {}
        direct = {k for k, roots in self.roots.items() if len(roots) == 1 and roots[0].is_parameter
                  and covers(roots[0].tensor) and self.value(k) == OK}

        def home(key: int):
            if key not in direct:
                return None
            p = self.roots[key][0].tensor
            slot = homes[key] = memory_for(p)
            if slot.stride() != p.stride() or slot.dtype != p.dtype:
                return None  # its own memory, copied into the slot when final
            return slot.untyped_storage(), (slot.storage_offset() - p.storage_offset()) * p.element_size()

        def on_last(keys: list[int]) -> None:
            for key in sorted((k for k in keys if k in self.roots and self.value(k) == OK), key=self.order.get):
                for root in self.roots[key]:
                    if root.is_parameter:
                        self._final(root, homes.pop(key, None), replay, on_final, memory_for, replaced)
        keep = {k for k, roots in self.roots.items() if not all(r.is_parameter for r in roots)}
        storages = {k: s for r in self.recordings for k, s in r.storages.items()}
        replay = Replay(self.plan, self.device or self.recordings[0].device, storages, home, keep)
        replay.run(on_last)
        return replay

    def _final(self, root: _Root, slot: Tensor | None, replay: Replay, on_final, memory_for, replaced) -> None:
        p = root.tensor
        value = replay.view(TensorRef.of(p))
        if slot is None or slot.data_ptr() != value.data_ptr() or slot.stride() != value.stride():
            slot = memory_for(p) if slot is None else slot
            slot.copy_(value)
        new = replaced[id(p)] = nn.Parameter(slot, requires_grad=p.requires_grad)
        for m, name, _ in root.holders:
            m._parameters[name] = new
        on_final(p, new)

    def _reset_route(self, on_final, memory_for, replaced) -> None:
        """Modules without a recorded value: memory, then their own initializer, module by module."""
        holders: dict[int, int] = {}  # id(meta parameter) -> how many reset modules still hold it directly
        for m in self.reset:
            for p in m._parameters.values():
                if p is not None and p.is_meta:
                    holders[id(p)] = holders.get(id(p), 0) + 1
        for m in self.reset:
            metas = [(k, p) for k, p in m._parameters.items() if p is not None and p.is_meta]
            for k, p in metas:
                if id(p) not in replaced:
                    replaced[id(p)] = nn.Parameter(memory_for(p), requires_grad=p.requires_grad)
                m._parameters[k] = replaced[id(p)]
            _initializer(m)()
            for _, p in metas:
                holders[id(p)] -= 1
                if holders[id(p)] == 0:
                    on_final(p, replaced[id(p)])

    def _assign(self, replay: Replay | None) -> None:
        """Buffers and tensor attributes get their replayed values (a buffer without one: memory, as ``torch.empty``
        gives it; a module of the reset route gives its own)."""
        for key, roots in self.roots.items():
            for root in roots:
                for m, name, kind in root.holders:
                    if kind == "buffer" and m._buffers[name] is root.tensor:
                        m._buffers[name] = replay.view(TensorRef.of(root.tensor)) if self.value(key) == OK \
                            else torch.empty_like(root.tensor, device=self._device)
                    elif kind == "attribute":
                        m.__dict__[name] = replay.view(TensorRef.of(root.tensor))

    def _move(self, replay: Replay | None) -> None:
        """States found through an overridden ``_apply`` get their values; what was not on the meta device moves."""
        def move(t: Tensor) -> Tensor:
            if not t.is_meta:
                return t.to(self._device)
            if replay is not None and self.value(storage_key(t)) == OK:
                return replay.view(TensorRef.of(t))
            return torch.zeros_like(t, device=self._device)  # made inside `_apply` (torchmetrics' device probe)
        for m in self.module.modules():
            _apply_to(m, move)

    @property
    def _device(self) -> torch.device:
        return self.device if self.device is not None else self.recordings[0].device


def _skipped_hugging_face_init(module: nn.Module) -> list[str]:
    """Hugging Face models that skipped their own init (``init_weights`` does on the meta device; the recording
    shows it the device instead, ``_RecordData``): no module flagged ``_is_hf_initialized``."""
    modeling = sys.modules.get("transformers.modeling_utils")
    base = getattr(modeling, "PreTrainedModel", None)
    return [f"{name or 'the root'} ({type(m).__name__}): Hugging Face skipped its init_weights() on the meta device"
            for name, m in module.named_modules() if base is not None and isinstance(m, base)
            and not any(getattr(sub, "_is_hf_initialized", False) for sub in m.modules())]


def _same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    if a.type != "cuda":
        return True
    current = torch.cuda.current_device() if torch.cuda.is_available() else 0
    return (a.index if a.index is not None else current) == (b.index if b.index is not None else current)


def check_materializable(module: nn.Module, device: torch.device | None = None) -> None:
    """Raises, before any work, naming the meta tensors whose eager values the materialization cannot give
    (Note [meta-device models]); ``device``: where it will be materialized (``None``: not checked)."""
    _Materialization.of(module, device)


def materialize(module: nn.Module, device: torch.device,
                on_final: Callable[[nn.Parameter, nn.Parameter], None] = lambda old, new: None,
                memory_for: Callable[[nn.Parameter], torch.Tensor] | None = None,
                ) -> dict[int, nn.Parameter]:
    """Gives every meta tensor of ``module`` memory on ``device`` and its initial value (Note [meta-device
    models]); tensors that are not meta move to ``device``. ``memory_for(meta)`` gives a meta parameter its
    memory (its slot of a bucket, so that the initializer writes there; default: a tensor of its own);
    ``on_final(old, new)`` is called with each meta parameter and the one replacing it once its value is final.
    Returns ``id`` of each meta parameter -> the parameter replacing it."""
    device = torch.device(device)
    if memory_for is None:
        def memory_for(p: nn.Parameter) -> torch.Tensor:
            return torch.empty_like(p, device=device)
    replaced = _Materialization.of(module, device).run(on_final, memory_for)
    forget(module)
    return replaced
