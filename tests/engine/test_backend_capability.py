"""A backend is handled by what it does, not by its name (Note [averaging] in ``engine/collectives.py``).

``probe_averaging`` tries ``ReduceOp.AVG`` on a tiny tensor for each reduction the package averages with
(all-reduce, reduce-scatter, reduce) and keeps those that average correctly; every other reduction sums and the
shard is divided after the wait. Checked on 3 gloo ranks:

* the probe finds what this torch's gloo does, and the reductions that use AVG give the mean;
* a backend that refuses AVG for one reduction (``dist.reduce`` raising, as gloo did before torch 2.13) and one
  that silently sums instead of averaging (``reduce_scatter``) are both found out: those reductions then sum and
  divide, and every result is still the mean, on every rank;
* the wrapper probes its groups at set-up, at 4 ranks as 2 owner groups of 2 (owner and replica groups).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from _dist import run_distributed
from lightning_layerwise.engine import collectives


def _means(group, world: int, rank: int) -> dict[str, torch.Tensor]:
    """Each averaged collective of the package on values ``rank + 1`` (mean ``(world + 1) / 2``)."""
    out = {}
    x = torch.arange(2 * world, dtype=torch.float32) + 10 * rank
    out["reduce_scatter"] = collectives.reduce_scatter_bucket(x.clone(), group, average=True).wait().clone()
    out["all_reduce"] = collectives.all_reduce_bucket(x.clone(), group, average=True).wait().clone()
    uneven = [(0, 1), (1, 1), (1, 2 * world)]  # chunks of unequal length, one empty: rooted reduces
    out["reduce"] = collectives.reduce_scatter_chunks(x.clone(), uneven, group, average=True).wait().clone()
    return out


def _worker(rank, world, broken):
    if broken:
        reduce, scatter = dist.reduce, collectives._reduce_scatter_single

        def refusing_reduce(tensor, *args, op=dist.ReduceOp.SUM, **kwargs):
            if op == dist.ReduceOp.AVG:
                raise RuntimeError("this backend has no ReduceOp.AVG for reduce")
            return reduce(tensor, *args, op=op, **kwargs)

        def summing_scatter(out, tensor, *args, op=dist.ReduceOp.SUM, **kwargs):
            return scatter(out, tensor, *args, op=dist.ReduceOp.SUM, **kwargs)  # AVG taken, SUM done

        dist.reduce, collectives._reduce_scatter_single = refusing_reduce, summing_scatter
    group = dist.new_group(list(range(world)))
    found = collectives.probe_averaging(group, torch.device("cpu"))
    return sorted(found), _means(group, world, rank)


@pytest.mark.parametrize("broken", [False, True], ids=["gloo", "refusing-and-summing"])
def test_the_probe_finds_what_averages_and_every_mean_is_right(broken):
    world = 3
    results = run_distributed(_worker, world, broken)
    x = [torch.arange(2 * world, dtype=torch.float32) + 10 * r for r in range(world)]
    mean = sum(x) / world
    for rank, (found, means) in enumerate(results):
        assert found == results[0][0], "every rank found the same"
        if broken:
            assert found == ["all_reduce"], found
        else:  # what this torch's gloo does; whatever it is, the means below hold
            print(f"gloo averages in the reduction: {found}")
        assert torch.allclose(means["all_reduce"], mean, rtol=1e-6), means["all_reduce"]
        assert torch.allclose(means["reduce_scatter"], mean.chunk(world)[rank], rtol=1e-6)
        chunk = [(0, 1), (1, 1), (1, 2 * world)][rank]
        assert torch.allclose(means["reduce"], mean[chunk[0]:chunk[1]], rtol=1e-6), (rank, means["reduce"])


def _wrapper_worker(rank, world):
    import lightning_layerwise as llw
    from lightning_layerwise import LayerwiseDataParallel, ProcessGroups

    probed = []
    probe = collectives.probe_averaging
    collectives.probe_averaging = lambda group, device: probed.append(tuple(dist.get_process_group_ranks(group))) \
        or probe(group, device)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    groups = ProcessGroups.create(owner_group_size=2)
    wrapped = LayerwiseDataParallel(model, groups, bucket_size=64)
    wrapped.release()
    held_before = len(collectives._AVERAGING)
    groups.destroy()
    del llw
    return probed, held_before, len(collectives._AVERAGING)


def test_the_wrapper_probes_its_owner_and_replica_groups_at_set_up():
    for rank, (probed, held_before, held_after) in enumerate(run_distributed(_wrapper_worker, 4)):
        assert held_before == 2 and held_after == 0, "the probes die with the groups"
        owner = tuple(range(rank // 2 * 2, rank // 2 * 2 + 2))
        replicas = (rank % 2, rank % 2 + 2)
        assert probed == [owner, replicas], (rank, probed)
