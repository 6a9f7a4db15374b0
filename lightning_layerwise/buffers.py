"""Contiguous parameter and gradient buffers built from a :class:`~lightning_layerwise.layout.Layout`.

After :func:`allocate_buffers`, every trainable parameter's ``.data`` is a view
into its param buffer, at the offset the layout chose. Collectives then read and
write the buffers directly: the all-gather fills a bucket of the param buffer in
place, and the parameters see the new values without any copy. Gradients are
added into the grad buffer by the wrapper's hooks; padding is never written and
stays zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .layout import Layout, ParamSlot


@dataclass
class FlatBuffer:
    """The param and grad tensors of one :class:`~lightning_layerwise.layout.BufferPlan`."""

    params: torch.Tensor
    grads: torch.Tensor


def allocate_buffers(
    layout: Layout,
    named_params: dict[str, torch.nn.Parameter],
    grad_dtype: torch.dtype | None = None,
) -> list[FlatBuffer]:
    """Allocates one param and one grad buffer per layout buffer and makes each parameter a view.

    ``grad_dtype`` overrides the gradient buffers' dtype (e.g. ``torch.float32``
    to accumulate and reduce bf16 gradients in fp32); by default gradients use
    the parameter dtype.
    """
    buffers = []
    for plan in layout.buffers:
        members = [layout.params[name] for bucket in plan.buckets for name in bucket.params]
        devices = {named_params[s.name].device for s in members}
        if len(devices) != 1:
            raise ValueError(
                f"parameters of one buffer ({plan.kind}, {plan.dtype}) sit on several devices {sorted(map(str, devices))}; "
                "move the module to one device before wrapping it."
            )
        device = devices.pop()
        params = torch.zeros(plan.numel, dtype=plan.dtype, device=device)
        grads = torch.zeros(plan.numel, dtype=grad_dtype or plan.dtype, device=device)
        for slot in members:
            p = named_params[slot.name]
            view = view_of(params, slot)
            view.copy_(p.detach())
            p.data = view
        buffers.append(FlatBuffer(params, grads))
    return buffers


def view_of(flat: torch.Tensor, slot: ParamSlot) -> torch.Tensor:
    """The parameter-shaped view of ``slot`` inside a flat buffer."""
    return flat[slot.offset : slot.end].view(slot.shape)
