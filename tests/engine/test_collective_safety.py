"""Collective hygiene that matters most on GPUs, checked on gloo ranks.

* Gradients are averaged without dividing them first (Note [averaging]): bf16 gradients
  reduce to the fp32 mean rounded once.
* No buffer of an in-flight reduce-scatter is touched: ``zero_grad_buffer`` and
  ``release`` wait for pending reduce-scatters first.
* Module buffers (BatchNorm statistics) are broadcast as one collective per forward.

Each test fails when its fix is reverted (see each docstring for what the old code did).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import lightning_layerwise as llw
from lightning_layerwise.engine import collectives
from _dist import run_distributed


class Scaled(nn.Module):
    """``loss = sum(weight * c)``: the gradient of ``weight`` is exactly ``c``."""

    def __init__(self, n: int, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n, dtype=dtype))

    def forward(self, c):
        return (self.weight * c).sum()


def rank_gradients(world: int, n: int) -> torch.Tensor:
    """Small integers: exact in bf16, and so is their sum; only the mean needs rounding."""
    g = torch.Generator().manual_seed(7)
    return torch.randint(-40, 41, (world, n), generator=g).to(torch.bfloat16)


def _average_worker(rank, world, n):
    model = Scaled(n, torch.bfloat16)
    wrapper = llw.LayerwiseDataParallel(model, bucket_size=n * world)
    wrapper(rank_gradients(world, n)[rank]).backward()
    wrapper.finish_grad_sync()
    grad = model.weight.grad
    return None if grad is None else grad.clone()


def test_bf16_gradients_average_to_the_fp32_mean_rounded_once():
    """Before: each rank divided its bf16 gradient by the world size, then gloo summed the rounded
    parts: at 3 ranks 49% of the elements differed from the correctly rounded mean."""
    world, n = 3, 256
    want = (rank_gradients(world, n).float().sum(0) / world).to(torch.bfloat16)
    grads = [g for g in run_distributed(_average_worker, world, n) if g is not None]
    assert len(grads) == 1  # one owner
    assert torch.equal(grads[0], want), (grads[0] != want).float().mean().item()


class FakeGroup:
    """A stand-in process group: compared by identity, weakly referenceable (as ``dist.ProcessGroup`` is)."""


def test_average_in_the_reduction_where_the_probe_found_it(monkeypatch):
    """A group whose probe found the reduce-scatter averaging (NCCL; gloo in torch 2.13) is reduced with
    ``ReduceOp.AVG``; one that does not, or was never probed, reduces the sum and the wait divides (Note
    [averaging] in engine/collectives.py). The backend's name plays no part."""

    class FakeWork:
        def wait(self):
            pass

    calls = []

    def fake_reduce_scatter(output, input, op, group, async_op):
        calls.append(op)
        output.copy_(input.chunk(2)[1] * 2)  # rank 1 of 2; every rank sent the same values
        return FakeWork()

    monkeypatch.setattr(collectives, "_reduce_scatter_single", fake_reduce_scatter)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")  # never consulted
    averaging, summing, unprobed = FakeGroup(), FakeGroup(), FakeGroup()
    monkeypatch.setitem(collectives._AVERAGING, averaging, {"cpu": frozenset({"reduce_scatter"})})
    monkeypatch.setitem(collectives._AVERAGING, summing, {"cpu": frozenset({"all_reduce"})})
    for group, op in ((averaging, dist.ReduceOp.AVG), (summing, dist.ReduceOp.SUM), (unprobed, dist.ReduceOp.SUM)):
        bucket = torch.arange(8, dtype=torch.float32)
        shard = collectives.reduce_scatter_bucket(bucket, group=group, average=True).wait()
        assert calls[-1] == op
        if op == dist.ReduceOp.SUM:
            assert torch.equal(shard, torch.arange(4, 8, dtype=torch.float32))  # 2 * x / 2


class WaitRecorder:
    """Wraps a collective's work handle and records whether ``wait`` was called."""

    def __init__(self, work, log):
        self.work, self.log = work, log

    def wait(self):
        self.log.append("wait")
        return self.work.wait()


def _in_flight_worker(rank, world, method):
    log = []
    real = collectives.reduce_scatter_bucket

    def recording(bucket, group, async_op=True, average=False):
        result = real(bucket, group, async_op=async_op, average=average)
        if result.work is not None:
            result.work = WaitRecorder(result.work, log)
            log.append("dispatch")
        return result

    collectives.reduce_scatter_bucket = recording
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    wrapper = llw.LayerwiseDataParallel(model, bucket_size=64)
    wrapper(torch.randn(3, 8)).sum().backward()  # reduce-scatters dispatched during backward, not waited
    dispatched = log.count("dispatch")
    log.append("zero" if method == "zero_grad_buffer" else "release")
    getattr(wrapper.grad_sync if method == "zero_grad_buffer" else wrapper, method)()
    return dispatched, log


def test_zero_grad_buffer_and_release_wait_for_in_flight_reduce_scatters():
    """Before: ``zero_grad_buffer`` zeroed the buffer under a pending reduce-scatter and dropped its
    handle; ``release`` freed the buffers. On NCCL the collective then reads zeros or freed memory."""
    for method in ("zero_grad_buffer", "release"):
        for dispatched, log in run_distributed(_in_flight_worker, 2, method):
            assert dispatched >= 2, log
            assert log.count("wait") == dispatched, f"{method}: every dispatched reduce-scatter is waited: {log}"


class Normed(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 6)
        self.bn1 = nn.BatchNorm1d(6)
        self.bn2 = nn.BatchNorm1d(6)

    def forward(self, x):
        return self.bn2(self.bn1(self.fc(x)))


def _buffers_worker(rank, world):
    torch.manual_seed(0)
    model = Normed()
    wrapper = llw.LayerwiseDataParallel(model)
    with torch.no_grad():  # rank-specific statistics: the broadcast must replace them with rank 0's
        for i, b in enumerate(model.buffers()):
            b.copy_(torch.full_like(b, 10 * rank + i))
    calls = []
    real = dist.broadcast

    def counting(tensor, *args, **kwargs):
        calls.append(tensor.dtype)
        return real(tensor, *args, **kwargs)

    dist.broadcast = counting
    wrapper._broadcast_module_buffers()
    after_broadcast = {n: b.clone() for n, b in model.named_buffers()}
    wrapper(torch.randn(5, 4)).sum().backward()  # a training forward broadcasts once more
    dist.broadcast = real
    return calls, after_broadcast


def test_module_buffers_are_broadcast_as_one_collective():
    """Before: one broadcast per buffer (6 here, of two dtypes) at every training forward."""
    results = run_distributed(_buffers_worker, 3)
    for calls, after in results:
        assert len(calls) == 2, calls  # one for the explicit call, one for the forward
        for i, (name, value) in enumerate(after.items()):
            assert torch.equal(value, torch.full_like(value, i)), (name, value)  # rank 0's values
