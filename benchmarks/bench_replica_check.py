"""What one replica check costs (``LayerwiseStrategy(replica_check_every=N)``, Note [replica check]).

Run (2 gloo ranks on CPU, about a minute)::

    .venv/bin/python benchmarks/bench_replica_check.py

For the example GPT (0.8M parameters) and a wider GPT (8 layers, d=512, 25M parameters),
2 ranks time ``wrapper.check_replicas()`` (per-parameter bit sums + one all-gather of one
int64 per parameter) and one training step of the same model, 20 times each after
warm-up; medians. A check every N steps costs ``check / (N * step)`` of the run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "examples"), str(ROOT / "benchmarks")]

import lightning_layerwise as llw  # noqa: E402
from bench_read_guard import free_port  # noqa: E402

MODELS = {"example_gpt": {}, "gpt_25m": {"n_layer": 8, "n_embd": 512, "n_head": 8}}


def _worker(rank: int, world: int, port: int, outdir: str, repeats: int) -> None:
    from gpt import GPT, GPTConfig

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=300))
    rows = {}
    for name, overrides in MODELS.items():
        torch.manual_seed(0)
        cfg = GPTConfig(**overrides)
        model = GPT(cfg)
        wrapper = llw.LayerwiseDataParallel(model, bucket_size=2_000_000)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(rank)
        steps, checks = [], []
        for i in range(repeats + 3):
            idx = torch.randint(0, cfg.vocab_size, (8, cfg.block_size + 1), generator=g)
            t0 = time.perf_counter()
            wrapper(idx[:, :-1], idx[:, 1:])[1].backward()
            wrapper.finish_grad_sync()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            wrapper.start_param_sync(force_sync=True)
            t1 = time.perf_counter()
            wrapper.check_replicas()
            t2 = time.perf_counter()
            if i >= 3:
                steps.append(t1 - t0)
                checks.append(t2 - t1)
        rows[name] = {"params": sum(p.numel() for p in model.parameters()),
                      "tensors": len(list(model.parameters())),
                      "step_ms": 1e3 * statistics.median(steps), "check_ms": 1e3 * statistics.median(checks)}
        wrapper.release()
    if rank == 0:
        (Path(outdir) / "rows.json").write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "replica_check_cpu.json"))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as outdir:
        mp.start_processes(_worker, args=(2, free_port(), outdir, args.repeats), nprocs=2, start_method="spawn")
        rows = json.loads((Path(outdir) / "rows.json").read_text())
    print(f"\n2 gloo ranks, medians of {args.repeats} (torch {torch.__version__})\n")
    print("| model | parameters | tensors | step ms | check ms | check / step | cost at every 100 steps |")
    print("|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        share = r["check_ms"] / r["step_ms"]
        print(f"| {name} | {r['params'] / 1e6:.1f}M | {r['tensors']} | {r['step_ms']:.1f} | {r['check_ms']:.2f} | "
              f"{share:.3f} | {share / 100:.2%} |")
    Path(args.out).write_text(json.dumps({"world": 2, "repeats": args.repeats, "torch": torch.__version__,
                                          "rows": rows}, indent=1))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
