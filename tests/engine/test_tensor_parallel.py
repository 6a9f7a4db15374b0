"""Tensor parallelism under the session: parity with one process without it, each Muon matrix orthogonalized
whole and once in the world, and clear errors for what it does not take (Note [tensor-parallel mesh], Note [local
parameters] in ``engine/tensor_parallel.py``, Note [tensor-parallel exchange] in ``engine/tp_exchange.py``).

The model (``tests/_tp_model.py``) has attention and MLP projections parallelized column- and row-wise, norms,
an embedding and a head, tied or not. The reference trains the same initial model in one process, without
tensor parallelism, on the same global batches. Tolerance: float32, relative 1e-5 per tensor after 8 steps:
the runs differ only in the order of float32 sums (the row-wise partial sums, the data-parallel average), each
about 1e-7 relative, which the steps carry forward without growing past a few 1e-6 at these learning rates.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F

import lightning_layerwise as llw
from lightning_layerwise.engine import tp_exchange
from lightning_layerwise.engine.tensor_parallel import localize
from lightning_layerwise.engine.wrapper_setup import layout_specs
from tests._dist import LATE_MS, counting_compiler, reference_threads, run_distributed
from tests._tp_model import HEADS, WIDTH, TinyLM, batches, full_state, parallelize

STEPS, BATCH, RTOL = 8, 8, 1e-5


def make_optimizer(name: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    if name.endswith("views"):
        mark_views(model)
    normuon = {"normuon": True, "lr": 0.01} if name.startswith("normuon") else {"lr": 0.02}
    opt = llw.Muon(llw.muon_param_groups(model), weight_decay=0.1, adamw_lr=1e-3, ns_dtype=torch.float32, **normuon)
    if name.endswith("qkclip"):  # a bound the first steps' logits pass, so heads are clipped
        for block in model.blocks:
            llw.mark_attention(block.attn, n_heads=HEADS, head_dim=WIDTH // HEADS, q="q.weight", k="k.weight")
        CLIPS.append(llw.QKClip(model, tau=QK_TAU).attach(opt))
    return opt


CLIPS: list = []  # the QK-clips of the runs in this process, to read after them
QK_TAU = 0.5


def mark_views(model: torch.nn.Module) -> None:
    """Blocks of every kind against the tensor-parallel shards: per-head rows of the column-wise q, k, v (each rank
    holds whole heads), per-head columns of the row-wise o; in the MLP blocks of two sizes, in the first block
    along the sharded dimension and straddling the shard boundary (rows of the column-wise up, columns of the
    row-wise down), in the second across it (columns of up, rows of down: each rank holds part of every block)."""
    for block in model.blocks:
        for name in ("q", "k", "v"):
            llw.mark_matrices(getattr(block.attn, name), "weight", split=HEADS)
        llw.mark_matrices(block.attn.o, "weight", split=HEADS, split_dim=1)
    first, second = model.blocks[0].mlp, model.blocks[1].mlp
    llw.mark_matrices(first.up, "weight", split=(WIDTH + 16, 3 * WIDTH - 16))
    llw.mark_matrices(first.down, "weight", split=(WIDTH + 8, 3 * WIDTH - 8), split_dim=1)
    llw.mark_matrices(second.up, "weight", split=(12, WIDTH - 12), split_dim=1)
    llw.mark_matrices(second.down, "weight", split=(WIDTH - 12, 12))


def reference(optimizer: str, tied: bool) -> dict[str, torch.Tensor]:
    with reference_threads():
        torch.manual_seed(0)
        model = TinyLM(tied=tied)
        opt = make_optimizer(optimizer, model)
        for tokens in batches(STEPS, BATCH):
            model.loss(tokens).backward()
            opt.step()
            opt.zero_grad()
    return {**{n: p.detach().clone() for n, p in model.named_parameters()}, **last_logits(optimizer)}


def last_logits(optimizer: str) -> dict[str, torch.Tensor]:
    """Under QK-clip, every head's largest logit of the last step, over the world (compared like a parameter)."""
    return {"qk_clip.last_max_logits": CLIPS[-1].last_max_logits.clone()} if optimizer.endswith("qkclip") else {}


def train(world: int, T: int, optimizer: str, tied: bool = False, parallel_head: bool = False,
          orthogonalized: list | None = None, owner_group_size: int | None = None,
          shard_parameters: bool = False, half: bool = False) -> dict[str, torch.Tensor]:
    """One run under the session at ``world`` ranks, ``T`` per tensor-parallel group; the full parameters.
    ``half``: a bfloat16 model stepped through float32 masters, as under ``precision="bf16-true"``."""
    torch.manual_seed(0)
    model = TinyLM(tied=tied).to(torch.bfloat16 if half else torch.float32)
    session = llw.LayerwiseSession(llw.LayerwiseConfig(tensor_parallel_size=T, owner_group_size=owner_group_size,
                                                       shard_parameters=shard_parameters))
    mesh = session.device_mesh
    parallelize(model, mesh["tensor_parallel"], parallel_head)
    opt = make_optimizer(optimizer, model)
    wrapped = session.wrap(model, opt, master_weights=half)
    D, d = world // T, mesh["data_parallel"].get_local_rank()
    for step, tokens in enumerate(batches(STEPS, BATCH)):
        if orthogonalized is not None:
            orthogonalized.append([])
        loss = wrapped.module.loss(tokens.chunk(D)[d])
        session.backward(loss)
        session.step(opt)
        opt.zero_grad()
    if owner_group_size is not None:  # owner groups inside each tensor-parallel position, sharing the step
        assert session.groups.owner_group_size == owner_group_size and session.groups.replica is not None
    assert session.wrapper.shard_parameters == (shard_parameters and D > 1)
    session.sync_parameters()
    with llw.full_parameters(model) if shard_parameters else contextlib.nullcontext():
        out = {**full_state(model), **last_logits(optimizer)}
    session.release()
    return out


def reference_half(optimizer: str) -> dict[str, torch.Tensor]:
    """One process, a bfloat16 model stepped through float32 masters: each step the masters take the bfloat16
    gradients, the optimizer steps them, and the model takes them back rounded."""
    with reference_threads():
        torch.manual_seed(0)
        masters = TinyLM()
        opt = make_optimizer(optimizer, masters)
        model = copy.deepcopy(masters).to(torch.bfloat16)
        pairs = list(zip(masters.parameters(), model.parameters()))
        for tokens in batches(STEPS, BATCH):
            model.loss(tokens).backward()
            for master, p in pairs:
                master.grad, p.grad = p.grad.float(), None
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                for master, p in pairs:
                    p.copy_(master)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _configs(rank: int, world: int, configs: list[tuple]) -> list[dict[str, torch.Tensor]]:
    return [train(world, *config) for config in configs]


def assert_matches(results: list, configs: list[tuple]) -> None:
    for k, (T, optimizer, *rest) in enumerate(configs):
        want = reference(optimizer, bool(rest and rest[0]))
        for rank, per_rank in enumerate(results):
            got = per_rank[k]
            assert set(got) == set(want)
            for name, value in want.items():
                err = ((got[name] - value).norm() / value.norm()).item()
                assert err <= RTOL, f"T={T} {optimizer} {rest}: rank {rank} {name} differs by {err:.2e} relative"
        for per_rank in results[1:]:  # every rank of a tensor-parallel group holds the same values
            for name in want:
                torch.testing.assert_close(per_rank[k][name], results[0][k][name], rtol=0, atol=0)


@pytest.mark.slow
def test_data_parallel_2_by_tensor_parallel_2_and_tensor_parallel_4_match_one_process():
    configs = [(2, "adamw"), (2, "muon"), (2, "muon", True), (4, "muon"), (4, "adamw", False, True)]
    assert_matches(run_distributed(_configs, 4, configs), configs)


@pytest.mark.slow
def test_owner_groups_inside_each_tensor_parallel_position_match_one_process():
    """8 ranks: tensor-parallel groups of 2, and over each position's 4 data-parallel ranks owner groups of 2
    sharing the step (replica sharing, Note [replica sharing] in ``layout/sharing.py``)."""
    configs = [(2, "muon", False, False, None, 2), (2, "adamw", True, False, None, 2)]
    assert_matches(run_distributed(_configs, 8, configs), configs)


@pytest.mark.slow
def test_sharded_parameters_with_tensor_parallelism_match_one_process():
    """2-D sharding: each local tensor sharded again over the data-parallel ranks between uses (Note [sharded
    parameters] in ``engine/buffers.py``), each matrix still whole on its owner, orthogonalized whole over the
    tensor-parallel group; also with every collective late."""
    configs = [(2, "muon", True, False, None, None, True), (2, "adamw", False, False, None, None, True)]
    assert_matches(run_distributed(_configs, 4, configs), configs)
    assert_matches(run_distributed(_configs, 4, configs[:1], late_ms=LATE_MS), configs[:1])


def test_tensor_parallel_2_alone_matches_one_process():
    configs = [(2, "muon"), (2, "adamw", True), (2, "muon", False, True)]
    assert_matches(run_distributed(_configs, 2, configs), configs)


@pytest.mark.slow
def test_normuon_matrix_blocks_and_qk_clip_with_tensor_parallelism_match_one_process():
    """NorMuon and blocks of every kind (``mark_views``: per head, straddling the shard boundary, across it) cut
    from the whole matrices on their ranks, NorMuon's state kept whole (Note [views and NorMuon over the exchange]
    in ``engine/tp_exchange.py``); QK-clip with each tensor-parallel rank recording its own heads: every head's
    largest logit over the world equals one process's, and so do the clipped weights."""
    configs = [(2, "normuon_views"), (2, "muon_views"), (2, "normuon_qkclip"), (4, "normuon_views"),
               (4, "muon_qkclip")]
    assert_matches(run_distributed(_configs, 4, configs), configs)


def test_tensor_parallel_matches_one_process_with_late_collectives():
    configs = [(2, "muon", True), (2, "normuon_qkclip")]
    assert_matches(run_distributed(_configs, 4, configs, late_ms=LATE_MS), configs)


def test_bf16_masters_under_tensor_parallelism_match_one_process_to_bf16_rounding():
    """``bf16-true``'s path: a bfloat16 model, float32 masters of what each rank owns (sharing their parameters'
    tensor-parallel specs), Muon's exchange on the masters. The runs differ in the order of bfloat16 sums (the
    row-wise layers' partial sums are added in bfloat16 across ranks), so the weights differ by about a bfloat16
    rounding: the whole model's relative difference is held to one bfloat16 epsilon (2^-7; measured 3.1e-3 at
    8 steps, while orthogonalizing shards alone gives 2.3e-2)."""
    configs = [(2, "muon", False, False, None, None, False, True)]
    results = run_distributed(_configs, 4, configs)
    want = reference_half("muon")
    for rank, per_rank in enumerate(results):
        got = per_rank[0]
        diff = sum((got[n].float() - want[n].float()).norm() ** 2 for n in want) ** 0.5
        err = (diff / sum(want[n].float().norm() ** 2 for n in want) ** 0.5).item()
        assert err <= torch.finfo(torch.bfloat16).eps, f"rank {rank}: the model differs by {err:.2e} relative"
        assert all(got[n].dtype == torch.bfloat16 for n in got)
        for name in want:
            torch.testing.assert_close(got[name], results[0][0][name], rtol=0, atol=0)


def _compiled(rank: int, world: int) -> tuple[dict[str, torch.Tensor], int]:
    """Tensor-parallel 2 alone, the wrapped module under ``torch.compile`` (a backend that runs each graph eagerly
    and counts it); the full parameters after ``STEPS`` steps and the graphs compiled."""
    backend, graphs = counting_compiler()
    torch.manual_seed(0)
    model = TinyLM()
    session = llw.LayerwiseSession(llw.LayerwiseConfig(tensor_parallel_size=2))
    parallelize(model, session.device_mesh["tensor_parallel"])
    opt = make_optimizer("muon", model)
    compiled = torch.compile(session.wrap(model, opt).module, backend=backend)
    for tokens in batches(STEPS, BATCH):
        logits = compiled(tokens[:, :-1])
        session.backward(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)))
        session.step(opt)
        opt.zero_grad()
    session.sync_parameters()
    out = full_state(model)
    session.release()
    return out, len(graphs)


def test_a_compiled_tensor_parallel_model_is_one_graph_and_matches_one_process():
    """The module's attributes read as DTensors through its own dict of specs (Note [local parameters]), which
    dynamo traces: the whole forward, DTensor's collectives included, is one graph, compiled once in 8 steps."""
    results = run_distributed(_compiled, 2)
    want = reference("muon", False)
    for rank, (got, graphs) in enumerate(results):
        assert graphs == 1, f"rank {rank}: {graphs} graphs"
        for name, value in want.items():
            err = ((got[name] - value).norm() / value.norm()).item()
            assert err <= RTOL, f"rank {rank}: {name} differs by {err:.2e} relative"


# --- the replica check ----------------------------------------------------------------------------------------------
def _corrupted(rank: int, world: int, name: str) -> str:
    """Trains a step at tensor-parallel 2, then changes ``name`` by one ulp on tensor-parallel rank 1 only; what the
    replica check says."""
    torch.manual_seed(0)
    model = TinyLM()
    session = llw.LayerwiseSession(llw.LayerwiseConfig(tensor_parallel_size=2))
    parallelize(model, session.device_mesh["tensor_parallel"])
    opt = make_optimizer("muon", model)
    wrapped = session.wrap(model, opt)
    session.backward(wrapped.module.loss(batches(1, BATCH)[0]))
    session.step(opt)
    session.wrapper.check_replicas()  # equal after a step
    if rank == 1:
        with torch.no_grad():
            param = dict(model.named_parameters())[name]
            param.view(-1)[0] = torch.nextafter(param.view(-1)[0], torch.tensor(float("inf")))
    try:
        session.wrapper.check_replicas()
        return "equal"
    except llw.ReplicaDivergenceError as error:
        return str(error)
    finally:
        session.release()


def test_the_replica_check_compares_what_a_tensor_parallel_group_holds_whole():
    """A replicated parameter (a norm) one ulp off on one rank of the group is found; shards differ by design."""
    found = run_distributed(_corrupted, 2, "blocks.0.norm1.weight")
    assert found[0] == found[1] and "'blocks.0.norm1.weight'" in found[0], found
    assert "between tensor-parallel rank 0 and tensor-parallel rank(s) [1]" in found[0], found[0]
    assert run_distributed(_corrupted, 2, "blocks.0.attn.q.weight") == ["equal", "equal"]


# --- once in the world ----------------------------------------------------------------------------------------------
def _count_orthogonalized(rank: int, world: int, duplicate: bool) -> list[list[tuple[int, ...]]]:
    """The shapes this rank orthogonalized in each step (``duplicate``: every rank orthogonalizes every matrix,
    the mutation the count must catch)."""
    seen: list[list[tuple[int, ...]]] = []
    original = tp_exchange.orthogonalize

    def counting(matrices, *args, **kwargs):
        seen[-1].extend(tuple(M.shape) for M in matrices)
        return original(matrices, *args, **kwargs)

    tp_exchange.orthogonalize = counting
    if duplicate:
        whole = tp_exchange.orthogonalize_whole

        def everywhere(directions, specs, update, dtype, extra_sizes=None):
            # every rank does all the work (counted); the result is not used
            tp_exchange.orthogonalize([_gathered(d, s) for d, s in zip(directions, specs)])
            return whole(directions, specs, update, dtype, extra_sizes)

        tp_exchange.orthogonalize_whole = everywhere
    try:
        train(world, 2, "muon", orthogonalized=seen)
    finally:
        tp_exchange.orthogonalize = original
        if duplicate:
            tp_exchange.orthogonalize_whole = whole
    return seen


def _gathered(local: torch.Tensor, spec) -> torch.Tensor:
    import torch.distributed as dist

    if spec.shard_dim is None:
        return local
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(spec.group))]
    dist.all_gather(parts, local.contiguous(), group=spec.group)
    return torch.cat(parts, dim=spec.shard_dim)


def _muon_matrices() -> list[tuple[int, ...]]:
    model = TinyLM()
    groups = llw.muon_param_groups(model)
    return sorted(tuple(p.shape) for g in groups if g["use_muon"] for p in g["params"])


@pytest.mark.parametrize("duplicate", [False, True], ids=["as-built", "duplicating-mutation"])
def test_each_matrix_is_orthogonalized_whole_once_in_the_world(duplicate):
    per_rank = run_distributed(_count_orthogonalized, 4, duplicate)
    want = _muon_matrices()
    for step in range(STEPS):
        shapes = sorted(s for seen in per_rank for s in seen[step])
        if duplicate:  # the count sees the repeated work: the test below is not blind to it
            assert len(shapes) > len(want)
        else:
            assert shapes == want, f"step {step}: orthogonalized {shapes}, Muon matrices {want}"


def _shards_alone(rank: int, world: int) -> dict[str, torch.Tensor]:
    """The mutation the parity tests must catch: each rank orthogonalizes its shards alone (blockwise)."""
    original = tp_exchange.orthogonalize_whole
    tp_exchange.orthogonalize_whole = lambda directions, specs, update, dtype, extra_sizes=None: (
        update(list(range(len(directions))), list(directions))[0], None)
    try:
        return train(world, 2, "muon")
    finally:
        tp_exchange.orthogonalize_whole = original


def test_orthogonalizing_shards_alone_fails_parity():
    got = run_distributed(_shards_alone, 2)[0]
    want = reference("muon", False)
    worst = max(((got[n] - v).norm() / v.norm()).item() for n, v in want.items())
    assert worst > 100 * RTOL, f"a blockwise Muon came within {worst:.1e} of the whole-matrix reference"


# --- assignment -----------------------------------------------------------------------------------------------------
def test_assignment_balances_newton_schulz_cost_and_is_deterministic():
    shapes = [(64, 64), (64, 256), (256, 64), (32, 32), (32, 32), (64, 64)]
    owner = tp_exchange.assign(shapes, 2)
    assert owner == tp_exchange.assign(list(shapes), 2)
    load = [sum(tp_exchange.ns_cost(s) for s, o in zip(shapes, owner) if o == r) for r in range(2)]
    total = sum(tp_exchange.ns_cost(s) for s in shapes)
    assert max(load) <= 0.5 * total + max(tp_exchange.ns_cost(s) for s in shapes)
    assert set(tp_exchange.assign(shapes, 8)) <= set(range(8))


# --- what it refuses ------------------------------------------------------------------------------------------------
def _refusals(rank: int, world: int) -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    messages = []
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("data_parallel", "tensor_parallel"))
    model = TinyLM()
    fully_shard(model.blocks[0].mlp, mesh=mesh["data_parallel"])  # as a configure_model for FSDP2 + TP would
    try:
        llw.LayerwiseSession(llw.LayerwiseConfig(tensor_parallel_size=2)).wrap(model)
    except ValueError as error:
        messages.append(str(error))
    uneven = torch.nn.Linear(4, 3)
    uneven.weight = torch.nn.Parameter(distribute_tensor(uneven.weight.detach(), mesh["tensor_parallel"], [Shard(0)]))
    try:
        localize(uneven, mesh["tensor_parallel"])
    except ValueError as error:
        messages.append(str(error))

    class WholeTensor(torch.optim.Optimizer):  # not known to be element-wise
        def __init__(self, params):
            super().__init__(params, {})

    model = parallelize(copy.deepcopy(TinyLM()), mesh["tensor_parallel"])
    try:
        llw.LayerwiseSession(llw.LayerwiseConfig(tensor_parallel_size=2)).wrap(model, WholeTensor(model.parameters()))
    except ValueError as error:
        messages.append(str(error))
    costed = parallelize(TinyLM(), mesh["tensor_parallel"])  # the layout costs a shard as its whole matrix
    localize(costed, mesh["tensor_parallel"])
    specs = {s.name: s for s in layout_specs(costed)}
    messages.append((tuple(specs["blocks.0.attn.q.weight"].shape), specs["blocks.0.attn.q.weight"].matrices,
                     tuple(specs["blocks.0.mlp.down.weight"].shape), specs["blocks.0.mlp.down.weight"].matrices))
    with torch.device("meta"):
        on_meta = TinyLM()
    try:
        llw.LayerwiseSession(llw.LayerwiseConfig(tensor_parallel_size=2)).wrap(on_meta)
    except ValueError as error:
        messages.append(str(error))
    stacked = parallelize(TinyLM(), mesh["tensor_parallel"])
    stacked.experts = torch.nn.Parameter(torch.randn(2, 8, 8))  # a stack of matrices, replicated over the group
    try:
        llw.LayerwiseSession(llw.LayerwiseConfig(tensor_parallel_size=2)).wrap(
            stacked, llw.Muon(llw.muon_param_groups(stacked)))
    except ValueError as error:
        messages.append(str(error))
    session = llw.LayerwiseSession(llw.LayerwiseConfig(tensor_parallel_size=2))
    later = parallelize(TinyLM(), mesh["tensor_parallel"])
    session.wrap(later)
    try:  # an optimizer added after wrap is checked as one given to it
        session.add_optimizer(WholeTensor(later.parameters()))
    except ValueError as error:
        messages.append(str(error))
    session.release()
    return messages


def test_set_up_refuses_by_name_and_costs_each_shard_as_its_whole_matrix():
    messages = run_distributed(_refusals, 2)[0]
    assert len(messages) == 7, messages
    assert "(2, 8, 8)" in messages[5] and "2-D matrices" in messages[5]
    assert "WholeTensor" in messages[6] and "shards of tensor-parallel parameters" in messages[6]
    assert messages[3] == ((16, 32), ((32, 32),), (32, 64), ((32, 128),)), messages[3]
    assert "meta device" in messages[4] and "empty_init=False" in messages[4]
    assert "shard_parameters=True" in messages[0] and "fully_shard" in messages[0]
    assert "does not divide 3" in messages[1]
    assert "WholeTensor" in messages[2] and "elementwise_optimizers" in messages[2]


@pytest.mark.parametrize("options, words", [
    ({"tensor_parallel_size": 0}, "tensor_parallel_size=0"),
    ({"tensor_parallel_size": 2, "expert_parallel_size": 2}, "expert_parallel_size"),
])
def test_bad_tensor_parallel_settings_are_refused_at_construction(options, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(")):
        llw.LayerwiseConfig(**options)
