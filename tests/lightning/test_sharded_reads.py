"""Reads of sharded parameters under Lightning (Note [sharded reads] in ``engine/sharded.py``, Note [collective
reads] in ``engine/collective_reads.py``).

* The reads of issue 43's hang, ``nn.MultiheadAttention`` at 2 and 3 ranks, AdamW, ``shard_parameters=True``: a
  weight's norm in ``on_train_batch_start``, logged with ``sync_dist=True``, and an L2 penalty over
  ``self.parameters()`` in ``training_step`` before ``self(x)``. Both gather on demand; the run equals one
  process on the same global batch, and so does every norm the hook read. A callback reading every
  parameter in ``on_train_batch_end`` holds one full bucket at a time, none after the hook. Also under the
  timing fuzzer.
* A read in a hook made on rank 0 only, in another hook on one rank, or of another bucket on each rank, ends
  every rank with the same :class:`ShardedParameterReadError` within 60 s, at 2 and 3 ranks.
* Lightning's ``EMAWeightAveraging`` (with validation on the average, ``ModelCheckpoint`` and a deep copy of
  the module) and ``StochasticWeightAveraging``, unchanged, equal to ``ddp``.
* Under Fabric a read between steps raises in Fabric's words.

Tolerance (float32): the sharded run and one process differ only in how each gradient's mean over the 12
rows is summed (two or three partial sums, then their mean: a relative rounding of a few 2**-24 per
element). AdamW turns a relative gradient error into at most that fraction of ``lr`` per step, so after
4 steps at ``lr=1e-2`` every parameter differs by far less than 1e-5 of its norm. Attention biases are off:
the key bias's gradient is zero up to rounding, which AdamW would scale to full steps.
"""

from __future__ import annotations

import copy
import time

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from lightning.pytorch import callbacks
from lightning.pytorch.callbacks import ModelCheckpoint, StochasticWeightAveraging
from torch.utils.data import DataLoader, TensorDataset

import lightning_layerwise as llw
from _dist import LATE_MS, reference_threads, run_distributed
from helpers import rel_err
from lightning_layerwise.engine.buffers import ParamState

VOCAB, SEQ, D = 23, 5, 16
GLOBAL_BATCH = 12
STEPS = 4
TOL = 1e-5
PENALTY = 1e-3
WATCHED = "attn.out_proj.weight"  # read by MultiheadAttention without calling out_proj; here also in a hook


class AttentionLM(L.LightningModule):
    """The model and the two reads of the hang; ``norms``: the hook's reads, one per step."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, D)
        self.attn = nn.MultiheadAttention(D, 2, batch_first=True, bias=False)
        self.fc = nn.Linear(D, D)
        self.head = nn.Linear(D, VOCAB)
        self.norms: list[float] = []

    def forward(self, x):
        h = self.emb(x)
        h = h + self.attn(h, h, h, need_weights=False)[0]
        return self.head(h + torch.relu(self.fc(h)))

    def on_train_batch_start(self, batch, batch_idx):
        norm = self.get_parameter(WATCHED).norm()
        self.log("watched_norm", norm, sync_dist=True)
        self.norms.append(norm.item())

    def training_step(self, batch, batch_idx):
        x, y = batch
        penalty = PENALTY * sum(p.square().sum() for p in self.parameters())  # before self(x)
        return F.cross_entropy(self(x).reshape(-1, VOCAB), y.reshape(-1)) + penalty

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)


def data():
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, VOCAB, (GLOBAL_BATCH * STEPS, SEQ), generator=g)
    return x, (x * 7 + 3) % VOCAB


def rank_loader(rank: int, world: int) -> DataLoader:
    """This rank's part of each global batch, in order (Lightning's sampler is off: it would shuffle)."""
    x, y = data()
    mine = torch.cat([rows.chunk(world)[rank] for rows in torch.arange(len(x)).split(GLOBAL_BATCH)])
    return DataLoader(TensorDataset(x[mine], y[mine]), batch_size=GLOBAL_BATCH // world)


def reference():
    """One process, the same global batches, loss and reads."""
    model = AttentionLM()
    opt = model.configure_optimizers()
    x, y = data()
    norms = []
    with reference_threads():
        for xb, yb in zip(x.split(GLOBAL_BATCH), y.split(GLOBAL_BATCH)):
            norms.append(model.get_parameter(WATCHED).norm().item())
            opt.zero_grad()
            model.training_step((xb, yb), 0).backward()
            opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, norms


class BucketProbe(L.Callback):
    """Reads every parameter in ``on_train_batch_end``; records the most buckets full at once during those reads
    and whether any was still full when the next hook began."""

    def __init__(self):
        self.most_full, self.left_full, self.buckets = 0, False, 0

    def _full(self, trainer) -> int:
        return sum(b.param.state is ParamState.READY for b in trainer.strategy.session.wrapper.buckets)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        for p in pl_module.parameters():
            p.abs().max()
            self.most_full = max(self.most_full, self._full(trainer))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.left_full |= self._full(trainer) > 0
        self.buckets = len(trainer.strategy.session.wrapper.buckets)


def trainer_for(world: int, callbacks=()) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=world, max_steps=STEPS, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                     callbacks=list(callbacks), use_distributed_sampler=False,
                     strategy=llw.LayerwiseStrategy(shard_parameters=True, bucket_size=400))


def _hang_worker(rank, world):
    model, probe = AttentionLM(), BucketProbe()
    trainer = trainer_for(world, [probe])
    trainer.fit(model, rank_loader(rank, world))
    llw.release(model)  # the run goes on after fit: ended here, every parameter whole
    return {n: p.detach().clone() for n, p in model.named_parameters()}, model.norms, probe.most_full, \
        probe.left_full, probe.buckets


@pytest.mark.slow
@pytest.mark.parametrize("late", [None, LATE_MS], ids=["now", "late"])
@pytest.mark.parametrize("world", [2, 3])
def test_reads_in_a_hook_and_before_the_forward_gather_on_demand_and_equal_one_process(world, late):
    expected, expected_norms = reference()
    results = run_distributed(_hang_worker, world, late_ms=late, timeout=150)
    for rank, (params, norms, most_full, left_full, buckets) in enumerate(results):
        assert buckets > 2 and most_full == 1 and not left_full, (rank, buckets, most_full, left_full)
        for n, ref in expected.items():
            assert rel_err(params[n], ref) <= TOL, (rank, n, rel_err(params[n], ref))
        assert len(norms) == STEPS
        for step, (norm, ref) in enumerate(zip(norms, expected_norms)):
            assert abs(norm - ref) <= TOL * ref, (rank, step, norm, ref)
    assert max(rel_err(results[0][0][n], AttentionLM().state_dict()[n]) for n in expected) > 1e-3


# --- reads not every rank makes --------------------------------------------------------------------------------

class UnevenReads(L.Callback):
    """``"rank0"``: rank 0 alone reads a weight in ``on_train_batch_start``; ``"hooks"``: the last rank reads it
    in ``on_train_batch_end`` instead (the same read, in another hook); ``"buckets"``: each rank reads a
    parameter of another bucket there."""

    def __init__(self, case: str):
        self.case = case

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        last = trainer.global_rank == trainer.world_size - 1
        if (self.case == "rank0" and trainer.global_rank == 0) or (self.case == "hooks" and not last):
            pl_module.get_parameter(WATCHED).norm()
        if self.case == "buckets":
            trainer.strategy.wrapper.param_sync.gather_order[trainer.global_rank].params[0].norm()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.case == "hooks" and trainer.global_rank == trainer.world_size - 1:
            pl_module.get_parameter(WATCHED).norm()


class PlainLM(AttentionLM):
    """The model without the hang's reads."""

    def on_train_batch_start(self, batch, batch_idx):
        return None

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x).reshape(-1, VOCAB), y.reshape(-1))


def _uneven_worker(rank, world, case):
    trainer = trainer_for(world, [UnevenReads(case)])
    start = time.monotonic()
    try:
        trainer.fit(PlainLM(), rank_loader(rank, world))
    except llw.ShardedParameterReadError as error:
        return str(error), time.monotonic() - start
    return "no error", time.monotonic() - start


@pytest.mark.slow
@pytest.mark.parametrize("case", ["rank0", "hooks", "buckets"])
@pytest.mark.parametrize("world", [2, 3])
def test_a_hook_read_not_every_rank_makes_ends_every_rank_with_the_same_error(world, case):
    results = run_distributed(_uneven_worker, world, case, timeout=120)
    for rank, (message, seconds) in enumerate(results):
        assert seconds < 60, (rank, seconds)
        assert "was read by Tensor.norm in [Callback]UnevenReads.on_train_batch_" in message, (rank, message)
        assert "every rank must read the same parameters in the same order" in message, (rank, message)
        if case == "buckets":  # every rank reached the agreement: each names what every rank read
            assert "the ranks read differently at this point (rank 0: bucket " in message, (rank, message)
        else:
            assert f"{WATCHED!r} was read by" in message and "did not make this read" in message, (rank, message)


# --- Lightning's weight averaging, unchanged ------------------------------------------------------------------

EMAWeightAveraging = getattr(callbacks, "EMAWeightAveraging", None)  # Lightning >= 2.6
needs_weight_averaging = pytest.mark.skipif(EMAWeightAveraging is None,
                                            reason="this Lightning has no WeightAveraging callback (added in 2.6)")


class ValidatedLM(PlainLM):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x).reshape(-1, VOCAB), y.reshape(-1)), sync_dist=True)


class Snapshots(L.Callback):
    """The module as a callback sees it: a deep copy when training starts, every parameter when it ends (before
    the averaging callback after it puts the average in)."""

    def on_train_start(self, trainer, pl_module):
        self.copy = copy.deepcopy(pl_module)

    def on_train_end(self, trainer, pl_module):
        self.trained = {n: p.detach().clone() for n, p in pl_module.named_parameters()}


def _averaging_fit(rank, world, strategy, root):
    snapshots, ema = Snapshots(), EMAWeightAveraging(decay=0.5)
    saves = ModelCheckpoint(dirpath=root, every_n_train_steps=2, save_top_k=-1, filename="{step}")
    model = ValidatedLM()
    trainer = L.Trainer(accelerator="cpu", devices=world, max_steps=STEPS, logger=False, default_root_dir=root,
                        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                        val_check_interval=2, limit_val_batches=1, num_sanity_val_steps=1,
                        callbacks=[snapshots, ema, saves], strategy=strategy)
    trainer.fit(model, rank_loader(rank, world), rank_loader(rank, world))
    llw.release(model)  # a no-op after ddp
    named = lambda m: {n: p.detach().clone() for n, p in m.named_parameters()}  # noqa: E731
    saved = torch.load(f"{root}/step=2.ckpt", weights_only=True) if rank == 0 else {}
    return {"copy": named(snapshots.copy), "trained": snapshots.trained,
            "averaged": named(ema._average_model.module), "after_fit": named(model),
            "val_loss": trainer.callback_metrics["val_loss"].item(),
            "saved": {k: saved[k] for k in ("state_dict", "current_model_state") if k in saved}}


def _averaging_worker(rank, world, root):
    return (_averaging_fit(rank, world, "ddp", f"{root}/ddp"),
            _averaging_fit(rank, world, llw.LayerwiseStrategy(shard_parameters=True, bucket_size=400),
                           f"{root}/sharded"))


@pytest.mark.slow
@needs_weight_averaging
def test_lightning_weight_averaging_works_unchanged_with_sharded_parameters_as_under_ddp(tmp_path):
    """``EMAWeightAveraging``: ``AveragedModel.update_parameters`` reads every parameter in ``on_train_batch_end``,
    validation swaps the average in and out (reads and writes in ``on_validation_epoch_*``), ``on_train_end``
    copies it into the module, ``ModelCheckpoint`` saves (from a hook: the strategy's own gathers) with the
    average as ``state_dict``; a deep copy taken in ``on_train_start`` reads every parameter too. Every value
    equals ``ddp``'s (same tolerance as one process: ``ddp`` averages the same per-rank gradients)."""
    for rank, (ddp, sharded) in enumerate(run_distributed(_averaging_worker, 2, str(tmp_path), timeout=180)):
        for what in ("copy", "trained", "averaged", "after_fit", *ddp["saved"]):
            want, got = ddp.get(what, ddp["saved"].get(what)), sharded.get(what, sharded["saved"].get(what))
            assert set(got) == set(want), (rank, what)
            for n, ref in want.items():
                assert rel_err(got[n], ref) <= TOL, (rank, what, n, rel_err(got[n], ref))
        assert rank > 0 or set(ddp["saved"]) == {"state_dict", "current_model_state"}
        assert abs(sharded["val_loss"] - ddp["val_loss"]) <= TOL * ddp["val_loss"]
        assert max(rel_err(ddp["averaged"][n], ddp["trained"][n]) for n in ddp["trained"]) > 1e-3, "EMA averaged"
        for n, ref in ddp["averaged"].items():
            assert torch.equal(ddp["after_fit"][n], ref), n


def _swa_fit(rank, world, strategy):
    snapshots = Snapshots()
    swa = StochasticWeightAveraging(swa_lrs=5e-3, swa_epoch_start=1, annealing_epochs=1)
    model = PlainLM()
    trainer = L.Trainer(accelerator="cpu", devices=world, max_epochs=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                        callbacks=[snapshots, swa], strategy=strategy)
    trainer.fit(model, rank_loader(rank, world))
    llw.release(model)
    return snapshots.trained, {n: p.detach().clone() for n, p in model.named_parameters()}


def _swa_worker(rank, world):
    return (_swa_fit(rank, world, "ddp"),
            _swa_fit(rank, world, llw.LayerwiseStrategy(shard_parameters=True, bucket_size=400)))


@pytest.mark.slow
def test_lightning_stochastic_weight_averaging_works_unchanged_with_sharded_parameters_as_under_ddp():
    """``StochasticWeightAveraging`` (its own copy, made in ``setup`` before wrapping): every parameter read in
    ``on_train_epoch_end`` and the average written into the module in ``on_train_end``. Equal to ``ddp``."""
    for rank, ((ddp_trained, ddp_final), (trained, final)) in enumerate(run_distributed(_swa_worker, 2)):
        for n in ddp_final:
            assert rel_err(trained[n], ddp_trained[n]) <= TOL, (rank, "trained", n)
            assert rel_err(final[n], ddp_final[n]) <= TOL, (rank, "averaged", n)
        assert max(rel_err(ddp_final[n], ddp_trained[n]) for n in ddp_final) > 1e-3, "SWA averaged"


# --- the words of each front end ------------------------------------------------------------------------------

def _fabric_read_worker(rank, world):
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=world,
                    strategy=llw.LayerwiseFabricStrategy(shard_parameters=True, bucket_size=400))
    fabric.launch()
    module = PlainLM()
    model, opt = fabric.setup(module, module.configure_optimizers())
    x, y = next(iter(rank_loader(rank, world)))
    fabric.backward(F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1)))
    opt.step()
    try:
        for p in module.parameters():  # every rank, between steps
            p.sum()
    except llw.ShardedParameterReadError as error:
        return str(error)
    finally:
        fabric.strategy.teardown()
    return "no error"


@pytest.mark.slow
def test_a_read_between_steps_under_fabric_names_fabrics_calls():
    for message in run_distributed(_fabric_read_worker, 2):
        assert "outside the forward of the model that fabric.setup returned" in message, message
        assert "llw.release(model) or fabric.strategy.teardown(), on every rank, gives the module every parameter " \
               "back whole." in message
        assert "trainer" not in message.lower() and "session" not in message.lower(), message
