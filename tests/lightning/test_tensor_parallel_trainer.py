"""``Trainer(strategy=LayerwiseStrategy(tensor_parallel_size=T))`` with a LightningModule written for
``ModelParallelStrategy``: ``configure_model`` applies ``parallelize_module`` over ``self.device_mesh``.

Against one process without tensor parallelism on the same global batches (Lightning's distributed sampler
shuffles with seed 0 over the data-parallel ranks; the reference replays that order), with gradient accumulation
and clipping by the global norm, and Lightning's ``grad_norm`` logged each step. float32; relative 1e-5 per tensor
(the runs differ in the order of float32 sums only: ``tests/engine/test_tensor_parallel.py``).
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.utilities import grad_norm
from torch.utils.data import DataLoader, DistributedSampler

import lightning_layerwise as llw
from tests._dist import reference_threads, run_distributed
from tests._tp_model import TinyLM, batches, full_state, parallelize

STEPS, ACCUMULATE, MICRO, CLIP, RTOL = 4, 2, 2, 0.05, 1e-5


def make_optimizer(name: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    return llw.Muon(llw.muon_param_groups(model), lr=0.02, weight_decay=0.1, adamw_lr=1e-3, ns_dtype=torch.float32)


class TPModule(L.LightningModule):
    def __init__(self, optimizer: str, tied: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = TinyLM(tied=tied)
        self.optimizer_name = optimizer
        self.norms: list[float] = []

    def configure_model(self) -> None:
        if self.device_mesh is None:
            assert self._trainer is None, "the strategy gave no device mesh before configure_model"
            return  # load_from_checkpoint in a plain process: the model whole
        parallelize(self.model, self.device_mesh["tensor_parallel"])

    def training_step(self, batch: torch.Tensor, _: int) -> torch.Tensor:
        return self.model.loss(batch)

    def on_before_optimizer_step(self, optimizer) -> None:
        self.norms.append(float(grad_norm(self.model, 2)["grad_2.0_norm_total"]))

    def configure_optimizers(self):
        return make_optimizer(self.optimizer_name, self.model)


def data(world_dp: int) -> torch.Tensor:
    return torch.cat(batches(STEPS * ACCUMULATE, MICRO * world_dp))


def _fit(rank: int, world: int, T: int, optimizer: str, path: str) -> tuple[dict, list[float]]:
    module = TPModule(optimizer)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=llw.LayerwiseStrategy(tensor_parallel_size=T),
                        max_steps=STEPS, accumulate_grad_batches=ACCUMULATE, gradient_clip_val=CLIP, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, DataLoader(data(world // T), batch_size=MICRO))
    trainer.strategy.sync_parameters()
    assert trainer.strategy.distributed_sampler_kwargs == {"num_replicas": world // T, "rank": rank // T}
    trainer.save_checkpoint(path)  # the default format for a small model: one full file, keyed by name
    return full_state(module.model), module.norms


def reference(world_dp: int, optimizer: str) -> tuple[dict, list[float]]:
    """One process: the global batch of each micro-step is every data-parallel rank's micro-batch."""
    tokens = data(world_dp)
    orders = [list(DistributedSampler(tokens, num_replicas=world_dp, rank=r, shuffle=True, seed=0))
              for r in range(world_dp)]
    with reference_threads():
        torch.manual_seed(0)
        model = TinyLM()
        opt = make_optimizer(optimizer, model)
        norms = []
        for step in range(STEPS):
            for micro in range(ACCUMULATE):
                k = step * ACCUMULATE + micro
                batch = torch.cat([tokens[order[k * MICRO:(k + 1) * MICRO]] for order in orders])
                (model.loss(batch) / ACCUMULATE).backward()
            norms.append(float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])))
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, norms


@pytest.mark.slow
@pytest.mark.parametrize("world, T, optimizer", [(4, 2, "muon"), (2, 2, "adamw")])
def test_trainer_with_tensor_parallel_plan_matches_one_process(world, T, optimizer, tmp_path):
    """Also: the checkpoint the Trainer saved opens with ``load_from_checkpoint`` in this plain process, as the
    model without tensor parallelism, with the trained values."""
    want, want_norms = reference(world // T, optimizer)
    assert max(want_norms) > CLIP  # the clipping acts
    path = str(tmp_path / "tp.ckpt")
    for rank, (got, norms) in enumerate(run_distributed(_fit, world, T, optimizer, path)):
        for name, value in want.items():
            err = ((got[name] - value).norm() / value.norm()).item()
            assert err <= RTOL, f"rank {rank}: {name} differs by {err:.2e} relative"
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(want_norms), rtol=RTOL, atol=0)
    loaded = TPModule.load_from_checkpoint(path, optimizer=optimizer, map_location="cpu")
    for name, param in loaded.model.named_parameters():
        torch.testing.assert_close(param.detach(), got[name], rtol=0, atol=0)


def _fabric_fit(rank: int, world: int, T: int) -> tuple[dict, list[float]]:
    """A LitGPT-style Fabric loop: the model is parallelized over ``fabric.strategy.device_mesh`` before
    ``fabric.setup``, as under Fabric's ``ModelParallelStrategy``."""
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=world, strategy=llw.LayerwiseFabricStrategy(tensor_parallel_size=T))
    fabric.launch()
    mesh = fabric.strategy.device_mesh
    torch.manual_seed(0)
    model = parallelize(TinyLM(), mesh["tensor_parallel"])
    model, opt = fabric.setup(model, make_optimizer("muon", model))
    tokens = data(world // T)
    d = mesh["data_parallel"].get_local_rank()
    order = list(DistributedSampler(tokens, num_replicas=world // T, rank=d, shuffle=True, seed=0))
    norms = []
    for step in range(STEPS):
        for micro in range(ACCUMULATE):
            k = step * ACCUMULATE + micro
            with fabric.no_backward_sync(model, enabled=micro < ACCUMULATE - 1):
                fabric.backward(model.module.loss(tokens[order[k * MICRO:(k + 1) * MICRO]]) / ACCUMULATE)
        norms.append(float(fabric.clip_gradients(model, opt, max_norm=CLIP)))
        opt.step()
        opt.zero_grad()
    fabric.strategy.sync_parameters()
    out = full_state(model.module)
    fabric.strategy.teardown()
    return out, norms


def test_fabric_loop_with_a_model_parallelized_before_setup_matches_one_process():
    want, want_norms = reference(2, "muon")
    for rank, (got, norms) in enumerate(run_distributed(_fabric_fit, 4, 2)):
        for name, value in want.items():
            err = ((got[name] - value).norm() / value.norm()).item()
            assert err <= RTOL, f"rank {rank}: {name} differs by {err:.2e} relative"
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(want_norms), rtol=RTOL, atol=0)


def _bad_size(rank: int, world: int) -> str:
    module = TPModule("adamw")
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=llw.LayerwiseStrategy(tensor_parallel_size=2),
                        max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    try:
        trainer.fit(module, DataLoader(data(1), batch_size=MICRO))
    except ValueError as error:
        assert module.model.blocks[0].attn.q.weight.shape == (32, 32)  # configure_model never ran
        return str(error)
    return "no error"


def test_a_tensor_parallel_size_that_does_not_divide_the_processes_per_node_is_refused_before_configure_model():
    for message in run_distributed(_bad_size, 3):
        assert "tensor_parallel_size=2" in message and "3 processes per node" in message and "[1, 3]" in message


def test_without_tensor_parallelism_there_is_no_mesh_and_data_is_split_as_under_ddp():
    strategy = llw.LayerwiseStrategy()
    assert strategy.session.config.tensor_parallel_size == 1
    assert strategy.session.device_mesh is None
    from lightning.pytorch.strategies import DDPStrategy

    ddp = DDPStrategy()
    assert strategy.distributed_sampler_kwargs == ddp.distributed_sampler_kwargs
