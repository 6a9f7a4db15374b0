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

Note [bucket states]
    A bucket goes through two cycles per optimizer step, each owned by one side of
    the engine: its gradients (:class:`GradState`, the gradient side) accumulate,
    are reduce-scattered and are reduced; its parameters (:class:`ParamState`, the
    parameter side) are stepped, all-gathered and ready. Every move is a method of
    the bucket that checks the state it leaves (:meth:`start_reduce`,
    :meth:`finish_reduce`, :meth:`restart`; :meth:`queue_gather`,
    :meth:`start_gather`, :meth:`finish_gather`), so a collective dispatched twice
    or a wait without a dispatch raises :class:`BucketStateError` instead of
    corrupting a buffer. The two cycles are two fields, not one: they overlap in
    time. A bucket's all-gather may still be in flight when the next backward starts
    accumulating into its gradients (its module ran no forward this step), and the
    gradients of the last step stay handed out (reduced) while the next forward
    gathers its parameters.

Note [sharded parameters]
    With ``shard_parameters=True`` a bucket keeps only this rank's shard of its
    parameters (:attr:`Bucket.param_shard`) and of its reduced gradient
    (:attr:`Bucket.grad_shard`); ``param_data`` and ``grad_data`` are then full-size
    tensors of their own storage, allocated while in use and freed (the storage
    resized to zero bytes, so every view keeps its shape) otherwise. The parameter
    cycle gains one state, ``FREED``: freed -> gathering (all-gathered from the
    shards) -> ready -> freed. A parameter this rank steps whole lies inside its
    shard, so it views ``param_shard`` and is always readable here; every other
    parameter views ``param_data`` and is readable only while its bucket is ready
    (the read guard makes a read wait for, or gather, it). Gradients go the other
    way: a backward adds local gradients into ``grad_data`` (allocated when the first
    one arrives), the reduce-scatter averages it in place, :meth:`Bucket.fold_reduce`
    adds this rank's shard of it into ``grad_shard`` and frees the full buffer.
    Nothing here knows when a bucket is needed: ``engine/sharded.py`` decides.
"""

from __future__ import annotations

import enum
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from . import collectives
from .collectives import Collective
from ..layout import Layout, ParamSlot


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
                f"parameters of one buffer ({plan.kind}, {plan.dtype}) sit on several devices "
                f"{sorted(map(str, devices))}; "
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


def view_of(flat: torch.Tensor, slot: ParamSlot, like: torch.Tensor | None = None,
            offset: int | None = None) -> torch.Tensor:
    """The parameter-shaped view of ``slot`` inside a flat buffer, strided as ``like`` where its strides are
    a dense permutation (Note [memory format]); ``offset``: where the slot starts in ``flat`` (default: its
    offset in its layout buffer)."""
    begin = slot.offset if offset is None else offset
    part = flat[begin : begin + slot.numel]
    if like is not None and not like.is_contiguous() and is_dense_permutation(like):
        return part.as_strided(slot.shape, like.stride())
    return part.view(slot.shape)


class GradState(enum.Enum):
    """Where a bucket's gradients are in one optimizer step (Note [bucket states])."""

    ACCUMULATING = "accumulating"  # backward passes add into the grad buffer
    REDUCING = "reducing"  # reduce-scatter dispatched, not waited
    REDUCED = "reduced"  # this rank's shard holds the averaged gradient; its units have it


class ParamState(enum.Enum):
    """Where a bucket's parameters are in one optimizer step (Note [bucket states])."""

    READY = "ready"  # every rank holds the bucket's current parameters
    STEPPED = "stepped"  # this rank's shard was stepped; the all-gather is queued (the replicas' chunks first)
    GATHERING = "gathering"  # all-gather dispatched, not waited
    FREED = "freed"  # sharded parameters: only this rank's shard is held (Note [sharded parameters])


class BucketStateError(RuntimeError):
    """A bucket was asked to move between states out of order: a bug in the engine, never a user error."""


@dataclass(eq=False)
class Bucket:
    """One planned bucket at run time: its slices of the buffers, its groups, its collectives and its states
    (Note [bucket states])."""

    buffer: int
    index: int
    params: list[nn.Parameter]
    param_data: torch.Tensor
    grad_data: torch.Tensor
    first_param: int
    """Registration index of the earliest parameter in the bucket (forward order key)."""
    start: int = 0
    """Its first element in its buffer."""
    group: dist.ProcessGroup | None = None
    """Group its shards are spread over (reduce-scatter); ``gather_group``: its all-gather communicator."""
    gather_group: dist.ProcessGroup | None = None
    shards: int = 1
    """Ranks in ``group``; ``rank``: this rank's shard."""
    rank: int = 0
    expert: bool = False
    """Expert parameters (Note [expert parallelism] in ``engine/process_groups.py``)."""
    chunks: list[tuple[int, int]] | None = None
    """Replica sharing (Note [replica sharing] in ``layout/sharing.py``): this rank's shard cut into one range per
    replica (from the shard's start), exchanged over ``replica_group``; ``None``: the rank steps its whole shard."""
    replica_group: dist.ProcessGroup | None = None
    replica_rank: int = 0
    param_state: ParamState = ParamState.READY
    grad_state: GradState = GradState.ACCUMULATING
    ready: set[int] = field(default_factory=set)
    """``id`` of the parameters whose gradient is complete this backward."""
    reduce: Collective | None = None
    """The reduce-scatter in flight (inside the owner group, then across the replicas)."""
    gather: Collective | None = None
    replica_gather: Collective | None = None
    """The all-gather of the shard's chunks across the replicas, which the owner group's all-gather follows."""
    param_shard: torch.Tensor | None = None
    """Sharded parameters (Note [sharded parameters]): this rank's shard of the parameters, always held;
    ``None``: every rank holds the whole bucket in ``param_data``."""
    grad_shard: torch.Tensor | None = None
    """Sharded parameters: this rank's shard of the reduced gradient, a tensor of its own storage: allocated
    (zeroed) at the bucket's first reduction after the gradients were dropped, freed when they are dropped
    (Note [sharded gradients] in ``engine/grad_sync.py``)."""
    taken_grad: torch.Tensor | None = None
    """Sharded parameters, a bucket that is one parameter: autograd's gradient of it, flat, taken as the full
    gradient buffer in place of ``grad_data`` (:meth:`take_grad`) until its reduction is folded in."""

    @property
    def sharded(self) -> bool:
        return self.param_shard is not None

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

    def stepped_grad(self) -> torch.Tensor:
        """The reduced gradient of what this rank steps (:attr:`stepped_range`), where it is kept."""
        begin, end = self.stepped_range
        if self.grad_shard is None:
            return self.grad_data[begin:end]
        if not is_allocated(self.grad_shard):  # dropped: zero until a reduction lands
            allocate(self.grad_shard)
            self.grad_shard.zero_()
        first = self.shard[0]
        return self.grad_shard[begin - first:end - first]

    @property
    def complete(self) -> bool:
        """Every parameter's gradient arrived this backward."""
        return len(self.ready) == len(self.params)

    def _move(self, field_name: str, allowed: tuple, to) -> None:
        now = getattr(self, field_name)
        if now not in allowed:
            raise BucketStateError(f"bucket {self.name}: {field_name} {now.value} cannot become {to.value} "
                                   f"(only from {', '.join(s.value for s in allowed)})")
        setattr(self, field_name, to)

    # --- gradients ---------------------------------------------------------------------------------------------
    def start_reduce(self) -> None:
        """Dispatches the reduce-scatter of the gradients into this rank's shard, averaged (Note [averaging] in
        ``engine/collectives.py``)."""
        self._move("grad_state", (GradState.ACCUMULATING,), GradState.REDUCING)
        self.reduce = collectives.reduce_scatter_bucket(self.full_grad, self.group, async_op=True, average=True)

    def start_replica_reduce(self) -> None:
        """With replica sharing, after the owner group's reduce-scatter landed: its mean averaged over the owner
        groups into the chunk this rank steps (Note [replica sharing] in ``layout/sharing.py``)."""
        begin, end = self.shard
        self.reduce = collectives.reduce_scatter_chunks(self.full_grad[begin:end], self.chunks, self.replica_group,
                                                        async_op=True, average=True)

    def finish_reduce(self) -> None:
        """Every reduction of this step landed (the caller waited for :attr:`reduce`)."""
        self._move("grad_state", (GradState.REDUCING,), GradState.REDUCED)
        self.reduce = None

    # --- sharded parameters (Note [sharded parameters]) ---------------------------------------------------------
    def drop_grad_shard(self) -> None:
        """The gradients were dropped: the shard's storage is freed until the next reduction lands in it."""
        free(self.grad_shard)

    @property
    def full_grad(self) -> torch.Tensor:
        """The full gradient buffer a backward fills: :attr:`taken_grad` where one was taken, else ``grad_data``."""
        return self.taken_grad if self.taken_grad is not None else self.grad_data

    @property
    def full_grad_held(self) -> bool:
        return self.taken_grad is not None or is_allocated(self.grad_data)

    def ensure_grad_buffer(self) -> None:
        """Allocates the full gradient buffer, zeroed, unless it is held."""
        if not self.full_grad_held:
            allocate(self.grad_data)
            self.grad_data.zero_()

    def take_grad(self, grad: torch.Tensor) -> bool:
        """Sharded parameters: where this bucket is exactly one parameter and its full buffer is not held, autograd's
        gradient ``grad`` becomes that buffer, reduced in place, so a backward neither allocates the buffer nor
        copies into it (Note [sharded gradients] in ``engine/grad_sync.py``); a later gradient of this backward is
        added into it. False where the gradient must be added into ``grad_data``: it holds local sums (``no_sync``),
        the bucket holds more (other parameters, padding), or ``grad`` differs in dtype or layout."""
        if self.taken_grad is not None:
            self.taken_grad.add_(grad.detach().reshape(-1))
            return True
        if (len(self.params) != 1 or is_allocated(self.grad_data) or grad.numel() != self.grad_data.numel()
                or grad.dtype != self.grad_data.dtype or grad.device != self.grad_data.device
                or grad.requires_grad or grad._is_view() or not grad.is_contiguous()):
            return False
        self.taken_grad = grad.view(-1)
        return True

    def drop_full_grad(self) -> None:
        """Frees the full gradient buffer, or lets go of the gradient taken in its place."""
        self.taken_grad = None
        free(self.grad_data)

    def fold_reduce(self) -> None:
        """The reduce-scatter landed (the caller waited for :attr:`reduce`, and with replica sharing for the
        chunks' too): the mean of what this rank steps is added into :attr:`grad_shard` and the full buffer is
        freed."""
        self._move("grad_state", (GradState.REDUCING,), GradState.REDUCED)
        self.reduce = None
        begin, end = self.stepped_range
        self.stepped_grad().add_(self.full_grad[begin:end])
        self.drop_full_grad()

    def share_chunks(self) -> None:
        """With replica sharing, after the step: every rank's shard gets the chunks its replicas stepped (Note
        [replica sharing] in ``layout/sharing.py``), so that any rank's shard is current for the next gather."""
        collectives.all_gather_chunks(self.param_shard, self.chunks, self.replica_group, async_op=False)

    def accumulate_again(self) -> None:
        """The backward that reduced this bucket ended; the next one accumulates into a fresh buffer."""
        self._move("grad_state", (GradState.REDUCED, GradState.ACCUMULATING), GradState.ACCUMULATING)
        self.ready.clear()

    def mark_reduced(self) -> None:
        """Every reduction of this accumulation was folded into the shard (the sync hands it out)."""
        self._move("grad_state", (GradState.ACCUMULATING, GradState.REDUCED), GradState.REDUCED)

    def start_unshard(self) -> None:
        """Allocates the full parameters and dispatches their all-gather from every rank's shard."""
        self._move("param_state", (ParamState.FREED,), ParamState.GATHERING)
        allocate(self.param_data)
        self.gather = collectives.all_gather_into(self.param_data, self.param_shard, self.gather_group,
                                                  async_op=True)

    def reshard(self) -> None:
        """Frees the full parameters (the all-gather landed, or this rank's shard changed since)."""
        self._move("param_state", (ParamState.READY, ParamState.STEPPED, ParamState.FREED), ParamState.FREED)
        free(self.param_data)

    def restart(self) -> None:
        """A new accumulation: no gradient arrived yet (the caller zeroed the buffer)."""
        if self.reduce is not None:
            raise BucketStateError(f"bucket {self.name}: restarted with its reduce-scatter in flight")
        self.ready.clear()
        self.grad_state = GradState.ACCUMULATING

    # --- parameters --------------------------------------------------------------------------------------------
    def queue_gather(self) -> None:
        """This rank's shard was stepped: its all-gathers are queued (with replica sharing, the chunks' across
        the replicas first, :meth:`start_replica_gather`; then the owner group's, :meth:`start_gather`)."""
        self._move("param_state", (ParamState.READY,), ParamState.STEPPED)
        self.gather = None

    def start_replica_gather(self) -> None:
        """With replica sharing: dispatches the all-gather of the shard's chunks across the replicas, which the
        owner group's all-gather follows (Note [replica sharing] in ``layout/sharing.py``)."""
        begin, end = self.shard
        self.replica_gather = collectives.all_gather_chunks(self.param_data[begin:end], self.chunks,
                                                            self.replica_group, async_op=True)

    def start_gather(self) -> None:
        """Dispatches the owner group's all-gather (the caller waited for :attr:`replica_gather`)."""
        self._move("param_state", (ParamState.STEPPED,), ParamState.GATHERING)
        self.replica_gather = None
        self.gather = collectives.all_gather_bucket(self.param_data, self.gather_group, async_op=True)

    def finish_gather(self) -> None:
        """The all-gather landed (the caller waited for :attr:`gather`): every rank holds the new parameters."""
        self._move("param_state", (ParamState.GATHERING,), ParamState.READY)
        self.gather = None

    def abandon(self) -> None:
        """Forgets every collective in flight (after a failed one: waiting would raise its error again). Sharded
        parameters whose all-gather did not land are left freed: nothing of them is held here."""
        lost = self.sharded and (self.param_state is ParamState.GATHERING or not is_allocated(self.param_data))
        self.gather = self.reduce = self.replica_gather = self.taken_grad = None
        self.param_state = ParamState.FREED if lost else ParamState.READY
        self.grad_state = GradState.ACCUMULATING


def allocate(tensor: torch.Tensor) -> None:
    """Gives ``tensor`` (the whole of its storage) its bytes back; the values are undefined."""
    storage = tensor.untyped_storage()
    nbytes = tensor.numel() * tensor.element_size()
    if storage.size() < nbytes:
        storage.resize_(nbytes)


def free(tensor: torch.Tensor) -> None:
    """Frees ``tensor``'s storage; ``tensor`` and its views keep their shapes (Note [sharded parameters])."""
    tensor.untyped_storage().resize_(0)


def is_allocated(tensor: torch.Tensor) -> bool:
    return tensor.untyped_storage().size() > 0


def meta_buffers(layout: Layout, grad_dtype: torch.dtype | None = None) -> list[FlatBuffer]:
    """The layout's buffers as shapes on the meta device (no memory): what the buckets of sharded parameters
    start from, before :func:`allocate_shards` and :func:`cut_shard` give them their tensors."""
    return [FlatBuffer(torch.empty(plan.numel, dtype=plan.dtype, device="meta"),
                       torch.empty(plan.numel, dtype=grad_dtype or plan.dtype, device="meta")) for plan in layout.buffers]


def single_device(tensors: list[torch.Tensor], what: str) -> torch.device:
    """The one device ``tensors`` sit on, or a ``ValueError`` naming them all."""
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"{what} sit on several devices {sorted(map(str, devices))}; move the module to one "
                         "device before wrapping it.")
    return devices.pop()


def allocate_shards(layout: Layout, buckets: list[Bucket], dtypes: list[tuple[torch.dtype, torch.dtype]],
                    device: torch.device) -> list[FlatBuffer]:
    """Sharded parameters (Note [sharded parameters]): each layout buffer's shards of this rank, one pair of
    tensors (parameters, gradients) per buffer, and every bucket's slices of them; each bucket's full gradient
    buffer, freed (the gradient side makes its views of it bucket by bucket). Values are not set: each bucket's
    parameters come with :func:`cut_shard`."""
    sharded = []
    for b_index, plan in enumerate(layout.buffers):
        mine = [b for b in buckets if b.buffer == b_index]
        param_dtype, grad_dtype = dtypes[b_index]
        total = sum(bp.numel // bp.shards for bp in plan.buckets)
        params = torch.empty(total, dtype=param_dtype, device=device)
        position = 0
        for bucket, bp in zip(mine, plan.buckets):
            size = bp.numel // bp.shards
            bucket.param_shard = params[position:position + size]
            # Each bucket's gradient shard has storage of its own, freed whenever the gradients are dropped, so
            # that a backward holds the shards of the buckets it reduced so far only (Note [sharded gradients]).
            bucket.grad_shard = torch.zeros(size, dtype=grad_dtype, device=device)
            bucket.grad_data = torch.empty(bp.numel, dtype=grad_dtype, device=device)
            free(bucket.grad_data)
            position += size
        sharded.append(FlatBuffer(params, torch.empty(0, dtype=grad_dtype, device=device)))
    return sharded


def cut_shard(bucket: Bucket, bp, layout: Layout, named: dict[str, nn.Parameter], stepped_whole: set[str],
              full: torch.Tensor) -> None:
    """``full`` holds the bucket's current parameters (every rank alike): this rank's shard is kept, every
    parameter of the bucket is pointed at the shard (those this rank steps whole) or at ``full``, which becomes
    the bucket's full buffer, freed."""
    begin, end = bucket.shard
    bucket.param_shard.copy_(full[begin:end])
    for name in bp.params:
        slot, p = layout.params[name], named[name]
        inside = slot.offset - bp.start
        if name in stepped_whole:
            p.data = view_of(bucket.param_shard, slot, like=p, offset=inside - begin)
        else:
            p.data = view_of(full, slot, like=p, offset=inside)
    bucket.param_data = full
    free(full)
    bucket.param_state = ParamState.FREED


def build_buckets(layout: Layout, flat_buffers: list[FlatBuffer], named: dict[str, nn.Parameter],
                  order: list[str], groups, ranks) -> list[Bucket]:
    """The run-time buckets of ``layout`` over ``flat_buffers``: each with its slices, its groups (dense ones over
    the owner group, expert ones over the expert owner group) and this rank's shard and chunks.

    ``order``: the parameter names in registration order (a bucket's forward-order key is its first one);
    ``groups``, ``ranks``: a :class:`~lightning_layerwise.ProcessGroups` and its ``Ranks``."""
    index = {name: i for i, name in enumerate(order)}
    buckets = []
    for b_index, plan in enumerate(layout.buffers):
        flat = flat_buffers[b_index]
        expert = plan.kind == "expert" and groups.expert_parallel is not None
        if expert:
            group, position = groups.expert_owner_group, ranks.expert_owner_rank
            gather_group = groups.expert_owner_all_gather or groups.expert_dp_all_gather
            replica_group, replica_rank = groups.expert_replica, groups.expert_replica_rank
        else:
            group, gather_group, position = groups.owner_group, groups.dp_all_gather, ranks.owner_rank
            replica_group, replica_rank = groups.replica, groups.replica_rank
        for bp in plan.buckets:
            chunks = None
            if bp.chunks:
                begin = bp.shard_range(position)[0]
                chunks = [(a - begin, b - begin) for a, b in bp.chunk_ranges(position)]
            buckets.append(Bucket(
                b_index, bp.index, [named[n] for n in bp.params], flat.params[bp.start:bp.end],
                flat.grads[bp.start:bp.end], first_param=min(index[n] for n in bp.params), start=bp.start, group=group,
                gather_group=gather_group, shards=bp.shards, rank=position, expert=expert, chunks=chunks,
                replica_group=replica_group, replica_rank=replica_rank))
    return buckets
