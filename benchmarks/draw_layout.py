"""Draws the layout the planner makes for a small transformer: buffers, buckets, shards, owners.

    .venv/bin/python benchmarks/draw_layout.py            # writes docs/images/layout_fill.png
    .venv/bin/python benchmarks/draw_layout.py --text     # the same as text, for docs/design.md
    .venv/bin/python benchmarks/draw_layout.py --replicas 2   # 4 ranks as 2 owner groups of 2:
                                                  # docs/images/layout_sharing.png and its text

The model is the toy transformer of docs/design.md: ``wte`` 256x64 (tied to the
output), ``wpe`` 64x64, and per block an attention 64x64 with bias, an MLP 256x64
with bias and a norm. Parameters are routed as ``lightning_layerwise.Muon`` routes
them: matrices of the blocks whole (Muon), embeddings, biases and norm weights
element-wise (AdamW), planned at ``dp`` ranks with element-wise fill and, for
comparison, without it. With ``--replicas R`` the layout is planned for owner groups of
``dp`` ranks and shared among ``R`` of them (Note [replica sharing] in ``layout/sharing.py``):
the picture shows, for every rank of the world, the chunk of its shard it steps, and the
text lists who orthogonalizes which matrix and who holds which optimizer state.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks import harness  # noqa: E402
from lightning_layerwise.layout import Layout, ParamSpec, plan_layout  # noqa: E402

MUON_STATE, ADAMW_STATE = 1, 2  # float32 tensors per element: Muon's momentum; AdamW's two moments


def toy_specs(fill: bool, n_blocks: int = 2) -> list[ParamSpec]:
    def p(name: str, *shape: int) -> ParamSpec:
        return ParamSpec(name, shape, elementwise=fill and (len(shape) < 2 or name in ("wte", "wpe")))

    specs = [p("wte", 256, 64), p("wpe", 64, 64)]
    for i in range(n_blocks):
        specs += [p(f"h.{i}.attn.weight", 64, 64), p(f"h.{i}.attn.bias", 64), p(f"h.{i}.mlp.weight", 256, 64),
                  p(f"h.{i}.mlp.bias", 256), p(f"h.{i}.ln.weight", 64)]
    return specs


def segments(layout: Layout):
    """Per bucket and rank: the (start, stop, name, piece index, piece count) inside that rank's shard."""
    for buf in layout.buffers:
        for bucket in buf.buckets:
            per_rank = []
            for rank in range(layout.group_size):
                lo, hi = bucket.shard_range(rank)
                mine = []
                for name in bucket.params:
                    slot = layout.params[name]
                    for i, piece in enumerate(slot.pieces):
                        a, b = slot.offset + piece.start, slot.offset + piece.stop
                        if piece.owner == rank and lo <= a and b <= hi:
                            mine.append((a - lo, b - lo, name, i, len(slot.pieces)))
                per_rank.append(sorted(mine))
            yield bucket, per_rank


def text(layout: Layout) -> str:
    lines = [f"dp={layout.group_size}, padding {100 * layout.padding_fraction:.1f}% of {layout.total_numel:,} elements"]
    for bucket, per_rank in segments(layout):
        cells = []
        for mine in per_rank:
            names = [n + (f" ({i + 1}/{k})" if k > 1 else "") for _, _, n, i, k in mine]
            used = sum(b - a for a, b, *_ in mine)
            cells.append(f"[{', '.join(names) or '-'}] {100 * (1 - used / bucket.shard_size):.0f}% pad")
        lines.append(f"bucket {bucket.index} ({bucket.shard_size:,}/shard): " + " | ".join(cells))
    return "\n".join(lines)


def sharing_text(layout: Layout, specs: list[ParamSpec]) -> str:
    """Who steps what with replica sharing: per bucket and shard, the chunk of each replica; per rank, the
    matrices it orthogonalizes and the optimizer state it holds."""
    g, R = layout.group_size, layout.replicas
    elementwise = {s.name: s.elementwise for s in specs}
    lines = [f"{g * R} ranks as {R} owner groups of {g}: rank = group * {g} + position; the ranks at one "
             "position hold the same shard and step one chunk of it each"]
    for buf in layout.buffers:
        for bucket in buf.buckets:
            for p in range(g):
                cells = []
                for k, (a, b) in enumerate(bucket.chunk_ranges(p)):
                    names = []
                    for name in bucket.params:
                        slot = layout.params[name]
                        for i, piece in enumerate(slot.pieces):
                            if piece.owner == k * g + p:
                                names.append(name + (f" ({i + 1}/{len(slot.pieces)})" if len(slot.pieces) > 1 else ""))
                    cells.append(f"rank {k * g + p}: [{', '.join(names) or '-'}] {b - a:,}")
                lines.append(f"bucket {bucket.index}, shard {p}: " + " | ".join(cells))
    lines.append("")
    for rank in range(g * R):
        matrices, elements, state = [], 0, 0
        for name, slot in layout.params.items():
            for piece in slot.pieces:
                if piece.owner == rank:
                    elements += piece.numel
                    state += piece.numel * (ADAMW_STATE if elementwise[name] else MUON_STATE)
                    if not elementwise[name]:
                        matrices.append(name)
        lines.append(f"rank {rank}: orthogonalizes {', '.join(matrices) or 'nothing'}; steps {elements:,} elements, "
                     f"holds {state:,} state values")
    return "\n".join(lines)


def draw_sharing(layout: Layout, path: Path) -> None:
    """One row per rank of the world: its shard of every bucket (grey: held, all-gathered from the other
    replicas), and in colour the chunk it steps (the parameters it orthogonalizes or updates)."""
    plt = harness.pyplot()
    g, R = layout.group_size, layout.replicas
    names = sorted(layout.params)
    cmap = plt.get_cmap("tab20")
    color = {n: cmap(i % 20) for i, n in enumerate(names)}
    fig, ax = plt.subplots(figsize=(12, 0.6 * g * R + 1.4))
    for buf in layout.buffers:
        for bucket in buf.buckets:
            for rank in range(g * R):
                k, p = divmod(rank, g)
                lo, hi = bucket.shard_range(p)
                ax.barh(rank, hi - lo, left=lo, color="#eeeeee", edgecolor="k", lw=0.6)
                for name in bucket.params:
                    slot = layout.params[name]
                    for i, piece in enumerate(slot.pieces):
                        if piece.owner != rank:
                            continue
                        a, b = slot.offset + piece.start, slot.offset + piece.stop
                        split = len(slot.pieces) > 1
                        ax.barh(rank, b - a, left=a, color=color[name], edgecolor="k", lw=0.3, hatch="//" if split else "")
                        if b - a > layout.total_numel / 45:
                            ax.text((a + b) / 2, rank, name + (f" {i + 1}/{len(slot.pieces)}" if split else ""),
                                    ha="center", va="center", fontsize=6.5)
            ax.axvline(bucket.end, color="k", lw=1.2)
    ax.set_yticks(range(g * R), [f"rank {r} (group {r // g}, position {r % g})" for r in range(g * R)])
    ax.invert_yaxis()
    ax.set_xlim(0, layout.total_numel)
    ax.set_title(f"{g * R} ranks as {R} owner groups of {g}: each rank holds its position's shard of every bucket "
                 "(grey) and steps one chunk of it (colour)", fontsize=9)
    ax.set_xlabel("offset in the buffer (elements); black lines end buckets; hatched: a piece of a split parameter",
                  fontsize=8)
    fig.tight_layout()
    harness.save_figure(fig, path, dpi=120)


def draw(layouts: list[tuple[str, Layout]], path: Path) -> None:
    plt = harness.pyplot()
    names = sorted({n for _, lay in layouts for n in lay.params})
    cmap = plt.get_cmap("tab20")
    color = {n: cmap(i % 20) for i, n in enumerate(names)}
    fig, axes = plt.subplots(len(layouts), 1, figsize=(12, 2.2 * len(layouts) + 0.6), squeeze=False)
    width = max(lay.total_numel for _, lay in layouts)
    for ax, (title, lay) in zip(axes[:, 0], layouts):
        for bucket, per_rank in segments(lay):
            for rank, mine in enumerate(per_rank):
                lo, _ = bucket.shard_range(rank)
                ax.barh(rank, bucket.shard_size, left=lo, color="#eeeeee", edgecolor="k", lw=0.6)
                for a, b, name, i, k in mine:
                    ax.barh(rank, b - a, left=lo + a, color=color[name], edgecolor="k", lw=0.3, hatch="//" if k > 1 else "")
                    if b - a > width / 40:
                        ax.text(lo + (a + b) / 2, rank, name + (f" {i + 1}/{k}" if k > 1 else ""), ha="center",
                                va="center", fontsize=6.5)
            ax.axvline(bucket.end, color="k", lw=1.2)
        ax.set_yticks(range(lay.group_size), [f"rank {r}" for r in range(lay.group_size)])
        ax.invert_yaxis()
        ax.set_xlim(0, width)
        ax.set_title(f"{title}: padding {100 * lay.padding_fraction:.1f}% (grey), buffer {lay.total_numel:,} elements",
                     fontsize=9)
        ax.set_xlabel("offset in the buffer (elements); black lines end buckets; hatched: a piece of a split parameter",
                      fontsize=8)
    fig.tight_layout()
    harness.save_figure(fig, path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--bucket-size", type=int, default=20_000)
    parser.add_argument("--text", action="store_true", help="print the layouts instead of drawing them")
    parser.add_argument("--replicas", type=int, default=1,
                        help="owner groups of --dp ranks sharing the stepping (Note [replica sharing])")
    parser.add_argument("--png", type=Path, default=None,
                        help="default docs/images/layout_fill.png, or layout_sharing.png with --replicas")
    args = parser.parse_args(argv)
    if args.replicas > 1:
        specs = toy_specs(True)
        layout = plan_layout(specs, args.dp, args.bucket_size, replicas=args.replicas)
        print(sharing_text(layout, specs))
        if not args.text:
            png = args.png or ROOT / "docs/images/layout_sharing.png"
            draw_sharing(layout, png)
            print(f"wrote {png}")
        return
    args.png = args.png or ROOT / "docs/images/layout_fill.png"
    layouts = [(f"whole ownership, dp={args.dp}", plan_layout(toy_specs(False), args.dp, args.bucket_size)),
               (f"element-wise fill, dp={args.dp}", plan_layout(toy_specs(True), args.dp, args.bucket_size))]
    if args.text:
        for title, lay in layouts:
            print(f"{title}:\n{text(lay)}\n")
        return
    draw(layouts, args.png)
    print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
