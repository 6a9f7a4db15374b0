"""A short fit with strategy="layerwise*", started by each launch mode under test.

    python tests/launch_script.py OUTDIR --strategy layerwise --devices 2 [--num_nodes N]

Every rank writes OUTDIR/rank<global_rank>.json with what it saw when the fit ends.

Fault injection (tests/lightning/test_faults.py): ``--die_in PHASE --die_at_step N`` makes global
rank ``--die_rank`` (default 1) die hard (``os._exit(1)``, or ``--die_how sigkill``) in
that phase of step N, after writing OUTDIR/died<rank>.json. Phases:

* ``batch_start``: in ``on_train_batch_start`` (exit code 3; the default with ``--die_at_step``
  alone, used by tests/lightning/test_launch.py);
* ``forward``: inside the model's forward (a forward pre-hook of the second layer);
* ``backward``: inside a backward hook (the first layer's weight gradient, the last one
  autograd computes, after later buckets' reduce-scatters were dispatched);
* ``optimizer_step``: inside ``optimizer.step``, after the closure (forward, backward and
  the gradient reduce-scatter) returned and before any parameter is updated;
* ``all_gather``: right after the first parameter all-gather of step N's
  ``start_param_sync`` was dispatched (asynchronously), i.e. with it in flight;
* ``save_sharded``: during the save of the checkpoint at global step N, after this rank's
  ``torch.distributed.checkpoint`` data file was written and before the index and
  ``meta.pt`` (use with ``--checkpoint_format sharded``);
* ``save_full``: during the save at global step N, after this rank sent rank 0 its first
  optimizer-state tensor of ``checkpoint.gather_named_state`` (``--checkpoint_format full``).

Other flags: ``--max_steps``, ``--samples`` (dataset size; 16 with batch 4 on 2 ranks is
an epoch of 2 steps), ``--bucket_size``, ``--timeout_s`` (collective timeout),
``--checkpoint_format``, ``--ckpt_every N`` (``ModelCheckpoint`` every N steps into
``--ckpt_dir``, default OUTDIR/checkpoints, named ``step=N.ckpt``), ``--ckpt_path`` (resume),
``--no-sync_log`` (log the loss without a collective). Every rank writes
OUTDIR/started<rank>.json (pid) at setup, and dumps all threads' stacks to stderr on SIGUSR1.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import sys
import time
from datetime import timedelta

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import lightning_layerwise as llw  # noqa: E402
from lightning_layerwise.checkpoint import named_state as llw_named_state  # noqa: E402
from lightning_layerwise.engine import collectives as llw_collectives  # noqa: E402

PHASES = ("batch_start", "forward", "backward", "optimizer_step", "all_gather", "save_sharded", "save_full")
_START_METHODS = {"layerwise": "popen", "layerwise_spawn": "spawn", "layerwise_fork": "fork",
                  "layerwise_notebook": "fork"}


class Tiny(L.LightningModule):
    def __init__(self, sync_log: bool = True):
        super().__init__()
        torch.manual_seed(0)
        self.sync_log = sync_log
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss, sync_dist=self.sync_log)
        return loss

    def configure_optimizers(self):
        return llw.Muon(llw.muon_param_groups(self), lr=0.02, adamw_lr=1e-2, ns_dtype=torch.float32)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("outdir")
    parser.add_argument("--strategy", default="layerwise")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--num_nodes", type=int, default=1)
    parser.add_argument("--max_steps", type=int, default=4)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--die_at_step", type=int, default=None, help="the dying rank exits hard at this step")
    parser.add_argument("--die_in", choices=PHASES, default="batch_start")
    parser.add_argument("--die_rank", type=int, default=1)
    parser.add_argument("--die_how", choices=("exit", "sigkill", "stop"), default="exit",
                        help="stop: SIGSTOP itself, a hung rank whose connections stay open (the caller kills it)")
    parser.add_argument("--bucket_size", type=int, default=None)
    parser.add_argument("--timeout_s", type=float, default=None)
    parser.add_argument("--checkpoint_format", choices=("sharded", "full"), default=None)
    parser.add_argument("--ckpt_every", type=int, default=None)
    parser.add_argument("--ckpt_dir", default=None)
    parser.add_argument("--ckpt_path", default=None)
    parser.add_argument("--sync_log", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a test that sees a hang asks where it blocks
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.samples, 6, generator=g)
    data = DataLoader(TensorDataset(x, x[:, :2].sin()), batch_size=4)
    model = Tiny(args.sync_log)
    callbacks: list[L.Callback] = [Record(args.outdir)]
    if args.die_at_step is not None:
        callbacks.append(Die(args.outdir, args.die_in, args.die_at_step, args.die_rank, args.die_how))
    if args.ckpt_every is not None:
        callbacks.append(ModelCheckpoint(dirpath=args.ckpt_dir or os.path.join(args.outdir, "checkpoints"),
                                         filename="{step}", every_n_train_steps=args.ckpt_every, save_top_k=-1))
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, num_nodes=args.num_nodes,
                        strategy=make_strategy(args), max_steps=args.max_steps, logger=False,
                        enable_checkpointing=args.ckpt_every is not None, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=callbacks)
    trainer.fit(model, data, ckpt_path=args.ckpt_path)


def make_strategy(args):
    """The strategy name as given, or a LayerwiseStrategy when an option of it was passed."""
    options = {}
    if args.bucket_size is not None:
        options["bucket_size"] = args.bucket_size
    if args.timeout_s is not None:
        options["timeout"] = timedelta(seconds=args.timeout_s)
    if args.checkpoint_format is not None:
        options["checkpoint_format"] = args.checkpoint_format
    if not options:
        return args.strategy
    if args.strategy not in _START_METHODS:
        raise SystemExit(f"--bucket_size/--timeout_s/--checkpoint_format need a layerwise strategy, not "
                         f"{args.strategy!r}")
    return llw.LayerwiseStrategy(start_method=_START_METHODS[args.strategy], **options)


class Die(L.Callback):
    """Simulates a crashed rank: global rank ``rank`` dies without cleaning up, in ``phase`` of step ``step``.

    "Step N" is the training batch that starts at ``trainer.global_step == N`` (its forward,
    backward, optimizer step and all-gather), or for the save phases the checkpoint saved
    once ``trainer.global_step == N``.
    """

    def __init__(self, outdir: str, phase: str, step: int, rank: int, how: str) -> None:
        self.outdir, self.phase, self.step, self.rank, self.how = outdir, phase, step, rank, how
        self.trainer = None
        self.armed = False  # all_gather: set once step N's optimizer.step is under way

    def now(self) -> bool:
        return self.trainer is not None and self.trainer.global_rank == self.rank and \
            self.trainer.global_step == self.step

    def die(self, where: str) -> None:
        record = {"rank": self.trainer.global_rank, "phase": self.phase, "where": where, "pid": os.getpid(),
                  "global_step": self.trainer.global_step, "time": time.time()}
        with open(os.path.join(self.outdir, f"died{self.trainer.global_rank}.json"), "w") as f:
            json.dump(record, f)
        if self.phase == "batch_start":
            os._exit(3)
        if self.how in ("sigkill", "stop"):
            os.kill(os.getpid(), signal.SIGKILL if self.how == "sigkill" else signal.SIGSTOP)
        os._exit(1)

    def setup(self, trainer, pl_module, stage) -> None:
        self.trainer = trainer
        if trainer.global_rank != self.rank:
            return
        # Patches that live outside the model are installed on the dying rank only.
        if self.phase == "all_gather":
            gather = llw_collectives.all_gather_bucket

            def all_gather_bucket(*args, **kwargs):
                result = gather(*args, **kwargs)
                if self.armed:
                    self.die("after dispatching an all_gather_bucket of start_param_sync")
                return result

            llw_collectives.all_gather_bucket = all_gather_bucket
        elif self.phase == "save_sharded":
            from torch.distributed.checkpoint import FileSystemWriter

            write_data = FileSystemWriter.write_data

            def dcp_write_data(writer, plan, planner):
                result = write_data(writer, plan, planner)
                if self.now():
                    result.wait()  # this rank's data file is written; the index and meta.pt are not
                    self.die("torch.distributed.checkpoint FileSystemWriter.write_data, after writing")
                return result

            FileSystemWriter.write_data = dcp_write_data
        elif self.phase == "save_full":
            send = llw_named_state.send_tensor

            def send_tensor(*args, **kwargs):
                result = send(*args, **kwargs)
                if self.now():
                    self.die("checkpoint.gather_named_state, after sending the first tensor")
                return result

            llw_named_state.send_tensor = send_tensor

    def on_train_start(self, trainer, pl_module) -> None:
        if trainer.global_rank != self.rank:
            return
        if self.phase == "forward":
            def pre_hook(module, args):
                if self.now():
                    self.die("forward pre-hook of net[2], after net[0] and net[1] ran")

            pl_module.net[2].register_forward_pre_hook(pre_hook)
        elif self.phase == "backward":
            def grad_hook(grad):
                if self.now():
                    self.die("gradient hook of net[0].weight during backward")
                return grad

            pl_module.net[0].weight.register_hook(grad_hook)
        elif self.phase == "optimizer_step":
            optimizer = trainer.optimizers[0]
            step = optimizer.step

            def optimizer_step(closure=None, **kwargs):
                if closure is None or not self.now():
                    return step(closure=closure, **kwargs)

                def closure_then_die():
                    closure()  # forward, backward, gradient reduce-scatter
                    self.die("optimizer.step, after its closure, before updating parameters")

                return step(closure=closure_then_die, **kwargs)

            optimizer.step = optimizer_step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.phase == "batch_start" and self.now():
            self.die("on_train_batch_start")

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        # Runs after backward, inside optimizer.step's closure: the next all-gather is start_param_sync's.
        if self.phase == "all_gather" and self.now():
            self.armed = True


class Record(L.Callback):
    """Writes what each rank saw; on_fit_end runs in every process, after the strategy's teardown."""

    def __init__(self, outdir: str) -> None:
        self.outdir = outdir

    def setup(self, trainer, pl_module, stage) -> None:
        with open(os.path.join(self.outdir, f"started{trainer.global_rank}.json"), "w") as f:
            json.dump({"global_rank": trainer.global_rank, "pid": os.getpid(), "time": time.time()}, f)

    def on_fit_end(self, trainer, pl_module) -> None:
        checksum = sum(p.detach().double().sum().item() for p in pl_module.parameters())
        record = {
            "global_rank": trainer.global_rank, "world_size": trainer.world_size,
            "node_rank": trainer.node_rank, "local_rank": trainer.local_rank,
            "strategy": type(trainer.strategy).__name__,
            "environment": type(trainer.strategy.cluster_environment).__name__,
            "checksum": checksum, "global_step": trainer.global_step,
            # per parameter: [sum, sum of squares], so differences cannot cancel across parameters
            "param_checksums": {n: [p.detach().double().sum().item(), p.detach().double().square().sum().item()]
                                for n, p in pl_module.named_parameters()},
        }
        with open(os.path.join(self.outdir, f"rank{trainer.global_rank}.json"), "w") as f:
            json.dump(record, f)


if __name__ == "__main__":
    main()
