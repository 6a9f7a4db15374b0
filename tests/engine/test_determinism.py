"""Two identical CPU runs give bitwise-identical parameters and losses (3 gloo ranks, overlapped all-gather).

Nothing in the strategy depends on timing: collectives are issued in a fixed order
(Note [bucket order]), the read guard only waits, and gloo's reductions sum in a fixed
order. So the same seed, data and world size reproduce every bit, with AdamW and Muon.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch

import lightning_layerwise as llw
from _dist import run_distributed
from helpers import Regressor, loaders


def _worker(rank, world, optimizer):
    losses = []

    class Losses(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(outputs["loss"].item())

    model = Regressor(optimizer=optimizer)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=llw.LayerwiseStrategy(bucket_size=256),
                        max_steps=10, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, gradient_clip_val=0.5, callbacks=[Losses()])
    train, _ = loaders()
    trainer.fit(model, train)
    return {n: p.detach().clone() for n, p in model.named_parameters()}, losses


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_two_identical_runs_are_bitwise_equal(optimizer):
    first = run_distributed(_worker, 3, optimizer)
    second = run_distributed(_worker, 3, optimizer)
    for rank, ((params_a, losses_a), (params_b, losses_b)) in enumerate(zip(first, second)):
        assert losses_a == losses_b and len(losses_a) == 10, rank
        for name in params_a:
            assert torch.equal(params_a[name], params_b[name]), (rank, name)
        assert not torch.equal(params_a["head.weight"], Regressor().head.weight), "training moved the parameters"
