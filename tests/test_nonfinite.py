"""``skip_nonfinite_steps``: a non-finite gradient on one rank skips the step on every rank.

Rank 1 alone puts an inf into ``head.bias``'s gradient at step 1; after the reduce-scatter
only the owner of ``head.bias`` sees it. With the policy on, every rank skips that step
(parameters after it equal those before it, on every rank), counts it, and training goes
on with finite parameters; with it off (the default, as ``ddp``), the inf reaches the
parameters and the all-gather spreads it to every rank. ``16-mixed`` keeps its grad
scaler's own skipping (tests/test_strategy.py).
"""

from __future__ import annotations

import lightning as L
import pytest
import torch

import lightning_layerwise as llw
from _dist import run_distributed
from test_strategy import Regressor, loaders


def _worker(rank, world, skip, precision, owner_group_size=None):
    model = Regressor(optimizer="adamw", inf_on_rank=1, inf_at_step=1)
    snapshots = {}

    class Snapshot(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            snapshots[trainer.global_step] = {n: p.detach().clone() for n, p in pl_module.named_parameters()}

    strategy = llw.LayerwiseStrategy(skip_nonfinite_steps=skip, owner_group_size=owner_group_size)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=4, logger=False,
                        precision=precision, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[Snapshot()])
    train, _ = loaders()
    trainer.fit(model, train)
    return snapshots, strategy.skipped_steps


@pytest.mark.slow
@pytest.mark.parametrize("precision,world,g", [("32-true", 2, None), ("bf16-mixed", 2, None), ("32-true", 4, 2)],
                         ids=["32-true", "bf16-mixed", "32-true-4ranks-2x2"])
def test_a_non_finite_gradient_on_one_rank_skips_the_step_everywhere(precision, world, g):
    """``world=4, g=2``: two owner groups sharing the step; the inf lands in the chunk of one rank of four
    (Note [replica sharing]), which must still stop all of them."""
    results = run_distributed(_worker, world, True, precision, g)
    for snapshots, skipped in results:
        assert skipped == 1
        # global_step counts the skipped step too (as with a grad scaler): the state after step 2
        # (the injected one) is the state after step 1.
        for name, before in snapshots[1].items():
            assert torch.equal(snapshots[2][name], before), name
            assert torch.isfinite(snapshots[4][name]).all() and not torch.equal(snapshots[4][name], before)
    for name in results[0][0][4]:
        for other in results[1:]:
            assert torch.equal(results[0][0][4][name], other[0][4][name]), "ranks agree"


@pytest.mark.slow
def test_without_the_policy_the_inf_reaches_every_rank():
    for snapshots, skipped in run_distributed(_worker, 2, False, "32-true"):
        assert skipped == 0
        assert not all(torch.isfinite(p).all() for p in snapshots[2].values())


def test_bad_policy_value_is_rejected():
    with pytest.raises(ValueError, match=r"skip_nonfinite_steps='yes'.*True or False"):
        llw.LayerwiseStrategy(skip_nonfinite_steps="yes")
