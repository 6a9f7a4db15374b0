"""The largest model each strategy trains under a per-rank memory cap: a search over model depth.

    MALLOC_MMAP_THRESHOLD_=65536 python benchmarks/largest_under_cap.py --cap-mib 2048 --devices 4

Each configuration of ``benchmarks/bench_strategies.py`` (default: ``ddp`` + AdamW, ``layerwise`` +
AdamW, ``layerwise`` with ``shard_parameters=True`` + AdamW, FSDP2 with ``reshard_after_forward`` +
AdamW) trains the example GPT of the ``120m`` row (``n_embd=512``, 8 heads, batch 2 x 64 per rank,
fp32, one thread per rank) with ``N`` layers of 3.15 M parameters each, for ``--warmup`` + ``--steps``
steps, the end of the run included (a sharded module stays sharded when ``fit`` returns, Note
[sharded release] in ``lightning_layerwise/engine/sharded.py``). A run *fits* when the largest peak
RSS of its ranks is at most the cap.

The search, per configuration: two depths (``--probe-layers``) give a line through peak RSS against
depth; the depth it predicts at the cap is run, then the ladder is walked by ``--step`` layers up
while runs fit and down while they do not, until a fitting depth and the next one up that does not
are both measured (or ``--max-layers`` is reached). Every run is measured, none is extrapolated: the
table gives the largest measured depth that fits and the smallest measured one that does not.

The cap is checked against measured peak RSS, not enforced by the kernel: ``RLIMIT_AS`` limits
virtual address space, which torch's threads and mappings make far larger than what a rank holds,
and this machine has no per-process memory cgroup. glibc keeps freed blocks in its heap unless told
not to, so run with ``MALLOC_MMAP_THRESHOLD_=65536`` (large blocks are then returned when freed, as
on a GPU's caching allocator after ``empty_cache``).

Writes ``--out`` (JSON: every run) and a markdown table next to it in ``--docs-dir``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
from benchmarks import harness  # noqa: E402

DEFAULT_CONFIGS = "ddp_adamw,layerwise_adamw,layerwise_sharded_adamw,fsdp2_adamw_reshard"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cap-mib", type=float, default=2048, help="per-rank peak RSS cap, MiB")
    parser.add_argument("--devices", type=int, default=4, help="ranks")
    parser.add_argument("--configs", default=DEFAULT_CONFIGS, help="configurations of bench_strategies.py")
    parser.add_argument("--probe-layers", default="16,40", help="the two depths the first line goes through")
    parser.add_argument("--step", type=int, default=8, help="layers between rungs of the ladder")
    parser.add_argument("--max-layers", type=int, default=200, help="the deepest model tried")
    parser.add_argument("--training-only", action="store_true",
                        help="compare the cap with the peak before the run's end (the strategy's teardown)")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps before them")
    parser.add_argument("--timeout", type=float, default=1500, help="seconds per run")
    parser.add_argument("--out", default=str(HERE / "results" / "largest_under_cap.json"))
    parser.add_argument("--docs-dir", default=str(ROOT / "docs" / "benchmarks"))
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plot")
    parser.add_argument("--from-json", default=None, help="only rebuild the table and plot from this JSON")
    return parser.parse_args(argv)


def run_once(config: str, layers: int, args: argparse.Namespace, scratch: Path) -> dict:
    """One ``bench_strategies.py`` run of ``config`` at ``layers``: its peak RSS per rank and parameters."""
    out = scratch / f"{config}-{layers}.json"
    cmd = [sys.executable, str(HERE / "bench_strategies.py"), "--sizes", f"120m-L{layers}",
           "--devices", str(args.devices), "--configs", config, "--repeats", "1", "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--timeout", str(args.timeout), "--out", str(out),
           "--docs-dir", str(scratch), "--no-plots"]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout + 120)
    wall = time.perf_counter() - start
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"{config} at {layers} layers failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    cell = json.loads(out.read_text())["cells"][0]
    result = cell["results"][config]
    peak = result["peak_rss_bytes_per_rank_median"] / 2**20
    train = result["train_peak_rss_bytes_per_rank_median"] / 2**20
    row = {"config": config, "layers": layers, "params": cell["model"]["n_params"], "peak_rss_mib": peak,
           "train_peak_rss_mib": train, "fits": (train if args.training_only else peak) <= args.cap_mib,
           "wall_s": wall, "param_bytes_per_rank": result.get("param_bytes_per_rank")}
    print(f"  {config:28s} {layers:4d} layers {row['params'] / 1e6:7.1f} M  peak {peak:7.0f} MiB (training "
          f"{train:7.0f})  {'fits' if row['fits'] else 'over'}  ({wall:.0f} s)", flush=True)
    return row


def search(config: str, args: argparse.Namespace, scratch: Path) -> list[dict]:
    runs: dict[int, dict] = {}

    def at(layers: int) -> dict:
        if layers not in runs:
            runs[layers] = run_once(config, layers, args, scratch)
        return runs[layers]

    low, high = (int(x) for x in args.probe_layers.split(","))
    metric = "train_peak_rss_mib" if args.training_only else "peak_rss_mib"
    a, b = at(low), at(high)
    slope = (b[metric] - a[metric]) / (high - low)
    guess = low if slope <= 0 else int(low + (args.cap_mib - a[metric]) / slope)
    layers = max(1, min(args.max_layers, guess))
    if at(layers)["fits"]:
        while layers + args.step <= args.max_layers and at(layers + args.step)["fits"]:
            layers += args.step
        if layers + args.step <= args.max_layers:
            at(layers + args.step)
    else:
        while layers - args.step >= 1 and not at(layers - args.step)["fits"]:
            layers -= args.step
        if layers - args.step >= 1:
            at(layers - args.step)
    return sorted(runs.values(), key=lambda r: r["layers"])


def summary(config: str, runs: list[dict]) -> dict:
    fits = [r for r in runs if r["fits"]]
    over = [r for r in runs if not r["fits"]]
    best = max(fits, key=lambda r: r["layers"]) if fits else None
    first_over = min((r for r in over if best is None or r["layers"] > best["layers"]),
                     key=lambda r: r["layers"], default=None)
    return {"config": config, "largest_fitting": best, "smallest_over": first_over}


def peaks(run: dict) -> str:
    return f"{run['peak_rss_mib']:.0f} ({run['train_peak_rss_mib']:.0f})"


def markdown(data: dict) -> str:
    meta = data["meta"]
    lines = [
        "# The largest model under a per-rank memory cap",
        "",
        f"Generated by `{meta['command']}`. Machine: {meta['machine']}, torch {meta['torch']}, "
        f"{meta['devices']} gloo ranks on CPU, one thread each; `MALLOC_MMAP_THRESHOLD_={meta['mmap_threshold']}`; "
        f"{meta['total_wall_s']:.0f} s in all. The example GPT at width 512 (8 heads, batch 2 x 64 per rank, "
        "fp32, AdamW, clipping at 1.0), with the number of layers searched; peak RSS is the largest rank's, over "
        f"{meta['warmup']} + {meta['steps']} steps and the end of the run (in parentheses: before the run's end, "
        "where a sharded module is gathered whole). A run fits when "
        f"{'the peak before the end' if meta['training_only'] else 'the whole run'} stays within the cap of "
        f"{meta['cap_mib']:.0f} MiB per rank.",
        "",
        "| configuration | largest that fits: layers | parameters | peak RSS MiB/rank | "
        "smallest measured over the cap: layers | parameters | peak RSS MiB/rank |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in data["summary"]:
        best, over = s["largest_fitting"], s["smallest_over"]
        left = (f"{best['layers']} | {best['params'] / 1e6:.0f} M | {peaks(best)}" if best
                else "none | – | –")
        right = (f"{over['layers']} | {over['params'] / 1e6:.0f} M | {peaks(over)}" if over
                 else "not reached | – | –")
        lines.append(f"| `{s['config']}` | {left} | {right} |")
    lines += ["", "Every run:", "",
              "| configuration | layers | parameters | peak RSS MiB/rank (training) | fits | wall s |",
              "|---|---|---|---|---|---|"]
    for r in data["runs"]:
        lines.append(f"| `{r['config']}` | {r['layers']} | {r['params'] / 1e6:.1f} M | {peaks(r)} | "
                     f"{'yes' if r['fits'] else 'no'} | {r['wall_s']:.0f} |")
    return "\n".join(lines) + "\n"


def plot(data: dict, path: Path) -> None:
    """Peak RSS per rank against parameters, each configuration a line, training and whole run, and the cap."""
    plt = harness.pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.8))
    for i, summary_row in enumerate(data["summary"]):
        config = summary_row["config"]
        runs = sorted((r for r in data["runs"] if r["config"] == config), key=lambda r: r["params"])
        x = [r["params"] / 1e6 for r in runs]
        line, = ax.plot(x, [r["train_peak_rss_mib"] for r in runs], "o-", label=f"{config} (training)")
        if any(abs(r["peak_rss_mib"] - r["train_peak_rss_mib"]) > 20 for r in runs):
            ax.plot(x, [r["peak_rss_mib"] for r in runs], "x--", color=line.get_color(),
                    label=f"{config} (with the run's end)")
    cap = data["meta"]["cap_mib"]
    ax.axhline(cap, color="black", linewidth=1)
    ax.text(ax.get_xlim()[0], cap, f" cap {cap:.0f} MiB", va="bottom")
    ax.set_xlabel("parameters (M)")
    ax.set_ylabel("peak RSS per rank (MiB)")
    ax.set_title(f"Peak memory per rank at {data['meta']['devices']} CPU ranks, AdamW, fp32")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    harness.save_figure(fig, path)
    plt.close(fig)


def write_docs(data: dict, out: Path, args: argparse.Namespace) -> None:
    md = Path(args.docs_dir) / (out.stem + ".md")
    text = markdown(data)
    if not args.no_plots:
        png = md.with_suffix(".png")
        plot(data, png)
        text += f"\n![peak memory against parameters]({png.name})\n"
    md.write_text(text)
    print(text)
    print(f"wrote {md}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.from_json:
        path = Path(args.from_json)
        write_docs(json.loads(path.read_text()), path, args)
        return
    import torch

    start = time.perf_counter()
    runs, summaries = [], []
    with tempfile.TemporaryDirectory() as scratch:
        for config in args.configs.split(","):
            print(f"{config}:", flush=True)
            found = search(config, args, Path(scratch))
            runs += found
            summaries.append(summary(config, found))
    data = {
        "meta": {"command": "python benchmarks/largest_under_cap.py " + " ".join(sys.argv[1:] if argv is None
                                                                                    else argv),
                 "machine": f"{harness.cpu_model()}, {os.cpu_count()} CPU cores",
                 "torch": torch.__version__, "devices": args.devices, "cap_mib": args.cap_mib,
                 "mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_", "unset"), "steps": args.steps,
                 "training_only": args.training_only,
                 "warmup": args.warmup, "total_wall_s": time.perf_counter() - start},
        "summary": summaries, "runs": runs,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1))
    print(f"wrote {out}")
    write_docs(data, out, args)


if __name__ == "__main__":
    main()
