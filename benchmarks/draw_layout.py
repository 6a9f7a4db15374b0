"""Draws the layout the planner makes for a small transformer: buffers, buckets, shards, owners.

    .venv/bin/python benchmarks/draw_layout.py            # writes docs/images/layout_fill.png
    .venv/bin/python benchmarks/draw_layout.py --text     # the same as text, for docs/design.md

The model is the toy transformer of docs/design.md: ``wte`` 256x64 (tied to the
output), ``wpe`` 64x64, and per block an attention 64x64 with bias, an MLP 256x64
with bias and a norm. Parameters are routed as ``lightning_layerwise.Muon`` routes
them: matrices of the blocks whole (Muon), embeddings, biases and norm weights
element-wise (AdamW), planned at ``dp`` ranks with element-wise fill and, for
comparison, without it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from lightning_layerwise.layout import Layout, ParamSpec, plan_layout  # noqa: E402


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
            for rank in range(layout.dp):
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
    lines = [f"dp={layout.dp}, padding {100 * layout.padding_fraction:.1f}% of {layout.total_numel:,} elements"]
    for bucket, per_rank in segments(layout):
        cells = []
        for mine in per_rank:
            names = [n + (f" ({i + 1}/{k})" if k > 1 else "") for _, _, n, i, k in mine]
            used = sum(b - a for a, b, *_ in mine)
            cells.append(f"[{', '.join(names) or '-'}] {100 * (1 - used / bucket.shard_size):.0f}% pad")
        lines.append(f"bucket {bucket.index} ({bucket.shard_size:,}/shard): " + " | ".join(cells))
    return "\n".join(lines)


def draw(layouts: list[tuple[str, Layout]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
        ax.set_yticks(range(lay.dp), [f"rank {r}" for r in range(lay.dp)])
        ax.invert_yaxis()
        ax.set_xlim(0, width)
        ax.set_title(f"{title}: padding {100 * lay.padding_fraction:.1f}% (grey), buffer {lay.total_numel:,} elements",
                     fontsize=9)
        ax.set_xlabel("offset in the buffer (elements); black lines end buckets; hatched: a piece of a split parameter",
                      fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--bucket-size", type=int, default=20_000)
    parser.add_argument("--text", action="store_true", help="print the layouts instead of drawing them")
    parser.add_argument("--png", type=Path, default=ROOT / "docs/images/layout_fill.png")
    args = parser.parse_args(argv)
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
