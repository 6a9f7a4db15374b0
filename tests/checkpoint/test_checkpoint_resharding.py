"""Checkpoints reshard: a run saved at N ranks resumes at M ranks and continues as if never interrupted.

Both formats (``sharded``: a torch.distributed.checkpoint directory, each rank
writing what it owns; ``full``: one file from rank 0) are keyed by parameter
name, so neither depends on the world size, the bucket size or even the
strategy. Data is world-size independent: every step has one global batch of
12 samples and rank r trains on its r-th slice, so 1, 2, 3 and 4 ranks compute
the same averaged gradient. An epoch is exactly the saved steps long, so the
checkpoint falls on an epoch boundary and the resumed run sees the batches the
uninterrupted one sees. Compared: every parameter and every step's global
loss, relative error <= 1e-5 (fp32).
"""

from __future__ import annotations

import os
import signal

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

import lightning_layerwise as llw
from _dist import run_distributed
from helpers import (CKPT_STEPS as STEPS, CkptNet as Net, assert_at_checkpoint, assert_continues,
                     ckpt_loader as loader, ckpt_result as result, ckpt_run_worker as _run_worker,
                     ckpt_trainer as make_trainer, rel_err, saved_params)


def _resume_worker(rank, world, optimizer, strategy, fmt, path, bucket_size=40_000_000, owner_group_size="auto",
                   fill=True):
    model = Net(optimizer)
    inspected = {}

    class Inspect(L.Callback):
        def on_train_start(self, trainer, pl_module):
            opt = trainer.optimizers[0]
            wrapper = getattr(trainer.strategy, "wrapper", None)
            inspected["n_state"] = len(opt.state)
            inspected["state_elements"] = sum(p.numel() for p in opt.state)  # a piece counts its elements
            stepped = set() if wrapper is None else {p for _, p in wrapper.named_owned_parameters()}
            inspected["only_owned"] = wrapper is None or all(p in stepped for p in opt.state)
            inspected["split"] = [] if wrapper is None else [n for n, s in wrapper.layout.params.items() if s.split]
            inspected["replicas"] = 1 if wrapper is None else world // wrapper.ranks.owner_group_size
            inspected["owned"] = None if wrapper is None else len(list(wrapper.named_owned_parameters()))
            inspected["params_at_start"] = {n: p.detach().clone() for n, p in pl_module.named_parameters()}
            names = {p: n for n, p in pl_module.named_parameters()}
            # NorMuon's state as loaded: the norm of each second moment (0 would mean it was not restored)
            inspected["second_moments"] = {names.get(p, "?"): float(s["second_moment"].norm())
                                           for p, s in opt.state.items() if "second_moment" in s}

    make_trainer(world, strategy, fmt, bucket_size, callbacks=[Inspect()], owner_group_size=owner_group_size,
                 fill=fill).fit(model, loader(), ckpt_path=path)
    return {**result(model), **inspected}


# --- resume at another world size, bucket size, strategy ---------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["sharded", "full"])
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
@pytest.mark.parametrize("saved_at, resumed_at", [(2, 3), (3, 1), (1, 4), (4, 3), (4, 1)])
def test_resume_at_another_world_size(tmp_path, fmt, optimizer, saved_at, resumed_at):
    reference = run_distributed(_run_worker, saved_at, optimizer, "layerwise", fmt, str(tmp_path))[0]
    path = str(tmp_path / f"step={STEPS}.ckpt")
    assert os.path.isdir(path) == (fmt == "sharded")
    resumed = run_distributed(_resume_worker, resumed_at, optimizer, "layerwise", fmt, path)
    n_elements = sum(p.numel() for p in Net(optimizer).parameters())
    # Each element's state is on exactly one rank of each owner group.
    assert sum(r["state_elements"] for r in resumed) == n_elements * resumed[0]["replicas"]
    if resumed_at > 1 and optimizer == "adamw":  # element-wise fill splits AdamW's parameters
        assert resumed[0]["split"], "no parameter was split: the pieces' resharding was not exercised"
    for rank, r in enumerate(resumed):
        assert r["only_owned"], f"rank {rank} holds optimizer state of parameters it does not own"
        assert_at_checkpoint(saved_params(path), r, f"{fmt} {saved_at}->{resumed_at} rank {rank}")
        assert_continues(reference, r, f"{fmt} {optimizer} {saved_at}->{resumed_at} rank {rank}")


@pytest.mark.parametrize("fmt", ["sharded", "full"])
@pytest.mark.parametrize("saved_at, resumed_at", [(2, 3), (3, 1)])
def test_normuon_state_resumes_at_another_world_size(tmp_path, fmt, saved_at, resumed_at):
    """The second moments (one float per row, not per element) follow their matrix's owner in both formats."""
    reference = run_distributed(_run_worker, saved_at, "normuon", "layerwise", fmt, str(tmp_path))[0]
    path = str(tmp_path / f"step={STEPS}.ckpt")
    resumed = run_distributed(_resume_worker, resumed_at, "normuon", "layerwise", fmt, path)
    for rank, r in enumerate(resumed):
        assert r["only_owned"], f"rank {rank} holds optimizer state of parameters it does not own"
        assert r["second_moments"] and all(n > 0 for n in r["second_moments"].values()), r["second_moments"]
        assert_at_checkpoint(saved_params(path), r, f"{fmt} normuon {saved_at}->{resumed_at} rank {rank}")
        assert_continues(reference, r, f"{fmt} normuon {saved_at}->{resumed_at} rank {rank}")
    # every matrix's state on exactly one rank (one owner group)
    owners = [n for r in resumed for n in r["second_moments"]]
    assert sorted(owners) == ["hidden.weight", "inp.weight", "out.weight"], owners


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["sharded", "full"])
def test_resume_with_another_bucket_size(tmp_path, fmt):
    """Another bucket size means another layout and other owners; names keep the state where it belongs."""
    reference = run_distributed(_run_worker, 2, "muon", "layerwise", fmt, str(tmp_path), 40_000_000)[0]
    resumed = run_distributed(_resume_worker, 2, "muon", "layerwise", fmt, str(tmp_path / f"step={STEPS}.ckpt"),
                              300)
    for rank, r in enumerate(resumed):
        assert r["only_owned"]
        assert_continues(reference, r, f"bucket 40M -> 300, rank {rank}")


@pytest.mark.slow
@pytest.mark.parametrize("saver, resumer", [("layerwise", "ddp"), ("ddp", "layerwise")])
def test_full_checkpoints_move_between_layerwise_and_ddp(tmp_path, saver, resumer):
    reference = run_distributed(_run_worker, 2, "muon", saver, "full", str(tmp_path))[0]
    path = str(tmp_path / f"step={STEPS}.ckpt")
    keys = list(torch.load(path, weights_only=True)["optimizer_states"][0]["state"])
    if saver == "layerwise":
        assert keys == sorted(n for n, _ in Net().named_parameters()), "state keyed by parameter name"
    resumed = run_distributed(_resume_worker, 2, "muon", resumer, "full", path)
    for rank, r in enumerate(resumed):
        assert_continues(reference, r, f"{saver} -> {resumer}, rank {rank}")


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["sharded", "full"])
def test_two_owner_groups_resume_at_three_ranks_at_one_and_under_ddp(tmp_path, fmt):
    """Saved at 4 ranks as 2 owner groups x 2 with element-wise fill (each group steps half of each shard,
    Note [replica sharing]); resumed as if never interrupted at 6 ranks as 3 groups of 2, at 3 ranks (one
    group of 3), at 1 rank, at 4 ranks as 2 x 2 and as 4 groups of 1, at 2 ranks without element-wise fill,
    and (full format) under ddp. The optimizer state is held once in the world whatever the shape."""
    reference = run_distributed(_run_worker, 4, "adamw", "layerwise", fmt, str(tmp_path), 40_000_000, 2)
    assert [r["owner_group_size"] for r in reference] == [2] * 4
    path = str(tmp_path / f"step={STEPS}.ckpt")
    targets = [(6, "layerwise", 2, True), (3, "layerwise", 3, True), (1, "layerwise", None, True),
               (4, "layerwise", 2, True),
               (4, "layerwise", 1, True), (2, "layerwise", None, False)]  # the last: element-wise fill off
    targets += [(2, "ddp", None, True)] if fmt == "full" else []
    n_elements = sum(p.numel() for p in Net("adamw").parameters())
    for world, strategy, g, fill in targets:
        resumed = run_distributed(_resume_worker, world, "adamw", strategy, fmt, path, 40_000_000, g, fill)
        if strategy == "layerwise":
            assert sum(r["state_elements"] for r in resumed) == n_elements
        if world == 3:
            assert resumed[0]["split"], "the 3-rank layout splits parameters too"
        if not fill:
            assert resumed[0]["split"] == [], "elementwise_fill=False owns every parameter whole"
        for rank, r in enumerate(resumed):
            assert_at_checkpoint(saved_params(path), r, f"2x2 -> {strategy} at {world}, rank {rank}")
            assert_continues(reference[0], r, f"{fmt} 2x2 -> {strategy} at {world}, rank {rank}")


# --- plain Lightning and torch read the files --------------------------------------------


def _save_one_step_worker(rank, world, fmt, path):
    model = Net("muon")
    trainer = make_trainer(world, "layerwise", fmt, max_steps=STEPS)
    trainer.fit(model, loader())
    trainer.save_checkpoint(path)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.slow
def test_full_checkpoint_loads_with_plain_lightning_and_torch(tmp_path):
    path = str(tmp_path / "full.ckpt")
    params = run_distributed(_save_one_step_worker, 2, "full", path)[0]
    loaded = Net.load_from_checkpoint(path)
    for name, p in loaded.named_parameters():
        assert torch.equal(p, params[name]), name
    checkpoint = torch.load(path, weights_only=True)
    saved = checkpoint["optimizer_states"][0]
    fresh = Net("muon")
    plain = fresh.configure_optimizers()["optimizer"]
    plain.load_state_dict(saved)  # torch pairs saved and current parameters by position within the groups
    names = {p: n for n, p in fresh.named_parameters()}
    loaded_states = 0
    for group in plain.param_groups:
        for p in group["params"]:
            for key, value in saved["state"][names[p]].items():
                assert torch.equal(plain.state[p][key], value), (names[p], key)
                loaded_states += 1
    assert loaded_states > len(names), "every parameter got its momentum (and Adam moments)"


@pytest.mark.slow
def test_sharded_checkpoint_consolidates_into_one_file(tmp_path):
    import subprocess
    import sys

    path = tmp_path / "sharded.ckpt"
    params = run_distributed(_save_one_step_worker, 3, "sharded", str(path))[0]
    files = sorted(p.name for p in path.iterdir())
    assert "meta.pt" in files and ".metadata" in files and sum(f.endswith(".distcp") for f in files) == 3, files
    out = tmp_path / "consolidated.ckpt"
    subprocess.run([sys.executable, "-m", "lightning.pytorch.utilities.consolidate_checkpoint", str(path),
                    "--output_file", str(out)], check=True, capture_output=True)
    checkpoint = torch.load(out, weights_only=False)
    assert checkpoint["global_step"] == STEPS
    assert sorted(checkpoint["optimizer_states"][0]["state"]) == sorted(params)
    loaded = Net.load_from_checkpoint(out)
    for name, p in loaded.named_parameters():
        assert torch.equal(p, params[name]), name


@pytest.mark.slow
def test_consolidated_sharded_checkpoint_resumes_under_ddp(tmp_path):
    import subprocess
    import sys

    reference = run_distributed(_run_worker, 2, "adamw", "layerwise", "sharded", str(tmp_path))[0]
    out = tmp_path / "consolidated.ckpt"
    subprocess.run([sys.executable, "-m", "lightning.pytorch.utilities.consolidate_checkpoint",
                    str(tmp_path / f"step={STEPS}.ckpt"), "--output_file", str(out)], check=True,
                   capture_output=True)
    resumed = run_distributed(_resume_worker, 2, "adamw", "ddp", "full", str(out))
    for rank, r in enumerate(resumed):
        assert_continues(reference, r, f"consolidated -> ddp, rank {rank}")


# --- nothing lost -------------------------------------------------------------------------


def _killed_while_saving_worker(rank, world, fmt, dirpath):
    """Writes last.ckpt after each epoch; rank 0 is killed (SIGKILL) halfway through the second save."""
    from lightning.pytorch.plugins.io import TorchCheckpointIO
    from torch.distributed.checkpoint import FileSystemWriter

    saves = []
    if fmt == "sharded":
        original = FileSystemWriter.write_data

        def write_data(self, plan, planner):
            saves.append(1)
            result = original(self, plan, planner)
            if rank == 0 and len(saves) == 2:
                result.wait()  # this rank's data files are written; the index and meta.pt are not
                os.kill(os.getpid(), signal.SIGKILL)
            return result

        FileSystemWriter.write_data = write_data
    else:
        original = TorchCheckpointIO.save_checkpoint

        def save_checkpoint(self, checkpoint, path, storage_options=None):
            saves.append(1)
            if len(saves) == 2:
                with open(path, "wb") as f:
                    f.write(b"half a checkpoint")
                    f.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            return original(self, checkpoint, path, storage_options)

        TorchCheckpointIO.save_checkpoint = save_checkpoint
    model = Net("adamw")
    save = ModelCheckpoint(dirpath=dirpath, every_n_train_steps=STEPS, save_top_k=0, save_last=True)
    make_trainer(world, "layerwise", fmt, callbacks=[save]).fit(model, loader())


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["sharded", "full"])
def test_a_save_killed_halfway_leaves_the_previous_checkpoint(tmp_path, fmt):
    reference = run_distributed(_run_worker, 2, "adamw", "layerwise", fmt, str(tmp_path / "reference"))[0]
    dirpath = tmp_path / "killed"
    with pytest.raises(RuntimeError, match="died|failed"):
        run_distributed(_killed_while_saving_worker, 2, fmt, str(dirpath), timeout=120)
    last = dirpath / "last.ckpt"
    leftovers = sorted(p.name for p in dirpath.iterdir())
    assert ".last.ckpt.partial" in leftovers, leftovers  # the interrupted save, written aside
    resumed = run_distributed(_resume_worker, 3, "adamw", "layerwise", fmt, str(last))
    for rank, r in enumerate(resumed):
        assert_at_checkpoint(saved_params(str(tmp_path / "reference" / f"step={STEPS}.ckpt")), r,
                             f"previous checkpoint, rank {rank}")
        assert_continues(reference, r, f"resumed after a killed save, rank {rank}")


def _save_twice_worker(rank, world, path):
    model = Net("adamw")
    trainer = make_trainer(world, "layerwise", "sharded", max_steps=STEPS)
    trainer.fit(model, loader())
    trainer.save_checkpoint(path)
    first = saved_params(path)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    trainer.save_checkpoint(path)  # replaces the directory
    return first, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.slow
def test_replacing_a_sharded_checkpoint_and_recovering_an_interrupted_rename(tmp_path):
    path = tmp_path / "model.ckpt"
    first, second = run_distributed(_save_twice_worker, 2, str(path))[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.ckpt"], "no partial or aside directory left"
    saved = saved_params(str(path))
    for name in second:
        assert torch.equal(saved[name], second[name]) and not torch.equal(saved[name], first[name]), name
    # A save killed between its two renames leaves the old checkpoint aside and none in place.
    os.rename(path, tmp_path / ".model.ckpt.old")
    (resumed,) = run_distributed(_resume_worker, 1, "adamw", "layerwise", "sharded", str(path))
    for name, p in resumed["params_at_start"].items():
        assert torch.equal(p, second[name]), name


def _top_k_worker(rank, world, dirpath):
    class Monitored(Net):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.log("train_loss", loss, sync_dist=True)
            return loss

    model = Monitored("adamw")
    save = ModelCheckpoint(dirpath=dirpath, filename="{step}", monitor="train_loss", every_n_train_steps=1,
                           save_top_k=2, save_last=True)
    make_trainer(world, "layerwise", "sharded", callbacks=[save]).fit(model, loader())
    return sorted(os.path.basename(p) for p in save.best_k_models), os.path.basename(save.last_model_path)


def _resume_last_worker(rank, world, dirpath):
    model = Net("adamw")
    save = ModelCheckpoint(dirpath=dirpath, filename="{step}", every_n_train_steps=STEPS, save_last=True)
    trainer = make_trainer(world, "layerwise", "sharded", callbacks=[save], max_steps=2 * STEPS)
    trainer.fit(model, loader(), ckpt_path="last")
    return trainer.global_step


@pytest.mark.slow
def test_model_checkpoint_top_k_and_last_with_directories(tmp_path):
    best, last = run_distributed(_top_k_worker, 2, str(tmp_path))[0]
    on_disk = sorted(p.name for p in tmp_path.iterdir())
    assert len(best) == 2 and last == "last.ckpt"
    assert on_disk == sorted(best + ["last.ckpt"]), on_disk  # the other top-k candidates were removed
    assert all((tmp_path / name / "meta.pt").is_file() for name in on_disk)
    # ckpt_path="last" finds the directory and resumes at its step.
    steps = run_distributed(_resume_last_worker, 2, str(tmp_path))
    assert steps == [2 * STEPS, 2 * STEPS]


# --- clear errors ---------------------------------------------------------------------------


def _load_worker(rank, world, path, optimizer="adamw"):
    model = Net(optimizer)
    make_trainer(world, "layerwise", "sharded").fit(model, loader(), ckpt_path=path)


@pytest.fixture(scope="module")
def sharded_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("sharded") / "good.ckpt"
    run_distributed(_save_one_step_worker, 2, "sharded", str(path))
    return path


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def _drop_meta(path):
    (path / "meta.pt").unlink()


def _drop_data_file(path):
    (path / "__1_0.distcp").unlink()


def _truncate_data_file(path):
    data = path / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])


def _drop_layerwise_record(path):
    meta = torch.load(path / "meta.pt", weights_only=False)
    del meta["layerwise"]
    torch.save(meta, path / "meta.pt")


def _drop_index(path):
    (path / ".metadata").unlink()


@pytest.mark.slow
@pytest.mark.parametrize("damage, message", [
    (_drop_meta, r"no meta\.pt: it is not a complete checkpoint.*interrupted"),
    (_drop_data_file, r"missing the data file '__1_0\.distcp'"),
    (_truncate_data_file, r"'__0_0\.distcp' is truncated"),
    (_drop_layerwise_record, r"not written by LayerwiseStrategy.*consolidate_checkpoint"),
    (_drop_index, r"no \.metadata"),
], ids=["no-meta", "missing-file", "truncated-file", "foreign", "no-index"])
def test_truncated_or_foreign_directories_raise_clear_errors(sharded_checkpoint, tmp_path, damage, message):
    broken = _copy(sharded_checkpoint, tmp_path / "broken.ckpt")
    damage(broken)
    with pytest.raises(RuntimeError, match=message):
        run_distributed(_load_worker, 1, str(broken))


@pytest.mark.slow
def test_changed_param_groups_raise_instead_of_crossing_state(sharded_checkpoint):
    # Saved with Muon's groups (matrices, then the rest); AdamW has one group.
    with pytest.raises(RuntimeError, match=r"2 param group\(s\), this optimizer 1"):
        run_distributed(_load_worker, 2, str(sharded_checkpoint), "adamw")


def test_bad_checkpoint_format_is_rejected_up_front():
    with pytest.raises(ValueError, match=r"checkpoint_format='distributed'.*'sharded'.*'full'"):
        llw.LayerwiseStrategy(checkpoint_format="distributed")


# --- bf16-true master weights, evaluation ------------------------------------------------------


def _bf16_worker(rank, world, dirpath, ckpt_path, bucket_size, fmt="sharded"):
    model = Net("adamw")
    callbacks = [] if ckpt_path else [ModelCheckpoint(dirpath=dirpath, filename="{step}",
                                                      every_n_train_steps=STEPS, save_top_k=-1)]
    trainer = L.Trainer(accelerator="cpu", devices=world, precision="bf16-true", max_steps=2 * STEPS, logger=False,
                        strategy=llw.LayerwiseStrategy(bucket_size=bucket_size, checkpoint_format=fmt),
                        callbacks=callbacks,
                        enable_checkpointing=bool(callbacks), enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False)
    trainer.fit(model, loader(), ckpt_path=ckpt_path)
    return {n: p.detach().float().clone() for n, p in model.named_parameters()}


@pytest.mark.slow
def test_bf16_true_master_weights_survive_a_sharded_resume(tmp_path):
    """The float32 masters are saved by their owners and restored under new owners (another bucket size).

    Rounding the masters to the bf16 parameters on resume would change the continuation by
    about a bf16 ulp per update; restored masters reproduce it bit for bit: the same kernels
    run on the same batches, a sum over 2 ranks is the same in either order, and AdamW's step
    is element-wise, so which rank owns an element (another bucket size) changes no bit.
    """
    reference = run_distributed(_bf16_worker, 2, str(tmp_path), None, 40_000_000)[0]
    path = tmp_path / f"step={STEPS}.ckpt"
    items = _checkpoint_keys(path)
    assert any(k.startswith("optimizer_0.master_weights.") for k in items), "masters are in the checkpoint"
    resumed = run_distributed(_bf16_worker, 2, str(tmp_path), str(path), 300)
    for rank, params in enumerate(resumed):
        for name, value in params.items():
            assert torch.equal(value, reference[name]), (rank, name, rel_err(value, reference[name]))


def _split_under_bf16(rank, world, bucket_size):
    model = Net("adamw")
    trainer = L.Trainer(accelerator="cpu", devices=world, precision="bf16-true", max_steps=1, logger=False,
                        strategy=llw.LayerwiseStrategy(bucket_size=bucket_size), enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False)
    split = []

    class Probe(L.Callback):
        def on_train_end(self, trainer, pl_module):
            wrapper = trainer.strategy.wrapper
            split.extend(n for n, p in pl_module.named_parameters() if wrapper.records.piece_of(p) is not None)

    trainer.callbacks.append(Probe())
    trainer.fit(model, loader())
    return split


def test_bf16_true_masters_of_pieces_survive_a_full_file_resume(tmp_path):
    """Split parameters under ``bf16-true``: the optimizer steps float32 masters of pieces. Loading a full file
    cuts their saved state to the piece, as for a piece itself (it once gave a master the whole parameter's
    AdamW state, and the first step after resuming failed on the shapes). Same bucket size, same world: the
    continuation is bit for bit the uninterrupted run's."""
    assert any(run_distributed(_split_under_bf16, 2, 300)), "no parameter is split at bucket_size=300"
    reference = run_distributed(_bf16_worker, 2, str(tmp_path), None, 300, "full")[0]
    path = tmp_path / f"step={STEPS}.ckpt"
    assert path.is_file(), "a full checkpoint file was written"
    resumed = run_distributed(_bf16_worker, 2, str(tmp_path), str(path), 300, "full")
    for rank, params in enumerate(resumed):
        for name, value in params.items():
            assert torch.equal(value, reference[name]), (rank, name, rel_err(value, reference[name]))


def _checkpoint_keys(path) -> list[str]:
    from torch.distributed.checkpoint import FileSystemReader

    return sorted(FileSystemReader(str(path)).read_metadata().state_dict_metadata)


class Evaluated(Net):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y), sync_dist=True)


def _validate_worker(rank, world, path):
    model = Evaluated("adamw")
    trainer = make_trainer(world, "layerwise", "sharded")
    trainer.validate(model, loader(), ckpt_path=path, verbose=False)
    return {n: p.detach().clone() for n, p in model.named_parameters()}, int(model.calls)


@pytest.mark.slow
def test_validate_from_a_sharded_checkpoint(sharded_checkpoint):
    """Outside fit the model is not wrapped: every rank reads every parameter (and no optimizer state)."""
    saved = saved_params(str(sharded_checkpoint))
    for params, calls in run_distributed(_validate_worker, 3, str(sharded_checkpoint)):
        assert calls == STEPS, "the module buffer was loaded"
        for name, value in params.items():
            assert torch.equal(value, saved[name]), name
