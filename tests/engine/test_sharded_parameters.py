"""Sharded parameters (``shard_parameters=True``) against one process on the same global batch.

Each case trains 10 steps through a :class:`~lightning_layerwise.LayerwiseSession` on 2, 3 or 4 gloo ranks and
compares every parameter after the last step with a single-process run (fp32, relative error <= 1e-5),
every rank's copy bitwise equal to rank 0's:

* ``Net`` (tests/engine/test_data_parallel.py): a tied embedding and output layer, a layer used twice, a
  frozen and an unused layer, odd shapes;
* ``AttentionNet``: ``nn.MultiheadAttention`` (reads ``out_proj.weight`` without calling ``out_proj``), an
  ``nn.TransformerEncoderLayer`` under activation checkpointing (reentrant and not), and a parent that reads
  ``head.weight`` for a penalty before any module runs;
* AdamW (element-wise fill: parameters split across shards, stepped in pieces) and Muon (whole matrices);
* micro-batches accumulated inside ``no_sync`` and without it (each backward reduces and adds into the
  shard), with clipping by global norm; ``reshard_after_forward=False``; small buckets (many per model)
  and one bucket; 4 ranks as two owner groups of 2 (shards replicated across the groups, each shard's step
  shared between its two replicas: Note [replica sharing] in ``layout/sharing.py``).

Every case also runs under the timing fuzzer (collectives up to ``LATE_MS`` late). Between steps and at
the end of every backward no bucket is full and no full gradient buffer is held. Two mutations show the
tests can fail: a backward that does not gather what it unpacks, and an all-gather that is not waited for.
Memory by storage bytes: ``tests/engine/test_sharded_memory.py``.
"""

from __future__ import annotations

import functools

import pytest
import torch

import lightning_layerwise as llw
from _dist import LATE_MS, reference_threads, run_distributed
from helpers import (nothing_full, rel_err, sharded_batches as batches, sharded_loss as loss_of,
                     sharded_model as make_model, sharded_optimizer as make_optimizer)
from lightning_layerwise.engine import sharded
from lightning_layerwise.engine.buffers import ParamState

TOL = 1e-5


@functools.cache
def reference(model_name: str, opt_name: str, micro: int, clip: float | None) -> dict[str, torch.Tensor]:
    model = make_model(model_name)
    opt = make_optimizer(opt_name, model)
    with reference_threads():
        for idx, target in batches(model_name):
            opt.zero_grad()
            for x, y in zip(idx.chunk(micro), target.chunk(micro)):
                (loss_of(model, x, y) / micro).backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _train_worker(rank, world, model_name, opt_name, micro, no_sync, clip, options):
    session = llw.LayerwiseSession(llw.LayerwiseConfig(**{"shard_parameters": True, **options}))
    model = make_model(model_name)
    opt = make_optimizer(opt_name, model)
    wrapped = session.wrap(model, opt)
    freed_between_steps = nothing_full(wrapped)
    for idx, target in batches(model_name):
        opt.zero_grad()
        xs, ys = idx.chunk(world)[rank].chunk(micro), target.chunk(world)[rank].chunk(micro)
        for i, (x, y) in enumerate(zip(xs, ys)):
            quiet = no_sync and i < micro - 1
            with wrapped.no_sync() if quiet else torch.enable_grad():
                session.backward(loss_of(wrapped, x, y) / micro)
            # a backward frees every bucket it gathered; without no_sync it also reduced every bucket
            freed_between_steps &= all(b.param.state is ParamState.FREED for b in wrapped.buckets)
            freed_between_steps &= quiet or nothing_full(wrapped)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        session.step(opt)
        session.sync_parameters()
        freed_between_steps &= nothing_full(wrapped)
    with llw.full_parameters(model):
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    freed_between_steps &= nothing_full(wrapped)
    session.release()
    released = {n: p.detach().clone() for n, p in model.named_parameters()}
    return params, released, freed_between_steps


CASES = {
    # name: (model, optimizer, world, micro-batches, no_sync, clip, options)
    "net-adamw-2": ("net", "adamw", 2, 1, False, None, {"bucket_size": 300}),
    "net-adamw-3-one-bucket": ("net", "adamw", 3, 1, False, None, {}),
    "net-muon-4": ("net", "muon", 4, 1, False, None, {"bucket_size": 300}),
    "net-muon-2-no_sync-clip": ("net", "muon", 2, 2, True, 0.5, {"bucket_size": 300}),
    "net-adamw-3-reduce-each-micro-batch-clip": ("net", "adamw", 3, 2, False, 0.5, {"bucket_size": 300}),
    "net-adamw-4-two-groups-no_sync-clip": ("net", "adamw", 4, 3, True, 0.5,
                                            {"bucket_size": 300, "owner_group_size": 2}),
    "attention-adamw-2": ("attention", "adamw", 2, 1, False, None, {"bucket_size": 1000}),
    "attention-muon-4-two-groups": ("attention", "muon", 4, 1, False, None,
                                    {"bucket_size": 1000, "owner_group_size": 2}),
    "attention-muon-3": ("attention", "muon", 3, 1, False, None, {"bucket_size": 1000}),
    # the checkpointed block's forward runs without autograd and again inside the backward (reentrant)
    "attention-reentrant-adamw-3-clip": ("attention-reentrant", "adamw", 3, 2, False, 0.5, {"bucket_size": 1000}),
    "attention-muon-2-keep-for-backward": ("attention", "muon", 2, 1, False, None,
                                           {"bucket_size": 1000, "reshard_after_forward": False}),
}


@pytest.mark.parametrize("late", [None, LATE_MS], ids=["now", "late"])
@pytest.mark.parametrize("case", list(CASES))
def test_sharded_parameters_equal_one_process(case, late):
    model_name, opt_name, world, micro, no_sync, clip, options = CASES[case]
    expected = reference(model_name, opt_name, micro, clip)
    results = run_distributed(_train_worker, world, model_name, opt_name, micro, no_sync, clip, options,
                              late_ms=late)
    first = results[0][0]
    moved = max(rel_err(first[n], make_model(model_name).state_dict()[n]) for n in first)
    assert moved > 1e-3, "training changed the parameters"
    for rank, (params, released, freed) in enumerate(results):
        assert freed, f"rank {rank}: a full bucket outlived its backward or its step"
        for n, ref in expected.items():
            assert rel_err(params[n], ref) <= TOL, (case, rank, n, rel_err(params[n], ref))
            assert torch.equal(params[n], first[n]), f"rank {rank} holds another {n} than rank 0"
            assert torch.equal(released[n], params[n]), f"rank {rank}: release() did not give back {n}"


# --- the tests can fail ------------------------------------------------------------------------------------------

def _unpack_without_gather(self, saved):
    return saved.tensor if type(saved) is sharded._SavedFromBucket else saved


def _wait_skipped(self, bucket):
    bucket.param.finish_gather()  # marked ready without waiting for the all-gather
    self._in_flight.remove(bucket)
    self._full[id(bucket)] = bucket
    for p in bucket.params:
        sharded.read_guard.restore(p)


def _mutated_worker(rank, world, mutation):
    if mutation == "unpack":
        sharded.ShardedParameterSync._unpack = _unpack_without_gather
    else:
        sharded.ShardedParameterSync._wait = _wait_skipped
    return _train_worker(rank, world, "attention", "adamw", 1, False, None, {"bucket_size": 1000})


@pytest.mark.parametrize("mutation", ["unpack", "wait"])
def test_a_backward_that_reads_freed_buckets_or_an_unwaited_gather_fails(mutation):
    expected = reference("attention", "adamw", 1, None)
    try:
        results = run_distributed(_mutated_worker, 2, mutation, late_ms=LATE_MS, timeout=60)
    except (RuntimeError, TimeoutError):
        return  # a rank died or raised: the mutation was caught
    wrong = max(rel_err(params[n], ref) for params, _, _ in results for n, ref in expected.items())
    assert not wrong <= TOL, f"the mutation {mutation!r} went unnoticed (relative error {wrong:.2e})"


# --- reads outside a step ----------------------------------------------------------------------------------------

def _reads_worker(rank, world):
    session = llw.LayerwiseSession(llw.LayerwiseConfig(shard_parameters=True, bucket_size=300))
    model = make_model("net")
    wrapped = session.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1))
    not_mine = next(n for n, p in model.named_parameters() if p.requires_grad and not wrapped.records.owns(p))
    p = model.get_parameter(not_mine)
    shape_ok = p.shape == make_model("net").get_parameter(not_mine).shape and p.requires_grad
    try:
        p.sum()
        error = ""
    except llw.ShardedParameterReadError as e:
        error = str(e)
    with llw.full_parameters(model):
        value = p.detach().clone()
    session.release()
    return not_mine, shape_ok, error, value


def test_a_read_outside_a_step_raises_naming_full_parameters_which_gives_the_value():
    for name, shape_ok, error, value in run_distributed(_reads_worker, 2):
        assert shape_ok, "shape and requires_grad read without a gather"
        assert name in error and "llw.full_parameters(model)" in error, error
        assert torch.equal(value, make_model("net").get_parameter(name).detach())


def test_what_sharding_does_not_support_yet_is_refused_before_any_work():
    with pytest.raises(RuntimeError, match=r"ValueError: shard_parameters=True is not supported with "
                                           r"param_read_guard='off'"):
        run_distributed(_refused_worker, 2)


def _refused_worker(rank, world):
    llw.LayerwiseDataParallel(make_model("net"), shard_parameters=True, param_read_guard="off")


# --- experts (Note [sharded experts]) ------------------------------------------------------------------------------

def _experts_worker(rank, world, E, opt_name):
    from lightning_layerwise.experts import check_expert_marks, expert_parameter_names
    from lightning_layerwise.optim import elementwise_parameters
    from helpers import NUM_EXPERTS, global_names, moe_batches, moe_gpt, moe_loss
    from helpers import moe_optimizer

    groups = llw.ProcessGroups.create(expert_parallel_size=E)
    model = moe_gpt(E, groups.expert_parallel_rank)
    check_expert_marks(model, E)
    model.set_expert_group(groups.expert_parallel)
    opt = moe_optimizer(opt_name, model)
    experts, elementwise = expert_parameter_names(model), elementwise_parameters(opt)
    ddp = llw.LayerwiseDataParallel(model, groups, bucket_size=4096, prefetch_depth=1, shard_parameters=True,
                                    expert=lambda n, p: n in experts, elementwise=lambda n, p: p in elementwise)
    ddp.use_shards_in(opt)
    for tokens in moe_batches():
        opt.zero_grad()
        moe_loss(ddp, tokens.chunk(world)[rank]).backward()
        ddp.finish_grad_sync()
        opt.step()
        ddp.start_param_sync()
    with llw.full_parameters(model):
        params = global_names(model, groups.expert_parallel_rank * (NUM_EXPERTS // E))
    expert_buckets, expert_rank = sum(b.expert for b in ddp.buckets), groups.expert_parallel_rank
    ddp.release()
    groups.destroy()
    return params, expert_rank, expert_buckets


@pytest.mark.parametrize("late", [None, LATE_MS], ids=["now", "late"])
@pytest.mark.parametrize("opt_name", ["adamw", "muon"])
def test_experts_sharded_in_their_expert_data_parallel_group_equal_one_process(opt_name, late):
    """``examples/moe.py``'s MoE GPT at E=2 on 4 ranks (experts skipped by ranks whose tokens miss them): the
    run equals one process holding every expert (10 steps), ranks holding the same experts bitwise."""
    from helpers import moe_reference

    expected = moe_reference(opt_name)
    results = run_distributed(_experts_worker, 4, 2, opt_name, late_ms=late)
    for rank, (params, expert_rank, expert_buckets) in enumerate(results):
        assert expert_rank == rank % 2 and expert_buckets > 0
        for name, value in params.items():
            assert rel_err(value, expected[name]) <= TOL, (opt_name, rank, name, rel_err(value, expected[name]))
            assert torch.equal(value, results[rank % 2][0][name]), (rank, name)


def test_a_model_that_does_not_fit_on_its_gpu_at_the_end_is_released_to_cpu_memory(monkeypatch):
    """Note [sharded release]: the module's parameters go back to a CUDA device only when its free memory holds
    them all; otherwise to CPU memory, with a warning naming the bytes. (The decision only: no GPU here.)"""
    from lightning_layerwise.engine.release import _release_device

    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (3 * 2**30, 80 * 2**30))
    assert _release_device(cuda, 2 * 2**30) == cuda
    with pytest.warns(UserWarning, match=r"4\.00 GiB of parameters\) does not fit in the 3\.00 GiB free"):
        assert _release_device(cuda, 4 * 2**30) == torch.device("cpu")
    assert _release_device(torch.device("cpu"), 4 * 2**30) == torch.device("cpu")
