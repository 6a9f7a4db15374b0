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
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]

import lightning_layerwise as llw  # noqa: E402
from benchmarks import harness  # noqa: E402

MODELS = {"example_gpt": {}, "gpt_25m": {"n_layer": 8, "n_embd": 512, "n_head": 8}}


def measure(rank: int, world: int, repeats: int) -> dict[str, dict]:
    """Per model: its size, and the median step and check times on this rank."""
    from gpt import GPT, GPTConfig

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
                      "step_ms": 1e3 * harness.median_of(steps), "check_ms": 1e3 * harness.median_of(checks)}
        wrapper.release()
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default=str(harness.RESULTS / "replica_check_cpu.json"))
    args = parser.parse_args(argv)
    rows = harness.run_ranks(measure, 2, args.repeats)[0]
    print(f"\n2 gloo ranks, medians of {args.repeats} (torch {torch.__version__})\n")
    table = []
    for name, r in rows.items():
        share = r["check_ms"] / r["step_ms"]
        table.append([name, f"{r['params'] / 1e6:.1f}M", r["tensors"], f"{r['step_ms']:.1f}", f"{r['check_ms']:.2f}",
                      f"{share:.3f}", f"{share / 100:.2%}"])
    print(harness.markdown_table(["model", "parameters", "tensors", "step ms", "check ms", "check / step",
                                  "cost at every 100 steps"], table))
    harness.write_json(args.out, {"world": 2, "repeats": args.repeats, "torch": torch.__version__, "rows": rows})
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
