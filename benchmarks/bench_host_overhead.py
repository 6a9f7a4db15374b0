"""Per-step host overhead of the layer-wise wrapper against plain training and ``DistributedDataParallel``.

Run from the repository root (gloo ranks on CPU; the default takes a few minutes on 2 cores)::

    .venv/bin/python benchmarks/bench_host_overhead.py
    .venv/bin/python benchmarks/bench_host_overhead.py --quick        # seconds, for a smoke test
    .venv/bin/python benchmarks/bench_host_overhead.py --blocks 96 --worlds 2 --repeats 3 --out /tmp/host.json

The model is host-bound on purpose: ``--blocks`` residual blocks of ``Linear(width, width)``
(with bias) and ``LayerNorm(width)`` (4 small parameters per block: 192 at the default 48
blocks), a batch of ``--batch`` rows per rank, ``torch.optim.AdamW`` (foreach), an MSE loss.
Every kernel is microseconds long, so the step time is mostly Python and dispatch: what a
wrapper adds per parameter shows. Configurations (same seed, initial weights and data):

* ``plain``: no wrapper. At world 1 the reference for host overhead; at a larger world every
  rank trains its own rows alone, with no communication (its replicas diverge: no correctness
  check), the same per-rank work and CPU contention as the data-parallel runs without their sync;
* ``ddp``: ``torch.nn.parallel.DistributedDataParallel(model)`` with default settings;
* ``ddp_view``: the same with ``gradient_as_bucket_view=True``;
* ``layerwise``: ``LayerwiseSession(LayerwiseConfig())`` (every default), the plain-loop API:
  ``session.wrap(model, optimizer)``, then per step ``optimizer.zero_grad(set_to_none=True)``,
  forward, ``session.backward(loss)``, ``session.step(optimizer)``.

Every rank of a world of N takes its chunk of each global batch of ``batch * N`` rows. For
each repeat and each world in ``--worlds``, N fresh processes (spawned, ``OMP_NUM_THREADS=1``,
``torch.set_num_threads(1)``, a free port on 127.0.0.1) run every configuration in turn, the
order rotated each repeat; each run builds its model and optimizer anew, ``ddp`` on a new gloo
group of its own, ``layerwise`` on the groups its session creates and destroys. One run is:

1. ``--warmup`` steps, not measured;
2. ``--steps`` timed steps, nothing instrumented but ``time.perf_counter`` around each phase:
   step (the whole iteration, ``zero_grad`` included), forward (with the loss), backward
   (``session.backward``: includes ``finish_grad_sync``, the wait for the reduce-scatters; DDP's
   backward includes its all-reduce wait), optimizer (``optimizer.step`` / ``session.step``,
   which starts the all-gather the next forward waits for);
3. ``--memory-steps`` steps measuring memory (below); then the run's model is released;
4. ``layerwise`` only: the hook probe. ``GradientSync._on_grad_ready``, the per-parameter
   gradient hook, is replaced on the class while a second wrapper (fresh model, optimizer and
   data) is built (the wrapper binds the hook at construction), then restored, so the timed
   run above paid nothing for the probe; ``--warmup`` + ``--steps`` steps of that wrapper add
   the ``perf_counter`` time of each hook call. Reported: hook calls per step (one per parameter
   on several processes; on one process only parameters whose gradient takes the copy path,
   none here: Note [in-place gradients]), the hook's time per step and per call, including the
   reduce-scatter a bucket's last gradient dispatches (asynchronous: the dispatch, not the
   transfer). DDP's hooks run in C++: for it (and for ``layerwise``) the table gives the
   backward time minus ``plain``'s at the same world instead;

The memory steps: a thread samples the resident set size (``/proc/self/statm``) every ~0.2 ms
(sleep granularity and the GIL permitting) over each backward, and the rise is the peak minus
the RSS when the backward started (freed CPU memory is usually kept by the allocator and
reused, so a steady-state rise near 0 is expected for small tensors); and at the end of the
backward the bytes of distinct storages that hold gradients: the ``.grad`` of every model and
optimizer parameter, plus the gradient buffers a wrapper keeps besides them (``layerwise``:
its flat gradient buffers; ``ddp`` without bucket views: its reducer's buckets, from DDP's
logging data). These steps run after the timed ones because the sampler thread competes for
the GIL; torch's CPU allocator reports no peak and ``tracemalloc`` does not see tensor memory.

Every number is a median over repeats of the slowest rank's value in a run (a rank's median
over the steps of a phase; for memory, its maximum over the memory steps). After the runs,
rank 0's final parameters of every synchronized configuration are compared with ``ddp``'s at
the same world (relative error: norm of the difference over the norm of ``ddp``'s parameters);
they must agree within 1e-5, and the script exits with an error above 1e-4.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import lightning_layerwise as llw  # noqa: E402
from lightning_layerwise.engine.grad_sync import GradientSync  # noqa: E402
from benchmarks import harness  # noqa: E402

CONFIGS = ("plain", "ddp", "ddp_view", "layerwise")
TOLERANCE = 1e-5  # what layerwise and ddp must agree to
FAIL_ABOVE = 1e-4  # the script fails above this
PHASES = ("step", "forward", "backward", "optimizer")


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.norm(self.linear(x)))


def build_model(blocks: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[Block(width) for _ in range(blocks)])


class HookProbe:
    """Times ``GradientSync._on_grad_ready``, the per-parameter gradient hook (module doc, step 4)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0

    @contextlib.contextmanager
    def installed(self) -> Iterator["HookProbe"]:
        """Replaces the hook on the class while inside: wrappers made inside register the timed hook (a wrapper's
        gradient side binds the hook at construction, so the ones made outside are not timed and pay nothing for the probe)."""
        original = GradientSync._on_grad_ready

        def timed_hook(sync: GradientSync, param: nn.Parameter, **kwargs) -> None:
            t0 = time.perf_counter()
            try:
                return original(sync, param, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
                self.calls += 1

        GradientSync._on_grad_ready = timed_hook
        try:
            yield self
        finally:
            GradientSync._on_grad_ready = original

    def reset(self) -> None:
        self.seconds, self.calls = 0.0, 0


@dataclass
class Loop:
    """One configuration's training loop around a model and its optimizer."""

    forward: Callable[[torch.Tensor], torch.Tensor]
    backward: Callable[[torch.Tensor], None]
    step: Callable[[], object]
    release: Callable[[], object]
    """Ends the run: unwraps the model, destroys the run's groups."""
    grad_buffers: Callable[[], list[torch.Tensor]] = list
    """Gradient tensors the wrapper keeps besides the ``.grad`` of parameters."""
    opaque_grad_bytes: Callable[[], int] = int
    """Gradient bytes the wrapper keeps where Python sees no tensor (DDP's reducer buckets)."""


def make_loop(config: str, model: nn.Module, optimizer: torch.optim.Optimizer, world: int) -> Loop:
    if config == "plain":
        return Loop(model, torch.Tensor.backward, optimizer.step, release=lambda: None)
    if config in ("ddp", "ddp_view"):
        group = dist.new_group(list(range(world)))
        bucket_view = config == "ddp_view"
        ddp = nn.parallel.DistributedDataParallel(model, process_group=group, gradient_as_bucket_view=bucket_view)

        def bucket_bytes() -> int:
            # With bucket views the .grad tensors are the buckets: counted through their storages.
            return 0 if bucket_view else sum(int(size) for size in
                                             str(ddp._get_ddp_logging_data()["bucket_sizes"]).split(","))

        return Loop(ddp, torch.Tensor.backward, optimizer.step, release=lambda: dist.destroy_process_group(group),
                    opaque_grad_bytes=bucket_bytes)
    session = llw.LayerwiseSession(llw.LayerwiseConfig())
    wrapped = session.wrap(model, optimizer)
    return Loop(wrapped, session.backward, lambda: session.step(optimizer), release=session.release,
                grad_buffers=lambda: [flat.grads for flat in wrapped.grad_sync.flat_buffers])


def gradient_bytes(loop: Loop, tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages holding the gradients of ``tensors`` and ``loop``'s gradient buffers."""
    grads = [t.grad for t in tensors if t.grad is not None] + loop.grad_buffers()
    storages = {g.untyped_storage().data_ptr(): g.untyped_storage().nbytes() for g in grads}
    return sum(storages.values()) + loop.opaque_grad_bytes()


class BackwardMemory:
    """The sampled RSS rise over backwards and the gradient bytes at their end (module doc, step 4)."""

    def __init__(self, loop: Loop, tensors: list[torch.Tensor], interval_s: float = 2e-4) -> None:
        self.loop, self.tensors, self.interval_s = loop, tensors, interval_s
        self.rss_rises: list[int] = []
        self.grad_bytes: list[int] = []

    @contextlib.contextmanager
    def watch(self) -> Iterator[None]:
        with harness.PeakRSS(self.interval_s) as rss:
            yield
        self.rss_rises.append(rss.rise)
        self.grad_bytes.append(gradient_bytes(self.loop, self.tensors))


def train_step(loop: Loop, optimizer: torch.optim.Optimizer, inputs: torch.Tensor, target: torch.Tensor,
               around_backward: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
               ) -> dict[str, float]:
    """One iteration; returns each phase's wall seconds."""
    t0 = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    t1 = time.perf_counter()
    loss = F.mse_loss(loop.forward(inputs), target)
    t2 = time.perf_counter()
    with around_backward():
        loop.backward(loss)
    t3 = time.perf_counter()
    loop.step()
    t4 = time.perf_counter()
    return {"step": t4 - t0, "forward": t2 - t1, "backward": t3 - t2, "optimizer": t4 - t3}


def rank_batches(n: int, rank: int, world: int, batch: int, width: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's chunk of ``n`` global batches of ``batch * world`` rows; step ``i``'s is drawn from seed ``i``,
    so every configuration at one world trains on the same data."""
    batches = []
    for i in range(n):
        g = torch.Generator().manual_seed(i)
        inputs = torch.randn(batch * world, width, generator=g)
        target = torch.randn(batch * world, width, generator=g)
        batches.append((inputs.chunk(world)[rank].contiguous(), target.chunk(world)[rank].contiguous()))
    return batches


def run_config(config: str, rank: int, world: int, args: argparse.Namespace) -> dict:
    model = build_model(args.blocks, args.width)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loop = make_loop(config, model, optimizer, world)
    tensors = [*model.parameters(), *(t for g in optimizer.param_groups for t in g["params"])]
    batches = iter(rank_batches(args.warmup + args.steps + args.memory_steps, rank, world, args.batch, args.width))
    for _ in range(args.warmup):
        train_step(loop, optimizer, *next(batches))
    timed = [train_step(loop, optimizer, *next(batches)) for _ in range(args.steps)]
    memory = BackwardMemory(loop, tensors)
    for _ in range(args.memory_steps):
        train_step(loop, optimizer, *next(batches), around_backward=memory.watch)
    loop.release()
    params = harness.flat_params(model) if rank == 0 else None
    hook_seconds, hook_calls = [], []
    if config == "layerwise":  # the hook, timed on a wrapper of its own (module doc, step 4)
        probe = HookProbe()
        with probe.installed():
            model = build_model(args.blocks, args.width)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
            loop = make_loop(config, model, optimizer, world)
        batches = iter(rank_batches(args.warmup + args.steps, rank, world, args.batch, args.width))
        for i in range(args.warmup + args.steps):
            probe.reset()
            train_step(loop, optimizer, *next(batches))
            if i >= args.warmup:
                hook_seconds.append(probe.seconds)
                hook_calls.append(probe.calls)
        loop.release()
    return {"phases": {phase: [t[phase] for t in timed] for phase in PHASES}, "hook_seconds": hook_seconds,
            "hook_calls": hook_calls, "rss_rise_bytes": memory.rss_rises, "grad_bytes": memory.grad_bytes,
            "params": params}


def run_configs(rank: int, world: int, configs: list[str], args: argparse.Namespace) -> dict[str, dict]:
    return {config: run_config(config, rank, world, args) for config in configs}


def launch(world: int, configs: list[str], args: argparse.Namespace) -> dict[str, list[dict]]:
    """Runs ``configs`` in order on ``world`` fresh processes; returns every rank's result per configuration."""
    ranks = harness.run_ranks(run_configs, world, configs, args)
    return {config: [r[config] for r in ranks] for config in configs}


def summarize(ranks: list[dict]) -> dict:
    """One run's numbers: the slowest rank's per-step medians (seconds to milliseconds), memory maxima."""
    summary = {f"{phase}_ms": harness.slowest_ms(r["phases"][phase] for r in ranks) for phase in PHASES}
    calls = sum(ranks[0]["hook_calls"])
    summary["hook_calls_per_step"] = harness.median_of(ranks[0]["hook_calls"])
    summary["hook_ms_per_step"] = harness.slowest_ms(r["hook_seconds"] for r in ranks) if calls else None
    summary["hook_us_per_call"] = (1e6 * max(sum(r["hook_seconds"]) / sum(r["hook_calls"]) for r in ranks)
                                   if calls else None)
    summary["grad_bytes"] = max(max(r["grad_bytes"]) for r in ranks)
    summary["rss_rise_bytes"] = max(max(r["rss_rise_bytes"]) for r in ranks)
    return summary


@dataclass
class Collected:
    """Every run's summary and rank 0's final parameters, by (configuration, world)."""

    summaries: dict[tuple[str, int], list[dict]] = field(default_factory=dict)
    params: dict[tuple[str, int], list[torch.Tensor]] = field(default_factory=dict)

    def add(self, config: str, world: int, ranks: list[dict]) -> None:
        self.summaries.setdefault((config, world), []).append(summarize(ranks))
        self.params.setdefault((config, world), []).append(ranks[0]["params"])


def table_rows(collected: Collected, worlds: list[int]) -> list[dict]:
    rows = []
    for world in worlds:
        ddp_step = harness.median_of(run["step_ms"] for run in collected.summaries[("ddp", world)])
        plain_backward = harness.median_of(run["backward_ms"] for run in collected.summaries[("plain", world)])
        for config in CONFIGS:
            runs = collected.summaries[(config, world)]
            row = {"config": config, "world": world, "runs": len(runs)}
            row.update(harness.medians(runs))
            row["step_vs_ddp"] = row["step_ms"] / ddp_step
            row["backward_minus_plain_ms"] = row["backward_ms"] - plain_backward
            rows.append(row)
    return rows


def check_against_ddp(collected: Collected, worlds: list[int]) -> dict[str, float]:
    """The largest relative error of each synchronized configuration's final parameters against ``ddp``'s."""
    errors = {}
    for world in worlds:
        references = collected.params[("ddp", world)]
        synced = [c for c in CONFIGS if c != "ddp" and (c != "plain" or world == 1)]
        for config in synced:
            errors[f"{config}@{world}"] = max(harness.relative_error(p, ref) for p in collected.params[(config, world)]
                                              for ref in references)
    return errors


def print_table(rows: list[dict]) -> None:
    header = ["config", "world", "step ms", "vs ddp", "fwd ms", "bwd ms", "opt ms", "bwd - plain ms", "hook calls/step",
              "hook ms/step", "hook us/call", "grads MiB", "bwd RSS rise MiB"]
    fmt = harness.fmt
    print(harness.markdown_table(header, [
        [r["config"], r["world"], fmt(r["step_ms"]), f"{r['step_vs_ddp']:.3f}", fmt(r["forward_ms"]),
         fmt(r["backward_ms"]), fmt(r["optimizer_ms"]), fmt(r["backward_minus_plain_ms"]),
         fmt(r["hook_calls_per_step"], ".0f"), fmt(r["hook_ms_per_step"]), fmt(r["hook_us_per_call"]),
         f"{r['grad_bytes'] / 2**20:.2f}", f"{r['rss_rise_bytes'] / 2**20:.2f}"] for r in rows]))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="few steps and one repeat (a smoke test)")
    parser.add_argument("--blocks", type=int, default=48, help="residual blocks of Linear + LayerNorm")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4, help="rows per rank")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (and as many hook-probe steps)")
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--memory-steps", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None, help="interleaved runs of every configuration")
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2], help="numbers of gloo ranks")
    parser.add_argument("--out", default=str(harness.RESULTS / "host_overhead_cpu.json"))
    args = parser.parse_args(argv)
    harness.quick_defaults(args, steps=(10, 100), warmup=(3, 10), memory_steps=(2, 5), repeats=(1, 5))
    clock = harness.Clock()
    collected = Collected()
    for _, order in harness.interleave(CONFIGS, args.repeats):
        for world in args.worlds:
            for config, ranks in launch(world, order, args).items():
                collected.add(config, world, ranks)
    rows = table_rows(collected, args.worlds)
    errors = check_against_ddp(collected, args.worlds)

    print(f"\n{args.blocks} blocks of Linear({args.width}, {args.width}) + LayerNorm, batch {args.batch} per rank, "
          f"AdamW; {args.steps} steps x {args.repeats} interleaved repeats, medians of the slowest rank "
          f"(torch {torch.__version__}, {os.cpu_count()} CPUs, {clock.elapsed_s():.0f} s)\n")
    print_table(rows)
    worst = harness.report_errors(errors, "ddp", TOLERANCE)

    runs = {f"{config}@{world}": summaries for (config, world), summaries in collected.summaries.items()}
    out = harness.write_json(args.out, {"machine": clock.machine(threads=1), "args": vars(args), "rows": rows,
                                        "runs": runs, "max_rel_error_vs_ddp": errors})
    print(f"wrote {out}")
    harness.exit_if_above(worst, FAIL_ABOVE, "ddp")


if __name__ == "__main__":
    main()
