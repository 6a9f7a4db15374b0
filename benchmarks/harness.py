"""The plumbing every benchmark shares, written once.

A script in ``benchmarks/`` keeps its measurement (the models, the timed step, what is
compared) and its argument parser; this module gives it the rest:

* processes: :func:`run_ranks` runs a function on N fresh processes joined in one gloo
  group on 127.0.0.1 (a port from :func:`free_port`) and returns what each rank returned;
  :func:`run_script` runs a command line in a fresh process from the repository root
  (tried again if it leaves no result) and reads the JSON it wrote;
* options: :func:`quick_defaults`, the defaults of options that differ with ``--quick``;
* order: :func:`rotated` and :func:`interleave`: configurations interleaved over repeats,
  the order rotated every repeat, so that a change of machine load hits all of them alike;
* statistics (``statistics.median``): :func:`summary` (median, min, max of samples),
  :func:`median_of`, :func:`medians`, :func:`slowest_ms`; :func:`flat_params`,
  :func:`relative_error`, :func:`report_errors` and :func:`exit_if_above`, to compare final
  weights across runs;
* timing: :func:`time_ms` and :func:`time_interleaved_ms` (CUDA events on a GPU, the wall
  clock elsewhere); :class:`PeakRSS`, the peak resident set size while a block runs;
* the machine: :func:`cpu_model`, :func:`machine` (CPU model and count, thread count,
  platform, Python and torch versions, load average) and :class:`Clock` (a run's wall time and load average);
* output: :func:`write_json`, :func:`markdown_table`, :func:`write_between_markers`,
  :func:`fixed_width` (a table for the terminal), :func:`fmt`, :func:`pyplot` and
  :func:`save_figure`.

Scripts import it as ``from benchmarks import harness`` after putting the repository root
on ``sys.path``. It imports torch but never ``lightning_layerwise``, so that a script can
still choose which checkout that comes from (``bench_backward_memory.py --repo``).
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence, TypeVar

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
T = TypeVar("T")


# --- processes ---------------------------------------------------------------------------------------------------

def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _environ(**values: str) -> Iterator[None]:
    """``os.environ`` with ``values`` set while inside (for the processes started there), restored after."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _rank_main(rank: int, world: int, port: int, outdir: str, fn: Callable[..., Any], args: tuple, threads: int,
               timeout_s: float) -> None:
    faulthandler.enable()  # a crashing rank prints where it was
    torch.set_num_threads(threads)
    os.environ.update(OMP_NUM_THREADS=str(threads), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
    try:
        result = fn(rank, world, *args)
        torch.save(result, os.path.join(outdir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()  # an orderly exit: gloo threads left running can abort the interpreter


def run_ranks(fn: Callable[..., T], world: int, *args: Any, start_method: str = "spawn", threads: int = 1,
              timeout_s: float = 300) -> list[T]:
    """Runs ``fn(rank, world, *args)`` on ``world`` fresh processes and returns each rank's return value, by rank.

    Every process has ``threads`` intra-op threads (``OMP_NUM_THREADS`` too), the torchrun variables
    (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``) and the default process group
    initialized over gloo on a free port of 127.0.0.1; after ``fn`` returns, a barrier and the group's
    destruction. Return values travel through ``torch.save``, so they may hold tensors. With
    ``start_method="spawn"`` ``fn`` and ``args`` must pickle (a module-level function)."""
    with tempfile.TemporaryDirectory() as outdir, _environ(OMP_NUM_THREADS=str(threads)):
        mp.start_processes(_rank_main, args=(world, free_port(), outdir, fn, args, threads, timeout_s),
                           nprocs=world, start_method=start_method)
        return [torch.load(os.path.join(outdir, f"rank{r}.pt"), weights_only=False) for r in range(world)]


@dataclass
class ScriptRun:
    """What :func:`run_script` got back."""

    result: Any
    """The JSON the command wrote."""
    wall_s: float
    exit_code: int


def run_script(command: Callable[[str], list[str]], *, label: str, threads: int | None = 1,
               env: Mapping[str, str] | None = None, timeout_s: float | None = None, attempts: int = 1,
               require_exit_zero: bool = False) -> ScriptRun:
    """Runs ``command(result_path)`` in a fresh process from the repository root; returns the JSON it wrote there.

    The command writes its result to ``result_path``, a file in a temporary folder of its own (removed after
    the run, with anything else the command put next to it). The environment is this one without
    ``MASTER_PORT`` (a launcher inside picks a free port), with ``OMP_NUM_THREADS`` and ``MKL_NUM_THREADS``
    set to ``threads`` (unless ``None``) and ``env`` on top. A run that leaves no result (or, with
    ``require_exit_zero``, exits non-zero) prints the end of its output and is tried again, ``attempts`` times
    in all; then :class:`RuntimeError`."""
    environ = dict(os.environ)
    environ.pop("MASTER_PORT", None)
    if threads is not None:
        environ["OMP_NUM_THREADS"] = environ["MKL_NUM_THREADS"] = str(threads)
    environ.update(env or {})
    for attempt in range(1, attempts + 1):
        with tempfile.TemporaryDirectory() as tmp:
            result = os.path.join(tmp, "result.json")
            t0 = time.perf_counter()
            proc = subprocess.run(command(result), cwd=ROOT, env=environ, capture_output=True, text=True,
                                  timeout=timeout_s)
            wall = time.perf_counter() - t0
            if os.path.exists(result) and (proc.returncode == 0 or not require_exit_zero):
                return ScriptRun(json.loads(Path(result).read_text()), wall, proc.returncode)
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-6000:])
        print(f"  {label}: attempt {attempt} failed with exit code {proc.returncode}", flush=True)
    raise RuntimeError(f"{label}: failed {attempts} time(s); its output is above")


# --- options -----------------------------------------------------------------------------------------------------

def quick_defaults(args: argparse.Namespace, **defaults: tuple[Any, Any]) -> argparse.Namespace:
    """Gives every option named in ``defaults`` that was left unset (``None`` or 0) its ``(quick, full)`` value:
    the first with ``--quick`` (``args.quick``), the second without."""
    for name, (quick, full) in defaults.items():
        if not getattr(args, name):
            setattr(args, name, quick if args.quick else full)
    return args


# --- order -------------------------------------------------------------------------------------------------------

def rotated(items: Sequence[T], shift: int) -> list[T]:
    """``items`` rotated left by ``shift`` places (modulo their number): round ``shift`` of an interleaved run."""
    k = shift % len(items) if items else 0
    return list(items[k:]) + list(items[:k])


def interleave(items: Sequence[T], repeats: int) -> Iterator[tuple[int, list[T]]]:
    """``(repeat, order)`` for every repeat: all of ``items``, rotated one more place each repeat."""
    for repeat in range(repeats):
        yield repeat, rotated(items, repeat)


# --- statistics --------------------------------------------------------------------------------------------------

def summary(samples: Sequence[float], unit: str = "ms") -> dict[str, float]:
    """``median_<unit>``, ``min_<unit>``, ``max_<unit>`` and ``samples`` (their number; zeros when there are none)."""
    if not samples:
        return {f"median_{unit}": 0.0, f"min_{unit}": 0.0, f"max_{unit}": 0.0, "samples": 0}
    return {f"median_{unit}": statistics.median(samples), f"min_{unit}": min(samples), f"max_{unit}": max(samples),
            "samples": len(samples)}


def median_of(values: Iterable[float | None]) -> float | None:
    """The median of the values that are not ``None``; ``None`` if there are none."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def medians(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Key by key (the first run's keys), the :func:`median_of` over ``runs``."""
    return {key: median_of(run[key] for run in runs) for key in runs[0]}


def slowest_ms(per_rank_seconds: Iterable[Sequence[float]]) -> float:
    """Milliseconds: every rank's median over its steps (seconds each), the slowest rank's."""
    return 1e3 * max(statistics.median(seconds) for seconds in per_rank_seconds)


def relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    """``|value - reference| / |reference|`` (Frobenius norms)."""
    return ((value - reference).norm() / reference.norm()).item()


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    """Every parameter of ``model``, float64, in one flat tensor (to compare final weights across runs)."""
    return torch.cat([p.detach().double().flatten() for p in model.parameters()])


def report_errors(errors: Mapping[str, float], reference: str, tolerance: float | None = None) -> float:
    """Prints the relative errors of final parameters against ``reference``'s at the same world (the largest
    first, then each, then with ``tolerance`` whether within it); returns the largest (0 when there are none)."""
    worst = max(errors.values(), default=0.0)
    verdict = ""
    if tolerance is not None:
        verdict = f"; {'within' if worst <= tolerance else 'ABOVE'} the {tolerance:.0e} tolerance"
    print(f"\nfinal parameters vs {reference} at the same world, max relative error: {worst:.1e} ("
          + ", ".join(f"{name} {error:.1e}" for name, error in errors.items()) + f"){verdict}")
    return worst


def exit_if_above(worst: float, limit: float, reference: str) -> None:
    """Ends the script with an error when the largest relative error of :func:`report_errors` is above ``limit``."""
    if worst > limit:
        sys.exit(f"FAILED: final parameters differ from {reference}'s by a relative error of {worst:.1e} "
                 f"(> {limit:.0e})")


# --- timing ------------------------------------------------------------------------------------------------------

def sync(device: torch.device) -> None:
    """Waits for the device's queued work (nothing to wait for off CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _sample_ms(fn: Callable[[], object], device: torch.device, inner: int) -> float:
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / inner
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - t0) * 1e3 / inner


def time_interleaved_ms(fns: Mapping[str, Callable[[], object]], device: torch.device, warmup: int, repeats: int,
                        inner: int = 1) -> dict[str, list[float]]:
    """Per-call milliseconds of each of ``fns``: ``repeats`` samples, the functions taking turns sample by sample
    (so a change of machine load hits them alike), each sample the mean of ``inner`` back-to-back calls between
    two CUDA events (the wall clock off CUDA), after ``warmup`` calls of each."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    sync(device)
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            samples[name].append(_sample_ms(fn, device, inner))
    return samples


def time_ms(fn: Callable[[], object], device: torch.device, warmup: int, repeats: int, inner: int = 1) -> list[float]:
    """:func:`time_interleaved_ms` of one function."""
    return time_interleaved_ms({"fn": fn}, device, warmup, repeats, inner)["fn"]


class PeakRSS:
    """The peak resident set size of this process while open, sampled by a thread every ``interval_s``.

    Use as a context manager, or :meth:`start` and :meth:`stop` where the block spans two calls. After it:
    ``rise`` (bytes, the peak minus the RSS at the start) and ``seconds`` (wall time open). Linux only
    (``/proc/self/statm``)."""

    def __init__(self, interval_s: float = 1e-3) -> None:
        self.interval_s = interval_s
        self._page = os.sysconf("SC_PAGE_SIZE")
        self.baseline = self.peak = self.rise = 0
        self.seconds = 0.0

    def rss(self) -> int:
        return int(os.pread(self._statm, 128, 0).split()[1]) * self._page

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.rss())
            time.sleep(self.interval_s)

    def start(self) -> "PeakRSS":
        self._statm = os.open("/proc/self/statm", os.O_RDONLY)
        self.baseline = self.peak = self.rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        self._t0 = time.perf_counter()
        return self

    def stop(self) -> "PeakRSS":
        self.seconds = time.perf_counter() - self._t0
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.rss())
        self.rise = self.peak - self.baseline
        os.close(self._statm)
        return self

    def __enter__(self) -> "PeakRSS":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# --- the machine -------------------------------------------------------------------------------------------------

def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine(threads: int | None = None) -> dict[str, Any]:
    """The machine and software a result came from. ``threads``: intra-op threads per process (default: this
    process's); ``load_average``: now (1, 5, 15 minutes)."""
    return {"cpu_model": cpu_model(), "cpu_count": os.cpu_count(), "threads": threads or torch.get_num_threads(),
            "platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "load_average": list(os.getloadavg())}


class Clock:
    """One benchmark run from its creation: the wall time since, and the load average at its start and now."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.load_at_start = list(os.getloadavg())

    def elapsed_s(self) -> float:
        return time.perf_counter() - self.started

    def machine(self, threads: int | None = None) -> dict[str, Any]:
        """:func:`machine`, with ``load_average_at_start`` and ``load_average_at_end`` (now)."""
        now = machine(threads)
        return {**now, "load_average_at_start": self.load_at_start, "load_average_at_end": now["load_average"]}


# --- output ------------------------------------------------------------------------------------------------------

def write_json(path: str | Path, data: Any, indent: int = 1) -> Path:
    """Writes ``data`` as JSON (folders created as needed); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=indent) + "\n")
    return path


def fmt(value: Any, spec: str = ".2f", empty: str = "-") -> str:
    """``format(value, spec)``, or ``empty`` for ``None``."""
    return empty if value is None else format(value, spec)


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A markdown table: ``| a | b |``, ``|---|---|``, then one line per row (cells as ``str`` gives them)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


@dataclass(frozen=True)
class Column:
    """One column of :func:`fixed_width`: its title, width, the format spec of its values, the alignment."""

    title: str
    width: int
    spec: str = ""
    align: str = ">"


def fixed_width(columns: Sequence[Column], rows: Iterable[Sequence[object]], empty: str = "-") -> str:
    """A table for the terminal: each cell ``fmt(value, spec, empty)`` aligned in its column's width, one space
    between columns, the titles first."""
    def line(cells: Iterable[str]) -> str:
        return " ".join(format(cell, f"{c.align}{c.width}") for c, cell in zip(columns, cells))

    lines = [line(c.title for c in columns)]
    lines += [line(fmt(value, c.spec, empty) for c, value in zip(columns, row)) for row in rows]
    return "\n".join(lines)


TABLE_START, TABLE_END = "<!-- table:start -->", "<!-- table:end -->"


def write_between_markers(path: Path, text: str, start: str = TABLE_START, end: str = TABLE_END,
                          title: str = "Results") -> None:
    """Puts ``text`` between the lines ``start`` and ``end`` of the markdown file ``path``, keeping the prose around
    them; appends the marked block where the markers are missing, and starts a file headed ``title`` where there
    is none."""
    block = f"{start}\n{text}\n{end}"
    if path.exists() and start in (old := path.read_text()):
        head, _, rest = old.partition(start)
        _, _, tail = rest.partition(end)
        path.write_text(head + block + tail)
    elif path.exists():
        path.write_text(path.read_text().rstrip() + f"\n\n{block}\n")
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"# {title}\n\n{block}\n")


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path, dpi: int = 110) -> Path:
    """Saves ``fig`` at ``path`` (folders created as needed); returns the path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    return path
