"""Lightning's ``grad_norm`` over the full gradient of each parameter, while the engine's gradient utilities are
patched (Note [gradient utilities] in ``engine/grad_utils.py``).

Registering the patch (importing this module) patches nothing: it is put in place with torch's when a
session wraps a model, and taken out when the last one is released (Note [patches] in ``engine/patches.py``).
Names bound before (``from lightning.pytorch.utilities import grad_norm``) are covered too: the patch swaps the
function's code object.
"""

from __future__ import annotations

import types
from typing import Any, Callable

import torch
from lightning.pytorch.utilities import grads as lightning_grads
from torch import nn

from ..engine import grad_utils, patches
from ..engine.live_wrappers import any_live

_original: Callable | None = None
"""Lightning's own ``grad_norm`` (a copy of the function with its original code), while patched."""


def grad_norm(module: nn.Module, norm_type: Any, group_separator: str = "/") -> dict[str, Any]:
    """Lightning's ``grad_norm``, over the full gradient of each parameter: the keys and values ``ddp`` gives."""
    if not any_live():
        return _original(module, norm_type, group_separator)
    named = list(module.named_parameters())
    wrapper = grad_utils.synced_wrapper([p for _, p in named])
    if wrapper is None:
        return _original(module, norm_type, group_separator)
    norm_type = float(norm_type)
    if norm_type <= 0:
        raise ValueError(f"`norm_type` must be a positive number or 'inf' (infinity norm). Got {norm_type}")
    values = grad_utils.per_parameter_norms(wrapper, named, norm_type)
    norms = {f"grad_{norm_type}_norm{group_separator}{name}": value for name, value in values.items()}
    if norms:
        norms[f"grad_{norm_type}_norm_total"] = torch.tensor(list(norms.values())).norm(norm_type)
    return norms


def _entry(module, norm_type, group_separator="/"):
    # Runs as the code of Lightning's grad_norm, in its module's globals: hence the import here.
    from lightning_layerwise.lightning.grad_norm import grad_norm

    return grad_norm(module, norm_type, group_separator)


_PATCH = patches.register("lightning.pytorch.utilities.grad_norm", "gradient utilities")


def _install() -> patches.Undo:
    global _original
    function = lightning_grads.grad_norm
    _original = types.FunctionType(function.__code__, function.__globals__, function.__name__,
                                   function.__defaults__, function.__closure__)
    return _PATCH.swap_code(function, _entry.__code__, function.__defaults__, function.__kwdefaults__)


patches.GRADIENT_UTILITIES.add(_install)
