"""The engine's two sides built alone, from a few buffers and a process group, with no module wrapper.

* ``ParameterSync`` over two hand-made buckets (8 and 16 elements) on 2 and 3 gloo ranks: each rank
  writes its rank number into its own shard of the param buffer; after ``start`` the buckets are
  queued and at most ``prefetch_depth`` (1) all-gathers are in flight; a read of a parameter viewing the
  second bucket waits for it through the read guard (counted in ``guarded_reads``), dispatching the
  first bucket before it (the fixed order); after ``finish`` every element holds its owner's number on
  every rank, every bucket is ``READY``, and the traced events are the four dispatches and waits in
  forward order. Also run with every collective delayed on a worker thread (the timing fuzzer).
* ``GradientSync`` over one bucket holding two parameters, each inside one shard (so each owned whole by
  one rank), on 2 and 3 ranks: two backward passes, the first inside ``no_sync``, and ``finish``: the
  owner's ``.grad`` is the mean over ranks of the two passes' sum (float32, exact here: small integers),
  the other rank's is ``None``, the bucket is ``REDUCED``; the global norm from the shards equals the
  norm of the gradients. A second step restarts the bucket (``ACCUMULATING``) before its gradients
  arrive: the cleared gradient of ``a`` starts from zero, the held one of ``b`` is carried and added to,
  as ``.grad`` accumulates under ``ddp``.
* A bucket refuses a move out of order: waiting for a gather never dispatched, dispatching a
  reduce-scatter twice (``BucketStateError``), without any collective.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from _dist import LATE_MS, run_distributed

from lightning_layerwise.engine import read_guard
from lightning_layerwise.engine.buffers import Bucket, BucketStateError, FlatBuffer, GradState, ParamState
from lightning_layerwise.engine.grad_records import GradRecord, GradUnit
from lightning_layerwise.engine.grad_sync import GradientSync
from lightning_layerwise.engine.param_records import ParamRecord, ParamRecords
from lightning_layerwise.engine.param_sync import ParameterSync
from lightning_layerwise.engine.process_groups import ProcessGroups
from lightning_layerwise.engine.waiter import Waiter
from lightning_layerwise.layout import ParamSlot, Piece


def _bucket(index: int, params: list, data: torch.Tensor, grads: torch.Tensor, world: int, rank: int) -> Bucket:
    group = dist.group.WORLD
    return Bucket(0, index, params, data, grads, first_param=index, group=group, gather_group=group,
                  shards=world, rank=rank)


def _param_sync_worker(rank: int, world: int) -> dict:
    sizes = [8 * world, 16 * world]  # equal shards of 8 and 16 elements
    flat = torch.zeros(sum(sizes))
    params, buckets, start = [], [], 0
    for i, size in enumerate(sizes):
        data = flat[start:start + size]
        param = nn.Parameter(data.view(world, -1))  # a view of the bucket, as the wrapper's parameters are
        params.append(param)
        buckets.append(_bucket(i, [param], data, torch.zeros(size), world, rank))
        start += size
    waiter = Waiter(rank, world, trace=True)
    sync = ParameterSync(buckets, {p: f"p{i}" for i, p in enumerate(params)}, waiter, prefetch_depth=1,
                         read_guard="wait")
    for p in params:
        read_guard.attach(p, sync.on_pending_read)
    for b in buckets:  # this rank's optimizer step: its shard only
        begin, end = b.shard
        b.param.data[begin:end] = float(rank + 1)
    sync.start()
    out = {"after_start": [b.param.state.value for b in buckets], "in_flight": len(sync._in_flight)}
    out["read"] = params[1].detach().clone()  # waits for bucket 1, and bucket 0 before it
    out["guarded"] = sync.guarded_reads
    sync.finish()
    out["states"] = [b.param.state.value for b in buckets]
    out["values"] = flat.clone()
    out["events"] = list(waiter.events)
    for p in params:
        read_guard.detach(p)
    return out


@pytest.mark.parametrize("world, late_ms", [(2, None), (3, None), (2, LATE_MS)], ids=["2", "3", "2-late"])
def test_parameter_sync_alone_gathers_in_order_and_reads_wait(world, late_ms):
    expected = torch.cat([torch.arange(1, world + 1).float().repeat_interleave(n) for n in (8, 16)])
    for rank, out in enumerate(run_distributed(_param_sync_worker, world, late_ms=late_ms)):
        assert out["after_start"] == ["gathering", "stepped"] and out["in_flight"] == 1, out
        assert torch.equal(out["read"].flatten(), expected[8 * world:]), (rank, out["read"])
        assert out["guarded"] == 1
        assert out["states"] == ["ready", "ready"]
        assert torch.equal(out["values"], expected), (rank, out["values"])
        assert out["events"] == [("ag_dispatch", "0.0"), ("ag_wait", "0.0"), ("ag_dispatch", "0.1"),
                                 ("ag_wait", "0.1")], out["events"]


def _grad_sync_worker(rank: int, world: int) -> dict:
    shard = 4
    param_data, grad_data = torch.zeros(shard * world), torch.zeros(shard * world)
    a = nn.Parameter(param_data[0:3])  # inside shard 0: owned by rank 0
    b = nn.Parameter(param_data[shard:shard + 2])  # inside shard 1: owned by rank 1
    bucket = _bucket(0, [a, b], param_data, grad_data, world, rank)
    records = []
    for p, name, offset, owner in ((a, "a", 0, 0), (b, "b", shard, 1)):
        view = grad_data[offset:offset + p.numel()]
        gradient = GradRecord(p, view, bucket)
        slot = ParamSlot(name, tuple(p.shape), 0, 0, offset, (Piece(owner, 0, p.numel()),))
        unit = GradUnit(p, p, view, bucket, gradient) if owner == rank else None
        records.append(ParamRecord(p, name, slot, bucket, gradient, unit))
    sync = GradientSync([bucket], [FlatBuffer(param_data, grad_data)], ParamRecords(records),
                        Waiter(rank, world), groups=ProcessGroups.create(), layout_group=dist.group.WORLD)
    out = {}
    for step in range(2):
        if step:
            a.grad = None  # cleared (optimizer.zero_grad); b's gradient is still held, so it is carried
            sync.prepare_backward()
            out["restarted"] = bucket.grad.state.value
        with sync.no_sync():
            ((rank + 1) * a.sum() + 2 * (rank + 1) * b.sum()).backward()
        (a.sum() + b.sum()).backward()
        sync.finish()
    out["state"] = bucket.grad.state.value
    out["a"] = None if a.grad is None else a.grad.clone()
    out["b"] = None if b.grad is None else b.grad.clone()
    out["norm_sq"] = sync.grad_norm_squared().item()
    sync.release()
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_gradient_sync_alone_accumulates_reduces_and_hands_out(world):
    mean_a = sum(r + 1 + 1 for r in range(world)) / world  # per element: (r + 1) from no_sync, 1 after it
    mean_b = 2 * sum(2 * (r + 1) + 1 for r in range(world)) / world  # carried into the second step
    for rank, out in enumerate(run_distributed(_grad_sync_worker, world)):
        assert out["restarted"] == "accumulating" and out["state"] == "reduced", out
        assert (out["a"] is not None) == (rank == 0) and (out["b"] is not None) == (rank == 1), out
        if rank == 0:
            assert torch.equal(out["a"], torch.full((3,), mean_a)), out["a"]
        if rank == 1:
            assert torch.equal(out["b"], torch.full((2,), mean_b)), out["b"]
        assert out["norm_sq"] == pytest.approx(3 * mean_a ** 2 + 2 * mean_b ** 2, rel=1e-6)


def test_a_bucket_refuses_moves_out_of_order():
    bucket = Bucket(0, 3, [], torch.zeros(4), torch.zeros(4), first_param=0)
    assert bucket.param.state is ParamState.READY and bucket.grad.state is GradState.ACCUMULATING
    with pytest.raises(BucketStateError, match="bucket 0.3: param_state ready cannot become ready"):
        bucket.param.finish_gather()
    bucket.grad.start_reduce()  # one process: no group, nothing sent
    with pytest.raises(BucketStateError, match="grad_state reducing cannot become reducing"):
        bucket.grad.start_reduce()
    bucket.grad.finish_reduce()
    assert bucket.grad.state is GradState.REDUCED
