"""Checkpoints with sharded parameters move to and from every other setting and continue as if uninterrupted.

The harness of ``test_checkpoint_resharding.py`` (one global batch of 12 per step whatever the world size, a
checkpoint at the end of the first epoch, every parameter and every step's global loss compared with
the uninterrupted run, relative error <= 1e-5):

* saved with ``shard_parameters=True`` at 4 ranks as a sharded directory, resumed at 2 ranks without it;
* saved with it at 4 ranks as a sharded directory, resumed with it at 3 ranks;
* saved with it at 2 ranks as one full file, resumed under ``ddp``;
* saved without it at 2 ranks as one full file, resumed with it at 3 ranks;

each with AdamW (parameters split across shards) or Muon (matrices whole), two cases each.

Right after loading, every rank holds the checkpoint's parameters (read inside ``llw.full_parameters``,
since outside a step a rank holds only its shard).
"""

from __future__ import annotations

import lightning as L
import torch
import pytest

import lightning_layerwise as llw
from _dist import run_distributed
from helpers import (CKPT_STEPS as STEPS, CkptNet as Net, assert_at_checkpoint, assert_continues,
                     ckpt_loader as loader, ckpt_result as result, ckpt_run_worker as _run_worker,
                     ckpt_trainer as make_trainer, saved_params)


def strategy(world: int, fmt: str, sharded: bool):
    if not sharded:
        return "ddp" if fmt == "ddp" else llw.LayerwiseStrategy(checkpoint_format=fmt, bucket_size=400)
    return llw.LayerwiseStrategy(checkpoint_format=fmt, bucket_size=400, shard_parameters=True)


def _save_worker(rank, world, optimizer, fmt, sharded, dirpath):
    return _run_worker(rank, world, optimizer, strategy(world, fmt, sharded), fmt, dirpath)


def _resume_worker(rank, world, optimizer, fmt, sharded, path):
    model = Net(optimizer)
    seen = {}

    class Inspect(L.Callback):
        def on_train_start(self, trainer, pl_module):
            with llw.full_parameters(pl_module):
                seen["params_at_start"] = {n: p.detach().clone() for n, p in pl_module.named_parameters()}

    trainer = make_trainer(world, strategy(world, fmt, sharded), fmt, callbacks=[Inspect()])
    trainer.fit(model, loader(), ckpt_path=path)
    return {**result(model), **seen}


CASES = {
    # name: (saved at, format, sharded when saved, resumed at, resumed sharded, resumed format, optimizer); each
    # optimizer twice (AdamW splits parameters across shards, Muon keeps matrices whole)
    "sharded-4-to-unsharded-2": (4, "sharded", True, 2, False, "sharded", "adamw"),
    "sharded-4-to-sharded-3": (4, "sharded", True, 3, True, "sharded", "muon"),
    "full-sharded-2-to-ddp-2": (2, "full", True, 2, False, "ddp", "muon"),
    "full-unsharded-2-to-sharded-3": (2, "full", False, 3, True, "full", "adamw"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_sharded_parameter_checkpoints_resume_anywhere(tmp_path, case):
    saved_at, fmt, sharded, resumed_at, resumed_sharded, resumed_fmt, optimizer = CASES[case]
    reference = run_distributed(_save_worker, saved_at, optimizer, fmt, sharded, str(tmp_path))[0]
    path = str(tmp_path / f"step={STEPS}.ckpt")
    resumed = run_distributed(_resume_worker, resumed_at, optimizer, resumed_fmt, resumed_sharded, path)
    for rank, r in enumerate(resumed):
        assert_at_checkpoint(saved_params(path), r, f"{case} rank {rank}")
        assert_continues(reference, r, f"{case} {optimizer} rank {rank}")


def _save_gathers_worker(rank, world, fmt, root):
    import torch

    session = llw.LayerwiseSession(llw.LayerwiseConfig(shard_parameters=True, checkpoint_format=fmt, bucket_size=300))
    model = Net("adamw")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)  # element-wise: 2 of its 3 buckets hold a split one
    wrapped = session.wrap(model, optimizer)
    for x, y in loader():
        optimizer.zero_grad()
        session.backward(torch.nn.functional.mse_loss(wrapped(x), y))
        session.step(optimizer)
    wrapped.grad_sync.waiter.events = []
    session.save_checkpoint(f"{root}/{fmt}")
    events, split = list(wrapped.grad_sync.waiter.events), {b.name for b in wrapped.param_sync.split_buckets}
    with llw.full_parameters(model):
        saved = {n: p.detach().clone() for n, p in model.named_parameters()}
    session.release()
    # A fresh run loads it (sharded parameters again) and holds the same values.
    session = llw.LayerwiseSession(llw.LayerwiseConfig(shard_parameters=True, bucket_size=300))
    model = Net("adamw")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    session.wrap(model, optimizer)
    session.load_checkpoint(f"{root}/{fmt}")
    with llw.full_parameters(model):
        loaded = {n: p.detach().clone() for n, p in model.named_parameters()}
    buckets = len(session.wrapper.buckets)
    session.release()
    return events, split, buckets, saved, loaded


@pytest.mark.parametrize("fmt", ["sharded", "full"])
def test_a_save_holds_at_most_one_bucket_full_and_the_sharded_format_gathers_only_split_parameters(tmp_path, fmt):
    """Note [sharded saves]: a sharded directory is written from the shards, gathering only the buckets holding
    a split parameter (element-wise fill), each once; a full file gathers every bucket once, one at a time. Read
    back into a sharded run, every parameter is the saved one."""
    for events, split, n_buckets, saved, loaded in run_distributed(_save_gathers_worker, 2, fmt, str(tmp_path)):
        gathered = [b for e, b in events if e == "ag_dispatch"]
        assert len(gathered) == len(set(gathered)), "each bucket gathered once"
        assert set(gathered) == (split if fmt == "sharded" else set(gathered))
        assert len(gathered) == (len(split) if fmt == "sharded" else n_buckets)
        assert split and len(split) < n_buckets, "the case has split and unsplit buckets"
        full = 0
        for event, _ in events:
            full += {"ag_dispatch": 1, "free": -1}.get(event, 0)
            assert full <= 1, "one bucket full at a time"
        for name, value in saved.items():
            assert torch.equal(loaded[name], value), name
