"""Step time of the Muon family's options: stacked vs flattened experts, whole vs split QKV, NorMuon vs Muon.

    python3 benchmarks/bench_muon_family.py                 # on a GPU (bf16 Newton-Schulz)
    python3 benchmarks/bench_muon_family.py --device cpu --quick

Each row is one ``llw.Muon.step()`` on float32 parameters with random gradients (median of timed steps after
warm-ups, synchronized), next to the Newton-Schulz flops of its matrices
(``lightning_layerwise.optim.matrices.newton_schulz_flops``). Prints a table and writes
``benchmarks/results/muon_family_<device>.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from torch import nn

import lightning_layerwise as llw
from lightning_layerwise.optim.matrices import MatrixView, matrix_shapes, newton_schulz_flops

RESULTS = Path(__file__).resolve().parent / "results"


def case(name: str, shapes: list[tuple[int, ...]], view: MatrixView | None, normuon: bool, device: str) -> dict:
    params = [nn.Parameter(torch.randn(s, device=device) * 0.02) for s in shapes]
    group = {"params": params, "use_muon": True}
    if view is not None:
        group.update(stack=view.stack, split=view.split, split_dim=view.split_dim)
    opt = llw.Muon([group], normuon=normuon, lr=0.01 if normuon else 0.02)
    for p in params:
        p.grad = torch.randn_like(p)
    return {"name": name, "opt": opt,
            "flops": sum(newton_schulz_flops(matrix_shapes(s, view or MatrixView(stack=False))) for s in shapes)}


def timed(opt: llw.Muon, device: str, warmup: int, steps: int) -> float:
    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    for _ in range(warmup):
        opt.step()
    times = []
    for _ in range(steps):
        sync()
        start = time.perf_counter()
        opt.step()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="small shapes (a smoke test)")
    args = parser.parse_args()
    q = 16 if args.quick else 1
    E, d, h, hidden = 64 // (4 if args.quick else 1), 4096 // q, 32, 1024 // q
    cases = [
        ("experts [E, hidden, d], stacked", [(E, hidden, d)], MatrixView(), False),
        ("experts [E, hidden, d], flattened", [(E, hidden, d)], MatrixView(stack=False), False),
        ("fused QKV [3d, d], whole", [(3 * d, d)], None, False),
        ("fused QKV [3d, d], split 3", [(3 * d, d)], MatrixView(split=3), False),
        ("fused QKV [3d, d], per head", [(3 * d, d)], MatrixView(split=3 * h), False),
        ("8 layers of [d, d] + [4d, d], Muon", [(d, d)] * 8 + [(4 * d, d)] * 8, None, False),
        ("8 layers of [d, d] + [4d, d], NorMuon", [(d, d)] * 8 + [(4 * d, d)] * 8, None, True),
    ]
    rows = []
    for name, shapes, view, normuon in cases:
        c = case(name, shapes, view, normuon, args.device)
        ms = timed(c["opt"], args.device, warmup=2 if args.quick else 3, steps=3 if args.quick else 10)
        rows.append({"case": name, "median_ms": round(ms, 3), "ns_gflop": round(c["flops"] / 1e9, 2),
                     "tflop_per_s": round(c["flops"] / ms / 1e9, 2)})
        del c
        if args.device == "cuda":
            torch.cuda.empty_cache()
    device_name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    print(f"# Muon family step times ({device_name}, torch {torch.__version__}, bf16 Newton-Schulz, "
          f"E={E}, d={d}, heads={h}, expert hidden={hidden})\n")
    print("| case | median ms | Newton-Schulz GFLOP | TFLOP/s |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['median_ms']} | {r['ns_gflop']} | {r['tflop_per_s']} |")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"muon_family_{args.device}{'_quick' if args.quick else ''}.json"
    out.write_text(json.dumps({"device": device_name, "torch": torch.__version__, "rows": rows}, indent=1))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
