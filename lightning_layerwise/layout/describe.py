"""A model's layout as text: :func:`describe_layout`."""

from __future__ import annotations

from typing import Callable

import torch

from .packing import plan_layout
from .plan import DEFAULT_BUCKET_SIZE, ParamSpec, newton_schulz_cost, param_specs


def describe_layout(module: torch.nn.Module, dp: int, bucket_size: int = DEFAULT_BUCKET_SIZE,
                    cost: Callable[[ParamSpec], float] = newton_schulz_cost,
                    elementwise: Callable[[str, torch.nn.Parameter], bool] | None = None) -> str:
    """Plans ``module`` for a data-parallel group of ``dp`` ranks (one owner group) and returns the layout's
    summary (``elementwise``: which parameters may be split, as for :func:`param_specs`)."""
    return plan_layout(param_specs(module, elementwise=elementwise), dp, bucket_size, cost).summary()
