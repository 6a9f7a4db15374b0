"""Precision-plugin adaptations for sharded gradients.

Lightning's precision plugins clip and unscale the gradients of the
optimizer's parameters. Under the layer-wise strategy each rank only holds the
gradients it owns, so two things must become collective:

* clipping by norm uses the norm of the *full* gradient (one all-reduce of the
  owned shards' sum of squares), and clipping by value acts on owned gradients;
* a ``16-mixed`` grad scaler's "found inf" is agreed across ranks (all-reduce
  MAX) right after unscaling, so every rank skips the same steps and keeps the
  same loss scale.

:func:`adapt_precision_plugin` installs both on the plugin instance the
Trainer built, leaving its class and every other behaviour as they are.
"""

from __future__ import annotations

import types
from typing import TYPE_CHECKING

import torch

from . import collectives
from .clip import clip_grad_norm_, clip_grad_value_

if TYPE_CHECKING:
    from .strategy import LayerwiseStrategy


def adapt_precision_plugin(plugin, strategy: "LayerwiseStrategy") -> None:
    """Makes ``plugin``'s clipping global across shards and its grad scaler agree on infs."""
    if getattr(plugin, "_layerwise_adapted", False):
        return

    def clip_grad_by_norm(self, optimizer, clip_val):
        clip_grad_norm_(strategy.wrapper, clip_val)

    def clip_grad_by_value(self, optimizer, clip_val):
        clip_grad_value_(strategy.wrapper, clip_val)

    plugin.clip_grad_by_norm = types.MethodType(clip_grad_by_norm, plugin)
    plugin.clip_grad_by_value = types.MethodType(clip_grad_by_value, plugin)
    scaler = getattr(plugin, "scaler", None)
    if scaler is not None:
        agree_on_found_inf(scaler, strategy)
    plugin._layerwise_adapted = True


def agree_on_found_inf(scaler: torch.amp.GradScaler, strategy: "LayerwiseStrategy") -> None:
    """Wraps ``scaler.unscale_`` so the inf check it records is the maximum over ranks."""
    unscale = scaler.unscale_

    def unscale_agreed(optimizer):
        unscale(optimizer)
        wrapper = strategy.wrapper
        if wrapper is None:
            return
        state = scaler._per_optimizer_states[id(optimizer)]
        found = state["found_inf_per_device"]
        device = strategy.root_device
        total = torch.zeros(1, dtype=torch.float32, device=device)
        for value in found.values():
            total += value.to(device)
        collectives.all_reduce_max(total, wrapper.process_groups.dp)
        # A rank that owns no gradient recorded nothing; give it the agreed verdict too.
        state["found_inf_per_device"] = {device: total}

    scaler.unscale_ = unscale_agreed
