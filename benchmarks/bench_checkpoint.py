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
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import harness  # noqa: E402

RESULT = harness.RESULTS / "checkpoint_cpu.json"
MiB = 2 ** 20


def measured_strategy(measured: dict) -> type:
    """``LayerwiseStrategy`` whose saves and restores put their RSS rise and wall time into ``measured``."""
    import lightning_layerwise as llw

    class Measured(llw.LayerwiseStrategy):
        def save_checkpoint(self, checkpoint, filepath, storage_options=None):
            with harness.PeakRSS() as m:
                super().save_checkpoint(checkpoint, filepath, storage_options)
            measured["save"] = {"peak_rss_delta": m.rise, "seconds": m.seconds}

        def load_checkpoint(self, checkpoint_path, weights_only=None):
            # The restore is measured from here to the end of load_optimizer_state_dict: reading,
            # the model's weights and the optimizer's (owned) state, in either format.
            measured["restore"] = harness.PeakRSS().start()
            return super().load_checkpoint(checkpoint_path, weights_only)

        def load_optimizer_state_dict(self, checkpoint):
            super().load_optimizer_state_dict(checkpoint)
            m = measured.pop("restore").stop()
            measured["load"] = {"peak_rss_delta": m.rise, "seconds": m.seconds}

    return Measured


def module_class(args: argparse.Namespace) -> type:
    """The example GPT (``examples/gpt.py``) as a LightningModule, trained with ``args.optimizer``."""
    import lightning as L
    import torch

    import lightning_layerwise as llw
    from examples.gpt import GPT, GPTConfig

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

    return Module


def save_at_step(step: int, path: str):
    """A callback that saves a checkpoint at ``path`` at the end of step ``step``, inside fit (where the ownership
    is known)."""
    import lightning as L

    class SaveInFit(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == step:
                trainer.save_checkpoint(path)

    return SaveInFit()


def rank_share(optimizer, model) -> dict:
    """The rank's share: owned parameters and their optimizer state (the strategy kept the ownership of the run
    in the optimizer state: only owned parameters have any); the totals over ranks."""
    import torch
    import torch.distributed as dist

    state_bytes = sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
                      if torch.is_tensor(v))
    total_state = torch.tensor([state_bytes], dtype=torch.float64)
    dist.all_reduce(total_state)
    return {"state_bytes": state_bytes, "owned_param_bytes": sum(p.numel() * p.element_size() for p in optimizer.state),
            "total_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "total_state": total_state.item()}


def checkpoint_bytes(path: str) -> int:
    if os.path.isdir(path):
        return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())
    return os.path.getsize(path)


def worker(args: argparse.Namespace) -> None:
    """One format at one world size, on every rank: train, save inside a fit, resume from it; rank 0 writes."""
    import lightning as L
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    measured: dict = {}
    strategy, module = measured_strategy(measured), module_class(args)
    data = torch.randint(0, args.vocab, (64, args.seq + 1), generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(data, batch_size=2)

    def fit(max_steps: int, callback=None, ckpt_path=None):
        model = module()
        trainer = L.Trainer(accelerator="cpu", devices=args.world, max_steps=max_steps, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            strategy=strategy(checkpoint_format=args.format))
        if callback is not None:
            trainer.callbacks.append(callback)
        trainer.fit(model, loader, ckpt_path=ckpt_path)
        return trainer, model

    trainer, model = fit(2)
    share = rank_share(trainer.optimizers[0], model)
    fit(3, callback=save_at_step(3, args.path))
    save = dict(measured["save"])
    measured.clear()
    size = checkpoint_bytes(args.path)
    fit(4, ckpt_path=args.path)
    load = dict(measured["load"])

    keys = ["save_peak_rss_delta", "save_seconds", "load_peak_rss_delta", "load_seconds", "owned_state_bytes",
            "owned_param_bytes"]
    row = torch.tensor([save["peak_rss_delta"], save["seconds"], load["peak_rss_delta"], load["seconds"],
                        share["state_bytes"], share["owned_param_bytes"]], dtype=torch.float64)
    rows = [torch.zeros_like(row) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, row)
    if dist.get_rank() == 0:
        harness.write_json(args.out, {"format": args.format, "world": args.world, "optimizer": args.optimizer,
                                      "param_bytes": share["total_bytes"], "state_bytes": share["total_state"],
                                      "checkpoint_bytes": size, "ranks": [dict(zip(keys, r.tolist())) for r in rows]})
    dist.barrier()
    dist.destroy_process_group()  # an orderly exit; gloo threads left running can abort the interpreter


def worker_command(args: argparse.Namespace, fmt: str, world: int, result: str) -> list[str]:
    """This script as one run's worker; its checkpoint goes next to its result."""
    checkpoint = Path(result).with_name(f"{fmt}_{world}.ckpt")
    return [sys.executable, str(Path(__file__).resolve()), "--_worker", "--format", fmt, "--world", str(world),
            "--path", str(checkpoint), "--out", result, "--optimizer", args.optimizer,
            "--n-layer", str(args.n_layer), "--n-embd", str(args.n_embd), "--n-head", str(args.n_head),
            "--vocab", str(args.vocab), "--seq", str(args.seq)]


def run(args: argparse.Namespace) -> None:
    results = []
    for world in args.worlds:
        for fmt in ("sharded", "full"):
            done = harness.run_script(lambda result: worker_command(args, fmt, world, result),
                                      label=f"{fmt} at {world} ranks", threads=1, require_exit_zero=True)
            results.append(done.result)
            print(f"# {fmt} at {world} ranks: {done.wall_s:.0f} s", file=sys.stderr)
    print(f"\nmodel: GPT n_layer={args.n_layer} n_embd={args.n_embd} vocab={args.vocab}, {args.optimizer}; "
          f"parameters {results[0]['param_bytes'] / MiB:.0f} MiB, optimizer state "
          f"{results[0]['state_bytes'] / MiB:.0f} MiB (all ranks)\n")
    header = ["format", "ranks", "rank", "share (MiB)", "save: peak RSS rise (MiB)", "save (s)",
              "load: peak RSS rise (MiB)", "load (s)", "on disk (MiB)"]
    print(harness.markdown_table(header, [
        [r["format"], r["world"], rank, f"{(x['owned_state_bytes'] + x['owned_param_bytes']) / MiB:.0f}",
         f"{x['save_peak_rss_delta'] / MiB:.0f}", f"{x['save_seconds']:.2f}", f"{x['load_peak_rss_delta'] / MiB:.0f}",
         f"{x['load_seconds']:.2f}", f"{r['checkpoint_bytes'] / MiB:.0f}"]
        for r in results for rank, x in enumerate(r["ranks"])]))
    result = harness.write_json(args.result or RESULT, {
        "machine": {**harness.machine(threads=1), "cpus": os.cpu_count()},
        "args": {k: v for k, v in vars(args).items() if not k.startswith("_")}, "results": results})
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
