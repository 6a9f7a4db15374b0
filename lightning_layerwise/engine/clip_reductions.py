"""The reductions over the ranks of a reduced gradient held in shards: its norms, its finite check, and the votes
on the list of parameters a norm is given.

:func:`shard_sum` counts each element of the reduced gradient once (Note [norm from shards] in
``engine/clip.py``), and :class:`ParameterLists` resolves a list of parameters to what this rank steps
of them and votes on the list, the votes summed in the norm's one all-reduce (Note [parameter lists]
in ``engine/clip.py``); :func:`all_finite` checks the same shards. The gradient side
(``engine/grad_sync.py``) owns a :class:`ParameterLists` and calls the functions with its shards; the
functions in ``engine/clip.py`` use them through the wrapper.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch

from . import collectives

if TYPE_CHECKING:
    from .grad_records import GradUnit
    from .param_records import ParamRecord, ParamRecords
    from .waiter import Waiter

__all__ = ["ParameterLists", "all_finite", "shard_sum"]


def all_finite(shards: Iterable[torch.Tensor], device: torch.device, dp_group) -> bool:
    """Whether every rank's ``shards`` of the reduced gradient are finite (one all-reduce over ``dp_group``).

    Each rank checks its own shards (every gradient element lies in exactly one), so all ranks return the same
    verdict.
    """
    bad = torch.zeros((), dtype=torch.float32, device=device)
    for shard in shards:
        bad = torch.maximum(bad, (~torch.isfinite(shard)).any().float())
    collectives.all_reduce_max(bad, dp_group)
    return not bool(bad.item())


def shard_sum(parts: Iterable[tuple[torch.Tensor, bool]], fn: Callable[[torch.Tensor], torch.Tensor],
              device: torch.device, layout_group, dp_group, expert_parallel_size: int, waiter: Waiter,
              extra: torch.Tensor | None = None) -> torch.Tensor:
    """``fn`` (a float32 scalar per tensor) summed over ``parts``, this rank's ``(tensor, is_expert)`` of the
    reduced gradient, and over the ranks: the sum over the whole reduced gradient, once per element.

    Each owner group holds the dense gradient once (with replica sharing, the world does: each
    element in the chunk of one rank), so dense parts are summed over ``layout_group``; each expert
    element lies in the shard of one rank of its expert data-parallel group, and those groups cover
    every rank, so expert parts are summed over ``dp_group``. ``extra`` (float32, on ``device``) is
    summed over the data-parallel group in the same all-reduce, in place. Collective (one all-reduce,
    two with expert parallelism).
    """
    # timed as "norm_all_reduce" (Note [timing communication waits] in ``engine/waiter.py``)
    t0 = time.perf_counter()
    dense = torch.zeros((), dtype=torch.float32, device=device)
    expert = torch.zeros((), dtype=torch.float32, device=device)
    for tensor, is_expert in parts:
        value = fn(tensor).to(device)
        if is_expert:
            expert += value
        else:
            dense += value
    # the layout group spans the data-parallel group (Note [replica sharing] in ``layout/sharing.py``)
    if extra is not None:
        payload = collectives.all_reduce_sum(torch.cat([dense.reshape(1), extra]), layout_group)
        dense = payload[0]
        extra.copy_(payload[1:])
    else:
        collectives.all_reduce_sum(dense, layout_group)
    if expert_parallel_size > 1:
        collectives.all_reduce_sum(expert, dp_group)
        dense += expert
    if waiter.seconds is not None:
        waiter.add("norm_all_reduce", t0)
    return dense


class ParameterLists:
    """The lists of parameters a norm is given: what this rank steps of each, and the votes that check the lists
    agree across ranks, with a verdict not read yet (Note [parameter lists] in ``engine/clip.py``).

    Args:
        records: every layout parameter's record, in layout order (the same on every rank): what this rank steps
            of it, whether it is an expert one (those are not voted on: each expert-parallel rank holds other
            experts under the same names).
        device: the device the votes are summed on (the gradient buffers').
    """

    def __init__(self, records: ParamRecords, device: Callable[[], torch.device]) -> None:
        self._records, self._device = records, device
        self._voters: list[ParamRecord] | None = None
        self._holds_mask: torch.Tensor | None = None
        self._verdict = None  # a verdict left on an accelerator, not read yet: (bad, verdict, landed, what)

    def units_of(self, tensors) -> list[GradUnit]:
        """What this rank steps of ``tensors`` (parameters, pieces or masters; each unit once, in list order)."""
        return self._units_listed(tensors)[0]

    def _units_listed(self, tensors) -> tuple[list[GradUnit], set]:
        units, seen, listed = [], set(), set()
        for t in tensors:
            record = self._records.of(t)
            if record is None:
                continue
            listed.add(record.param)
            unit = record.unit
            if unit is not None and id(unit) not in seen:
                seen.add(id(unit))
                units.append(unit)
        return units, listed

    def units_and_votes(self, tensors) -> tuple[list[GradUnit], torch.Tensor]:
        """:meth:`units_of` ``tensors`` and this rank's vote on the list, to be summed (or maximized) over the
        data-parallel group and read by :meth:`check_votes`."""
        units, listed = self._units_listed(tensors)
        voters = self._list_voters()
        listed_mask = torch.tensor([r.param in listed for r in voters], dtype=torch.bool)
        holds = self._holds_mask
        # row 0: this rank holds the parameter's gradient and left it out; row 1: this rank named it
        votes = torch.cat([holds & ~listed_mask, listed_mask]).float()
        return units, votes.to(self._device())

    def check_votes(self, votes: torch.Tensor, what: str) -> None:
        """Raises, on every rank alike, if the summed votes of :meth:`units_and_votes` show a parameter named on
        some ranks and left out by a rank that holds its gradient.

        On CPU at once. On an accelerator the verdict is copied to the host without waiting and read at the next
        call, or at :meth:`resolve_votes`: reading it now would stop the host until the step's backward and this
        all-reduce ran, every step, for a check that nearly always passes.
        """
        self.resolve_votes()
        n = len(self._list_voters())
        if n == 0:
            return
        bad = (votes[:n] > 0) & (votes[n:] > 0)
        if bad.device.type == "cpu":
            self._raise_for_votes(bad, what)
            return
        verdict = torch.empty((), dtype=torch.bool, pin_memory=True)
        verdict.copy_(bad.any(), non_blocking=True)
        landed = torch.cuda.Event()
        landed.record()
        self._verdict = (bad, verdict, landed, what)

    def resolve_votes(self) -> None:
        """Reads a verdict :meth:`check_votes` left on an accelerator, raising as it would have."""
        pending, self._verdict = self._verdict, None
        if pending is not None:
            bad, verdict, landed, what = pending
            landed.synchronize()  # the last call's work only: long done by the next one
            if bool(verdict):
                self._raise_for_votes(bad, what)

    def discard_votes(self) -> None:
        """Forgets a verdict not read yet (the wrapper is released without waiting)."""
        self._verdict = None

    def _raise_for_votes(self, bad: torch.Tensor, what: str) -> None:
        wrong = bad.nonzero().flatten().tolist()
        if not wrong:
            return
        voters = self._list_voters()
        names = [voters[i].name for i in wrong[:3]]
        raise ValueError(
            f"{what} was given different parameters on different ranks: {names}{' and more' if len(wrong) > 3 else ''} "
            "are in the list on some ranks but left out on a rank that holds their gradient. Under "
            "strategy='layerwise' a rank holds the reduced gradient only of what it steps, so the list must name "
            "the same parameters on every rank: model.parameters(), a fixed part such as "
            "model.decoder.parameters(), or either filtered by `p.grad is not None` (which this strategy keeps "
            "consistent).")

    def _list_voters(self) -> list[ParamRecord]:
        """The records of the layout parameters a list is voted on, in layout order (the same on every rank): the
        dense ones; an expert parameter is a different tensor on each expert-parallel rank."""
        voters = self._voters
        if voters is None:
            voters = [r for r in self._records if not r.bucket.expert]
            self._voters = voters
            self._holds_mask = torch.tensor([r.unit is not None for r in voters], dtype=torch.bool)
        return voters
