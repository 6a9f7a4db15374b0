"""Replica sharing (Note [replica sharing] in layout.py): owner groups share the optimizer step.

With ``dp = g * R`` ranks in ``R`` owner groups of ``g``, every element is stepped by exactly
one rank of the world: each Muon matrix is orthogonalized once per step over all ranks, and the
optimizer state is held once. Checked here:

* the planner, on random models and group shapes (hypothesis): every element once, chunks
  tiling every shard, matrices whole, the offsets inside their shard and not overlapping;
* a 3-layer GPT (12 Muon matrices) at 4 ranks as 2 groups of 2, 6 as 2 of 3 and as 3 of 2, and
  8 as 4 of 2 and as 2 of 4: Newton–Schulz is counted on every rank (the package's batched
  entry point wrapped) and the counts add up to the 12 matrices in every step; the parameters
  equal one process on the same global batch (fp32 Newton–Schulz, relative error <= 1e-5 with
  AdamW, <= 1e-4 with Muon, 10 steps) and are bitwise equal on every rank;
* the MoE GPT at 4 ranks with E=2 and dense owner groups of 2: the same count over its dense and
  expert matrices, and the same parity;
* gradient accumulation (``no_sync``) with global-norm clipping at 6 ranks as 3 groups of 2;
* the same under late collectives (Note [late collectives]), bitwise equal to the plain run.
"""

from __future__ import annotations

import functools
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from _dist import LATE_MS, reference_threads, run_distributed
from helpers import backward_micro_batches, gpt_loss, rel_err, snapshot
from lightning_layerwise import LayerwiseDataParallel, ProcessGroups
from lightning_layerwise.engine.clip import clip_grad_norm_
from lightning_layerwise.layout import ALIGNMENT, ParamSpec, plan_layout, share_among_replicas
from lightning_layerwise.optim import Muon, elementwise_parameters, muon_param_groups

STEPS = 10
GLOBAL_BATCH = 24  # divides 4, 6 and 8 ranks, and 2 micro-batches of each
SEQ = 8
VOCAB = 97
MICRO = 2
MAX_NORM = 0.05
TOL = {"adamw": 1e-5, "muon": 1e-4}


# --- the planner --------------------------------------------------------------------------------------------


@st.composite
def mixed_specs(draw):
    n = draw(st.integers(1, 24))
    specs = []
    for i in range(n):
        if draw(st.booleans()):
            specs.append(ParamSpec(f"m{i}", (draw(st.sampled_from([8, 24, 64, 96])),
                                             draw(st.sampled_from([8, 24, 64, 96])))))
        else:
            specs.append(ParamSpec(f"v{i}", (draw(st.sampled_from([1, 7, 64, 100, 2000, 9000])),), elementwise=True))
    return specs


def check_shared(specs: list[ParamSpec], layout) -> None:
    """Every element stepped by exactly one of the ``g * R`` ranks, inside that rank's chunk of its shard;
    every shard cut as NCCL runs it in two operations across the groups (one replica steps it whole, or
    ``R`` equal chunks of element-wise elements, or nothing for a padding-only shard), unless split for balance
    into whole parameters, each replica's in one range; chunks tile every shard; a matrix is never cut;
    parameters inside their shard, aligned, disjoint."""
    g, R = layout.group_size, layout.replicas
    elementwise = {s.name: s.elementwise for s in specs}
    for plan in layout.buffers:
        for bucket in plan.buckets:
            for p in range(g):
                ranges = bucket.chunk_ranges(p)
                assert len(ranges) == R
                lo, hi = bucket.shard_range(p)
                held = [n for n in bucket.params
                        if any(piece.owner % g == p for piece in layout.params[n].pieces)]
                cut = bucket.chunks[p] if bucket.chunks else ((0, 0),)  # R = 1: the whole shard
                if not cut:
                    assert not held, (bucket.index, p, held)
                    assert all(a == b for a, b in ranges), "a padding-only shard sends nothing"
                    continue
                edges = sorted(ranges)
                assert edges[0][0] == lo and edges[-1][1] == hi
                assert all(a[1] == b[0] for a, b in zip(edges, edges[1:])), edges
                sizes = [b - a for a, b in ranges]
                whole = all(len(layout.params[n].pieces) == 1 for n in held)
                if len(cut) > 1 and all(elementwise[n] for n in held) and not whole:
                    # equal chunks, in replica order, of element-wise elements
                    assert sizes == [(hi - lo) // R] * R and ranges == sorted(ranges), ranges
                elif len(cut) > 1:  # a shard split for balance: whole parameters, each replica's one range
                    assert whole or sizes == [(hi - lo) // R] * R, (held, ranges)
                else:
                    assert sum(s > 0 for s in sizes) == 1, sizes
    taken: dict[int, list[tuple[int, int]]] = {}
    for name, slot in layout.params.items():
        bucket = layout.buffers[slot.buffer].buckets[slot.bucket]
        assert slot.offset % ALIGNMENT == 0 or elementwise[name], (name, slot.offset)
        covered = 0
        for piece in slot.pieces:
            assert piece.start == covered, (name, slot.pieces)
            covered = piece.stop
            k, p = divmod(piece.owner, g)
            a, b = bucket.chunk_ranges(p)[k]
            assert a <= slot.offset + piece.start and slot.offset + piece.stop <= b, (name, piece, (a, b))
        assert covered == slot.numel, (name, slot.pieces)
        if not elementwise[name]:
            assert len(slot.pieces) == 1, f"matrix {name} cut: {slot.pieces}"
        taken.setdefault(slot.buffer, []).append((slot.offset, slot.offset + slot.numel))
    for spans in taken.values():
        spans.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), "parameters overlap"


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=mixed_specs(), g=st.integers(1, 6), replicas=st.integers(1, 6), bucket_size=st.sampled_from([500, 5000, 10**6]))
def test_shared_layouts_step_every_element_once(specs, g, replicas, bucket_size):
    layout = plan_layout(specs, g, bucket_size, replicas=replicas)
    assert layout.replicas == replicas and layout.ranks == g * replicas
    check_shared(specs, layout)
    assert layout == plan_layout(specs, g, bucket_size, replicas=replicas), "deterministic"


def test_matrices_are_spread_over_the_replicas_by_newton_schulz_cost():
    """Eight equal matrices and two of four times the cost at 2 groups of 2: each of the 4 ranks gets the
    same cost (the big ones alone, the small ones in fours), not the same count."""
    specs = [ParamSpec(f"big{i}", (128, 128)) for i in range(2)] + [ParamSpec(f"small{i}", (64, 128))
                                                                      for i in range(8)]
    layout = plan_layout(specs, 2, 10**6, replicas=2)
    costs = layout.rank_costs()
    assert len(costs) == 4 and max(costs) == min(costs), costs
    assert sorted(len(layout.owned_by(r)) for r in range(4)) == [1, 1, 4, 4]


def test_a_shard_of_several_matrices_is_split_only_to_balance():
    """A wide, cheap matrix seeds a round at 2 ranks whose other shard is filled with eight square matrices of 8x its
    cost. Stepped whole, that shard would put all eight on one replica (8x the other's work); the balancing splits
    it instead, four matrices each, laid out so that each replica's are one range (two chunks: four operations
    across the groups for that shard, two for every other). With splitting off the shard stays whole."""
    specs = [ParamSpec(f"sq{i}", (64, 64)) for i in range(8)] + [ParamSpec("wide", (8, 4096))]
    layout = plan_layout(specs, 2, 10**6, replicas=2)
    check_shared(specs, layout)
    (bucket,) = layout.buffers[0].buckets
    assert [len(c) for c in bucket.chunks] == [1, 2], bucket.chunks
    squares = [sum(1 for i in range(8) if layout.params[f"sq{i}"].owner == rank) for rank in range(4)]
    assert squares == [0, 4, 0, 4], squares
    with mock.patch("lightning_layerwise.layout.sharing.SPLIT_ABOVE", float("inf")):
        whole = plan_layout(specs, 2, 10**6, replicas=2)
    check_shared(specs, whole)
    assert [len(c) for c in whole.buffers[0].buckets[0].chunks] == [1, 1]
    assert max(whole.rank_costs()) == 2 * max(layout.rank_costs())


def _assign_position_afresh(position, job, replicas, floor, split):
    """``sharing._assign_position`` as written first: after every split, every job costed and sorted again and the
    longest-processing-time assignment run from scratch."""
    import heapq

    from lightning_layerwise.layout import sharing

    divisible = {key: items for key, items in position
                 if len(items) > 1 and all(piece.start == 0 and piece.stop == slot.numel for _, slot, piece in items)}
    mine = set()
    while True:
        jobs = [j for key, items in position
                for j in ([job(key, [item], item[0]) for item in items] if key in mine else [job(key, items)])]
        heap, bins = [(0.0, 0, k) for k in range(replicas)], [[] for _ in range(replicas)]
        for j in sorted(jobs, key=lambda j: (-j[0], -j[1], j[2])):
            cost, state, k = heapq.heappop(heap)
            bins[k].append(j)
            heapq.heappush(heap, (cost + j[0], state + j[1], k))
        loads, states = [0.0] * replicas, [0] * replicas
        for cost, state, k in heap:
            loads[k], states[k] = cost, state
        sharing._rebalance(bins, loads, states, floor)
        busiest = max(range(replicas), key=lambda k: (loads[k], k))
        candidates = [j for j in bins[busiest] if j[2][3] == "" and j[2][:3] in divisible]
        if loads[busiest] <= sharing.SPLIT_ABOVE * floor or not candidates:
            break
        mine.add(max(candidates, key=lambda j: (j[0], j[2]))[2][:3])
    split |= mine
    replica_of = {j[2]: k for k, bin_k in enumerate(bins) for j in bin_k}
    sharing._rotate(sorted((j for j in jobs if j[2][3] == ""), key=lambda j: j[2]), replica_of)
    return replica_of


def test_splitting_shards_keeps_the_assignment_of_a_fresh_sort():
    """The replicas of every shard and parameter are those of costing and sorting all jobs again after each split
    (the split shard's parameters take its place in the sorted jobs), on layouts where shards of several matrices
    are split once or twice."""
    from lightning_layerwise.layout import sharing

    assign, splits = sharing._assign_position, []

    def both(position, job, replicas, floor, split):
        afresh: set = set()
        expected = _assign_position_afresh(position, job, replicas, floor, afresh)
        assert assign(position, job, replicas, floor, split) == expected and afresh <= split
        splits.append(len(afresh))
        return expected

    specs = [ParamSpec(f"h{i}.{name}", shape) for i in range(12)
             for name, shape in (("a", (64, 64)), ("b", (32, 96)), ("c", (128, 16)), ("v", (100,)))]
    with mock.patch.object(sharing, "_assign_position", both):
        for g, bucket_size, replicas in ((1, 20_000, 3), (1, 60_000, 5), (2, 20_000, 3), (1, 5_000, 5)):
            check_shared(specs, plan_layout(specs, g, bucket_size, replicas=replicas))
    assert max(splits) >= 2, splits


def _consecutive_roots(layout) -> tuple[int, int]:
    """Per position, consecutive whole shards (bucket order) stepped by the same replica, and all such pairs."""
    same = pairs = 0
    for plan in layout.buffers:
        for p in range(layout.group_size):
            roots = [bucket.chunks[p][0][0] for bucket in plan.buckets if len(bucket.chunks[p]) == 1]
            same += sum(a == b for a, b in zip(roots, roots[1:]))
            pairs += len(roots) - 1
    return same, pairs


def test_consecutive_shards_are_stepped_by_different_replicas_at_no_cost_in_balance():
    """12 layers of four matrix shapes at 2 ranks as 3 groups: each position's consecutive shards go to different
    replicas (the cross-group reduces and broadcasts change root from one bucket to the next) and every rank carries
    the same Newton–Schulz cost as without rotating, which leaves 20 of the 46 pairs on one replica."""
    from lightning_layerwise.layout import sharing

    specs = [ParamSpec(f"h{layer}.{name}", shape) for layer in range(12)
             for name, shape in (("attn", (64, 192)), ("proj", (64, 64)), ("fc", (256, 64)), ("out", (64, 256)))]
    layout = plan_layout(specs, 2, 1, replicas=3)  # a bucket per round: 48 consecutive shards per position
    check_shared(specs, layout)
    with mock.patch.object(sharing, "_rotate", lambda *args, **kwargs: None):
        unrotated = plan_layout(specs, 2, 1, replicas=3)
    assert _consecutive_roots(layout) == (0, 46), _consecutive_roots(layout)
    assert _consecutive_roots(unrotated)[0] > 0, "the check cannot fail"
    assert sorted(layout.rank_costs()) == sorted(unrotated.rank_costs())


def test_sharing_a_shared_layout_or_a_bad_count_is_refused():
    specs = [ParamSpec("w", (8, 8))]
    with pytest.raises(ValueError, match="already shared"):
        share_among_replicas(plan_layout(specs, 1, 100, replicas=2), specs, 2)
    with pytest.raises(ValueError, match=r"replicas=0"):
        plan_layout(specs, 1, 100, replicas=0)


# --- training: Newton–Schulz counted, parity with one process -------------------------------------------------


def gpt(seed: int = 0) -> nn.Module:
    from examples.gpt import GPT, GPTConfig

    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=VOCAB, n_layer=3, n_head=2, n_embd=24, block_size=SEQ, bias=False))


def optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    return Muon(muon_param_groups(model), lr=0.02, weight_decay=0.01, ns_dtype=torch.float32, adamw_lr=3e-3,
                adamw_weight_decay=0.1)


def muon_matrices(model: nn.Module) -> int:
    return sum(len(g["params"]) for g in muon_param_groups(model) if g["use_muon"])


def batches():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=g) for _ in range(STEPS)]


class CountNewtonSchulz:
    """Counts the matrices this process orthogonalizes, per optimizer step, by wrapping the one function every
    Newton–Schulz of ``lightning_layerwise.Muon`` goes through (batched or not)."""

    def __init__(self) -> None:
        from lightning_layerwise.optim import orthogonalization

        self.per_step: list[int] = []
        original = orthogonalization._orthogonalize_chunk

        def counting(matrices, *args, **kwargs):
            self.per_step[-1] += len(matrices)
            return original(matrices, *args, **kwargs)

        self.patch = mock.patch.object(orthogonalization, "_orthogonalize_chunk", counting)

    def __enter__(self):
        self.patch.start()
        return self

    def __exit__(self, *exc):
        self.patch.stop()

    def step(self) -> None:
        self.per_step.append(0)


def _step(model, ddp, opt, tokens, rank, world, accumulate: bool):
    """One optimizer step: distributed (``ddp``) on this rank's rows, or one process on all of them."""
    opt.zero_grad()
    rows = [tokens.chunk(world)[r] for r in (range(world) if ddp is None else [rank])]
    if not accumulate:
        gpt_loss(ddp if ddp is not None else model, torch.cat(rows)).backward()
    else:
        backward_micro_batches(model, ddp, [torch.cat([r.chunk(MICRO)[i] for r in rows]) for i in range(MICRO)])
    norm = None
    if ddp is not None:
        ddp.finish_grad_sync()
        if accumulate:
            norm = clip_grad_norm_(ddp, MAX_NORM).item()
    elif accumulate:
        norm = nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item()
    opt.step()
    if ddp is not None:
        ddp.start_param_sync()
    return norm


@functools.cache
def reference(opt_name: str, world: int, accumulate: bool = False) -> tuple[dict, list]:
    """One process on the same global batches (the rows of every rank, in rank order)."""
    model = gpt()
    opt = optimizer(opt_name, model)
    with reference_threads():
        norms = [_step(model, None, opt, t, 0, world, accumulate) for t in batches()]
    return snapshot(model), norms


def _worker(rank: int, world: int, g: int, opt_names: list[str], accumulate: bool) -> dict:
    out = {}
    for opt_name in opt_names:
        model = gpt(seed=rank)  # rank 0's initialisation is broadcast
        opt = optimizer(opt_name, model)
        elementwise = elementwise_parameters(opt)
        groups = ProcessGroups.create(owner_group_size=g)
        ddp = LayerwiseDataParallel(model, groups, bucket_size=2048, prefetch_depth=1,
                                    elementwise=lambda name, p: p in elementwise)
        ddp.use_shards_in(opt)
        with CountNewtonSchulz() as counter:
            norms = []
            for tokens in batches():
                counter.step()
                norms.append(_step(model, ddp, opt, tokens, rank, world, accumulate))
        ddp.param_sync.finish()
        state = sum(v.numel() for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim())
        out[opt_name] = {"params": snapshot(model), "ns": counter.per_step, "norms": norms,
                         "matrices": muon_matrices(model), "replicas": ddp.ranks.replicas, "g": ddp.layout.group_size,
                         "state_elements": state}
        groups.destroy()
    return out


@functools.cache
def run(world: int, g: int, accumulate: bool = False, late_ms: float | None = None,
        opt_names: tuple[str, ...] = ("adamw", "muon")) -> list[dict]:
    return run_distributed(_worker, world, g, list(opt_names), accumulate, late_ms=late_ms, timeout=480.0)


def check_parity(results: list[dict], opt_name: str, world: int, accumulate: bool = False) -> float:
    want, norms = reference(opt_name, world, accumulate)
    worst = 0.0
    for name, value in results[0]["params"].items():
        err = rel_err(value, want[name])
        worst = max(worst, err)
        assert err <= TOL[opt_name], f"{opt_name} at {world} ranks: {name} differs from one process by {err:.2e}"
    for rank, r in enumerate(results[1:], start=1):
        for name, value in r["params"].items():
            assert torch.equal(value, results[0]["params"][name]), f"rank {rank} differs from rank 0 on {name}"
    if accumulate:
        for r in results:
            assert r["norms"] == pytest.approx(norms, rel=1e-5), "the clipped norm is the one-process norm"
    return worst


SHAPES = [(4, 2), (6, 3), (6, 2), (8, 2), (8, 4)]
"""(world, owner group size g): 4 = 2 groups of 2, 6 = 2 of 3 and 3 of 2, 8 = 4 of 2 and 2 of 4."""


@pytest.mark.slow
@pytest.mark.parametrize("world,g", SHAPES, ids=[f"{w}ranks_g{g}" for w, g in SHAPES])
def test_each_matrix_is_orthogonalized_once_per_step_in_the_world(world, g):
    results = run(world, g)
    muon = [r["muon"] for r in results]
    assert all(r["g"] == g and r["replicas"] == world // g for r in muon)
    total = [sum(r["ns"][step] for r in muon) for step in range(STEPS)]
    assert total == [muon[0]["matrices"]] * STEPS, (
        f"{world} ranks as {world // g} groups of {g}: {total} matrices orthogonalized per step, "
        f"{muon[0]['matrices']} Muon matrices; per rank {[r['ns'][0] for r in muon]}")
    busiest = max(r["ns"][0] for r in muon)
    assert busiest <= -(-muon[0]["matrices"] // world) + 1, [r["ns"][0] for r in muon]
    for opt_name in ("adamw", "muon"):
        worst = check_parity([r[opt_name] for r in results], opt_name, world)
        print(f"{world} ranks, g={g}, {opt_name}: max rel err {worst:.2e}; "
              f"Newton–Schulz per rank {[r['ns'][0] for r in muon]}")
    # AdamW's two moments of every element, once in the world (Muon's momentum likewise).
    model = gpt()
    assert sum(r["state_elements"] for r in (x["adamw"] for x in results)) == \
        2 * sum(p.numel() for p in model.parameters())


@pytest.mark.slow
def test_accumulation_with_clipping_at_six_ranks_as_three_groups_of_two():
    results = run(6, 2, accumulate=True)
    for opt_name in ("adamw", "muon"):
        worst = check_parity([r[opt_name] for r in results], opt_name, 6, accumulate=True)
        print(f"6 ranks as 3 x 2, no_sync + clipping, {opt_name}: max rel err {worst:.2e}")


@pytest.mark.slow
def test_late_collectives_change_no_bit_at_six_ranks_as_three_groups_of_two():
    """Every collective up to LATE_MS late: the uneven reduce-scatters and all-gathers across the replicas
    are awaited before their chunks are read or stepped."""
    late = run(6, 2, late_ms=LATE_MS, opt_names=("muon",))
    plain = run(6, 2)
    for rank, (r, want) in enumerate(zip(late, plain)):
        for name, value in r["muon"]["params"].items():
            assert torch.equal(value, want["muon"]["params"][name]), f"rank {rank}: {name} differs with late collectives"


# --- experts: E=2 on 4 ranks, dense owner groups of 2 ---------------------------------------------------------


def _expert_worker(rank: int, world: int, E: int, g: int, ge: int | None, bucket_size: int = 4096) -> dict:
    from helpers import NUM_EXPERTS, global_names, train_moe, wrap_moe

    groups = ProcessGroups.create(expert_parallel_size=E, owner_group_size=g, expert_group_size=ge)
    model, opt, ddp, experts = wrap_moe(groups, E, "muon", bucket_size)
    with CountNewtonSchulz() as counter:
        train_moe(ddp, opt, rank, world, before_step=counter.step)
    names = {p: n for n, p in model.named_parameters()}
    muon = [names[p] for group in muon_param_groups(model) if group["use_muon"] for p in group["params"]]
    result = {"params": global_names(model, groups.expert_parallel_rank * (NUM_EXPERTS // E)), "ns": counter.per_step,
              "dense_matrices": [n for n in muon if n not in experts],
              "expert_matrices": [n for n in muon if n in experts], "replicas": ddp.ranks.replicas,
              "expert_replicas": ddp.ranks.expert_replicas}
    groups.destroy()
    return result


@pytest.mark.slow
@pytest.mark.parametrize("ge, bucket_size", [(None, 4096), (1, 4096), (1, 1)],
                         ids=["expert_group_of_2", "expert_groups_of_1_shared", "expert_groups_of_1_bucket_per_round"])
def test_experts_and_shared_dense_groups_orthogonalize_each_matrix_once(ge, bucket_size):
    """4 ranks, E=2 (ranks {0,2} and {1,3} hold the same experts), dense owner groups of 2 shared by 2
    replicas: per step the ranks orthogonalize every dense matrix once and every expert matrix once (each
    of the 2 expert data-parallel ranks of an expert steps its share). ``ge=1``: the expert buffers planned
    for expert owner groups of 1, the 2 expert data-parallel ranks sharing them as replicas (Note [expert
    owner groups] in process_groups.py). ``bucket_size=1``: a bucket per planner round, so an expert skipped
    for want of tokens holds buckets of its own. Gathered from the experts' own pre-hooks with a prefetch that
    blocks on cross-group gathers, a rank waited in an expert's pre-hook for a gather that a rank which skipped
    the expert had not issued, while that one waited in the token all-to-all: this case hung (killed after
    200 s). The layer's pre-hook (Note [conditional experts] in engine/data_parallel.py) and the prefetch that
    never blocks (Note [cross-group gathers] in engine/param_sync.py) each prevent it."""
    from helpers import global_names, moe_batches, moe_gpt, moe_loss as loss_fn
    from helpers import moe_optimizer

    results = run_distributed(_expert_worker, 4, 2, 2, ge, bucket_size, timeout=480.0)
    assert all(r["replicas"] == 2 and r["expert_replicas"] == (2 if ge == 1 else 1) for r in results)
    # One process holding every expert, counted the same way: an expert no token reached in a step has no
    # gradient there and is not stepped, so the count follows the routing, not the number of matrices.
    model = moe_gpt()
    opt = moe_optimizer("muon", model)
    with reference_threads(), CountNewtonSchulz() as counter:
        for tokens in moe_batches():
            counter.step()
            opt.zero_grad()
            loss_fn(model, tokens).backward()
            opt.step()
    want = global_names(model, 0)
    dense = len(results[0]["dense_matrices"])
    local_experts = len(results[0]["expert_matrices"])  # this rank's experts; E=2 ranks hold different ones
    assert max(counter.per_step) == dense + 2 * local_experts, "some steps reach every expert"
    total = [sum(r["ns"][step] for r in results) for step in range(STEPS)]
    assert total == counter.per_step, (total, counter.per_step)
    worst = 0.0
    for rank, r in enumerate(results):
        for name, value in r["params"].items():
            err = rel_err(value, want[name])
            worst = max(worst, err)
            assert err <= TOL["muon"], f"rank {rank}: {name} differs from one process by {err:.2e}"
    print(f"MoE, 4 ranks, E=2, dense 2 x 2, expert groups {ge}: max rel err {worst:.2e}; "
          f"per rank {[r['ns'][0] for r in results]}")
    if ge == 1:  # the expert chunks' uneven collectives under late collectives: bitwise the plain run
        late = run_distributed(_expert_worker, 4, 2, 2, ge, timeout=480.0, late_ms=LATE_MS)
        for rank, (r, plain) in enumerate(zip(late, results)):
            for name, value in r["params"].items():
                assert torch.equal(value, plain["params"][name]), f"rank {rank}: {name} differs with late collectives"
