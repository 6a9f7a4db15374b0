"""Checks of the wrapped module: at wrapping (the same module on every rank, no sparse gradients) and at every
training forward (Note [fixed module]).

Note [fixed module]
    The layout is planned once, from the parameters the module has when it is
    wrapped. Every training forward checks, before any collective of the step,
    that the module still has exactly those parameter objects, in the same order,
    and that each trainable one still views its slot in the param buffer
    (``data_ptr``): a parameter added, removed or replaced (a module assigned
    anew), or re-typed or moved (``model.half()``, ``p.data = ...``), raises a
    ``RuntimeError`` naming it on every rank that made the change, instead of
    a collective over a layout that no longer matches. Only identities and
    pointers are compared; no tensor is read. The parameters a module yields are
    those of its modules' ``_parameters`` dicts, reached through their ``_modules``
    dicts, so the check compares the sizes of those dicts and the identities of their
    values, recorded at wrapping, instead of walking ``module.parameters()`` (a
    recursive generator, the largest part of the wrapper's forward overhead in
    ``benchmarks/bench_host_overhead.py``); both comparisons, and the storage pointers,
    are lists built by ``map`` in C rather than Python loops over the modules.
    :class:`FixedModule` holds every recorded object (``all_params``,
    ``modules``), so no identity is reused while it compares them. Still
    O(parameters): an assignment to ``.data`` runs no hook, so only reading every
    pointer sees it.
"""

from __future__ import annotations

import hashlib
import operator
from itertools import chain

import torch
import torch.distributed as dist
from torch import nn

_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_PARAMETERS_OF = operator.attrgetter("_parameters")
_CHILDREN_OF = operator.attrgetter("_modules")


class FixedModule:
    """What every training forward checks is still so (Note [fixed module]): recorded from ``module`` and its
    trainable parameters (``param_names``: parameter -> name) when it is wrapped."""

    def __init__(self, module: nn.Module, param_names: dict[nn.Parameter, str], sharded: bool) -> None:
        self.module, self._param_names, self._sharded = module, param_names, sharded
        self.all_params = list(module.parameters())
        self.modules = list(module.modules())
        """The modules as wrapped, in ``module.modules()`` order (the forward's check confirms they still are)."""
        self._structure = _structure_of(self.modules)
        self._trainable = list(param_names)
        self._data_ptrs = self._places_of(self._trainable)
        self._outside = [p for p in self.all_params if p not in param_names]  # frozen when wrapped

    def check(self) -> list[str]:
        """Raises before any collective of the step if the module's parameters changed since wrapping; returns the
        names of the parameters frozen when it was wrapped that train now (they need a new layout).

        Identity and storage pointers only: no tensor is read.
        """
        if _structure_of(self.modules) != self._structure:
            self._raise_changed()
        if self._outside and any(map(_REQUIRES_GRAD, self._outside)):
            names = {id(p): n for n, p in self.module.named_parameters()}
            return [names[id(p)] for p in self._outside if p.requires_grad and id(p) in names]
        if self._places_of(self._trainable) == self._data_ptrs:
            return []
        for p, now, ptr in zip(self._trainable, self._places_of(self._trainable), self._data_ptrs):
            if now != ptr:
                raise RuntimeError(
                        f"parameter {self._param_names[p]!r} no longer lives in its bucket: its .data, dtype or "
                        "device was changed after the module was wrapped (model.half(), .to(), or an assignment "
                        "to .data during training). Convert or move the model before fit, or use the Trainer's "
                        "precision= argument."
                    )
        return []

    def _places_of(self, params: list[nn.Parameter]) -> list[int]:
        """Where each parameter lives: its data pointer, or with sharded parameters (whose full buffers move when
        gathered again) its storage's identity and offset."""
        if not self._sharded:
            return _data_ptrs_of(params)
        with torch._C.DisableTorchFunctionSubclass():
            return [hash((p.untyped_storage()._cdata, p.storage_offset())) for p in params]

    def _raise_changed(self) -> None:
        before = {id(p): n for p, n in self._param_names.items()}
        now = dict(self.module.named_parameters())
        added = [n for n, p in now.items() if p.requires_grad and id(p) not in before]
        removed = [n for p, n in self._param_names.items() if all(q is not p for q in now.values())]
        raise RuntimeError(
            "the module's parameters changed after it was wrapped for data-parallel training (the layout is "
            f"planned once, at setup): added or replaced {added[:5]}, removed or replaced {removed[:5]}. Create "
            "every parameter (and module) before fit, e.g. in __init__ or configure_model, and do not assign "
            "new modules or parameters during training."
        )


def _structure_of(modules: list[nn.Module]) -> tuple[list[int], ...]:
    """The sizes of ``modules``' ``_parameters`` and ``_modules`` dicts and the identities of their values, in order
    (Note [fixed module]); every loop in C. The objects stay alive while the wrapper holds them, so an identity is
    never reused for another."""
    params = list(map(_PARAMETERS_OF, modules))
    children = list(map(_CHILDREN_OF, modules))
    return (list(map(len, params)), list(map(id, chain.from_iterable(map(dict.values, params)))),
            list(map(len, children)), list(map(id, chain.from_iterable(map(dict.values, children)))))


def _data_ptrs_of(params: list[nn.Parameter]) -> list[int]:
    with torch._C.DisableTorchFunctionSubclass():  # a guarded parameter's Python hook is not needed for a pointer
        return list(map(torch._C.TensorBase.data_ptr, params))


def reject_sparse_gradients(module: nn.Module) -> None:
    """Raises naming the first embedding that would produce sparse gradients (they cannot be reduce-scattered
    into dense buckets); before any collective, on every rank alike."""
    for name, child in module.named_modules():
        if isinstance(child, (nn.Embedding, nn.EmbeddingBag)) and child.sparse and child.weight.requires_grad:
            where = f"{name}.weight" if name else "weight"
            raise ValueError(
                f"{where!r} belongs to {type(child).__name__}(sparse=True), whose gradients are sparse; "
                "strategy='layerwise' reduces gradients in dense buckets. Build it with sparse=False (the "
                "default; torch.optim.SparseAdam then needs replacing by Adam or AdamW), or freeze it.")


def check_same_module_on_all_ranks(module: nn.Module, group, expert=None) -> None:
    """Raises on every rank if the parameters differ in name, shape, dtype, requires_grad, device type or
    expert mark across ranks.

    Device *type* only: each rank has its own GPU index.
    """
    if group is None:
        return
    mine = [(n, tuple(p.shape), str(p.dtype), p.requires_grad, p.device.type) for n, p in module.named_parameters()]
    if expert is not None:
        mine = [(*entry, "expert" if expert(n, p) else "dense")
                for entry, (n, p) in zip(mine, module.named_parameters())]
    # First a digest per rank (a few bytes: the full lists of a large model on a thousand ranks would be
    # megabytes per rank, on NCCL in GPU memory); the lists themselves only when the digests differ.
    digest = hashlib.sha256(repr(mine).encode()).hexdigest()
    digests: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(digests, digest, group=group)
    if all(d == digest for d in digests):
        return
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    for rank, theirs in enumerate(gathered):
        if theirs != mine:
            diff = next(((a, b) for a, b in zip(mine, theirs) if a != b), None)
            detail = (f"first difference: this rank has {diff[0]}, rank {rank} has {diff[1]}" if diff
                      else f"this rank has {len(mine)} parameters, rank {rank} has {len(theirs)}")
            raise ValueError(
                "the module's parameters differ across ranks (name, shape, dtype, requires_grad or device type"
                f"{', or expert mark' if expert is not None else ''}); "
                f"{detail}. Build the same model on every rank (same config and seed) before wrapping it."
            )
