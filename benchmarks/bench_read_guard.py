"""What the read guard costs, and how much all-gather it still hides (Note [read guard]).

Run (2 gloo ranks on CPU, about 2 minutes)::

    .venv/bin/python benchmarks/bench_read_guard.py
    .venv/bin/python benchmarks/bench_read_guard.py --quick        # seconds, for a smoke test

For each model, the same 2-rank training loop (wrapper protocol: forward, backward,
``finish_grad_sync``, ``optimizer.step``, ``start_param_sync``) runs under

* ``wait``: the default guard: reads outside a module's pre-hook wait for their bucket;
* ``off``: the guard removed (stale reads possible: the behaviour before the guard);
* ``no_overlap``: ``overlap_param_gather=False``: the all-gather completes inside the step.

Configurations are interleaved, ``--repeats`` times each, and every number is a median
over repeats of the per-run median step. Per configuration it reports the step time,
its ratio to ``off``, the all-gather time the forward was blocked on (the wrapper's
``grad_sync.waiter.seconds["all_gather"]``, Note [timing communication waits]), how many
reads waited through the guard per step, and whether the final parameters equal the
``no_overlap`` run (the reference: no overlap, nothing stale).

Models: the example GPT (calls every module it uses: the guard never fires) and
``lightning.pytorch.demos.Transformer`` (``nn.MultiheadAttention`` reads
``out_proj.weight`` without calling ``out_proj``: the guard fires).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]

import lightning_layerwise as llw  # noqa: E402
from benchmarks import harness  # noqa: E402

CONFIGS = {
    "wait": {"param_read_guard": "wait"},
    "off": {"param_read_guard": "off"},
    "no_overlap": {"overlap_param_gather": False},
}


def build(model_name: str, quick: bool):
    torch.manual_seed(0)
    if model_name == "example_gpt":
        from gpt import GPT, GPTConfig

        cfg = GPTConfig(n_layer=2, n_embd=64, block_size=64) if quick else GPTConfig()
        model = GPT(cfg)

        def batch(g, per_rank):
            idx = torch.randint(0, cfg.vocab_size, (per_rank, cfg.block_size + 1), generator=g)
            return (idx[:, :-1], idx[:, 1:]), None

        def loss(model, inputs, _):
            return model(*inputs)[1]

        return model, batch, loss, 50_000 if quick else 200_000
    from lightning.pytorch.demos import Transformer

    # Buckets small enough that 5 of the 8 attention layers' out_proj lie in a later bucket than their
    # in_proj (at 200_000 elements none does): the guard has reads to wait for.

    ninp = 64 if quick else 128
    model = Transformer(vocab_size=96, ninp=ninp, nhead=4, nhid=2 * ninp, nlayers=2, dropout=0.0)

    def batch(g, per_rank):
        tokens = torch.randint(0, 96, (per_rank, 64 if quick else 128), generator=g)
        return (tokens, (tokens * 5 + 1) % 96), (tokens * 5 + 2) % 96

    def loss(model, inputs, target):
        return F.nll_loss(model(*inputs), target.reshape(-1))

    return model, batch, loss, 20_000 if quick else 100_000


def run_config(rank: int, world: int, model_name: str, config: str, steps: int, warmup: int, quick: bool) -> dict:
    model, make_batch, loss_fn, bucket_size = build(model_name, quick)
    wrapper = llw.LayerwiseDataParallel(model, bucket_size=bucket_size, **CONFIGS[config])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1 + rank)
    per_rank = 4 if quick else 16
    times, waits, guarded = [], [], []
    for step in range(warmup + steps):
        inputs, target = make_batch(g, per_rank)
        wrapper.grad_sync.waiter.seconds = {}
        before = wrapper.param_sync.guarded_reads
        t0 = time.perf_counter()
        loss_fn(wrapper, inputs, target).backward()
        wrapper.finish_grad_sync()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        wrapper.start_param_sync()
        elapsed = time.perf_counter() - t0
        if step >= warmup:
            times.append(elapsed)
            waits.append(wrapper.grad_sync.waiter.seconds.get("all_gather", 0.0))
            guarded.append(wrapper.param_sync.guarded_reads - before)
    wrapper.param_sync.finish()
    checksum = harness.flat_params(model)
    n_buckets = len(wrapper.buckets)
    wrapper.release()
    return {"step_ms": 1e3 * harness.median_of(times), "all_gather_wait_ms": 1e3 * harness.median_of(waits),
            "guarded_reads_per_step": harness.median_of(guarded), "params": checksum, "buckets": n_buckets}


def run_jobs(rank: int, world: int, jobs: list, steps: int, warmup: int, quick: bool) -> list[dict]:
    """Every (model, configuration) of ``jobs`` in turn on this rank."""
    return [run_config(rank, world, m, c, steps, warmup, quick) for m, c in jobs]


def summarize(models: list[str], jobs: list, results: list[dict]) -> list[dict]:
    """One row per model and configuration: medians over its runs, the error against ``no_overlap``."""
    rows: dict[tuple[str, str], list[dict]] = {}
    for job, result in zip(jobs, results):
        rows.setdefault(job, []).append(result)
    table = []
    for model in models:
        reference = rows[(model, "no_overlap")][0]["params"]
        off_ms = harness.median_of(r["step_ms"] for r in rows[(model, "off")])
        for config in CONFIGS:
            runs = rows[(model, config)]
            step_ms = harness.median_of(r["step_ms"] for r in runs)
            table.append({
                "model": model, "config": config, "buckets": runs[0]["buckets"], "step_ms_median": step_ms,
                "step_vs_off": step_ms / off_ms,
                "all_gather_wait_ms_median": harness.median_of(r["all_gather_wait_ms"] for r in runs),
                "guarded_reads_per_step": harness.median_of(r["guarded_reads_per_step"] for r in runs),
                "max_rel_err_vs_no_overlap": max(harness.relative_error(r["params"], reference) for r in runs),
                "runs": len(runs),
            })
    return table


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny models and few steps (a smoke test)")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved runs of every configuration")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--out", default=str(harness.RESULTS / "read_guard_cpu.json"))
    args = harness.quick_defaults(parser.parse_args(argv), repeats=(1, 5), steps=(3, 15))
    repeats, steps = args.repeats, args.steps
    models = ["example_gpt", "demo_transformer"]
    jobs = [(m, c) for _ in range(repeats) for m in models for c in CONFIGS]  # interleaved
    world = 2
    results = harness.run_ranks(run_jobs, world, jobs, steps, 2, args.quick)[0]
    table = summarize(models, jobs, results)
    print(f"\n2 gloo ranks, {steps} steps x {repeats} interleaved runs, medians (torch {torch.__version__})\n")
    print(harness.markdown_table(
        ["model", "config", "buckets", "step ms", "vs off", "all-gather wait ms", "guarded reads/step",
         "rel err vs no_overlap"],
        [[r["model"], r["config"], r["buckets"], f"{r['step_ms_median']:.1f}", f"{r['step_vs_off']:.3f}",
          f"{r['all_gather_wait_ms_median']:.2f}", f"{r['guarded_reads_per_step']:.0f}",
          f"{r['max_rel_err_vs_no_overlap']:.1e}"] for r in table]))
    out = harness.write_json(args.out, {"world": world, "steps": steps, "repeats": repeats, "quick": args.quick,
                                        "torch": torch.__version__, "rows": table})
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
