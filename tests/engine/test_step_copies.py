"""Device copies per steady-state step, counted by a ``TorchDispatchMode`` (``lightning_layerwise.testing.op_counts``).

On one process, under every way of clearing gradients (``optimizer.zero_grad()`` with ``set_to_none`` either way,
``model.zero_grad()``) and every front door (the bare wrapper loop, ``LayerwiseSession``, the Trainer with AdamW,
Muon and ``bf16-mixed``, manual optimization, Fabric), a step after the first makes no per-parameter copy of
gradients or parameters (Note [in-place gradients] in ``engine/grad_sync.py``; the table in ``docs/design.md``,
"What a step copies"). Each case has a budget of ``aten.copy_`` + ``aten.clone`` calls per step, fewer than the
model's 12 parameters, and a budget of copies touching the wrapper's buffers. What the budgets allow, by case:

* ``set_to_none=False``: the gradients are zeroed, not cleared, so they are held: one clone of the bucket's own
  shard, carried into the next reduction (Note [gradient lifecycle]);
* the session: the norm's one ``copy_`` of its all-reduced payload (``shard_sum`` in ``engine/clip_reductions.py``);
* the Trainer's automatic optimization: Lightning's clone of the loss;
* Muon: Newton-Schulz stacks each matrix's update into one batch (``_stack_as`` in ``optim/orthogonalization.py``).

A step with no backward after a forward that restarted accumulation steps nothing, as plain torch would, and the
patterns around that restart train bitwise as plain torch does.
"""

from __future__ import annotations

import contextlib
import os

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.fabric import Fabric
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_layerwise as llw
from lightning_layerwise import LayerwiseDataParallel, ProcessGroups
from lightning_layerwise.testing.op_counts import BUFFER_COPIES, OpCounts, copies

STEPS = 5  # the counts are of the fifth: the first step builds state, and every later one is alike


def net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(16, 16) for _ in range(6)])  # 12 parameters, one bucket


def inputs() -> torch.Tensor:
    return torch.randn(4, 16, generator=torch.Generator().manual_seed(1))


def counted_loop(step, wrapper) -> OpCounts:
    """``step()`` ``STEPS`` times, each one marked."""
    counts = OpCounts()
    counts.watch(wrapper)
    with counts:
        for _ in range(STEPS):
            counts.mark()
            step()
        counts.mark()
    return counts


def assert_within(counts: OpCounts, total: int, in_buffers: int, what: str) -> None:
    step = counts.per_step(STEPS - 1)
    assert copies(step) <= total, f"{what}: {copies(step)} copies in a step (budget {total}): {step}"
    assert step.get(BUFFER_COPIES, 0) <= in_buffers, f"{what}: {step[BUFFER_COPIES]} copies of the buffers"


def clear(how, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    if how == "model":
        model.zero_grad()
    else:
        optimizer.zero_grad(set_to_none=how)


# --- the bare wrapper and the session --------------------------------------------------------------------------------

@pytest.mark.parametrize("how, total, in_buffers", [(True, 0, 0), ("model", 0, 0), (False, 1, 1)])
@pytest.mark.parametrize("zero_first", [True, False], ids=["zero_grad_first", "zero_grad_last"])
def test_the_bare_wrapper_loop_copies_no_gradient(how, total, in_buffers, zero_first):
    model = net()
    wrapper = LayerwiseDataParallel(model, ProcessGroups.single())
    optimizer = torch.optim.AdamW(model.parameters())
    x = inputs()

    def step():
        if zero_first:
            clear(how, model, optimizer)
        wrapper(x).square().mean().backward()
        wrapper.finish_grad_sync()
        optimizer.step()
        wrapper.start_param_sync()
        if not zero_first:
            clear(how, model, optimizer)

    assert_within(counted_loop(step, wrapper), total, in_buffers, f"bare loop, zero_grad({how})")


def test_the_session_loop_copies_no_gradient():
    model = net()
    optimizer = torch.optim.AdamW(model.parameters())
    session = llw.LayerwiseSession(llw.LayerwiseConfig())
    wrapped = session.wrap(model, optimizer)
    x = inputs()

    def step():
        optimizer.zero_grad(set_to_none=True)
        session.backward(wrapped(x).square().mean())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        session.step(optimizer)

    try:
        assert_within(counted_loop(step, session.wrapper), 1, 0, "session")
    finally:
        session.release()


def test_a_step_without_backward_after_a_cleared_forward_steps_nothing():
    """The forward restarted accumulation (the slots are the ``.grad``); with no backward the step finds no
    gradient, as plain torch's would after ``zero_grad()``."""
    def train(wrapped: bool) -> list[torch.Tensor]:
        model = net()
        optimizer = torch.optim.AdamW(model.parameters())
        session = llw.LayerwiseSession(llw.LayerwiseConfig()) if wrapped else None
        forward = session.wrap(model, optimizer) if wrapped else model
        for i in range(4):
            optimizer.zero_grad()
            loss = forward(inputs()).square().mean()
            if i != 2:  # the third step skips its backward
                session.backward(loss) if wrapped else loss.backward()
            session.step(optimizer) if wrapped else optimizer.step()
        if wrapped:
            session.release()
        return [p.detach().clone() for p in model.parameters()]

    for got, want in zip(train(True), train(False), strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("pattern", ["zero_grad_twice", "no_grad_forward_between", "no_sync_micro_batches",
                                     "never_cleared"])
def test_the_bare_loop_equals_plain_torch_bitwise(pattern):
    """Around the forward's restart: ``zero_grad`` again between the forward and the backward (the copy path), a
    forward under ``no_grad`` between steps, micro-batches under ``no_sync``, gradients never cleared (carried)."""
    def train(wrapped: bool) -> list[torch.Tensor]:
        model = net()
        optimizer = torch.optim.AdamW(model.parameters())
        wrapper = LayerwiseDataParallel(model, ProcessGroups.single()) if wrapped else None
        forward = wrapper if wrapped else model
        no_sync = wrapper.no_sync if wrapped else contextlib.nullcontext
        x = inputs()
        for i in range(4):
            if pattern != "never_cleared":
                optimizer.zero_grad()
            loss = forward(x * (i + 1)).square().mean()
            if pattern == "zero_grad_twice":
                optimizer.zero_grad()
            if pattern == "no_sync_micro_batches":
                with no_sync():
                    loss.backward()
                loss = forward(x * (i + 2)).square().mean()
            loss.backward()
            if wrapped:
                wrapper.finish_grad_sync()
            optimizer.step()
            if wrapped:
                wrapper.start_param_sync()
            if pattern == "no_grad_forward_between":
                with torch.no_grad():
                    forward(x)
        return [p.detach().clone() for p in model.parameters()]

    for got, want in zip(train(True), train(False), strict=True):
        assert torch.equal(got, want), pattern


# --- Lightning: the Trainer and Fabric -------------------------------------------------------------------------------

@pytest.fixture
def one_process_group():
    """The Trainer and Fabric on one CPU device start a gloo group of one in this process and set the launch
    variables (``MASTER_PORT``, ``LOCAL_RANK``...) in its environment: both end with the test, so that the tests
    after it fork their ranks from a process without a group, and the processes they start launch their own ranks
    instead of taking themselves for a launched one."""
    environ = dict(os.environ)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(environ)


class Net(L.LightningModule):
    def __init__(self, optimizer: str = "adamw", manual: bool = False):
        super().__init__()
        self.net = net()
        self.optimizer = optimizer
        self.automatic_optimization = not manual

    def training_step(self, batch, batch_idx):
        loss = self.net(batch[0]).square().mean()
        if self.automatic_optimization:
            return loss
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        return None

    def configure_optimizers(self):
        if self.optimizer == "muon":
            return llw.Muon(llw.muon_param_groups(self), lr=0.02)
        return torch.optim.AdamW(self.parameters())


class Marks(L.Callback):
    def __init__(self, counts: OpCounts):
        self.counts = counts

    def on_train_start(self, trainer, pl_module):
        self.counts.watch(trainer.strategy.wrapper)

    def on_train_batch_start(self, *args):
        self.counts.mark()


@pytest.mark.parametrize("optimizer, precision, manual, total", [
    ("adamw", "32-true", False, 1),
    ("muon", "32-true", False, 7),
    ("adamw", "bf16-mixed", False, 1),
    ("adamw", "32-true", True, 0),
], ids=["adamw", "muon", "bf16-mixed", "manual"])
def test_the_trainer_copies_no_gradient(optimizer, precision, manual, total, one_process_group):
    counts = OpCounts()
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy="layerwise", max_steps=STEPS + 1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        precision=precision, callbacks=[Marks(counts)])
    data = DataLoader(TensorDataset(torch.randn(4 * (STEPS + 1), 16)), batch_size=4)
    with counts:
        trainer.fit(Net(optimizer, manual), data)
    assert_within(counts, total, 0, f"Trainer {optimizer} {precision} manual={manual}")


@pytest.mark.parametrize("set_to_none, total", [(True, 0), (False, 1)])
def test_fabric_copies_no_gradient(set_to_none, total, one_process_group):
    fabric = Fabric(accelerator="cpu", devices=1, strategy="layerwise")
    fabric.launch()
    model = net()
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters()))
    x = inputs()

    def step():
        optimizer.zero_grad(set_to_none=set_to_none)
        fabric.backward(model(x).square().mean())
        optimizer.step()

    try:
        assert_within(counted_loop(step, fabric.strategy.wrapper), total, total, f"Fabric set_to_none={set_to_none}")
    finally:
        fabric.strategy.teardown()
