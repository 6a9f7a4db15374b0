"""A non-finite gradient on one rank, under every precision, with and without ``skip_nonfinite_steps``.

``skip_nonfinite_steps``: a non-finite gradient on one rank skips the step on every rank. Rank 1 alone
puts an inf into ``head.bias``'s gradient at step 1; after the reduce-scatter only the owner of
``head.bias`` sees it. With the policy on, every rank skips that step (parameters after it equal those
before it, on every rank), counts it, and training goes on with finite parameters; with it off (the
default, as ``ddp``), the inf reaches the parameters and the all-gather spreads it to every rank.

``16-mixed`` keeps its grad scaler's own skipping: with an inf on rank 1 only, the strategy's own
precision plugin (torch's ``ShardedGradScaler``) skips the first step on every rank and every rank keeps
the same loss scale; the user's plugin object is left untouched.

What the default settings do, per precision (docs/reliability.md, "Non-finite gradients"): rank 1 adds
inf or NaN times ``out.bias.sum()`` to its loss at step 0. Under ``32-true``, ``bf16-mixed`` and
``bf16-true`` (also with clipping) the owner steps with the non-finite gradient, every rank's
parameters become non-finite and nothing warns; under ``16-mixed`` every rank skips that step and
halves the loss scale. Both ranks hold the same values in every case.
"""

from __future__ import annotations

import math
import re
import warnings

import lightning as L
import pytest
import torch
from lightning.pytorch.plugins import MixedPrecision
from torch import nn

import lightning_layerwise as llw
from _dist import run_distributed
from helpers import WORLD, Regressor, Tiny, loaders, tiny_batches as batches, tiny_trainer as trainer


# --- skip_nonfinite_steps ----------------------------------------------------------------------------------------


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


# --- 16-mixed: the grad scaler's own skipping ----------------------------------------------------------------


def _inf_worker(rank, world):
    model = Regressor(optimizer="adamw", inf_on_rank=1, inf_at_step=0)
    train, _ = loaders()
    precision = MixedPrecision("16-mixed", "cpu")
    trainer = L.Trainer(accelerator="cpu", devices=WORLD, strategy="layerwise", max_steps=3, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        plugins=[precision])
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    scales = []

    class Spy(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            scales.append(trainer.precision_plugin.scaler.get_scale())
            if batch_idx == 0:
                spy.after_first = {n: p.detach().clone() for n, p in pl_module.named_parameters()}

    spy = Spy()
    trainer.callbacks.append(spy)
    trainer.fit(model, train)
    unchanged = all(torch.equal(spy.after_first[n], initial[n]) for n in initial)
    # The strategy's own plugin with torch's public sharded scaler; the user's plugin object is untouched.
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    assert isinstance(trainer.precision_plugin, llw.lightning.precision.LayerwiseMixedPrecision)
    assert type(trainer.precision_plugin.scaler) is ShardedGradScaler
    assert trainer.precision_plugin is not precision and not set(vars(precision)) & {"clip_grad_by_norm",
                                                                                   "clip_grad_by_value"}
    assert type(precision.scaler) is torch.amp.GradScaler and precision.scaler.get_scale() == 2.0**16
    return unchanged, scales


def test_16_mixed_inf_on_one_rank_skips_the_step_on_all_ranks():
    results = run_distributed(_inf_worker, WORLD)
    for unchanged, scales in results:
        assert unchanged, "the first step (inf on rank 1 only) must be skipped on every rank"
        assert scales[0] == 2.0**15, scales  # halved once, from the default 2**16
    assert results[0][1] == results[1][1], "every rank keeps the same loss scale"


# --- non-finite gradients on one rank, per precision (docs/reliability.md) -----------------------------------------


class InfGradient(Tiny):
    """Rank 1 adds ``value * out.bias.sum()`` to its loss at step 0: one parameter's gradient is non-finite there."""

    def __init__(self, value: float):
        super().__init__()
        self.value = value
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(x).float(), y.float())
        if self.global_rank == 1 and self.global_step == 0:
            loss = loss + self.value * self.out.bias.sum()
        self.losses.append(loss.item())
        return loss


class AfterEachStep(L.Callback):
    def __init__(self):
        self.steps: list[dict] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        self.steps.append({"params": {n: p.detach().float().clone() for n, p in pl_module.named_parameters()},
                           "scale": scaler.get_scale() if scaler is not None else None})


NONFINITE_CASES = [("32-true", math.inf, None), ("32-true", math.nan, None), ("bf16-mixed", math.inf, None),
                   ("bf16-true", math.inf, None), ("16-mixed", math.inf, None), ("16-mixed", math.nan, None),
                   ("32-true", math.inf, 1.0)]


def _nonfinite_worker(rank, world):
    results = []
    for precision, value, clip in NONFINITE_CASES:
        model, spy = InfGradient(value), AfterEachStep()
        initial = {n: p.detach().float().clone() for n, p in model.named_parameters()}
        # 16-mixed through the plugin: precision="16-mixed" on CPU falls back to bf16-mixed (Lightning warns).
        kind = {"plugins": [MixedPrecision("16-mixed", "cpu")]} if precision == "16-mixed" else {"precision": precision}
        t = trainer(devices=2, max_steps=2, callbacks=[spy], gradient_clip_val=clip, **kind)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            t.fit(model, batches(16))
        results.append({"initial": initial, "steps": spy.steps, "losses": model.losses,
                        "warnings": [str(w.message) for w in caught]})
    return results


def test_a_nonfinite_gradient_on_one_rank_by_precision():
    ranks = run_distributed(_nonfinite_worker, 2)
    for i, (precision, value, clip) in enumerate(NONFINITE_CASES):
        case = (precision, value, clip)
        per_rank = [r[i] for r in ranks]
        for rank, res in enumerate(per_rank):
            after0, after1 = res["steps"][0]["params"], res["steps"][1]["params"]
            finite0 = {n: bool(torch.isfinite(p).all()) for n, p in after0.items()}
            if precision == "16-mixed":
                # ShardedGradScaler: found-inf is all-reduced, every rank skips step 0 and halves the scale.
                assert all(torch.equal(after0[n], res["initial"][n]) for n in after0), case
                assert [s["scale"] for s in res["steps"]] == [2.0**15, 2.0**15], case
                assert all(torch.isfinite(p).all() for p in after1.values()), case
                assert any(not torch.equal(after1[n], after0[n]) for n in after1), (case, "step 1 trains")
                assert math.isfinite(res["losses"][1]), case
            else:
                # The owner of out.bias steps with the non-finite gradient; the all-gather gives every rank the
                # result, and the next forward spreads it through the loss into every parameter.
                assert finite0 == {"inp.weight": True, "inp.bias": True, "out.weight": True, "out.bias": False}, \
                    (case, rank, finite0)
                assert not math.isfinite(res["losses"][1]), (case, rank, res["losses"])
                assert not any(torch.isfinite(p).all() for p in after1.values()), (case, rank)
                silent = [w for w in res["warnings"] if re.search(r"\bnan\b|\binf\b|finite", w, re.I)]
                assert not silent, (case, "no warning mentions it", silent)
        for n in per_rank[0]["steps"][0]["params"]:  # both ranks hold the same values (NaN compared as equal)
            assert torch.equal(per_rank[0]["steps"][0]["params"][n].nan_to_num(7.0),
                               per_rank[1]["steps"][0]["params"][n].nan_to_num(7.0)), (case, n)
