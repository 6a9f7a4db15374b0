"""Reads of sharded parameters that gather as collectives, and failing together.

Note [collective reads]
    With sharded parameters a read of a freed bucket can only be served by an all-gather, and an
    all-gather only if every rank issues it (Note [sharded reads] in ``engine/sharded.py``). Where a
    front end knows that every rank runs the same code (Lightning's hooks under the Trainer), a read
    is taken for a collective, but a read made on some ranks only (``if trainer.is_global_zero``) or
    in another order would pair its all-gather with whatever collective the other ranks issue next
    (gloo may not even notice), or wait for ever. So before such a gather the ranks agree on it: each
    contributes the bucket's index and a checksum of where it reads (the hook) to an all-gather on a
    gloo group of their own (:class:`ReadAgreement`, made when the model is wrapped), on which nothing
    else runs. All equal: every rank is at the same read, and the bucket is gathered on its usual
    group. Different: every rank raises, naming the reads. A rank reading alone waits in the agreement,
    never in a collective of the model's groups, while the others block in their next collective,
    which waits for it. The agreeing rank watches them (Note [failing together]): once every rank has
    been blocked for :data:`DEADLOCK_SECONDS`, some in the agreement and some elsewhere, none can move
    on and it raises; after :data:`AGREEMENT_SECONDS` it raises whatever the others do (a rank blocked
    in a collective that is not the package's, Lightning's logging all-reduce say, is not seen blocked).

Note [failing together]
    A read error raised on one rank must end the job on every rank, with that error, not with a
    closed connection or a wait for a collective the failed rank will never issue. The
    :class:`FailureBoard` is a few keys in the default group's store, under a prefix of this run:
    a rank that raises posts its error there; a wait of the package's collectives (``Waiter.wait``, on
    CPU tensors) that has blocked for :data:`WATCH_SECONDS` counts itself blocked and looks at the
    board every :data:`POLL_SECONDS`, and raises an error posted since it last looked, as
    :class:`ShardedParameterReadError`. The poster waits up to :data:`ACK_SECONDS` for every rank to
    have seen it before it raises, so that the store (rank 0's process) outlives the reading. A rank
    that raises counts as having seen every error posted until then, and until its next collective
    completes it raises no other rank's: ranks that all raise at the same read and catch it go on,
    whichever posts first. Nothing of this runs while collectives complete within
    :data:`WATCH_SECONDS`. GPU waits are not watched (a timed wait on NCCL blocks the CPU thread);
    there the other ranks stop at the collective timeout.
"""

from __future__ import annotations

import contextlib
import itertools
import time
import zlib
from datetime import timedelta

import torch
import torch.distributed as dist

from . import collectives

WATCH_SECONDS = 1.0
"""A wait blocked this long counts itself blocked and starts looking at the board (Note [failing together])."""
POLL_SECONDS = 0.25
"""How often a blocked wait looks at the board."""
DEADLOCK_SECONDS = 5.0
"""Every rank blocked, unchanged for this long, some in a read's agreement: a read not every rank makes."""
AGREEMENT_SECONDS = 30.0
"""The longest a rank waits in a read's agreement for the other ranks (Note [collective reads])."""
ACK_SECONDS = 5.0
"""The longest a rank that raises waits for the others to have seen its error."""

_RUNS = itertools.count()  # wraps in this process: the same sequence on every rank (wrapping is collective)


class ShardedParameterReadError(RuntimeError):
    """A sharded parameter was read where it cannot be gathered (Note [sharded reads] in ``engine/sharded.py``)."""


class ReadNotShared(Exception):
    """A read's agreement failed: ``rows`` (every rank's bucket index and place) differ, or the other ranks did
    not come within ``waited`` seconds. Turned into :class:`ShardedParameterReadError` by the caller."""

    def __init__(self, rows: list[tuple[int, int]] | None = None, waited: float = 0.0) -> None:
        super().__init__(rows, waited)
        self.rows, self.waited = rows, waited


def wait_for(work, seconds: float) -> bool:
    """Waits up to ``seconds`` for ``work``; whether it completed. A failed collective raises its error."""
    try:
        work.wait(timedelta(seconds=seconds))
    except TypeError:  # a handle that cannot wait for a while: it waits until done
        work.wait()
    except RuntimeError:
        if work.is_completed():
            raise
        return False
    return True


class FailureBoard:
    """Errors and blocked waits of one run, shared through the store (Note [failing together])."""

    def __init__(self, store, rank: int, world: int) -> None:
        self.store, self.rank, self.world = store, rank, world
        self.seen = 0
        """Errors posted that this rank raised or has seen."""
        self.raised = False
        """Whether this rank posted an error since its last collective completed (it raised, and went on)."""
        self._stable: tuple[int, float] | None = None  # (changes, since when) while every rank looks blocked

    @classmethod
    def open(cls) -> "FailureBoard | None":
        """The board of a new run on the default group (collective: every rank calls it as it wraps a model);
        ``None`` without a group of several ranks or a store."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return None
        try:
            store = dist.distributed_c10d._get_default_store()
        except (AttributeError, RuntimeError, ValueError):
            return None
        prefix = f"lightning_layerwise/run{next(_RUNS)}/"
        return cls(dist.PrefixStore(prefix, store), dist.get_rank(), dist.get_world_size())

    # --- errors ---------------------------------------------------------------------------------------------------
    def post(self, message: str) -> None:
        """Posts this rank's error and waits, up to :data:`ACK_SECONDS`, until every rank has seen it."""
        self.raised = True
        try:
            index = self.store.add("errors", 1)
            self.store.set(f"error/{index}", f"{self.rank}\n{message}")
            deadline = time.monotonic() + ACK_SECONDS
            while True:
                # Every rank's mark first, then the errors posted: a rank raising at the same read posts its own
                # error before it marks this one seen, so this rank sees that error too before it goes on
                # (read the other way round, one posted in between was left for a later wait to raise).
                acknowledged = self.store.add(f"seen/{index}", 0) >= self.world
                self._see(self.store.add("errors", 0))  # also the errors other ranks post meanwhile
                if acknowledged or time.monotonic() > deadline:
                    return
                time.sleep(0.02)
        except RuntimeError:  # the store is gone (rank 0 ended; DistError is a RuntimeError): nothing to wait for
            return

    def unseen(self) -> str | None:
        """An error posted since this rank last looked, marked seen, as ``(rank) message``; else ``None``."""
        try:
            posted = self.store.add("errors", 0)
            if posted <= self.seen:
                return None
            rank, _, message = self.store.get(f"error/{self.seen + 1}").decode().partition("\n")
            self._see(posted)
        except RuntimeError:
            return None
        return f"{message}\n(raised on rank {rank}; rank {self.rank} waited for a collective it will not issue)"

    def _see(self, posted: int) -> None:
        for index in range(self.seen + 1, posted + 1):
            self.store.add(f"seen/{index}", 1)
        self.seen = max(self.seen, posted)

    # --- blocked waits --------------------------------------------------------------------------------------------
    def wait(self, work, agreeing: bool = False) -> None:
        """Waits for ``work``, raising an error another rank posted meanwhile; in a read's agreement
        (``agreeing``), also :class:`ReadNotShared` when it cannot complete (Note [collective reads])."""
        if not wait_for(work, WATCH_SECONDS):
            self._wait_blocked(work, agreeing)
        self.raised = False

    def _wait_blocked(self, work, agreeing: bool) -> None:
        start = time.monotonic() - WATCH_SECONDS
        with self._blocked(agreeing):
            while not wait_for(work, POLL_SECONDS):
                message = self.unseen()
                if message is not None and not self.raised:  # else the same failure, which this rank went past
                    raise ShardedParameterReadError(message)
                waited = time.monotonic() - start
                if agreeing and (waited >= AGREEMENT_SECONDS or self._deadlocked()):
                    raise ReadNotShared(waited=waited)

    @contextlib.contextmanager
    def _blocked(self, agreeing: bool):
        keys = ("blocked", "agreeing") if agreeing else ("blocked",)
        self._count(keys, +1)
        try:
            yield
        finally:
            self._count(keys, -1)

    def _count(self, keys: tuple[str, ...], step: int) -> None:
        try:
            for key in keys:
                self.store.add(key, step)
            self.store.add("changes", 1)
        except RuntimeError:
            pass

    def _deadlocked(self) -> bool:
        """Every rank blocked, some agreeing and some not, with no change for :data:`DEADLOCK_SECONDS`."""
        try:
            blocked, agreeing, changes = (self.store.add(k, 0) for k in ("blocked", "agreeing", "changes"))
        except RuntimeError:
            return False
        if not (blocked >= self.world and 0 < agreeing < self.world):
            self._stable = None
            return False
        now = time.monotonic()
        if self._stable is None or self._stable[0] != changes:
            self._stable = (changes, now)
        return now - self._stable[1] >= DEADLOCK_SECONDS


class ReadAgreement:
    """Every rank's agreement before a read gathers a bucket on demand (Note [collective reads])."""

    def __init__(self, group, board: FailureBoard) -> None:
        self.group, self.board = group, board

    @classmethod
    def create(cls, board: FailureBoard | None, timeout: timedelta | None) -> "ReadAgreement | None":
        """A gloo group of every rank for the agreements (collective); ``None`` without a board."""
        if board is None:
            return None
        kwargs = {"timeout": timeout} if timeout is not None else {}
        return cls(dist.new_group(backend="gloo", **kwargs), board)

    def agree(self, bucket_index: int, where: str) -> None:
        """Returns when every rank reads ``bucket_index`` at ``where``; raises :class:`ReadNotShared` otherwise,
        or :class:`ShardedParameterReadError` with another rank's error."""
        mine = torch.tensor([bucket_index, zlib.crc32(where.encode())], dtype=torch.int64)
        rows = torch.empty(self.board.world * 2, dtype=torch.int64)
        gathered = collectives.all_gather_into(rows, mine, self.group, async_op=True)
        self.board.wait(gathered.work, agreeing=True)
        gathered.wait()
        pairs = [tuple(r) for r in rows.view(-1, 2).tolist()]
        if any(p != pairs[0] for p in pairs):
            raise ReadNotShared(rows=pairs)

    def destroy(self) -> None:
        """Ends the group (local; an agreement left waiting after a failure is abandoned; gone already if the
        default group was destroyed first)."""
        if dist.is_initialized():
            dist.destroy_process_group(self.group)

