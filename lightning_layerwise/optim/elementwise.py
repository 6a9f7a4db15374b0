"""Which parameters an optimizer updates element by element, and may therefore be split across ranks.

Note [element-wise optimizers]
    An update is *element-wise* when each element's new value depends only on
    that element's own gradient, state and the group's hyperparameters: SGD
    (with momentum, Nesterov, weight decay), Adam, AdamW, Adamax, NAdam, RAdam,
    RMSprop, Adagrad, Adadelta, ASGD, Rprop, and the AdamW groups
    (``use_muon=False``) of :class:`lightning_layerwise.Muon`. Such a parameter
    may be cut anywhere: each rank steps its piece and the pieces together are
    the one-process update, bit for bit. Muon groups (Newton–Schulz needs the
    whole matrix), ``torch.optim.Muon``, and every optimizer not known to be
    element-wise (Adafactor's row and column statistics, LAMB's and LARS's
    per-tensor trust ratios, Shampoo's preconditioners…) keep whole ownership.
    A user declares another optimizer class element-wise with
    ``LayerwiseStrategy(elementwise_optimizers=[...])``; the declaration is a
    promise the library cannot check.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from typing import Union

import torch

from .muon import Muon

ELEMENTWISE_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
    torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Adagrad, torch.optim.Adadelta, torch.optim.ASGD,
    torch.optim.Rprop,
)
"""torch optimizers whose update is element-wise in every param group (Note [element-wise optimizers])."""

OptimizerClass = Union[type, str]


def resolve_optimizer_classes(classes: Iterable[OptimizerClass], argument: str) -> tuple[type, ...]:
    """Classes given as types or import paths (``"my_pkg.optim.Lion"``); raises naming ``argument``."""
    resolved = []
    for entry in classes:
        if isinstance(entry, type):
            resolved.append(entry)
            continue
        if not isinstance(entry, str) or "." not in entry:
            raise ValueError(f"{argument}: {entry!r} is not an optimizer class; pass the class or its import path, "
                             "e.g. 'my_package.optim.Lion'.")
        module_name, _, name = entry.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module_name), name)
        except (ImportError, AttributeError) as error:
            raise ValueError(f"{argument}: cannot import {entry!r} ({error}); pass the class or a valid import "
                             "path.") from error
        if not isinstance(cls, type):
            raise ValueError(f"{argument}: {entry!r} is {type(cls).__name__}, not a class.")
        resolved.append(cls)
    return tuple(resolved)


def elementwise_parameters(optimizer: torch.optim.Optimizer, extra: Iterable[type] = ()) -> set[torch.Tensor]:
    """The parameters ``optimizer`` updates element-wise (Note [element-wise optimizers]).

    ``extra``: further optimizer classes to treat as element-wise in every group.
    """
    known = ELEMENTWISE_OPTIMIZERS + tuple(extra)
    if isinstance(optimizer, Muon):
        groups = [g for g in optimizer.param_groups if not g["use_muon"]]
    elif isinstance(optimizer, known) and not isinstance(optimizer, torch.optim.Muon if hasattr(torch.optim, "Muon")
                                                          else ()):
        groups = optimizer.param_groups
    else:
        groups = []
    return {p for g in groups for p in g["params"]}
