"""The process groups the data-parallel wrapper talks over, created once and passed explicitly.

There is no module-level group state: whoever builds a :class:`LayerwiseDataParallel`
hands it a :class:`ProcessGroups`. A separate all-gather group (on by default)
lets a bucket's parameter all-gather and another bucket's gradient
reduce-scatter be in flight at the same time, since collectives on one
communicator are serialized. Expert groups are reserved for mixture-of-experts
layouts and are ``None`` until used.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist
from torch.distributed import ProcessGroup


@dataclass(frozen=True)
class ProcessGroups:
    """Groups for dense (and later expert) data parallelism.

    ``None`` for a group means "no communication": a single process.
    """

    dp: ProcessGroup | None
    """Dense data-parallel group: gradient reduce-scatter, norms, broadcasts."""
    dp_all_gather: ProcessGroup | None
    """Same ranks as ``dp``; parameter all-gathers. May be ``dp`` itself."""
    expert_dp: ProcessGroup | None = None
    expert_dp_all_gather: ProcessGroup | None = None

    @property
    def dp_size(self) -> int:
        return 1 if self.dp is None else dist.get_world_size(self.dp)

    @property
    def dp_rank(self) -> int:
        return 0 if self.dp is None else dist.get_rank(self.dp)

    @property
    def separate_all_gather(self) -> bool:
        return self.dp_all_gather is not None and self.dp_all_gather is not self.dp

    def destroy(self) -> None:
        """Destroys the groups (each once), so no communicator or thread outlives its training run.

        For groups made by :meth:`create`; the caller must not use them afterwards.
        Every rank calls it after its last collective on them.
        """
        seen = []
        for group in (self.dp_all_gather, self.dp, self.expert_dp_all_gather, self.expert_dp):
            if group is not None and all(group is not g for g in seen) and dist.is_initialized():
                seen.append(group)
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
    ) -> "ProcessGroups":
        """Groups over every rank of the initialized default group.

        Collective: every rank must call it, in the same order relative to other
        group creations. Without an initialized default group (or with one rank)
        returns :meth:`single`.
        """
        if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
            return cls.single()
        ranks = list(range(dist.get_world_size()))
        kwargs = {"backend": backend, "timeout": timeout}
        dp = dist.new_group(ranks, **kwargs)
        all_gather = dist.new_group(ranks, **kwargs) if separate_all_gather else dp
        return cls(dp=dp, dp_all_gather=all_gather)
