"""GPU: sharded parameters (``shard_parameters=True``) with several gloo ranks over CUDA tensors on the one GPU.

Needs CUDA; each test runs its body in a fresh process (``_gpu.py`` says why and how), which spawns the ranks.

What runs on CUDA here and nowhere else: full buckets freed by resizing a CUDA storage to zero bytes and given
their bytes back before each all-gather (Note [sharded parameters] in ``engine/buffers.py``), the saved-tensor
hooks that gather a freed bucket again for the backward, the read guard on CUDA parameters, and the end of a
run (Note [sharded release] in ``engine/sharded.py``): the module's parameters come back whole on the GPU, or in
CPU memory when the GPU's free memory cannot hold them.

``AttentionNet`` of ``tests/engine/test_sharded_parameters.py`` (``nn.MultiheadAttention``, an encoder layer
under activation checkpointing, a parameter read before any module runs) on 4 ranks, one owner group or two of
2, AdamW and Muon for 10 steps: every rank equals one process on the same GPU (relative error <= 1e-5), the
ranks are bitwise equal, no full bucket is held between steps, and the CUDA memory a rank holds after a step is
below the whole model's.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from _gpu import TOL, _rel_err, _run_child, gloo_over_cuda, save_rank, spawn_ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

WORLD = 4


def _sharded_worker(rank: int, world: int, tmp: str, opt_name: str, owner_group_size) -> None:
    import lightning_layerwise as llw
    from helpers import (nothing_full, sharded_batches as batches, sharded_loss as loss_of,
                         sharded_model as make_model, sharded_optimizer as make_optimizer)

    tag = f"sharded_{opt_name}_{owner_group_size}"
    with gloo_over_cuda(tmp, tag, rank, world):
        session = llw.LayerwiseSession(llw.LayerwiseConfig(shard_parameters=True, bucket_size=1000,
                                                           owner_group_size=owner_group_size))
        model = make_model("attention").cuda()
        whole = sum(p.numel() * p.element_size() for p in model.parameters())
        optimizer = make_optimizer(opt_name, model)
        wrapped = session.wrap(model, optimizer)
        freed = nothing_full(wrapped)
        for idx, target in batches("attention"):
            optimizer.zero_grad()
            x, y = idx.chunk(world)[rank].cuda(), target.chunk(world)[rank].cuda()
            session.backward(loss_of(wrapped, x, y))
            session.step(optimizer)
            session.sync_parameters()
            freed &= nothing_full(wrapped)
        torch.cuda.synchronize()
        held = sum({t.untyped_storage()._cdata: t.untyped_storage().nbytes()
                    for b in wrapped.buckets for t in (b.param.data, b.param.shard)}.values())
        with llw.full_parameters(model):
            params = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
        session.release()
        released = {n: (p.device.type, torch.equal(p.detach().cpu(), params[n]))
                    for n, p in model.named_parameters()}
    save_rank(tmp, tag, rank, {"params": params, "freed": freed, "held": held, "whole": whole, "released": released})


def _sharded_child(tmp: str, opt_name: str, owner_group_size) -> dict:
    from helpers import (sharded_batches as batches, sharded_loss as loss_of, sharded_model as make_model,
                         sharded_optimizer as make_optimizer)

    model = make_model("attention").cuda()
    optimizer = make_optimizer(opt_name, model)
    for idx, target in batches("attention"):
        optimizer.zero_grad()
        loss_of(model, idx.cuda(), target.cuda()).backward()
        optimizer.step()
    reference = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    ranks = spawn_ranks(_sharded_worker, WORLD, tmp, f"sharded_{opt_name}_{owner_group_size}", opt_name,
                        owner_group_size)
    return {"reference": reference, "ranks": ranks}


@pytest.mark.parametrize("owner_group_size", [None, 2], ids=["one_group", "owner_groups_2x2"])
@pytest.mark.parametrize("opt_name", ["adamw", "muon"])
def test_sharded_parameters_on_cuda_match_one_process(opt_name, owner_group_size):
    out = _run_child(_sharded_child, opt_name, owner_group_size)
    first = out["ranks"][0]
    worst = 0.0
    for name, value in first["params"].items():
        err = _rel_err(value, out["reference"][name])
        worst = max(worst, err)
        assert err <= TOL, f"{opt_name}, owner groups {owner_group_size}: {name} differs by {err:.2e}"
    for rank, r in enumerate(out["ranks"]):
        assert r["freed"], f"rank {rank}: a full bucket outlived its backward or its step on CUDA"
        assert r["held"] < r["whole"], f"rank {rank}: holds {r['held']} B of parameters, the model is {r['whole']}"
        assert all(device == "cuda" and same for device, same in r["released"].values()), r["released"]
        for name, value in r["params"].items():
            assert torch.equal(value, first["params"][name]), f"rank {rank} differs from rank 0 on {name}"
    print(f"sharded, gloo over CUDA, 4 ranks, owner groups {owner_group_size}, {opt_name}: max rel err {worst:.2e}")


def _release_child(tmp: str) -> dict:
    """The decision of Note [sharded release] against the real free memory of the GPU."""
    from lightning_layerwise.engine.release import _release_device

    device = torch.device("cuda", 0)
    free, _ = torch.cuda.mem_get_info(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        small, large = _release_device(device, 1 << 20), _release_device(device, 2 * free)
    return {"small": str(small), "large": str(large), "warned": [str(w.message) for w in caught]}


def test_a_model_larger_than_the_free_gpu_memory_is_released_to_cpu():
    out = _run_child(_release_child)
    assert out["small"] == "cuda:0" and out["large"] == "cpu", out
    assert len(out["warned"]) == 1 and "does not fit" in out["warned"][0], out["warned"]
