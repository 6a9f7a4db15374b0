"""Property tests of the pure layout planner: every guarantee on random parameter lists, dp 1..64."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from lightning_layerwise.layout import (
    ALIGNMENT,
    ParamSpec,
    aligned,
    DEFAULT_RANKS_PER_NODE,
    PADDING_TOLERANCE,
    choose_owner_group_size,
    estimated_rank_bytes,
    describe_layout,
    newton_schulz_cost,
    numel_cost,
    param_specs,
    plan_layout,
)

shapes = st.one_of(
    st.tuples(st.integers(1, 700)),
    st.tuples(st.integers(1, 96), st.integers(1, 96)),
    st.tuples(st.integers(1, 8), st.integers(1, 8), st.integers(1, 5), st.integers(1, 5)),
)
dtypes = st.sampled_from([torch.float32, torch.bfloat16])
kinds = st.sampled_from(["dense", "dense", "expert"])


@st.composite
def spec_lists(draw, max_params=40):
    n = draw(st.integers(1, max_params))
    return [ParamSpec(f"p{i}", draw(shapes), draw(dtypes), draw(kinds)) for i in range(n)]


def check_invariants(specs: list[ParamSpec], layout) -> None:
    dp = layout.group_size
    assert set(layout.params) == {s.name for s in specs}
    by_name = {s.name: s for s in specs}
    # one buffer per (dtype, kind), holding exactly those params
    keys = [(b.dtype, b.kind) for b in layout.buffers]
    assert len(keys) == len(set(keys))
    for buf in layout.buffers:
        covered = 0
        members = set()
        for bi, bucket in enumerate(buf.buckets):
            assert bucket.index == bi
            assert bucket.start == covered, "buckets tile the buffer contiguously"
            covered = bucket.end
            assert bucket.numel % dp == 0 and bucket.numel > 0
            assert bucket.shard_size * dp == bucket.numel
            members.update(bucket.params)
            intervals = []
            for name in bucket.params:
                slot = layout.params[name]
                spec = by_name[name]
                assert (spec.dtype, spec.kind) == (buf.dtype, buf.kind)
                assert slot.buffer == buf.index and slot.bucket == bucket.index
                assert slot.offset % ALIGNMENT == 0
                lo, hi = bucket.shard_range(slot.owner)
                assert lo <= slot.offset and slot.end <= hi, f"{name} crosses its shard"
                intervals.append((slot.offset, slot.end))
            intervals.sort()
            for (a0, a1), (b0, _) in zip(intervals, intervals[1:]):
                assert a1 <= b0, "parameters overlap"
        assert covered == buf.numel
        assert members == {s.name for s in specs if (s.dtype, s.kind) == (buf.dtype, buf.kind)}
    # backward order: bucket 0 holds the first parameter in backward order, and buckets start
    # (their earliest parameter in backward order) strictly later as the index grows
    for buf in layout.buffers:
        backward = [s.name for s in reversed(specs) if (s.dtype, s.kind) == (buf.dtype, buf.kind)]
        position = {n: i for i, n in enumerate(backward)}
        starts = [min(position[n] for n in bucket.params) for bucket in buf.buckets]
        assert starts[0] == 0
        assert all(a < b for a, b in zip(starts, starts[1:])), starts
    # owners come from the layout and cover every param
    assert sum(len(layout.owned_by(r)) for r in range(dp)) == len(specs)
    assert 0.0 <= layout.padding_fraction < 1.0
    assert math.isclose(sum(layout.rank_costs()), sum(newton_schulz_cost(s) for s in specs), rel_tol=1e-9)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=spec_lists(), dp=st.integers(1, 64), bucket_size=st.integers(1, 50_000))
def test_invariants_random(specs, dp, bucket_size):
    check_invariants(specs, plan_layout(specs, dp, bucket_size))


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 40).map(lambda k: k * ALIGNMENT), min_size=1, max_size=4, unique=True),
    dp=st.integers(1, 16),
    groups=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_zero_padding_for_equal_size_groups(sizes, dp, groups, seed):
    """Parameters in groups of equal size whose count dp divides pack without padding."""
    names = [(size, k) for size in sizes for k in range(groups * dp)]
    random.Random(seed).shuffle(names)
    specs = [ParamSpec(f"p{i}_{size}", (size,)) for i, (size, _) in enumerate(names)]
    layout = plan_layout(specs, dp, bucket_size=10 * max(sizes) * dp)
    check_invariants(specs, layout)
    assert layout.padding_fraction == 0.0


def transformer_specs(n_layer: int, d: int, vocab: int = 512) -> list[ParamSpec]:
    specs = [ParamSpec("wte", (vocab, d)), ParamSpec("wpe", (256, d))]
    for i in range(n_layer):
        b = f"h.{i}."
        specs += [
            ParamSpec(b + "ln_1.weight", (d,)), ParamSpec(b + "ln_1.bias", (d,)),
            ParamSpec(b + "attn.c_attn.weight", (3 * d, d)), ParamSpec(b + "attn.c_attn.bias", (3 * d,)),
            ParamSpec(b + "attn.c_proj.weight", (d, d)), ParamSpec(b + "attn.c_proj.bias", (d,)),
            ParamSpec(b + "ln_2.weight", (d,)), ParamSpec(b + "ln_2.bias", (d,)),
            ParamSpec(b + "mlp.c_fc.weight", (4 * d, d)), ParamSpec(b + "mlp.c_fc.bias", (4 * d,)),
            ParamSpec(b + "mlp.c_proj.weight", (d, 4 * d)), ParamSpec(b + "mlp.c_proj.bias", (d,)),
        ]
    return specs


@pytest.mark.parametrize("dp", [1, 2, 4, 8])
def test_transformer_blocks_pack_without_padding(dp):
    specs = transformer_specs(n_layer=8, d=128)
    blocks = [s for s in specs if s.name.startswith("h.")]
    layout = plan_layout(blocks, dp, bucket_size=2**20)
    check_invariants(blocks, layout)
    assert layout.padding_fraction == 0.0
    # the whole GPT with embeddings: little padding thanks to greedy fill
    full = plan_layout(specs, dp, bucket_size=2**20)
    check_invariants(specs, full)
    # Measured: 0.0%, 1.1%, 8.2%, 19.7% at dp 1, 2, 4, 8 (the lone embeddings cost the rest).
    assert full.padding_fraction <= {1: 0.0, 2: 0.02, 4: 0.09, 8: 0.20}[dp]


@pytest.mark.parametrize("dp", [2, 4, 8])
def test_whole_ownership_padding_bound_with_a_huge_embedding(dp):
    """One parameter owned whole needs dp shards of its size: padding >= 1 - total / (dp * biggest).

    GPT-2 small's 38.6M-element embedding at dp=8 forces >= 60% padding under
    whole-tensor ownership, whatever the packing; the planner must still honour
    every invariant and never do worse than its plain greedy pass.
    """
    from lightning_layerwise.layout import packing as planner

    specs = transformer_specs(n_layer=12, d=768, vocab=50304)
    layout = plan_layout(specs, dp, bucket_size=2**24)
    check_invariants(specs, layout)
    total = sum(s.numel for s in specs)
    bound = max(0.0, 1 - total / (dp * max(s.numel for s in specs)))
    queue = list(reversed(specs))
    plain = planner._pack(queue, dp, 2**24, layout.costs, (), len(queue))
    assert bound - 1e-9 <= layout.padding_fraction <= plain.padding / (plain.padding + total) + 1e-12


@pytest.mark.parametrize("dp", [2, 3, 4, 8])
def test_owners_balanced_by_newton_schulz_cost(dp):
    specs = transformer_specs(n_layer=8, d=128)
    layout = plan_layout(specs, dp, bucket_size=2**20)
    costs = layout.rank_costs()
    # The embedding alone is one rank's job; everything else spreads evenly.
    biggest = max(newton_schulz_cost(s) for s in specs)
    assert max(costs) - min(costs) <= biggest
    assert layout.imbalance < 1.35, layout.summary()


def test_balance_counts_cost_not_elements():
    """A square matrix costs more Newton–Schulz work than a thin one of equal size."""
    specs = [ParamSpec("square", (64, 64)), ParamSpec("thin", (4096, 1)), ParamSpec("square2", (64, 64)),
             ParamSpec("thin2", (4096, 1))]
    layout = plan_layout(specs, 2, bucket_size=10**6)
    assert layout.params["square"].owner != layout.params["square2"].owner
    assert layout.params["thin"].owner != layout.params["thin2"].owner
    by_numel = plan_layout(specs, 2, bucket_size=10**6, cost=numel_cost)
    assert by_numel.rank_numels() == [2 * 4096, 2 * 4096]


def test_large_parameter_gets_its_own_bucket():
    specs = [ParamSpec("a", (100,)), ParamSpec("big", (5000,)), ParamSpec("b", (100,))]
    layout = plan_layout(specs, 2, bucket_size=1000)
    big = layout.params["big"]
    bucket = layout.buffers[0].buckets[big.bucket]
    assert bucket.params == ("big",)


def test_dp1_is_one_shard_with_everything_owned_by_rank0():
    specs = transformer_specs(2, 64)
    layout = plan_layout(specs, 1, bucket_size=10_000)
    assert all(s.owner == 0 for s in layout.params.values())
    assert layout.group_size == 1


def test_tied_parameter_appears_once():
    emb = torch.nn.Embedding(32, 16)
    head = torch.nn.Linear(16, 32, bias=False)
    head.weight = emb.weight
    model = torch.nn.ModuleDict({"emb": emb, "head": head, "ln": torch.nn.LayerNorm(16)})
    specs = param_specs(model)
    assert [s.name for s in specs] == ["emb.weight", "ln.weight", "ln.bias"]
    layout = plan_layout(specs, 2, 100)
    check_invariants(specs, layout)


def test_frozen_parameters_are_left_out():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model[0].weight.requires_grad_(False)
    assert [s.name for s in param_specs(model)] == ["0.bias", "1.weight", "1.bias"]


def test_summary_reports_padding_and_costs():
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
    text = describe_layout(model, dp=3, bucket_size=4096)
    assert "padding=" in text and "rank 2:" in text and "cost share=" in text


def test_cli_prints_layout(capsys):
    from lightning_layerwise.layout_cli import _main

    _main(["tests.layout.test_layout:_tiny_model", "--dp", "2", "3"])
    out = capsys.readouterr().out
    assert out.count("layout: group_size=") == 2


def _tiny_model():
    return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"group_size": 0}, "group_size=0"),
        ({"group_size": True}, "group_size=True"),
        ({"group_size": 2, "bucket_size": 0}, "bucket_size=0"),
        ({"group_size": 2, "bucket_size": -5}, "bucket_size=-5"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        plan_layout([ParamSpec("w", (4, 4))], **kwargs)


def test_duplicate_and_empty_specs_rejected():
    with pytest.raises(ValueError, match="appears twice"):
        plan_layout([ParamSpec("w", (4,)), ParamSpec("w", (4,))], 2)
    with pytest.raises(ValueError, match="no elements"):
        plan_layout([ParamSpec("w", (0, 4))], 2)


def test_aligned():
    assert aligned(1) == 64 and aligned(64) == 64 and aligned(65) == 128


# --- Note [leftovers] ------------------------------------------------------------------------------

@settings(max_examples=80, deadline=None)
@given(
    dp=st.integers(2, 16),
    sizes=st.lists(st.integers(1, 32).map(lambda k: k * ALIGNMENT), min_size=1, max_size=3, unique=True),
    layers=st.integers(1, 40),
    extra=st.integers(0, 5000).map(lambda k: k * ALIGNMENT),
)
def test_leftovers_fill_the_large_seeds_round(dp, sizes, layers, extra):
    """A stack of blocks whose count ``dp`` does not divide, behind a large parameter (first in backward).

    Each size class of ``c`` matrices needs ``c // dp`` full rounds; the ``c % dp`` leftovers
    (volume ``V``) fit into the large parameter's ``dp - 1`` free shards when its size ``H`` is at
    least ``largest + V / (dp - 1)`` (first-fit decreasing: an item that does not fit means every
    shard has less room than the item). So the padding is at most ``(dp - 1) * H - V`` elements,
    what the large parameter's round must leave empty anyway. The old backward-order fill took
    whole layers into that round and left a short round per class behind.
    """
    specs = []
    for i in range(layers):
        specs += [ParamSpec(f"h.{i}.w{j}", (size,)) for j, size in enumerate(sizes)]
    leftover = sum((layers % dp) * size for size in sizes)
    head = max(sizes) + ALIGNMENT + -(-leftover // (dp - 1)) + extra
    head = aligned(head)
    specs.append(ParamSpec("head", (head,)))  # registered last: first in backward order
    layout = plan_layout(specs, dp, bucket_size=10**9)
    check_invariants(specs, layout)
    padding = layout.total_numel - layout.param_numel
    assert padding <= (dp - 1) * head - leftover, layout.summary()


def test_leftovers_of_a_transformer_stack_behind_an_untied_head():
    """Llama-like: 20 blocks of (q, k, v, o, gate, up, down, 2 norms), an untied head and embedding.

    At dp 8 the head's round (head + embedding as peers, 6 free shards) took whole layers in
    backward order, and every size class ended in a short round: 2.60% padding (measured).
    With Note [leftovers] the leftovers of each class fill the head's round and the rest packs
    in full rounds: 0.24% (measured), owner imbalance 1.028.
    """
    d, ffn, kv, vocab = 256, 704, 64, 4000
    specs = [ParamSpec("embed", (vocab, d))]
    for i in range(20):
        b = f"layers.{i}."
        specs += [ParamSpec(b + "q", (d, d)), ParamSpec(b + "k", (kv, d)), ParamSpec(b + "v", (kv, d)),
                  ParamSpec(b + "o", (d, d)), ParamSpec(b + "gate", (ffn, d)), ParamSpec(b + "up", (ffn, d)),
                  ParamSpec(b + "down", (d, ffn)), ParamSpec(b + "ln1", (d,)), ParamSpec(b + "ln2", (d,))]
    specs += [ParamSpec("norm", (d,)), ParamSpec("head", (vocab, d))]
    from lightning_layerwise.layout import packing as planner

    queue = list(reversed(specs))
    costs = {s.name: newton_schulz_cost(s) for s in specs}
    old = planner._search(queue, 8, 2**24, costs, [0.0] * 8, frozenset())
    layout = plan_layout(specs, 8, bucket_size=2**24)
    check_invariants(specs, layout)
    total = layout.param_numel
    assert old.padding / (old.padding + total) > 0.025
    assert layout.padding_fraction < 0.003, layout.summary()
    assert layout.imbalance < 1.10, layout.summary()


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=spec_lists(), dp=st.integers(2, 64))
def test_leftover_reservation_never_pads_more(specs, dp):
    """The reserved-leftovers packing is a candidate: the plan keeps it only when it pads less."""
    from lightning_layerwise.layout import packing as planner

    layout = plan_layout(specs, dp, bucket_size=10**6)
    check_invariants(specs, layout)
    for buf in layout.buffers:
        members = [s for s in specs if (s.dtype, s.kind) == (buf.dtype, buf.kind)]
        queue = list(reversed(members))
        plain = planner._search(queue, dp, 10**6, layout.costs, [0.0] * dp, frozenset())
        used = sum(s.numel for s in members)
        assert buf.numel - used <= plain.padding + sum(aligned(s.numel) - s.numel for s in members)


# --- element-wise fill (Note [element-wise fill]) ----------------------------------------------


@st.composite
def mixed_spec_lists(draw, max_params=40):
    """Parameters of which some are element-wise (may be split) and the rest owned whole."""
    n = draw(st.integers(1, max_params))
    return [ParamSpec(f"p{i}", draw(shapes), draw(dtypes), draw(kinds), elementwise=draw(st.booleans()))
            for i in range(n)]


def check_fill_invariants(specs: list[ParamSpec], layout) -> None:
    dp = layout.group_size
    by_name = {s.name: s for s in specs}
    assert set(layout.params) == set(by_name)
    for buf in layout.buffers:
        covered = 0
        intervals = []
        for bi, bucket in enumerate(buf.buckets):
            assert bucket.index == bi and bucket.start == covered, "buckets tile the buffer contiguously"
            covered = bucket.end
            assert bucket.numel > 0 and bucket.numel % (dp * ALIGNMENT) == 0, "equal, aligned shards"
            for name in bucket.params:
                slot, spec = layout.params[name], by_name[name]
                assert slot.buffer == buf.index and slot.bucket == bucket.index
                assert slot.offset % ALIGNMENT == 0
                intervals.append((slot.offset, slot.end, name))
                # every element is stepped by exactly one rank, each piece inside its owner's shard
                assert slot.pieces[0].start == 0 and slot.pieces[-1].stop == spec.numel
                for a, b in zip(slot.pieces, slot.pieces[1:]):
                    assert a.stop == b.start, f"{name}: pieces are not contiguous"
                assert all(p.numel > 0 for p in slot.pieces)
                assert len({p.owner for p in slot.pieces}) == len(slot.pieces), "one piece per rank"
                for piece in slot.pieces:  # with replica sharing an owner is replica * dp + position
                    lo, hi = bucket.shard_range(piece.owner % dp)
                    assert lo <= slot.offset + piece.start and slot.offset + piece.stop <= hi, f"{name} crosses"
                if not spec.elementwise:
                    assert not slot.split, f"{name} is owned whole: it may not cross a shard boundary"
        assert covered == buf.numel
        intervals.sort()
        for (_, a1, a), (b0, _, b) in zip(intervals, intervals[1:]):
            assert a1 <= b0, f"{a} and {b} overlap"
    assert sum(layout.rank_numels()) == sum(s.numel for s in specs)
    assert 0.0 <= layout.padding_fraction < 1.0


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=mixed_spec_lists(), dp=st.integers(1, 64), bucket_size=st.integers(1, 50_000))
def test_fill_invariants_random(specs, dp, bucket_size):
    check_fill_invariants(specs, plan_layout(specs, dp, bucket_size))


@settings(max_examples=80, deadline=None)
@given(numels=st.lists(st.integers(1, 5000), min_size=1, max_size=30), dp=st.integers(1, 64))
def test_element_wise_parameters_alone_pad_only_for_alignment(numels, dp):
    """Only element-wise parameters: a ZeRO-1 layout, padded only to align parameters and shards."""
    specs = [ParamSpec(f"p{i}", (n,), elementwise=True) for i, n in enumerate(numels)]
    layout = plan_layout(specs, dp)
    assert len(layout.buffers[0].buckets) == 1
    ideal = sum(aligned(n) for n in numels)
    assert layout.total_numel == aligned(ideal, dp * ALIGNMENT)
    numels_per_rank = layout.rank_numels()
    assert max(numels_per_rank) - min(numels_per_rank) <= layout.total_numel // dp


def test_a_parameter_split_across_three_ranks():
    specs = [ParamSpec("emb", (100, 30), elementwise=True), ParamSpec("w", (30, 30))]
    layout = plan_layout(specs, 4)
    emb = layout.params["emb"]
    assert len(emb.pieces) >= 3 and [p.owner for p in emb.pieces] == sorted(p.owner for p in emb.pieces)
    assert not layout.params["w"].split


def test_element_wise_fill_pours_small_parameters_into_matrix_padding():
    """A bias that fits the padding of a matrix bucket completing no earlier goes there, whole."""
    specs = [ParamSpec("a", (64, 64)), ParamSpec("a_bias", (64,), elementwise=True), ParamSpec("b", (64, 64)),
             ParamSpec("c", (64, 64))]
    layout = plan_layout(specs, 2)  # three equal matrices on two ranks: one round has a free shard
    bias = layout.params["a_bias"]
    assert not bias.split and layout.buffers[0].buckets[bias.bucket].params != ("a_bias",)
    whole_only = plan_layout([s for s in specs if s.name != "a_bias"], 2)
    assert layout.total_numel == whole_only.total_numel, "the bias cost no buffer space"


# --- owner groups: choosing g (Note [choosing the owner group size]) -----------------------------------


def _divisors(n: int) -> list[int]:
    return [g for g in range(1, n + 1) if n % g == 0]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=mixed_spec_lists(max_params=25), dp=st.integers(1, 64), bucket_size=st.integers(64, 50_000),
       per_node=st.sampled_from([None, 1, 2, 4, 8]))
# the larger group pads little without its replicas, too much with them (the plan the wrapper makes)
@example(specs=[ParamSpec("p0", (65,), torch.bfloat16, "dense", elementwise=True)], dp=10, bucket_size=64,
         per_node=None)
def test_chosen_owner_group_size_is_the_largest_on_a_node_that_pads_at_most_one_percent(specs, dp, bucket_size,
                                                                                        per_node):
    """Note [choosing the owner group size]: one group on one node; otherwise the largest divisor of the
    ranks per node (with one rank per node: all ranks, then one) whose buffers exceed the unpadded
    parameters by at most 1%, else the least bytes."""
    g, layout = choose_owner_group_size(specs, dp, bucket_size, ranks_per_node=per_node)
    assert dp % g == 0 and layout.group_size == g and layout.replicas == dp // g
    check_fill_invariants(specs, layout)  # every element once, no whole matrix across a shard, equal shards
    assert layout == plan_layout(specs, g, bucket_size, replicas=dp // g), "the plan the wrapper makes"
    node = per_node or DEFAULT_RANKS_PER_NODE
    if dp <= node:
        assert g == dp, "one node: one group"
        return
    candidates = [dp, 1] if node == 1 else [d for d in reversed(_divisors(dp)) if node % d == 0]  # largest first
    assert g in candidates
    tried_first = candidates[:candidates.index(g)]
    limit = (1 + PADDING_TOLERANCE) * sum(aligned(s.numel) for s in specs)
    assert all(plan_layout(specs, d, bucket_size, replicas=dp // d).total_numel > limit for d in tried_first), \
        "a larger group would have padded little enough"
    if layout.total_numel > limit:
        need = {d: estimated_rank_bytes(plan_layout(specs, d, bucket_size, replicas=dp // d)) for d in candidates}
        assert need[g] == min(need.values()), (g, need)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=mixed_spec_lists(max_params=30), dp=st.sampled_from([2, 4, 6, 8, 12, 16, 32, 64]), data=st.data())
def test_layouts_for_every_group_size_dividing_dp_keep_the_invariants(specs, dp, data):
    g = data.draw(st.sampled_from(_divisors(dp)))
    check_fill_invariants(specs, plan_layout(specs, g, 4096))


def test_few_matrices_on_many_ranks_choose_smaller_owner_groups():
    """Twelve equal matrices and an embedding at 64 ranks (8 per node): one group of 64 would be mostly
    padding; the chosen groups pad less and hold less per rank."""
    specs = [ParamSpec("emb", (5000, 64), elementwise=True)]
    specs += [ParamSpec(f"h.{i}.w", (256, 64)) for i in range(12)]
    g, layout = choose_owner_group_size(specs, 64, ranks_per_node=8)
    whole = plan_layout(specs, 64)
    assert g < 64 and layout.padding_fraction < whole.padding_fraction
    assert estimated_rank_bytes(layout) < estimated_rank_bytes(whole)


def test_owner_group_choice_weighs_experts_as_the_wrapper_plans_them():
    """``owner_group_size="auto"`` with expert marks: experts are planned over their expert data-parallel group
    whatever the owner group is, so only the dense parameters decide. At 16 ranks (8 per node, E=8, so 2
    expert data-parallel ranks), 8 dense matrices fill a node's 8 shards without padding, so they take
    groups of 8; taking the 6 half-size experts as dense too would leave 2 of 8 shards of their round empty
    (and 2 of 4 at 4), so that choice falls to groups of 2."""
    from lightning_layerwise.layout import choose_owner_group_size

    dense = [ParamSpec(f"d{i}", (512, 512)) for i in range(8)]
    experts = [ParamSpec(f"e{i}", (256, 512), kind="expert") for i in range(6)]
    as_dense = [ParamSpec(s.name, s.shape) for s in experts]
    g_marked, layout = choose_owner_group_size(dense + experts, 16, 2**20, ranks_per_node=8, expert_dp_size=2)
    g_dense_only, _ = choose_owner_group_size(dense + as_dense, 16, 2**20, ranks_per_node=8)
    assert (g_marked, g_dense_only) == (8, 2)
    assert {b.kind for b in layout.buffers} == {"dense", "expert"}
    owners = {p.owner for name, slot in layout.params.items() if name.startswith("e") for p in slot.pieces}
    assert owners == {0, 1}, "experts are planned over the 2 expert data-parallel ranks"


# --- flat buckets follow the layers (Note [flat layers] in layout/flat.py) ---------------------------------------

def _gpt_specs(layers: int, width: int, vocab: int = 96) -> list[ParamSpec]:
    """The example GPT's trainable parameters, every one element-wise (AdamW), in registration order."""
    specs = [ParamSpec("transformer.wte.weight", (vocab, width), torch.float32, elementwise=True),
             ParamSpec("transformer.wpe.weight", (64, width), torch.float32, elementwise=True)]
    for i in range(layers):
        for name, shape in (("ln_1.weight", (width,)), ("attn.c_attn.weight", (3 * width, width)),
                            ("attn.c_attn.bias", (3 * width,)), ("attn.c_proj.weight", (width, width)),
                            ("ln_2.weight", (width,)), ("mlp.c_fc.weight", (4 * width, width)),
                            ("mlp.c_proj.weight", (width, 4 * width))):
            specs.append(ParamSpec(f"transformer.h.{i}.{name}", shape, torch.float32, elementwise=True))
    specs.append(ParamSpec("transformer.ln_f.weight", (width,), torch.float32, elementwise=True))
    return specs


@pytest.mark.parametrize("dp", [2, 3, 4])
def test_flat_buckets_at_the_sharded_bucket_size_hold_one_layer_each(dp):
    """Blocks of 3.1 M elements under the sharded bucket size of 4 Mi, planned for sharded parameters
    (``follow_layers``): each block is one bucket of its own (a bucket that ran on into the next block would keep
    two blocks full while either runs). Without it the flat buckets cross blocks, as they always did."""
    from lightning_layerwise.layout import SHARDED_BUCKET_SIZE
    from lightning_layerwise.layout.flat import layer_of

    specs = _gpt_specs(layers=10, width=512)
    layout = plan_layout(specs, group_size=dp, bucket_size=SHARDED_BUCKET_SIZE, follow_layers=True)
    plain = plan_layout(specs, group_size=dp, bucket_size=SHARDED_BUCKET_SIZE)  # unsharded: as before
    assert any(len({layer_of(n) for n in b.params if ".h." in n}) > 1 for buf in plain.buffers for b in buf.buckets)
    layers_of = [{layer_of(n) for n in b.params if ".h." in n} for buf in layout.buffers for b in buf.buckets]
    assert sum(1 for layers in layers_of if layers) == 10, layers_of
    assert all(len(layers) <= 1 for layers in layers_of), layers_of
    assert layout.padding_fraction < 0.01


def test_layer_of_names_the_numbered_block():
    from lightning_layerwise.layout.flat import layer_of

    assert layer_of("transformer.h.3.attn.c_attn.weight") == "transformer.h.3"
    assert layer_of("0.2.weight") == "0"
    assert layer_of("transformer.wte.weight") == "transformer.wte.weight"
