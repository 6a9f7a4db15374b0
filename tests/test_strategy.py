"""Trainer(strategy="layerwise") against Trainer(strategy="ddp") on the same model, data and seed.

Each rank is a forked gloo process with LOCAL_RANK/WORLD_SIZE set, the way
Lightning's own subprocess launcher (and torchrun) start workers, so both
Trainers run in the same process group and every rank's parameters come back.
"""

from __future__ import annotations

import math
import os

import lightning as L
import pytest
import torch
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins import MixedPrecision, Precision
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_layerwise as llw
from _dist import counting_compiler, reference_threads, run_distributed

WORLD = 2


class Regressor(L.LightningModule):
    def __init__(self, optimizer: str = "adamw", inf_on_rank: int | None = None, inf_at_step: int = 1):
        super().__init__()
        self.optimizer_name = optimizer
        self.inf_on_rank, self.inf_at_step = inf_on_rank, inf_at_step
        torch.manual_seed(0)
        self.emb = nn.Linear(7, 24)
        self.body = nn.Sequential(nn.Linear(24, 33), nn.GELU(), nn.LayerNorm(33), nn.Linear(33, 24))
        self.head = nn.Linear(24, 3)

    def forward(self, x):
        h = self.emb(x)
        return self.head(h + self.body(h))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        if self.inf_on_rank == self.global_rank and self.global_step == self.inf_at_step:
            # An inf gradient for one parameter only: after the reduce-scatter only its owner sees it.
            loss = loss + self.head.bias.sum() * float("inf")
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y), sync_dist=True)

    def configure_optimizers(self):
        if self.optimizer_name == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)
        groups = llw.muon_param_groups(self)
        return llw.Muon(groups, lr=0.02, adamw_lr=1e-2, ns_dtype=torch.float32)


def loaders(n: int = 64, batch_size: int = 4):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 7, generator=g)
    y = torch.stack([x[:, 0] * x[:, 1], x[:, 2].sin(), x[:, 3:].sum(1)], dim=1)
    data = TensorDataset(x, y)
    return DataLoader(data, batch_size=batch_size), DataLoader(data, batch_size=8)


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


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-12)).item()


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

    assert isinstance(trainer.precision_plugin, llw.precision.LayerwiseMixedPrecision)
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


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"bucket_size": -1}, "bucket_size=-1"),
        ({"bucket_size": 0}, "bucket_size=0"),
        ({"prefetch_depth": 0}, "prefetch_depth=0"),
        ({"grad_reduce_dtype": "float64"}, "grad_reduce_dtype='float64'"),
        ({"checkpoint_format": "zip"}, "checkpoint_format='zip'"),
    ],
)
def test_bad_strategy_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        llw.LayerwiseStrategy(**kwargs)


def test_a_misspelt_argument_names_the_closest_one_and_the_valid_ones():
    with pytest.raises(TypeError, match=r"^LayerwiseStrategy got unknown argument\(s\) \['bucket_sise'\] \(did you "
                                        r"mean 'bucket_size'\?\); its arguments are \['broadcast_buffers', "
                                        r"'bucket_size', .*'timeout'\] and Lightning's \(process_group_backend, "
                                        r"accelerator, .*precision_plugin\)\.$"):
        llw.LayerwiseStrategy(bucket_sise=10)
    with pytest.raises(TypeError, match=r"^LayerwiseStrategy got unknown argument\(s\) \['prefech_depth', 'zzz'\] "
                                        r"\(did you mean 'prefetch_depth' for 'prefech_depth'\?\); its arguments"):
        llw.LayerwiseStrategy(zzz=1, prefech_depth=2)
    with pytest.raises(TypeError, match=r"^LayerwiseStrategy got unknown argument\(s\) \['zzz'\]; its arguments"):
        llw.LayerwiseStrategy(zzz=1)
    # The check leaves the explicit signature in place: LightningCLI reads the arguments and their types from it.
    import inspect

    params = inspect.signature(llw.LayerwiseStrategy).parameters
    assert params["bucket_size"].annotation == "int" and "kwargs" not in params
    assert llw.LayerwiseStrategy(4096, prefetch_depth=3).config.bucket_size == 4096


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
            masters = trainer.strategy._masters
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


@pytest.mark.parametrize("kwargs, match", [
    ({"elementwise_fill": "yes"}, "elementwise_fill='yes'"),
    ({"elementwise_optimizers": "torch.optim.AdamW"}, "pass a list"),
    ({"elementwise_optimizers": ["Lion"]}, "'Lion' is not an optimizer class"),
    ({"elementwise_optimizers": ["no_such_package.Lion"]}, "cannot import 'no_such_package.Lion'"),
    ({"elementwise_optimizers": ["math.pi"]}, "'math.pi' is float, not a class"),
])
def test_bad_elementwise_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        llw.LayerwiseStrategy(**kwargs)


# --- owner groups ---------------------------------------------------------------------------------


def _owner_groups_worker(rank, world, optimizer, owner_group_size):
    sizes = []

    class Inspect(L.Callback):
        def on_train_start(self, trainer, pl_module):
            sizes.append(trainer.strategy.wrapper.owner_size)

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


def test_owner_group_size_must_divide_the_world():
    with pytest.raises(ValueError, match=r"owner_group_size=0"):
        llw.LayerwiseStrategy(owner_group_size=0)
    with pytest.raises(ValueError, match=r"owner_group_size='half'"):
        llw.LayerwiseStrategy(owner_group_size="half")
    error = run_distributed(_indivisible_worker, 2)[0]
    assert "owner_group_size=3) does not divide the 2 ranks" in error


def _indivisible_worker(rank, world):
    try:
        L.Trainer(accelerator="cpu", devices=world, strategy=llw.LayerwiseStrategy(owner_group_size=3), max_steps=1,
                  logger=False, enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False).fit(Regressor(), loaders()[0])
    except ValueError as error:
        return str(error)
    return "no error"


# --- torch.compile --------------------------------------------------------------------------------------------------


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
