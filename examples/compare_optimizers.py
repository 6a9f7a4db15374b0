"""Loss curves of the example GPT trained with AdamW, Muon and Muon's variants, all under ``strategy="layerwise"``.

Run from the repository root (default: 2 CPU processes, 300 steps per optimizer, 4 to 5
minutes on 2 CPU cores)::

    .venv/bin/python examples/compare_optimizers.py
    .venv/bin/python examples/compare_optimizers.py --steps 500 --val-every 100
    python examples/compare_optimizers.py --accelerator gpu --devices 8 --steps 2000

Every run is ``examples/train.py fit --config examples/configs/cpu.yaml`` (batch 16 per
rank, gradient clipping 1.0, bucket size 200,000; ``--seed_everything`` from ``--seeds``
sets the initial weights and, on several processes, the data order: runs of one seed
start from the same weights and see the same batches) with only the optimizer, the seed
and the run length overridden on the command line. ``--optimizers`` picks the runs by name:

    adamw       --model.optimizer torch.optim.AdamW  lr=1e-3, betas=(0.9, 0.95), weight_decay=0
                (a sweep over {5e-4, 1e-3, 2e-3, 3e-3, 1e-2}, 150 steps: 1e-3 and 2e-3 tie on
                validation loss, 2e-3 spikes early, 3e-3 and 1e-2 end higher; docs/benchmarks.md)
    muon        --model.optimizer lightning_layerwise.Muon  lr=0.02 (hidden matrices), momentum=0.95,
                adamw_lr=3e-3 for the embeddings/tied head, biases and LayerNorm gains (cpu.yaml)
    muon_heads  muon, with each fused QKV weight orthogonalized per head (``--model.split_qkv heads``:
                3 * n_head row blocks instead of one matrix)
    normuon     muon with NorMuon's per-row normalization (``normuon=True``) at ``lr=--normuon-lr``
                (0.01). NorMuon's lr is on AdamW's scale (update RMS 0.2 * lr), Muon's is not
                (update RMS about lr / sqrt(128) for this model's 128 x 128 matrices): 0.01 gives
                0.002, about Muon's 0.02 / sqrt(128) = 0.0018.
    muon_polar  muon with the Polar Express Newton-Schulz coefficients (``ns_coefficients="polar_express"``)

An AdamW learning-rate sweep point: ``--optimizers adamw --adamw-lr 2e-3 --steps 150
--json /tmp/lr.json --plot /tmp/lr.png``. The Muon family over two seeds::

    .venv/bin/python examples/compare_optimizers.py --optimizers muon muon_heads normuon muon_polar \\
        --seeds 1234 1235 --steps 300 --val-every 50 \\
        --json benchmarks/results/loss_curves_muon_family.json --plot docs/images/loss_curves_muon_family.png

``--moe`` runs the mixture-of-experts example instead (``examples/train_moe.py fit --config
examples/configs/moe_cpu.yaml --model.grouped_experts true``: the experts of a layer kept
as 3-D stacks) twice per seed, and ``--optimizers`` picks among:

    stacked     Muon orthogonalizes each expert's matrix on its own (the default for a stack)
    flattened   ``--model.flatten_experts true``: Muon sees each 3-D stack (this rank's experts)
                as one flattened ``(experts, rest)`` matrix

and writes ``docs/images/loss_curves_moe_stack.png`` and
``benchmarks/results/loss_curves_moe_stack.json`` unless ``--plot``/``--json`` say otherwise.

The training loss is logged every step (the global batch's loss, ``sync_dist=True``),
the validation loss every ``--val-every`` steps on the config's fixed held-out batches
(8 per rank for the GPT, 4 for the MoE model). Each run's ``CSVLogger`` metrics are read
back from ``runs/compare/<name>_s<seed>/metrics.csv`` (``runs/compare_moe/...`` with ``--moe``).

With the defaults (``adamw`` and ``muon``, one seed), writes ``docs/images/loss_curves.png``
(train loss, raw and smoothed, and validation points against the step) and
``benchmarks/results/loss_curves.json`` (every number in the plot, the exact commands and
the wall time of each run). With several seeds or any other run, the plot has two
panels: the smoothed train loss of every run (one colour per variant, one line style
per seed) with its validation points, and the final validation loss of each run; the
JSON file adds a ``summary`` of the final validation loss per seed, its mean, and the
wall times.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN_DIR = "runs/compare"
MOE_RUN_DIR = "runs/compare_moe"
GPT_NAMES = ("adamw", "muon", "muon_heads", "normuon", "muon_polar")
MOE_NAMES = ("stacked", "flattened")
LABELS = {
    "adamw": "AdamW", "muon": "Muon", "muon_heads": "Muon, QKV per head", "normuon": "NorMuon",
    "muon_polar": "Muon, Polar Express", "stacked": "experts stacked (per expert)",
    "flattened": "experts flattened (one matrix per stack)",
}
COLORS = {
    "adamw": "tab:blue", "muon": "tab:orange", "muon_heads": "tab:green", "normuon": "tab:red",
    "muon_polar": "tab:purple", "stacked": "tab:orange", "flattened": "tab:cyan",
}
SEED_STYLES = ("-", "--", ":", "-.")


def muon_overrides(args: argparse.Namespace, lr: float) -> list[str]:
    return ["--model.optimizer", "lightning_layerwise.Muon", "--model.optimizer.lr", str(lr),
            "--model.optimizer.momentum", "0.95", "--model.optimizer.adamw_lr", str(args.muon_adamw_lr),
            "--model.optimizer.weight_decay", "0.0", "--model.optimizer.adamw_weight_decay", "0.0"]


def optimizer_overrides(name: str, args: argparse.Namespace) -> list[str]:
    if name == "adamw":
        return ["--model.optimizer", "torch.optim.AdamW", "--model.optimizer.lr", str(args.adamw_lr),
                "--model.optimizer.betas", "[0.9, 0.95]", "--model.optimizer.weight_decay", "0.0"]
    if name == "muon":
        return muon_overrides(args, args.muon_lr)
    if name == "muon_heads":
        return [*muon_overrides(args, args.muon_lr), "--model.split_qkv", "heads"]
    if name == "normuon":
        return [*muon_overrides(args, args.normuon_lr), "--model.optimizer.normuon", "true"]
    if name == "muon_polar":
        return [*muon_overrides(args, args.muon_lr), "--model.optimizer.ns_coefficients", "polar_express"]
    if name == "stacked":
        return ["--model.grouped_experts", "true"]
    if name == "flattened":
        return ["--model.grouped_experts", "true", "--model.flatten_experts", "true"]
    raise ValueError(f"unknown run {name!r}")


def run_version(name: str, seed: int) -> str:
    return f"{name}_s{seed}"


def train_command(name: str, seed: int, args: argparse.Namespace) -> list[str]:
    script, config, run_dir = (("examples/train_moe.py", "examples/configs/moe_cpu.yaml", MOE_RUN_DIR) if args.moe
                               else ("examples/train.py", "examples/configs/cpu.yaml", RUN_DIR))
    return [
        sys.executable, script, "fit", "--config", config, "--seed_everything", str(seed),
        "--trainer.accelerator", args.accelerator, "--trainer.devices", str(args.devices),
        "--trainer.max_steps", str(args.steps), "--trainer.val_check_interval", str(args.val_every),
        "--trainer.log_every_n_steps", "1", "--trainer.enable_checkpointing", "false",
        "--trainer.enable_progress_bar", "false",
        "--trainer.logger.init_args.save_dir", run_dir, "--trainer.logger.init_args.name", "",
        "--trainer.logger.init_args.version", run_version(name, seed), "--trainer.default_root_dir", run_dir,
        *optimizer_overrides(name, args),
    ]


def read_metrics(path: Path) -> tuple[list[list[float]], list[list[float]]]:
    """``[updates, loss]`` pairs of the training and the validation loss from a CSVLogger file.

    ``updates`` is the number of optimizer steps applied to the weights the loss was
    measured with. CSVLogger's ``step`` column is the 0-based index of the batch: a
    training loss logged at step k comes from the forward before update k + 1 (k
    updates), a validation loss logged at step k runs after that update (k + 1).
    """
    train, val = [], []
    with path.open() as f:
        for row in csv.DictReader(f):
            if row.get("train_loss"):
                train.append([int(row["step"]), float(row["train_loss"])])
            if row.get("val_loss"):
                val.append([int(row["step"]) + 1, float(row["val_loss"])])
    return train, val


def ema(values: list[float], beta: float = 0.9) -> list[float]:
    """Bias-corrected exponential moving average (as TensorBoard's smoothing)."""
    out, avg = [], 0.0
    for i, v in enumerate(values, start=1):
        avg = beta * avg + (1 - beta) * v
        out.append(avg / (1 - beta**i))
    return out


def plot(results: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"adamw": "tab:blue", "muon": "tab:orange"}
    fig, ax = plt.subplots(figsize=(8, 4.8), dpi=120)
    for name, r in results.items():
        steps = [s for s, _ in r["train"]]
        losses = [v for _, v in r["train"]]
        c = colors.get(name)
        ax.plot(steps, losses, color=c, alpha=0.25, linewidth=0.8)
        ax.plot(steps, ema(losses), color=c, linewidth=1.8, label=f"{r['label']}: train (EMA 0.9)")
        if r["val"]:
            vs, vl = zip(*r["val"])
            ax.plot(vs, vl, "o--", color=c, markersize=6, markeredgecolor="black", linewidth=1,
                    label=f"{r['label']}: validation")
    ax.set_xlabel("optimizer steps taken")
    ax.set_ylabel("cross-entropy loss (nats/char)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    all_losses = [v for r in results.values() for _, v in r["train"] + r["val"]]
    late = sorted(all_losses)[: max(1, int(0.9 * len(all_losses)))]  # clip the first steps' spike
    ax.set_ylim(min(all_losses) - 0.1, max(late) + 0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def summarize(results: dict) -> dict:
    """Per variant: the final validation loss and the wall time of each seed, and the mean final validation loss."""
    summary: dict[str, dict] = {}
    for r in results.values():
        s = summary.setdefault(r["name"], {"label": r["label"], "final_val": {}, "wall_s": {}})
        if r["val"]:
            s["final_val"][str(r["seed"])] = r["val"][-1][1]
        s["wall_s"][str(r["seed"])] = r["wall_s"]
    for s in summary.values():
        vals = list(s["final_val"].values())
        s["mean_final_val"] = sum(vals) / len(vals) if vals else None
        s["spread_final_val"] = max(vals) - min(vals) if vals else None
    return summary


def plot_family(results: dict, path: Path, title: str) -> None:
    """Left: smoothed train loss of every run (one colour per variant, one line style per seed) and its
    validation points. Right: the final validation loss of each run, one column per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["name"] for r in results.values()))
    seeds = sorted({r["seed"] for r in results.values()})
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 5), dpi=120, gridspec_kw={"width_ratios": [2.2, 1]})
    for r in results.values():
        c = COLORS.get(r["name"])
        style = SEED_STYLES[seeds.index(r["seed"]) % len(SEED_STYLES)]
        steps = [s for s, _ in r["train"]]
        ax.plot(steps, ema([v for _, v in r["train"]]), style, color=c, linewidth=1.5,
                label=f"{r['label']}, seed {r['seed']}")
        if r["val"]:
            vs, vl = zip(*r["val"])
            ax.plot(vs, vl, "o", color=c, markersize=5, markeredgecolor="black")
    ax.plot([], [], "o", color="white", markeredgecolor="black", label="validation (dots)")
    ax.set_xlabel("optimizer steps taken")
    ax.set_ylabel("cross-entropy loss (nats/char)")
    ax.set_title("train loss (EMA 0.9) and validation loss", fontsize=10)
    ax.grid(alpha=0.3)
    smoothed = [v for r in results.values() for v in ema([x for _, x in r["train"]])]
    smoothed += [v for r in results.values() for _, v in r["val"]]
    late = sorted(smoothed)[: max(1, int(0.85 * len(smoothed)))]  # clip the first steps
    ax.set_ylim(min(smoothed) - 0.05, max(late) + 0.1)
    ax.legend(fontsize=7, ncol=2)

    summary = summarize(results)
    for i, name in enumerate(names):
        s = summary[name]
        c = COLORS.get(name)
        for seed, v in s["final_val"].items():
            k = seeds.index(int(seed))
            x = i + 0.08 * (k - (len(seeds) - 1) / 2)
            bx.plot(x, v, "o", color=c, markersize=7, markeredgecolor="black")
            left = k < len(seeds) / 2  # label the first half of the seeds on the left, the rest on the right
            bx.annotate(f"{v:.3f}", (x, v), xytext=(-6 if left else 6, 0), textcoords="offset points",
                        fontsize=7, va="center", ha="right" if left else "left")
        if s["mean_final_val"] is not None:
            bx.hlines(s["mean_final_val"], i - 0.25, i + 0.25, color=c, linewidth=2)
    bx.set_xticks(range(len(names)), [LABELS.get(n, n).replace(", ", ",\n").replace(" (", "\n(") for n in names],
                  fontsize=7)
    bx.set_xlim(-0.6, len(names) - 0.4)
    last = max((r["val"][-1][0] for r in results.values() if r["val"]), default=0)
    bx.set_ylabel("validation loss")
    bx.set_title(f"final validation loss (step {last}):\ndots = seeds {', '.join(map(str, seeds))}; bar = mean",
                 fontsize=9)
    bx.grid(alpha=0.3, axis="y")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def plot_title(args: argparse.Namespace, names: list[str], family: bool) -> str:
    if args.moe:
        return (f"example MoE GPT (grouped experts), strategy='layerwise', {args.devices} x {args.accelerator}, "
                f"moe_cpu.yaml (expert_parallel_size=2)\nMuon lr=0.02 (adamw_lr=3e-3): each expert's matrix on "
                f"its own vs each rank's stack flattened to one matrix")
    if family:
        lrs = [f"Muon lr={args.muon_lr:g}"] if set(names) - {"adamw", "normuon"} else []
        lrs += [f"NorMuon lr={args.normuon_lr:g}"] if "normuon" in names else []
        lrs += [f"adamw_lr={args.muon_adamw_lr:g} for embeddings, norms, biases"] if set(names) - {"adamw"} else []
        lrs += [f"AdamW lr={args.adamw_lr:g}"] if "adamw" in names else []
        return (f"example GPT (0.8M parameters), strategy='layerwise', {args.devices} x {args.accelerator}, "
                f"global batch 32 x 128 chars\n{', '.join(lrs)}")
    return (f"example GPT, strategy='layerwise', {args.devices} x {args.accelerator}\nAdamW lr={args.adamw_lr:g}"
            f" vs Muon lr={args.muon_lr:g} (adamw_lr={args.muon_adamw_lr:g} for embeddings, norms, biases)")


def parse_names(values: list[str]) -> list[str]:
    """``--optimizers a b`` and ``--optimizers a,b`` both name the runs ``[a, b]``."""
    return [n for v in values for n in v.split(",") if n]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--val-every", type=int, default=50, help="validation interval in steps")
    parser.add_argument("--devices", type=int, default=None,
                        help="processes per run (default: 2, with --moe the 4 of moe_cpu.yaml)")
    parser.add_argument("--accelerator", default="cpu", choices=["cpu", "gpu"])
    parser.add_argument("--adamw-lr", type=float, default=1e-3, help="lr of the AdamW run")
    parser.add_argument("--muon-lr", type=float, default=0.02, help="Muon lr of the hidden matrices")
    parser.add_argument("--muon-adamw-lr", type=float, default=3e-3,
                        help="Muon's adamw_lr: embeddings, tied head, biases, norms (cpu.yaml)")
    parser.add_argument("--normuon-lr", type=float, default=0.01,
                        help="lr of the NorMuon run's hidden matrices (AdamW's scale: update RMS 0.2 * lr)")
    parser.add_argument("--optimizers", nargs="+", default=None,
                        help=f"runs by name, space- or comma-separated: {', '.join(GPT_NAMES)} "
                             f"(default: adamw muon); with --moe: {', '.join(MOE_NAMES)} (default: both)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[1234], help="seed_everything of each run")
    parser.add_argument("--moe", action="store_true",
                        help="the MoE example with grouped experts: stacked vs flattened Newton-Schulz")
    parser.add_argument("--threads", type=int, default=1, help="OMP threads per rank on CPU")
    parser.add_argument("--plot", default=None,
                        help="default: docs/images/loss_curves.png (loss_curves_moe_stack.png with --moe)")
    parser.add_argument("--json", default=None,
                        help="default: benchmarks/results/loss_curves.json (loss_curves_moe_stack.json with --moe)")
    parser.add_argument("--plot-only", action="store_true", help="replot from the existing --json file")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.val_every < 1:
        raise ValueError(f"--steps {args.steps} --val-every {args.val_every}: both must be >= 1.")
    allowed = MOE_NAMES if args.moe else GPT_NAMES
    names = parse_names(args.optimizers) if args.optimizers else list(MOE_NAMES if args.moe else ("adamw", "muon"))
    if not names or not set(names) <= set(allowed):
        raise ValueError(f"--optimizers {' '.join(args.optimizers)!r}: choose from {', '.join(allowed)}"
                         f"{' (with --moe)' if args.moe else ' (stacked, flattened need --moe)'}.")
    if len(set(args.seeds)) != len(args.seeds):
        raise ValueError(f"--seeds {args.seeds}: each seed once.")
    args.optimizers = ",".join(names)
    if args.devices is None:
        args.devices = 4 if args.moe else 2
    stem = "loss_curves_moe_stack" if args.moe else "loss_curves"
    args.plot = args.plot or f"docs/images/{stem}.png"
    args.json = args.json or f"benchmarks/results/{stem}.json"
    # The original two-run picture: AdamW and Muon, one seed. Everything else: the multi-seed layout.
    family = args.moe or len(args.seeds) > 1 or not set(names) <= {"adamw", "muon"}

    title = plot_title(args, names, family)
    json_path, plot_path = ROOT / args.json, ROOT / args.plot
    if args.plot_only:
        saved = json.loads(json_path.read_text())
        if saved.get("layout") == "family":
            plot_family(saved["runs"], plot_path, saved.get("title", title))
        else:
            plot(saved["runs"], plot_path, saved.get("title", title))
        print(f"wrote {plot_path}")
        return

    env = dict(os.environ)
    if args.accelerator == "cpu":
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(args.threads)
    env.pop("MASTER_PORT", None)
    env["PYTHONWARNINGS"] = "ignore"
    results: dict[str, dict] = {}
    run_dir = MOE_RUN_DIR if args.moe else RUN_DIR
    for seed in args.seeds:
        for name in names:
            key = run_version(name, seed) if family else name
            cmd = train_command(name, seed, args)
            metrics = ROOT / run_dir / run_version(name, seed) / "metrics.csv"
            if metrics.exists():
                metrics.unlink()  # CSVLogger appends to an existing version directory
            print(f"{key}: {shlex.join(cmd[1:])}", flush=True)
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
            wall = time.perf_counter() - t0
            if proc.returncode != 0 or not metrics.exists():
                sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-6000:])
                raise RuntimeError(f"{key}: training failed with exit code {proc.returncode}")
            train, val = read_metrics(metrics)
            label = LABELS[name]
            if name == "normuon":
                label = f"NorMuon lr={args.normuon_lr:g}"
            results[key] = {"name": name, "seed": seed, "label": label, "command": shlex.join(["python", *cmd[1:]]),
                            "wall_s": wall, "train": train, "val": val}
            last = val[-1] if val else train[-1]
            print(f"{key}: {wall:.0f} s, final train loss {train[-1][1]:.4f}, "
                  f"last val loss {last[1]:.4f} at step {last[0]}", flush=True)

    json_path.parent.mkdir(parents=True, exist_ok=True)
    record = {"title": title, "args": vars(args), "runs": results}
    if family:
        record = {"title": title, "layout": "family", "args": vars(args), "summary": summarize(results),
                  "runs": results}
    json_path.write_text(json.dumps(record, indent=2))
    (plot_family if family else plot)(results, plot_path, title)
    width = max(10, *(len(r["label"]) + 8 for r in results.values()))
    print(f"\n{'run':{width}} {'final train (EMA)':>17} {'wall s':>7} " + " ".join(
        f"{'val@' + str(s):>9}" for s, _ in next(iter(results.values()))["val"]))
    for r in results.values():
        smoothed = ema([v for _, v in r["train"]])[-1]
        label = f"{r['label']} s{r['seed']}" if family else r["label"]
        print(f"{label:{width}} {smoothed:17.4f} {r['wall_s']:7.0f} " + " ".join(f"{v:9.4f}" for _, v in r["val"]))
    if family:
        print(f"\n{'variant':{width}} " + " ".join(f"{'val s' + str(s):>10}" for s in args.seeds) + "       mean")
        for s in summarize(results).values():
            print(f"{s['label']:{width}} " + " ".join(f"{s['final_val'].get(str(x), float('nan')):10.4f}"
                                                       for x in args.seeds) + f" {s['mean_final_val']:10.4f}")
    print(f"wrote {plot_path} and {json_path}")


if __name__ == "__main__":
    main()
