"""Run a function on N gloo ranks (forked processes) and collect each rank's return value.

Workers are forked, not spawned, so they start in milliseconds and inherit the
test's imports; each uses one intra-op thread so 3 or 4 ranks share 2 cores.
A worker that raises makes the whole call raise with that rank's traceback;
a worker that hangs is killed after ``timeout`` seconds and the call fails.
"""

from __future__ import annotations

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


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, outdir: str, fn: Callable, args: tuple) -> None:
    torch.set_num_threads(1)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    path = os.path.join(outdir, f"rank{rank}.pkl")
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
        result = fn(rank, world_size, *args)
        dist.barrier()
        with open(path, "wb") as f:
            pickle.dump(("ok", result), f)
    except BaseException:  # noqa: BLE001 - report every failure to the parent
        with open(path, "wb") as f:
            pickle.dump(("error", traceback.format_exc()), f)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 240.0) -> list[Any]:
    """Runs ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; returns the results by rank."""
    with tempfile.TemporaryDirectory() as outdir:
        ctx = mp.start_processes(
            _worker, args=(world_size, free_port(), outdir, fn, args), nprocs=world_size,
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
