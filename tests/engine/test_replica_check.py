"""Note [replica check]: ``replica_check_every`` catches ranks whose parameters differ after the all-gather.

* a clean 50-step run at 3 ranks never fires (10 checks);
* a one-ulp corruption injected into rank 1's all-gathered parameters from step 12 on is
  caught at the next check (step 15), on every rank, naming the bucket and parameter;
* a frozen parameter changed on one rank only (frozen parameters are never all-gathered)
  is caught at the first check.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_layerwise as llw
from lightning_layerwise.engine import collectives
from _dist import run_distributed

EVERY = 5


class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(6, 16)
        self.frozen = nn.Linear(16, 16)
        self.frozen.requires_grad_(False)
        self.out = nn.Linear(16, 2)
        self.corrupt_from: int | None = None  # step from which rank 1's all-gathers are corrupted
        self.seen_steps: list[int] = []

    def forward(self, x):
        return self.out(self.frozen(self.inp(x).tanh()).tanh())

    def training_step(self, batch, batch_idx):
        self.seen_steps.append(self.global_step)
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def loader(world):
    g = torch.Generator().manual_seed(1)
    return DataLoader(TensorDataset(torch.randn(60 * 2 * world, 6, generator=g),
                                    torch.randn(60 * 2 * world, 2, generator=g)), batch_size=2)


class OneUlpLink:
    """Work handle whose wait lands the all-gather, then moves one element of ``target`` by one ulp."""

    def __init__(self, work, target):
        self.work, self.target = work, target

    def wait(self):
        self.work.wait()
        with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():  # no read guard inside a wait
            flat = self.target.view(-1)
            flat[0] = torch.nextafter(flat[0], torch.tensor(float("inf")))


def _worker(rank, world, mode):
    model = Net()
    strategy = llw.LayerwiseStrategy(replica_check_every=EVERY, bucket_size=64)
    checks = []

    class Count(L.Callback):
        def on_train_start(self, trainer, pl_module):
            wrapper = trainer.strategy.wrapper
            real = wrapper.check_replicas
            wrapper.check_replicas = lambda: (checks.append(pl_module.global_step), real())[1]
            if mode == "frozen" and rank == 1:
                with torch.no_grad():
                    pl_module.frozen.bias[3] += 1e-3

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if mode == "link" and rank == 1 and trainer.global_step == 12:
                real_gather = collectives.all_gather_bucket
                wrapper = trainer.strategy.wrapper
                target = next(b.params[0] for b in wrapper.buckets if not wrapper.records.owns(b.params[0]))
                start = target.data_ptr()

                def faulty(bucket, group, async_op=True):
                    result = real_gather(bucket, group, async_op=async_op)
                    if bucket.data_ptr() <= start < bucket.data_ptr() + bucket.numel() * bucket.element_size():
                        result.work = OneUlpLink(result.work, target)
                    return result

                collectives.all_gather_bucket = faulty

    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=50, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[Count()])
    try:
        trainer.fit(model, loader(world))
    except llw.ReplicaDivergenceError as e:
        return str(e), model.seen_steps[-1], checks
    return None, model.seen_steps[-1], checks


@pytest.mark.slow
def test_clean_run_never_fires():
    for error, last_step, checks in run_distributed(_worker, 3, "clean"):
        assert error is None, error
        assert last_step == 49 and len(checks) == 50 // EVERY


@pytest.mark.slow
def test_one_ulp_corruption_after_the_all_gather_is_caught_within_the_interval():
    results = run_distributed(_worker, 3, "link")
    for error, last_step, _ in results:
        assert error is not None, "the corrupted run must stop"
        assert "bucket" in error and "differ between rank 0 and rank(s) [1]" in error, error
        assert "'inp." in error or "'out." in error, error  # the corrupted parameter, by name
        assert 12 <= last_step < 12 + EVERY, last_step  # stopped at the first check after the fault
    assert len({e for e, _, _ in results}) == 1, "every rank raises the same error"


@pytest.mark.slow
def test_a_frozen_parameter_changed_on_one_rank_is_caught():
    for error, last_step, _ in run_distributed(_worker, 2, "frozen"):
        assert error is not None and "'frozen.bias' (frozen, never all-gathered)" in error, error
        assert last_step == EVERY - 1


def test_bad_interval_is_rejected():
    with pytest.raises(ValueError, match=r"replica_check_every=0.*>= 1"):
        llw.LayerwiseStrategy(replica_check_every=0)
