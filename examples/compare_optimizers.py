"""Loss curves of the example GPT trained with AdamW and with Muon, both under ``strategy="layerwise"``.

Run from the repository root (default: 2 CPU processes, 300 steps per optimizer, 4 to 5
minutes on 2 CPU cores)::

    .venv/bin/python examples/compare_optimizers.py
    .venv/bin/python examples/compare_optimizers.py --steps 500 --val-every 100
    python examples/compare_optimizers.py --accelerator gpu --devices 8 --steps 2000

Both runs are ``examples/train.py fit --config examples/configs/cpu.yaml`` (same seed,
data order, initial weights, batch 16 per rank, gradient clipping 1.0, bucket size
200,000) with only the optimizer and the run length overridden on the command line:

    adamw  --model.optimizer torch.optim.AdamW  lr=1e-3, betas=(0.9, 0.95), weight_decay=0
           (a sweep over {5e-4, 1e-3, 2e-3, 3e-3, 1e-2}, 150 steps: 1e-3 and 2e-3 tie on
           validation loss, 2e-3 spikes early, 3e-3 and 1e-2 end higher; docs/benchmarks.md)
    muon   --model.optimizer lightning_layerwise.Muon  lr=0.02 (hidden matrices), momentum=0.95,
           adamw_lr=3e-3 for the embeddings/tied head, biases and LayerNorm gains (cpu.yaml)

An AdamW learning-rate sweep point: ``--optimizers adamw --adamw-lr 2e-3 --steps 150
--json /tmp/lr.json --plot /tmp/lr.png``.

The training loss is logged every step (the global batch's loss, ``sync_dist=True``),
the validation loss every ``--val-every`` steps on 8 batches per rank of the fixed
held-out windows. Each run's ``CSVLogger`` metrics are read back from
``runs/compare/<optimizer>/metrics.csv``.

Writes ``docs/images/loss_curves.png`` (train loss, raw and smoothed, and validation
points against the step) and ``benchmarks/results/loss_curves.json`` (every number
in the plot, the exact commands and the wall time of each run).
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


def optimizer_overrides(name: str, args: argparse.Namespace) -> list[str]:
    if name == "adamw":
        return ["--model.optimizer", "torch.optim.AdamW", "--model.optimizer.lr", str(args.adamw_lr),
                "--model.optimizer.betas", "[0.9, 0.95]", "--model.optimizer.weight_decay", "0.0"]
    return ["--model.optimizer", "lightning_layerwise.Muon", "--model.optimizer.lr", str(args.muon_lr),
            "--model.optimizer.momentum", "0.95", "--model.optimizer.adamw_lr", str(args.muon_adamw_lr),
            "--model.optimizer.weight_decay", "0.0", "--model.optimizer.adamw_weight_decay", "0.0"]


def train_command(name: str, args: argparse.Namespace) -> list[str]:
    return [
        sys.executable, "examples/train.py", "fit", "--config", "examples/configs/cpu.yaml",
        "--trainer.accelerator", args.accelerator, "--trainer.devices", str(args.devices),
        "--trainer.max_steps", str(args.steps), "--trainer.val_check_interval", str(args.val_every),
        "--trainer.log_every_n_steps", "1", "--trainer.enable_checkpointing", "false",
        "--trainer.enable_progress_bar", "false",
        "--trainer.logger.init_args.save_dir", RUN_DIR, "--trainer.logger.init_args.name", "",
        "--trainer.logger.init_args.version", name, "--trainer.default_root_dir", RUN_DIR,
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--val-every", type=int, default=50, help="validation interval in steps")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--accelerator", default="cpu", choices=["cpu", "gpu"])
    parser.add_argument("--adamw-lr", type=float, default=1e-3, help="lr of the AdamW run")
    parser.add_argument("--muon-lr", type=float, default=0.02, help="Muon lr of the hidden matrices")
    parser.add_argument("--muon-adamw-lr", type=float, default=3e-3,
                        help="Muon's adamw_lr: embeddings, tied head, biases, norms (cpu.yaml)")
    parser.add_argument("--optimizers", default="adamw,muon")
    parser.add_argument("--threads", type=int, default=1, help="OMP threads per rank on CPU")
    parser.add_argument("--plot", default="docs/images/loss_curves.png")
    parser.add_argument("--json", default="benchmarks/results/loss_curves.json")
    parser.add_argument("--plot-only", action="store_true", help="replot from the existing --json file")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.val_every < 1:
        raise ValueError(f"--steps {args.steps} --val-every {args.val_every}: both must be >= 1.")
    names = [n for n in args.optimizers.split(",") if n]
    if not set(names) <= {"adamw", "muon"}:
        raise ValueError(f"--optimizers {args.optimizers!r}: choose from 'adamw,muon'.")

    title = (f"example GPT, strategy='layerwise', {args.devices} x {args.accelerator}\nAdamW lr={args.adamw_lr:g}"
             f" vs Muon lr={args.muon_lr:g} (adamw_lr={args.muon_adamw_lr:g} for embeddings, norms, biases)")
    json_path, plot_path = ROOT / args.json, ROOT / args.plot
    if args.plot_only:
        saved = json.loads(json_path.read_text())
        plot(saved["runs"], plot_path, saved.get("title", title))
        print(f"wrote {plot_path}")
        return

    env = dict(os.environ)
    if args.accelerator == "cpu":
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(args.threads)
    env.pop("MASTER_PORT", None)
    env["PYTHONWARNINGS"] = "ignore"
    results: dict[str, dict] = {}
    for name in names:
        cmd = train_command(name, args)
        metrics = ROOT / RUN_DIR / name / "metrics.csv"
        if metrics.exists():
            metrics.unlink()  # CSVLogger appends to an existing version directory
        print(f"{name}: {shlex.join(cmd[1:])}", flush=True)
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if proc.returncode != 0 or not metrics.exists():
            sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-6000:])
            raise RuntimeError(f"{name}: training failed with exit code {proc.returncode}")
        train, val = read_metrics(metrics)
        label = "AdamW" if name == "adamw" else "Muon"
        results[name] = {"label": label, "command": shlex.join(["python", *cmd[1:]]), "wall_s": wall,
                         "train": train, "val": val}
        last = val[-1] if val else train[-1]
        print(f"{name}: {wall:.0f} s, final train loss {train[-1][1]:.4f}, "
              f"last val loss {last[1]:.4f} at step {last[0]}", flush=True)

    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps({"title": title, "args": vars(args), "runs": results}, indent=2))
    plot(results, plot_path, title)
    print(f"\n{'optimizer':10} {'final train (EMA)':>17} " + " ".join(f"{'val@' + str(s):>9}" for s, _ in
                                                                      next(iter(results.values()))["val"]))
    for name, r in results.items():
        smoothed = ema([v for _, v in r["train"]])[-1]
        print(f"{r['label']:10} {smoothed:17.4f} " + " ".join(f"{v:9.4f}" for _, v in r["val"]))
    print(f"wrote {plot_path} and {json_path}")


if __name__ == "__main__":
    main()
