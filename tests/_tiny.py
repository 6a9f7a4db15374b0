"""A two-layer LightningModule, its data and a quiet ``Trainer``, shared by the tests of bad inputs and faults.

``outcome(fn)`` runs ``fn`` and returns ``"ok"`` or the type and text of what it raised, so a test can
assert the exact message a user reads, also from a forked rank (``tests/_dist.py``). Used by
``checkpoint/test_checkpoint_errors.py``, ``engine/test_model_checks.py``, ``lightning/test_launch.py``,
``lightning/test_faults.py`` and ``lightning/test_nonfinite.py``.
"""

from __future__ import annotations

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_layerwise as llw


class Tiny(L.LightningModule):
    """Two linear layers; ``head`` names the second one (another name makes another model)."""

    def __init__(self, width: int = 8, head: str = "out"):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(4, width)
        setattr(self, head, nn.Linear(width, 2))
        self.head_name = head

    def forward(self, x):
        return getattr(self, self.head_name)(self.inp(x).tanh())

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def batches(n: int = 8, batch_size: int = 2) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g)
    return DataLoader(TensorDataset(x, x[:, :2].sin()), batch_size=batch_size)


def trainer(devices: int = 1, strategy=None, **kwargs) -> L.Trainer:
    options = dict(accelerator="cpu", devices=devices, strategy=strategy or llw.LayerwiseStrategy(), max_steps=1,
                   logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    options.update(kwargs)
    return L.Trainer(**options)


def outcome(fn) -> str:
    """``"ok"``, or the type and text of what ``fn()`` raised."""
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - the message is what is under test
        return f"{type(e).__name__}: {e}"
    return "ok"
