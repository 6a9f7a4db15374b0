"""Collectives per optimizer step of a plain-torch ``LayerwiseSession`` loop against ``DistributedDataParallel``.

Run from the repository root (gloo ranks on CPU; the default takes about 2 minutes on 2 cores)::

    .venv/bin/python benchmarks/bench_session_collectives.py
    .venv/bin/python benchmarks/bench_session_collectives.py --quick        # seconds, for a smoke test
    .venv/bin/python benchmarks/bench_session_collectives.py --worlds 2 --repeats 3 --out /tmp/collectives.json

The model is the example GPT at the size ``tests/session/test_torch_loop.py`` builds (``examples/gpt.py``:
vocabulary 256, 2 layers, 2 heads, width 32, block 16, no biases; 33,440 parameters in 15 tensors,
the embedding tied to the head; no module buffers), ``torch.optim.AdamW(lr=1e-3)``, random tokens,
``--rows`` rows per rank per micro-batch. One optimizer step is ``--micro`` micro-batches of
accumulation (the loss divided by their number), then
``torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)`` and the step:

* ``session``: ``session = LayerwiseSession(LayerwiseConfig())`` (every default: one 40 M-element
  bucket holds the whole model), ``wrapped = session.wrap(model, optimizer)``; per step
  ``optimizer.zero_grad()``, per micro-batch ``wrapped(x, y)`` and ``session.backward(loss)``, then
  torch's clip (which the package makes global, Note [gradient utilities]) and
  ``session.step(optimizer)``;
* ``ddp``: ``DistributedDataParallel(model)`` (defaults, on a gloo group of its own) with the same
  loop: ``loss.backward()``, torch's clip, ``optimizer.step()``;
* ``*_nosync``: the first micro-batch's forward and backward inside ``session.wrapper.no_sync()`` /
  ``ddp.no_sync()``, so only the last backward reduces;
* ``session_small_buckets*``: the session with ``bucket_size=4096`` (as ``tests/session/test_torch_loop.py``),
  to show what each extra bucket costs;
* ``session_no_flags*``, a what-if: the session with the split-parameter flags' all-reduce of
  ``finish_grad_sync`` (started there, waited for in ``GradientSync._split_parameters_used`` or at
  the next restart) left out, as if it were fused into another collective. The benchmark replaces that method on its own wrapper (the package is not
  changed) with one that answers "used" for every split parameter, which is the all-reduce's answer
  here, since every parameter gets a gradient on every rank (checked at each step); the final
  parameters are compared with ``ddp``'s like every other configuration's.

Per repeat and world, ``world`` forked processes (one intra-op thread each, a free port on
127.0.0.1) do:

1. timed: every configuration builds its model, optimizer and wrapper (its own groups) from the
   same seed, all alive together; then ``--warmup`` + ``--steps`` rounds, each round one step of
   every configuration on the same data, the order rotated each round, so a burst of load from
   other jobs on the machine falls on all of them alike. After each step the configuration's
   collectives in flight are waited for (``settle``: the session's all-gather, which would
   otherwise overlap with the next configuration's step; DDP has none), and that wait is part of
   the step's time: the session gets no credit for hiding its all-gather behind the next forward
   (on 2 busy cores there is little to hide it behind). Each step is timed with
   ``time.perf_counter``: the whole step, and its parts: the micro-batches' forwards and
   backwards, the clip, the optimizer step, the settle; nothing instrumented. Then one more step
   and its settle per configuration under ``torch.profiler``, whose ``c10d::*`` operator events
   (every collective that reaches a process group, from Python or from DDP's C++ reducer) are
   counted as a cross-check of the counts below; rank 0's final parameters are kept;
2. counted (first repeat only: the counts do not vary): a fresh model and wrapper, every
   ``torch.distributed`` function that moves tensors replaced by a counting wrapper before it is
   built (and the two names ``lightning_layerwise/engine/collectives.py`` bound at import,
   ``_reduce_scatter_single`` and ``_all_gather_single``): each call's kind, reduce op, bytes (of
   the whole tensor it covers: the all-reduced tensor, a reduce-scatter's input, an all-gather's
   output), group size, whether asynchronous, the loop phase it ran in, the package function
   that issued it, and for a synchronous call its wall time. ``ddp`` also gets a comm hook
   (``ddp.register_comm_hook``) that names its calls "DDP bucket" and runs the default
   ``allreduce_hook``, so its bucket all-reduces (otherwise issued from C++) pass through the
   counting ``dist.all_reduce``. ``--count-warmup`` steps, then ``--count-steps`` counted steps,
   which must all issue the same collectives;
3. once per world and repeat, a latency probe on the default group: the median wall time of a
   blocking ``all_reduce`` of 1 and of 31 float32 elements (the split-parameter flags; the clip's
   norm with its list votes), and of the bucket's all-reduce, reduce-scatter and all-gather.

Worlds after the first run ``--other-world-repeats`` (3) repeats at most: 3 ranks on 2 cores are slow.
Every time is a median over repeats of the slowest rank's median over steps. "vs ddp" divides the
medians; "paired" ratios are the median over repeats of the ratio within one launch: against
``ddp`` with the same no_sync setting, and for a session variant against the default session with
the same setting. Final parameters of every configuration are compared with ``ddp``'s at the same
world (relative error; the script fails above 1e-4). Writes
``benchmarks/results/session_collectives_cpu.json`` and prints the tables.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import lightning_layerwise as llw  # noqa: E402
from lightning_layerwise.engine import collectives as llw_collectives  # noqa: E402
from examples.gpt import GPT, GPTConfig  # noqa: E402
from benchmarks import harness  # noqa: E402

CONFIGS = ("session", "session_nosync", "ddp", "ddp_nosync", "session_small_buckets", "session_small_buckets_nosync",
           "session_no_flags", "session_no_flags_nosync")
SMALL_BUCKET = 4096
FAIL_ABOVE = 1e-4
PHASES = ("step", "micro_batches", "clip", "optimizer", "settle")

# Every torch.distributed function that moves tensors or objects (those this torch has are replaced).
DIST_FUNCTIONS = (
    "all_reduce", "all_reduce_coalesced", "reduce", "broadcast", "_broadcast_coalesced", "broadcast_object_list",
    "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "_reduce_scatter_base",
    "all_gather", "all_gather_into_tensor", "all_gather_single", "_all_gather_base", "all_gather_coalesced",
    "all_gather_object", "gather", "gather_object", "scatter", "scatter_object_list", "all_to_all",
    "all_to_all_single", "barrier", "monitored_barrier", "send", "recv", "isend", "irecv", "batch_isend_irecv",
    "send_object_list", "recv_object_list",
)
# Names collectives.py bound at import (the 2.13 names, or the older ones): replaced there too.
PACKAGE_BOUND = {"_reduce_scatter_single": "reduce_scatter_tensor", "_all_gather_single": "all_gather_into_tensor"}
KIND = {"reduce_scatter_single": "reduce_scatter_tensor", "_reduce_scatter_base": "reduce_scatter_tensor",
        "all_gather_single": "all_gather_into_tensor", "_all_gather_base": "all_gather_into_tensor"}


# --- counting -------------------------------------------------------------------------------------------------

class Recorder:
    """The collectives issued while :attr:`active`, each as a dict (module doc, step 2)."""

    def __init__(self) -> None:
        self.active = False
        self.events: list[dict] = []
        self.phase = "-"
        self.site: str | None = None  # set by the DDP comm hook around its all-reduce
        self.hook_calls = 0
        self._originals: list[tuple[object, str, Callable]] = []

    def install(self) -> None:
        for name in DIST_FUNCTIONS:
            if hasattr(dist, name):
                self._replace(dist, name, KIND.get(name, name))
        for name, kind in PACKAGE_BOUND.items():
            if hasattr(llw_collectives, name):
                self._replace(llw_collectives, name, kind)

    def uninstall(self) -> None:
        for owner, name, original in reversed(self._originals):
            setattr(owner, name, original)
        self._originals = []

    def _replace(self, owner: object, name: str, kind: str) -> None:
        original = getattr(owner, name)
        self._originals.append((owner, name, original))

        @functools.wraps(original)
        def counted(*args, **kwargs):
            if not self.active:
                return original(*args, **kwargs)
            t0 = time.perf_counter()
            result = original(*args, **kwargs)
            seconds = time.perf_counter() - t0
            self.events.append(self._describe(kind, args, kwargs, seconds))
            return result

        setattr(owner, name, counted)

    def _describe(self, kind: str, args: tuple, kwargs: dict, seconds: float) -> dict:
        values = list(args) + list(kwargs.values())
        per_arg = [_tensor_bytes(v) for v in values]
        group = next((v for v in values if isinstance(v, dist.ProcessGroup)), None)
        op = kwargs.get("op")
        if op is None:
            op = next((v for v in args if isinstance(v, dist.ReduceOp.RedOpType)), None)
        if op is None and "reduce" in kind:
            op = dist.ReduceOp.SUM  # the default
        async_op = bool(kwargs.get("async_op", False))
        return {"kind": kind, "op": None if op is None else str(op).split(".")[-1],
                "bytes": max(per_arg, default=0), "group_size": dist.get_world_size(group),
                "async": async_op, "phase": self.phase, "site": self.site or _call_site(),
                "sync_ms": None if async_op else 1e3 * seconds}


def _tensor_bytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def _call_site() -> str:
    """The package function (or, outside it, the first function outside torch.distributed) that issued the call."""
    frame = sys._getframe(3)
    fallback = None
    while frame is not None:
        path = frame.f_code.co_filename
        name = f"{Path(path).stem}.{frame.f_code.co_name}"
        if "lightning_layerwise" in path and not path.endswith("collectives.py"):
            return name
        if fallback is None and f"torch{os.sep}distributed" not in path and path != __file__:
            fallback = name
        frame = frame.f_back
    return fallback or "?"


RECORDER = Recorder()


def counting_allreduce_hook(group, bucket):
    """DDP comm hook: counts the bucket, then does the default all-reduce (which the counting wrapper records).

    No annotations: DDP checks them, and ``from __future__ import annotations`` makes them strings."""
    RECORDER.hook_calls += 1
    RECORDER.site = f"DDP bucket {bucket.index()} (comm hook)"
    try:
        return default_hooks.allreduce_hook(group, bucket)
    finally:
        RECORDER.site = None


# --- the loop -------------------------------------------------------------------------------------------------

def build_model() -> nn.Module:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=256, n_layer=2, n_head=2, n_embd=32, block_size=16, bias=False))


@dataclass
class Loop:
    forward: Callable
    backward: Callable[[torch.Tensor], None]
    no_sync: Callable[[], contextlib.AbstractContextManager]
    step: Callable[[], object]
    release: Callable[[], object]
    settle: Callable[[], object] = lambda: None
    """Waits for every collective in flight (the session's all-gather)."""


def make_loop(config: str, model: nn.Module, optimizer: torch.optim.Optimizer, world: int,
              count_hook: bool = False) -> Loop:
    if config.startswith("ddp"):
        group = dist.new_group(list(range(world)))
        ddp = nn.parallel.DistributedDataParallel(model, process_group=group)
        if count_hook:
            ddp.register_comm_hook(group, counting_allreduce_hook)
        return Loop(ddp, torch.Tensor.backward, ddp.no_sync, optimizer.step,
                    release=lambda: dist.destroy_process_group(group))
    options = {"bucket_size": SMALL_BUCKET} if "small_buckets" in config else {}
    session = llw.LayerwiseSession(llw.LayerwiseConfig(**options))
    wrapped = session.wrap(model, optimizer)
    if "no_flags" in config:
        without_split_flags(wrapped)
    return Loop(wrapped, session.backward, lambda: session.wrapper.no_sync(), lambda: session.step(optimizer),
                release=session.release, settle=lambda: session.wrapper.param_sync.finish())


def without_split_flags(wrapper: llw.LayerwiseDataParallel) -> None:
    """What-if (module doc): the split-parameter flags' all-reduce of ``finish_grad_sync`` left out, as if fused
    into another collective. Valid only when every split parameter gets a gradient on every rank (checked here):
    then the all-reduce's answer is "used" for all of them, which this returns without communicating."""
    sync = wrapper.grad_sync
    split = [p for params, _ in sync._split_by_group for p in params]

    def used() -> dict:
        if not all(wrapper.records[p].gradient.seen for p in split):
            raise RuntimeError("no_flags what-if: a split parameter got no gradient on this rank; the flags matter")
        return {p: True for p in split}

    sync._split_parameters_used = used  # this wrapper only; the package is not changed
    sync._split_by_group, sync._split_flags = [], []  # so finish_grad_sync starts no flags all-reduce


def train_step(loop: Loop, model: nn.Module, optimizer: torch.optim.Optimizer, micro: list, no_sync: bool
               ) -> dict[str, float]:
    """One optimizer step over ``micro`` micro-batches; returns each part's wall seconds."""
    t0 = time.perf_counter()
    RECORDER.phase = "zero_grad"
    optimizer.zero_grad()
    for i, (x, y) in enumerate(micro):
        with loop.no_sync() if no_sync and i < len(micro) - 1 else contextlib.nullcontext():
            RECORDER.phase = f"forward {i + 1}"
            _, loss = loop.forward(x, y)
            RECORDER.phase = f"backward {i + 1}"
            loop.backward(loss / len(micro))
    t1 = time.perf_counter()
    RECORDER.phase = "clip"
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    t2 = time.perf_counter()
    RECORDER.phase = "optimizer step"
    loop.step()
    t3 = time.perf_counter()
    RECORDER.phase = "-"
    return {"step": t3 - t0, "micro_batches": t1 - t0, "clip": t2 - t1, "optimizer": t3 - t2}


def rank_batches(n: int, rank: int, world: int, args: argparse.Namespace) -> list[list[tuple]]:
    """This rank's micro-batches of ``n`` steps: step ``s``'s global batch is drawn from seed ``s``."""
    steps = []
    for s in range(n):
        g = torch.Generator().manual_seed(s)
        tokens = torch.randint(0, 256, (args.micro, world * args.rows, 17), generator=g)
        steps.append([(t.chunk(world)[rank][:, :-1].contiguous(), t.chunk(world)[rank][:, 1:].contiguous())
                      for t in tokens])
    return steps


def profiled_c10d_ops(step: Callable[[], object], settle: Callable[[], object]) -> dict[str, int]:
    """The ``c10d::`` operator events (every collective reaching a process group) of one step and the settle
    after it, which the timed steps all have (a gloo collective started under the profiler and waited for after
    it stopped also crashes the process: SIGSEGV in the wait, torch 2.13)."""
    from torch.profiler import ProfilerActivity, profile

    quiet = os.open(os.devnull, os.O_WRONLY)
    stderr = os.dup(2)
    os.dup2(quiet, 2)  # the profiler's start and stop lines
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
            settle()
    finally:
        os.dup2(stderr, 2)
        os.close(stderr)
        os.close(quiet)
    return dict(Counter(e.name for e in prof.events() if e.name.startswith("c10d::")))


def run_timed(configs: list[str], rank: int, world: int, args: argparse.Namespace) -> dict[str, dict]:
    """Every configuration's timed run, their steps interleaved (module doc, step 1)."""
    runs = {}
    for config in configs:  # each its own model, optimizer, wrapper and groups, all alive together
        model = build_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        runs[config] = (model, optimizer, make_loop(config, model, optimizer, world))
    batches = rank_batches(args.warmup + args.steps + 1, rank, world, args)
    timed: dict[str, list[dict]] = {config: [] for config in configs}
    for i, micro in enumerate(batches[:-1]):
        shift = i % len(configs)
        for config in configs[shift:] + configs[:shift]:
            model, optimizer, loop = runs[config]
            t = train_step(loop, model, optimizer, micro, config.endswith("_nosync"))
            t0 = time.perf_counter()
            loop.settle()  # the session's all-gather lands before another configuration runs
            t["settle"] = time.perf_counter() - t0
            t["step"] += t["settle"]
            if i >= args.warmup:
                timed[config].append(t)
    results = {}
    for config in configs:
        model, optimizer, loop = runs[config]
        no_sync = config.endswith("_nosync")
        c10d_ops = profiled_c10d_ops(lambda: train_step(loop, model, optimizer, batches[-1], no_sync), loop.settle)
        loop.release()
        params = harness.flat_params(model) if rank == 0 else None
        results[config] = {"phases": {phase: [t[phase] for t in timed[config]] for phase in PHASES},
                           "c10d_ops": c10d_ops, "params": params}
    return results


def run_counted(config: str, rank: int, world: int, args: argparse.Namespace) -> dict:
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    RECORDER.events, RECORDER.hook_calls = [], 0
    loop = make_loop(config, model, optimizer, world, count_hook=True)
    no_sync = config.endswith("_nosync")
    steps = []
    for i, micro in enumerate(rank_batches(args.count_warmup + args.count_steps, rank, world, args)):
        RECORDER.active = i >= args.count_warmup
        RECORDER.events, RECORDER.hook_calls = [], 0
        train_step(loop, model, optimizer, micro, no_sync)
        if RECORDER.active:
            steps.append({"events": RECORDER.events, "hook_calls": RECORDER.hook_calls})
        RECORDER.active = False
    loop.release()
    signature = [[(e["kind"], e["op"], e["bytes"], e["phase"], e["site"]) for e in s["events"]] for s in steps]
    if any(sig != signature[0] for sig in signature):
        raise RuntimeError(f"{config}: the counted steps issued different collectives: {signature}")
    return {"steps": steps}


def latency_probe(bucket_elements: int, iterations: int) -> dict[str, float]:
    """Median ms of blocking collectives on the default group (module doc, step 3)."""
    world = dist.get_world_size()
    bucket = -(-bucket_elements // world) * world
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor  # as collectives.py
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    cases = {
        "all_reduce 1 float32": lambda t=torch.zeros(1): dist.all_reduce(t),
        "all_reduce 31 float32": lambda t=torch.zeros(31): dist.all_reduce(t),
        f"all_reduce {bucket} float32": lambda t=torch.zeros(bucket): dist.all_reduce(t),
        f"reduce_scatter_tensor {bucket} float32":
            lambda i=torch.zeros(bucket), o=torch.zeros(bucket // world): reduce_scatter(o, i),
        f"all_gather_into_tensor {bucket} float32":
            lambda i=torch.zeros(bucket // world), o=torch.zeros(bucket): all_gather(o, i),
    }
    out = {}
    for name, call in cases.items():
        for _ in range(10):
            call()
        times = []
        for _ in range(iterations):
            dist.barrier()
            t0 = time.perf_counter()
            call()
            times.append(time.perf_counter() - t0)
        out[name] = 1e3 * harness.median_of(times)
    return out


def run_rank(rank: int, world: int, configs: list[str], count: bool, args: argparse.Namespace) -> dict:
    """This rank's share of one launch: the timed runs, the counted ones (``count``), the latency probe."""
    results = {"timed": run_timed(configs, rank, world, args)}
    if count:
        RECORDER.install()
        try:
            results["counted"] = {config: run_counted(config, rank, world, args) for config in configs}
        finally:
            RECORDER.uninstall()
    bucket_elements = sum(p.numel() for p in build_model().parameters())
    results["latency_ms"] = latency_probe(bucket_elements, args.probe_iterations)
    return results


# --- summaries ------------------------------------------------------------------------------------------------

KIND_SHORT = {"all_reduce": "AR", "reduce_scatter_tensor": "RS", "all_gather_into_tensor": "AG",
              "broadcast": "BC", "_broadcast_coalesced": "BC", "reduce_scatter": "RS (list)",
              "all_gather": "AG (list)"}


def count_summary(ranks: list[dict], config: str) -> dict:
    """One configuration's collectives per step (rank 0's; every rank issues the same ones)."""
    per_rank = [r["counted"][config]["steps"] for r in ranks]
    for r, steps in enumerate(per_rank[1:], start=1):
        if [(e["kind"], e["bytes"]) for e in steps[0]["events"]] != \
                [(e["kind"], e["bytes"]) for e in per_rank[0][0]["events"]]:
            raise RuntimeError(f"{config}: rank {r} issued other collectives than rank 0")
    events = per_rank[0][0]["events"]
    by_kind: dict[str, dict] = {}
    for e in events:
        entry = by_kind.setdefault(e["kind"], {"calls": 0, "bytes": 0})
        entry["calls"] += 1
        entry["bytes"] += e["bytes"]
    sites: dict[tuple, dict] = {}
    for i, e in enumerate(events):
        key = (e["phase"], e["site"], e["kind"], e["op"], e["bytes"], e["async"])
        entry = sites.setdefault(key, {"phase": e["phase"], "site": e["site"], "kind": e["kind"], "op": e["op"],
                                       "bytes": e["bytes"], "async": e["async"], "calls": 0, "sync_ms": []})
        entry["calls"] += 1
        if e["sync_ms"] is not None:  # the slowest rank's median over the counted steps, for each occurrence
            entry["sync_ms"].append(max(harness.median_of(s["events"][i]["sync_ms"] for s in steps)
                                        for steps in per_rank))
    site_list = []
    for entry in sites.values():
        entry["sync_ms"] = sum(entry["sync_ms"]) if entry["sync_ms"] else None
        site_list.append(entry)
    small = [e for e in events if e["bytes"] <= 1024]
    return {"collectives": len(events), "bytes": sum(e["bytes"] for e in events), "by_kind": by_kind,
            "small_collectives": len(small), "hook_calls": per_rank[0][0]["hook_calls"], "sites": site_list,
            "sync_ms_total": sum(e["sync_ms"] or 0.0 for e in site_list)}


def references(config: str, configs: list[str]) -> dict[str, str]:
    """What a configuration's step time is divided by, pair by pair in each launch: ``ddp`` with the same
    no_sync setting, and for a session variant the default session with the same setting."""
    nosync = config.endswith("_nosync")
    out = {"ddp": "ddp_nosync" if nosync and "ddp_nosync" in configs else "ddp"}
    if config.startswith("session_") and config not in ("session_nosync",):
        session = "session_nosync" if nosync else "session"
        if session in configs:
            out["session"] = session
    return out


def timing_summary(ranks: list[dict], config: str) -> dict:
    return {f"{phase}_ms": harness.slowest_ms(r["timed"][config]["phases"][phase] for r in ranks) for phase in PHASES}


def print_tables(rows: list[dict], counts: dict, latency: dict) -> None:
    def kind_cell(row_counts: dict, kinds: tuple[str, ...]) -> str:
        calls = sum(row_counts["by_kind"].get(k, {}).get("calls", 0) for k in kinds)
        nbytes = sum(row_counts["by_kind"].get(k, {}).get("bytes", 0) for k in kinds)
        return "0" if not calls else f"{calls} ({_fmt_bytes(nbytes)})"

    header = ["config", "world", "collectives/step", "all-reduce", "reduce-scatter", "all-gather", "broadcast",
              "≤1 KiB", "bytes/step", "c10d ops (profiler)", "step ms", "vs ddp", "vs ddp, paired",
              "vs session, paired", "micro-batches ms", "clip ms", "opt ms", "settle ms"]
    table = []
    for r in rows:
        c = counts[(r["config"], r["world"])]
        table.append([
            r["config"], r["world"], c["collectives"], kind_cell(c, ("all_reduce",)),
            kind_cell(c, ("reduce_scatter_tensor", "reduce_scatter")),
            kind_cell(c, ("all_gather_into_tensor", "all_gather")), kind_cell(c, ("broadcast", "_broadcast_coalesced")),
            c["small_collectives"], _fmt_bytes(c["bytes"]), r["c10d_ops"], f"{r['step_ms']:.2f}",
            f"{r['step_vs_ddp']:.2f}", f"{r['vs_ddp']:.2f}", harness.fmt(r["vs_session"]),
            f"{r['micro_batches_ms']:.2f}", f"{r['clip_ms']:.2f}", f"{r['optimizer_ms']:.2f}", f"{r['settle_ms']:.2f}"])
    print(harness.markdown_table(header, table))
    for world in sorted({w for _, w in counts}):
        print(f"\nWhere each collective of a step comes from, world {world} (sync ms: the slowest rank's median "
              "wall time inside the call, synchronous calls only):\n")
        sites = [[config, s["phase"], f"`{s['site']}`", KIND_SHORT.get(s["kind"], s["kind"]), s["op"] or "-",
                  _fmt_bytes(s["bytes"]), "yes" if s["async"] else "no", s["calls"], harness.fmt(s["sync_ms"], ".3f")]
                 for (config, w), c in counts.items() if w == world for s in c["sites"]]
        print(harness.markdown_table(["config", "phase", "issued by", "kind", "op", "bytes", "async", "calls",
                                      "sync ms"], sites))
        print(f"\nLatency probe, world {world} (ms, blocking, median of the slowest rank over repeats): "
              + ", ".join(f"{name} {ms:.3f}" for name, ms in latency[world].items()))


def _fmt_bytes(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    if n < 2**20:
        return f"{n / 1024:.1f} KiB"
    return f"{n / 2**20:.2f} MiB"


@dataclass
class Collected:
    """What the launches gave, by (configuration, world): timings of each run, rank 0's profiler counts and final
    parameters, the counted collectives (first repeat), and the latency probe's medians by world."""

    timings: dict[tuple[str, int], list[dict]] = field(default_factory=dict)
    c10d: dict[tuple[str, int], list[dict]] = field(default_factory=dict)
    params: dict[tuple[str, int], list[torch.Tensor]] = field(default_factory=dict)
    counts: dict[tuple[str, int], dict] = field(default_factory=dict)
    latency_runs: dict[int, list[dict]] = field(default_factory=dict)

    def add(self, world: int, order: list[str], ranks: list[dict], configs: list[str], counted: bool) -> None:
        for config in order:
            self.timings.setdefault((config, world), []).append(timing_summary(ranks, config))
        for config in order:  # ratios within this launch (the same processes, interleaved)
            this = self.timings[(config, world)][-1]
            for name, reference in references(config, configs).items():
                this[f"vs_{name}"] = this["step_ms"] / self.timings[(reference, world)][-1]["step_ms"]
        for config in order:
            self.c10d.setdefault((config, world), []).append(ranks[0]["timed"][config]["c10d_ops"])
            self.params.setdefault((config, world), []).append(ranks[0]["timed"][config]["params"])
            if counted:
                self.counts[(config, world)] = count_summary(ranks, config)
        self.latency_runs.setdefault(world, []).append(
            {name: max(r["latency_ms"][name] for r in ranks) for name in ranks[0]["latency_ms"]})


def collect(args: argparse.Namespace) -> Collected:
    """Every repeat and world: one launch of every configuration, the order rotated each repeat."""
    collected = Collected()
    for repeat, order in harness.interleave(args.configs, args.repeats):
        for world in args.worlds:
            if world != args.worlds[0] and repeat >= args.other_world_repeats:
                continue
            ranks = harness.run_ranks(run_rank, world, order, repeat == 0, args, start_method="fork")
            collected.add(world, order, ranks, args.configs, counted=repeat == 0)
    return collected


def table_rows(collected: Collected, args: argparse.Namespace) -> list[dict]:
    """One row per configuration and world: medians over repeats, and the step against ``ddp``'s."""
    rows = []
    for world in args.worlds:
        for config in args.configs:
            runs = collected.timings[(config, world)]
            c10d = collected.c10d[(config, world)]
            row = {"config": config, "world": world, "runs": len(runs), **harness.medians(runs)}
            row.setdefault("vs_session", None)
            row["step_ms_each_run"] = [run["step_ms"] for run in runs]
            ops = {json.dumps(o, sort_keys=True) for o in c10d}
            row["c10d_ops"] = sum(c10d[0].values()) if len(ops) == 1 else "varies"
            row["c10d_ops_by_name"] = c10d[0]
            rows.append(row)
        base = {False: next(r for r in rows if r["world"] == world and r["config"] == "ddp")}
        nosync = [r for r in rows if r["world"] == world and r["config"] == "ddp_nosync"]
        base[True] = nosync[0] if nosync else base[False]
        for r in rows:
            if r["world"] == world:
                r["step_vs_ddp"] = r["step_ms"] / base[r["config"].endswith("_nosync")]["step_ms"]  # of medians
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="few steps and one repeat (a smoke test)")
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 3], help="numbers of gloo ranks")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    parser.add_argument("--micro", type=int, default=2, help="micro-batches of accumulation per step")
    parser.add_argument("--rows", type=int, default=4, help="rows per rank per micro-batch (16 tokens each)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None, help="interleaved runs of every configuration")
    parser.add_argument("--other-world-repeats", type=int, default=3,
                        help="at most this many repeats for every world after the first (3 ranks share 2 cores slowly)")
    parser.add_argument("--count-steps", type=int, default=3)
    parser.add_argument("--count-warmup", type=int, default=3)
    parser.add_argument("--probe-iterations", type=int, default=None)
    parser.add_argument("--out", default=str(harness.RESULTS / "session_collectives_cpu.json"))
    args = parser.parse_args(argv)
    harness.quick_defaults(args, steps=(5, 30), warmup=(2, 5), repeats=(1, 5), probe_iterations=(20, 100))
    if "ddp" not in args.configs:
        args.configs = ["ddp", *args.configs]
    clock = harness.Clock()
    collected = collect(args)
    rows = table_rows(collected, args)
    latency = {world: harness.medians(runs) for world, runs in collected.latency_runs.items()}
    errors = {f"{config}@{world}": max(harness.relative_error(p, ref) for p in params
                                        for ref in collected.params[("ddp", world)])
              for (config, world), params in collected.params.items() if config != "ddp"}

    print(f"\nexample GPT (33,440 parameters), AdamW, {args.micro} micro-batches of {args.rows} rows x 16 tokens per "
          f"rank per step, clip 1.0; {args.steps} timed steps x {args.repeats} interleaved repeats "
          f"({min(args.repeats, args.other_world_repeats)} beyond {args.worlds[0]} ranks), medians of the "
          f"slowest rank; vs ddp: against ddp with the same no_sync setting (torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs, {harness.cpu_model()}, {clock.elapsed_s():.0f} s)\n")
    print_tables(rows, collected.counts, latency)
    worst = harness.report_errors(errors, "ddp")

    out = harness.write_json(args.out, {
        "machine": clock.machine(threads=1), "args": vars(args), "rows": rows,
        "counts": {f"{config}@{world}": c for (config, world), c in collected.counts.items()},
        "latency_ms": {str(w): v for w, v in latency.items()},
        "runs": {f"{config}@{world}": t for (config, world), t in collected.timings.items()},
        "max_rel_error_vs_ddp": errors})
    print(f"wrote {out}")
    harness.exit_if_above(worst, FAIL_ABOVE, "ddp")


if __name__ == "__main__":
    main()
