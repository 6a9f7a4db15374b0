"""Checkpoint cost per rank: ``sharded`` vs ``full``: peak memory, time and bytes of a save and a load.

Run from the repository root (about 2 minutes on 2 CPU cores)::

    .venv/bin/python benchmarks/bench_checkpoint.py
    .venv/bin/python benchmarks/bench_checkpoint.py --worlds 2 4 --n-layer 8 --n-embd 512 --optimizer adamw
    # a model at checkpoint_format="auto"'s limit (512 MiB of parameters), about 5 minutes
    .venv/bin/python benchmarks/bench_checkpoint.py --worlds 2 --n-layer 12 --n-embd 960 --n-head 12 \
        --result benchmarks/results/checkpoint_cpu_at_limit.json

For each world size and format, fresh processes (gloo, one thread each) train
the example GPT (``examples/gpt.py``, random tokens) for 2 steps under
``LayerwiseStrategy(checkpoint_format=...)``, then ``trainer.save_checkpoint``
writes a checkpoint, and a new Trainer resumes from it at the same world size.
Around each save and each restore (reading the checkpoint, loading the model's
weights and the optimizer's state) a thread samples the rank's resident set
size (RSS, ``/proc/self/statm``) every millisecond; the report gives, per rank,
the peak RSS during the operation minus the RSS just before it (what the
operation itself costs, including the optimizer state it allocates), the wall
time, and the rank's *share*: the bytes of the
parameters it owns plus their optimizer state, i.e. what the sharded format
writes from that rank. A full checkpoint instead gathers every rank's state on
rank 0 (tensor by tensor, point-to-point; only their names and shapes are pickled) before one file
is written.

Writes ``benchmarks/results/checkpoint_cpu.json`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "benchmarks" / "results" / "checkpoint_cpu.json"
PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class PeakRSS:
    """Samples RSS every millisecond while open; ``delta`` is the peak minus the RSS at entry."""

    def __enter__(self):
        self.start = rss_bytes()
        self.peak = self.start
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        self.t0 = time.perf_counter()
        return self

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            time.sleep(0.001)

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.t0
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())
        self.delta = self.peak - self.start


def worker(args) -> None:
    sys.path.insert(0, str(ROOT))
    import lightning as L
    import torch
    import torch.distributed as dist

    import lightning_layerwise as llw
    from examples.gpt import GPT, GPTConfig

    torch.set_num_threads(1)
    measured: dict = {}

    class Measured(llw.LayerwiseStrategy):
        def save_checkpoint(self, checkpoint, filepath, storage_options=None):
            with PeakRSS() as m:
                super().save_checkpoint(checkpoint, filepath, storage_options)
            measured["save"] = {"peak_rss_delta": m.delta, "seconds": m.seconds}

        def load_checkpoint(self, checkpoint_path, weights_only=None):
            # The restore is measured from here to the end of load_optimizer_state_dict: reading,
            # the model's weights and the optimizer's (owned) state, in either format.
            measured["restore"] = PeakRSS().__enter__()
            return super().load_checkpoint(checkpoint_path, weights_only)

        def load_optimizer_state_dict(self, checkpoint):
            super().load_optimizer_state_dict(checkpoint)
            m = measured.pop("restore")
            m.__exit__(None, None, None)
            measured["load"] = {"peak_rss_delta": m.delta, "seconds": m.seconds}

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.gpt = GPT(GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.n_layer,
                                     n_head=args.n_head, n_embd=args.n_embd))

        def training_step(self, batch, batch_idx):
            _, loss = self.gpt(batch[:, :-1], batch[:, 1:])
            return loss

        def configure_optimizers(self):
            if args.optimizer == "adamw":
                return torch.optim.AdamW(self.parameters(), lr=1e-4)
            return llw.Muon(llw.muon_param_groups(self), lr=0.02, adamw_lr=3e-4)

    data = torch.randint(0, args.vocab, (64, args.seq + 1), generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(data, batch_size=2)

    def trainer(max_steps):
        return L.Trainer(accelerator="cpu", devices=args.world, max_steps=max_steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         strategy=Measured(checkpoint_format=args.format))

    model = Module()
    t = trainer(2)
    t.fit(model, loader)
    opt = t.optimizers[0]
    # The rank's share: owned parameters and their optimizer state (the strategy kept the
    # ownership of the run in the optimizer state: only owned parameters have any).
    state_bytes = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
                      if torch.is_tensor(v))
    owned_param_bytes = sum(p.numel() * p.element_size() for p in opt.state)
    total_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    total_state = torch.tensor([state_bytes], dtype=torch.float64)
    dist.all_reduce(total_state)

    # save_checkpoint inside fit, where ownership is known: a callback at the last step.
    class SaveInFit(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 3:
                trainer.save_checkpoint(args.path)

    model = Module()
    t = trainer(3)
    t.callbacks.append(SaveInFit())
    t.fit(model, loader)
    save = dict(measured["save"])
    measured.clear()
    size = sum(f.stat().st_size for f in Path(args.path).rglob("*") if f.is_file()) if os.path.isdir(args.path) \
        else os.path.getsize(args.path)

    model = Module()
    t = trainer(4)
    t.fit(model, loader, ckpt_path=args.path)
    load = dict(measured["load"])

    row = torch.tensor([save["peak_rss_delta"], save["seconds"], load["peak_rss_delta"], load["seconds"],
                        state_bytes, owned_param_bytes], dtype=torch.float64)
    rows = [torch.zeros_like(row) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, row)
    if dist.get_rank() == 0:
        keys = ["save_peak_rss_delta", "save_seconds", "load_peak_rss_delta", "load_seconds",
                "owned_state_bytes", "owned_param_bytes"]
        out = {"format": args.format, "world": args.world, "optimizer": args.optimizer,
               "param_bytes": total_bytes, "state_bytes": total_state.item(), "checkpoint_bytes": size,
               "ranks": [dict(zip(keys, r.tolist())) for r in rows]}
        Path(args.out).write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()  # an orderly exit; gloo threads left running can abort the interpreter


def run(args) -> None:
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for world in args.worlds:
            for fmt in ("sharded", "full"):
                path = os.path.join(tmp, f"{fmt}_{world}.ckpt")
                out = os.path.join(tmp, f"{fmt}_{world}.json")
                cmd = [sys.executable, __file__, "--_worker", "--format", fmt, "--world", str(world),
                       "--path", path, "--out", out, "--optimizer", args.optimizer, "--n-layer", str(args.n_layer),
                       "--n-embd", str(args.n_embd), "--n-head", str(args.n_head), "--vocab", str(args.vocab),
                       "--seq", str(args.seq)]
                env = dict(os.environ, OMP_NUM_THREADS="1")
                t0 = time.time()
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
                if proc.returncode != 0:
                    sys.exit(f"{fmt} at {world} ranks failed:\n{proc.stderr[-4000:]}")
                results.append(json.loads(Path(out).read_text()))
                print(f"# {fmt} at {world} ranks: {time.time() - t0:.0f} s", file=sys.stderr)
                if os.path.isdir(path):
                    shutil.rmtree(path)
                elif os.path.exists(path):
                    os.remove(path)
    mib = 2 ** 20
    print(f"\nmodel: GPT n_layer={args.n_layer} n_embd={args.n_embd} vocab={args.vocab}, {args.optimizer}; "
          f"parameters {results[0]['param_bytes'] / mib:.0f} MiB, optimizer state "
          f"{results[0]['state_bytes'] / mib:.0f} MiB (all ranks)\n")
    print("| format | ranks | rank | share (MiB) | save: peak RSS rise (MiB) | save (s) | load: peak RSS rise (MiB) "
          "| load (s) | on disk (MiB) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        for rank, x in enumerate(r["ranks"]):
            share = (x["owned_state_bytes"] + x["owned_param_bytes"]) / mib
            print(f"| {r['format']} | {r['world']} | {rank} | {share:.0f} | {x['save_peak_rss_delta'] / mib:.0f} | "
                  f"{x['save_seconds']:.2f} | {x['load_peak_rss_delta'] / mib:.0f} | {x['load_seconds']:.2f} | "
                  f"{r['checkpoint_bytes'] / mib:.0f} |")
    result = Path(args.result) if args.result else RESULT
    result.parent.mkdir(parents=True, exist_ok=True)
    result.write_text(json.dumps({"machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                                              "load_average": os.getloadavg()},
                                  "args": {k: v for k, v in vars(args).items() if not k.startswith("_")},
                                  "results": results}, indent=1))
    print(f"\nwrote {result}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--optimizer", choices=["adamw", "muon"], default="adamw")
    parser.add_argument("--n-layer", type=int, default=8)
    parser.add_argument("--n-embd", type=int, default=512)
    parser.add_argument("--n-head", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--result", help=f"the JSON to write (default {RESULT.relative_to(ROOT)})")
    parser.add_argument("--_worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--format", default="sharded", help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    worker(args) if args._worker else run(args)


if __name__ == "__main__":
    main()
