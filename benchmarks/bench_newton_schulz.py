"""Newton-Schulz cost of one Muon step on a GPT's matrices: batched vs per-matrix, bf16 vs fp32.

Run (default: n_layer=6, n_embd=384, i.e. the hidden matrices of a small GPT; under a
minute on 2 CPU cores):

    python benchmarks/bench_newton_schulz.py
    python benchmarks/bench_newton_schulz.py --n-layer 12 --n-embd 768 --repeats 5
    python benchmarks/bench_newton_schulz.py --shapes 1152x384,384x384 --count 6 --devices cuda

For every device (CPU, and CUDA when present) and every ``ns_dtype`` it times
``orthogonalize(matrices, batched=True)`` (same shapes stacked into one baddbmm chain)
against ``batched=False`` (one matrix at a time, op for op like torch.optim.Muon),
reports median milliseconds per optimizer step (variants interleaved per repeat), and
measures accuracy on one block's matrices: ``max|sigma - 1|`` and ``mean|sigma - 1|``
over the output's singular values (how orthogonal it is) and the relative Frobenius
distance to the same iteration run in float64 (the error the dtype adds).
Inputs are Gaussian matrices (a stand-in for momentum; real gradients are lower-rank,
which moves ``max|sigma - 1|`` but not the timings).

Writes ``benchmarks/results/newton_schulz_<device>.json`` (``..._threads<N>.json`` with
``--threads N``). On a shared CPU, ``--threads 1`` gives the steadiest numbers: with
every core busy, multi-threaded kernels spend their time waiting at barriers.

``--gram`` times the Gram iteration (``newton_schulz_gram``, Note [Gram Newton-Schulz] in
``optim/orthogonalization.py``) against the standard one on each Llama-3 8B/70B matrix shape,
one matrix per call, and measures both against float64 on the shape divided by 16 (an SVD
of the full shape takes minutes on a CPU); ``--quick`` divides the timed shapes by 4:

    python benchmarks/bench_newton_schulz.py --gram --quick --threads 1

It writes ``newton_schulz_gram_<device>[_quick][_threads<N>].json``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lightning_layerwise.optim.muon_options import NS_SCHEDULES  # noqa: E402
from lightning_layerwise.optim.orthogonalization import (newton_schulz, newton_schulz_gram,  # noqa: E402
                                                          newton_schulz_reference, orthogonalize)
from benchmarks import harness  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
# (rows, cols) of Llama-3 8B's attention and MLP matrices, its K/V projection, and 70B's MLP.
LLAMA3_SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096), (1024, 4096), (8192, 28672)]


def gpt_matrix_shapes(n_layer: int, n_embd: int) -> list[tuple[int, int]]:
    """(out, in) shapes of the Linear weights Muon steps in a GPT-2 style model, block by block."""
    per_block = [(3 * n_embd, n_embd), (n_embd, n_embd), (4 * n_embd, n_embd), (n_embd, 4 * n_embd)]
    return per_block * n_layer


def parse_shapes(text: str, count: int) -> list[tuple[int, int]]:
    shapes = []
    for item in text.split(","):
        rows, _, cols = item.strip().partition("x")
        if not rows.isdigit() or not cols.isdigit():
            raise ValueError(f"--shapes item {item!r} is not ROWSxCOLS, e.g. --shapes 1152x384,384x384")
        shapes.append((int(rows), int(cols)))
    return shapes * count


def accuracy(mats: list[torch.Tensor], steps: int, schedule: str, dtype: torch.dtype) -> dict[str, float]:
    """Orthogonality of the output and its distance to the float64 run of the same iteration."""
    deviations, rel_err = [], 0.0
    for M in mats:
        out = newton_schulz_reference(M, steps, schedule, 1e-7, dtype).double()
        ref = newton_schulz_reference(M.double(), steps, schedule, 1e-7, torch.float64)
        deviations.append((torch.linalg.svdvals(out) - 1).abs())
        rel_err = max(rel_err, ((out - ref).norm() / ref.norm()).item())
    dev = torch.cat(deviations)
    return {"max_abs_sigma_minus_1": dev.max().item(), "mean_abs_sigma_minus_1": dev.mean().item(),
            "rel_err_vs_float64": rel_err}


def bench_device(args: argparse.Namespace, device: torch.device, shapes: list[tuple[int, int]]) -> dict:
    g = torch.Generator().manual_seed(0)
    mats = [torch.randn(s, generator=g).to(device) for s in shapes]
    block = mats[: len(set(shapes))]  # one of each shape, for the accuracy numbers
    rows = []
    for name in args.dtypes.split(","):
        dtype = DTYPES[name]
        row: dict = {"ns_dtype": name}
        variants = {
            key: (lambda b=batched: orthogonalize(mats, args.steps, args.schedule, 1e-7, dtype, batched=b))
            for key, batched in (("batched", True), ("per_matrix", False))
        }
        # Interleaved repeat by repeat, so that a change of machine load (a shared CPU) hits every variant alike
        # rather than biasing the one that ran last.
        for key, times in harness.time_interleaved_ms(variants, device, args.warmup, args.repeats).items():
            stats = harness.summary(times)
            row[f"{key}_ms_median"] = stats["median_ms"]
            row[f"{key}_ms_min"] = stats["min_ms"]
            row[f"{key}_ms_all"] = times
        row["speedup_batched"] = row["per_matrix_ms_median"] / row["batched_ms_median"]
        row["accuracy"] = {s: accuracy([m.cpu() for m in block], args.steps, s, dtype) for s in args.accuracy_schedules}
        rows.append(row)
    return {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else harness.cpu_model(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "load_avg_1min_at_start": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "shapes": [list(s) for s in shapes],
        "n_matrices": len(shapes),
        "ns_steps": args.steps,
        "timed_schedule": args.schedule,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "rows": rows,
    }


def gram_accuracy(M: torch.Tensor, steps: int, schedule: str, dtype: torch.dtype) -> dict[str, dict[str, float]]:
    """``max|sigma - 1|`` and the relative distance to the float64 iteration, standard and Gram path."""
    ref = newton_schulz(M[None].double(), steps, schedule, 1e-7, torch.float64)[0]
    out = {}
    for name, fn in (("standard", newton_schulz), ("gram", newton_schulz_gram)):
        Y = fn(M[None], steps, schedule, 1e-7, dtype)[0].double()
        out[name] = {"max_abs_sigma_minus_1": (torch.linalg.svdvals(Y) - 1).abs().max().item(),
                     "rel_err_vs_float64": ((Y - ref).norm() / ref.norm()).item()}
    return out


def bench_gram(args: argparse.Namespace, device: torch.device) -> dict:
    """Standard vs Gram Newton-Schulz per Llama-3 shape (divided by ``args.scale``), medians of interleaved runs."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for rows_, cols in LLAMA3_SHAPES:
        shape = (rows_ // args.scale, cols // args.scale)
        M = torch.randn(shape, generator=g).to(device)
        small = torch.randn(rows_ // 16, cols // 16, generator=g)
        for name in args.dtypes.split(","):
            dtype = DTYPES[name]
            variants = {"standard": lambda: newton_schulz(M[None], args.steps, args.schedule, 1e-7, dtype),
                        "gram": lambda: newton_schulz_gram(M[None], args.steps, args.schedule, 1e-7, dtype)}
            times = harness.time_interleaved_ms(variants, device, args.warmup, args.repeats)
            row = {"shape": list(shape), "ns_dtype": name,
                   **{f"{k}_ms_median": harness.summary(v)["median_ms"] for k, v in times.items()},
                   **{f"{k}_ms_all": v for k, v in times.items()},
                   "accuracy_shape": list(small.shape),
                   "accuracy": gram_accuracy(small, args.steps, args.schedule, dtype)}
            row["speedup_gram"] = row["standard_ms_median"] / row["gram_ms_median"]
            rows.append(row)
            print(f"{shape} {name}: standard {row['standard_ms_median']:.1f} ms, gram {row['gram_ms_median']:.1f} ms",
                  flush=True)
    return {"device": str(device), **harness.machine(torch.get_num_threads()),
            "scale": args.scale, "ns_steps": args.steps, "schedule": args.schedule, "warmup": args.warmup,
            "repeats": args.repeats, "rows": rows}


def print_gram_table(result: dict) -> None:
    print(f"\n{result['device']}, shapes divided by {result['scale']}, ns_steps={result['ns_steps']} "
          f"({result['schedule']}), median of {result['repeats']}")
    columns = [harness.Column("shape", 12, align="<"), harness.Column("ns_dtype", 9, align="<"),
               harness.Column("standard ms", 12, ".1f"), harness.Column("gram ms", 9, ".1f"),
               harness.Column("speedup", 8), harness.Column("err std/gram", 18),
               harness.Column("max|s-1| std/gram", 18)]
    rows = []
    for r in result["rows"]:
        acc = r["accuracy"]
        rows.append([f"{r['shape'][0]}x{r['shape'][1]}", r["ns_dtype"], r["standard_ms_median"], r["gram_ms_median"],
                     f"{r['speedup_gram']:.2f}x",
                     f"{acc['standard']['rel_err_vs_float64']:.1e}/{acc['gram']['rel_err_vs_float64']:.1e}",
                     f"{acc['standard']['max_abs_sigma_minus_1']:.3f}/{acc['gram']['max_abs_sigma_minus_1']:.3f}"])
    print(harness.fixed_width(columns, rows))


def print_table(result: dict) -> None:
    print(f"\n{result['device']} ({result['device_name']}, {result['threads']} threads, torch {result['torch']}): "
          f"{result['n_matrices']} matrices, ns_steps={result['ns_steps']}, median of {result['repeats']}")
    schedules = list(result["rows"][0]["accuracy"])
    columns = [harness.Column("ns_dtype", 9, align="<"), harness.Column("batched ms", 11, ".1f"),
               harness.Column("per-matrix ms", 14, ".1f"), harness.Column("speedup", 8)]
    for s in schedules:  # two spaces before each schedule's pair of columns
        columns += [harness.Column(s + " max/mean|s-1|", 29), harness.Column("err vs fp64", 11, ".1e")]
    rows = []
    for r in result["rows"]:
        row = [r["ns_dtype"], r["batched_ms_median"], r["per_matrix_ms_median"], f"{r['speedup_batched']:.2f}x"]
        for s in schedules:
            acc = r["accuracy"][s]
            pair = f"{acc['max_abs_sigma_minus_1']:.3f}/{acc['mean_abs_sigma_minus_1']:.3f}"
            row += [pair, acc["rel_err_vs_float64"]]
        rows.append(row)
    print(harness.fixed_width(columns, rows))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n-layer", type=int, default=6)
    parser.add_argument("--n-embd", type=int, default=384)
    parser.add_argument("--shapes", default=None, help="ROWSxCOLS,... instead of the GPT shapes")
    parser.add_argument("--count", type=int, default=1, help="repeat --shapes this many times")
    parser.add_argument("--steps", type=int, default=5, help="Newton-Schulz iterations")
    parser.add_argument("--schedule", default="simple", choices=sorted(NS_SCHEDULES), help="schedule that is timed")
    parser.add_argument("--accuracy-schedules", default=",".join(NS_SCHEDULES),
                        help="schedules whose accuracy is reported")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--devices", default="cpu,cuda", help="devices to run; cuda is skipped when absent")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--out-dir", default=str(harness.RESULTS))
    parser.add_argument("--gram", action="store_true", help="standard vs Gram iteration on the Llama-3 shapes")
    parser.add_argument("--scale", type=int, default=1, help="with --gram: divide each shape's sides by this")
    parser.add_argument("--quick", action="store_true", help="with --gram: --scale 4")
    args = parser.parse_args(argv)
    if args.quick:
        args.scale = 4
    args.accuracy_schedules = [s for s in args.accuracy_schedules.split(",") if s]
    if args.threads:
        torch.set_num_threads(args.threads)

    shapes = parse_shapes(args.shapes, args.count) if args.shapes else gpt_matrix_shapes(args.n_layer, args.n_embd)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in args.devices.split(","):
        if name == "cuda" and not torch.cuda.is_available():
            print("cuda: not available, skipped")
            continue
        device = torch.device(name)
        if args.gram:
            result = bench_gram(args, device)
            print_gram_table(result)
            suffix = ("_quick" if args.quick else "") + (f"_threads{args.threads}" if args.threads else "")
            path = harness.write_json(out_dir / f"newton_schulz_gram_{device.type}{suffix}.json", result, indent=2)
            print(f"wrote {path}")
            continue
        result = bench_device(args, device, shapes)
        print_table(result)
        # A run with pinned threads gets its own file so it does not replace the default run.
        suffix = f"_threads{args.threads}" if args.threads else ""
        path = harness.write_json(out_dir / f"newton_schulz_{device.type}{suffix}.json", result, indent=2)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
