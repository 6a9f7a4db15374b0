"""Draws what each bucket holds through one training step with ``shard_parameters=True``, as recorded.

    .venv/bin/python benchmarks/draw_sharded_buckets.py     # writes docs/images/sharded_buckets.png

Two gloo ranks train a stack of 10 linear layers (with an embedding and a head) through a
``LayerwiseSession(shard_parameters=True, prefetch_depth=2)``. Every event of the engine on rank 0
(an all-gather dispatched or landed, a bucket freed, a reduce-scatter dispatched or folded into the
shard) is recorded with the state of every bucket right after it: its parameters freed, being
gathered or full, and whether its full gradient buffer exists. Nothing is modelled: the picture is
the second step's record (the first is the same, after set-up). Also prints the most buckets full at
once in each phase.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks import harness  # noqa: E402


def record(rank: int, world: int) -> dict:
    import torch
    from torch import nn

    import lightning_layerwise as llw
    from lightning_layerwise.engine import waiter as waiter_module
    from lightning_layerwise.engine.buffers import is_allocated

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(64, 48), *[nn.Linear(48, 48) for _ in range(10)], nn.Linear(48, 64))
    session = llw.LayerwiseSession(llw.LayerwiseConfig(shard_parameters=True, bucket_size=5000, prefetch_depth=2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    wrapped = session.wrap(model, optimizer)
    order = wrapped.param_sync.gather_order
    frames: list[dict] = []
    phase = ["set-up"]

    def snapshot(event: str, bucket_name: str) -> None:
        frames.append({"event": event, "bucket": bucket_name, "phase": phase[0],
                       "params": [b.param.state.value for b in order],
                       "grads": [is_allocated(b.grad.data) for b in order]})

    trace = waiter_module.Waiter.trace

    def traced(self, event, bucket):
        trace(self, event, bucket)
        snapshot(event, bucket.name)

    waiter_module.Waiter.trace = traced
    wrapped.grad_sync.waiter.events = []
    for step in range(2):
        frames.clear()
        idx = torch.randint(0, 64, (8, 4))
        optimizer.zero_grad()
        phase[0] = "forward"
        loss = nn.functional.cross_entropy(wrapped(idx).reshape(-1, 64), idx.reshape(-1))
        snapshot("forward returns", "")
        phase[0] = "backward"
        session.backward(loss)
        snapshot("backward returns", "")
        phase[0] = "step"
        session.step(optimizer)
        snapshot("step returns", "")
    return {"frames": frames, "buckets": [b.name for b in order],
            "sizes": [b.param.data.numel() for b in order]}


def draw(result: dict, path: Path) -> None:
    plt = harness.pyplot()
    from matplotlib.colors import ListedColormap

    frames, buckets = result["frames"], result["buckets"]
    code = {"freed": 0, "gathering": 1, "ready": 2, "stepped": 0}
    grid = [[code[f["params"][i]] + (3 if f["grads"][i] else 0) for f in frames] for i in range(len(buckets))]
    colors = ["#f2f2f2", "#9ecae1", "#2171b5", "#fdd0a2", "#a1d99b", "#238b45"]
    fig, ax = plt.subplots(figsize=(max(8, len(frames) * 0.22), 0.45 * len(buckets) + 2.2))
    ax.imshow(grid, aspect="auto", cmap=ListedColormap(colors), vmin=-0.5, vmax=5.5, interpolation="nearest")
    ax.set_yticks(range(len(buckets)), [f"bucket {i} ({n})" for i, n in enumerate(result["sizes"])])
    ax.set_ylabel("buckets in forward order (elements)")
    bounds = [i for i in range(1, len(frames)) if frames[i]["phase"] != frames[i - 1]["phase"]]
    for b in bounds:
        ax.axvline(b - 0.5, color="black", lw=1)
    starts = [0] + bounds
    for s, e in zip(starts, bounds + [len(frames)]):
        ax.text((s + e - 1) / 2, -0.9, frames[s]["phase"], ha="center", va="bottom", fontsize=9)
    ax.set_xticks(range(len(frames)), [f["event"] for f in frames], rotation=90, fontsize=6)
    from matplotlib.patches import Patch
    labels = ["freed (shard only)", "all-gather in flight", "full parameters", "freed + full gradient buffer",
              "gathering + gradient buffer", "full parameters + gradient buffer"]
    ax.legend(handles=[Patch(color=c, label=l) for c, l in zip(colors, labels)], fontsize=7, ncol=3,
              loc="upper center", bbox_to_anchor=(0.5, -0.45))
    ax.set_title("shard_parameters=True, rank 0 of 2, one training step as recorded (prefetch_depth=2)", pad=26)
    fig.tight_layout()
    harness.save_figure(fig, path)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--png", type=Path, default=ROOT / "docs/images/sharded_buckets.png")
    args = p.parse_args(argv)
    result = harness.run_ranks(record, 2)[0]
    for phase in ("forward", "backward", "step"):
        mine = [f for f in result["frames"] if f["phase"] == phase]
        full = max(sum(s != "freed" for s in f["params"]) for f in mine)
        grads = max(sum(f["grads"]) for f in mine)
        print(f"{phase}: at most {full} of {len(result['buckets'])} buckets' parameters full, "
              f"{grads} full gradient buffers")
    draw(result, args.png)
    print(f"wrote {args.png}", file=sys.stderr)


if __name__ == "__main__":
    main()
