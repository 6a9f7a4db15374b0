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
    parameter side) are stepped, all-gathered and ready. Each cycle is a part of the
    bucket, ``bucket.grad`` (:class:`BucketGradient`) and ``bucket.param``
    (:class:`BucketParameters`), and every move is a method of the part that checks
    the state it leaves (``grad.start_reduce``, ``grad.finish_reduce``,
    ``grad.restart``; ``param.queue_gather``, ``param.start_gather``,
    ``param.finish_gather``), so a collective dispatched twice or a wait without a
    dispatch raises :class:`BucketStateError` instead of corrupting a buffer. The
    two cycles are two fields, not one: they overlap in time. A bucket's all-gather
    may still be in flight when the next backward starts accumulating into its
    gradients (its module ran no forward this step), and the gradients of the last
    step stay handed out (reduced) while the next forward gathers its parameters.

Note [sharded parameters]
    With ``shard_parameters=True`` a bucket keeps only this rank's shard of its
    parameters (``bucket.param.shard``) and of its reduced gradient
    (``bucket.grad.shard``); the full buffers, ``param.data`` and ``grad.data``, are
    then tensors of their own storage, allocated while in use and freed (the storage
    resized to zero bytes, so every view keeps its shape) otherwise. The parameter
    cycle gains one state, ``FREED``: freed -> gathering (all-gathered from the
    shards) -> ready -> freed. A parameter this rank steps whole lies inside its
    shard, so it views ``param.shard`` and is always readable here; every other
    parameter views ``param.data`` and is readable only while its bucket is ready
    (the read guard makes a read wait for, or gather, it). Gradients go the other
    way: a backward adds local gradients into ``grad.data`` (allocated when the
    first one arrives), the reduce-scatter averages it in place,
    :meth:`BucketGradient.fold_reduce` adds this rank's shard of it into
    ``grad.shard`` and frees the full buffer. Nothing here knows when a bucket is
    needed: ``engine/sharded.py`` decides.
"""

from __future__ import annotations

import enum
import warnings
from dataclasses import dataclass

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


def _check_move(bucket: str, what: str, now: enum.Enum, allowed: tuple, to: enum.Enum) -> None:
    """Raises :class:`BucketStateError` unless ``now`` may become ``to``: it is one of ``allowed``."""
    if now not in allowed:
        raise BucketStateError(f"bucket {bucket}: {what} {now.value} cannot become {to.value} "
                               f"(only from {', '.join(s.value for s in allowed)})")


class BucketGradient:
    """A bucket's gradients (:attr:`Bucket.grad`): the full gradient buffer a backward fills, this rank's shard of
    the reduced gradient with sharded parameters, the state they are in and the reduce-scatters that move them
    (Note [bucket states]).

    Args:
        bucket: the bucket's name, for errors.
        data: the full gradient buffer (the bucket's slice of its grad buffer).
        param_count: how many parameters the bucket holds.
        group, chunks, replica_group: as :class:`Bucket`'s.
        shard, stepped: this rank's shard of the bucket and what it steps of it (:attr:`Bucket.stepped_range`).
    """

    def __init__(self, bucket: str, data: torch.Tensor, param_count: int, group: dist.ProcessGroup | None,
                 chunks: list[tuple[int, int]] | None, replica_group: dist.ProcessGroup | None,
                 shard: tuple[int, int], stepped: tuple[int, int]) -> None:
        self.data = data
        """The full gradient buffer; with sharded parameters a tensor of its own storage, allocated while a backward
        fills it (Note [sharded parameters])."""
        self.shard: torch.Tensor | None = None
        """Sharded parameters: this rank's shard of the reduced gradient, a tensor of its own storage: allocated
        (zeroed) at the bucket's first reduction after the gradients were dropped, freed when they are dropped
        (Note [sharded gradients] in ``engine/grad_sync.py``); ``None``: the reduced shard stays in :attr:`data`."""
        self.taken: torch.Tensor | None = None
        """Sharded parameters, a bucket that is one parameter: autograd's gradient of it, flat, taken as the full
        gradient buffer in place of :attr:`data` (:meth:`take`) until its reduction is folded in."""
        self.state = GradState.ACCUMULATING
        self.ready: set[int] = set()
        """``id`` of the parameters whose gradient is complete this backward."""
        self.reduce: Collective | None = None
        """The reduce-scatter in flight (inside the owner group, then across the replicas)."""
        self._bucket, self._param_count, self._group = bucket, param_count, group
        self._chunks, self._replica_group = chunks, replica_group
        self._shard, self._stepped = shard, stepped

    @property
    def complete(self) -> bool:
        """Every parameter's gradient arrived this backward."""
        return len(self.ready) == self._param_count

    @property
    def full(self) -> torch.Tensor:
        """The full gradient buffer a backward fills: :attr:`taken` where one was taken, else :attr:`data`."""
        return self.taken if self.taken is not None else self.data

    @property
    def full_held(self) -> bool:
        """Whether the full gradient buffer is held: allocated, or a gradient taken in its place."""
        return self.taken is not None or is_allocated(self.data)

    def stepped(self) -> torch.Tensor:
        """The reduced gradient of what this rank steps (:attr:`Bucket.stepped_range`), where it is kept."""
        begin, end = self._stepped
        if self.shard is None:
            return self.data[begin:end]
        if not is_allocated(self.shard):  # dropped: zero until a reduction lands
            allocate(self.shard)
            self.shard.zero_()
        first = self._shard[0]
        return self.shard[begin - first:end - first]

    def _move(self, allowed: tuple, to: GradState) -> None:
        _check_move(self._bucket, "grad_state", self.state, allowed, to)
        self.state = to

    def start_reduce(self) -> None:
        """Dispatches the reduce-scatter of the gradients into this rank's shard, averaged (Note [averaging] in
        ``engine/collectives.py``)."""
        self._move((GradState.ACCUMULATING,), GradState.REDUCING)
        self.reduce = collectives.reduce_scatter_bucket(self.full, self._group, async_op=True, average=True)

    def start_replica_reduce(self) -> None:
        """With replica sharing, after the owner group's reduce-scatter landed: its mean averaged over the owner
        groups into the chunk this rank steps (Note [replica sharing] in ``layout/sharing.py``)."""
        begin, end = self._shard
        self.reduce = collectives.reduce_scatter_chunks(self.full[begin:end], self._chunks, self._replica_group,
                                                        async_op=True, average=True)

    def finish_reduce(self) -> None:
        """Every reduction of this step landed (the caller waited for :attr:`reduce`)."""
        self._move((GradState.REDUCING,), GradState.REDUCED)
        self.reduce = None

    def fold_reduce(self) -> None:
        """Sharded parameters: the reduce-scatter landed (the caller waited for :attr:`reduce`, and with replica
        sharing for the chunks' too): the mean of what this rank steps is added into :attr:`shard` and the full
        buffer is freed."""
        self._move((GradState.REDUCING,), GradState.REDUCED)
        self.reduce = None
        begin, end = self._stepped
        self.stepped().add_(self.full[begin:end])
        self.drop_full()

    def accumulate_again(self) -> None:
        """The backward that reduced this bucket ended; the next one accumulates into a fresh buffer."""
        self._move((GradState.REDUCED, GradState.ACCUMULATING), GradState.ACCUMULATING)
        self.ready.clear()

    def mark_reduced(self) -> None:
        """Every reduction of this accumulation was folded into the shard (the sync hands it out)."""
        self._move((GradState.ACCUMULATING, GradState.REDUCED), GradState.REDUCED)

    def restart(self) -> None:
        """A new accumulation: no gradient arrived yet (the caller zeroed the buffer)."""
        if self.reduce is not None:
            raise BucketStateError(f"bucket {self._bucket}: restarted with its reduce-scatter in flight")
        self.ready.clear()
        self.state = GradState.ACCUMULATING

    # --- sharded parameters (Note [sharded parameters]) ---------------------------------------------------------
    def ensure_full(self) -> None:
        """Allocates the full gradient buffer, zeroed, unless it is held."""
        if not self.full_held:
            allocate(self.data)
            self.data.zero_()

    def take(self, grad: torch.Tensor) -> bool:
        """Where this bucket is exactly one parameter and its full buffer is not held, autograd's gradient ``grad``
        becomes that buffer, reduced in place, so a backward neither allocates the buffer nor copies into it (Note
        [sharded gradients] in ``engine/grad_sync.py``); a later gradient of this backward is added into it. False
        where the gradient must be added into :attr:`data`: it holds local sums (``no_sync``), the bucket holds more
        (other parameters, padding), or ``grad`` differs in dtype or layout."""
        if self.taken is not None:
            self.taken.add_(grad.detach().reshape(-1))
            return True
        if (self._param_count != 1 or is_allocated(self.data) or grad.numel() != self.data.numel()
                or grad.dtype != self.data.dtype or grad.device != self.data.device
                or grad.requires_grad or grad._is_view() or not grad.is_contiguous()):
            return False
        self.taken = grad.view(-1)
        return True

    def drop_full(self) -> None:
        """Frees the full gradient buffer, or lets go of the gradient taken in its place."""
        self.taken = None
        free(self.data)

    def drop_shard(self) -> None:
        """The gradients were dropped: the shard's storage is freed until the next reduction lands in it."""
        free(self.shard)

    def abandon(self) -> None:
        """Forgets the reduce-scatter in flight and the gradient taken (after a failed collective)."""
        self.reduce = self.taken = None
        self.state = GradState.ACCUMULATING


class BucketParameters:
    """A bucket's parameters (:attr:`Bucket.param`): the full parameters, this rank's shard of them with sharded
    parameters, the state they are in and the all-gathers that move them (Note [bucket states]).

    Args:
        bucket: the bucket's name, for errors.
        data: the full parameters (the bucket's slice of its param buffer).
        gather_group, chunks, replica_group: as :class:`Bucket`'s.
        shard: this rank's shard, as a range of the bucket.
    """

    def __init__(self, bucket: str, data: torch.Tensor, gather_group: dist.ProcessGroup | None,
                 chunks: list[tuple[int, int]] | None, replica_group: dist.ProcessGroup | None,
                 shard: tuple[int, int]) -> None:
        self.data = data
        """The full parameters; with sharded parameters a tensor of its own storage, allocated while the bucket is
        gathered (Note [sharded parameters])."""
        self.shard: torch.Tensor | None = None
        """Sharded parameters: this rank's shard of the parameters, always held; ``None``: every rank holds the
        whole bucket in :attr:`data`."""
        self.state = ParamState.READY
        self.gather: Collective | None = None
        """The owner group's all-gather in flight."""
        self.replica_gather: Collective | None = None
        """The all-gather of the shard's chunks across the replicas, which the owner group's all-gather follows."""
        self._bucket, self._gather_group = bucket, gather_group
        self._chunks, self._replica_group, self._shard = chunks, replica_group, shard

    def _move(self, allowed: tuple, to: ParamState) -> None:
        _check_move(self._bucket, "param_state", self.state, allowed, to)
        self.state = to

    def queue_gather(self) -> None:
        """This rank's shard was stepped: its all-gathers are queued (with replica sharing, the chunks' across
        the replicas first, :meth:`start_replica_gather`; then the owner group's, :meth:`start_gather`)."""
        self._move((ParamState.READY,), ParamState.STEPPED)
        self.gather = None

    def start_replica_gather(self) -> None:
        """With replica sharing: dispatches the all-gather of the shard's chunks across the replicas, which the
        owner group's all-gather follows (Note [replica sharing] in ``layout/sharing.py``)."""
        begin, end = self._shard
        self.replica_gather = collectives.all_gather_chunks(self.data[begin:end], self._chunks,
                                                            self._replica_group, async_op=True)

    def start_gather(self) -> None:
        """Dispatches the owner group's all-gather (the caller waited for :attr:`replica_gather`)."""
        self._move((ParamState.STEPPED,), ParamState.GATHERING)
        self.replica_gather = None
        self.gather = collectives.all_gather_bucket(self.data, self._gather_group, async_op=True)

    def finish_gather(self) -> None:
        """The all-gather landed (the caller waited for :attr:`gather`): every rank holds the new parameters."""
        self._move((ParamState.GATHERING,), ParamState.READY)
        self.gather = None

    # --- sharded parameters (Note [sharded parameters]) ---------------------------------------------------------
    def share_chunks(self) -> None:
        """With replica sharing, after the step: every rank's shard gets the chunks its replicas stepped (Note
        [replica sharing] in ``layout/sharing.py``), so that any rank's shard is current for the next gather."""
        collectives.all_gather_chunks(self.shard, self._chunks, self._replica_group, async_op=False)

    def start_unshard(self) -> None:
        """Allocates the full parameters and dispatches their all-gather from every rank's shard."""
        self._move((ParamState.FREED,), ParamState.GATHERING)
        allocate(self.data)
        self.gather = collectives.all_gather_into(self.data, self.shard, self._gather_group, async_op=True)

    def reshard(self) -> None:
        """Frees the full parameters (the all-gather landed, or this rank's shard changed since)."""
        self._move((ParamState.READY, ParamState.STEPPED, ParamState.FREED), ParamState.FREED)
        free(self.data)

    def abandon(self) -> None:
        """Forgets the all-gathers in flight (after a failed collective). Sharded parameters whose all-gather did
        not land are left freed: nothing of them is held here."""
        lost = self.shard is not None and (self.state is ParamState.GATHERING or not is_allocated(self.data))
        self.gather = self.replica_gather = None
        self.state = ParamState.FREED if lost else ParamState.READY


class Bucket:
    """One planned bucket at run time: what it is (its parameters, its groups, this rank's shard of it) and its two
    parts, :attr:`grad` and :attr:`param`, each with its buffers, its state and its collectives (Note [bucket
    states])."""

    def __init__(self, buffer: int, index: int, params: list[nn.Parameter], param_data: torch.Tensor,
                 grad_data: torch.Tensor, first_param: int, start: int = 0, group: dist.ProcessGroup | None = None,
                 gather_group: dist.ProcessGroup | None = None, shards: int = 1, rank: int = 0, expert: bool = False,
                 chunks: list[tuple[int, int]] | None = None, replica_group: dist.ProcessGroup | None = None,
                 replica_rank: int = 0) -> None:
        self.buffer, self.index = buffer, index
        self.params = params
        self.first_param = first_param
        """Registration index of the earliest parameter in the bucket (forward order key)."""
        self.start = start
        """Its first element in its buffer."""
        self.group, self.gather_group = group, gather_group
        """Group its shards are spread over (reduce-scatter); ``gather_group``: its all-gather communicator."""
        self.shards, self.rank = shards, rank
        """Ranks in ``group``; ``rank``: this rank's shard."""
        self.expert = expert
        """Expert parameters (Note [expert parallelism] in ``engine/process_groups.py``)."""
        self.chunks = chunks
        """Replica sharing (Note [replica sharing] in ``layout/sharing.py``): this rank's shard cut into one range per
        replica (from the shard's start), exchanged over ``replica_group``; ``None``: the rank steps its whole shard."""
        self.replica_group, self.replica_rank = replica_group, replica_rank
        size = grad_data.numel() // shards
        self.shard = rank * size, (rank + 1) * size
        """This rank's shard, as a range of the bucket."""
        begin, end = self.shard
        if chunks is not None:
            begin, end = begin + chunks[replica_rank][0], begin + chunks[replica_rank][1]
        self.stepped_range = begin, end
        """What this rank steps of the bucket (its shard, or its chunk of it), as a range of the bucket."""
        self.grad = BucketGradient(self.name, grad_data, len(params), group, chunks, replica_group, self.shard,
                                   self.stepped_range)
        """Its gradients: buffers, :class:`GradState` and reduce-scatters."""
        self.param = BucketParameters(self.name, param_data, gather_group, chunks, replica_group, self.shard)
        """Its parameters: buffers, :class:`ParamState` and all-gathers."""

    @property
    def name(self) -> str:
        return f"{self.buffer}.{self.index}"

    @property
    def sharded(self) -> bool:
        """Whether only this rank's shard of the parameters is held between uses (Note [sharded parameters])."""
        return self.param.shard is not None

    def abandon(self) -> None:
        """Forgets every collective in flight (after a failed one: waiting would raise its error again)."""
        self.param.abandon()
        self.grad.abandon()


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
            bucket.param.shard = params[position:position + size]
            # Each bucket's gradient shard has storage of its own, freed whenever the gradients are dropped, so
            # that a backward holds the shards of the buckets it reduced so far only (Note [sharded gradients]).
            bucket.grad.shard = torch.zeros(size, dtype=grad_dtype, device=device)
            bucket.grad.data = torch.empty(bp.numel, dtype=grad_dtype, device=device)
            free(bucket.grad.data)
            position += size
        sharded.append(FlatBuffer(params, torch.empty(0, dtype=grad_dtype, device=device)))
    return sharded


def cut_shard(bucket: Bucket, bp, layout: Layout, named: dict[str, nn.Parameter], stepped_whole: set[str],
              full: torch.Tensor) -> None:
    """``full`` holds the bucket's current parameters (every rank alike): this rank's shard is kept, every
    parameter of the bucket is pointed at the shard (those this rank steps whole) or at ``full``, which becomes
    the bucket's full buffer, freed."""
    begin, end = bucket.shard
    bucket.param.shard.copy_(full[begin:end])
    for name in bp.params:
        slot, p = layout.params[name], named[name]
        inside = slot.offset - bp.start
        if name in stepped_whole:
            p.data = view_of(bucket.param.shard, slot, like=p, offset=inside - begin)
        else:
            p.data = view_of(full, slot, like=p, offset=inside)
    bucket.param.data = full
    free(full)
    bucket.param.state = ParamState.FREED


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
