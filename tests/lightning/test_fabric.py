"""``Fabric(strategy="layerwise")``: a hand-written loop against one process on the same global batch.

* Parity: the tied-embedding example GPT (its embedding split into pieces by the
  element-wise fill) at 2 and 3 gloo ranks, AdamW and Muon, two micro-batches per step
  (``fabric.no_backward_sync`` on the first) and ``fabric.clip_gradients`` by norm,
  10 steps: parameters within 1e-5 of one process, the clipped norms equal, the ranks
  bitwise equal. Also ``setup_module`` + ``setup_optimizers`` and ``bf16-true``.
* Resharding: ``fabric.save`` after 5 steps at 2 ranks, ``fabric.load`` at 3 ranks (written
  with another bucket size), 5 more steps: equal to 10 uninterrupted steps of one process, sharded and full
  formats; a Trainer strategy's checkpoint loads into Fabric.
* Stale reads: ``nn.Transformer`` and a parent reading its child's weight equal one
  process under the default read guard; ``param_read_guard="strict"`` names the read.
* Bad input: each misuse gets its own clear error on every rank, before any collective.
"""

from __future__ import annotations


import lightning as L
import pytest
import torch
from lightning.fabric import Fabric
from torch import nn

import lightning_layerwise as llw
from _dist import LATE_MS, counting_compiler, reference_threads, run_distributed
from helpers import (READ_CASES, READ_STEPS, gpt, gpt_batches as batches, gpt_loss, gpt_optimizer as optimizer,
                     local_part, read_batches as make_batches, read_loss as loss_of, read_optimizer as make_optimizer,
                     read_reference, rel_err, snapshot)

STEPS = 10
MICRO = 2
MAX_NORM = 0.05
TOL = 1e-5


def make_fabric(world: int, **strategy_kwargs) -> Fabric:
    precision = strategy_kwargs.pop("precision", "32-true")
    fabric = Fabric(accelerator="cpu", devices=world, precision=precision,
                    strategy=llw.LayerwiseFabricStrategy(**strategy_kwargs) if strategy_kwargs else "layerwise")
    fabric.launch()
    return fabric


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """The trained values by the user's names (a Fabric-wrapped model: its original module's)."""
    return snapshot(getattr(model, "module", model))


def train_steps(fabric: Fabric, model, opt, steps, rank: int, world: int, finite: bool = True) -> list[float]:
    """The loop a user writes: micro-batches, no_backward_sync on all but the last, clipping, step."""
    norms = []
    for tokens in steps:
        opt.zero_grad()
        micro = tokens.chunk(world)[rank].chunk(MICRO)
        for i, part in enumerate(micro):
            with fabric.no_backward_sync(model, enabled=i < MICRO - 1):
                fabric.backward(gpt_loss(model, part) / MICRO)
        norms.append(fabric.clip_gradients(model, opt, max_norm=MAX_NORM, error_if_nonfinite=finite).item())
        opt.step()
    return norms


def reference_run(opt_name: str, steps=None, model_dtype=None) -> tuple[dict, list[float]]:
    """One process, the same global batch as MICRO micro-batches of the world's rows."""
    with reference_threads():
        return _reference_run(opt_name, steps, model_dtype)


def _reference_run(opt_name: str, steps=None, model_dtype=None) -> tuple[dict, list[float]]:
    model = gpt()
    opt = optimizer(opt_name, model)
    norms = []
    for tokens in steps if steps is not None else batches():
        opt.zero_grad()
        for part in tokens.chunk(MICRO):
            (gpt_loss(model, part) / MICRO).backward()
        norms.append(nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        opt.step()
    return snapshot(model), norms


def assert_equal_to_one_process(results: list, reference: tuple[dict, list[float]], what: str) -> float:
    want_params, want_norms = reference
    worst = 0.0
    for rank, (params, norms) in enumerate(results):
        for name, want in want_params.items():
            err = rel_err(params[name], want)
            worst = max(worst, err)
            assert err <= TOL, f"{what}, rank {rank}: {name} differs from one process by {err:.2e}"
            assert torch.equal(params[name], results[0][0][name]), f"{what}: rank {rank} differs on {name}"
        for got, want in zip(norms, want_norms):
            assert abs(got - want) <= TOL * want, f"{what}, rank {rank}: clipped norm {got} vs {want}"
    return worst


# --- parity ------------------------------------------------------------------------------------------------


def _parity_worker(rank, world, opt_name, joint_setup, owner_group_size=None, rows=None):
    fabric = make_fabric(world, bucket_size=2048, owner_group_size=owner_group_size)
    model = gpt(seed=rank)  # rank 0's initialisation is broadcast
    if joint_setup:
        opt = optimizer(opt_name, model)
        model, opt = fabric.setup(model, opt)
    else:
        model = fabric.setup_module(model)
        opt = fabric.setup_optimizers(optimizer(opt_name, model))
    norms = train_steps(fabric, model, opt, [t[:rows] for t in batches()], rank, world)
    split = {n for n, s in fabric.strategy.wrapper.layout.params.items() if s.split}
    assert fabric.strategy.process_groups.owner_group_size == (owner_group_size or world)
    params = params_of(model)  # the last all-gather is awaited by the read guard
    fabric.strategy.teardown()
    return params, norms, split


@pytest.mark.slow
@pytest.mark.parametrize("world,late_ms", [(2, None), (3, None), (2, LATE_MS)])
@pytest.mark.parametrize("opt_name", ["adamw", "muon"])
def test_fabric_loop_equals_one_process(world, opt_name, late_ms):
    """``late_ms``: every collective up to that late (Note [late collectives] in collectives.py).

    Mutation runs (LATE_MS=4), relative error of transformer.wte.weight, adamw / muon: reduce-scatter
    not awaited before the step 1.6e-1 / 1.6e-1; all-gather not awaited in the pre-hook 1.1e-1 / 1.0e-1.
    """
    results = run_distributed(_parity_worker, world, opt_name, True, late_ms=late_ms)
    worst = assert_equal_to_one_process([r[:2] for r in results], reference_run(opt_name), f"{opt_name} at {world}")
    assert "transformer.wte.weight" in results[0][2], "the tied embedding is cut into pieces"
    print(f"fabric {opt_name} world={world}: max rel err {worst:.2e}")


def _sharded_worker(rank, world, opt_name, path):
    fabric = make_fabric(world, bucket_size=2048, shard_parameters=True)
    model = gpt(seed=rank)
    model, opt = fabric.setup(model, optimizer(opt_name, model))
    norms = train_steps(fabric, model, opt, batches(), rank, world)
    try:
        params_of(model)
        outside = "no error"
    except llw.ShardedParameterReadError as error:  # between steps a rank holds its shard only
        outside = str(error)
    with llw.full_parameters(model):
        params = params_of(model)
    fabric.save(path, {"model": model, "optimizer": opt})
    fabric.strategy.teardown()
    return params, norms, outside


@pytest.mark.slow
@pytest.mark.parametrize("late_ms", [None, LATE_MS], ids=["now", "late"])
@pytest.mark.parametrize("opt_name", ["adamw", "muon"])
def test_sharded_parameters_under_fabric_equal_one_process(opt_name, late_ms, tmp_path):
    """``LayerwiseFabricStrategy(shard_parameters=True)``: the loop a user writes (micro-batches under
    ``no_backward_sync``, global-norm clipping) equals one process; between steps a read raises naming
    ``llw.full_parameters``, inside it every parameter is whole, and ``fabric.save`` writes the whole model."""
    path = str(tmp_path / "sharded.ckpt")
    results = run_distributed(_sharded_worker, 2, opt_name, path, late_ms=late_ms)
    assert_equal_to_one_process([r[:2] for r in results], reference_run(opt_name), f"sharded {opt_name}")
    assert all("llw.full_parameters(model)" in r[2] for r in results), results[0][2]
    saved = torch.load(path, weights_only=True)["model"]
    for name, value in results[0][0].items():
        assert torch.equal(saved[name], value), name


def _sharded_meta_worker(rank, world):
    fabric = make_fabric(world, bucket_size=2048, shard_parameters=True)
    with fabric.init_module(empty_init=True):
        model = gpt(seed=rank)
    built_on_meta = all(p.is_meta for p in model.parameters())
    opt = optimizer("adamw", model)
    model, opt = fabric.setup(model, opt)
    materialized = not any(p.is_meta for group in opt.param_groups for p in group["params"])
    with llw.full_parameters(model):
        start = params_of(model)
    train_steps(fabric, model, opt, batches(2), rank, world)
    with llw.full_parameters(model):
        end = params_of(model)
    fabric.strategy.teardown()
    return built_on_meta, materialized, start, end


def test_fabric_init_module_empty_init_builds_on_meta_and_setup_materializes():
    """``fabric.init_module(empty_init=True)`` with sharded parameters: built on the meta device, materialized by
    ``fabric.setup`` with rank 0's values on every rank (the example GPT's own init replayed: bitwise those of an
    eager build with rank 0's seed), the optimizer stepping the new parameters."""
    results = run_distributed(_sharded_meta_worker, 2)
    eager = snapshot(gpt(seed=0))
    for rank, (built_on_meta, materialized, start, end) in enumerate(results):
        assert built_on_meta and materialized
        for name in start:
            assert torch.equal(start[name], eager[name]) and torch.equal(end[name], results[0][3][name]), name
        assert max(rel_err(end[n], start[n]) for n in start) > 1e-3, "the steps trained the new parameters"


@pytest.mark.slow
@pytest.mark.parametrize("opt_name", ["adamw", "muon"])
def test_owner_groups_under_fabric_equal_one_process(opt_name):
    """4 ranks as two owner groups of 2 (8 rows per step: one row per micro-batch per rank)."""
    results = run_distributed(_parity_worker, 4, opt_name, True, 2, 8)
    reference = reference_run(opt_name, [t[:8] for t in batches()])
    worst = assert_equal_to_one_process([r[:2] for r in results], reference, f"{opt_name}, owner groups 2x2")
    print(f"fabric {opt_name} 2x2 owner groups: max rel err {worst:.2e}")


@pytest.mark.slow
def test_setup_module_then_setup_optimizers_equals_one_process():
    results = run_distributed(_parity_worker, 2, "adamw", False)
    assert_equal_to_one_process([r[:2] for r in results], reference_run("adamw"), "setup_module + setup_optimizers")
    assert results[0][2] == set(), "without the optimizer at wrap time every parameter is owned whole"


def _bf16_true_worker(rank, world):
    fabric = make_fabric(world, bucket_size=2048, precision="bf16-true")
    model = gpt(seed=rank)
    model, opt = fabric.setup(model, optimizer("adamw", model))
    masters = fabric.strategy.session.masters.numel
    norms = train_steps(fabric, model, opt, batches(4), rank, world)
    params = params_of(model)
    fabric.strategy.teardown()
    return params, norms, masters


def _bf16_reference():
    """One process with a bf16 model and float32 master weights: what bf16-true under the strategy computes."""
    with reference_threads():
        return _bf16_reference_run()


def _bf16_reference_run():
    model = gpt().to(torch.bfloat16)
    masters = gpt()  # float32, the same initial values
    opt = optimizer("adamw", masters)
    norms = []
    for tokens in batches(4):
        opt.zero_grad()
        model.zero_grad(set_to_none=True)
        for part in tokens.chunk(MICRO):
            (gpt_loss(model, part) / MICRO).backward()
        for m, p in zip(masters.parameters(), model.parameters()):
            m.grad = p.grad.float()
        norms.append(nn.utils.clip_grad_norm_(masters.parameters(), MAX_NORM).item())
        opt.step()
        with torch.no_grad():
            for m, p in zip(masters.parameters(), model.parameters()):
                p.copy_(m)
    return snapshot(model), norms


@pytest.mark.slow
def test_bf16_true_keeps_float32_masters_of_owned_parameters_only():
    results = run_distributed(_bf16_true_worker, 2)
    n = sum(p.numel() for p in gpt().parameters())
    assert sum(r[2] for r in results) == n, "every parameter has exactly one float32 master in the world"
    want, _ = _bf16_reference()
    for rank, (params, _, _) in enumerate(results):
        assert all(p.dtype == torch.bfloat16 for p in params.values())
        for name, value in params.items():
            # bf16 gradients summed in another order: a few bf16 ulps, the Trainer tests' bound for bf16
            assert rel_err(value, want[name]) <= 2e-2, (rank, name, rel_err(value, want[name]))
            assert torch.equal(value, results[0][0][name])


# --- resharding --------------------------------------------------------------------------------------------


def _save_worker(rank, world, path, fmt):
    fabric = make_fabric(world, bucket_size=2048, checkpoint_format=fmt)
    model = gpt(seed=rank)
    model, opt = fabric.setup(model, optimizer("adamw", model))
    train_steps(fabric, model, opt, batches()[:5], rank, world)
    fabric.save(path, {"model": model, "optimizer": opt, "step": 5, "note": "half way"})
    fabric.strategy.teardown()


def _resume_worker(rank, world, path, fmt):
    fabric = make_fabric(world, bucket_size=1024, checkpoint_format=fmt)
    model = gpt(seed=100 + rank)  # overwritten by the checkpoint
    model, opt = fabric.setup(model, optimizer("adamw", model))
    refused = _sharded_misuse(fabric, path, model, opt) if fmt == "sharded" else {}
    state = {"model": model, "optimizer": opt, "step": 0}
    rest = fabric.load(path, state)
    norms = train_steps(fabric, model, opt, batches()[5:], rank, world)
    params = params_of(model)
    fabric.strategy.teardown()
    return params, norms, state["step"], rest, refused


def _sharded_misuse(fabric, path, model, opt) -> dict[str, str]:
    """Loads a sharded directory cannot serve, each refused on every rank before anything is read."""
    refused = {}
    for case, call in (("load_raw", lambda: fabric.load_raw(path, model)), ("no state", lambda: fabric.load(path)),
                       ("no module", lambda: fabric.load(path, {"optimizer": opt}))):
        try:
            call()
        except ValueError as error:
            refused[case] = str(error)
    return refused


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["sharded", "full"])
def test_save_at_two_ranks_load_at_three_continues_as_if_uninterrupted(tmp_path, fmt):
    path = str(tmp_path / "fabric.ckpt")
    run_distributed(_save_worker, 2, path, fmt)
    results = run_distributed(_resume_worker, 3, path, fmt)
    want_params, want_norms = reference_run("adamw")
    assert_equal_to_one_process([r[:2] for r in results], (want_params, want_norms[5:]), f"{fmt}, saved at 2, resumed at 3")
    for _, _, step, rest, refused in results:
        assert step == 5
        assert rest == {"note": "half way"}, rest
        if fmt == "sharded":  # what the directory cannot serve is refused, naming the way that works
            assert "is a sharded checkpoint directory: fabric.load_raw reads one file" in refused["load_raw"], refused
            assert "pass the objects to restore" in refused["no state"], refused
            assert "needs the trained module in the state" in refused["no module"], refused


class TrainerGPT(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = gpt()

    def forward(self, tokens):
        return self.model(tokens)

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        return gpt_loss(self.model, tokens)

    def configure_optimizers(self):
        return optimizer("adamw", self.model)


def _trainer_save_worker(rank, world, path):
    from torch.utils.data import DataLoader, TensorDataset

    module = TrainerGPT()
    data = DataLoader(TensorDataset(torch.cat(batches()[:3])), batch_size=12 // world)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=llw.LayerwiseStrategy(bucket_size=2048),
                        max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=True)
    trainer.fit(module, data)
    trainer.save_checkpoint(path)
    return snapshot(module)


def _fabric_load_trainer_worker(rank, world, path):
    fabric = make_fabric(world, bucket_size=1024)
    module = TrainerGPT()
    torch.manual_seed(rank + 7)
    for p in module.parameters():
        nn.init.normal_(p)  # overwritten by the checkpoint
    opt = optimizer("adamw", module.model)
    module, opt = fabric.setup(module, opt)
    rest = fabric.load(path, {"model": module, "optimizer": opt})
    params = params_of(module)
    saved_steps = [s["step"] for s in opt.optimizer.state.values() if "step" in s]
    fabric.strategy.teardown()
    return params, rest["global_step"], saved_steps


@pytest.mark.slow
def test_a_trainer_checkpoint_loads_into_fabric_at_another_world_size(tmp_path):
    path = str(tmp_path / "trainer.ckpt")
    trained = run_distributed(_trainer_save_worker, 2, path)[0]
    for params, global_step, steps in run_distributed(_fabric_load_trainer_worker, 3, path):
        assert global_step == 3
        assert steps and all(float(s) == 3.0 for s in steps), steps  # AdamW's state came along
        for name, value in trained.items():
            assert torch.equal(params[name], value), name


# --- stale reads -------------------------------------------------------------------------------------------


def _read_worker(rank, world, cases, guard):
    results = {}
    for case in cases:
        factory, bucket_size, penalty, _ = READ_CASES[case]
        for repeat in range(2):  # a race can pass once
            fabric = make_fabric(world, param_read_guard=guard, **({} if bucket_size is None
                                                                    else {"bucket_size": bucket_size}))
            torch.manual_seed(0)
            model = factory()
            model, opt = fabric.setup(model, make_optimizer(model.parameters()))
            error = None
            try:
                for batch in make_batches(case, world, READ_STEPS):
                    inputs, target = local_part(batch, rank, world)
                    opt.zero_grad()
                    loss, _ = loss_of(case, model, inputs, target, penalty)
                    fabric.backward(loss)
                    opt.step()
            except llw.StaleParameterReadError as e:
                error = str(e)
            fabric.strategy.sync_parameters()
            results[(case, repeat)] = params_of(model), error, fabric.strategy.wrapper.param_sync.guarded_reads
            fabric.strategy.teardown()
    return results


@pytest.mark.slow
def test_reads_outside_a_module_see_this_steps_parameters_under_fabric():
    cases = ["transformer_512", "parent_reads_child", "l2_before_forward"]
    refs = {case: read_reference(case, 2)[0] for case in cases}
    for rank, results in enumerate(run_distributed(_read_worker, 2, cases, "wait")):
        for (case, repeat), (params, error, waited) in results.items():
            assert error is None, error
            for name, want in refs[case].items():
                assert rel_err(params[name], want) <= TOL, (case, repeat, rank, name)
            if repeat == 0:
                assert waited > 0, f"{case}: the guard never waited, so the test proves nothing"


@pytest.mark.slow
def test_strict_mode_names_the_stale_read_under_fabric():
    cases = ["parent_reads_child", "example_gpt"]
    for results in run_distributed(_read_worker, 2, cases, "strict"):
        error = results[("parent_reads_child", 0)][1]
        assert error is not None and READ_CASES["parent_reads_child"][3] in error and "param_read_guard" in error
        assert results[("example_gpt", 0)][1] is None, "strict mode stays silent on a model that calls its modules"


# --- bad input ---------------------------------------------------------------------------------------------


def _misuse_worker(rank, world, case):
    fabric = make_fabric(world)
    model = gpt(seed=0)
    tokens = batches(1)[0].chunk(world)[rank]
    try:
        if case == "model without optimizer":
            model = fabric.setup(model)
            opt = torch.optim.AdamW(model.parameters())
            fabric.backward(gpt_loss(model, tokens))
            opt.step()
        elif case == "no_backward_sync on a raw module":
            with fabric.no_backward_sync(model):
                pass
        elif case == "no_backward_sync on a frozen module":
            teacher = gpt(seed=1).requires_grad_(False)
            teacher = fabric.setup_module(teacher)
            with fabric.no_backward_sync(teacher):
                pass
        elif case == "step after no_backward_sync only":
            model, opt = fabric.setup(model, torch.optim.AdamW(model.parameters()))
            with fabric.no_backward_sync(model):
                fabric.backward(gpt_loss(model, tokens))
            opt.step()
        elif case == "optimizers before the module":
            fabric.setup_optimizers(torch.optim.AdamW(model.parameters()))
        elif case == "a second trained module":
            fabric.setup(model, torch.optim.AdamW(model.parameters()))
            other = gpt(seed=2)
            fabric.setup(other, torch.optim.AdamW(other.parameters()))
        elif case == "an optimizer of another module":
            fabric.setup(model, torch.optim.AdamW(gpt(seed=2).parameters()))
        else:
            raise AssertionError(case)
    except Exception as e:  # noqa: BLE001 - the message is what is tested
        return f"{type(e).__name__}: {e}"
    finally:
        if fabric.strategy.wrapper is not None:
            fabric.strategy.teardown()
    return None


MISUSES = {
    "model without optimizer": r"RuntimeError: strategy='layerwise': backward on a module that was set up without "
                               r"an optimizer\..*fabric\.setup\(model, optimizer\)",
    "no_backward_sync on a raw module": r"TypeError: You need to set up the model first",
    "no_backward_sync on a frozen module": r"TypeError: fabric\.no_backward_sync\(model\) under strategy='layerwise' "
                                           r"needs the model returned by fabric\.setup\(model, optimizer\); got a GPT",
    "step after no_backward_sync only": r"RuntimeError: strategy='layerwise': optimizer\.step\(\) after a backward "
                                        r"inside fabric\.no_backward_sync\(model\)",
    "optimizers before the module": r"RuntimeError: strategy='layerwise': set up the module first",
    "a second trained module": r"ValueError: strategy='layerwise' trains one module per Fabric, and one is set up "
                               r"already\. Put the trained modules in one nn\.Module \(e\.g\. an nn\.ModuleDict\) "
                               r"and set that up once with all their optimizers, any number of them "
                               r"\(fabric\.setup\(model, opt_g, opt_d\)\); modules without trainable parameters "
                               r"can be set up beside it\.$",
    "an optimizer of another module": r"ValueError: the optimizer holds \d+ tensor\(s\) that are not parameters "
                                      r"of the module being set up",
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(MISUSES))
def test_misuse_gets_a_clear_error_on_every_rank(case):
    import re

    for rank, message in enumerate(run_distributed(_misuse_worker, 2, case)):
        assert message is not None and re.match(MISUSES[case], message, re.S), (rank, message)


def test_registered_for_fabric_with_the_launch_variants():
    from lightning.fabric.strategies import STRATEGY_REGISTRY

    for name, method in (("layerwise", "popen"), ("layerwise_spawn", "spawn"), ("layerwise_fork", "fork"),
                         ("layerwise_notebook", "fork")):
        strategy = STRATEGY_REGISTRY.get(name)
        assert isinstance(strategy, llw.LayerwiseFabricStrategy) and strategy._start_method == method


def test_bad_arguments_and_plugins_are_refused_at_construction():
    with pytest.raises(ValueError, match=r"^LayerwiseFabricStrategy\(bucket_size=0\): pass a positive number"):
        llw.LayerwiseFabricStrategy(bucket_size=0)
    with pytest.raises(TypeError, match=r"^LayerwiseFabricStrategy got unknown argument\(s\) \['bucket_sise'\] "
                                        r"\(did you mean 'bucket_size'\?\); its arguments are \[.*'bucket_size'"):
        llw.LayerwiseFabricStrategy(bucket_sise=10)
    # Fabric's own arguments are matched too; a name close to none gets no guess.
    with pytest.raises(TypeError, match=r"^LayerwiseFabricStrategy got unknown argument\(s\) \['precison', 'zzz'\] "
                                        r"\(did you mean 'precision' for 'precison'\?\); its arguments are \[.*\] "
                                        r"\(as LayerwiseStrategy's\) and Fabric's own \(accelerator, precision, "):
        llw.LayerwiseFabricStrategy(precison="bf16-mixed", zzz=1)
    with pytest.raises(TypeError, match=r"^LayerwiseFabricStrategy got unknown argument\(s\) \['zzz'\]; its"):
        llw.LayerwiseFabricStrategy(zzz=1)
    from lightning.fabric.plugins.precision import Precision

    class CustomPrecision(Precision):
        pass

    with pytest.raises(ValueError, match=r"^strategy='layerwise' does not support the precision plugin CustomPrecision"):
        llw.LayerwiseFabricStrategy(precision=CustomPrecision())


# --- the example --------------------------------------------------------------------------------------------


def _example_worker(rank, world, out, extra):
    from examples.fabric_train import main

    return main(["--accelerator", "cpu", "--devices", str(world), "--max-steps", "20", "--val-every", "10",
                 "--val-batches", "2", "--max-chars", "200000", "--n-layer", "2", "--n-embd", "64", "--grad-accum",
                 "2", "--out", out, *extra])


@pytest.mark.slow
def test_the_fabric_example_trains_and_resumes_at_another_world_size(tmp_path):
    import math

    out = str(tmp_path)
    first = run_distributed(_example_worker, 2, out, [])[0]
    steps = [s for s, _, _ in first["val"]]
    assert steps == [10, 20]
    assert first["final_val_loss"] < math.log(97) - 1.0, first  # well below a uniform guess over the characters
    resumed = run_distributed(_example_worker, 3, out, ["--max-steps", "30", "--resume", f"{out}/last.ckpt"])[0]
    assert [s for s, _, _ in resumed["val"]] == [30], resumed  # continued at step 20, not from 0


def _plain_save(path):
    """A plain single-process loop (what Fabric's ddp or no strategy saves): state dicts keyed by position."""
    model = gpt()
    opt = optimizer("adamw", model)
    for tokens in batches()[:5]:
        opt.zero_grad()
        for part in tokens.chunk(MICRO):
            (gpt_loss(model, part) / MICRO).backward()
        nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 5}, path)


@pytest.mark.slow
def test_a_plain_full_file_with_positional_optimizer_state_resumes(tmp_path):
    path = str(tmp_path / "plain.pt")
    _plain_save(path)
    results = run_distributed(_resume_worker, 2, path, "full")
    want_params, want_norms = reference_run("adamw")
    assert_equal_to_one_process([r[:2] for r in results], (want_params, want_norms[5:]), "plain file resumed at 2")


def _fp16_worker(rank, world):
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    from lightning.fabric.plugins.precision import MixedPrecision

    # Fabric maps "16-mixed" to bf16 on CPU; the plugin with a float16 grad scaler is given explicitly.
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**24))
    fabric = Fabric(accelerator="cpu", devices=world, plugins=[plugin],
                    strategy=llw.LayerwiseFabricStrategy(bucket_size=2048))
    fabric.launch()
    model = gpt(seed=rank)
    model, opt = fabric.setup(model, optimizer("adamw", model))
    scaler = fabric.strategy.precision.scaler
    # An overflowed step has an infinite norm, which Fabric's clip_gradients refuses by default.
    norms = train_steps(fabric, model, opt, batches(8), rank, world, finite=False)
    params = params_of(model)
    fabric.strategy.teardown()
    return params, norms, type(scaler) is ShardedGradScaler, scaler.get_scale()


@pytest.mark.slow
def test_16_mixed_agrees_on_the_loss_scale_across_ranks():
    results = run_distributed(_fp16_worker, 2)
    for params, norms, sharded, scale in results:
        assert scale < 2.0**24, "the first steps overflowed at 2**24 and every rank lowered the scale"
        assert sharded, "the grad scaler is torch's ShardedGradScaler over the data-parallel group"
        assert scale == results[0][3]
        assert torch.equal(torch.tensor(norms).isfinite(), torch.tensor(results[0][1]).isfinite())
        assert torch.isfinite(torch.tensor(norms[-1])), f"the scale came down to a finite step: {norms}"
        for name, value in params.items():
            assert torch.isfinite(value).all(), "skipped steps left the parameters finite"
            assert torch.equal(value, results[0][0][name]), name


# --- expert parallelism -------------------------------------------------------------------------------------


def _moe_worker(rank, world, E, opt_name, steps, save=None, load=None):
    import helpers as X

    fabric = make_fabric(world, bucket_size=4096, expert_parallel_size=E)
    expert_rank = fabric.strategy.expert_parallel_rank  # known before set-up: build only these experts
    model = X.moe_gpt(E, expert_rank)
    model, opt = fabric.setup(model, X.moe_optimizer(opt_name, model))
    model.set_expert_group(fabric.strategy.process_groups.expert_parallel)
    state = {"model": model, "optimizer": opt, "step": 0}
    if load is not None:
        fabric.load(load, state)
    for tokens in X.moe_batches()[state["step"]:steps]:
        opt.zero_grad()
        fabric.backward(X.moe_loss(model, tokens.chunk(world)[rank]))
        opt.step()
        state["step"] += 1
    if save is not None:
        fabric.save(save, state)
    fabric.strategy.sync_parameters()
    params = X.global_names(model.module, expert_rank * (X.NUM_EXPERTS // E))
    fabric.strategy.teardown()
    return params


def _assert_moe_equal(results, opt_name):
    import helpers as X

    want = X.moe_reference(opt_name)
    for rank, params in enumerate(results):
        for name, value in params.items():
            assert rel_err(value, want[name]) <= TOL, (opt_name, rank, name, rel_err(value, want[name]))


@pytest.mark.slow
@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_expert_parallelism_under_fabric_equals_one_process_holding_every_expert(opt_name):
    """4 ranks with 2 expert-parallel ranks (SGD checks the averaging rule, AdamW the rest)."""
    _assert_moe_equal(run_distributed(_moe_worker, 4, 2, opt_name, 10), opt_name)


@pytest.mark.slow
def test_an_expert_parallel_fabric_checkpoint_resumes_without_expert_parallelism(tmp_path):
    path = str(tmp_path / "moe.ckpt")
    run_distributed(_moe_worker, 4, 2, "adamw", 5, path)
    _assert_moe_equal(run_distributed(_moe_worker, 2, 1, "adamw", 10, None, path), "adamw")


# --- torch.compile ------------------------------------------------------------------------------------------


def _compiled_worker(rank, world, overlap):
    fabric = make_fabric(world, bucket_size=2048, overlap_param_gather=overlap)
    model = gpt(seed=rank)
    opt = optimizer("adamw", model)
    # Fabric compiles again around the strategy's wrapper (Note [compiled wrapper]); aot_eager traces
    # forward and backward as inductor does, without generating code.
    model, opt = fabric.setup(torch.compile(model, backend="aot_eager"), opt)
    try:
        norms = train_steps(fabric, model, opt, batches(), rank, world)
    except ValueError as e:
        fabric.strategy.teardown()
        return str(e)
    compiled = fabric.strategy.wrapper.compiled_forward
    params = params_of(model)
    fabric.strategy.teardown()
    return params, norms, compiled


@pytest.mark.slow
@pytest.mark.parametrize("overlap", ["auto", False])
def test_a_compiled_model_under_fabric_equals_one_process(overlap):
    results = run_distributed(_compiled_worker, 2, overlap)
    assert all(r[2] for r in results), "the wrapper's forward ran compiled"
    assert_equal_to_one_process([r[:2] for r in results], reference_run("adamw"), f"compiled, overlap={overlap}")


@pytest.mark.slow
def test_overlap_true_with_a_compiled_model_is_refused_at_the_first_step():
    for message in run_distributed(_compiled_worker, 2, True):
        assert isinstance(message, str) and message.startswith(
            "LayerwiseFabricStrategy(overlap_param_gather=True) with a model compiled around"), message


def _compile_count_worker(rank, world):
    backend, graphs = counting_compiler()

    fabric = make_fabric(world, bucket_size=64)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # Fabric compiles the strategy's wrapper with the same backend (Note [compiled wrapper]).
    model, opt = fabric.setup(torch.compile(model, backend=backend), opt)
    g = torch.Generator().manual_seed(rank)
    for _ in range(4):
        opt.zero_grad()
        fabric.backward(model(torch.randn(4, 8, generator=g)).square().mean())
        opt.step()
    compiled = fabric.strategy.wrapper.compiled_forward
    fabric.strategy.teardown()
    return len(graphs), compiled


def test_a_compiled_model_compiles_once_under_fabric():
    """Note [compiled pre-hooks] (param_sync.py): the forward pre-hooks traced with the model guard only on a state
    that is the same at every synced forward, so 4 steps compile once."""
    for rank, (compiles, compiled) in enumerate(run_distributed(_compile_count_worker, 2)):
        assert compiled, "the wrapper's forward ran compiled"
        assert compiles == 1, f"rank {rank}: the model compiled {compiles} times in 4 steps"


def _moe_full_load_worker(rank, world, path):
    import helpers as X

    fabric = make_fabric(world, bucket_size=4096, expert_parallel_size=2)
    model = X.moe_gpt(2, fabric.strategy.expert_parallel_rank)
    model, opt = fabric.setup(model, X.moe_optimizer("adamw", model))
    try:
        fabric.load(path, {"model": model})
    except Exception as e:  # noqa: BLE001 - the message is what is tested
        return f"{type(e).__name__}: {e}"
    finally:
        fabric.strategy.teardown()
    return None


@pytest.mark.slow
def test_a_full_file_at_expert_parallel_size_two_is_refused(tmp_path):
    import helpers as X

    path = str(tmp_path / "full.pt")
    torch.save({"model": X.moe_gpt().state_dict()}, path)  # every expert, under global names
    for message in run_distributed(_moe_full_load_worker, 2, path):
        assert message == ("CheckpointError: loading a full checkpoint file with expert_parallel_size=2 is not "
                           "supported yet; load it with expert_parallel_size=1, or resume from a sharded "
                           "checkpoint."), message
