"""Tensor parallelism on the example GPT at 4 CPU ranks (data-parallel 2 x tensor-parallel 2): time, bytes by
kind, memory, loss.

Drives ``benchmarks/bench_strategies.py``'s machinery (its configurations, workers, :class:`CommCounter`,
aggregation) on the ``tp10m`` size (10.7 M parameters) and writes ``benchmarks/results/tensor_parallel_cpu.json``
and ``docs/benchmarks/tensor_parallel_cpu.md``. Run from the repository root::

    .venv/bin/python benchmarks/bench_tensor_parallel.py                 # the matrix below, 2 repeats
    .venv/bin/python benchmarks/bench_tensor_parallel.py --from-json benchmarks/results/tensor_parallel_cpu.json

Rows (all at 4 ranks; the tensor-parallel rows are 2 data-parallel x 2 tensor-parallel, so their global batch
is 2 per-rank batches, the rows without tensor parallelism 4):

    layerwise_tp_muon     LayerwiseStrategy(tensor_parallel_size=2, overlap_param_gather=True), llw.Muon: each TP
                          matrix orthogonalized whole, once, via two all_to_all_single per step
    layerwise_tp_adamw    the same with torch.optim.AdamW
    fsdp2_tp_adamw        Lightning ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2): the same TP
                          plan, then fully_shard per block and on the root over device_mesh["data_parallel"], AdamW
    fsdp2_tp_torch_muon   the same with torch.optim.Muon + AdamW (bench_strategies.MuonAndAdamW) on its DTensors
    layerwise_muon        LayerwiseStrategy without tensor parallelism (4 data-parallel ranks), llw.Muon
    layerwise_adamw       the same with AdamW

The same command line can run through ``bench_strategies.py --sizes tp10m --devices 4 --configs ...``; this
script adds the tensor-parallel report (bytes by kind, ratios to ``fsdp2_tp_adamw`` and to the rows without
tensor parallelism, loss against ``ModelParallelStrategy`` + ``torch.optim.Muon``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import bench_strategies as bs  # noqa: E402
from benchmarks import harness  # noqa: E402

CONFIGS = ("layerwise_tp_muon", "layerwise_tp_adamw", "fsdp2_tp_adamw", "fsdp2_tp_torch_muon", "layerwise_muon",
           "layerwise_adamw")
WHAT = {
    "layerwise_tp_muon": "LayerwiseStrategy(tensor_parallel_size=2), llw.Muon (dp 2 x tp 2)",
    "layerwise_tp_adamw": "LayerwiseStrategy(tensor_parallel_size=2), AdamW (dp 2 x tp 2)",
    "fsdp2_tp_adamw": "ModelParallelStrategy(2, 2): TP plan + fully_shard over data_parallel, AdamW",
    "fsdp2_tp_torch_muon": "the same with torch.optim.Muon + AdamW on its DTensors",
    "layerwise_muon": "LayerwiseStrategy, 4 data-parallel ranks, no TP, llw.Muon",
    "layerwise_adamw": "LayerwiseStrategy, 4 data-parallel ranks, no TP, AdamW",
}
# Kinds in the bytes table, in this order (others, if any, follow).
KINDS = ("reduce_scatter_single", "all_gather_single", "all_gather", "all_to_all_single", "all_reduce", "broadcast",
         "dtensor_all_reduce", "dtensor_all_gather_single", "dtensor_reduce_scatter_single",
         "dtensor_all_to_all_single")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="tp10m")
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=400)
    parser.add_argument("--out", default=str(bs.RESULTS / "tensor_parallel_cpu.json"))
    parser.add_argument("--docs-dir", default=str(bs.DOCS))
    parser.add_argument("--from-json", default=None, help="only rebuild the page from this JSON")
    return parser


def strategies_args(args: argparse.Namespace) -> argparse.Namespace:
    """bench_strategies' options for this matrix (its defaults for everything else: lr, clipping, 1 thread per rank)."""
    argv = ["--sizes", args.size, "--devices", str(args.devices), "--configs", args.configs,
            "--repeats", str(args.repeats), "--timeout", str(args.timeout)]
    if args.steps:
        argv += ["--steps", str(args.steps)]
    if args.warmup:
        argv += ["--warmup", str(args.warmup)]
    return bs.build_parser().parse_args(argv)


def _kib(value: float | None) -> str:
    return "–" if not value else f"{value / 1024:,.0f}"


def _step_ratio(t: dict, name: str, ref: str) -> str:
    """This row's median step time over ``ref``'s (empty when ``ref`` did not run)."""
    return f"{t[name]['step_ms_median'] / t[ref]['step_ms_median']:.2f}" if ref in t else "–"


def markdown_report(data: dict) -> str:
    meta, cell = data["meta"], data["cells"][0]
    t, m = cell["results"], cell["model"]
    machine = meta["machine"]
    lines = [
        "# Tensor parallelism on CPU: measured tables",
        "",
        f"Generated by `{meta['command']}` ({meta['total_wall_s']:.0f} s in all) into `{meta['json']}`; "
        f"`--from-json` rebuilds this page.",
        "",
        f"Machine: {machine['cpu_model']}, {machine['cpu_count']} CPU cores **shared with other work**, "
        f"{machine['platform']}, Python {machine['python']}, torch {machine['torch']}, gloo; 1 thread per rank, "
        f"**4 processes on {machine['cpu_count']} cores**. Load average (1/5/15 min) at start "
        f"{'/'.join(f'{x:.2f}' for x in meta['load_avg_start'])}, at end "
        f"{'/'.join(f'{x:.2f}' for x in meta['load_avg_end'])}.",
        "",
        f"Model: the example GPT, n_layer={m['n_layer']} n_head={m['n_head']} n_embd={m['n_embd']} "
        f"({m['n_params'] / 1e6:.2f} M parameters, vocabulary {m['vocab_size']}), batch {m['batch_size']} x "
        f"{m['block_size']} per data-parallel rank, {m['steps']} timed steps after {m['warmup']} warm-up steps, "
        f"{meta['repeats']} interleaved repeats. AdamW lr 1e-3; Muon lr 0.02 (its AdamW groups 3e-3), "
        "Newton-Schulz in bf16; clipping by norm 1.0 (bench_strategies' settings).",
        "",
        "## Rows",
        "",
        harness.markdown_table(["configuration", "what it is"], [[f"`{n}`", WHAT.get(n, "")] for n in
                                                                  list(t) + list(cell.get("errors", {}))]),
        "",
        "The tensor-parallel rows run 2 data-parallel x 2 tensor-parallel: the 2 ranks of a tensor-parallel group "
        "read the same batch, so a step trains on **half the tokens** of the rows without tensor parallelism "
        "(4 data-parallel ranks). Compare step times at equal work with tokens/s.",
        "",
        "## Time, memory, loss",
        "",
        "Medians over repeats of the median over steps of the slowest rank's step. ×fsdp2_tp_adamw and ×no TP: "
        "this row's step time divided by `fsdp2_tp_adamw`'s and by the same optimizer's row without tensor "
        "parallelism (tokens/s ratio in brackets: > 1 is faster per token). NS: Newton-Schulz wall time per step. "
        "Peak RSS: the largest rank's, measured at the end of training. Optimizer state: per rank (local shards).",
        "",
    ]
    header = ["configuration", "step ms (runs)", "tokens/s", "fwd+bwd", "opt", "NS", "×fsdp2_tp_adamw",
              "×no TP (tokens/s)", "peak RSS MiB/rank", "optimizer state KiB/rank", "params KiB/rank", "final loss",
              "mean of last 10", "max \\|Δloss\\| vs fsdp2 TP peer"]
    rows = []
    for name, r in t.items():
        runs = ", ".join(f"{x:.0f}" for x in r["step_ms_runs"])
        no_tp = "–"
        if "step_ratio_no_tp" in r:
            no_tp = f"{r['step_ratio_no_tp']:.2f} ({r['tokens_per_s_ratio_no_tp']:.2f})"
        state = " / ".join(f"{b / 1024:,.0f}" for b in r["state_bytes_per_rank"])
        rows.append([f"`{name}`", f"{r['step_ms_median']:.0f} ({runs})", f"{r['tokens_per_s_median']:,.0f}",
                     f"{r['fwd_bwd_ms_median']:.0f}", f"{r['opt_ms_median']:.0f}", f"{r['ns_ms_median']:.0f}",
                     _step_ratio(t, name, "fsdp2_tp_adamw"),
                     no_tp, f"{r['peak_rss_bytes_per_rank_median'] / 2**20:,.0f}", state,
                     f"{r['param_bytes_per_rank'] / 1024:,.0f}", f"{r['final_loss_median']:.4f}",
                     f"{r['late_loss_median']:.4f}", bs._fmt(r.get("max_abs_loss_diff_fsdp2_tp"), ".1e")])
    lines += [harness.markdown_table(header, rows), ""]
    for name, error in cell.get("errors", {}).items():
        lines += [f"`{name}` did not train: it raised `{error}` (its result; see the JSON for the traceback).", ""]
    kinds = sorted({k for r in t.values() for k, v in r["comm_bytes_by_kind"].items() if v},
                   key=lambda k: (KINDS.index(k) if k in KINDS else len(KINDS), k))
    lines += [
        "## Bytes per step by kind, per rank",
        "",
        "KiB handed to collectives per step on one rank (the same on every rank), with bench_strategies' "
        "conventions: all-reduce and broadcast the tensor, all-gather the output, reduce-scatter and all-to-all the "
        "input. Unprefixed kinds are `torch.distributed` (c10d) calls: the layer-wise engine's reduce-scatters, "
        "all-gathers, norm all-reduce and the tensor-parallel exchange's `all_to_all_single` (llw.Muon), and "
        "FSDP2's all-gathers and reduce-scatters. `dtensor_*` are DTensor's functional collectives (the row-wise "
        "layers' all-reduce of activations and of the replicated inputs' gradients, redistributions). Ring: what "
        "one rank sends with ring algorithms (all-reduce 2(n-1)/n of the bytes, the others (n-1)/n, n the "
        "group's size).",
        "",
        harness.markdown_table(["configuration"] + [f"`{k}`" for k in kinds] + ["total", "ring"], [
            [f"`{name}`"] + [_kib(r["comm_bytes_by_kind"].get(k)) for k in kinds]
            + [_kib(r["comm_bytes_median"]), _kib(r["ring_bytes_median"])] for name, r in t.items()]),
        "",
    ]
    lines += headline(data) + [""] + NOTES
    return "\n".join(lines)


def headline(data: dict) -> list[str]:
    """The ratios and loss comparisons in sentences (also quoted in docs/benchmarks.md)."""
    t = data["cells"][0]["results"]
    out = ["## Ratios", ""]

    def has(*names: str) -> bool:
        return all(n in t for n in names)

    if has("layerwise_tp_adamw", "fsdp2_tp_adamw"):
        r = t["layerwise_tp_adamw"]
        out.append(f"- `layerwise_tp_adamw` / `fsdp2_tp_adamw` step time: **{r['step_ratio_fsdp2_tp']:.2f}** "
                   f"({r['step_ms_median']:.0f} / {t['fsdp2_tp_adamw']['step_ms_median']:.0f} ms); "
                   f"max |Δloss| over the run {r['max_abs_loss_diff_fsdp2_tp']:.1e}, final loss "
                   f"{r['final_loss_median']:.4f} vs {t['fsdp2_tp_adamw']['final_loss_median']:.4f}.")
    if has("layerwise_tp_muon", "fsdp2_tp_adamw"):
        r = t["layerwise_tp_muon"]
        out.append(f"- `layerwise_tp_muon` / `fsdp2_tp_adamw` step time: "
                   f"**{_step_ratio(t, 'layerwise_tp_muon', 'fsdp2_tp_adamw')}** (Newton-Schulz "
                   f"{r['ns_ms_median']:.0f} ms of {r['step_ms_median']:.0f} ms).")
    if has("layerwise_tp_muon", "fsdp2_tp_torch_muon"):
        r, p = t["layerwise_tp_muon"], t["fsdp2_tp_torch_muon"]
        out.append(f"- `layerwise_tp_muon` vs `fsdp2_tp_torch_muon` (ModelParallelStrategy + torch.optim.Muon): "
                   f"step time ×{r['step_ratio_fsdp2_tp']:.2f} ({r['step_ms_median']:.0f} / "
                   f"{p['step_ms_median']:.0f} ms; NS {r['ns_ms_median']:.0f} vs {p['ns_ms_median']:.0f} ms), "
                   f"final loss {r['final_loss_median']:.4f} vs {p['final_loss_median']:.4f}, max |Δloss| "
                   f"{r['max_abs_loss_diff_fsdp2_tp']:.1e} over the run (same seed, data and initial weights; "
                   "both orthogonalize each whole matrix in bf16, with their own Newton-Schulz code).")
    elif "layerwise_tp_muon" in t and "fsdp2_tp_torch_muon" in data["cells"][0].get("errors", {}):
        out.append("- `fsdp2_tp_torch_muon` did not train (error above), so there is no torch.optim.Muon loss to "
                   "compare `layerwise_tp_muon` with.")
    for name in ("layerwise_tp_muon", "layerwise_tp_adamw"):
        if name in t and "step_ratio_no_tp" in t[name]:
            r = t[name]
            out.append(f"- `{name}` / `{bs.NO_TP_PEER[name]}` (no TP, 4 data-parallel ranks): step time "
                       f"×{r['step_ratio_no_tp']:.2f}, tokens/s ×{r['tokens_per_s_ratio_no_tp']:.2f}.")
    return out


NOTES = [
    "## Notes",
    "",
    "- 2 CPU cores shared with other work run 4 single-threaded processes: every rank waits for a core about "
    "half the time, so step times include that scheduling and the ratios mean more than the absolute numbers. "
    "Gloo on one host: communication is memory copies between processes, nothing like a network or NVLink.",
    "- Counted: every `torch.distributed` collective called from Python (c10d), and DTensor's functional "
    "collectives (`torch.distributed._functional_collectives`: `all_reduce`, `all_gather_single`, "
    "`reduce_scatter_single`, `all_to_all_single`, ... wrapped before anything is imported; DTensor calls them as "
    "`funcol.<name>` at call time). Not counted: collectives issued from C++ (none in these rows), "
    "`torch.ops._dtensor.shard_dim_alltoall` (on CPU DTensor falls back to an all-gather, which is counted). "
    "Point-to-point sends are not used.",
    "- Exposed communication is not in the table: for DTensor's functional collectives the time awaiting their "
    "results (`funcol.wait_tensor`) is recorded in the JSON as `dtensor_wait_ms_median`, but with gloo a "
    "functional collective may complete inside the call, so neither number is the whole cost.",
    "- Newton-Schulz runs in bf16 (bench_strategies' default; torch.optim.Muon always uses bf16). On a CPU without "
    "native bf16 matmul (no AVX-512 BF16) that is far slower than float32 and dominates the Muon rows; see "
    "docs/benchmarks.md, section 9.",
    "- `fsdp2_tp_*` rows clip per mesh (`clip_over_meshes`, Note [clipping FSDP2 with TP] in bench_strategies.py): "
    "torch's `clip_grad_norm_` refuses the mix of 2-D and 1-D DTensors that the TP plan plus `fully_shard` makes.",
    "- Peak RSS is `ru_maxrss` per process: it includes the interpreter, torch and Lightning (several hundred MiB "
    "per rank), and glibc keeps freed blocks, so differences of parameters and state show only in part.",
    "- Optimizer state is the bytes of tensors in each rank's optimizer state (local shards of DTensors). "
    "Layer-wise rows own whole parameters (matrices whole, element-wise groups split), so the per-rank numbers "
    "differ between ranks.",
    "- Losses: rows with the same global batch start from the same weights and read the same batches, so "
    "`layerwise_tp_adamw` vs `fsdp2_tp_adamw` (and `layerwise_tp_muon` vs `fsdp2_tp_torch_muon`) compare the "
    "same training; the rows without tensor parallelism train on twice the tokens per step and their losses "
    "differ for that reason.",
]


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    docs_dir = Path(args.docs_dir)
    if args.from_json:
        data = json.loads(Path(args.from_json).read_text())
    else:
        sargs = strategies_args(args)
        cells = bs.plan_cells(sargs)
        print(f"{args.size}: {bs.count_params(bs.size_of(args.size), 96) / 1e6:.2f} M parameters", flush=True)
        clock = harness.Clock()
        errors: dict = {}
        runs = bs.run_matrix(sargs, cells, errors)
        out_cells = bs.result_cells(sargs, cells, runs, errors)
        out_path = Path(args.out)
        meta = bs.run_meta(sargs, [], clock, out_path)
        meta["command"] = "python benchmarks/bench_tensor_parallel.py " + " ".join(
            argv if argv is not None else sys.argv[1:])
        meta["machine"] = clock.machine(threads=sargs.threads)
        data = {"meta": meta, "cells": out_cells}
        bs.print_summary(data)
        harness.write_json(out_path, data)
    docs_dir.mkdir(parents=True, exist_ok=True)
    md = docs_dir / f"{Path(data['meta']['json']).stem}.md"
    md.write_text(markdown_report(data))
    print("\n".join(headline(data)))
    print(f"wrote {data['meta']['json']} and {os.path.relpath(md, ROOT)} ({data['meta']['total_wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
