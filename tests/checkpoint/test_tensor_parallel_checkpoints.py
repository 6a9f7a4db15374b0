"""Checkpoints under tensor parallelism hold full (global) tensors by name and resume under any (data-parallel,
tensor-parallel) shape (Note [tensor-parallel checkpoints] in ``checkpoint/tensor_parallel.py``).

The model is ``tests/_tp_model.py``'s (projections column- and row-wise, norms, an embedding, a head; one block),
trained with AdamW and with Muon (NorMuon, the queries in per-head blocks: its state is one float per row of
each whole block, kept whole by every tensor-parallel rank) on the same global batches whatever the mesh (each
data-parallel rank its slice). Each save writes a full file (``"auto"``'s choice for this small model) and a sharded directory. Three
runs, each over both optimizers and, where it resumes, both formats:

* 2 ranks without tensor parallelism save after ``SAVED`` steps;
* 4 ranks at data-parallel 2 x tensor-parallel 2 save after ``SAVED`` steps, then resume the first run's
  checkpoints and continue to ``STEPS``, and resume their own at tensor-parallel 4;
* 2 ranks without tensor parallelism resume the second run's checkpoints and continue to ``STEPS``.

Compared with one uninterrupted process without any of it: every parameter after ``STEPS`` steps; the file
saved under tensor parallelism read with ``torch.load`` into a plain ``TinyLM`` and optimizer (the full shapes,
the values ``full_state`` gives, the optimizer state at ``SAVED``), which that process then continues to
``STEPS``; the AdamW file loaded as Lightning's ``ModelParallelStrategy`` loads one, into a DTensor model at
tensor-parallel 2, and trained on to ``STEPS``; the directory saved under tensor parallelism, consolidated,
equal to that file. Tolerance: float32, relative 1e-5 per tensor, as in ``tests/engine/test_tensor_parallel.py``.
One test: each multi-process run costs seconds, and the three runs feed one another.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import lightning_layerwise as llw
from lightning_layerwise.checkpoint import consolidate
from _dist import reference_threads, run_distributed
from _tp_model import TinyLM, batches, full_state, parallelize

SAVED, STEPS, BATCH, RTOL = 4, 8, 8, 1e-5
MODEL = {"blocks": 1, "vocab": 128}
BUCKET_SIZE = 4096  # at data-parallel 2 x tensor-parallel 2, AdamW's layout splits mlp.down (a Shard(1)
# parameter: its pieces are not rectangles of the global tensor), the embedding and the head (replicated)
OPTIMIZERS = ("adamw", "muon")
FORMATS = {"": "full file", ".dir": "sharded directory"}  # what a checkpoint's path ends with


def make_optimizer(name: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    for block in model.blocks:  # per-head blocks: NorMuon's state is one float per row of each whole head block
        llw.mark_matrices(block.attn.q, "weight", split=4)
    return llw.Muon(llw.muon_param_groups(model), lr=0.01, weight_decay=0.1, adamw_lr=1e-3, ns_dtype=torch.float32,
                    normuon=True)


def run(world: int, T: int, optimizer: str, start: int, stop: int, load: str | None = None,
        save: str | None = None) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Steps ``start`` to ``stop`` under the session (``load``: resuming that checkpoint, which must be at
    ``start``; ``save``: then saving a full file there, ``"auto"``'s choice for this model, and a sharded
    directory beside it); the full parameters at the end, and the parameters the layout split."""
    torch.manual_seed(0)
    model = TinyLM(**MODEL)
    session = llw.LayerwiseSession(llw.LayerwiseConfig(tensor_parallel_size=T, bucket_size=BUCKET_SIZE))
    if T > 1:
        parallelize(model, session.device_mesh["tensor_parallel"])
    opt = make_optimizer(optimizer, model)
    wrapped = session.wrap(model, opt)
    split = [name for name, slot in wrapped.layout.params.items() if slot.split]
    D, d = world // T, dist.get_rank() // T
    if load is not None:
        assert session.load_checkpoint(load)["step"] == start
    for tokens in batches(stop, BATCH)[start:]:
        session.backward(wrapped.module.loss(tokens.chunk(D)[d]))
        session.step(opt)
        opt.zero_grad()
    if save is not None:
        session.save_checkpoint(save, step=stop)
        session.config = dataclasses.replace(session.config, checkpoint_format="sharded")
        session.save_checkpoint(save + ".dir", step=stop)
    session.sync_parameters()
    out = full_state(model)
    session.release()
    return out, split


def _save_plain(rank: int, world: int, root: str) -> None:
    for optimizer in OPTIMIZERS:
        run(world, 1, optimizer, 0, SAVED, save=f"{root}/plain_{optimizer}.ckpt")


def _tensor_parallel(rank: int, world: int, root: str) -> dict:
    out = {}
    for optimizer in OPTIMIZERS:
        out["saved", optimizer] = run(world, 2, optimizer, 0, SAVED, save=f"{root}/tp_{optimizer}.ckpt")
        for suffix in FORMATS:
            out[suffix, optimizer] = run(world, 2, optimizer, SAVED, STEPS, load=f"{root}/plain_{optimizer}.ckpt"
                                         + suffix)
            out["tp4", suffix, optimizer] = run(world, 4, optimizer, SAVED, STEPS, load=f"{root}/tp_{optimizer}.ckpt"
                                                + suffix)
    return out


def _resume_plain(rank: int, world: int, root: str) -> dict:
    out = {(suffix, optimizer): run(world, 1, optimizer, SAVED, STEPS, load=f"{root}/tp_{optimizer}.ckpt" + suffix)
           for optimizer in OPTIMIZERS for suffix in FORMATS}
    out["model_parallel"] = _model_parallel(root)
    return out


def _model_parallel(root: str) -> dict[str, torch.Tensor]:
    """The AdamW file saved at dp2 x tp2 loaded as Lightning's ModelParallelStrategy loads a file (its
    ``load_checkpoint`` calls this function) into a DTensor model at tensor-parallel 2, then trained on."""
    from lightning.fabric.strategies.model_parallel import _load_checkpoint
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("data_parallel", "tensor_parallel"))
    torch.manual_seed(1)  # not the saved run's initial values
    model = parallelize(TinyLM(**MODEL), mesh["tensor_parallel"])
    opt = make_optimizer("adamw", model)
    _load_checkpoint(Path(f"{root}/tp_adamw.ckpt"), {"state_dict": model, "optimizer_0": opt},
                     optimizer_states_from_list=True)
    for tokens in batches(STEPS, BATCH)[SAVED:]:
        model.loss(tokens).backward()
        opt.step()
        opt.zero_grad()
    return full_state(model)


def reference(optimizer: str, start: int = 0, stop: int = STEPS, load: str | None = None):
    """One process, no session: ``(model, optimizer)`` after steps ``start`` to ``stop`` (``load``: a checkpoint
    file read with ``torch.load`` into the plain model and optimizer first)."""
    with reference_threads():
        torch.manual_seed(0)
        model = TinyLM(**MODEL)
        opt = make_optimizer(optimizer, model)
        if load is not None:
            saved = torch.load(load, weights_only=True)
            model.load_state_dict(saved["state_dict"])
            opt.load_state_dict(saved["optimizer_states"][0])
        for tokens in batches(stop, BATCH)[start:]:
            model.loss(tokens).backward()
            opt.step()
            opt.zero_grad()
    return model, opt


def assert_close(got: dict, want: dict, what: str) -> None:
    assert set(got) == set(want), what
    for name, value in want.items():
        assert got[name].shape == value.shape, f"{what}: {name} has shape {tuple(got[name].shape)}"
        err = ((got[name] - value).norm() / value.norm().clamp_min(1e-30)).item()
        assert err <= RTOL, f"{what}: {name} differs by {err:.2e} relative"


def named_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """``opt``'s per-parameter tensors as ``{"name/key": tensor}``."""
    names = {p: n for n, p in model.named_parameters()}
    return {f"{names[p]}/{k}": v for p, entry in opt.state.items() for k, v in entry.items() if torch.is_tensor(v)}


def file_state(path: str) -> dict[str, torch.Tensor]:
    """A full file's optimizer state as :func:`named_state` keys it (the file is keyed by name)."""
    saved = torch.load(path, weights_only=True)["optimizer_states"][0]["state"]
    return {f"{n}/{k}": v for n, entry in saved.items() for k, v in entry.items() if torch.is_tensor(v)}


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # consolidating in this process is the intent
def test_checkpoints_move_between_tensor_parallel_and_plain_runs(tmp_path):
    root = str(tmp_path)
    run_distributed(_save_plain, 2, root)
    tp = run_distributed(_tensor_parallel, 4, root)
    plain = run_distributed(_resume_plain, 2, root)
    for optimizer in OPTIMIZERS:
        want_model, _ = reference(optimizer)
        want = {n: p.detach() for n, p in want_model.named_parameters()}
        if optimizer == "adamw":
            for rank, result in enumerate(plain):
                assert_close(result["model_parallel"], want, f"adamw: saved at dp2 x tp2, resumed by "
                                                             f"ModelParallelStrategy's loading at tp2, rank {rank}")
        for suffix, fmt in FORMATS.items():
            for rank, result in enumerate(tp):
                assert_close(result[suffix, optimizer][0], want, f"{optimizer} {fmt}: saved at dp2, resumed at dp2 x "
                                                              f"tp2, rank {rank}")
                assert_close(result["tp4", suffix, optimizer][0], want, f"{optimizer} {fmt}: saved at dp2 x tp2, "
                                                                        f"resumed at tp4, rank {rank}")
            for rank, result in enumerate(plain):
                assert_close(result[suffix, optimizer][0], want, f"{optimizer} {fmt}: saved at dp2 x tp2, resumed at "
                                                              f"2, rank {rank}")
        # The file saved under tensor parallelism, in a plain process: full shapes, full_state's values, the
        # optimizer state one process holds at that step; and that process continues from it.
        path = f"{root}/tp_{optimizer}.ckpt"
        at_save, at_save_opt = reference(optimizer, stop=SAVED)
        loaded, _ = reference(optimizer, stop=0, load=path)
        loaded_params = {n: p.detach() for n, p in loaded.named_parameters()}
        saved, split = tp[0]["saved", optimizer]
        if optimizer == "adamw":
            assert {"blocks.0.mlp.down.weight", "embed.weight"} <= set(split), split
        for name, value in saved.items():
            torch.testing.assert_close(loaded_params[name], value, rtol=0, atol=0)
        assert_close(loaded_params, {n: p.detach() for n, p in at_save.named_parameters()},
                     f"{optimizer}: the parameters of the file saved under tensor parallelism")
        assert_close(file_state(path), named_state(at_save, at_save_opt),
                     f"{optimizer}: the optimizer state of the file saved under tensor parallelism")
        continued, _ = reference(optimizer, start=SAVED, load=path)
        assert_close({n: p.detach() for n, p in continued.named_parameters()}, want,
                     f"{optimizer}: saved at dp2 x tp2, resumed in one plain process")
        # The sharded directory holds the global tensors: consolidated, it is the full file.
        consolidated = consolidate(Path(path + ".dir"), tmp_path / f"consolidated_{optimizer}.ckpt")
        full, joined = torch.load(path, weights_only=True), torch.load(consolidated, weights_only=True)
        torch.testing.assert_close(joined["state_dict"], full["state_dict"], rtol=0, atol=0)
        torch.testing.assert_close(joined["optimizer_states"][0]["state"], full["optimizer_states"][0]["state"],
                                   rtol=0, atol=0)
