"""The layout planner at scale, simulated: padding, memory, communication, Newton–Schulz balance, planning time.

Run (about a minute on 2 CPU cores; shapes only, no weights, no processes):

    .venv/bin/python benchmarks/layout_scale.py
    .venv/bin/python benchmarks/layout_scale.py --models llama3-70b --dp 64 1024 --repeats 5

For every model of ``benchmarks/model_shapes.py`` and every ``dp`` it plans the
layout ``LayerwiseStrategy`` would use with ``lightning_layerwise.Muon`` and its
defaults: element-wise fill on (the AdamW parameters, i.e. embeddings, head and
vectors, may be split; Muon matrices are owned whole) and
``owner_group_size="auto"`` with 8 ranks per node (``choose_owner_group_size``).
Per row:

* ``g``: the owner group size ``"auto"`` chose; ``padding``: share of the buffer
  elements that hold no parameter; ``padding, whole, g = dp``: the same model
  planned as before both changes (every parameter owned whole, one group);
* ``memory / ideal``: the busiest rank's bytes (param buffer in bf16, grad buffer in
  fp32, padding included, plus optimizer state of what it steps: 8 bytes per Muon
  element, momentum and a float32 master; 12 per AdamW element, two moments and a
  master) against an ideal element-wise ZeRO-1 without padding at the same world
  size (the same buffers unpadded, plus the state divided evenly over ``dp``); and
  per part: param and grad buffer (one ratio, the padding's) and optimizer state;
* ``bytes / ddp``: bytes each rank sends per step in ring collectives
  (reduce-scatter and all-gather inside the owner group, all-reduce of the owned
  shard across groups) against ``ddp``'s all-reduce of the gradients, with
  gradients and parameters in the same dtype (the README's claim);
* ``NS / bound``: the busiest rank's Newton–Schulz cost (``min(m,n)^2 max(m,n)`` per
  Muon matrix) against the bound ``max(largest matrix, total / dp)``;
* ``plan s``: median seconds of ``choose_owner_group_size`` (which plans every
  candidate ``g``) over ``--repeats`` runs.

Targets: memory <= 1.05 x ideal, bytes <= 1.05 x ddp, Newton–Schulz <= 1.10 x
bound, planning <= 2 s, on every row.

Writes ``benchmarks/results/layout_scale.json``, the table into
``docs/benchmarks/layout_scale.md`` (between its table markers) and the plot
``docs/benchmarks/layout_scale.png``.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks import harness  # noqa: E402
from benchmarks.model_shapes import MODELS, ModelShapes, model_shapes  # noqa: E402
from lightning_layerwise.layout import (  # noqa: E402
    DEFAULT_BUCKET_SIZE,
    Layout,
    ParamSpec,
    choose_owner_group_size,
    newton_schulz_cost,
    plan_layout,
)

MEMORY_TARGET = 1.05
BYTES_TARGET = 1.05
BALANCE_TARGET = 1.10
PLANNING_TARGET_S = 2.0
RANKS_PER_NODE = 8
PARAM_BYTES, GRAD_BYTES = 2, 4  # bf16 parameters, gradients reduced in fp32
MUON_STATE_BYTES, ADAMW_STATE_BYTES = 8, 12  # momentum + fp32 master; two moments + fp32 master
EXPERT_TABLE_START, EXPERT_TABLE_END = "<!-- expert-table:start -->", "<!-- expert-table:end -->"
TITLE = "Layout at scale (simulated)"


def routed_cost(model: ModelShapes) -> Callable[[ParamSpec], float]:
    """Planning cost that follows ``muon_param_groups``: Newton–Schulz for Muon matrices, elements otherwise."""
    def cost(spec: ParamSpec) -> float:
        return newton_schulz_cost(spec) if model.uses_muon(spec) else float(spec.numel)
    return cost


def muon_cost(model: ModelShapes, spec: ParamSpec) -> float:
    """The Newton–Schulz work a parameter really causes: zero unless Muon steps it."""
    return newton_schulz_cost(spec) if model.uses_muon(spec) else 0.0


def balance(model: ModelShapes, layout: Layout, dp: int) -> float:
    """Busiest rank's Newton–Schulz cost over ``max(largest matrix cost, total / dp)`` (Muon matrices are whole)."""
    per_rank = [0.0] * layout.ranks
    costs = {s.name: muon_cost(model, s) for s in model.specs}
    for name, slot in layout.params.items():
        per_rank[slot.owner] += costs[name]
    return max(per_rank) / ns_bound(list(costs.values()), dp)


def ns_bound(costs: list[float], dp: int) -> float:
    """The least busiest-rank Newton–Schulz cost any placement of whole matrices could reach, as
    simple bounds give it: ``max(largest matrix, total / dp)``."""
    return max(max(costs), sum(costs) / dp)


def bins_needed(costs: list[float], capacity: float) -> int:
    """Martello and Toth's L2 lower bound on the ranks needed to hold ``costs`` (whole) with at most
    ``capacity`` each: for each threshold ``a <= capacity / 2``, the items above ``capacity - a`` each need a
    rank alone, those above half need one each, and the items between ``a`` and half fill what those leave
    free before they need ranks of their own."""
    half = capacity / 2
    big = [c for c in costs if c > half]
    best = len(big)
    for a in sorted({c for c in costs if c <= half} | {0.0}):
        alone = sum(1 for c in big if c > capacity - a)
        paired = [c for c in big if c <= capacity - a]
        small = sum(c for c in costs if a <= c <= half)
        room = len(paired) * capacity - sum(paired)
        best = max(best, alone + len(paired) + max(0, math.ceil((small - room) / capacity - 1e-9)))
    return best


def ns_floor(costs: list[float], dp: int) -> float:
    """The least busiest-rank cost any placement of these whole matrices on ``dp`` ranks can have, from
    below: the smallest capacity at which :func:`bins_needed` fits ``dp`` ranks (bisection to 0.1%)."""
    costs = [c for c in costs if c > 0]
    lo = hi = ns_bound(costs, dp)
    while bins_needed(costs, hi) > dp:
        hi *= 1.25
    while hi - lo > 1e-3 * lo:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if bins_needed(costs, mid) <= dp else (mid, hi)
    return lo


def memory(model: ModelShapes, layout: Layout, dp: int) -> dict[str, float]:
    """The busiest rank's bytes against an unpadded element-wise ZeRO-1 at ``dp`` ranks: in all
    (``total``) and per part (param buffer and grad buffer, whose ratio is the same, and optimizer state,
    against its ``1/dp`` share and against the least a whole-matrix placement can hold, ``state_bound``:
    that share or one whole Muon matrix's state, whichever is larger)."""
    muon = {s.name: model.uses_muon(s) for s in model.specs}
    state = [0.0] * layout.ranks
    for name, slot in layout.params.items():
        per_element = MUON_STATE_BYTES if muon[name] else ADAMW_STATE_BYTES
        for piece in slot.pieces:
            state[piece.owner] += piece.numel * per_element
    total_state = sum(s.numel * (MUON_STATE_BYTES if muon[s.name] else ADAMW_STATE_BYTES) for s in model.specs)
    largest = max((s.numel * MUON_STATE_BYTES for s in model.specs if muon[s.name]), default=0)
    ours = layout.total_numel * (PARAM_BYTES + GRAD_BYTES) + max(state)
    ideal = model.numel * (PARAM_BYTES + GRAD_BYTES) + total_state / dp
    return {"total": ours / ideal, "buffers": layout.total_numel / model.numel,
            "state": max(state) / (total_state / dp), "state_bound": max(state) / max(total_state / dp, largest)}


def memory_ratio(model: ModelShapes, layout: Layout, dp: int) -> float:
    return memory(model, layout, dp)["total"]


def bytes_ratio(model: ModelShapes, layout: Layout, dp: int) -> float:
    """Bytes the busiest rank sends per step against ddp's gradient all-reduce, all in one dtype.

    Inside the owner group a ring reduce-scatter and all-gather of each bucket, ``2 (g-1)/g`` of it. Across
    the replicas each shard's chunks (Note [replica sharing]): a ring reduce to the replica stepping a whole
    shard and a ring broadcast from it, or a ring reduce-scatter and all-gather of equal chunks; either way
    replica ``k`` sends ``2 (shard - its chunk)``. A padding-only shard sends nothing across."""
    g, replicas = layout.group_size, layout.replicas
    sent = [0.0] * (g * replicas)
    for plan in layout.buffers:
        for b in plan.buckets:
            group = 2 * (g - 1) / g * b.numel
            for p in range(g):
                across = replicas > 1 and (not b.chunks or bool(b.chunks[p]))
                for k, (lo, hi) in enumerate(b.chunk_ranges(p)):
                    sent[k * g + p] += group + 2 * (b.shard_size - (hi - lo)) * across
    return max(sent) / (2 * (dp - 1) / dp * model.numel)


def time_planning(model: ModelShapes, dp: int, bucket_size: int, repeats: int) -> tuple[int, Layout, float]:
    """The chosen group size, its layout and the median seconds ``choose_owner_group_size`` took."""
    cost = routed_cost(model)
    times, result = [], None
    for _ in range(repeats):
        specs = model.routed_specs()  # fresh specs each run (nothing cached in them), built outside the timing
        t0 = time.perf_counter()
        result = choose_owner_group_size(specs, dp, bucket_size, cost, ranks_per_node=RANKS_PER_NODE,
                                         grad_bytes=GRAD_BYTES)
        times.append(time.perf_counter() - t0)
    return result[0], result[1], harness.median_of(times)


def measure(model: ModelShapes, dp: int, bucket_size: int, repeats: int) -> dict:
    """One row at ``dp`` ranks, and the same group size without replica sharing (every owner group steps
    its whole shard, as before Note [replica sharing])."""
    g, layout, seconds = time_planning(model, dp, bucket_size, repeats)
    unshared = plan_layout(model.routed_specs(), g, bucket_size, routed_cost(model))
    parts = memory(model, layout, dp)
    costs = [muon_cost(model, s) for s in model.specs]
    return {"model": model.name, "dp": dp, "params": model.numel, "muon_matrices": model.muon_matrices,
            "g": g, "replicas": layout.replicas, "padding": layout.padding_fraction,
            "memory_ratio": parts["total"], "buffers_ratio": parts["buffers"], "state_ratio": parts["state"],
            "state_bound_ratio": parts["state_bound"], "bytes_ratio": bytes_ratio(model, layout, dp),
            "ns_balance": balance(model, layout, dp), "ns_floor": ns_floor(costs, dp) / ns_bound(costs, dp),
            "plan_s": seconds, "split_params": sum(s.split for s in layout.params.values()),
            "ns_balance_unshared": balance(model, unshared, dp),
            "state_ratio_unshared": memory(model, unshared, dp)["state"],
            "state_bound_ratio_unshared": memory(model, unshared, dp)["state_bound"],
            "memory_ratio_unshared": memory(model, unshared, dp)["total"]}


EXPERT_ROWS = (("mixtral-8x7b", 8), ("deepseek-v3", 8), ("deepseek-v3", 64))
"""(model, expert-parallel size E) planned with real expert parallelism in the second table."""


def _expert_index(name: str) -> int:
    return int(name.split("experts.")[1].split(".")[0])


def measure_experts(model: ModelShapes, dp: int, E: int, bucket_size: int, repeats: int = 1) -> dict:
    """One rank's layouts with expert parallelism (Note [expert parallelism]): its dense parameters planned
    as in the main table, its ``n/E`` local experts per layer planned inside the ``D = dp/E`` ranks of its
    expert data-parallel group (an expert owner group of ``g_e``, its ``D / g_e`` replicas sharing the
    stepping: Note [expert owner groups]), as ``choose_owner_group_size`` plans them with the expert marks.

    Against ``ddp`` with expert parallelism (dense gradients all-reduced over ``dp``, expert gradients over
    ``D``) and an unpadded element-wise ZeRO-1 of the same (dense state over ``dp`` ranks, expert state over
    ``D``). The busiest rank's state is taken as the busiest dense owner's plus the busiest expert owner's."""
    cost = routed_cost(model)
    experts = [s for s in model.routed_specs() if s.kind == "expert"]
    per_layer = 1 + max(_expert_index(s.name) for s in experts)
    local_names = {s.name for s in experts if _expert_index(s.name) < per_layer // E}  # expert-parallel rank 0's
    specs = [s for s in model.routed_specs() if s.kind != "expert" or s.name in local_names]
    D = dp // E
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        g, layout = choose_owner_group_size(specs, dp, bucket_size, cost, ranks_per_node=RANKS_PER_NODE,
                                            grad_bytes=GRAD_BYTES, expert_dp_size=D)
        times.append(time.perf_counter() - t0)
    muon = {s.name: model.uses_muon(s) for s in specs}
    state_bytes = {n: MUON_STATE_BYTES if muon[n] else ADAMW_STATE_BYTES for n in muon}
    numel = {s.name: s.numel for s in specs}
    by_name = {s.name: s for s in specs}
    out = {"model": model.name, "dp": dp, "E": E, "expert_dp": D, "g": g, "replicas": layout.replicas,
           "g_e": layout.expert_group_size, "expert_replicas": layout.expert_replicas,
           "local_experts": len(local_names), "plan_s": harness.median_of(times)}
    ours_buffers, ideal_buffers, ours_state, ideal_state, sent, ddp_bytes = 0, 0, 0.0, 0.0, 0.0, 0.0
    for kind, ranks in (("dense", dp), ("expert", D)):
        names = [s.name for s in specs if (s.kind == "expert") == (kind == "expert")]
        plans = [p for p in layout.buffers if p.kind == kind]
        elements = sum(p.numel for p in plans)
        params = sum(numel[n] for n in names)
        state = [0.0] * ranks
        ns = [0.0] * ranks
        for n in names:
            for piece in layout.params[n].pieces:
                state[piece.owner] += piece.numel * state_bytes[n]
                ns[piece.owner] += muon_cost(model, by_name[n]) * piece.numel / numel[n]
        costs = [muon_cost(model, by_name[n]) for n in names]
        ours_buffers += elements
        ideal_buffers += params
        ours_state += max(state)
        ideal_state += sum(numel[n] * state_bytes[n] for n in names) / ranks
        g_kind = plans[0].shards if plans else 1
        replicas = ranks // g_kind
        per_rank = [0.0] * ranks
        for plan in plans:
            for b in plan.buckets:
                for p in range(g_kind):
                    across = replicas > 1 and (not b.chunks or bool(b.chunks[p]))  # padding only: nothing
                    for k, (lo, hi) in enumerate(b.chunk_ranges(p)):
                        per_rank[k * g_kind + p] += 2 * (g_kind - 1) / g_kind * b.numel \
                            + 2 * (b.shard_size - (hi - lo)) * across
        sent += max(per_rank)
        ddp_bytes += 2 * (ranks - 1) / ranks * params
        out[f"{kind}_padding"] = 1 - params / elements if elements else 0.0
        out[f"{kind}_ns"] = max(ns) / ns_bound(costs, ranks)
        out[f"{kind}_ns_floor"] = ns_floor(costs, ranks) / ns_bound(costs, ranks)
    out["memory_ratio"] = (ours_buffers * (PARAM_BYTES + GRAD_BYTES) + ours_state) / \
        (ideal_buffers * (PARAM_BYTES + GRAD_BYTES) + ideal_state)
    out["state_ratio"] = ours_state / ideal_state
    out["bytes_ratio"] = sent / ddp_bytes
    return out


def _verdict(checks: list[tuple[str, float, float, float | None]]) -> str:
    """"met", or the targets missed among ``(name, value, target, floor)``; a miss whose floor (the best any
    placement of whole matrices reaches) is above the target too says so."""
    misses = []
    for name, value, target, floor in checks:
        if value > target:
            reachable = floor is None or floor <= target
            misses.append(name if reachable else
                          f"{name} (no placement of whole matrices reaches it: floor {floor:.3f})")
    return "met" if not misses else "missed: " + ", ".join(misses)


def expert_verdict(row: dict) -> str:
    return _verdict([("memory", row["memory_ratio"], MEMORY_TARGET, None),
                     ("bytes", row["bytes_ratio"], BYTES_TARGET, None),
                     ("dense NS", row["dense_ns"], BALANCE_TARGET, row["dense_ns_floor"]),
                     ("expert NS", row["expert_ns"], BALANCE_TARGET, row["expert_ns_floor"]),
                     ("plan", row["plan_s"], PLANNING_TARGET_S, None)])


def _table(columns: list[tuple[str, str | Callable[[dict], str], str]], rows: list[dict],
           judge: Callable[[dict], str]) -> str:
    """A markdown table of ``rows``: per column ``(title, key, spec)``, the row's value under ``key`` formatted
    with ``spec`` (or what ``key`` returns for the row, if it is a function); then the row's targets verdict."""
    return harness.markdown_table([title for title, _, _ in columns] + ["targets"], [
        [key(r) if callable(key) else format(r[key], spec) for _, key, spec in columns] + [judge(r)] for r in rows])


EXPERT_COLUMNS = [
    ("model", "model", ""), ("dp", "dp", ""), ("E", "E", ""), ("expert DP", "expert_dp", ""),
    ("dense g x R", lambda r: f"{r['g']} x {r['replicas']}", ""),
    ("expert g_e x R_e", lambda r: f"{r['g_e']} x {r['expert_replicas']}", ""),
    ("expert tensors per rank", "local_experts", ","), ("dense padding", "dense_padding", ".2%"),
    ("expert padding", "expert_padding", ".2%"), ("memory / ideal", "memory_ratio", ".3f"),
    ("opt state / ideal", "state_ratio", ".2f"), ("bytes / ddp", "bytes_ratio", ".3f"),
    ("dense NS / bound", "dense_ns", ".3f"), ("expert NS / bound", "expert_ns", ".3f"), ("plan s", "plan_s", ".2f"),
]
COLUMNS = [
    ("model", "model", ""), ("dp", "dp", ""), ("g", "g", ""), ("R", "replicas", ""), ("padding", "padding", ".2%"),
    ("memory / ideal", "memory_ratio", ".3f"), ("param, grad buffer / ideal", "buffers_ratio", ".3f"),
    ("opt state / ideal (1/dp)", "state_ratio", ".2f"), ("opt state / bound", "state_bound_ratio", ".2f"),
    ("bytes / ddp", "bytes_ratio", ".3f"), ("NS / bound", "ns_balance", ".3f"), ("NS floor / bound", "ns_floor", ".3f"),
    ("plan s", "plan_s", ".2f"), ("NS / bound, unshared", "ns_balance_unshared", ".3f"),
    ("opt state / ideal, unshared", "state_ratio_unshared", ".2f"),
]


def expert_table(rows: list[dict]) -> str:
    return _table(EXPERT_COLUMNS, rows, expert_verdict)


def verdict(row: dict) -> str:
    return _verdict([("memory", row["memory_ratio"], MEMORY_TARGET, None),
                     ("bytes", row["bytes_ratio"], BYTES_TARGET, None),
                     ("NS", row["ns_balance"], BALANCE_TARGET, row["ns_floor"]),
                     ("plan", row["plan_s"], PLANNING_TARGET_S, None)])


def table(rows: list[dict]) -> str:
    return _table(COLUMNS, rows, verdict)


def plot(rows: list[dict], path: Path) -> None:
    plt = harness.pyplot()
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.8))
    panels = [("state_bound_ratio", 1, "busiest rank's optimizer state / its bound", None, True),
              ("memory_ratio", 1, "busiest rank's memory / ideal ZeRO-1", MEMORY_TARGET, True),
              ("bytes_ratio", 1, "bytes sent per step / ddp all-reduce", BYTES_TARGET, False),
              ("ns_balance", 1, "busiest rank's Newton–Schulz / bound", BALANCE_TARGET, True)]
    for name in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == name]
        dps = [r["dp"] for r in mine]
        for ax, (key, scale, title, target, before) in zip(axes, panels):
            line, = ax.plot(dps, [scale * r[key] for r in mine], marker="o", label=name)
            if before:
                ax.plot(dps, [scale * r[key + "_unshared"] for r in mine], ls=":", color=line.get_color())
    for ax, (key, _, title, target, _) in zip(axes, panels):
        if target is not None:
            ax.axhline(target, color="k", lw=0.8, ls="--", label=f"target {target}")
        ax.set_title(title, fontsize=10)
        ax.set_xscale("log", base=2)
        ticks = sorted({r["dp"] for r in rows})
        ax.set_xticks(ticks, [str(d) for d in ticks])
        ax.set_xlabel("dp (ranks)")
        ax.grid(alpha=0.3)
    axes[0].set_yscale("log")
    axes[1].set_yscale("log")
    axes[3].set_yscale("log")
    axes[3].legend(fontsize=8)
    fig.suptitle("Layouts of published models, owner_group_size='auto': owner groups sharing the optimizer "
                 "step (solid) vs each group stepping its whole shard (dotted)")
    fig.tight_layout()
    harness.save_figure(fig, path, dpi=110)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    p.add_argument("--dp", type=int, nargs="+", default=[8, 64, 256, 1024])
    p.add_argument("--bucket-size", type=int, default=DEFAULT_BUCKET_SIZE)
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
            rows.append(measure(model, dp, args.bucket_size, args.repeats))
            r = rows[-1]
            print(f"{name:>13} dp={dp:<5} g={r['g']:<5} padding={100 * r['padding']:6.2f}% "
                  f"memory={r['memory_ratio']:.3f} bytes={r['bytes_ratio']:.3f} ns={r['ns_balance']:.3f} "
                  f"plan={r['plan_s']:.2f}s", file=sys.stderr, flush=True)
    text = table(rows)
    expert_rows = [measure_experts(model_shapes(name), dp, E, args.bucket_size, args.repeats)
                   for name, E in EXPERT_ROWS if name in args.models for dp in args.dp if dp % E == 0 and dp > E]
    experts_text = expert_table(expert_rows)
    print(text)
    print()
    print(experts_text)
    print(f"\ntotal {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    if args.no_write:
        return
    machine = harness.machine()
    meta = {"bucket_size": args.bucket_size, "repeats": args.repeats, "python": machine["python"],
            "torch": machine["torch"], "machine": machine["cpu_model"],
            "ranks_per_node": RANKS_PER_NODE, "targets": {"memory": MEMORY_TARGET, "bytes": BYTES_TARGET,
                                                          "ns": BALANCE_TARGET, "plan_s": PLANNING_TARGET_S},
            "bytes_model": {"param": PARAM_BYTES, "grad": GRAD_BYTES, "muon_state": MUON_STATE_BYTES,
                            "adamw_state": ADAMW_STATE_BYTES}}
    harness.write_json(args.json, {"meta": meta, "rows": rows, "expert_rows": expert_rows})
    harness.write_between_markers(args.markdown, text, title=TITLE)
    harness.write_between_markers(args.markdown, experts_text, EXPERT_TABLE_START, EXPERT_TABLE_END, title=TITLE)
    plot(rows, args.png)
    print(f"wrote {args.json}, {args.markdown}, {args.png}", file=sys.stderr)


if __name__ == "__main__":
    main()
