"""A checkpoint saved at N ranks resumes at M ranks and continues as if never interrupted.

The checkpoint holds the full optimizer state keyed by parameter index, not by
rank, so any world size can load it; each rank then keeps the state of the
parameters it owns under the new layout. Data is world-size independent here:
every step has one global batch of 12 samples and rank r trains on its r-th
slice, so 1, 2 and 3 ranks compute the same averaged gradient. An epoch is
exactly the saved steps long, so the checkpoint falls on an epoch boundary
and the resumed run sees the batches the uninterrupted one sees.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.distributed as dist
from torch import nn

import lightning_layerwise as llw
from _dist import run_distributed

GLOBAL_BATCH = 12


class Net(L.LightningModule):
    def __init__(self, optimizer: str):
        super().__init__()
        self.optimizer_name = optimizer
        torch.manual_seed(0)
        self.inp = nn.Linear(5, 24)
        self.hidden = nn.Linear(24, 24)
        self.norm = nn.LayerNorm(24)
        self.out = nn.Linear(24, 2)

    def forward(self, x):
        return self.out(self.norm(self.hidden(self.inp(x).tanh()).tanh()))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self):
        if self.optimizer_name == "adamw":
            opt = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)
        else:
            opt = llw.Muon(llw.muon_param_groups(self), lr=0.02, adamw_lr=1e-2, ns_dtype=torch.float32)
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class RankSlices(torch.utils.data.Dataset):
    """Item i is this rank's slice of global batch i."""

    def __init__(self, steps: int):
        g = torch.Generator().manual_seed(7)
        self.x = torch.randn(steps, GLOBAL_BATCH, 5, generator=g)
        self.y = torch.stack([self.x[..., 0] * self.x[..., 1], self.x[..., 2:].sum(-1)], dim=-1)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        return self.x[i][rank::world], self.y[i][rank::world]


def trainer(world: int, max_steps: int) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=world, strategy="layerwise", max_steps=max_steps, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     use_distributed_sampler=False)


def loader(steps: int):
    return torch.utils.data.DataLoader(RankSlices(steps), batch_size=None, shuffle=False)


def _save_worker(rank, world, optimizer, dirpath, steps):
    """The uninterrupted run; ModelCheckpoint writes the checkpoint halfway."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    model = Net(optimizer)
    t = trainer(world, 2 * steps)
    t.callbacks.append(ModelCheckpoint(dirpath=dirpath, filename="{step}", every_n_train_steps=steps, save_top_k=-1))
    t.fit(model, loader(steps))
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _resume_worker(rank, world, optimizer, path, steps):
    model = Net(optimizer)
    owned_state_ok = []

    class Inspect(L.Callback):
        def on_train_start(self, trainer, pl_module):
            wrapper = trainer.strategy.wrapper
            opt = trainer.optimizers[0]
            owned_state_ok.append(len(opt.state) > 0 and all(wrapper.owns(p) for p in opt.state))

    t = trainer(world, 2 * steps)
    t.callbacks.append(Inspect())
    t.fit(model, loader(steps), ckpt_path=path)
    return {n: p.detach().clone() for n, p in model.named_parameters()}, owned_state_ok


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-12)).item()


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
@pytest.mark.parametrize("saved_at, resumed_at", [(2, 3), (3, 1)])
def test_resume_at_another_world_size(tmp_path, optimizer, saved_at, resumed_at):
    steps = 3
    (uninterrupted, *_) = run_distributed(_save_worker, saved_at, optimizer, str(tmp_path), steps)
    path = str(tmp_path / f"step={steps}.ckpt")
    ckpt = torch.load(path, weights_only=False)
    n_params = len(list(Net(optimizer).parameters()))
    assert len(ckpt["optimizer_states"][0]["state"]) == n_params, "the file holds every parameter's state"
    resumed = run_distributed(_resume_worker, resumed_at, optimizer, path, steps)
    for params, owned_state_ok in resumed:
        assert owned_state_ok == [True], "after loading, each rank keeps only its owners' state"
        moved = rel_err(params["hidden.weight"], Net(optimizer).hidden.weight.detach())
        assert moved > 1e-3
        for name, value in params.items():
            assert rel_err(value, uninterrupted[name]) <= 1e-5, (name, rel_err(value, uninterrupted[name]))
