"""The wrappers alive in this process, found by the tensors they train.

torch's gradient utilities (``engine/grad_utils.py``), Lightning's ``grad_norm`` (``lightning/grad_norm.py``)
and QK-clip (``engine/qk_clip.py``) are handed tensors, not a wrapper: they look the wrapper up here. A wrapper
(``engine/data_parallel.py``) enters its parameters and pieces when it is built and each master when it is set,
and leaves at its ``release``, or when it is garbage-collected without one (the registry holds it weakly). The
wrappers are typed here as the modules they are: ``data_parallel.py`` imports this module, so this one does not
import it back, not even for its types (``tests/package/test_layers.py``).
"""

from __future__ import annotations

import itertools
import weakref

from torch import nn

__all__ = ["any_live", "live_wrappers", "wrapper_of"]

_LIVE: "weakref.WeakValueDictionary[int, nn.Module]" = weakref.WeakValueDictionary()
"""``id(tensor)`` -> the live wrapper that trains it (its parameters, pieces and masters), held weakly: a wrapper
collected without :meth:`~LayerwiseDataParallel.release` leaves no entry. The wrapper holds those tensors, so no
id is reused while its entry stands. Lets torch's gradient utilities find the wrapper behind the tensors they are
given (``grad_utils.py``)."""


_SYNCS = itertools.count(1)
"""Numbers the syncs of this process: the wrapper synced last holds the highest (see ``grad_utils.synced_wrapper``)."""


def any_live() -> bool:
    """Whether some wrapper is alive (one dictionary test: the patched utilities' fast path)."""
    return bool(_LIVE)


def live_wrappers() -> list[nn.Module]:
    """Every wrapper with an entry in :data:`_LIVE`."""
    return list({id(w): w for w in _LIVE.values()}.values())


def wrapper_of(tensor) -> nn.Module | None:
    """The live wrapper training ``tensor`` (a parameter in its layout, a piece or a master), else ``None``."""
    return _LIVE.get(id(tensor))
