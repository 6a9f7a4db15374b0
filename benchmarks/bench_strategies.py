"""Lightning ``ddp`` against ``layerwise``, each with AdamW and with Muon, on the example GPT.

Run from the repository root (default: the example GPT of ``examples/configs/cpu.yaml``,
2 CPU processes on gloo, 3 interleaved repeats of 4 configurations, 25 timed steps
each; 3 to 6 minutes on 2 shared CPU cores, depending on their load)::

    .venv/bin/python benchmarks/bench_strategies.py
    .venv/bin/python benchmarks/bench_strategies.py --steps 40 --repeats 5 --n-layer 6 --n-embd 256
    python benchmarks/bench_strategies.py --accelerator gpu --devices 8 --batch-size 32 --n-layer 12 --n-embd 768

Configurations (peers in the same run, same seed, same data order, same initial weights):

    ddp_adamw        Trainer(strategy="ddp"),       torch.optim.AdamW
    ddp_muon         Trainer(strategy="ddp"),       llw.Muon, replicated: every rank runs
                     Newton-Schulz on every matrix and keeps the full optimizer state
    layerwise_adamw  Trainer(strategy="layerwise"), torch.optim.AdamW on the owned params
    layerwise_muon   Trainer(strategy="layerwise"), llw.Muon on the owned params

AdamW: ``lr=1e-3, betas=(0.9, 0.95), weight_decay=0`` (the best of a short sweep, see
docs/benchmarks.md). Muon as in cpu.yaml: ``lr=0.02`` (momentum 0.95, Nesterov, 5
Newton-Schulz steps in bf16), ``adamw_lr=3e-3`` for embeddings, the tied head, biases
and norms. Gradient clipping by norm 1.0 and ``LayerwiseStrategy(bucket_size=200_000)``,
as in cpu.yaml.

Each configuration runs in a fresh ``python benchmarks/bench_strategies.py --_worker NAME``
subprocess with ``OMP_NUM_THREADS=1`` per rank on CPU. Lightning's subprocess launcher
re-runs that same command line for ranks 1..N-1, so the worker entry point is the
same on every rank; rank 0 writes the result. Repeats are interleaved round-robin
(the order rotates every repeat) so a change of machine load hits every
configuration alike; the report gives medians over repeats.

Measured per run, after ``--warmup`` steps, over ``--steps`` steps (wall times are
the maximum over ranks of each step, then the median over steps):

* step: wall time between ``on_train_batch_end`` of consecutive steps (data, forward,
  backward, communication, clipping, optimizer, the layer-wise all-gather), and the
  CPU time the rank's process spent in it (all its threads; robust to time the
  process was not scheduled on a shared machine, but it includes gloo's threads);
* fwd+bwd: ``on_train_batch_start`` to ``on_before_optimizer_step`` (includes waiting
  for the gradient reduction, and under ``layerwise`` for the all-gathers that the
  forward pre-hooks await);
* clip: ``on_before_optimizer_step`` to the end of ``configure_gradient_clipping``
  (under ``layerwise`` it includes the all-reduce of the global norm);
* opt: end of clipping to the optimizer's step post-hook, i.e. the parameter update
  alone, as wall time and as the main thread's CPU time;
* optimizer-state bytes: the sum of tensor bytes in ``optimizer.state``, per rank, at
  its peak (after a step), gathered from every rank;
* parameter and gradient bytes per rank: distinct storages behind the parameters and
  their ``.grad`` (for ``layerwise``: the flat buffers, padding included); ``ddp``'s
  internal bucket copy of the gradients is reported separately when torch exposes it;
* the training loss of every step (mean over ranks = the global batch's loss).

Note [overlap in the benchmark]
    The probe callback overrides ``on_train_batch_end``, so with
    ``overlap_param_gather="auto"`` (the strategy's default) the strategy would
    complete the all-gather inside every step, assuming the callback reads
    parameters. It only reads the loss and the clock, so the benchmark passes
    ``overlap_param_gather=True`` (the all-gather overlaps the next forward, as in
    a run without such callbacks); ``--overlap-param-gather false`` measures the
    non-overlapped step.

On CUDA every timestamp is taken after ``torch.cuda.synchronize()`` and the peak of
``torch.cuda.max_memory_allocated`` is reported; on CPU the peak RSS of each rank.

Writes ``benchmarks/results/strategies_<accelerator>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CONFIGS: dict[str, tuple[str, str]] = {
    "ddp_adamw": ("ddp", "adamw"),
    "ddp_muon": ("ddp", "muon"),
    "layerwise_adamw": ("layerwise", "adamw"),
    "layerwise_muon": ("layerwise", "muon"),
}
BASELINE = "ddp_adamw"
LAST_K = 10  # steps averaged for the "late loss" column
# (name, from event, to event, clock): the intervals of one step that are reported.
# Events: start = on_train_batch_start, grads = on_before_optimizer_step, clipped = end of
# configure_gradient_clipping, stepped = optimizer step post-hook, end = on_train_batch_end.
# "end" with from "end" means from the previous step's end.
INTERVALS = (
    ("step", "end", "end", "wall"),
    ("step_cpu", "end", "end", "process"),
    ("fwd_bwd", "start", "grads", "wall"),
    ("clip", "grads", "clipped", "wall"),
    ("opt", "clipped", "stepped", "wall"),
    ("opt_cpu", "clipped", "stepped", "thread"),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--accelerator", default="cpu", choices=["cpu", "gpu", "cuda"])
    parser.add_argument("--devices", type=int, default=2, help="processes (ranks) per configuration")
    parser.add_argument("--steps", type=int, default=25, help="timed optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before them (>= 1)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per configuration, interleaved")
    parser.add_argument("--batch-size", type=int, default=16, help="per rank (cpu.yaml: 16)")
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--adamw-lr", type=float, default=1e-3, help="lr of the AdamW configurations")
    parser.add_argument("--muon-lr", type=float, default=0.02, help="Muon lr of the hidden matrices")
    parser.add_argument("--muon-adamw-lr", type=float, default=3e-3, help="Muon's adamw_lr (cpu.yaml)")
    parser.add_argument("--ns-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--bucket-size", type=int, default=200_000, help="layerwise bucket_size (cpu.yaml)")
    parser.add_argument("--overlap-param-gather", default="true", choices=["true", "false", "auto"],
                        help="layerwise overlap_param_gather; see Note [overlap in the benchmark]")
    parser.add_argument("--gradient-clip-val", type=float, default=1.0, help="0 disables clipping")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--threads", type=int, default=1, help="torch/OMP threads per rank on CPU")
    parser.add_argument("--max-chars", type=int, default=2_000_000, help="corpus size (cpu.yaml)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset of " + ",".join(CONFIGS))
    parser.add_argument("--timeout", type=float, default=900, help="seconds per run before it is killed")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/strategies_<acc>.json)")
    # Internal: one configuration in this process (and, via Lightning's launcher, its peers).
    parser.add_argument("--_worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--_result", default=None, help=argparse.SUPPRESS)
    return parser


# ---------------------------------------------------------------------------------------
# Worker: one configuration, every rank
# ---------------------------------------------------------------------------------------


def run_worker(args: argparse.Namespace) -> None:
    if args.accelerator == "cpu":
        # Before torch creates its thread pool; the env vars also reach the launched ranks.
        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(args.threads)
    import lightning as L
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(ROOT))
    import lightning_layerwise as llw
    from examples.data import CharDataModule
    from examples.module import GPTLightningModule

    if args.accelerator == "cpu":
        torch.set_num_threads(args.threads)
    strategy_name, optimizer_name = CONFIGS[args._worker]
    cuda = args.accelerator in ("gpu", "cuda")

    def make_optimizer(groups):
        if optimizer_name == "adamw":
            return torch.optim.AdamW(groups, lr=args.adamw_lr, betas=(0.9, 0.95), weight_decay=0.0)
        return llw.Muon(groups, lr=args.muon_lr, adamw_lr=args.muon_adamw_lr,
                        ns_dtype=getattr(torch, args.ns_dtype))

    class Probe(L.Callback):
        """Clock readings at five points of every step, and memory, on this rank."""

        def __init__(self) -> None:
            self.marks: dict[str, list[dict[str, float]]] = {
                e: [] for e in ("start", "grads", "clipped", "stepped", "end")}
            self.losses: list[float] = []
            self.state_bytes_peak = 0
            self.param_bytes = 0
            self.grad_bytes = 0
            self.ddp_bucket_bytes: int | None = None

        def mark(self, event: str) -> None:
            if cuda:
                torch.cuda.synchronize()
            self.marks[event].append({"wall": time.perf_counter(), "thread": time.thread_time(),
                                      "process": time.process_time()})

        def on_train_start(self, trainer, pl_module) -> None:
            if cuda:  # here the rank's device is set; earlier would touch GPU 0 from every rank
                torch.cuda.reset_peak_memory_stats()
            self.param_bytes = _storage_bytes(p for p in pl_module.parameters())
            trainer.optimizers[0].register_step_post_hook(self._after_optimizer_step)
            self.ddp_bucket_bytes = _ddp_bucket_bytes(trainer.strategy.model)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self.mark("start")

        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            self.mark("grads")
            self.grad_bytes = max(self.grad_bytes, _storage_bytes(
                p.grad for p in pl_module.parameters() if p.grad is not None))

        def _after_optimizer_step(self, optimizer, args_, kwargs_) -> None:
            self.mark("stepped")
            state = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
                        if torch.is_tensor(t))
            self.state_bytes_peak = max(self.state_bytes_peak, state)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.mark("end")
            self.losses.append(float(outputs["loss"].detach()))

    class TimedGPT(GPTLightningModule):
        # Lightning calls this hook every step, with or without clipping: the end of it
        # separates clipping from the optimizer's own step.
        def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
            super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
            probe.mark("clipped")

    L.seed_everything(args.seed, verbose=False)
    dm = CharDataModule(block_size=args.block_size, batch_size=args.batch_size, max_chars=args.max_chars,
                        seed=args.seed)
    model = TimedGPT(vocab_size=dm.vocab_size, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
                     block_size=args.block_size, optimizer=make_optimizer)
    probe = Probe()
    strategy: Any = strategy_name
    if strategy_name == "layerwise":
        overlap = {"true": True, "false": False, "auto": "auto"}[args.overlap_param_gather]
        strategy = llw.LayerwiseStrategy(bucket_size=args.bucket_size, overlap_param_gather=overlap)
    trainer = L.Trainer(
        accelerator="gpu" if cuda else "cpu", devices=args.devices, strategy=strategy, precision=args.precision,
        max_steps=args.warmup + args.steps, gradient_clip_val=args.gradient_clip_val or None,
        limit_val_batches=0, num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[probe],
    )
    trainer.fit(model, datamodule=dm)

    w = args.warmup
    local: dict[str, Any] = {"rank": trainer.global_rank, "losses": probe.losses}
    for name, a, b, clock in INTERVALS:
        # Step k (k >= warmup) spans end[k-1] .. end[k]; the other intervals lie inside step k.
        begin = probe.marks[a][w - 1:-1] if (a, b) == ("end", "end") else probe.marks[a][w:]
        local[name + "_ms"] = [1e3 * (y[clock] - x[clock]) for x, y in zip(begin, probe.marks[b][w:])]
    local.update(
        optimizer_state_bytes_peak=probe.state_bytes_peak,
        param_bytes=probe.param_bytes,
        grad_bytes=probe.grad_bytes,
        ddp_bucket_bytes=probe.ddp_bucket_bytes,
        peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        cuda_max_allocated_bytes=torch.cuda.max_memory_allocated() if cuda else None,
    )
    ranks = [local]
    if dist.is_available() and dist.is_initialized():
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, local)
    if trainer.global_rank == 0 and args._result:
        Path(args._result).write_text(json.dumps({"config": args._worker, "ranks": ranks}))
    if dist.is_available() and dist.is_initialized():
        # Lightning leaves the process group to interpreter exit, where gloo's threads
        # occasionally abort the process ("terminate called without an active exception").
        dist.barrier()
        dist.destroy_process_group()


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a flat buffer counts once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _ddp_bucket_bytes(model) -> int | None:
    """Bytes of DistributedDataParallel's gradient buckets, if torch reports them."""
    get = getattr(model, "_get_ddp_logging_data", None)
    if get is None:
        return None
    try:
        sizes = get().get("bucket_sizes")
    except Exception:  # a private API: absent or different in other torch versions
        return None
    if isinstance(sizes, str):
        sizes = [int(s) for s in sizes.split(",") if s.strip()]
    return sum(sizes) if sizes else None


# ---------------------------------------------------------------------------------------
# Driver: fresh subprocess per run, round-robin repeats, medians and ratios
# ---------------------------------------------------------------------------------------


def worker_command(args: argparse.Namespace, name: str, result: str) -> list[str]:
    skip = {"_worker", "_result", "configs", "repeats", "out", "timeout"}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--_worker", name, "--_result", result]
    for key, value in vars(args).items():
        if key not in skip:
            cmd += [f"--{key.replace('_', '-')}", str(value)]
    return cmd


def run_one(args: argparse.Namespace, name: str, attempts: int = 2) -> dict:
    """One configuration in fresh processes; a run that leaves no result is tried once more."""
    env = dict(os.environ)
    if args.accelerator == "cpu":
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(args.threads)
    env.pop("MASTER_PORT", None)  # Lightning picks a free port for every run
    env["PYTHONWARNINGS"] = "ignore"
    for attempt in range(1, attempts + 1):
        with tempfile.TemporaryDirectory() as tmp:
            result = os.path.join(tmp, "result.json")
            t0 = time.perf_counter()
            proc = subprocess.run(worker_command(args, name, result), cwd=ROOT, env=env, capture_output=True,
                                  text=True, timeout=args.timeout)
            wall = time.perf_counter() - t0
            if os.path.exists(result):
                out = json.loads(Path(result).read_text())
                out["process_wall_s"] = wall
                out["exit_code"] = proc.returncode
                if proc.returncode != 0:
                    print(f"  note: {name} wrote its result but exited with code {proc.returncode}: "
                          f"{proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ''}", flush=True)
                return out
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-6000:])
        print(f"  {name}: attempt {attempt} failed with exit code {proc.returncode}", flush=True)
    raise RuntimeError(f"{name}: worker failed {attempts} times; its output is above")


def summarize_run(run: dict) -> dict:
    """One run: per-step maxima over ranks, medians over steps; memory per rank; losses."""
    ranks = run["ranks"]
    out: dict[str, Any] = {"world": len(ranks), "process_wall_s": run["process_wall_s"],
                           "exit_code": run["exit_code"]}
    for name, *_ in INTERVALS:
        # A step ends when the slowest rank ends it: the maximum over ranks, step by step.
        per_step = [max(values) for values in zip(*(r[name + "_ms"] for r in ranks))]
        out[name + "_ms"] = statistics.median(per_step)
        out[name + "_ms_steps"] = per_step
    out["opt_cpu_ms_per_rank"] = [statistics.median(r["opt_cpu_ms"]) for r in ranks]
    state = [r["optimizer_state_bytes_peak"] for r in ranks]
    losses = [statistics.fmean(values) for values in zip(*(r["losses"] for r in ranks))]
    cuda_bytes = [r["cuda_max_allocated_bytes"] for r in ranks]
    out.update(
        state_bytes_per_rank=state,
        param_bytes_per_rank=max(r["param_bytes"] for r in ranks),
        grad_bytes_per_rank=max(r["grad_bytes"] for r in ranks),
        ddp_bucket_bytes_per_rank=ranks[0]["ddp_bucket_bytes"],
        peak_rss_bytes_per_rank=max(r["peak_rss_bytes"] for r in ranks),
        cuda_max_allocated_bytes_per_rank=max(cuda_bytes) if None not in cuda_bytes else None,
        losses=losses,
        final_loss=losses[-1],
        late_loss=statistics.fmean(losses[-LAST_K:]),
    )
    return out


def aggregate(runs: dict[str, list[dict]]) -> dict[str, dict]:
    table: dict[str, dict] = {}
    for name, rs in runs.items():
        row: dict[str, Any] = {}
        for key, *_ in INTERVALS:
            values = [r[key + "_ms"] for r in rs]
            row[key + "_ms_median"] = statistics.median(values)
            row[key + "_ms_runs"] = values
        row["step_ms_steps_runs"] = [r["step_ms_steps"] for r in rs]
        row["step_cpu_ms_steps_runs"] = [r["step_cpu_ms_steps"] for r in rs]
        first = rs[0]
        row.update(
            opt_cpu_ms_per_rank_median=[statistics.median(v) for v in zip(*(r["opt_cpu_ms_per_rank"] for r in rs))],
            state_bytes_per_rank=first["state_bytes_per_rank"],
            state_bytes_max_per_rank=max(first["state_bytes_per_rank"]),
            state_bytes_sum=sum(first["state_bytes_per_rank"]),
            param_bytes_per_rank=first["param_bytes_per_rank"],
            grad_bytes_per_rank=first["grad_bytes_per_rank"],
            ddp_bucket_bytes_per_rank=first["ddp_bucket_bytes_per_rank"],
            peak_rss_bytes_per_rank_median=statistics.median(r["peak_rss_bytes_per_rank"] for r in rs),
            cuda_max_allocated_bytes_per_rank=first["cuda_max_allocated_bytes_per_rank"],
            final_loss_median=statistics.median(r["final_loss"] for r in rs),
            final_loss_runs=[r["final_loss"] for r in rs],
            late_loss_median=statistics.median(r["late_loss"] for r in rs),
            losses_run0=first["losses"],
            process_wall_s_runs=[r["process_wall_s"] for r in rs],
            exit_codes=[r["exit_code"] for r in rs],
        )
        table[name] = row

    def ratios(row: dict, ref: dict, suffix: str) -> None:
        for key in ("step", "step_cpu", "fwd_bwd", "opt", "opt_cpu"):
            row[f"{key}_ratio_{suffix}"] = row[key + "_ms_median"] / ref[key + "_ms_median"]
        row[f"state_ratio_{suffix}"] = row["state_bytes_max_per_rank"] / ref["state_bytes_max_per_rank"]

    for name, row in table.items():
        if BASELINE in table:
            ratios(row, table[BASELINE], "vs_ddp_adamw")
        peer = table.get("ddp_" + name.split("_", 1)[1])
        if name.startswith("layerwise_") and peer:
            ratios(row, peer, "vs_ddp_same_optimizer")
            row["max_abs_loss_diff_vs_ddp_same_optimizer"] = max(
                abs(a - b) for a, b in zip(row["losses_run0"], peer["losses_run0"]))
    return table


def print_table(table: dict[str, dict], meta: dict) -> None:
    kib, nan = 1024, float("nan")
    print(f"\n{meta['devices']} x {meta['accelerator']} ({meta['backend']}), GPT n_layer={meta['n_layer']} "
          f"n_embd={meta['n_embd']} ({meta['n_params']:,} params), batch {meta['batch_size']}/rank x "
          f"{meta['block_size']}, {meta['steps']} timed steps after {meta['warmup']}, medians of "
          f"{meta['repeats']} interleaved runs (ratio: / ddp_adamw)")
    print(f"{'config':16} {'step ms':>8} {'ratio':>6} {'step CPU ms':>11} {'ratio':>6} {'fwd+bwd ms':>10} "
          f"{'clip ms':>7} {'opt ms':>7} {'ratio':>6} {'opt CPU ms':>10} {'ratio':>6}")
    for name, r in table.items():
        print(f"{name:16} {r['step_ms_median']:8.1f} {r.get('step_ratio_vs_ddp_adamw', nan):6.2f} "
              f"{r['step_cpu_ms_median']:11.1f} {r.get('step_cpu_ratio_vs_ddp_adamw', nan):6.2f} "
              f"{r['fwd_bwd_ms_median']:10.1f} {r['clip_ms_median']:7.2f} {r['opt_ms_median']:7.2f} "
              f"{r.get('opt_ratio_vs_ddp_adamw', nan):6.2f} {r['opt_cpu_ms_median']:10.2f} "
              f"{r.get('opt_cpu_ratio_vs_ddp_adamw', nan):6.2f}")
    print(f"\n{'config':16} {'opt state KiB/rank':>18} {'ratio':>6} {'sum KiB':>8} {'param KiB':>9} "
          f"{'grad KiB':>8} {'ddp bucket KiB':>14} {'final loss':>10} {'last-10 loss':>12} {'max|dloss| vs ddp':>17}")
    for name, r in table.items():
        diff = r.get("max_abs_loss_diff_vs_ddp_same_optimizer")
        bucket = r["ddp_bucket_bytes_per_rank"]
        print(f"{name:16} {r['state_bytes_max_per_rank'] / kib:18.0f} {r.get('state_ratio_vs_ddp_adamw', nan):6.2f} "
              f"{r['state_bytes_sum'] / kib:8.0f} {r['param_bytes_per_rank'] / kib:9.0f} "
              f"{r['grad_bytes_per_rank'] / kib:8.0f} {'-' if bucket is None else f'{bucket / kib:.0f}':>14} "
              f"{r['final_loss_median']:10.4f} {r['late_loss_median']:12.4f} "
              f"{'-' if diff is None else f'{diff:.1e}':>17}")
    print()
    for name, r in table.items():
        if "step_ratio_vs_ddp_same_optimizer" in r:
            print(f"{name} / ddp with the same optimizer: step x{r['step_ratio_vs_ddp_same_optimizer']:.2f} "
                  f"(CPU x{r['step_cpu_ratio_vs_ddp_same_optimizer']:.2f}), optimizer "
                  f"x{r['opt_ratio_vs_ddp_same_optimizer']:.2f} (CPU x{r['opt_cpu_ratio_vs_ddp_same_optimizer']:.2f}), "
                  f"state/rank x{r['state_ratio_vs_ddp_same_optimizer']:.2f}")


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def count_params(args: argparse.Namespace, vocab_size: int) -> int:
    from examples.gpt import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=vocab_size, block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head,
                    n_embd=args.n_embd)
    return sum(p.numel() for p in GPT(cfg).parameters())


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args._worker is not None:
        run_worker(args)
        return
    if args.accelerator == "cuda":
        args.accelerator = "gpu"
    if args.warmup < 1 or args.steps < 2:
        raise ValueError(f"--warmup {args.warmup} --steps {args.steps}: need warmup >= 1 and steps >= 2, "
                         "e.g. --warmup 3 --steps 25.")
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise ValueError(f"--configs: unknown {unknown}; choose from {list(CONFIGS)}.")

    runs: dict[str, list[dict]] = {n: [] for n in names}
    t_start = time.perf_counter()
    load_start = os.getloadavg()[0]
    for rep in range(args.repeats):
        order = names[rep % len(names):] + names[:rep % len(names)]
        for name in order:
            run = summarize_run(run_one(args, name))
            runs[name].append(run)
            print(f"repeat {rep + 1}/{args.repeats} {name:16} step {run['step_ms']:6.1f} ms "
                  f"(CPU {run['step_cpu_ms']:6.1f})  fwd+bwd {run['fwd_bwd_ms']:6.1f}  opt {run['opt_ms']:6.2f} "
                  f"(CPU {run['opt_cpu_ms']:6.2f})  final loss {run['final_loss']:.4f}  "
                  f"[{run['process_wall_s']:.0f} s, load {os.getloadavg()[0]:.1f}]", flush=True)
    table = aggregate(runs)

    import torch

    sys.path.insert(0, str(ROOT))
    from examples.data import CharDataModule

    vocab = CharDataModule(max_chars=args.max_chars).vocab_size
    meta = {
        "accelerator": args.accelerator,
        "backend": "gloo" if args.accelerator == "cpu" else "nccl",
        "devices": args.devices,
        "device_name": (torch.cuda.get_device_name() if args.accelerator == "gpu" and torch.cuda.is_available()
                        else cpu_name()),
        "cpu_count": os.cpu_count(),
        "threads_per_rank": args.threads if args.accelerator == "cpu" else None,
        "load_avg_1min_start": load_start,
        "load_avg_1min_end": os.getloadavg()[0],
        "torch": torch.__version__,
        "n_params": count_params(args, vocab),
        "total_wall_s": time.perf_counter() - t_start,
        **{k: v for k, v in vars(args).items() if not k.startswith("_")},
    }
    print_table(table, meta)
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / f"strategies_{args.accelerator}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "results": table}, indent=2))
    print(f"wrote {out} ({meta['total_wall_s']:.0f} s in all)")


if __name__ == "__main__":
    main()
