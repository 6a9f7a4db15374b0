"""Models built on the meta device, materialized by the wrapper.

Note [meta-device models]
    A model built under ``trainer.init_module(empty_init=True)`` or Fabric's
    ``init_module(empty_init=True)`` with ``shard_parameters=True`` has its parameters on the
    meta device: shapes without memory. The wrapper plans the layout from them as from any
    model, then materializes module by module, in ``module.modules()`` order: each meta
    parameter and buffer a module holds directly gets memory on the device and the module's
    ``reset_parameters()`` (``nn.MultiheadAttention``: ``_reset_parameters()``) fills it.
    A parameter in the layout gets its memory in its bucket's full buffer, allocated when
    the bucket's first parameter is made, so the initializer writes where the value is kept
    and nothing is copied. A parameter several modules hold (a tied embedding) is made once
    and is final after the last of its modules ran its initializer; a bucket whose
    parameters are all final is broadcast from the first rank of its group (so every
    replica holds the same values, whatever each rank's random state), cut to this rank's
    shard and freed. A rank therefore holds at most the shards and the buckets still open:
    for a model whose buckets follow its modules, the shard plus one bucket (measured in
    ``tests/engine/test_sharded_memory.py``). A bucket holding a tied parameter stays open
    until the last module holding it is initialized.

    How the values relate to a plain init: the same as building the model on the device,
    with the same seed, when every module's initializer fills exactly its own parameters and
    the modules were built in the order they are registered. A module built and then
    re-assigned, an initializer that also fills a child's parameter, or a tied parameter
    whose second module's initializer ran in the plain build give other (equally
    distributed) values. They are deterministic for rank 0's seed.
"""

from __future__ import annotations

from itertools import chain
from typing import Callable

import torch
from torch import nn


def has_meta_tensors(module: nn.Module) -> bool:
    return any(t.is_meta for t in chain(module.parameters(), module.buffers()))


def _direct_meta(module: nn.Module) -> bool:
    return any(t is not None and t.is_meta for t in chain(module._parameters.values(), module._buffers.values()))


def _initializer(module: nn.Module) -> Callable[[], None] | None:
    return getattr(module, "reset_parameters", None) or getattr(module, "_reset_parameters", None)


def check_materializable(module: nn.Module) -> None:
    """Raises, before any work, naming the modules that hold meta tensors but cannot initialize them."""
    missing = [f"{name or 'the root'} ({type(m).__name__})" for name, m in module.named_modules()
               if _direct_meta(m) and _initializer(m) is None]
    if missing:
        raise ValueError(
            f"modules {missing[:3]} hold parameters or buffers on the meta device but have no reset_parameters() "
            "to initialize them (Note [meta-device models]). Give them one, or build the model on the device "
            "(without empty_init=True).")


def materialize(module: nn.Module, device: torch.device,
                on_final: Callable[[nn.Parameter, nn.Parameter], None] = lambda old, new: None,
                memory_for: Callable[[nn.Parameter], torch.Tensor] | None = None,
                ) -> dict[int, nn.Parameter]:
    """Gives every meta tensor of ``module`` memory on ``device`` and its initial value, module by module (Note
    [meta-device models]); tensors that are not meta move to ``device``. ``memory_for(meta)`` gives a meta
    parameter its memory (its slot of a bucket, so that the initializer writes there; default: a tensor of its
    own); ``on_final(old, new)`` is called with each meta parameter and the one replacing it once its value is
    final. Returns ``id`` of each meta parameter -> the parameter replacing it."""
    if memory_for is None:
        def memory_for(p: nn.Parameter) -> torch.Tensor:
            return torch.empty_like(p, device=device)
    check_materializable(module)
    holders: dict[int, int] = {}  # id(meta parameter) -> how many modules still hold it directly
    for m in module.modules():
        for p in m._parameters.values():
            if p is not None and p.is_meta:
                holders[id(p)] = holders.get(id(p), 0) + 1
    replaced: dict[int, nn.Parameter] = {}
    with torch.no_grad():
        for m in module.modules():
            metas = [(k, p) for k, p in m._parameters.items() if p is not None and p.is_meta]
            fresh = False
            for k, p in metas:
                if id(p) not in replaced:
                    replaced[id(p)] = nn.Parameter(memory_for(p), requires_grad=p.requires_grad)
                    fresh = True
                m._parameters[k] = replaced[id(p)]
            for k, b in list(m._buffers.items()):
                if b is not None and b.is_meta:
                    m._buffers[k] = torch.empty_like(b, device=device)
                    fresh = True
            if fresh:
                _initializer(m)()
            m._apply(lambda t: t.to(device), recurse=False)  # what was not on the meta device
            for _, p in metas:
                holders[id(p)] -= 1
                if holders[id(p)] == 0:
                    on_final(p, replaced[id(p)])
    return replaced
