"""A short fit with strategy="layerwise*", started by each launch mode under test.

    python tests/launch_script.py OUTDIR --strategy layerwise --devices 2 [--num_nodes N]

Every rank writes OUTDIR/rank<global_rank>.json with what it saw.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import lightning_layerwise as llw  # noqa: E402


class Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return llw.Muon(llw.muon_param_groups(self), lr=0.02, adamw_lr=1e-2, ns_dtype=torch.float32)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("outdir")
    parser.add_argument("--strategy", default="layerwise")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--num_nodes", type=int, default=1)
    parser.add_argument("--die_at_step", type=int, default=None, help="global rank 1 exits hard at this step")
    args = parser.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 6, generator=g)
    data = DataLoader(TensorDataset(x, x[:, :2].sin()), batch_size=4)
    model = Tiny()
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, num_nodes=args.num_nodes, strategy=args.strategy,
                        max_steps=4, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[Record(args.outdir), Die(args.die_at_step)])
    trainer.fit(model, data)


class Die(L.Callback):
    """Simulates a crashed rank: global rank 1 exits without cleaning up."""

    def __init__(self, step: int | None) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.step is not None and trainer.global_rank == 1 and trainer.global_step == self.step:
            os._exit(3)


class Record(L.Callback):
    """Writes what each rank saw; on_fit_end runs in every process, after the strategy's teardown."""

    def __init__(self, outdir: str) -> None:
        self.outdir = outdir

    def on_fit_end(self, trainer, pl_module) -> None:
        checksum = sum(p.detach().double().sum().item() for p in pl_module.parameters())
        record = {
            "global_rank": trainer.global_rank, "world_size": trainer.world_size,
            "node_rank": trainer.node_rank, "local_rank": trainer.local_rank,
            "strategy": type(trainer.strategy).__name__,
            "environment": type(trainer.strategy.cluster_environment).__name__,
            "checksum": checksum, "global_step": trainer.global_step,
        }
        with open(os.path.join(self.outdir, f"rank{trainer.global_rank}.json"), "w") as f:
            json.dump(record, f)


if __name__ == "__main__":
    main()
