"""The wrappers alive in this process, found by the tensors they train.

torch's gradient utilities (``engine/grad_utils.py``), Lightning's ``grad_norm`` (``lightning/grad_norm.py``)
and QK-clip (``engine/qk_clip.py``) are handed tensors, not a wrapper: they look the wrapper up here. A wrapper
(``engine/data_parallel.py``) enters its parameters and pieces when it is built and each master when it is set,
and leaves at its ``release``, or when it is garbage-collected without one. The wrappers are typed here as the
modules they are: ``data_parallel.py`` imports this module, so this one does not import it back, not even for
its types (``tests/package/test_layers.py``).
"""

from __future__ import annotations

import itertools
import weakref

from torch import nn

__all__ = ["any_live", "live_wrappers", "wrapper_of"]

_LIVE: dict[int, "weakref.ref[nn.Module]"] = {}
"""``id(tensor)`` -> the live wrapper that trains it (its parameters, pieces and masters). Lets torch's
gradient utilities find the wrapper behind the tensors they are given (``grad_utils.py``)."""


def _forget(ref: "weakref.ref[nn.Module]") -> None:
    """A wrapper was collected without :meth:`~LayerwiseDataParallel.release`: its entries in :data:`_LIVE` go too."""
    for key in [key for key, value in _LIVE.items() if value is ref]:
        del _LIVE[key]


_SYNCS = itertools.count(1)
"""Numbers the syncs of this process: the wrapper synced last holds the highest (see ``grad_utils.synced_wrapper``)."""


def any_live() -> bool:
    """Whether some wrapper is alive (one dictionary test: the patched utilities' fast path)."""
    return bool(_LIVE)


def live_wrappers() -> list[nn.Module]:
    """Every wrapper with an entry in :data:`_LIVE` that is still alive."""
    refs = {id(ref): ref for ref in list(_LIVE.values())}  # by identity: a dead weak reference cannot be hashed
    return [w for w in (ref() for ref in refs.values()) if w is not None]


def wrapper_of(tensor) -> nn.Module | None:
    """The live wrapper training ``tensor`` (a parameter in its layout, a piece or a master), else ``None``."""
    ref = _LIVE.get(id(tensor))
    return ref() if ref is not None else None
