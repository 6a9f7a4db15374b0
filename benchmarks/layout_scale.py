"""The layout planner at scale, simulated: padding, Newton–Schulz balance and planning time.

Run (about a minute on 2 CPU cores; shapes only, no weights, no processes):

    .venv/bin/python benchmarks/layout_scale.py
    .venv/bin/python benchmarks/layout_scale.py --models llama3-70b --dp 64 1024 --repeats 5

For every model of ``benchmarks/model_shapes.py`` and every ``dp`` it runs
``plan_layout`` on the parameter shapes and reports:

* padding: share of buffer elements that hold no parameter, and the floor that
  whole-parameter ownership sets, ``1 - total / (dp * largest)``;
* Newton–Schulz balance: the busiest rank's Newton–Schulz cost divided by the
  lower bound ``max(largest matrix cost, total cost / dp)``. Only the matrices
  ``muon_param_groups`` sends to Muon carry cost (``min(m, n)^2 * max(m, n)``,
  the planner's ``newton_schulz_cost``); embeddings, the output head and vectors
  go to AdamW and carry none. The layout is planned with the cost that matches
  this routing (Newton–Schulz for Muon matrices, element count for AdamW
  parameters); ``ns/lb default`` is the same measure for a layout planned with
  the library's default cost, which counts an embedding as a matrix;
* planning time: median wall time of ``--repeats`` calls of ``plan_layout``.

Targets (from the benchmark issue) on rows where ``dp`` is at most the number
of Muon matrices: padding <= 1%, busiest rank <= 1.10 x the lower bound;
planning <= 2 s for Llama-3 70B at dp 1024.

Writes ``benchmarks/results/layout_scale.json``, the table into
``docs/benchmarks/layout_scale.md`` (between its table markers) and the plot
``docs/benchmarks/layout_scale.png``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.model_shapes import MODELS, ModelShapes, model_shapes  # noqa: E402
from lightning_layerwise.layout import (  # noqa: E402
    DEFAULT_BUCKET_SIZE,
    Layout,
    ParamSpec,
    newton_schulz_cost,
    plan_layout,
)

PADDING_TARGET = 0.01
BALANCE_TARGET = 1.10
PLANNING_TARGET_S = 2.0
TABLE_START, TABLE_END = "<!-- table:start -->", "<!-- table:end -->"


def routed_cost(model: ModelShapes) -> Callable[[ParamSpec], float]:
    """Planning cost that follows ``muon_param_groups``: Newton–Schulz for Muon matrices, elements otherwise."""
    def cost(spec: ParamSpec) -> float:
        return newton_schulz_cost(spec) if model.uses_muon(spec) else float(spec.numel)
    return cost


def muon_cost(model: ModelShapes, spec: ParamSpec) -> float:
    """The Newton–Schulz work a parameter really causes: zero unless Muon steps it."""
    return newton_schulz_cost(spec) if model.uses_muon(spec) else 0.0


def balance(model: ModelShapes, layout: Layout, dp: int) -> float:
    """Busiest rank's Newton–Schulz cost over ``max(largest matrix cost, total / dp)``."""
    per_rank = [0.0] * dp
    costs = {s.name: muon_cost(model, s) for s in model.specs}
    for name, slot in layout.params.items():
        per_rank[slot.owner] += costs[name]
    bound = max(max(costs.values()), sum(costs.values()) / dp)
    return max(per_rank) / bound


def time_planning(model: ModelShapes, dp: int, bucket_size: int, repeats: int) -> tuple[Layout, float]:
    """The layout and the median seconds ``plan_layout`` took over ``repeats`` runs."""
    cost = routed_cost(model)
    times, layout = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        layout = plan_layout(model.specs, dp, bucket_size, cost)
        times.append(time.perf_counter() - t0)
    return layout, statistics.median(times)


def measure(model: ModelShapes, dp: int, bucket_sizes: list[int], repeats: int) -> dict:
    """One row: padding, balance and planning time at ``dp`` for every bucket size."""
    total = model.numel
    largest = max(s.numel for s in model.specs)
    row = {"model": model.name, "dp": dp, "params": total, "muon_matrices": model.muon_matrices,
           "padding_floor": max(0.0, 1 - total / (dp * largest)), "buckets": {}}
    for i, bucket_size in enumerate(bucket_sizes):
        layout, seconds = time_planning(model, dp, bucket_size, repeats if i == 0 else 1)
        entry = {"padding": layout.padding_fraction, "ns_balance": balance(model, layout, dp),
                 "plan_s": seconds, "n_buckets": sum(len(b.buckets) for b in layout.buffers)}
        if i == 0:
            default = plan_layout(model.specs, dp, bucket_size)  # the library's default cost
            entry["ns_balance_default_cost"] = balance(model, default, dp)
        row["buckets"][str(bucket_size)] = entry
    row["target_applies"] = dp <= model.muon_matrices
    return row


def verdict(row: dict, bucket_size: int) -> str:
    entry = row["buckets"][str(bucket_size)]
    if not row["target_applies"]:
        return "n/a (dp > matrices)"
    misses = []
    if entry["padding"] > PADDING_TARGET:
        misses.append("padding")
    if entry["ns_balance"] > BALANCE_TARGET:
        misses.append("balance")
    return "met" if not misses else "missed: " + ", ".join(misses)


def table(rows: list[dict], bucket_sizes: list[int]) -> str:
    base, extra = bucket_sizes[0], bucket_sizes[1:]
    head = ["model", "dp", "Muon matrices", "padding", "padding floor", "NS busiest / bound",
            "same, default cost", "plan s"]
    for b in extra:
        head += [f"padding @{b / 1e6:g}M", f"NS / bound @{b / 1e6:g}M"]
    head.append("targets (padding <= 1%, NS <= 1.10)")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        e = r["buckets"][str(base)]
        cells = [r["model"], str(r["dp"]), f"{r['muon_matrices']:,}", f"{100 * e['padding']:.2f}%",
                 f"{100 * r['padding_floor']:.2f}%", f"{e['ns_balance']:.3f}", f"{e['ns_balance_default_cost']:.3f}",
                 f"{e['plan_s']:.3f}"]
        for b in extra:
            x = r["buckets"][str(b)]
            cells += [f"{100 * x['padding']:.2f}%", f"{x['ns_balance']:.3f}"]
        cells.append(verdict(r, base))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_markdown(path: Path, text: str) -> None:
    """Replaces the table between the markers, keeping the narrative around it."""
    block = f"{TABLE_START}\n{text}\n{TABLE_END}"
    if path.exists() and TABLE_START in (old := path.read_text()):
        head, _, rest = old.partition(TABLE_START)
        _, _, tail = rest.partition(TABLE_END)
        path.write_text(head + block + tail)
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"# Layout at scale (simulated)\n\n{block}\n")


def plot(rows: list[dict], bucket_size: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    models = list(dict.fromkeys(r["model"] for r in rows))
    for name in models:
        mine = [r for r in rows if r["model"] == name]
        dps = [r["dp"] for r in mine]
        entries = [r["buckets"][str(bucket_size)] for r in mine]
        line, = axes[0].plot(dps, [100 * e["padding"] for e in entries], marker="o", label=name)
        axes[0].plot(dps, [100 * r["padding_floor"] for r in mine], ls=":", color=line.get_color())
        axes[1].plot(dps, [e["ns_balance"] for e in entries], marker="o", label=name)
        axes[2].plot(dps, [e["plan_s"] for e in entries], marker="o", label=name)
    axes[0].axhline(100 * PADDING_TARGET, color="k", lw=0.8, ls="--", label="target 1%")
    axes[0].set_yscale("symlog", linthresh=0.1)
    axes[0].set(title="padding (dotted: whole-ownership floor)", ylabel="% of buffer elements", ylim=(0, 120))
    axes[1].axhline(BALANCE_TARGET, color="k", lw=0.8, ls="--", label="target 1.10")
    axes[1].set(title="busiest rank's Newton–Schulz cost / lower bound", ylabel="ratio")
    axes[2].axhline(PLANNING_TARGET_S, color="k", lw=0.8, ls="--", label="target 2 s (70B, dp 1024)")
    axes[2].set(title="planning time (median)", ylabel="seconds", yscale="log")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r["dp"] for r in rows}), [str(d) for d in sorted({r["dp"] for r in rows})])
        ax.set_xlabel("dp (ranks)")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8)
    axes[0].legend(fontsize=8, loc="lower right")
    fig.suptitle(f"plan_layout on published model shapes, bucket_size={bucket_size:,} elements")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    p.add_argument("--dp", type=int, nargs="+", default=[8, 64, 256, 1024])
    p.add_argument("--bucket-sizes", type=int, nargs="+", default=[DEFAULT_BUCKET_SIZE, 10 * DEFAULT_BUCKET_SIZE],
                   help="bucket lengths in elements; the first is the main one (default: the library's "
                        "default and ten times it)")
    p.add_argument("--repeats", type=int, default=3, help="planning runs per row; the median is reported")
    p.add_argument("--json", type=Path, default=ROOT / "benchmarks/results/layout_scale.json")
    p.add_argument("--markdown", type=Path, default=ROOT / "docs/benchmarks/layout_scale.md")
    p.add_argument("--png", type=Path, default=ROOT / "docs/benchmarks/layout_scale.png")
    p.add_argument("--no-write", action="store_true", help="print the table only")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats={args.repeats} must be >= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    t0 = time.perf_counter()
    rows = []
    for name in args.models:
        model = model_shapes(name)
        for dp in args.dp:
            rows.append(measure(model, dp, args.bucket_sizes, args.repeats))
            e = rows[-1]["buckets"][str(args.bucket_sizes[0])]
            print(f"{name:>13} dp={dp:<5} padding={100 * e['padding']:6.2f}% ns/bound={e['ns_balance']:.3f} "
                  f"plan={e['plan_s']:.3f}s", file=sys.stderr, flush=True)
    text = table(rows, args.bucket_sizes)
    print(text)
    print(f"\ntotal {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    if args.no_write:
        return
    import torch

    meta = {"bucket_sizes": args.bucket_sizes, "repeats": args.repeats, "python": platform.python_version(),
            "torch": torch.__version__, "machine": platform.processor() or platform.machine(),
            "padding_target": PADDING_TARGET, "balance_target": BALANCE_TARGET,
            "cost": "newton_schulz_cost on Muon-routed matrices; plan cost: the same, element count for AdamW params"}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    write_markdown(args.markdown, text)
    plot(rows, args.bucket_sizes[0], args.png)
    print(f"wrote {args.json}, {args.markdown}, {args.png}", file=sys.stderr)


if __name__ == "__main__":
    main()
