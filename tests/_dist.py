"""Run a function on N gloo ranks (forked processes) and collect each rank's return value.

Workers are forked, not spawned, so they start in milliseconds and inherit the
test's imports; each uses one intra-op thread so 3 or 4 ranks share 2 cores.
A worker that raises makes the whole call raise with that rank's traceback;
a worker that hangs is killed after ``timeout`` seconds and the call fails.

``late_ms`` runs the workers under Note [late collectives] (``lightning_layerwise/testing/late_collectives.py``):
every collective of the package is queued and runs up to ``late_ms`` milliseconds late.
:func:`reference_threads` fixes the intra-op thread count of single-process references.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import socket
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_layerwise.testing import late_collectives

LATE_MS = 4.0
"""The largest delay (ms) of the fuzzed parity tests: ``run_distributed(..., late_ms=LATE_MS)``.

Longer than a gloo collective of these tests' buckets takes on a CPU (well under 1 ms), so
most collectives land after the code that follows their dispatch has run, yet short enough
that a fuzzed test costs a few seconds more than its plain run.
"""

REFERENCE_THREADS = int(os.environ.get("LLW_REFERENCE_THREADS", "1"))
"""Intra-op threads of every single-process reference and of each distributed worker.

With a fixed count a reference's reductions are split the same way on every machine and
under any load; a count that followed the machine (torch's default: its cores) would make
the reference itself vary between machines. ``LLW_REFERENCE_THREADS=2`` checks that the
tolerances also hold where the kernels split their work differently.
"""


@contextlib.contextmanager
def reference_threads(threads: int = REFERENCE_THREADS):
    """Runs the block with ``torch.set_num_threads(threads)``, then restores the previous count."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_outcome(path: str, outcome: tuple) -> None:
    """Written aside and renamed into place: when one rank dies, the others are terminated, possibly while
    writing, and the parent must never read half a file (it reads only whole outcomes, or none)."""
    with open(path + ".partial", "wb") as f:
        pickle.dump(outcome, f)
    os.replace(path + ".partial", path)


def _worker(rank: int, world_size: int, port: int, outdir: str, fn: Callable, args: tuple,
            late_ms: float | None) -> None:
    torch.set_num_threads(REFERENCE_THREADS)
    # Lightning's launchers set cores // processes threads unless OMP_NUM_THREADS is set: on a
    # machine with more cores a Trainer in a worker would otherwise run with another count.
    os.environ["OMP_NUM_THREADS"] = str(REFERENCE_THREADS)
    if late_ms is not None:  # the fuzzer in this worker; processes it starts read the environment
        late_collectives.install(late_ms)
        os.environ[late_collectives.LATE_COLLECTIVES_ENV] = str(late_ms)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    path = os.path.join(outdir, f"rank{rank}.pkl")
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
        result = fn(rank, world_size, *args)
        dist.barrier()
        _write_outcome(path, ("ok", result))
    except BaseException:  # noqa: BLE001 - report every failure to the parent
        _write_outcome(path, ("error", traceback.format_exc()))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 240.0,
                    late_ms: float | None = None) -> list[Any]:
    """Runs ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; returns the results by rank.

    ``late_ms``: every collective of the package runs up to that many milliseconds late
    (Note [late collectives]); ``None`` leaves the fuzzer as this process has it (``--late-collectives``).
    """
    with tempfile.TemporaryDirectory() as outdir:
        ctx = mp.start_processes(
            _worker, args=(world_size, free_port(), outdir, fn, args, late_ms), nprocs=world_size,
            join=False, start_method="fork",
        )
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"distributed workers did not finish within {timeout}s")
        except (mp.ProcessRaisedException, mp.ProcessExitedException):  # reported below, with every rank
            pass
        except TimeoutError:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            raise
        outcomes = {}
        for rank in range(world_size):
            path = os.path.join(outdir, f"rank{rank}.pkl")
            if os.path.exists(path):
                with open(path, "rb") as f:
                    outcomes[rank] = pickle.load(f)
        # Every failing rank's traceback: one rank's error often surfaces as another's broken collective.
        errors = [f"rank {rank} failed:\n{value}" for rank, (status, value) in sorted(outcomes.items())
                  if status == "error"]
        if errors:
            raise RuntimeError("\n".join(errors))
        missing = [r for r in range(world_size) if r not in outcomes]
        if missing:
            codes = {r: ctx.processes[r].exitcode for r in missing}
            raise RuntimeError(f"ranks {missing} died without a result (exit codes {codes})")
        return [outcomes[r][1] for r in range(world_size)]


def counting_compiler() -> tuple[Callable, list]:
    """A ``torch.compile`` backend that runs each graph eagerly and records it: ``(backend, graphs)``.

    Resets dynamo first: a forked worker inherits what the test process compiled.
    """
    import torch._dynamo

    torch._dynamo.reset()
    graphs: list = []

    def backend(gm, example_inputs):
        graphs.append(str(gm.graph))
        return gm.forward

    return backend, graphs
