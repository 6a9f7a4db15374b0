"""What ``trainer.fit`` leaves behind with ``shard_parameters=True``, against ``ddp`` (Note [sharded release] in
``engine/sharded.py``).

The run goes on after ``fit``: every bucket stays sharded and the gradient shards are freed, so the end of
``fit`` gathers nothing (a rank never holds the whole model there). On that module, in the same worker as a
``ddp`` run of the same model and data (``TinyLM`` of ``tests/helpers.py``, as in ``test_sharded_trainer.py``:
tied embedding, ``nn.MultiheadAttention``, a penalty read before the forward), and compared with it (fp32,
relative error <= 1e-5):

* a read outside the rules raises ``ShardedParameterReadError`` on every rank, naming ``llw.release(model)``;
* ``trainer.validate`` on the same Trainer runs on the sharded run and gives ``ddp``'s loss, also after a
  ``validate`` that raised (a failed evaluation keeps the run and its values);
* ``trainer.save_checkpoint`` writes a file that ``trainer.validate(ckpt_path=...)`` reads back into the
  sharded module (after the values were changed) and ``load_from_checkpoint`` opens in one process, with
  ``ddp``'s values;
* ``llw.full_parameters`` gathers ``ddp``'s values;
* a second ``fit`` by a new Trainer ends the first run (the module whole again) and trains on from there;
* ``llw.release(model)`` gives every parameter back whole, in its own storage.

Now and under the timing fuzzer. Also: without sharding, the run's buffers go when ``fit`` returns.
"""

from __future__ import annotations

import gc
import weakref

import lightning as L
import pytest
import torch

import lightning_layerwise as llw
from _dist import LATE_MS, run_distributed
from helpers import TINY_LM_STEPS as STEPS, TinyLM, rel_err, tiny_lm_loader as loader

TOL = 1e-5


class FailingLM(TinyLM):
    """``TinyLM`` whose validation can be made to raise, on every rank."""

    fail = False

    def validation_step(self, batch, batch_idx):
        if self.fail:
            raise ValueError("validation failed on purpose")
        return super().validation_step(batch, batch_idx)


def _strategy(name: str):
    if name == "ddp":
        return "ddp_find_unused_parameters_true"
    return llw.LayerwiseStrategy(shard_parameters=True, bucket_size=3000)


def _trainer(world: int, name: str) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=world, strategy=_strategy(name), max_steps=STEPS, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     num_sanity_val_steps=0)


def _values(model) -> dict[str, torch.Tensor]:
    with llw.full_parameters(model):  # passes through after ddp
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def _after_fit(rank, world, name, root):
    model, out = FailingLM("adamw"), {}
    trainer = _trainer(world, name)
    trainer.fit(model, loader(world, 1))
    if name == "sharded":
        wrapper = trainer.strategy.session.wrapper
        out["sharded"] = wrapper is not None and len(wrapper.buckets) > 1 and all(
            b.param.state.value == "freed" for b in wrapper.buckets)
        out["gradients_freed"] = all(b.grad.shard is None or b.grad.shard.untyped_storage().size() == 0
                                     for b in wrapper.buckets)
        try:
            model.head.weight.sum()  # tied: named wte.weight
            out["read"] = "no error"
        except llw.ShardedParameterReadError as error:
            out["read"] = str(error)
    model.fail = True
    try:
        trainer.validate(model, loader(world, 1), verbose=False)
    except ValueError as error:
        out["failed_validate"] = str(error)
    model.fail = False
    out["val_loss"] = trainer.validate(model, loader(world, 1), verbose=False)[0]["val_loss"]
    if name == "sharded":
        out["sharded_after_validate"] = all(b.param.state.value == "freed"
                                            for b in trainer.strategy.session.wrapper.buckets)
    trainer.save_checkpoint(f"{root}/{name}.ckpt")
    out["fit"] = _values(model)
    with torch.no_grad():
        with llw.full_parameters(model):
            for p in model.parameters():
                p.mul_(0.5)  # every rank alike: the checkpoint must bring the values back
    out["val_loss_from_checkpoint"] = trainer.validate(model, loader(world, 1), ckpt_path=f"{root}/{name}.ckpt",
                                                       verbose=False)[0]["val_loss"]
    out["restored"] = _values(model)
    _trainer(world, name).fit(model, loader(world, 1))  # a new Trainer, a new run from the values reached
    llw.release(model)
    out["own_storage"] = all(p.untyped_storage().nbytes() == p.numel() * p.element_size()
                             for p in model.parameters())
    out["second_fit"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


def _worker(rank, world, root):
    return {name: _after_fit(rank, world, name, root) for name in ("ddp", "sharded")}


@pytest.mark.slow
@pytest.mark.parametrize("late", [None, LATE_MS], ids=["now", "late"])
def test_fit_leaves_the_module_sharded_and_each_use_afterwards_equals_ddp(tmp_path, late):
    results = run_distributed(_worker, 2, str(tmp_path), late_ms=late)
    for rank, result in enumerate(results):
        ddp, sharded = result["ddp"], result["sharded"]
        assert sharded["sharded"] and sharded["gradients_freed"] and sharded["sharded_after_validate"], rank
        assert "'wte.weight' was read by" in sharded["read"] and "llw.release(model)" in sharded["read"], \
            (rank, sharded["read"])
        assert abs(sharded["val_loss"] - ddp["val_loss"]) <= TOL * abs(ddp["val_loss"]), rank
        assert sharded["own_storage"], rank
        assert sharded["failed_validate"] == ddp["failed_validate"] == "validation failed on purpose", rank
        assert sharded["val_loss_from_checkpoint"] == sharded["val_loss"], rank
        assert all(torch.equal(sharded["restored"][n], v) for n, v in sharded["fit"].items()), rank
        for what in ("fit", "second_fit"):
            for n, ref in ddp[what].items():
                assert rel_err(sharded[what][n], ref) <= TOL, (rank, what, n, rel_err(sharded[what][n], ref))
                assert torch.equal(sharded[what][n], results[0]["sharded"][what][n]), (rank, what, n)
    trained = results[0]["sharded"]["fit"]
    loaded = TinyLM.load_from_checkpoint(tmp_path / "sharded.ckpt", map_location="cpu")
    for n, p in loaded.named_parameters():
        assert torch.equal(p, trained[n]), n
    assert max(rel_err(results[0]["ddp"]["second_fit"][n], results[0]["ddp"]["fit"][n])
               for n in trained if n != "unused.weight") > 1e-3, "the second fit trained on"


class _KeepWeakly(L.Callback):
    """Weak references to the strategy's wrapper and its two sides (which hold the buffers), taken while it
    trains."""

    def on_train_end(self, trainer, pl_module):
        wrapper = trainer.strategy.session.wrapper
        self.refs = [weakref.ref(x) for x in (wrapper, wrapper.grad_sync, wrapper.param_sync)]


def _freed_worker(rank, world):
    keep = _KeepWeakly()
    trainer = L.Trainer(accelerator="cpu", devices=world, max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[keep],
                        strategy=llw.LayerwiseStrategy(bucket_size=3000))
    gc.disable()  # only what the release itself frees counts
    try:
        trainer.fit(TinyLM("adamw"), loader(world, 1))
        return [ref() is None for ref in keep.refs]
    finally:
        gc.enable()


def test_an_unsharded_run_frees_its_buffers_when_fit_returns():
    """Without sharding ``fit`` ends the run: the wrapper and its two sides, which hold the flat buffers (the
    model's and the gradients' size), go when it returns, not at the interpreter's next garbage collection (they
    call each other back)."""
    for rank, gone in enumerate(run_distributed(_freed_worker, 2)):
        assert all(gone), (rank, "wrapper, gradient side, parameter side still alive:", gone)
