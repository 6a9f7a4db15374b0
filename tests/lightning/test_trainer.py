"""Trainer(strategy="layerwise") against Trainer(strategy="ddp") on the same model, data and seed.

Each rank is a forked gloo process with LOCAL_RANK/WORLD_SIZE set, the way Lightning's own subprocess
launcher (and torchrun) start workers, so both Trainers run in the same process group inside the same
worker (see ``tests/_dist.py``) and every value is compared rank by rank.

The strategy itself, on a small regressor (``Regressor``): AdamW and Muon, gradient accumulation,
clipping by norm and by value, ``bf16-mixed``; ``bf16-true`` keeping float32 masters of owned
parameters only (held once in the world, with owner groups too); element-wise fill following the
optimizer and the strategy's arguments; two owner groups of two with accumulation and clipping; a
model without a trainable parameter; an accelerator or a precision plugin the strategy cannot serve;
the registered strategy names; repeated fits leaving no process group behind.

Lightning Trainer features (``Net``): checkpoint and resume (full optimizer state in the file, owned
state after load), LR schedulers with ``LearningRateMonitor``, BatchNorm (plain, synchronised through a
``LayerSync`` plugin, and ``sync_batchnorm=True``), validate/test/predict with uneven batch counts across
ranks, ``fast_dev_run``/``max_steps``, manual optimization with and without ``clip_gradients``,
teardown, ``torch.compile`` (and an inner network that compiles once), the wrapper as an ``nn.Module``,
and the parameters callbacks see. Each of these multi-process tests takes about a second on 2 CPU cores
(tiny model, forked gloo ranks); the two torch.compile tests against ``ddp`` take 2-20 s and are marked
slow.

Elsewhere: the strategy's arguments in ``test_strategy_arguments.py``; patterns of user code (several
backward passes or optimizers, torch's clipping, Lightning's ``grad_norm``) in ``test_ddp_patterns.py``;
non-finite gradients in ``test_nonfinite.py``.
"""

from __future__ import annotations

import glob
import os

import lightning as L
import pytest
import torch
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import Logger
from lightning.pytorch.plugins import Precision
from lightning.pytorch.plugins.layer_sync import LayerSync
from torch import nn
from torch.utils.data import DataLoader

import lightning_layerwise as llw
from _dist import counting_compiler, reference_threads, run_distributed
from helpers import WORLD, Core, Regressor, dataset, loaders, params_of, rel_err

TOL = 1e-5


# --- the strategy on a small regressor ------------------------------------------------------------------------------


def fit(strategy, model_kwargs, trainer_kwargs):
    model = Regressor(**model_kwargs)
    train, val = loaders()
    trainer = L.Trainer(
        accelerator="cpu", devices=WORLD, strategy=strategy, max_steps=8, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=2, val_check_interval=4, num_sanity_val_steps=1, **trainer_kwargs,
    )
    trainer.fit(model, train, val)
    return {n: p.detach().clone() for n, p in model.named_parameters()}, trainer


def _compare_worker(rank, world, model_kwargs, trainer_kwargs):
    torch.manual_seed(0)
    ddp_params, _ = fit("ddp", model_kwargs, trainer_kwargs)
    lw_params, trainer = fit("layerwise", model_kwargs, trainer_kwargs)
    plain = all(type(p.data) is torch.Tensor and p.data.untyped_storage().nbytes() == p.numel() * p.element_size()
                for p in trainer.lightning_module.parameters())
    return ddp_params, lw_params, plain


CASES = {
    "adamw": ({"optimizer": "adamw"}, {}),
    "muon": ({"optimizer": "muon"}, {}),
    "accumulate": ({"optimizer": "muon"}, {"accumulate_grad_batches": 2}),
    "clip_norm": ({"optimizer": "adamw"}, {"gradient_clip_val": 0.05, "gradient_clip_algorithm": "norm"}),
    "clip_value": ({"optimizer": "adamw"}, {"gradient_clip_val": 0.01, "gradient_clip_algorithm": "value"}),
    "bf16_mixed": ({"optimizer": "muon"}, {"precision": "bf16-mixed"}),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_layerwise_equals_ddp(case):
    model_kwargs, trainer_kwargs = CASES[case]
    # bf16 autocast rounds activations; the two strategies then differ by a few bf16 ulps
    tol = 2e-2 if case == "bf16_mixed" else 1e-5
    for ddp_params, lw_params, plain in run_distributed(_compare_worker, WORLD, model_kwargs, trainer_kwargs):
        assert plain, "after teardown, parameters own their storage again"
        moved = max(rel_err(lw_params[n], Regressor().state_dict()[n]) for n in lw_params)
        assert moved > 1e-3, "training changed the parameters"
        for n in ddp_params:
            assert rel_err(lw_params[n], ddp_params[n]) <= tol, (n, rel_err(lw_params[n], ddp_params[n]))


class NoTrainable(Regressor):
    def __init__(self):
        super().__init__()
        self.requires_grad_(False)


def _no_trainable_worker(rank, world):
    trainer = L.Trainer(accelerator="cpu", devices=WORLD, strategy="layerwise", max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    train, _ = loaders()
    try:
        trainer.fit(NoTrainable(), train)
    except ValueError as e:
        return str(e)
    return None


def test_model_without_trainable_parameters_is_a_clear_error():
    for message in run_distributed(_no_trainable_worker, WORLD):
        assert message and "no trainable parameter" in message


class OtherAccelerator(Accelerator):
    """An accelerator the strategy cannot serve (stands in for TPU/XLA, MPS, HPU)."""

    def setup_device(self, device):
        pass

    def teardown(self):
        pass

    @staticmethod
    def parse_devices(devices):
        return devices

    @staticmethod
    def get_parallel_devices(devices):
        return [torch.device("cpu")] * devices

    @staticmethod
    def auto_device_count():
        return 1

    @staticmethod
    def is_available():
        return True

    @staticmethod
    def name():
        return "other"

    def get_device_stats(self, device):
        return {}

    @classmethod
    def register_accelerators(cls, registry):
        pass


def test_unsupported_accelerator_is_rejected_at_trainer_construction():
    with pytest.raises(ValueError, match="OtherAccelerator"):
        L.Trainer(accelerator=OtherAccelerator(), devices=2, strategy="layerwise")


def test_strategy_names_are_registered():
    from lightning.pytorch.strategies import StrategyRegistry

    for name, method in [("layerwise", "popen"), ("layerwise_spawn", "spawn"), ("layerwise_fork", "fork"),
                         ("layerwise_notebook", "fork")]:
        assert name in StrategyRegistry
        strategy = StrategyRegistry.get(name)
        assert isinstance(strategy, llw.LayerwiseStrategy) and strategy._start_method == method


def _bf16_true_worker(rank, world, steps, owner_group_size="auto"):
    model = Regressor(optimizer="adamw")
    train, _ = loaders()
    info = {}

    class Inspect(L.Callback):
        def on_train_end(self, trainer, pl_module):
            masters = trainer.strategy.session.masters
            info["master_numel"] = masters.numel
            info["master_dtypes"] = {m.dtype for _, m in masters.pairs}
            opt = trainer.optimizers[0]
            info["optimizer_holds_masters"] = all(
                any(p is m for g in opt.param_groups for p in g["params"]) for _, m in masters.pairs)
            info["param_dtypes"] = {p.dtype for p in pl_module.parameters()}

    trainer = L.Trainer(accelerator="cpu", devices=world, max_steps=steps, logger=False,
                        strategy=llw.LayerwiseStrategy(owner_group_size=owner_group_size),
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        precision="bf16-true", callbacks=[Inspect()])
    trainer.fit(model, train)
    return {n: p.detach().float().clone() for n, p in model.named_parameters()}, info


def bf16_master_reference(steps: int, world: int = WORLD) -> dict[str, torch.Tensor]:
    """One process, bf16 model with float32 master weights stepped by AdamW.

    The gradient is formed as the ranks form it: each rank's batch (the
    DistributedSampler Lightning injects, shuffled with seed 0) backpropagates
    in bf16, and the float32 gradient buffer averages them.
    """
    from torch.utils.data import DistributedSampler

    model = Regressor(optimizer="adamw").to(torch.bfloat16)
    params = list(model.parameters())
    masters = [nn.Parameter(p.detach().float().clone()) for p in params]
    opt = torch.optim.AdamW(masters, lr=1e-2, weight_decay=0.1)
    data = loaders()[0].dataset
    orders = [list(DistributedSampler(data, num_replicas=world, rank=r, shuffle=True, seed=0)) for r in range(world)]
    for step in range(steps):
        grads = [torch.zeros_like(m) for m in masters]
        for rank in range(world):
            x, y = data[orders[rank][4 * step: 4 * step + 4]]
            loss = nn.functional.mse_loss(model(x.to(torch.bfloat16)), y.to(torch.bfloat16))
            loss.backward()
            for g, p in zip(grads, params):
                g += p.grad.float() / world
                p.grad = None
        for m, g in zip(masters, grads):
            m.grad = g
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for p, m in zip(params, masters):
                p.copy_(m)
    return {n: p.detach().float() for n, p in model.named_parameters()}


def test_bf16_true_keeps_float32_masters_for_owned_parameters_only():
    steps = 6
    results = run_distributed(_bf16_true_worker, WORLD, steps)
    total = sum(p.numel() for p in Regressor().parameters())
    with reference_threads():  # as in the workers: bf16 matmuls then round identically
        ref = bf16_master_reference(steps)
    assert sum(info["master_numel"] for _, info in results) == total, "each parameter has one master in the world"
    for params, info in results:
        assert info["master_dtypes"] == {torch.float32} and info["optimizer_holds_masters"]
        assert info["param_dtypes"] == {torch.bfloat16}
        assert info["master_numel"] < total
        for n, value in params.items():
            # Bit for bit: the same bf16 kernels on the same rows, and over 2 ranks the reduction's
            # (a + b) / 2 equals the reference's a / 2 + b / 2 exactly (halving is exact in binary).
            assert torch.equal(value, ref[n]), (n, rel_err(value, ref[n]))
    for n in results[0][0]:
        assert torch.equal(results[0][0][n], results[1][0][n])


@pytest.mark.slow
def test_bf16_true_masters_are_held_once_in_the_world_with_owner_groups():
    """4 ranks as 2 owner groups of 2 sharing the step (Note [replica sharing]): every parameter has one
    float32 master in the world, not one per group, and training matches one process. Not bitwise: the
    float32 mean is summed in another order ((a + b) + (c + d) against a + b + c + d), and a last-bit
    difference in a master may round its bf16 parameter one bf16 step apart (2^-8 relative)."""
    steps = 4
    results = run_distributed(_bf16_true_worker, 4, steps, 2)
    total = sum(p.numel() for p in Regressor().parameters())
    assert sum(info["master_numel"] for _, info in results) == total, "each parameter has one master in the world"
    with reference_threads():
        ref = bf16_master_reference(steps, world=4)
    for params, info in results:
        assert info["master_dtypes"] == {torch.float32} and info["optimizer_holds_masters"]
        for n, value in params.items():
            assert rel_err(value, ref[n]) <= 2 ** -8, (n, rel_err(value, ref[n]))
            assert torch.equal(value, results[0][0][n]), "every rank holds the same parameters"


def _live_groups() -> int:
    from torch.distributed import distributed_c10d

    return len(distributed_c10d._world.pg_map)


def _repeated_fit_worker(rank, world, fits):
    counts = [_live_groups()]
    for _ in range(fits):
        fit("layerwise", {"optimizer": "muon"}, {})
        counts.append(_live_groups())
    return counts


@pytest.mark.slow
def test_fits_in_one_process_leave_no_process_groups_behind():
    """Each fit creates its reduce-scatter and all-gather groups and destroys them at teardown.

    Before, five fits left ten live groups (and gloo threads) behind; one alive at interpreter exit
    could abort the process after a successful fit ("terminate called without an active exception").
    """
    for counts in run_distributed(_repeated_fit_worker, WORLD, 5):
        assert counts == [counts[0]] * 6, counts


class CustomPrecision(Precision):
    """A plugin kind the strategy cannot know how to clip across shards."""


def test_unsupported_precision_plugin_is_rejected_at_trainer_construction():
    with pytest.raises(ValueError, match=r"does not support the precision plugin CustomPrecision.*precision='32-true'"):
        L.Trainer(accelerator="cpu", devices=1, strategy=llw.LayerwiseStrategy(), plugins=[CustomPrecision()])


# --- element-wise fill settings -----------------------------------------------------------------


class SignSGD(torch.optim.Optimizer):
    """An optimizer the library does not know: element-wise, but only the user can say so."""

    def __init__(self, params, lr: float = 1e-2):
        super().__init__(params, {"lr": lr})

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.no_grad():
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.add_(p.grad.sign(), alpha=-group["lr"])
        return loss


class SignRegressor(Regressor):
    def configure_optimizers(self):
        return SignSGD(self.parameters())


def _fill_settings_worker(rank, world):
    out = {}
    for label, model_cls, kwargs in [
        ("default", Regressor, {}),
        ("off", Regressor, {"elementwise_fill": False}),
        ("unknown", SignRegressor, {}),
        ("declared", SignRegressor, {"elementwise_optimizers": [f"{__name__}.SignSGD"]}),
    ]:
        splits = []

        class Inspect(L.Callback):
            def on_train_start(self, trainer, pl_module):
                splits.extend(n for n, s in trainer.strategy.wrapper.layout.params.items() if s.split)

        params = {}
        for strategy in ("ddp", llw.LayerwiseStrategy(bucket_size=512, **kwargs)):
            model = model_cls()
            train, _ = loaders()
            callbacks = [Inspect()] if strategy != "ddp" else []
            L.Trainer(accelerator="cpu", devices=WORLD, strategy=strategy, max_steps=6, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=callbacks).fit(model, train)
            params[str(strategy)[:3]] = {n: p.detach().clone() for n, p in model.named_parameters()}
        out[label] = {"split": splits, "err": max(rel_err(params["ddp"][n], v) for n, v in params["<li"].items())}
    return out


@pytest.mark.slow
def test_elementwise_fill_follows_the_optimizer_and_the_strategy_arguments():
    """AdamW's parameters are split by default; `elementwise_fill=False` and an unknown optimizer keep
    whole ownership; `elementwise_optimizers` declares one. Every setting equals `ddp`."""
    result = run_distributed(_fill_settings_worker, WORLD)[0]
    assert result["default"]["split"] and result["declared"]["split"]
    assert result["off"]["split"] == [] and result["unknown"]["split"] == []
    for label, r in result.items():
        assert r["err"] <= 1e-5, (label, r["err"])


# --- owner groups ---------------------------------------------------------------------------------


def _owner_groups_worker(rank, world, optimizer, owner_group_size):
    sizes = []

    class Inspect(L.Callback):
        def on_train_start(self, trainer, pl_module):
            sizes.append(trainer.strategy.wrapper.ranks.owner_group_size)

    params = {}
    for strategy in ("ddp", llw.LayerwiseStrategy(owner_group_size=owner_group_size, bucket_size=512)):
        model = Regressor(optimizer)
        train, _ = loaders()
        L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=8, logger=False,
                  enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                  gradient_clip_val=0.05, accumulate_grad_batches=2,
                  callbacks=[] if strategy == "ddp" else [Inspect()]).fit(model, train)
        params["ddp" if strategy == "ddp" else "layerwise"] = {n: p.detach().clone()
                                                               for n, p in model.named_parameters()}
    return params, sizes


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_two_owner_groups_of_two_equal_ddp_with_accumulation_and_clipping(optimizer):
    results = run_distributed(_owner_groups_worker, 4, optimizer, 2)
    for rank, (params, sizes) in enumerate(results):
        assert sizes == [2], sizes
        for n, value in params["ddp"].items():
            assert rel_err(params["layerwise"][n], value) <= 1e-5, (rank, n, rel_err(params["layerwise"][n], value))
        for n, value in params["layerwise"].items():
            assert torch.equal(value, results[0][0]["layerwise"][n]), (rank, n)


# --- Lightning Trainer features: model, data, trainer -------------------------------------------------------------


class Net(L.LightningModule):
    """A small regressor; options select the feature under test."""

    def __init__(self, optimizer: str = "adamw", norm: str = "layer", scheduler: str | None = None,
                 manual: bool = False, clip: float | None = None, compile_inner: bool = False):
        super().__init__()
        self.optimizer_name, self.scheduler_name, self.clip = optimizer, scheduler, clip
        self.automatic_optimization = not manual
        torch.manual_seed(0)
        core = Core(norm)
        self.core = torch.compile(core) if compile_inner else core
        self.calls = {"train": 0, "val": 0, "test": 0, "predict": 0}

    def forward(self, x):
        return self.core(x)

    def training_step(self, batch, batch_idx):
        self.calls["train"] += 1
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        if self.clip is not None:
            self.clip_gradients(opt, gradient_clip_val=self.clip, gradient_clip_algorithm="norm")
        opt.step()
        return None

    def validation_step(self, batch, batch_idx):
        self.calls["val"] += 1
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y), sync_dist=True)
        self.log("val_samples", float(len(x)), reduce_fx="sum", sync_dist=True)

    def test_step(self, batch, batch_idx):
        self.calls["test"] += 1
        x, y = batch
        self.log("test_loss", nn.functional.l1_loss(self(x), y), sync_dist=True)
        self.log("test_samples", float(len(x)), reduce_fx="sum", sync_dist=True)

    def predict_step(self, batch, batch_idx):
        self.calls["predict"] += 1
        return self(batch[0])

    def configure_optimizers(self):
        if self.optimizer_name == "adamw":
            opt = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)
        else:
            opt = llw.Muon(llw.muon_param_groups(self), lr=0.02, adamw_lr=1e-2, ns_dtype=torch.float32)
        if self.scheduler_name is None:
            return opt
        if self.scheduler_name == "step":
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        else:
            sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[g["lr"] for g in opt.param_groups],
                                                        total_steps=8, cycle_momentum=False)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def train_loader(n: int = 32, batch_size: int = 4) -> DataLoader:
    """Sequential (no shuffle): with the distributed sampler every epoch shows each rank the same batches."""
    return DataLoader(dataset(n), batch_size=batch_size)


def make_trainer(strategy, root: str, **kwargs) -> L.Trainer:
    options = dict(accelerator="cpu", devices=WORLD, strategy=strategy, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                   default_root_dir=root)
    options.update(kwargs)
    return L.Trainer(**options)


def state_of(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n.replace("_orig_mod.", ""): t.detach().clone() for n, t in module.state_dict().items()}


def assert_close_dicts(actual: dict, expected: dict, tol: float = TOL, what: str = "") -> None:
    assert actual.keys() == expected.keys(), (what, sorted(actual), sorted(expected))
    for k in expected:
        if torch.is_tensor(expected[k]) and expected[k].is_floating_point():
            err = rel_err(actual[k], expected[k])
            assert err <= tol, (what, k, err)
        elif torch.is_tensor(expected[k]):
            assert torch.equal(actual[k], expected[k]), (what, k, actual[k], expected[k])
        else:
            assert actual[k] == pytest.approx(expected[k], rel=tol, abs=1e-7), (what, k, actual[k], expected[k])


def assert_trained(after: dict, what: str = "") -> None:
    initial = params_of(Net())
    assert max(rel_err(after[n], initial[n]) for n in initial) > 1e-3, f"{what}: training changed nothing"


def owns_storage(module: nn.Module) -> bool:
    return all(type(p.data) is torch.Tensor and p.data.untyped_storage().nbytes() == p.numel() * p.element_size()
               for p in module.parameters())


# --- 1. checkpoint and resume ---------------------------------------------------------------------------------------

class OptimizerStateProbe(L.Callback):
    """Records which parameters the (raw) optimizer keeps state for, right after the restore and at the end."""

    def __init__(self):
        self.records = {}

    def _record(self, trainer, pl_module, when):
        opt = trainer.strategy.optimizers[0]
        wrapper = trainer.strategy.wrapper
        names = {p: n for n, p in pl_module.named_parameters()}
        self.records[when] = {
            "state_names": sorted(names[p] for p in opt.state),
            "owned_names": sorted(n for p, n in names.items() if wrapper is not None and wrapper.records.owns(p)),
            "wrapped": wrapper is not None,
            "order": [names[p] for g in opt.param_groups for p in g["params"]],  # state_dict indices
            "state": {names[p]: {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in s.items()}
                      for p, s in opt.state.items()},
        }

    def on_train_start(self, trainer, pl_module):
        self._record(trainer, pl_module, "start")

    def on_train_end(self, trainer, pl_module):
        self._record(trainer, pl_module, "end")


def _ckpt_callback(dirpath: str) -> ModelCheckpoint:
    return ModelCheckpoint(dirpath=dirpath, filename="{step}", every_n_train_steps=4, save_top_k=-1)


def _load(path: str) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)


RESUME_SCHEDULER = {"adamw": "step", "muon": "onecycle"}


def _resume_worker(rank, world, root, optimizer):
    out = {}
    scheduler = RESUME_SCHEDULER[optimizer]
    # Reference: ddp, 8 steps, a checkpoint every 4 steps.
    ddp_dir = os.path.join(root, f"ddp_{optimizer}")
    model = Net(optimizer, scheduler=scheduler)
    make_trainer("ddp", root, max_steps=8, enable_checkpointing=True,
                 callbacks=[_ckpt_callback(ddp_dir)]).fit(model, train_loader())
    out["ddp"] = params_of(model)

    # Layerwise, 8 steps without interruption.
    model = Net(optimizer, scheduler=scheduler)
    make_trainer("layerwise", root, max_steps=8).fit(model, train_loader())
    out["lw8"] = params_of(model)

    # Layerwise, 4 steps; ModelCheckpoint writes during fit, save_checkpoint after fit (wrapper released).
    # One full file, to compare with ddp's (tests/checkpoint/test_checkpoint_resharding.py covers both formats).
    lw_dir = os.path.join(root, f"lw_{optimizer}")
    model = Net(optimizer, scheduler=scheduler)
    trainer = make_trainer(llw.LayerwiseStrategy(checkpoint_format="full"), root, max_steps=4,
                           enable_checkpointing=True,
                           callbacks=[_ckpt_callback(lw_dir)])
    trainer.fit(model, train_loader())
    after_fit = os.path.join(lw_dir, "after_fit.ckpt")
    trainer.save_checkpoint(after_fit)
    out["lw4"] = params_of(model)
    out["files"] = sorted(os.path.basename(f) for f in glob.glob(os.path.join(lw_dir, "*.ckpt")))

    # A new Trainer resumes from the step-4 checkpoint for 4 more steps.
    probe = OptimizerStateProbe()
    model = Net(optimizer, scheduler=scheduler)
    trainer = make_trainer("layerwise", root, max_steps=8, callbacks=[probe])
    trainer.fit(model, train_loader(), ckpt_path=os.path.join(lw_dir, "step=4.ckpt"))
    out["resumed"] = params_of(model)
    out["resumed_step"] = trainer.global_step
    out["probe"] = probe.records
    out["n_params"] = sum(1 for p in model.parameters() if p.requires_grad)
    if rank == 0:
        out["ckpt_lw"] = _load(os.path.join(lw_dir, "step=4.ckpt"))
        out["ckpt_lw_after_fit"] = _load(after_fit)
        out["ckpt_ddp"] = _load(os.path.join(ddp_dir, "step=4.ckpt"))
    return out


def _assert_same_optimizer_state(actual: dict, expected: dict, what: str) -> None:
    assert sorted(actual["state"]) == sorted(expected["state"]), what
    for idx, entry in expected["state"].items():
        assert sorted(actual["state"][idx]) == sorted(entry), (what, idx)
        for key, value in entry.items():
            got = actual["state"][idx][key]
            if torch.is_tensor(value) and value.numel() > 1:
                assert rel_err(got, value) <= TOL, (what, idx, key, rel_err(got, value))
            else:
                assert float(got) == pytest.approx(float(value), rel=TOL), (what, idx, key)
    assert [{k: v for k, v in g.items() if k != "params"} for g in actual["param_groups"]] == \
           [{k: v for k, v in g.items() if k != "params"} for g in expected["param_groups"]], what


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_checkpoint_and_resume_equal_an_uninterrupted_run_and_ddp(optimizer, tmp_path):
    results = run_distributed(_resume_worker, WORLD, str(tmp_path), optimizer)
    n_params = results[0]["n_params"]
    owned_by_rank = [set(r["probe"]["start"]["owned_names"]) for r in results]
    assert set.union(*owned_by_rank) == set(results[0]["lw8"]), "every parameter has an owner"
    assert sum(len(o) for o in owned_by_rank) == n_params, "and exactly one"
    assert all(owned_by_rank), "both ranks own something (else the pruning check proves nothing)"

    for rank, r in enumerate(results):
        assert r["files"] == ["after_fit.ckpt", "step=4.ckpt"], r["files"]
        assert r["resumed_step"] == 8
        assert_trained(r["lw8"], "layerwise 8 steps")
        assert_close_dicts(r["lw8"], r["ddp"], what=f"rank {rank}: 8 layerwise steps vs ddp")
        assert_close_dicts(r["resumed"], r["lw8"], what=f"rank {rank}: 4 + 4 resumed vs 8 uninterrupted")
        assert_close_dicts(r["resumed"], r["ddp"], what=f"rank {rank}: 4 + 4 resumed vs ddp")
        for when in ("start", "end"):
            rec = r["probe"][when]
            assert rec["wrapped"], when
            # After the load each rank keeps the state of the parameters it owns, and only those.
            assert rec["state_names"] == rec["owned_names"], (rank, when, rec["state_names"], rec["owned_names"])

    ckpt, after_fit, ddp_ckpt = results[0]["ckpt_lw"], results[0]["ckpt_lw_after_fit"], results[0]["ckpt_ddp"]
    # ddp keys the state by position in the param groups, layerwise by parameter name.
    order = results[0]["probe"]["start"]["order"]
    ddp_named = dict(ddp_ckpt["optimizer_states"][0],
                     state={order[i]: v for i, v in ddp_ckpt["optimizer_states"][0]["state"].items()})
    assert [n for g in ckpt["optimizer_states"][0]["param_groups"] for n in g["params"]] == order
    assert ckpt["global_step"] == ddp_ckpt["global_step"] == 4
    assert ckpt["lr_schedulers"] == ddp_ckpt["lr_schedulers"] and len(ckpt["lr_schedulers"]) == 1
    # The file holds the FULL optimizer state: one entry for every parameter (all of them had gradients) ...
    assert len(ckpt["optimizer_states"]) == 1
    assert len(ckpt["optimizer_states"][0]["state"]) == n_params
    assert len(after_fit["optimizer_states"][0]["state"]) == n_params
    # ... equal to ddp's (which every rank holds whole), written during fit and after it.
    _assert_same_optimizer_state(ckpt["optimizer_states"][0], ddp_named, "ModelCheckpoint")
    _assert_same_optimizer_state(after_fit["optimizer_states"][0], ddp_named, "save_checkpoint after fit")
    assert_close_dicts(ckpt["state_dict"], ddp_ckpt["state_dict"], what="model weights in the checkpoint")
    assert_close_dicts(ckpt["state_dict"], results[0]["lw4"], what="checkpoint weights are the current parameters")
    # The state restored on each rank is the checkpoint's, for its owned parameters.
    for r in results:
        for name, entry in r["probe"]["start"]["state"].items():
            saved = ckpt["optimizer_states"][0]["state"][name]
            for key, value in entry.items():
                if torch.is_tensor(value) and value.numel() > 1:
                    assert torch.equal(value, saved[key]), (name, key)


# --- 2. LR scheduler and LearningRateMonitor ------------------------------------------------------------------------

class MemoryLogger(Logger):
    def __init__(self):
        super().__init__()
        self.logged: list[tuple[int, dict]] = []

    @property
    def name(self):
        return "memory"

    @property
    def version(self):
        return 0

    def log_hyperparams(self, params, *args, **kwargs):
        pass

    def log_metrics(self, metrics, step=None):
        self.logged.append((step, dict(metrics)))


def _scheduler_worker(rank, world, root):
    out = {}
    for optimizer, scheduler in (("adamw", "step"), ("muon", "onecycle")):
        for strategy in ("ddp", "layerwise"):
            model = Net(optimizer, scheduler=scheduler)
            logger = MemoryLogger()
            trainer = make_trainer(strategy, root, max_steps=8, logger=logger, log_every_n_steps=1,
                                   callbacks=[LearningRateMonitor(logging_interval="step")])
            trainer.fit(model, train_loader())
            lrs = [(step, {k: v for k, v in m.items() if k.startswith("lr-")}) for step, m in logger.logged]
            out[(optimizer, strategy)] = {
                "params": params_of(model),
                "lrs": [(s, m) for s, m in lrs if m],
                "final_lr": [g["lr"] for g in trainer.optimizers[0].param_groups],
            }
    return out


def test_lr_scheduler_and_lr_monitor_match_ddp(tmp_path):
    for rank, out in enumerate(run_distributed(_scheduler_worker, WORLD, str(tmp_path))):
        for optimizer in ("adamw", "muon"):
            ddp, lw = out[(optimizer, "ddp")], out[(optimizer, "layerwise")]
            assert len(ddp["lrs"]) == 8, ddp["lrs"]
            keys = set(ddp["lrs"][0][1])
            assert len(keys) == (1 if optimizer == "adamw" else 2), keys  # Muon: one lr per param group
            values = [v for _, m in ddp["lrs"] for v in m.values()]
            assert len(set(values)) > 2, "the scheduler changed the lr"
            assert [s for s, _ in lw["lrs"]] == [s for s, _ in ddp["lrs"]]
            for (_, got), (_, want) in zip(lw["lrs"], ddp["lrs"]):
                assert got.keys() == want.keys()
                for k in want:  # the same scheduler arithmetic on the same Python floats
                    assert got[k] == want[k], (rank, optimizer, k)
            assert lw["final_lr"] == ddp["final_lr"]
            assert_trained(lw["params"], optimizer)
            assert_close_dicts(lw["params"], ddp["params"], what=f"rank {rank} {optimizer}")


# --- 3. BatchNorm: plain, synchronised through a LayerSync plugin, sync_batchnorm=True -----------------------------

class CPUSyncBatchNorm1d(nn.BatchNorm1d):
    """BatchNorm over the global batch, with an autograd-aware all-reduce (works on CPU/gloo).

    ``torch.nn.SyncBatchNorm`` (what ``sync_batchnorm=True`` installs) refuses CPU tensors,
    so this layer checks the strategy's handling of a synchronising ``LayerSync`` plugin.
    """

    def forward(self, x):
        if not self.training:
            return super().forward(x)
        from torch.distributed.nn.functional import all_reduce

        c = x.shape[1]
        local = torch.cat([x.sum(0), (x * x).sum(0), x.new_full((1,), float(x.shape[0]))])
        total = all_reduce(local)
        count = total[-1]
        mean = total[:c] / count
        var = total[c:2 * c] / count - mean * mean
        with torch.no_grad():
            self.num_batches_tracked += 1
            self.running_mean.mul_(1 - self.momentum).add_(self.momentum * mean)
            self.running_var.mul_(1 - self.momentum).add_(self.momentum * var * count / (count - 1))
        return (x - mean) / torch.sqrt(var + self.eps) * self.weight + self.bias


class CPUSyncBatchNormPlugin(LayerSync):
    def apply(self, model):
        for m in model.modules():
            if type(m) is nn.BatchNorm1d:
                m.__class__ = CPUSyncBatchNorm1d
        return model

    def revert(self, model):
        for m in model.modules():
            if type(m) is CPUSyncBatchNorm1d:
                m.__class__ = nn.BatchNorm1d
        return model


class NormClassProbe(L.Callback):
    """The class of the model's norm layer while training (Lightning reverts a LayerSync at teardown)."""

    def on_train_start(self, trainer, pl_module):
        self.seen = type(pl_module.core.body[2]).__name__


def _batchnorm_worker(rank, world, root):
    out = {}
    for variant in ("plain", "layer_sync"):
        for strategy in ("ddp", "layerwise"):
            model = Net(norm="batch")
            plugins = [CPUSyncBatchNormPlugin()] if variant == "layer_sync" else []
            probe = NormClassProbe()
            make_trainer(strategy, root, max_steps=6, plugins=plugins, callbacks=[probe]).fit(model, train_loader())
            out[(variant, strategy)] = {"state": state_of(model), "bn_class": probe.seen,
                                        "bn_class_after": type(model.core.body[2]).__name__}
    # sync_batchnorm=True installs torch.nn.SyncBatchNorm, which runs on GPUs only.
    for strategy in ("ddp", "layerwise"):
        model = Net(norm="batch")
        probe = NormClassProbe()
        try:
            make_trainer(strategy, root, max_steps=2, sync_batchnorm=True, callbacks=[probe]).fit(
                model, train_loader())
            error = None
        except ValueError as e:
            error = str(e)
        out[("sync_batchnorm", strategy)] = {"error": error, "bn_class": getattr(probe, "seen", None),
                                             "plain": owns_storage(model), "state": state_of(model)}
    return out


def test_batchnorm_and_sync_batchnorm_match_ddp(tmp_path):
    results = run_distributed(_batchnorm_worker, WORLD, str(tmp_path))
    for rank, out in enumerate(results):
        for variant in ("plain", "layer_sync"):
            ddp, lw = out[(variant, "ddp")], out[(variant, "layerwise")]
            assert lw["bn_class"] == ddp["bn_class"]
            assert_trained({k: v for k, v in lw["state"].items() if k in params_of(Net())}, variant)
            # Parameters and the running statistics (broadcast from rank 0 before each forward, as ddp does).
            assert_close_dicts(lw["state"], ddp["state"], what=f"rank {rank} {variant}")
        assert out[("layer_sync", "layerwise")]["bn_class"] == "CPUSyncBatchNorm1d"
        assert out[("layer_sync", "layerwise")]["bn_class_after"] == "BatchNorm1d", "reverted at teardown"
        sync_rm = out[("layer_sync", "layerwise")]["state"]["core.body.2.running_mean"]
        plain_rm = out[("plain", "layerwise")]["state"]["core.body.2.running_mean"]
        assert rel_err(sync_rm, plain_rm) > 1e-3, "synchronised statistics differ from per-rank ones"
        # On CPU both refuse torch.nn.SyncBatchNorm with a ValueError on every rank (no hang): ddp when
        # DistributedDataParallel wraps the model ("SyncBatchNorm layers only work with GPU modules"),
        # layerwise only at the first training forward, from torch's SyncBatchNorm.forward.
        ddp_err, lw_err = out[("sync_batchnorm", "ddp")]["error"], out[("sync_batchnorm", "layerwise")]["error"]
        assert ddp_err is not None and "SyncBatchNorm layers only work with GPU modules" in ddp_err, ddp_err
        assert lw_err is not None and "SyncBatchNorm expected input tensor to be on GPU" in lw_err, lw_err
        assert out[("sync_batchnorm", "layerwise")]["bn_class"] == "SyncBatchNorm", "the layers were converted"
        assert out[("sync_batchnorm", "layerwise")]["plain"], "a failed fit still releases the flat buffers"
    # With global statistics every rank updates the running stats identically; per-rank ones differ.
    for strategy in ("ddp", "layerwise"):
        a, b = (r[("layer_sync", strategy)]["state"] for r in results)
        assert torch.allclose(a["core.body.2.running_mean"], b["core.body.2.running_mean"], rtol=1e-5, atol=1e-7)
        a, b = (r[("plain", strategy)]["state"] for r in results)
        assert not torch.allclose(a["core.body.2.running_mean"], b["core.body.2.running_mean"], rtol=1e-5, atol=1e-7)


# --- 4. validate / test / predict, with uneven batch counts -------------------------------------------------------

def _eval_loaders(rank: int) -> dict[str, DataLoader]:
    """Rank 0 gets 5 samples (3 batches of 2), rank 1 gets 3 (2 batches): uneven batch counts."""
    data = dataset(8, seed=7)
    mine = torch.utils.data.Subset(data, range(5) if rank == 0 else range(5, 8))
    return {"val": DataLoader(mine, batch_size=2), "test": DataLoader(mine, batch_size=2),
            "predict": DataLoader(mine, batch_size=2)}


def _rank_train_loader(rank: int) -> DataLoader:
    data = dataset(32)
    return DataLoader(torch.utils.data.Subset(data, range(rank, 32, WORLD)), batch_size=4)


def _scalars(metrics_list) -> list[dict]:
    return [{k: float(v) for k, v in m.items()} for m in metrics_list]


def _evaluate(trainer, model, loaders):
    return {
        "validate": _scalars(trainer.validate(model, loaders["val"], verbose=False)),
        "test": _scalars(trainer.test(model, loaders["test"], verbose=False)),
        "predict": [p.clone() for p in trainer.predict(model, loaders["predict"])],
    }


def _eval_worker(rank, world, root):
    loaders = _eval_loaders(rank)
    out = {}
    for strategy in ("ddp", "layerwise"):
        res = {}
        # Standalone, without fit (the strategy does not wrap the model for evaluation).
        model = Net()
        res["standalone"] = _evaluate(make_trainer(strategy, root, use_distributed_sampler=False), model, loaders)
        res["standalone_calls"] = dict(model.calls)
        # Fit with validation during fit (uneven batches, sanity check included), then evaluate with that Trainer.
        model = Net()
        trainer = make_trainer(strategy, root, max_steps=6, use_distributed_sampler=False, val_check_interval=2,
                               num_sanity_val_steps=2)
        trainer.fit(model, _rank_train_loader(rank), loaders["val"])
        res["fit_val"] = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val")}
        res["fit_calls"] = dict(model.calls)
        res["after_fit"] = _evaluate(trainer, model, loaders)
        res["params"] = params_of(model)
        # What the final parameters give on this rank's data, by plain forward.
        with torch.no_grad():
            model.eval()
            x, y = next(iter(DataLoader(loaders["val"].dataset, batch_size=8)))
            res["local_mse"] = float(nn.functional.mse_loss(model(x), y))
        out[strategy] = res
    return out


def test_validate_test_predict_match_ddp_with_uneven_batches(tmp_path):
    results = run_distributed(_eval_worker, WORLD, str(tmp_path), timeout=180)
    for rank, out in enumerate(results):
        ddp, lw = out["ddp"], out["layerwise"]
        n_batches = 3 if rank == 0 else 2
        assert lw["standalone_calls"] == ddp["standalone_calls"] == {
            "train": 0, "val": n_batches, "test": n_batches, "predict": n_batches}
        # 6 train steps; 2 sanity + 3 validations of all batches (2 sanity ones on each rank)
        assert lw["fit_calls"] == ddp["fit_calls"], (lw["fit_calls"], ddp["fit_calls"])
        assert lw["fit_calls"]["train"] == 6 and lw["fit_calls"]["val"] == 2 + 3 * n_batches
        assert_trained(lw["params"])
        assert_close_dicts(lw["params"], ddp["params"], what=f"rank {rank} params")
        assert lw["fit_val"].keys() == {"val_loss", "val_samples"}
        assert_close_dicts(lw["fit_val"], ddp["fit_val"], what="validation during fit")
        for phase in ("standalone", "after_fit"):
            for kind in ("validate", "test"):
                assert len(lw[phase][kind]) == 1
                assert_close_dicts(lw[phase][kind][0], ddp[phase][kind][0], what=f"{phase} {kind}")
                assert lw[phase][kind][0][f"{kind.replace('validate', 'val')}_samples"] == 8.0  # 5 + 3 samples
            assert len(lw[phase]["predict"]) == len(ddp[phase]["predict"]) == n_batches
            for got, want in zip(lw[phase]["predict"], ddp[phase]["predict"]):
                assert got.shape == want.shape and rel_err(got, want) <= TOL, phase
        assert rel_err(torch.tensor(lw["standalone"]["validate"][0]["val_loss"]),
                       torch.tensor(lw["after_fit"]["validate"][0]["val_loss"])) > 1e-3, "fit changed the metric"
    # sync_dist: every rank logs the same value.
    for strategy in ("ddp", "layerwise"):
        values = [r[strategy]["after_fit"]["validate"][0]["val_loss"] for r in results]
        assert values[0] == values[1]  # one all-reduce, the same result on every rank
        # Lightning weights each batch by its size, over all ranks: (5 * loss_0 + 3 * loss_1) / 8.
        expected = (5 * results[0][strategy]["local_mse"] + 3 * results[1][strategy]["local_mse"]) / 8
        assert values[0] == pytest.approx(expected, rel=1e-5)


# --- 5. fast_dev_run and max_steps ---------------------------------------------------------------------------------

def _stopping_worker(rank, world, root):
    out = {}
    for strategy in ("ddp", "layerwise"):
        model = Net()
        trainer = make_trainer(strategy, root, fast_dev_run=True)
        trainer.fit(model, train_loader(), DataLoader(dataset(8, seed=7), batch_size=2))
        out[("fast_dev_run", strategy)] = {"params": params_of(model), "calls": dict(model.calls),
                                           "step": trainer.global_step, "epoch": trainer.current_epoch}
        # 4 batches per epoch and rank: max_steps=6 stops in the middle of the second epoch.
        model = Net("muon")
        trainer = make_trainer(strategy, root, max_steps=6, max_epochs=5)
        trainer.fit(model, train_loader())
        out[("max_steps", strategy)] = {"params": params_of(model), "calls": dict(model.calls),
                                        "step": trainer.global_step, "epoch": trainer.current_epoch}
    return out


def test_fast_dev_run_and_max_steps_stop_where_ddp_stops(tmp_path):
    for rank, out in enumerate(run_distributed(_stopping_worker, WORLD, str(tmp_path))):
        for case, step, train_calls, val_calls in (("fast_dev_run", 1, 1, 1), ("max_steps", 6, 6, 0)):
            ddp, lw = out[(case, "ddp")], out[(case, "layerwise")]
            assert ddp["step"] == lw["step"] == step, (case, ddp["step"], lw["step"])
            assert ddp["epoch"] == lw["epoch"], case
            assert lw["calls"] == ddp["calls"]
            assert lw["calls"]["train"] == train_calls and lw["calls"]["val"] == val_calls, (case, lw["calls"])
            assert_trained(lw["params"], case)
            assert_close_dicts(lw["params"], ddp["params"], what=f"rank {rank} {case}")


# --- 6 and 7. manual optimization, with clip_gradients ----------------------------------------------------------------

def _manual_worker(rank, world, root):
    out = {}
    for optimizer, clip in (("adamw", None), ("adamw", 0.05), ("muon", 0.05)):
        for strategy in ("ddp", "layerwise"):
            model = Net(optimizer, manual=True, clip=clip)
            make_trainer(strategy, root, max_steps=6).fit(model, train_loader())
            out[(optimizer, clip, strategy)] = {"params": params_of(model), "calls": model.calls["train"]}
    return out


def test_manual_optimization_and_clip_gradients_match_ddp(tmp_path):
    for rank, out in enumerate(run_distributed(_manual_worker, WORLD, str(tmp_path))):
        for optimizer, clip in (("adamw", None), ("adamw", 0.05), ("muon", 0.05)):
            ddp, lw = out[(optimizer, clip, "ddp")], out[(optimizer, clip, "layerwise")]
            assert ddp["calls"] == lw["calls"] == 6
            assert_trained(lw["params"], f"manual {optimizer} clip={clip}")
            assert_close_dicts(lw["params"], ddp["params"], what=f"rank {rank} manual {optimizer} clip={clip}")
        clipped, unclipped = out[("adamw", 0.05, "layerwise")]["params"], out[("adamw", None, "layerwise")]["params"]
        assert max(rel_err(clipped[n], unclipped[n]) for n in clipped) > 1e-3, "clipping was active"


# --- 8. teardown ---------------------------------------------------------------------------------------------------

def _teardown_worker(rank, world, root):
    out = {}
    x = dataset(6, seed=3).tensors[0]
    for strategy in ("ddp", "layerwise"):
        model = Net("muon")
        make_trainer(strategy, root, max_steps=4).fit(model, train_loader())
        res = {
            "plain": owns_storage(model),
            "main_grad": any(hasattr(p, "main_grad") for p in model.parameters()),
            "grad_ok": all(p.grad is None or (type(p.grad) is torch.Tensor and p.grad.shape == p.shape
                                              and p.grad.untyped_storage().nbytes() >= p.numel() * p.element_size())
                           for p in model.parameters()),
            "hooks": sum(len(m._forward_pre_hooks) for m in model.modules()),
            "params1": params_of(model),
        }
        with torch.no_grad():
            res["forward1"] = model(x)
        # A second fit with a new Trainer on the same module.
        make_trainer(strategy, root, max_steps=4).fit(model, train_loader())
        res["params2"] = params_of(model)
        res["plain2"] = owns_storage(model)
        with torch.no_grad():
            res["forward2"] = model(x)
        # A plain backward on the module (no stale hooks or views) gives the gradients ddp gives.
        model.train()
        model.zero_grad(set_to_none=True)
        loss = model(x).square().mean()
        loss.backward()
        res["grads_after"] = {n: p.grad.clone() for n, p in model.named_parameters()}
        out[strategy] = res
    return out


def test_teardown_leaves_an_ordinary_module_that_fits_again(tmp_path):
    for rank, out in enumerate(run_distributed(_teardown_worker, WORLD, str(tmp_path))):
        ddp, lw = out["ddp"], out["layerwise"]
        assert lw["plain"] and lw["plain2"], "parameters own their storage after fit"
        assert not lw["main_grad"], "no main_grad left on parameters"
        assert lw["grad_ok"]
        assert lw["hooks"] == ddp["hooks"] == 0, "no forward pre-hooks left"
        assert_trained(lw["params1"])
        assert_close_dicts(lw["params1"], ddp["params1"], what=f"rank {rank} first fit")
        assert rel_err(lw["forward1"], ddp["forward1"]) <= TOL
        assert max(rel_err(lw["params2"][n], lw["params1"][n]) for n in lw["params1"]) > 1e-3, "second fit trained"
        assert_close_dicts(lw["params2"], ddp["params2"], what=f"rank {rank} second fit")
        assert rel_err(lw["forward2"], ddp["forward2"]) <= TOL
        assert_close_dicts(lw["grads_after"], ddp["grads_after"], what="plain backward after fit")


# --- 9. torch.compile ----------------------------------------------------------------------------------------------

def _compiled_fit(strategy, root, variant):
    model = Net(compile_inner=(variant == "inner"))
    fit_model = torch.compile(model) if variant == "module" else model
    trainer = make_trainer(strategy, root, max_steps=5)
    trainer.fit(fit_model, train_loader())
    return {"params": params_of(model), "step": trainer.global_step, "calls": model.calls["train"]}


def _compile_worker(rank, world, root):
    torch._dynamo.reset()
    out = {}
    for variant in ("inner", "module"):
        # layerwise first: dynamo traces the model with the wrapper's forward pre-hooks in place.
        for strategy in ("layerwise", "ddp"):
            out[(variant, strategy)] = _compiled_fit(strategy, root, variant)
    return out


@pytest.mark.slow
def test_torch_compile_matches_ddp(tmp_path):
    """A compiled submodule (``self.core = torch.compile(Core())``) and ``trainer.fit(torch.compile(model))``.

    Fails today: tracing the wrapper's forward pre-hook makes dynamo wrap the
    ``LayerwiseDataParallel`` module, whose ``_buffers`` attribute (a list of FlatBuffers)
    shadows ``nn.Module._buffers``, so ``named_buffers()`` raises
    ``InternalTorchDynamoError: AttributeError: 'list' object has no attribute 'items'``
    (see ``test_wrapper_keeps_the_nn_module_api``).
    """
    for rank, out in enumerate(run_distributed(_compile_worker, WORLD, str(tmp_path), timeout=400)):
        for variant in ("inner", "module"):
            ddp, lw = out[(variant, "ddp")], out[(variant, "layerwise")]
            assert ddp["step"] == lw["step"] == 5
            assert ddp["calls"] == lw["calls"] == 5
            assert_trained(lw["params"], variant)
            assert_close_dicts(lw["params"], ddp["params"], what=f"rank {rank} compiled {variant}")


SMALL_BUCKETS = 512  # ~2000 trainable elements: several buckets, more than prefetch_depth=2


def _compile_cached_worker(rank, world, root):
    torch._dynamo.reset()
    out = {}
    for strategy in ("ddp", "layerwise"):  # control: eager, small buckets
        model = Net()
        make_trainer(strategy if strategy == "ddp" else llw.LayerwiseStrategy(bucket_size=SMALL_BUCKETS), root,
                     max_steps=5).fit(model, train_loader())
        out[("eager", strategy)] = params_of(model)
    for strategy in ("ddp", "layerwise"):  # ddp compiles Core.forward first, without any forward pre-hook
        model = Net(compile_inner=True)
        make_trainer(strategy if strategy == "ddp" else llw.LayerwiseStrategy(bucket_size=SMALL_BUCKETS), root,
                     max_steps=5).fit(model, train_loader())
        out[("compiled", strategy)] = params_of(model)
    return out


@pytest.mark.slow
def test_torch_compile_reusing_code_compiled_without_the_wrappers_hooks(tmp_path):
    """Layerwise after dynamo already compiled the model's forward in this process (here under ddp).

    Dynamo does not guard on nn.Module hooks (``torch._dynamo.config.skip_nnmodule_hook_guards``
    is True by default), so the cached graph runs without the wrapper's forward pre-hooks:
    nothing waits for (or dispatches, past ``prefetch_depth``) the parameter all-gathers, and
    the forward reads the previous step's values of parameters owned by the other rank.
    Fails today (silently wrong parameters, no error).
    """
    for rank, out in enumerate(run_distributed(_compile_cached_worker, WORLD, str(tmp_path), timeout=400)):
        assert_trained(out[("eager", "layerwise")])
        assert_close_dicts(out[("eager", "layerwise")], out[("eager", "ddp")], what=f"rank {rank} eager control")
        assert_close_dicts(out[("compiled", "ddp")], out[("eager", "ddp")], tol=1e-5, what="compiled ddp")
        assert_close_dicts(out[("compiled", "layerwise")], out[("compiled", "ddp")],
                           what=f"rank {rank} compiled layerwise after an earlier compile")


class CompiledInner(L.LightningModule):
    """A LightningModule whose network is ``torch.compile``d: the strategy wraps the module and its forward pre-hooks
    run inside the compiled network (two processes: one registers none)."""

    def __init__(self, backend):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.compile(nn.Sequential(nn.Linear(7, 16), nn.ReLU(), nn.Linear(16, 3)), backend=backend,
                                 fullgraph=True)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _compile_count_worker(rank, world):
    backend, graphs = counting_compiler()

    model = CompiledInner(backend)
    before = [p.detach().clone() for p in model.parameters()]
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy="layerwise", max_steps=4, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, loaders()[0])
    moved = all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    return len(graphs), moved


def test_a_compiled_inner_module_compiles_once():
    """Note [compiled pre-hooks] (param_sync.py): the forward pre-hooks guard only on a state that is the same at every
    synced forward, so 4 steps compile the network once, as one graph (fullgraph=True: the hooks break no graph)."""
    for rank, (compiles, moved) in enumerate(run_distributed(_compile_count_worker, WORLD)):
        assert moved, rank
        assert compiles == 1, f"rank {rank}: the network compiled {compiles} times in 4 steps"


# --- more: the wrapper as an nn.Module; parameters seen by callbacks ------------------------------------------------

def test_wrapper_keeps_the_nn_module_api():
    """``LayerwiseDataParallel`` is an ``nn.Module``; its module-API methods must keep working.

    Fails today: ``LayerwiseDataParallel.__init__`` assigns ``self._buffers = allocate_buffers(...)``
    (a list), overwriting ``nn.Module._buffers`` (the dict of registered buffers), so
    ``named_buffers()``, ``buffers()``, ``state_dict()``, ``.to()``/``.float()`` raise
    ``AttributeError: 'list' object has no attribute 'items'``, and so does torch.compile
    when it traces a forward pre-hook that refers to the wrapper.
    """
    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    expected_state = {k: v.clone() for k, v in inner.state_dict().items()}
    wrapper = llw.LayerwiseDataParallel(inner, process_groups=llw.ProcessGroups.single())
    assert [n for n, _ in wrapper.named_buffers()] == [
        "module.1.running_mean", "module.1.running_var", "module.1.num_batches_tracked"]
    assert len(list(wrapper.buffers())) == 3
    state = wrapper.state_dict()
    assert_close_dicts({k.removeprefix("module."): v for k, v in state.items()}, expected_state)
    assert wrapper.float() is wrapper and wrapper.to(torch.device("cpu")) is wrapper
    out = wrapper(torch.randn(5, 3))
    assert out.shape == (5, 4)


class ParamRecorder(L.Callback):
    """What a callback (EMA, SWA, weight logging...) sees of the parameters between optimizer steps."""

    def __init__(self):
        self.seen: list[tuple[str, dict]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.seen.append((f"batch_end {batch_idx}", params_of(pl_module)))

    def on_train_epoch_end(self, trainer, pl_module):
        self.seen.append((f"epoch_end {trainer.current_epoch}", params_of(pl_module)))


def _callback_worker(rank, world, root):
    out = {}
    for name, strategy in (("ddp", "ddp"), ("layerwise", "layerwise"),
                           ("layerwise_small_buckets", llw.LayerwiseStrategy(bucket_size=SMALL_BUCKETS))):
        recorder = ParamRecorder()
        model = Net()
        make_trainer(strategy, root, max_steps=6, callbacks=[recorder]).fit(model, train_loader())
        out[name] = recorder.seen
    return out


def test_callbacks_see_the_current_parameters(tmp_path):
    """``on_train_batch_end``/``on_train_epoch_end`` callbacks read the parameters just stepped.

    Fails today: after ``optimizer.step`` the strategy only *starts* the all-gather
    (``start_param_sync``); it is awaited by the next forward's pre-hooks. Between the two,
    parameters owned by another rank still hold the previous step's values (buckets past
    ``prefetch_depth`` are not even dispatched, the others race with the gloo thread), so
    Lightning's ``StochasticWeightAveraging``, EMA callbacks or weight logging see stale
    weights on every rank but the owner. ``on_train_end`` and checkpoints are synced.
    """
    for rank, out in enumerate(run_distributed(_callback_worker, WORLD, str(tmp_path))):
        reference = out["ddp"]
        assert [w for w, _ in reference] == [f"batch_end {i}" for i in range(4)] + ["epoch_end 0"] + [
            f"batch_end {i}" for i in range(2)] + ["epoch_end 1"]
        for name in ("layerwise", "layerwise_small_buckets"):
            assert [w for w, _ in out[name]] == [w for w, _ in reference]
            for (when, got), (_, want) in zip(out[name], reference):
                assert_close_dicts(got, want, what=f"rank {rank} {name} at {when}")
