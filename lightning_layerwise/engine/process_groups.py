"""The process groups the data-parallel wrapper talks over, created once and passed explicitly.

There is no module-level group state: whoever builds a :class:`LayerwiseDataParallel`
hands it a :class:`ProcessGroups`. A separate all-gather group (on by default)
lets a bucket's parameter all-gather and another bucket's gradient
reduce-scatter be in flight at the same time, since collectives on one
communicator are serialized. Expert groups are reserved for mixture-of-experts
layouts and are ``None`` until used.

Note [owner groups]
    With ``owner`` set, the data-parallel ranks are split into *owner groups* of
    ``g`` consecutive ranks (``[0, g)``, ``[g, 2g)``…; consecutive ranks share a
    node when ``g`` divides the ranks per node). The layout is planned for ``g``
    ranks: inside its owner group a rank holds the shards it would hold in a world
    of ``g``, and gradients are reduce-scattered and parameters all-gathered inside
    the group, as HSDP does. The ``replica`` group (the ranks at the same position
    in every owner group) holds the same shards and shares their stepping (Note
    [replica sharing] in ``layout/sharing.py``): each shard's gradient is reduced
    across it to the replica that steps it (or reduce-scattered into equal chunks),
    and after the step gathered back across it before the owner group's all-gather. Every matrix's
    Newton–Schulz runs once in the world and the optimizer state is held once.

Note [expert parallelism]
    With ``expert_parallel_size=E`` the ranks are also split into expert-parallel
    groups of ``E`` consecutive ranks (``[0, E)``, ``[E, 2E)``…): the ranks of
    one group hold different experts (position ``r`` holds experts
    ``[r * n/E, (r + 1) * n/E)`` of ``n``) and exchange tokens. The ranks at the
    same position in every group (``r, r + E, r + 2E``…) hold the same experts:
    the expert data-parallel group, over which expert gradients are
    reduce-scattered and expert parameters all-gathered (its own layout and its
    own all-gather communicator), while dense parameters use the data-parallel
    (or owner) group as before. One process holding every expert averages an
    expert's gradient over the whole global batch; here each expert data-parallel
    group sees ``1/(world/E)`` of it per rank position, summed over the ``E`` ranks
    that sent it tokens, so expert gradients are averaged over the expert
    data-parallel group and then divided by ``E``: the mean over all ``world`` ranks.

Note [expert owner groups]
    The expert data-parallel group of position ``i`` (ranks ``i, i + E, i + 2E``…,
    ``D = world / E`` of them) is split as the dense ranks are (Note [owner groups]):
    owner groups of ``ge`` consecutive members (``[0, ge)``, ``[ge, 2ge)``… of the
    group), whose expert buffers are planned for ``ge`` ranks, and replica groups of
    the members at the same position in every owner group, which share the stepping
    of each shard (Note [replica sharing] in ``layout/sharing.py``). A member's rank in the
    expert data-parallel group is then ``replica * ge + position``, the owner index of
    its expert pieces.

Note [splitting groups]
    ``dist.new_group`` must be called by every rank for every group, in the same order,
    and each call is a store round-trip over the world: at 1024 ranks with owner groups
    of 8, set-up made 265 such calls (``test_cross_group_collectives.py`` counts them).
    Where torch has ``dist.split_group`` and the default group is bound to a device
    (``init_process_group(..., device_id=...)``, which Lightning's strategies pass on GPUs
    with torch >= 2.3; NCCL then splits communicators with ``ncclCommSplit`` instead of
    building each from scratch), each family of disjoint groups (the owner groups, their all-gather
    communicators, the replica groups…) is one ``split_group`` call: 4 at that scale.
    Whether the backend splits is asked of it (``supports_splitting``: NCCL yes, gloo
    no); an unbound default group cannot be split, nor a ``backend`` other than the
    default's; those keep one ``new_group`` per group.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist
from torch.distributed import ProcessGroup

from . import collectives


@dataclass(frozen=True)
class ProcessGroups:
    """Groups for dense (and later expert) data parallelism.

    ``None`` for a group means "no communication": a single process. Note [owner groups],
    Note [expert parallelism] and Note [expert owner groups] (the module's docstring) explain them.
    """

    dp: ProcessGroup | None
    """Every data-parallel rank: broadcasts, cross-rank checks and agreements."""
    dp_all_gather: ProcessGroup | None
    """The owner group's ranks (every data-parallel rank without owner groups) on a
    communicator of their own: parameter all-gathers. May be the owner group itself."""
    expert_dp: ProcessGroup | None = None
    """Expert data-parallel group (Note [expert parallelism]): the ranks holding the same experts;
    expert gradients are reduce-scattered over it. ``None``: experts are replicated like dense parameters."""
    expert_dp_all_gather: ProcessGroup | None = None
    """The expert data-parallel ranks on a communicator of their own: expert parameter all-gathers."""
    expert_parallel: ProcessGroup | None = None
    """Expert-parallel group: the ranks holding different experts, between which an MoE layer
    exchanges tokens. ``None``: no expert parallelism."""
    owner: ProcessGroup | None = None
    """The owner group (Note [owner groups]); ``None``: ``dp`` is the owner group."""
    replica: ProcessGroup | None = None
    """The ranks holding the same shards in the other owner groups; ``None``: one owner group."""
    expert_owner: ProcessGroup | None = None
    """Owner groups inside the expert data-parallel group (Note [expert owner groups]); ``None``: ``expert_dp``."""
    expert_owner_all_gather: ProcessGroup | None = None
    """The expert owner group on a communicator of its own: expert parameter all-gathers."""
    expert_replica: ProcessGroup | None = None
    """The expert data-parallel ranks holding the same expert shards in the other expert owner groups."""

    @property
    def dp_size(self) -> int:
        return 1 if self.dp is None else dist.get_world_size(self.dp)

    @property
    def owner_group(self) -> ProcessGroup | None:
        """The group gradients are reduce-scattered over and shards are owned in."""
        return self.owner if self.owner is not None else self.dp

    @property
    def owner_group_size(self) -> int:
        group = self.owner_group
        return 1 if group is None else dist.get_world_size(group)

    @property
    def owner_rank(self) -> int:
        """This rank's position in its owner group: the shard it owns."""
        group = self.owner_group
        return 0 if group is None else dist.get_rank(group)

    @property
    def replica_rank(self) -> int:
        """Which owner group this rank is in (0 without owner groups)."""
        return 0 if self.replica is None else dist.get_rank(self.replica)

    @property
    def expert_parallel_size(self) -> int:
        return 1 if self.expert_parallel is None else dist.get_world_size(self.expert_parallel)

    @property
    def expert_parallel_rank(self) -> int:
        """Which experts this rank holds: position ``r`` holds experts ``[r * n/E, (r + 1) * n/E)``."""
        return 0 if self.expert_parallel is None else dist.get_rank(self.expert_parallel)

    @property
    def expert_group(self) -> ProcessGroup | None:
        """The group expert gradients are reduced over: ``expert_dp``, or the owner group without expert parallelism."""
        return self.expert_dp if self.expert_parallel is not None else self.owner_group

    @property
    def expert_owner_group(self) -> ProcessGroup | None:
        """The group expert gradients are reduce-scattered over and expert shards are owned in."""
        return self.expert_owner if self.expert_owner is not None else self.expert_dp

    @property
    def expert_group_size(self) -> int:
        group = self.expert_owner_group
        return 1 if group is None else dist.get_world_size(group)

    @property
    def expert_replica_rank(self) -> int:
        return 0 if self.expert_replica is None else dist.get_rank(self.expert_replica)

    @property
    def separate_all_gather(self) -> bool:
        return self.dp_all_gather is not None and self.dp_all_gather is not self.owner_group

    def destroy(self) -> None:
        """Destroys the groups (each once), so no communicator or thread outlives its training run; what was
        probed of them (Note [averaging] in ``engine/collectives.py``) goes with them.

        For groups made by :meth:`create`; the caller must not use them afterwards.
        Every rank calls it after its last collective on them.
        """
        seen = []
        for group in (self.dp_all_gather, self.replica, self.owner, self.dp, self.expert_owner_all_gather,
                      self.expert_replica, self.expert_owner, self.expert_dp_all_gather, self.expert_dp,
                      self.expert_parallel):
            if group is not None and all(group is not g for g in seen):
                seen.append(group)
                collectives.forget_probes(group)
                if dist.is_initialized():
                    dist.destroy_process_group(group)

    @classmethod
    def single(cls) -> "ProcessGroups":
        """No communication: the wrapper behaves like a plain module on one process."""
        return cls(dp=None, dp_all_gather=None)

    @classmethod
    def create(
        cls,
        separate_all_gather: bool = True,
        backend: str | None = None,
        timeout: timedelta | None = None,
        owner_group_size: int | None = None,
        expert_parallel_size: int = 1,
        expert_group_size: int | None = None,
        tensor_parallel_size: int = 1,
    ) -> "ProcessGroups":
        """Groups over every rank of the initialized default group, or with ``tensor_parallel_size=T`` over the
        data-parallel ranks of this rank's tensor-parallel position (Note [tensor-parallel mesh] in
        ``engine/tensor_parallel.py``): each group is then made once per position.

        ``owner_group_size``: ``g`` dividing the world size splits it into owner groups
        of ``g`` consecutive ranks (Note [owner groups]); ``None`` or the world size:
        one owner group. ``expert_group_size``: the same inside each expert data-parallel group
        (Note [expert owner groups]); ``None``: one. Collective: every rank must call it, in the same order
        relative to other group creations. Without an initialized default group (or
        with one rank) returns :meth:`single`.
        """
        if not dist.is_available() or not dist.is_initialized():
            return cls.single()
        T = tensor_parallel_size
        if dist.get_world_size() % T:
            raise ValueError(f"tensor_parallel_size={T} does not divide the {dist.get_world_size()} ranks.")
        if T > 1 and expert_parallel_size > 1:
            raise ValueError("expert parallelism together with tensor parallelism is not supported yet.")
        world, rank = dist.get_world_size() // T, dist.get_rank() // T  # the data-parallel ranks; this one's place
        if world == 1:
            return cls.single()
        kwargs = {"backend": backend, "timeout": timeout, "positions": T, "position": dist.get_rank() % T}
        g = world if owner_group_size is None else owner_group_size
        if isinstance(g, bool) or not isinstance(g, int) or g < 1 or world % g:
            raise ValueError(f"owner group size {owner_group_size!r} does not divide the {world} data-parallel "
                             f"ranks; pass a divisor of {world} (e.g. the GPUs per node), or None for one group.")
        E = expert_parallel_size
        if isinstance(E, bool) or not isinstance(E, int) or E < 1 or world % E:
            raise ValueError(f"expert_parallel_size={expert_parallel_size!r} does not divide the {world} ranks; pass "
                             f"a divisor of {world}, or 1 for no expert parallelism.")
        D = world // E
        ge = D if expert_group_size is None else expert_group_size
        if E > 1 and (isinstance(ge, bool) or not isinstance(ge, int) or ge < 1 or D % ge):
            raise ValueError(f"expert_group_size={expert_group_size!r} does not divide the {D} expert "
                             f"data-parallel ranks; pass a divisor of {D}, or None for one group.")
        everyone = [list(range(world))]
        dp = _partition(everyone, rank, kwargs)
        experts = cls._expert_groups(world, rank, E, separate_all_gather, kwargs, ge) if E > 1 else {}
        if g == world:
            all_gather = _partition(everyone, rank, kwargs) if separate_all_gather else dp
            return cls(dp=dp, dp_all_gather=all_gather, **experts)
        owners = [list(range(k * g, (k + 1) * g)) for k in range(world // g)]
        owner = _partition(owners, rank, kwargs)
        all_gather = _partition(owners, rank, kwargs) if separate_all_gather else owner
        replica = _partition([list(range(i, world, g)) for i in range(g)], rank, kwargs)
        return cls(dp=dp, dp_all_gather=all_gather, owner=owner, replica=replica, **experts)

    @staticmethod
    def _expert_groups(world: int, rank: int, E: int, separate_all_gather: bool, kwargs: dict, ge: int) -> dict:
        """Expert-parallel groups of ``E`` consecutive ranks and the strided expert data-parallel groups
        (Note [expert parallelism]), and inside those the expert owner and replica groups of
        ``ge`` (Note [expert owner groups]). Every rank takes part in creating every group.
        """
        out: dict = {}
        out["expert_parallel"] = _partition([list(range(k * E, (k + 1) * E)) for k in range(world // E)], rank,
                                            kwargs)
        strided = [list(range(i, world, E)) for i in range(E)]
        out["expert_dp"] = _partition(strided, rank, kwargs)
        out["expert_dp_all_gather"] = _partition(strided, rank, kwargs) if separate_all_gather else out["expert_dp"]
        D = world // E
        if ge == D:
            return out
        owners = [members[k * ge:(k + 1) * ge] for members in strided for k in range(D // ge)]
        out["expert_owner"] = _partition(owners, rank, kwargs)
        out["expert_owner_all_gather"] = (_partition(owners, rank, kwargs) if separate_all_gather
                                          else out["expert_owner"])
        out["expert_replica"] = _partition([members[j::ge] for members in strided for j in range(ge)], rank, kwargs)
        return out


def can_split(kwargs: dict) -> bool:
    """Whether groups can be split from the default group (Note [splitting groups]): torch has ``dist.split_group``,
    the default group is bound to a device (``init_process_group(device_id=...)``), its backend for that device
    says it supports splitting (NCCL does, gloo not), and no other backend is asked for."""
    if not hasattr(dist, "split_group") or kwargs.get("backend") is not None:
        return False
    default = dist.group.WORLD
    device = getattr(default, "bound_device_id", None)
    if device is None:
        return False
    try:
        backend = default._get_backend(device)
    except (RuntimeError, ValueError, AttributeError):  # no backend for that device
        return False
    return bool(getattr(backend, "supports_splitting", False))


def _partition(parts: list[list[int]], rank: int, kwargs: dict) -> dist.ProcessGroup | None:
    """The group of ``parts`` (disjoint lists of ranks) that holds ``rank`` (Note [splitting groups]): one
    ``split_group`` call where :func:`can_split`, else one ``new_group`` per part, every rank taking part in
    creating every group (torch requires it)."""
    T, position = kwargs.get("positions", 1), kwargs.get("position", 0)
    if T > 1:  # the same parts in every tensor-parallel position t: data-parallel rank d is rank d * T + t
        parts = [[d * T + t for d in ranks] for t in range(T) for ranks in parts]
        rank = rank * T + position
    kwargs = {k: v for k, v in kwargs.items() if k in ("backend", "timeout")}
    if can_split(kwargs):
        return dist.split_group(split_ranks=parts, timeout=kwargs.get("timeout"))
    mine = None
    for ranks in parts:
        group = dist.new_group(ranks, **kwargs)
        if rank in ranks:
            mine = group
    return mine


@dataclass(frozen=True)
class Ranks:
    """Where this rank sits in a :class:`ProcessGroups`: the sizes and positions the layout and the buckets use."""

    dp_size: int
    dp_rank: int
    owner_group_size: int
    """Ranks in an owner group (Note [owner groups]); ``owner_rank``: this rank's position in it."""
    owner_rank: int
    replicas: int
    """Owner groups that share each shard's stepping (Note [replica sharing] in ``layout/sharing.py``)."""
    layout_rank: int
    """Which dense pieces this rank steps: ``replica * g + position`` (the position without replicas)."""
    expert_parallel_size: int = 1
    expert_dp_rank: int = 0
    """Position in the expert data-parallel group (``owner_rank`` without expert parallelism)."""
    expert_group_size: int | None = None
    """Ranks of an expert owner group (Note [expert owner groups]); ``None`` without expert parallelism."""
    expert_owner_rank: int = 0
    expert_replicas: int = 1

    @classmethod
    def of(cls, groups: "ProcessGroups") -> "Ranks":
        replicas = groups.dp_size // groups.owner_group_size if groups.replica is not None else 1
        dp_rank = 0 if groups.dp is None else dist.get_rank(groups.dp)
        common = dict(dp_size=groups.dp_size, dp_rank=dp_rank, owner_group_size=groups.owner_group_size,
                      owner_rank=groups.owner_rank, replicas=replicas,
                      layout_rank=groups.replica_rank * groups.owner_group_size + groups.owner_rank,
                      expert_parallel_size=groups.expert_parallel_size)
        if groups.expert_parallel is None:
            return cls(**common, expert_dp_rank=groups.owner_rank)
        expert_dp_size = dist.get_world_size(groups.expert_dp)
        return cls(**common, expert_dp_rank=dist.get_rank(groups.expert_dp),
                   expert_group_size=groups.expert_group_size,
                   expert_owner_rank=dist.get_rank(groups.expert_owner_group),
                   expert_replicas=expert_dp_size // groups.expert_group_size)
