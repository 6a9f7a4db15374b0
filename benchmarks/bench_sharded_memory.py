"""Peak memory per rank of sharded parameters against their peers, at default settings.

    MALLOC_MMAP_THRESHOLD_=65536 .venv/bin/python benchmarks/bench_sharded_memory.py
    .venv/bin/python benchmarks/bench_sharded_memory.py --models mlp_deep --devices 2 --configs layerwise_sharded,fsdp2
    .venv/bin/python benchmarks/bench_sharded_memory.py --from-json benchmarks/results/sharded_memory_cpu.json

Each run is one ``Trainer.fit`` of 4 AdamW steps (``lr=1e-3``) on gloo CPU ranks, one thread each,
every strategy at its default settings:

    ddp                 Trainer(strategy="ddp")
    layerwise           Trainer(strategy="layerwise")
    layerwise_sharded   Trainer(strategy=LayerwiseStrategy(shard_parameters=True))
    fsdp2               ModelParallelStrategy, ``fully_shard`` on each block and on the root
                        (``reshard_after_forward=True``, FSDP2's default)

Models (fp32): ``mlp_wide`` is 2 blocks of Linear 2048->8192->2048 (67.1 M parameters), ``mlp_deep`` 8 blocks
of Linear 1024->4096->1024 (67.1 M), ``gpt`` the example GPT with 10 layers at width 512 (31.6 M, batch
2 x 64 tokens per rank), and ``gpt_meta`` the same GPT built under ``trainer.init_module(empty_init=True)``
(materialized by the strategy; FSDP2 runs its own meta-device recipe: ``to_empty`` after ``fully_shard``
and the model's init).

Measured per rank: the resident set's peak (``VmHWM``, reset after the imports) minus the resident set at
that moment, over the training (up to ``on_train_end``) and over the whole ``fit`` (the strategy's teardown
included), and the resident set when ``fit`` returns (what it leaves behind). The tables give the largest
rank's. glibc keeps freed blocks in its heap unless told not to, so run with ``MALLOC_MMAP_THRESHOLD_=65536``
(large blocks are then returned when freed, as a GPU's caching allocator returns them after ``empty_cache``);
the script sets it for its workers when unset.

Writes ``--out`` (JSON, every run) and a markdown table in ``--docs-dir``.
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
MODELS = ("mlp_wide", "mlp_deep", "gpt", "gpt_meta")
CONFIGS = ("ddp", "layerwise", "layerwise_sharded", "fsdp2")
STEPS = 4


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--devices", default="2,4", help="comma-separated world sizes")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--out", default=str(HERE / "results" / "sharded_memory_cpu.json"))
    p.add_argument("--docs-dir", default=str(ROOT / "docs" / "benchmarks"))
    p.add_argument("--from-json", default=None, help="only rebuild the table from this JSON")
    p.add_argument("--_worker", nargs=4, metavar=("CONFIG", "MODEL", "DEVICES", "OUT"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


# --- the worker: one fit on this rank --------------------------------------------------------------------------

def _status(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"{key} not in /proc/self/status")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident set


def build_model(name: str):
    import torch
    from torch import nn

    if name.startswith("mlp"):
        width, hidden, blocks = (2048, 8192, 2) if name == "mlp_wide" else (1024, 4096, 8)
        model = nn.Sequential(*(nn.Sequential(nn.Linear(width, hidden), nn.ReLU(), nn.Linear(hidden, width))
                                for _ in range(blocks)))
        model.blocks, model.width = list(model), width
        return model
    sys.path.insert(0, str(ROOT / "examples"))
    from gpt import GPT, GPTConfig

    model = GPT(GPTConfig(vocab_size=96, block_size=64, n_layer=10, n_head=8, n_embd=512))
    model.blocks = list(model.transformer.h)
    return model


def run_worker(config: str, model_name: str, devices: int, out: str) -> None:
    import lightning as L
    import torch
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    import lightning_layerwise as llw

    torch.set_num_threads(1)
    _reset_peak()
    base = _status("VmRSS")
    meta = model_name == "gpt_meta"
    record: dict = {}

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = None if config == "fsdp2" and meta else build_model(model_name)

        def configure_model(self) -> None:
            if config != "fsdp2":
                return
            from torch.distributed.fsdp import fully_shard

            if self.net is None:
                with torch.device("meta"):
                    self.net = build_model(model_name)
            mesh = self.device_mesh["data_parallel"]
            for block in self.net.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(self.net, mesh=mesh)
            if meta:  # FSDP2's recipe: memory for the shards, then the model's own init
                self.net.to_empty(device="cpu")
                self.net.apply(self.net._init_weights)

        def training_step(self, batch, batch_idx):
            if model_name.startswith("mlp"):
                return self.net(batch).square().mean()
            return self.net(batch[:, :-1], batch[:, 1:])[1]

        def on_train_end(self) -> None:
            record["train_peak"] = _status("VmHWM")

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    g = torch.Generator().manual_seed(1234)
    if model_name.startswith("mlp"):
        width = 2048 if model_name == "mlp_wide" else 1024
        data = [torch.randn(8, width, generator=g) for _ in range(STEPS)]
    else:
        data = [torch.randint(0, 96, (2, 65), generator=g) for _ in range(STEPS)]
    strategy = {"ddp": lambda: DDPStrategy(),
                "layerwise": lambda: llw.LayerwiseStrategy(),
                "layerwise_sharded": lambda: llw.LayerwiseStrategy(shard_parameters=True),
                "fsdp2": lambda: ModelParallelStrategy(data_parallel_size=devices, tensor_parallel_size=1)}[config]()
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=STEPS, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False)
    if meta and config != "fsdp2":
        with trainer.init_module(empty_init=True):
            module = Module()
    else:
        module = Module()
    params = sum(p.numel() for p in (module.net.parameters() if module.net is not None else []))
    start = time.perf_counter()
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=None))
    rank = trainer.global_rank
    result = {"rank": rank, "base_mib": base, "train_peak_mib": record["train_peak"] - base,
              "fit_peak_mib": _status("VmHWM") - base, "after_fit_mib": _status("VmRSS") - base, "params": params,
              "wall_s": time.perf_counter() - start}
    with open(f"{out}.rank{rank}", "w") as f:
        json.dump(result, f)


# --- the driver ------------------------------------------------------------------------------------------------

def run_one(config: str, model: str, devices: int, timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result")
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
        env.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
        cmd = [sys.executable, str(Path(__file__).resolve()), "--_worker", config, model, str(devices), out]
        proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout)
        ranks = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(devices)
                 if Path(f"{out}.rank{r}").exists()]
        if proc.returncode != 0 or len(ranks) != devices:
            raise RuntimeError(f"{config} {model} at {devices} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return {"config": config, "model": model, "devices": devices, "ranks": ranks,
            "train_peak_mib": max(r["train_peak_mib"] for r in ranks),
            "fit_peak_mib": max(r["fit_peak_mib"] for r in ranks),
            "after_fit_mib": max(r["after_fit_mib"] for r in ranks), "params": ranks[0]["params"]}


def table(runs: list[dict]) -> str:
    configs = [c for c in CONFIGS if any(r["config"] == c for r in runs)]
    rows = sorted({(r["model"], r["devices"]) for r in runs}, key=lambda k: (MODELS.index(k[0]), k[1]))
    cell = {(r["model"], r["devices"], r["config"]): r for r in runs}
    lines = ["| model | ranks | " + " | ".join(f"`{c}`" for c in configs)
             + " | sharded / FSDP2 | sharded / `layerwise` |",
             "|---|---|" + "---|" * (len(configs) + 2)]
    for model, devices in rows:
        vals = [cell.get((model, devices, c)) for c in configs]
        text = [f"{v['train_peak_mib']:.0f} ({v['fit_peak_mib']:.0f})" if v else "–" for v in vals]
        get = {c: cell.get((model, devices, c)) for c in configs}
        ratios = []
        for peer in ("fsdp2", "layerwise"):
            s, p = get.get("layerwise_sharded"), get.get(peer)
            ratios.append(f"{s['train_peak_mib'] / p['train_peak_mib']:.2f}" if s and p else "–")
        lines.append(f"| {model} | {devices} | " + " | ".join(text) + " | " + " | ".join(ratios) + " |")
    return "\n".join(lines)


def left_table(runs: list[dict]) -> str:
    """What ``fit`` leaves behind: the resident set when it returns, minus the base (MiB, the largest rank's)."""
    configs = [c for c in CONFIGS if any(r["config"] == c and "after_fit_mib" in r for r in runs)]
    rows = sorted({(r["model"], r["devices"]) for r in runs}, key=lambda k: (MODELS.index(k[0]), k[1]))
    cell = {(r["model"], r["devices"], r["config"]): r for r in runs}
    lines = ["| model | ranks | " + " | ".join(f"`{c}`" for c in configs) + " |", "|---|---|" + "---|" * len(configs)]
    for model, devices in rows:
        vals = [cell.get((model, devices, c)) for c in configs]
        lines.append(f"| {model} | {devices} | "
                     + " | ".join(f"{v['after_fit_mib']:.0f}" if v and "after_fit_mib" in v else "–" for v in vals)
                     + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args._worker:
        config, model, devices, out = args._worker
        run_worker(config, model, int(devices), out)
        return
    if args.from_json:
        runs = json.loads(Path(args.from_json).read_text())["runs"]
    else:
        runs = []
        for devices in [int(d) for d in args.devices.split(",")]:
            for model in args.models.split(","):
                for config in args.configs.split(","):
                    run = run_one(config, model, devices, args.timeout)
                    runs.append(run)
                    print(f"{model:9s} {devices} {config:18s} train {run['train_peak_mib']:7.0f} MiB  "
                          f"fit {run['fit_peak_mib']:7.0f} MiB  after {run['after_fit_mib']:7.0f} MiB", flush=True)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"runs": runs, "steps": STEPS}, indent=1))
    text = table(runs)
    left = left_table(runs)
    print(text + "\n\n" + left)
    docs = Path(args.docs_dir) / "sharded_memory_cpu.md"
    docs.parent.mkdir(parents=True, exist_ok=True)
    docs.write_text("# Peak memory per rank at default settings\n\n"
                    "Generated by `MALLOC_MMAP_THRESHOLD_=65536 python benchmarks/bench_sharded_memory.py`: peak RSS "
                    "per rank minus the rank's resident set after its imports, MiB, the largest rank's, over the "
                    "training and (in parentheses) over the whole `fit`, the strategy's teardown included. "
                    "4 AdamW steps, fp32, gloo CPU ranks, one thread each.\n\n" + text + "\n\n"
                    "## What `fit` leaves behind\n\nThe resident set per rank when `fit` returns, minus the same base "
                    "(MiB, the largest rank's). `ddp` and `layerwise` leave the whole model and the optimizer state; "
                    "sharded runs (ours and FSDP2) leave their shards and the optimizer state.\n\n" + left + "\n")


if __name__ == "__main__":
    main()
