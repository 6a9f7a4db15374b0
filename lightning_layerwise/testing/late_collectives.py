"""The timing fuzzer: every collective of the package run late, on a worker thread.

Note [late collectives]
    With the fuzzer installed (:func:`install`; ``LLW_LATE_COLLECTIVES=<ms>`` in the
    environment when ``lightning_layerwise`` is imported; ``pytest --late-collectives=<ms>``
    with the plugin ``lightning_layerwise.testing.pytest_plugin``), each collective the
    engine issues (``engine/collectives.py``) is queued instead of started: one worker
    thread per process group runs that group's collectives in program order, each no
    earlier than a random delay in ``[0, ms]`` milliseconds after its dispatch. The
    collective reads its inputs and writes its outputs only then. An asynchronous
    call returns at once with a :class:`LateWork` whose ``wait()`` blocks until the
    collective ran (and raises its error); a synchronous call blocks until it ran.
    Correct code computes the same numbers with or without it; code that reads an
    output before ``wait()``, or writes an input after dispatch, sees other values.
    The delays depend only on the seed (``LLW_LATE_COLLECTIVES_SEED``, default 0), the
    global rank and how many collectives this process issued before: a failing run is
    repeated with the same delays by setting the same seed. A worker thread ends as
    soon as its queue has been empty for a short while, so none outlives its group's
    last collective by more than that.

    The engine learns of the fuzzer through one indirection, set once when it is
    installed (``collectives.set_dispatch``): the training path reads no environment
    variable and tests nothing per call. A forked child keeps the installation and
    starts with empty queues; a new interpreter reads the environment at import.
"""

from __future__ import annotations

import collections
import math
import os
import random
import threading
import time
from typing import Callable

import torch.distributed as dist
from torch.distributed import ProcessGroup

from ..engine import collectives

LATE_COLLECTIVES_ENV = "LLW_LATE_COLLECTIVES"
LATE_COLLECTIVES_SEED_ENV = "LLW_LATE_COLLECTIVES_SEED"
_IDLE_SECONDS = 0.2  # a worker thread with nothing queued for this long ends
_installed_ms: float | None = None  # the largest delay in force, None: off


def late_collectives_ms() -> float | None:
    """The largest delay of Note [late collectives] in milliseconds, or ``None`` when it is off."""
    value = os.environ.get(LATE_COLLECTIVES_ENV, "").strip()
    if not value:
        return None
    try:
        ms = float(value)
    except ValueError:
        ms = math.nan
    if not (0.0 <= ms < math.inf):
        raise ValueError(f"{LATE_COLLECTIVES_ENV}={value!r}: pass the largest delay of a collective in "
                         f"milliseconds, a number >= 0 (e.g. {LATE_COLLECTIVES_ENV}=5), or unset it.")
    return ms


def _late_seed() -> int:
    value = os.environ.get(LATE_COLLECTIVES_SEED_ENV, "0").strip() or "0"
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{LATE_COLLECTIVES_SEED_ENV}={value!r}: pass an integer, e.g. "
                         f"{LATE_COLLECTIVES_SEED_ENV}=1.") from None


def late_delay_ms(seed: int | str, rank: int, index: int, max_ms: float) -> float:
    """The delay of this process's ``index``-th collective on global rank ``rank``, in ``[0, max_ms]``.

    A function of its arguments only, so a run repeated with the same seed sees the same delays.
    """
    return random.Random(f"{seed}:{rank}:{index}").uniform(0.0, max_ms)


class LateWork:
    """The handle of a queued collective (Note [late collectives]): ``wait()`` blocks until it ran."""

    def __init__(self, run: Callable[[], object], due: float, index: int) -> None:
        self._run, self.due, self.index = run, due, index
        self._done = threading.Event()
        self._error: BaseException | None = None

    def execute(self) -> None:
        try:
            self._run()
        except BaseException as error:  # noqa: BLE001 - handed to whoever waits
            self._error = error
        finally:
            self._run = None  # drops the tensors
            self._done.set()

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout=None) -> bool:
        """As torch's ``Work.wait``: a ``timeout`` (a ``timedelta``) that passes first raises ``RuntimeError`` and
        leaves the collective queued. Without one, the collective itself fails after its group's timeout."""
        if not self._done.wait(None if timeout is None else timeout.total_seconds()):
            raise RuntimeError("Operation timed out!")
        if self._error is not None:
            raise self._error
        return True


class _GroupQueue:
    """One process group's queued collectives and the thread that runs them in order."""

    def __init__(self, key: int) -> None:
        self.key = key
        self.items: collections.deque[LateWork] = collections.deque()
        self.thread = threading.Thread(target=self._loop, name=f"llw-late-collectives-{key:x}", daemon=True)

    def _loop(self) -> None:
        while True:
            with _late.cond:
                idle_until = time.monotonic() + _IDLE_SECONDS
                while not self.items:
                    left = idle_until - time.monotonic()
                    if left <= 0:
                        # Removed under the lock: a later collective of this group starts a new thread.
                        del _late.queues[self.key]
                        return
                    _late.cond.wait(left)
                item = self.items.popleft()
            delay = item.due - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            item.execute()


class _LateState:
    """Per process: the queues by process group and the number of collectives issued (the delays' seed)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.queues: dict[int, _GroupQueue] = {}
        self.issued = 0


_late = _LateState()
# A forked child has none of the parent's threads: it starts with no queue and a fresh lock.
os.register_at_fork(after_in_child=lambda: globals().__setitem__("_late", _LateState()))


def _enqueue(group: ProcessGroup, run: Callable[[], object], max_ms: float, seed: int) -> LateWork:
    rank = dist.get_rank() if dist.is_initialized() else 0
    with _late.cond:
        index = _late.issued
        _late.issued += 1
        work = LateWork(run, time.monotonic() + late_delay_ms(seed, rank, index, max_ms) / 1000.0, index)
        queue = _late.queues.get(id(group))
        if queue is None:
            queue = _late.queues[id(group)] = _GroupQueue(id(group))
            queue.thread.start()
        queue.items.append(work)
        _late.cond.notify_all()
    return work


def install(max_ms: float, seed: int | None = None) -> None:
    """Runs every later collective of the package up to ``max_ms`` milliseconds late (Note [late collectives]).

    ``seed``: the delays' seed; default ``LLW_LATE_COLLECTIVES_SEED`` (0 when unset)."""
    if not (isinstance(max_ms, (int, float)) and 0.0 <= max_ms < math.inf):
        raise ValueError(f"max_ms={max_ms!r}: pass the largest delay of a collective in milliseconds, a number >= 0.")
    seed = _late_seed() if seed is None else int(seed)

    def dispatch(group: ProcessGroup, call: Callable[[bool], object], async_op: bool):
        work = _enqueue(group, lambda: call(False), max_ms, seed)
        if async_op:
            return work
        work.wait()
        return None

    global _installed_ms
    collectives.set_dispatch(dispatch)
    _installed_ms = max_ms


def uninstall() -> None:
    """Collectives issued from now on run at once again (queued ones still run late)."""
    global _installed_ms
    collectives.set_dispatch(None)
    _installed_ms = None


def installed_ms() -> float | None:
    """The largest delay in force in this process, or ``None`` when the fuzzer is off."""
    return _installed_ms


def install_from_environment() -> float | None:
    """Installs the fuzzer if ``LLW_LATE_COLLECTIVES`` asks for it (a bad value raises, naming it); returns the
    largest delay, or ``None``."""
    ms = late_collectives_ms()
    if ms is not None:
        install(ms)
    return ms
