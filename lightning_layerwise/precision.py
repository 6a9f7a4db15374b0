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


class MasterWeights:
    """Float32 master copies of the owned low-precision parameters (``bf16-true``, ``16-true``).

    With a half-precision model, stepping the half-precision parameters
    directly loses small updates to rounding. Each rank keeps a float32 copy of
    the parameters it *owns* only (1/world of the model), puts those copies in
    the optimizer in place of the half-precision ones, and after each step
    writes them back into the param buffer, from where the all-gather spreads
    them. The copies' gradients are views of the float32 gradient buffer
    (the strategy reduces half-precision gradients in float32), so clipping and
    the optimizer see the same tensors.
    """

    def __init__(self, wrapper, optimizer: torch.optim.Optimizer) -> None:
        self.wrapper = wrapper
        self.pairs: list[tuple[torch.nn.Parameter, torch.nn.Parameter]] = []
        swap = {}
        for name, p in wrapper.named_owned_parameters():
            if p.dtype in (torch.bfloat16, torch.float16):
                master = torch.nn.Parameter(p.detach().float().clone())
                swap[p] = master
                self.pairs.append((p, master))
        self.names = {master: name for name, p in wrapper.named_owned_parameters()
                      for master in [swap.get(p)] if master is not None}
        for group in optimizer.param_groups:
            group["params"] = [swap.get(p, p) for p in group["params"]]
        for p, master in swap.items():
            if p in optimizer.state:  # state created before the swap follows its parameter
                optimizer.state[master] = optimizer.state.pop(p)

    @property
    def numel(self) -> int:
        return sum(m.numel() for _, m in self.pairs)

    def attach_grads(self) -> None:
        """Gives every master the reduced gradient of its parameter (None if it has none)."""
        for p, master in self.pairs:
            if p.grad is None:
                master.grad = None
            else:
                main_grad = p.main_grad
                master.grad = main_grad if main_grad.dtype == torch.float32 else main_grad.float()

    @torch.no_grad()
    def write_back(self) -> None:
        """Copies the masters into the model's (half-precision) parameters, i.e. the param buffer."""
        for p, master in self.pairs:
            p.copy_(master)

    @torch.no_grad()
    def refresh(self) -> None:
        """Sets the masters to the (just loaded) parameters; a checkpoint's masters then override them."""
        for p, master in self.pairs:
            master.copy_(p)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's masters by parameter name (on CPU)."""
        return {self.names[m]: m.detach().cpu() for _, m in self.pairs}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restores the owned masters from a full ``{name: tensor}`` mapping and writes them back."""
        for p, master in self.pairs:
            name = self.names[master]
            if name in state:
                master.copy_(state[name])
        self.write_back()
