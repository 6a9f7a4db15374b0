"""Note [late collectives] (``lightning_layerwise/testing/late_collectives.py``): the timing fuzzer itself.

A queued collective reads its inputs and writes its outputs only when it runs; ``wait()``
blocks until then and raises its error; each process group's collectives run in program
order; the delays are reproducible from the seed; worker threads end when idle.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from _dist import run_distributed
from lightning_layerwise.engine import collectives
from lightning_layerwise.testing import late_collectives
from lightning_layerwise.testing.late_collectives import (LATE_COLLECTIVES_ENV, LATE_COLLECTIVES_SEED_ENV,
                                                          late_delay_ms)

MAX_MS = 1000.0
SLOW_MS = 500.0  # the first collective of each rank waits at least this long (seed chosen below)


def _slow_first_seed(world: int) -> int:
    """A seed whose first delay is >= SLOW_MS on every rank: checks made right after dispatch run before it."""
    return next(s for s in range(10_000) if all(late_delay_ms(s, r, 0, MAX_MS) >= SLOW_MS for r in range(world)))


def _late_worker(rank: int, world: int) -> dict:
    out = {}
    tensor = torch.full((4,), float(rank + 1))
    result = collectives.all_reduce_bucket(tensor, torch.distributed.group.WORLD, async_op=True)
    out["pending"] = result.pending
    out["before_wait"] = tensor.clone()  # not yet reduced: the collective has not run
    tensor.add_(10.0)  # a write to the input after dispatch: the collective sends it
    out["after_wait"] = result.wait().clone()
    out["pending_after"] = result.pending
    # A synchronous call returns only after it ran.
    out["sum"] = collectives.all_reduce_sum(torch.full((2,), float(rank)), torch.distributed.group.WORLD).clone()
    time.sleep(late_collectives._IDLE_SECONDS * 3)
    out["threads_left"] = [t.name for t in threading.enumerate() if t.name.startswith("llw-late-collectives")]
    return out


def test_a_late_collective_reads_and_writes_only_when_it_runs(monkeypatch):
    world = 2
    monkeypatch.setenv(LATE_COLLECTIVES_SEED_ENV, str(_slow_first_seed(world)))  # inherited by the workers
    results = run_distributed(_late_worker, world, late_ms=MAX_MS)
    total = sum(r + 1 + 10.0 for r in range(world))
    for rank, out in enumerate(results):
        assert out["pending"] and not out["pending_after"]
        assert torch.equal(out["before_wait"], torch.full((4,), float(rank + 1))), out["before_wait"]
        assert torch.equal(out["after_wait"], torch.full((4,), total)), out["after_wait"]
        assert torch.equal(out["sum"], torch.full((2,), float(sum(range(world)))))
        assert out["threads_left"] == [], "worker threads end once idle"


def _plain_worker(rank: int, world: int) -> torch.Tensor:
    """Without the fuzzer the call goes to torch.distributed at once, and its wait returns the sum."""
    late_collectives.uninstall()  # also when the whole suite runs under the fuzzer
    tensor = torch.full((4,), float(rank + 1))
    result = collectives.all_reduce_bucket(tensor, torch.distributed.group.WORLD, async_op=True)
    result.wait()
    return tensor


def test_without_late_collectives_the_call_runs_at_once():
    for tensor in run_distributed(_plain_worker, 2):
        assert torch.equal(tensor, torch.full((4,), 3.0))


class _Group:
    """Stands in for a process group: only its identity selects the queue."""


@pytest.fixture
def restore_dispatch():
    """Puts back whatever dispatch this process had (the fuzzer under ``--late-collectives``, else none)."""
    before = collectives._issue
    yield
    collectives.set_dispatch(before)


def test_one_group_runs_in_program_order_and_errors_reach_wait(restore_dispatch):
    late_collectives.install(20)
    order = []
    a, b = _Group(), _Group()
    works = [collectives._issue(g, lambda _, i=i: order.append(i), True) for i, g in enumerate([a, b, a, b, a])]

    def fail(_):
        raise RuntimeError("peer gone")

    failing = collectives._issue(a, fail, True)
    for w in works:
        assert w.wait()
    assert [i for i in order if i % 2 == 0] == [0, 2, 4] and [i for i in order if i % 2] == [1, 3]
    with pytest.raises(RuntimeError, match="peer gone"):
        failing.wait()
    with pytest.raises(RuntimeError, match="peer gone"):  # as often as it is waited for
        failing.wait()
    with pytest.raises(RuntimeError, match="peer gone"):  # a synchronous call raises at once
        collectives._issue(b, fail, False)


def test_delays_are_reproducible_from_the_seed():
    first = [late_delay_ms(0, 1, i, 5.0) for i in range(50)]
    assert first == [late_delay_ms(0, 1, i, 5.0) for i in range(50)]
    assert first != [late_delay_ms(1, 1, i, 5.0) for i in range(50)]
    assert first != [late_delay_ms(0, 0, i, 5.0) for i in range(50)]
    assert all(0.0 <= d <= 5.0 for d in first) and max(first) > 2.5


@pytest.mark.parametrize("value", ["-1", "soon", "nan", "inf"])
def test_a_bad_setting_is_a_clear_error(monkeypatch, restore_dispatch, value):
    monkeypatch.setenv(LATE_COLLECTIVES_ENV, value)
    with pytest.raises(ValueError, match=rf"LLW_LATE_COLLECTIVES='{value}': pass the largest delay"):
        late_collectives.install_from_environment()
    monkeypatch.setenv(LATE_COLLECTIVES_ENV, "1")
    monkeypatch.setenv(LATE_COLLECTIVES_SEED_ENV, "x")
    with pytest.raises(ValueError, match="LLW_LATE_COLLECTIVES_SEED='x': pass an integer"):
        late_collectives.install_from_environment()


def test_the_environment_is_read_once_at_import_and_never_per_collective(tmp_path):
    """A new interpreter with ``LLW_LATE_COLLECTIVES`` set has the fuzzer from ``import lightning_layerwise``
    on; the setting changed afterwards changes nothing, and without it the engine calls torch directly."""
    script = (
        "import os, lightning_layerwise\n"
        "from lightning_layerwise.engine import collectives\n"
        "from lightning_layerwise.testing import late_collectives\n"
        "print(late_collectives.installed_ms(), collectives._issue is collectives._direct)\n"
        "os.environ['LLW_LATE_COLLECTIVES'] = 'soon'  # read no more: no error at the next collective\n"
        "work = collectives._issue(object(), lambda _: None, True)\n"
        "print(type(work).__name__ if work is not None else None)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != LATE_COLLECTIVES_ENV}
    off = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    on = subprocess.run([sys.executable, "-c", script], env={**env, LATE_COLLECTIVES_ENV: "3"},
                        capture_output=True, text=True, check=True)
    assert off.stdout.split() == ["None", "True", "None"], off.stdout + off.stderr
    assert on.stdout.split() == ["3.0", "False", "LateWork"], on.stdout + on.stderr
