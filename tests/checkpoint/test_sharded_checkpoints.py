"""Checkpoints with sharded parameters move to and from every other setting and continue as if uninterrupted.

The harness of ``test_checkpoint_resharding.py`` (one global batch of 12 per step whatever the world size, a
checkpoint at the end of the first epoch, every parameter and every step's global loss compared with
the uninterrupted run, relative error <= 1e-5):

* saved with ``shard_parameters=True`` at 4 ranks as a sharded directory, resumed at 2 ranks without it;
* saved with it at 4 ranks as a sharded directory, resumed with it at 3 ranks;
* saved with it at 2 ranks as one full file, resumed under ``ddp``;
* saved without it at 2 ranks as one full file, resumed with it at 3 ranks.

Right after loading, every rank holds the checkpoint's parameters (read inside ``llw.full_parameters``,
since outside a step a rank holds only its shard).
"""

from __future__ import annotations

import lightning as L
import pytest

import lightning_layerwise as llw
from _dist import run_distributed
from test_checkpoint_resharding import (STEPS, Net, _run_worker, assert_at_checkpoint, assert_continues, loader,
                                        make_trainer, result, saved_params)


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
    # name: (saved at, format, sharded when saved, resumed at, resumed sharded, resumed format)
    "sharded-4-to-unsharded-2": (4, "sharded", True, 2, False, "sharded"),
    "sharded-4-to-sharded-3": (4, "sharded", True, 3, True, "sharded"),
    "full-sharded-2-to-ddp-2": (2, "full", True, 2, False, "ddp"),
    "full-unsharded-2-to-sharded-3": (2, "full", False, 3, True, "full"),
}


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
@pytest.mark.parametrize("case", list(CASES))
def test_sharded_parameter_checkpoints_resume_anywhere(tmp_path, case, optimizer):
    saved_at, fmt, sharded, resumed_at, resumed_sharded, resumed_fmt = CASES[case]
    reference = run_distributed(_save_worker, saved_at, optimizer, fmt, sharded, str(tmp_path))[0]
    path = str(tmp_path / f"step={STEPS}.ckpt")
    resumed = run_distributed(_resume_worker, resumed_at, optimizer, resumed_fmt, resumed_sharded, path)
    for rank, r in enumerate(resumed):
        assert_at_checkpoint(saved_params(path), r, f"{case} rank {rank}")
        assert_continues(reference, r, f"{case} {optimizer} rank {rank}")
