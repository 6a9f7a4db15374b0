"""Waiting for the engine's collectives: one object that both sides of the engine share.

Note [timing communication waits]
    :attr:`Waiter.seconds` (``wrapper.grad_sync.waiter.seconds``) is ``None`` by
    default and then nothing is timed (one ``is None`` test per wait). Setting it to a
    dict (``wrapper.grad_sync.waiter.seconds = {}``) makes every wait of the wrapper add its
    wall-clock seconds under ``"reduce_scatter"``, ``"all_gather"`` or
    ``"norm_all_reduce"`` (the synchronous all-reduce of ``GradientSync.shard_sum``,
    behind every gradient norm): the time this process was blocked on communication that
    compute did not hide. On CUDA a ``wait()`` only orders streams, so host wall time
    there does not measure exposed communication.
"""

from __future__ import annotations

import time

from .collective_reads import FailureBoard, ShardedParameterReadError
from .collectives import Collective


class CollectiveError(RuntimeError):
    """A collective of the wrapper failed: usually another rank died or hung (the message names the phase)."""


PHASES = {
    "reduce_scatter": "gradient reduce-scatter (end of backward)",
    "split_flags": "all-reduce of which split parameters got a gradient (end of backward)",
    "replica_reduce_scatter": "gradient reduce-scatter across owner groups (end of backward)",
    "replica_all_gather": "parameter all-gather across owner groups (before the owner group's all-gather)",
    "all_gather": "parameter all-gather (forward pre-hook, a parameter read, or a sync before eval/checkpoint)",
}
"""What each kind of wait is, in the words of a :class:`CollectiveError`."""


class Waiter:
    """Waits for collectives: a failure names its phase and this rank; the waits may be timed (Note [timing
    communication waits]) and the collective events traced (``events``, for tests and debugging)."""

    def __init__(self, rank: int, size: int, trace: bool = False) -> None:
        self.rank, self.size = rank, size
        self.seconds: dict[str, float] | None = None
        """Seconds blocked in waits, by kind; ``None``: not timed."""
        self.events: list[tuple[str, str]] | None = [] if trace else None
        """``(event, bucket name)`` in the order they happened; ``None``: not traced."""
        self.board: FailureBoard | None = None
        """Where another rank's error is read while a wait blocks (Note [failing together] in
        ``engine/collective_reads.py``); ``None``: waits block until the collective ends."""

    def wait(self, collective: Collective, kind: str) -> None:
        """Waits for ``collective``, timed under ``kind`` if requested.

        A failed collective (a dead or hung rank) raises :class:`CollectiveError` naming the
        phase, chained to the backend's error (which names the peer's address, not its rank).
        With a :attr:`board`, a wait on CPU tensors that blocks raises the error another rank
        posted, as :class:`ShardedParameterReadError`, and so does a collective that failed after
        one was posted (Note [failing together] in ``engine/collective_reads.py``).
        """
        t0 = time.perf_counter() if self.seconds is not None else 0.0
        try:
            board = self.board
            if board is not None and collective.pending and not collective.output.is_cuda:
                board.wait(collective.work)  # Note [failing together] in engine/collective_reads.py
            collective.wait()
        except ShardedParameterReadError:
            raise
        except RuntimeError as error:
            posted = self.board.unseen() if self.board is not None else None
            if posted is not None:  # the rank that left posted why
                raise ShardedParameterReadError(posted) from error
            phase = PHASES.get(kind, kind)
            raise CollectiveError(
                f"the {phase} failed on rank {self.rank} of {self.size}: another rank died, hung past the "
                f"collective timeout, or left the job ({type(error).__name__}: {str(error)[:300]}). Check the other "
                "ranks' logs for the first error; resume from the last checkpoint.") from error
        if self.seconds is not None:
            self.add(kind, t0)

    def add(self, kind: str, t0: float) -> None:
        """Adds the seconds since ``t0`` (``time.perf_counter()``) under ``kind``; only while timing."""
        self.seconds[kind] = self.seconds.get(kind, 0.0) + time.perf_counter() - t0

    def trace(self, event: str, bucket) -> None:
        if self.events is not None:
            self.events.append((event, bucket.name))
