"""Contiguous parameter and gradient buffers built from a :class:`~lightning_layerwise.layout.Layout`.

After :func:`allocate_buffers`, every trainable parameter's ``.data`` is a view
into its param buffer, at the offset the layout chose. Collectives then read and
write the buffers directly: the all-gather fills a bucket of the param buffer in
place, and the parameters see the new values without any copy. Gradients are
added into the grad buffer by the wrapper's hooks; padding is never written and
stays zero.

Note [memory format]
    A parameter keeps its memory format (``channels_last``, a transposed weight):
    its slot is viewed with the parameter's strides, and so is its gradient's slot,
    so the optimizer sees parameter and gradient laid out as under ``ddp``. That
    needs strides that cover exactly ``numel`` elements without gaps or overlap
    (any permutation of a contiguous layout); a parameter with other strides (a
    view with gaps) becomes contiguous, with a warning. A non-contiguous parameter
    is never split into pieces: a piece is a range of storage, and checkpoints cut
    and join pieces as ranges of the parameter's logical elements.
"""

from __future__ import annotations

import enum
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from .collectives import Collective
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
        relaid = []
        for slot in members:
            p = named_params[slot.name]
            if not p.is_contiguous() and not is_dense_permutation(p):
                relaid.append(slot.name)
            view = view_of(params, slot, like=p)
            view.copy_(p.detach())
            p.data = view
        if relaid:
            warnings.warn(f"parameters {relaid[:3]} have strides with gaps or overlaps; strategy='layerwise' "
                          "keeps them contiguous in its buffers (Note [memory format]).", stacklevel=3)
        buffers.append(FlatBuffer(params, grads))
    return buffers


def is_dense_permutation(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s strides lay its elements out without gaps or overlaps, in some dimension order."""
    dims = sorted((s, n) for n, s in zip(tensor.shape, tensor.stride()) if n != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def view_of(flat: torch.Tensor, slot: ParamSlot, like: torch.Tensor | None = None) -> torch.Tensor:
    """The parameter-shaped view of ``slot`` inside a flat buffer, strided as ``like`` where its strides are
    a dense permutation (Note [memory format])."""
    part = flat[slot.offset : slot.end]
    if like is not None and not like.is_contiguous() and is_dense_permutation(like):
        return part.as_strided(slot.shape, like.stride())
    return part.view(slot.shape)


class BucketState(enum.Enum):
    """Where a bucket is in one optimizer step."""

    ACCUMULATING = "accumulating"  # gradients of this step are being added
    REDUCING = "reducing"  # reduce-scatter dispatched, not waited
    REDUCED = "reduced"  # this rank's shard holds the averaged gradient
    GATHERING = "gathering"  # all-gather dispatched, not waited
    SYNCED = "synced"  # every rank holds the bucket's current parameters


@dataclass(eq=False)
class Bucket:
    """Run-time state of one planned bucket."""

    buffer: int
    index: int
    params: list[nn.Parameter]
    param_data: torch.Tensor
    grad_data: torch.Tensor
    first_param: int
    """Registration index of the earliest parameter in the bucket (forward order key)."""
    group: dist.ProcessGroup | None = None
    """Group its shards are spread over (reduce-scatter); ``gather_group``: its all-gather communicator."""
    gather_group: dist.ProcessGroup | None = None
    shards: int = 1
    """Ranks in ``group``; ``rank``: this rank's shard."""
    rank: int = 0
    expert: bool = False
    """Expert parameters (Note [expert parallelism] in ``process_groups.py``)."""
    chunks: list[tuple[int, int]] | None = None
    """Replica sharing (Note [replica sharing] in ``layout.py``): this rank's shard cut into one range per
    replica (from the shard's start), exchanged over ``replica_group``; ``None``: the rank steps its whole shard."""
    replica_group: dist.ProcessGroup | None = None
    replica_rank: int = 0
    state: BucketState = BucketState.SYNCED
    grads_state: BucketState = BucketState.ACCUMULATING
    ready: set[int] = field(default_factory=set)
    reduce: Collective | None = None
    gather: Collective | None = None
    replica_gather: Collective | None = None
    """The all-gather of the shard's chunks across the replicas, which the owner group's all-gather follows."""

    @property
    def name(self) -> str:
        return f"{self.buffer}.{self.index}"

    @property
    def shard(self) -> tuple[int, int]:
        """This rank's shard, as a range of the bucket."""
        size = self.grad_data.numel() // self.shards
        return self.rank * size, (self.rank + 1) * size

    @property
    def stepped_range(self) -> tuple[int, int]:
        """What this rank steps of the bucket (its shard, or its chunk of it), as a range of the bucket."""
        begin, end = self.shard
        if self.chunks is None:
            return begin, end
        a, b = self.chunks[self.replica_rank]
        return begin + a, begin + b
