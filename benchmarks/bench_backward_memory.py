"""Memory allocated during backward: plain training, ``ddp`` and ``layerwise`` on one process.

Run (about 20 s on 2 CPU cores):

    .venv/bin/python benchmarks/bench_backward_memory.py
    .venv/bin/python benchmarks/bench_backward_memory.py --repo /path/to/an/older/checkout --label before

A stack of ``--layers`` square matrices (``--width``, float32, no bias) and a small batch, so
that weight gradients dominate what backward allocates. After two warm-up steps (AdamW,
``zero_grad()`` before each backward, as Lightning does), the third backward runs under
``torch.profiler`` with ``profile_memory=True``: every allocation and free of the CPU
allocator is recorded with its time, and the table gives the peak of the bytes live during
backward above those live when it started, and the bytes still held at its end. A gradient
allocated by autograd and copied into a bucket counts at its peak even when it is freed
right away; one accumulated in place into a bucket view allocates nothing.

Variants: ``plain`` (no wrapper: autograd allocates every ``.grad``), ``ddp`` (torch
``DistributedDataParallel`` on one gloo process, as Lightning's ``ddp`` with
``gradient_as_bucket_view`` off and on), ``layerwise`` (``LayerwiseDataParallel`` on one
process and, with ``--world 2``, rank 0 of two, its reduce-scatters dispatched after backward
so that gloo's staging copy of each bucket, the collective's memory, is not counted). ``--repo`` imports ``lightning_layerwise``
from another checkout (e.g. the commit before in-place gradients) to compare releases.
Writes ``benchmarks/results/backward_memory_cpu[_LABEL].json`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import harness  # noqa: E402  (imports torch, never lightning_layerwise: see --repo)


def _peak_during(fn) -> tuple[int, int]:
    """(peak bytes live above the start, bytes still live at the end) of the CPU allocator while ``fn`` runs."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak, live


def measure(rank: int, world: int, variant: str, args: argparse.Namespace) -> dict:
    """The third step's backward of ``variant`` on this rank: peak and held bytes of the CPU allocator."""
    if args.repo is not None:
        sys.path.insert(0, str(args.repo))
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(args.width, args.width, bias=False) for _ in range(args.layers)])
    wrapped: nn.Module = model
    wrapper = None
    if variant.startswith("ddp"):
        wrapped = nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=variant == "ddp_bucket_view")
    elif variant == "layerwise":
        from lightning_layerwise import LayerwiseDataParallel, ProcessGroups

        # The reduce-scatters are dispatched after backward, outside the measurement: gloo stages a whole
        # bucket for each, which is the collective's memory, not a gradient's.
        wrapper = LayerwiseDataParallel(model, ProcessGroups.create(), overlap_grad_reduce=False)
        wrapped = wrapper
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if wrapper is not None:
        wrapper.use_shards_in(opt)
    x = torch.randn(args.batch, args.width)

    def step(profiled: bool):
        opt.zero_grad()
        if wrapper is not None and hasattr(wrapper, "prepare_backward"):
            wrapper.prepare_backward()
        loss = wrapped(x).square().mean()
        result = _peak_during(loss.backward) if profiled else loss.backward()
        if wrapper is not None:
            wrapper.finish_grad_sync()
        opt.step()
        if wrapper is not None:
            wrapper.start_param_sync()
        return result

    step(False)
    step(False)
    peak, held = step(True)
    return {"variant": variant, "world": world, "peak_bytes": peak, "held_bytes": held}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--world", type=int, default=2, help="also run layerwise at this many processes (1: not)")
    p.add_argument("--repo", type=Path, default=None, help="import lightning_layerwise from this checkout")
    p.add_argument("--label", default="", help="suffix of the JSON file")
    p.add_argument("--out", type=Path, default=None,
                   help="the JSON to write (default benchmarks/results/backward_memory_cpu[_LABEL].json)")
    args = p.parse_args(argv)
    runs = [(v, 1) for v in ("plain", "ddp", "ddp_bucket_view", "layerwise")]
    runs += [("layerwise", args.world)] if args.world > 1 else []
    rows = [harness.run_ranks(measure, w, v, args)[0] for v, w in runs]
    grads = args.layers * args.width * args.width * 4
    print(f"{args.layers} x {args.width}x{args.width} float32: weight gradients {grads / 2**20:.1f} MiB")
    print(harness.markdown_table(
        ["variant", "processes", "peak MiB allocated during backward", "MiB still held after it"],
        [[r["variant"], r["world"], f"{r['peak_bytes'] / 2**20:.1f}", f"{r['held_bytes'] / 2**20:.1f}"]
         for r in rows]))
    name = "backward_memory_cpu" + (f"_{args.label}" if args.label else "") + ".json"
    machine = harness.machine(threads=1)
    meta = {"layers": args.layers, "width": args.width, "batch": args.batch,
            "repo": str(args.repo) if args.repo else None, "torch": machine["torch"], "python": machine["python"],
            "weight_grad_bytes": grads}
    path = harness.write_json(args.out or harness.RESULTS / name, {"meta": meta, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
