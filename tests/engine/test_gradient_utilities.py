"""torch's gradient utilities over sharded gradients (Note [gradient utilities], ``engine/grad_utils.py``):
where they are patched, and ``ddp``'s numbers from torch's clipping on any list of parameters.

The patches have a scope:

* Importing the package patches nothing (a fresh interpreter: torch's ``clip_grad_norm_`` implementation,
  ``nn.Module.zero_grad`` and Lightning's ``grad_norm`` code are torch's and Lightning's own objects).
* Building :class:`LayerwiseDataParallel` by hand patches nothing: torch's ``clip_grad_norm_`` over the
  model's parameters returns this rank's local norm (the norm of what it steps), which differs between
  the ranks; inside ``with llw.gradient_utilities():`` it returns the global norm, the same on every rank
  and equal to one process's norm of the mean gradient (fp32, relative error <= 1e-5: the same sums in
  another order).
* A session holds the patches from ``wrap`` to ``release``, counted over live holders: two sessions, one
  released, still patched; both released, every original object is back in place.
* Every patch ``patched_functions()`` lists (Note [patches] in ``engine/patches.py``), the shorter-lived ones
  of ``record_init`` and of a Trainer stage included, is in place only within its scope; and a ``Patch``'s
  undo and a ``Scope``'s holds put back exactly what they changed.

torch's clipping on a list of parameters, split parameters included, must give ``ddp``'s numbers.

Under ``ddp`` every parameter that received a gradient has a ``.grad``, so loops pick what to clip
with ``[p for p in model.parameters() if p.grad is not None]``. Under ``layerwise`` with element-wise
fill (the default) a rank holds the reduced gradient only of what it steps, and a split parameter's
gradient exists on no rank whole: its ``.grad`` is a marker, ``llw.SplitGradient`` (Note [split
gradients] in ``lightning_layerwise/engine/split_gradient.py``), so the filter keeps it as ``ddp``'s does, and a
list that differs across ranks in any other way raises (Note [parameter lists] in ``engine/clip.py``).

Each worker trains the tied-embedding GPT of ``test_elementwise_fill.py`` (buckets of 512 elements:
the embedding is split at 2 and 3 ranks under every optimizer, every matrix under SGD and AdamW) on
the same global batches under ``ddp`` and under ``layerwise`` inside the same forked gloo ranks
(``tests/_dist.py``), clips after every backward with ``max_norm`` 0.25 (every step's norm is above
it), and compares every parameter rank by rank: fp32, relative error <= 1e-5, 1e-4 where Muon's
Newton-Schulz runs (five float32 matrix products amplify the rounding of the gradient, which differs
from ``ddp``'s in the order of float additions: a reduce-scatter against one all-reduce), and the norm
``clip_grad_norm_`` returned at each step, relative error <= 1e-5. Lists: (a) filtered by ``p.grad is
not None``; (b) a fixed part of the model, the embedding (split) and the second block, the first block
left out; (c) the unfiltered generator ``model.parameters()``; (d) one layer's parameters filtered by
``p.grad is not None``, a list that is empty on the ranks stepping none of that layer (they still take
part in the norm's all-reduce; they once ran torch's own clipping instead and the others hung in it). Optimizers: SGD with momentum, AdamW,
and ``llw.Muon(llw.muon_param_groups(model))`` (whole matrices; its AdamW groups, with the embedding,
split). Each front end runs at 2 and 3 ranks, and once at 2 ranks with every collective delayed on a
worker thread (``late_ms``, the timing fuzzer). The layerwise run must have split a parameter on this
rank and handed the filtered list a ``SplitGradient``, so no comparison passes vacuously.

* Trainer, manual optimization: ``self.manual_backward(loss)``, then
  ``torch.nn.utils.clip_grad_norm_(<list>, 0.25)``; also ``torch.nn.utils.clip_grad_value_`` on the
  filtered list (SGD, clip value 2e-3; the first step's largest gradient element is 0.1).
* Fabric: ``fabric.backward(loss)``, then torch's ``clip_grad_norm_(<list>, 0.25)``; and once
  ``fabric.clip_gradients(model, optimizer, max_norm=0.25)``.
* The plain session (``examples/torch_train.py``'s loop): ``session.backward(loss)``, torch's clipping,
  ``session.step(optimizer)``, against ``torch.nn.parallel.DistributedDataParallel``.
* Lists that disagree across ranks with no one-process answer (rank 1 leaves out a parameter it owns
  whole, or one it steps a piece of; 2-norm, 1-norm, inf-norm): every rank raises the same
  ``ValueError`` naming the parameter, with no hang, and the next clipping call works; a rank passing
  the unfiltered list while the other passes the filtered one is no disagreement.
* A split parameter's ``.grad``: ``isinstance(p.grad, llw.SplitGradient)`` with the parameter's shape,
  dtype and device; reading its values raises ``llw.SplitGradientError`` naming the parameter and
  ``elementwise_fill=False``; ``model.zero_grad(set_to_none=False)`` passes (a loop clearing that way
  equals ``DistributedDataParallel``); ``copy.deepcopy(model)`` carries ``None`` for it.

Observed worst relative error against ``ddp``, the same for the three front ends (they run the same
arithmetic): parameters 1.6e-7 (Muon 2.0e-6), norms 1.7e-7, seen with 5 steps per case; now 3 per case, the list
tests take 30-60 s on 2 cores.

Mutation, seen failing: with the marker not handed out (``_hand_out`` in ``grad_sync.py`` leaving a
split parameter's ``.grad`` ``None``) the filtered list drops the split embedding on every rank, and the
Trainer, Fabric and session tests fail at 2 ranks in 7 s, on every rank: ``('filtered', 'muon'): step 0's
norm 0.41415, ddp's 0.706357`` (the marker test: ``.grad is NoneType, not a SplitGradient``). Without
``fail_fast`` and the Muon cases first they time out instead (see ``fail_fast``).
"""

from __future__ import annotations

import copy
import gc
import importlib
import math
import subprocess
import sys
from typing import Callable

import lightning as L
import pytest
import torch
from lightning.fabric import Fabric
from lightning.pytorch.callbacks import BaseFinetuning
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

import lightning_layerwise as llw
from _dist import LATE_MS, reference_threads, run_distributed
from lightning_layerwise.engine import grad_utils, patches
from lightning_layerwise.engine.init_record import record_init
from helpers import (gpt, gpt_batches as batches, gpt_loss, gpt_optimizer as optimizer, params_of, rel_err,
                     world_trainer as trainer)

TOL = 1e-5


# --- the scope of the patches ------------------------------------------------------------------------------------


def _originals() -> dict[str, object]:
    """The objects the patches replace, as they are now."""
    from lightning.pytorch.utilities import grads as lightning_grads
    from torch.nn.utils import clip_grad

    cell = grad_utils._implementation_cell(clip_grad.clip_grad_norm_)
    return {"clip_grad_norm_": cell.cell_contents if cell is not None else clip_grad.clip_grad_norm_,
            "zero_grad": nn.Module.__dict__["zero_grad"], "grad_norm": lightning_grads.grad_norm.__code__}


def test_importing_the_package_patches_nothing():
    script = (
        "import torch, lightning.pytorch.utilities.grads as g\n"
        "from torch.nn.utils import clip_grad\n"
        "before = (clip_grad.clip_grad_norm_.__closure__[0].cell_contents if clip_grad.clip_grad_norm_.__closure__ "
        "else clip_grad.clip_grad_norm_, torch.nn.Module.__dict__['zero_grad'], g.grad_norm.__code__)\n"
        "import lightning_layerwise\n"
        "after = (clip_grad.clip_grad_norm_.__closure__[0].cell_contents if clip_grad.clip_grad_norm_.__closure__ "
        "else clip_grad.clip_grad_norm_, torch.nn.Module.__dict__['zero_grad'], g.grad_norm.__code__)\n"
        "print(all(a is b for a, b in zip(before, after)), lightning_layerwise.engine.grad_utils.installed())\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "False"], out.stdout + out.stderr


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def _batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)


def _reference_norm(world: int) -> float:
    """One process, the mean of the ranks' losses: the norm every rank must see."""
    model = _model()
    loss = sum(nn.functional.mse_loss(model(x), y) for x, y in map(_batch, range(world))) / world
    loss.backward()
    return torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"), norm_type=2.0).item()


def _same(now: dict, before: dict) -> dict[str, bool]:
    return {key: now[key] is before[key] for key in before}


def _scope_worker(rank: int, world: int) -> dict:
    untouched = _originals()
    out = {}
    model = _model()
    wrapper = llw.LayerwiseDataParallel(model, bucket_size=128)
    out["patched_by_wrapper"] = grad_utils.installed()
    x, y = _batch(rank)
    nn.functional.mse_loss(wrapper(x), y).backward()
    wrapper.finish_grad_sync()
    out["local"] = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")).item()
    with llw.gradient_utilities():
        out["global"] = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")).item()
    out["after_hold"] = _same(_originals(), untouched)
    wrapper.release()

    sessions = [llw.LayerwiseSession(llw.LayerwiseConfig(bucket_size=128)) for _ in range(2)]
    for session in sessions:
        session.wrap(_model(), [])
    out["two_held"] = grad_utils.installed() and not any(_same(_originals(), untouched).values())
    sessions[0].release()
    out["one_held"] = grad_utils.installed() and not any(_same(_originals(), untouched).values())
    sessions[1].release()
    out["none_held"] = not grad_utils.installed()
    out["restored"] = _same(_originals(), untouched)
    return out


def test_the_patches_live_from_wrap_to_release_and_only_there():
    world = 2
    results = run_distributed(_scope_worker, world)
    with reference_threads():
        expected = _reference_norm(world)
    for rank, out in enumerate(results):
        assert not out["patched_by_wrapper"], "building the engine directly patched torch"
        assert abs(out["global"] - expected) <= TOL * expected, (rank, out["global"], expected)
        assert out["two_held"] and out["one_held"] and out["none_held"], out
        for key in out["restored"]:
            assert out["after_hold"][key], f"{key} not restored after the hold"
            assert out["restored"][key], f"{key} not restored after the last release"
    # Without the hold torch clips by this rank's own part: the ranks disagree, and none sees the global norm.
    assert results[0]["local"] != results[1]["local"]
    assert all(out["local"] < expected for out in results)


# --- every patch undone ----------------------------------------------------------------------------------------


def _resolve(what: str) -> object:
    """The object a qualified name names: its longest importable module, then attributes."""
    parts = what.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            found = getattr(found, name)
        return found
    raise ImportError(what)


def _state(found: object) -> tuple:
    """What a patch may replace: the object itself, its code object, what its implementation cell holds."""
    cell = grad_utils._implementation_cell(found) if callable(found) else None
    return found, getattr(found, "__code__", None), cell.cell_contents if cell is not None else None


def _seen(before: tuple, during: tuple, after: tuple) -> tuple[bool, bool]:
    """(replaced while patched, the original back after)."""
    return (any(a is not b for a, b in zip(before, during)), all(a is b for a, b in zip(before, after)))


def _in_process(scope) -> Callable[[list[str]], dict]:
    def drive(names: list[str]) -> dict:
        before = {name: _state(_resolve(name)) for name in names}
        with scope():
            during = {name: _state(_resolve(name)) for name in names}
        return {name: _seen(before[name], during[name], _state(_resolve(name))) for name in names}
    return drive


class _Finetuning(BaseFinetuning):
    def freeze_before_training(self, pl_module):
        pass

    def finetune_function(self, pl_module, current_epoch, optimizer):
        pass


class _Regression(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = _model()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _DuringFit(L.Callback):
    def __init__(self, observe):
        self.observe, self.seen = observe, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.seen is None:
            self.seen = self.observe()


def _stage_worker(rank: int, world: int, names: list[str], root: str) -> dict:
    """A Trainer's patches: each resolved on the Trainer or the callback its qualified name's class matches."""
    model = _Regression()
    finetuning = _Finetuning()

    def observe() -> dict:
        objects = [fit, finetuning]
        out = {}
        for name in names:
            owner, _, attribute = name.rpartition(".")
            holder = next(o for o in objects if isinstance(o, _resolve(owner)))
            out[name] = _state(getattr(holder, attribute))
        return out
    during = _DuringFit(observe)
    fit = trainer(llw.LayerwiseStrategy(shard_parameters=True, bucket_size=128), root, max_steps=2,
                  callbacks=[finetuning, during])
    before = observe()
    fit.fit(model, DataLoader(TensorDataset(*_batch(rank)), batch_size=3))
    after = observe()
    llw.release(model)
    return {name: _seen(before[name], during.seen[name], after[name]) for name in names}


def _on_every_rank(results: list[dict]) -> dict:
    return {name: tuple(all(out[name][i] for out in results) for i in range(2)) for name in results[0]}


_SCOPES = {
    "gradient utilities": _in_process(llw.gradient_utilities),
    "init record": _in_process(lambda: record_init("cpu")),
    "trainer stage": lambda names, root: _on_every_rank(run_distributed(_stage_worker, 2, names, root)),
}


def test_a_patch_undoes_what_it_changed_once_and_a_scope_with_its_last_hold():
    class Owner:
        value = 1

    owner = Owner()
    patch = patches.Patch("Owner.value", "trainer stage")  # not registered: patched_functions() is unchanged
    undo = patch.set_attribute(owner, "value", 2)
    assert owner.value == 2 and patch.applied == 1
    undo()
    undo()
    assert "value" not in vars(owner) and owner.value == 1 and patch.applied == 0
    scope = patches.Scope()
    scope.add(lambda: patch.set_attribute(Owner, "value", 3))
    scope.hold()
    scope.hold()
    scope.release()
    assert Owner.value == 3
    scope.release()
    assert Owner.value == 1 and patch.applied == 0 and "Owner.value" not in patches.patched_functions()


def test_every_patch_is_in_place_only_within_its_scope(tmp_path):
    """For every name ``patched_functions()`` lists (Note [patches] in ``engine/patches.py``): the original object
    before its scope, another inside it (the object, its code object or its implementation cell), the original
    again after. The Trainer's patches are read on the Trainer and a ``BaseFinetuning`` callback of a fit with
    sharded parameters at 2 processes (one process shards nothing). Mutations, seen failing: the strategy's
    teardown leaving its patches in place (the profiler and ``BaseFinetuning`` reported), ``record_init`` not
    undoing its swaps, ``grad_norm``'s install returning an undo that does nothing."""
    names = patches.patched_functions()
    by_scope: dict[str, list[str]] = {}
    for patch in patches.patches():
        by_scope.setdefault(patch.when, []).append(patch.what)
    assert set(by_scope) <= set(_SCOPES), "a scope this test does not drive"
    seen = {}
    for when, listed in by_scope.items():
        drive = _SCOPES[when]
        seen.update(drive(listed, str(tmp_path)) if when == "trainer stage" else drive(listed))
    assert sorted(seen) == sorted(names)
    assert "lightning.pytorch.Trainer.profiler" in names and len(names) >= 12, names
    wrong = {name: found for name, found in seen.items() if found != (True, True)}
    assert wrong == {}, "(replaced while patched, original back after): " + str(wrong)
    assert patches.in_place() == []


# --- torch's clipping on lists of parameters, against ddp --------------------------------------------------


MUON_TOL = 1e-4  # Newton-Schulz amplifies the gradient's rounding (see the module docstring)
BUCKET = 512
STEPS = 3
MAX_NORM = 0.25  # below every step's norm of every list here: clipping scales at each step
LAYER_MAX_NORM = 0.02  # the one-layer list's norms are 0.05-0.08


def max_norm(kind: str) -> float:
    return LAYER_MAX_NORM if kind == "layer" else MAX_NORM
CLIP_VALUE = 2e-3
LISTS = ["filtered", "partial", "all", "layer"]
# Muon first: there every rank owns a whole parameter, so a filtered list is never empty and a wrong norm is
# reported (fail_fast) before a case whose empty list would hang (see the note at fail_fast).
OPTIMIZERS = ["muon", "sgd", "adamw"]
CASES = [(kind, name) for kind in LISTS for name in OPTIMIZERS] + [("value", "sgd")]
FABRIC_CASES = CASES[:-1] + [("fabric", "sgd")]  # fabric.clip_gradients once
RUNS = [pytest.param(2, None, id="2-first"), pytest.param(3, None, id="3-first"),
        pytest.param(2, LATE_MS, id="2-late")]  # each front end once under the timing fuzzer


def clip_list(model: nn.Module, kind: str):
    if kind == "filtered":  # the usual "parameters that have a gradient"
        return [p for p in model.parameters() if p.grad is not None]
    if kind == "partial":  # a fixed part: the embedding (split) and the second block; the first block left out
        return [model.transformer.wte.weight, *model.transformer.h[1].parameters()]
    if kind == "layer":  # one layer, filtered: empty on a rank that steps none of it (it must still take part)
        return [p for p in model.transformer.h[1].mlp.c_fc.parameters() if p.grad is not None]
    return model.parameters()  # the unfiltered generator


def clip(model: nn.Module, kind: str) -> float | None:
    """torch's clipping line of ``kind``; the norm it returned (``None`` for clip_grad_value_)."""
    if kind == "value":
        torch.nn.utils.clip_grad_value_(clip_list(model, "filtered"), CLIP_VALUE)
        return None
    return torch.nn.utils.clip_grad_norm_(clip_list(model, kind), max_norm(kind)).item()


def observe(model: nn.Module, wrapper) -> dict:
    """After the first backward: what this rank steps a piece of (layerwise), which ``.grad`` are markers, and
    the largest gradient element (``ddp``: clip_grad_value_ must clamp something)."""
    names = {p: n for n, p in model.named_parameters()}
    seen = {"split": [], "markers": [n for p, n in names.items() if isinstance(p.grad, llw.SplitGradient)]}
    if wrapper is not None:
        seen["split"] = [n for p, n in names.items() if wrapper.records.piece_of(p) is not None]
    else:
        seen["grad_max"] = max(p.grad.abs().max().item() for p in names if p.grad is not None)
    return seen


def fail_fast(out: dict, case, front: str) -> None:
    """In the worker, right after a case's two runs: its norms must be ``ddp``'s, so a wrong norm fails the test
    at the first case that shows it rather than after every case ran. (Under SGD and AdamW at 2 ranks rank 1
    owns no whole parameter, so a filtered list without the split parameters' markers is empty there; an empty
    list once took part in no collective and the other ranks hung in the norm's all-reduce.) Every rank
    computes the same global norms, so every rank raises."""
    (_, want, _), (_, got, _) = out[(case, "ddp")], out[(case, "layerwise")]
    for step, (g, w) in enumerate(zip(got, want)):
        if g != pytest.approx(w, rel=TOL):
            raise AssertionError(f"{front} {case}: step {step}'s norm {g:.6g}, ddp's {w:.6g}")


def _stale_wrapper_worker(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    stale = llw.LayerwiseDataParallel(_model(), llw.ProcessGroups.single(), bucket_size=128)
    x, y = _batch(rank)
    nn.functional.mse_loss(stale(x), y).backward()
    stale.finish_grad_sync()  # synced and never released: it lives until the garbage collector finds it
    if rank == 0:
        del stale
        gc.collect()  # this rank's collector found it; rank 1's has not yet
    model = _model()
    wrapper = llw.LayerwiseDataParallel(model, bucket_size=128)
    nn.functional.mse_loss(wrapper(x), y).backward()
    wrapper.finish_grad_sync()
    held = [p for p in model.parameters() if p.grad is not None]
    listed = held[:1] if rank == 0 else []  # rank 1 steps none of what rank 0 lists: an empty list there
    with llw.gradient_utilities():
        norm = torch.nn.utils.clip_grad_norm_(listed, max_norm=1e9, norm_type=float("inf")).item()
    out = {"norm": norm, "own": held[0].grad.abs().max().item() if rank == 0 else None}
    wrapper.release()
    return out


def test_an_empty_list_joins_the_norm_whatever_stale_wrappers_a_rank_still_holds():
    """A rank whose list is empty must still join the norm's all-reduce, on the wrapper every rank synced last.
    Here rank 1 still holds an earlier wrapper nobody released (synced, not yet garbage-collected) and rank 0
    does not. Choosing "the one live synced wrapper" made rank 1 find two, run torch's local clipping and leave
    rank 0 waiting in the all-reduce: the whole suite hung on it once, in a forked worker that inherited its
    parent's uncollected wrappers. Both ranks must return the owner's norm (inf-norm: exact)."""
    results = run_distributed(_stale_wrapper_worker, 2, timeout=60)
    assert results[0]["norm"] == results[1]["norm"] == results[0]["own"], results


def my_rows(tokens: torch.Tensor) -> torch.Tensor:
    return tokens.chunk(torch.distributed.get_world_size())[torch.distributed.get_rank()]


# --- Trainer, manual optimization -------------------------------------------------------------------------------------

class Clipping(L.LightningModule):
    def __init__(self, kind: str, opt_name: str):
        super().__init__()
        self.kind, self.opt_name = kind, opt_name
        self.automatic_optimization = False
        self.net = gpt(seed=0)
        self.norms: list[float] = []
        self.seen: dict = {}

    def training_step(self, tokens, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(gpt_loss(self.net, my_rows(tokens)))
        if batch_idx == 0:
            self.seen = observe(self.net, getattr(self.trainer.strategy, "wrapper", None))
        norm = clip(self.net, self.kind)
        if norm is not None:
            self.norms.append(norm)
        opt.step()

    def configure_optimizers(self):
        return optimizer(self.opt_name, self.net)


def _trainer_worker(rank, world, root):
    out = {}
    for case in CASES:
        for name, strategy in (("ddp", "ddp"), ("layerwise", llw.LayerwiseStrategy(bucket_size=BUCKET))):
            model = Clipping(*case)
            # every rank iterates every global batch and takes its rows (my_rows)
            trainer(strategy, root, use_distributed_sampler=False).fit(
                model, DataLoader(batches(STEPS), batch_size=None))
            out[(case, name)] = (params_of(model.net), model.norms, model.seen)
        fail_fast(out, case, "Trainer")
    return out


# --- Fabric --------------------------------------------------------------------------------------------------------

def _fabric_run(world, strategy, kind, opt_name):
    fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()
    raw = gpt(seed=0)
    model, opt = fabric.setup(raw, optimizer(opt_name, raw))
    wrapper = getattr(fabric.strategy, "wrapper", None)
    norms, seen = [], {}
    for step, tokens in enumerate(batches(STEPS)):
        opt.zero_grad()
        fabric.backward(gpt_loss(model, my_rows(tokens)))
        if step == 0:
            seen = observe(raw, wrapper)
        if kind == "fabric":
            norms.append(fabric.clip_gradients(model, opt, max_norm=MAX_NORM).item())
        else:
            norms.append(clip(raw, kind))
        opt.step()
    if wrapper is not None:
        fabric.strategy.teardown()  # waits for the last all-gather: raw holds the trained parameters
    return params_of(raw), norms, seen


def _fabric_worker(rank, world):
    out = {}
    for kind, opt_name in FABRIC_CASES:
        for name, strategy in (("ddp", "ddp"), ("layerwise", llw.LayerwiseFabricStrategy(bucket_size=BUCKET))):
            out[((kind, opt_name), name)] = _fabric_run(world, strategy, kind, opt_name)
        fail_fast(out, (kind, opt_name), "Fabric")
    return out


# --- the plain session -----------------------------------------------------------------------------------------------

def _session_run(kind, opt_name, layerwise: bool, zero_to_none: bool = True):
    model = gpt(seed=0)
    opt = optimizer(opt_name, model)
    if layerwise:
        session = llw.LayerwiseSession(llw.LayerwiseConfig(bucket_size=BUCKET))
        forward = session.wrap(model, opt)
    else:
        session, forward = None, DistributedDataParallel(model)
    norms, seen = [], {}
    for step, tokens in enumerate(batches(STEPS)):
        if zero_to_none:
            opt.zero_grad()
        else:
            model.zero_grad(set_to_none=False)
        loss = gpt_loss(forward, my_rows(tokens))
        session.backward(loss) if layerwise else loss.backward()
        if step == 0:
            seen = observe(model, session.wrapper if layerwise else None)
        norm = clip(model, kind)
        if norm is not None:
            norms.append(norm)
        session.step(opt) if layerwise else opt.step()
    if layerwise:
        session.release()  # waits for the last all-gather
    return params_of(model), norms, seen


def _session_worker(rank, world):
    out = {}
    for case in CASES:
        for name in ("ddp", "layerwise"):
            out[(case, name)] = _session_run(*case, layerwise=name == "layerwise")
        fail_fast(out, case, "session")
    return out


# --- the comparison --------------------------------------------------------------------------------------------------

WORST: dict[str, list[float]] = {}


def check_against_ddp(results: list[dict], cases, front: str, world: int, late_ms) -> None:
    """Norms step by step, then every parameter; then that the layerwise run split and marked something."""
    worst = WORST.setdefault(front, [0.0, 0.0, 0.0])  # parameters (not Muon), parameters (Muon), norms
    for rank, out in enumerate(results):
        for case in cases:
            kind, opt_name = case
            (want, want_norms, want_seen), (got, got_norms, got_seen) = out[(case, "ddp")], out[(case, "layerwise")]
            what = f"{front} {kind} list, {opt_name}, {world} ranks, rank {rank}" + (" (late)" if late_ms else "")
            assert len(got_norms) == len(want_norms) == (0 if kind == "value" else STEPS), what
            for step, (g, w) in enumerate(zip(got_norms, want_norms)):
                assert g == pytest.approx(w, rel=TOL), f"{what}: step {step}'s norm {g:.6g}, ddp's {w:.6g}"
                worst[2] = max(worst[2], abs(g - w) / w)
            tol = MUON_TOL if opt_name == "muon" else TOL
            assert got.keys() == want.keys(), what
            for n in want:
                err = rel_err(got[n], want[n])
                assert err <= tol, f"{what}: {n} differs from ddp by {err:.2e}"
                worst[opt_name == "muon"] = max(worst[opt_name == "muon"], err)
            initial = params_of(gpt(seed=0))
            assert max(rel_err(got[n], initial[n]) for n in initial) > 1e-3, f"{what}: training changed nothing"
            if kind == "value":
                assert want_seen["grad_max"] > 2 * CLIP_VALUE, f"{what}: clip_grad_value_ clamped nothing"
            else:
                assert min(want_norms) > max_norm(kind), f"{what}: clipping did not scale at every step: {want_norms}"
            # not vacuous: this rank steps a piece of a split parameter, and the filter kept its marker
            assert "transformer.wte.weight" in got_seen["split"], f"{what}: nothing split here: {got_seen}"
            assert "transformer.wte.weight" in got_seen["markers"], f"{what}: no SplitGradient: {got_seen}"
            assert not want_seen["markers"], what
    print(f"\n{front}, {world} ranks{' (late)' if late_ms else ''}: worst relative error so far "
          f"{worst[0]:.1e} (Muon {worst[1]:.1e}), norms {worst[2]:.1e}")


@pytest.mark.slow
@pytest.mark.parametrize("world, late_ms", RUNS)
def test_trainer_manual_clipping_on_lists_matches_ddp(world, late_ms, tmp_path):
    results = run_distributed(_trainer_worker, world, str(tmp_path), late_ms=late_ms)
    check_against_ddp(results, CASES, "Trainer", world, late_ms)


@pytest.mark.slow
@pytest.mark.parametrize("world, late_ms", RUNS)
def test_fabric_clipping_on_lists_matches_ddp(world, late_ms):
    results = run_distributed(_fabric_worker, world, late_ms=late_ms)
    check_against_ddp(results, FABRIC_CASES, "Fabric", world, late_ms)


@pytest.mark.slow
@pytest.mark.parametrize("world, late_ms", RUNS)
def test_session_clipping_on_lists_matches_ddp(world, late_ms):
    results = run_distributed(_session_worker, world, late_ms=late_ms)
    check_against_ddp(results, CASES, "session", world, late_ms)


# --- lists that disagree across ranks --------------------------------------------------------------------------------

def _disagreeing_worker(rank, world):
    model = gpt(seed=0)
    opt = optimizer("muon", model)  # Muon: rank 1 owns whole matrices and steps a piece of the embedding
    session = llw.LayerwiseSession(llw.LayerwiseConfig(bucket_size=BUCKET))
    wrapper = session.wrap(model, opt)
    names = {p: n for n, p in model.named_parameters()}
    opt.zero_grad()
    session.backward(gpt_loss(wrapper, my_rows(batches(1)[0])))
    owned = next(p for p in model.parameters() if wrapper.records.owns(p))
    piece = next(p for p in model.parameters() if wrapper.records.piece_of(p) is not None)
    outcomes = []
    for left_out, norm_type in ((owned, 2.0), (piece, 2.0), (owned, 1.0), (piece, math.inf)):
        # rank 0 lists everything; rank 1 leaves out a parameter whose gradient it holds
        params = list(model.parameters()) if rank == 0 else [p for p in model.parameters() if p is not left_out]
        try:
            torch.nn.utils.clip_grad_norm_(params, 1e9, norm_type)
            outcomes.append(None)
        except ValueError as error:
            outcomes.append(str(error))
    # the same parameters by another route: unfiltered on rank 0, filtered on rank 1
    mixed = model.parameters() if rank == 0 else [p for p in model.parameters() if p.grad is not None]
    mixed_norm = torch.nn.utils.clip_grad_norm_(mixed, 1e9).item()
    full_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9).item()  # no collective left hanging
    session.step(opt)
    session.release()
    return names[owned], names[piece], outcomes, mixed_norm, full_norm


def test_lists_that_disagree_across_ranks_raise_the_same_error_on_every_rank():
    results = run_distributed(_disagreeing_worker, 2, timeout=120.0)
    owned, piece = results[1][0], results[1][1]  # what rank 1 left out
    assert owned != piece
    expected = [owned, piece, owned, piece]
    for rank, (_, _, outcomes, mixed_norm, full_norm) in enumerate(results):
        for i, (message, name) in enumerate(zip(outcomes, expected)):
            assert message is not None, f"rank {rank}, case {i}: no error"
            assert message == results[0][2][i], f"rank {rank}, case {i}: another message than rank 0's"
            assert "different parameters on different ranks" in message and repr(name) in message, message
        assert mixed_norm == pytest.approx(full_norm, rel=TOL) and full_norm == results[0][4] > 0


# --- a split parameter's .grad -----------------------------------------------------------------------------------

READS = {
    "sum": lambda g: g.sum(),
    "clone": lambda g: g.clone(),
    "norm": lambda g: g.norm(),
    "mul": lambda g: g * 2,
    "tolist": lambda g: g.tolist(),
    "torch.linalg.vector_norm": lambda g: torch.linalg.vector_norm(g),
}


def _split_grad_worker(rank, world):
    model = gpt(seed=0)
    opt = optimizer("adamw", model)
    session = llw.LayerwiseSession(llw.LayerwiseConfig(bucket_size=BUCKET))
    wrapper = session.wrap(model, opt)
    opt.zero_grad()
    session.backward(gpt_loss(wrapper, my_rows(batches(1)[0])))
    p = model.transformer.wte.weight
    assert wrapper.records.piece_of(p) is not None
    g = p.grad
    if not isinstance(g, llw.SplitGradient):  # now, before the loops below (see fail_fast)
        raise AssertionError(f"rank {rank}: the split parameter's .grad is {type(g).__name__}, not a SplitGradient")
    facts = {"metadata": (g.shape, g.dtype, g.device) == (p.shape, p.dtype, p.device), "errors": {}}
    for what, read in READS.items():
        try:
            read(g)
            facts["errors"][what] = None
        except llw.SplitGradientError as error:
            facts["errors"][what] = str(error)
    model.zero_grad(set_to_none=False)  # passes: the marker holds nothing to zero
    facts["after_zero_grad"] = isinstance(p.grad, llw.SplitGradient)
    twin = copy.deepcopy(model)
    facts["copy_grad"] = twin.transformer.wte.weight.grad
    facts["copy_equal"] = all(torch.equal(a, b) for a, b in zip(twin.parameters(), model.parameters()))
    session.step(opt)
    session.release()
    # A loop clearing with model.zero_grad(set_to_none=False): the marker stays into the next backward.
    want, want_norms, _ = _session_run("filtered", "sgd", layerwise=False, zero_to_none=False)
    got, got_norms, _ = _session_run("filtered", "sgd", layerwise=True, zero_to_none=False)
    return facts, (want, want_norms), (got, got_norms)


def test_a_split_parameters_grad_is_a_marker_that_cannot_be_read():
    for rank, (facts, (want, want_norms), (got, got_norms)) in enumerate(run_distributed(_split_grad_worker, 2)):
        assert facts["metadata"], facts
        for what, message in facts["errors"].items():
            assert message is not None, f"rank {rank}: {what} read a SplitGradient without an error"
            assert "'transformer.wte.weight'" in message and "elementwise_fill=False" in message, message
        assert facts["after_zero_grad"], "model.zero_grad(set_to_none=False) replaced the marker"
        assert facts["copy_grad"] is None and facts["copy_equal"], facts
        # the loop that clears with zero_grad(set_to_none=False) equals DistributedDataParallel's
        for g, w in zip(got_norms, want_norms, strict=True):
            assert g == pytest.approx(w, rel=TOL)
        for n in want:
            assert rel_err(got[n], want[n]) <= TOL, f"rank {rank}: {n} differs by {rel_err(got[n], want[n]):.2e}"


def _recompile_worker(rank, world):
    from _dist import counting_compiler

    backend, graphs = counting_compiler()
    fabric = Fabric(accelerator="cpu", devices=world, strategy=llw.LayerwiseFabricStrategy(bucket_size=BUCKET))
    fabric.launch()
    model = gpt(seed=0)
    opt = optimizer("adamw", model)
    wrapped, opt = fabric.setup(torch.compile(model, backend=backend), opt)
    split = [n for n, p in model.named_parameters() if fabric.strategy.wrapper.records.piece_of(p) is not None]
    for step, tokens in enumerate(batches(4)):
        tokens = tokens if step < 2 else tokens[:, : tokens.shape[1] // 2]  # a new shape: dynamo recompiles
        opt.zero_grad()
        fabric.backward(gpt_loss(wrapped, my_rows(tokens)))
        opt.step()
    fabric.strategy.teardown()
    return split, len(graphs)


def test_a_recompile_inspects_split_gradients_without_reading_them():
    """torch.compile's guards look at every parameter's ``.grad`` when it recompiles (``_is_view``, strides,
    ``_base``...): a split parameter's marker lets every attribute through but its values. A batch of another
    shape after two steps recompiles the model with the markers in place."""
    for split, compiles in run_distributed(_recompile_worker, 2):
        assert "transformer.wte.weight" in split, split
        assert compiles >= 2, f"the new shape did not recompile ({compiles} graph(s))"
