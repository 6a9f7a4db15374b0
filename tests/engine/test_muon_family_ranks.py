"""Stacked and split matrices, NorMuon and QK-clip under the layer-wise wrapper, against the papers' formulas.

Every run trains ``_muon_family.py``'s FamilyNet (experts stacked in 3-D parameters, a fused QKV per head,
a query per head, two attentions QK-clip watches) for 10 steps on 12-row global batches, each rank its rows,
and compares with one process running the reference optimizer written from the formulas (float32
Newton-Schulz against float64, relative error <= 1e-5):

* at 2 and 3 ranks and at 4 as 2 owner groups of 2, at 3 with sharded parameters, plain and (3 ranks) with
  every collective delayed on a worker thread (the timing fuzzer), which must give bitwise the plain run;
* the Newton-Schulz count: each of FamilyNet's 28 matrices (4 + 4 experts, 12 per-head blocks, 4 query heads
  and 4 plain matrices) is orthogonalized exactly once per step over all ranks;
* QK-clip: fires on the two hot heads, rescales the query and key weights stepped by two different ranks, and
  every rank ends bitwise equal; with AdamW for every parameter the query and key weights are split into
  pieces over the ranks (element-wise fill), and each rank scales the rows of its piece;
* the example MoE GPT with grouped (3-D) experts, E=4 on 4 ranks with expert-parallel size 2, Muon and NorMuon,
  against the reference holding every expert;
* NorMuon and QK-clip in a Fabric loop and in a plain torch loop over ``LayerwiseSession``; QK-clip under
  ``bf16-true``, where the optimizer steps float32 masters.
"""

from __future__ import annotations

import contextlib
import functools
from collections import Counter
from unittest import mock

import pytest
import torch

from _dist import LATE_MS, reference_threads, run_distributed
from _muon_family import (FamilyNet, ReferenceOptimizer, batches, loss_fn, moe_matrices, package_optimizer,
                          reference_run)
from helpers import rel_err
from lightning_layerwise import LayerwiseDataParallel, ProcessGroups, QKClip, full_parameters
from lightning_layerwise.optim import elementwise_parameters, orthogonalization
from lightning_layerwise.optim.matrices import matrix_shapes, matrix_views

STEPS = 10
TAU = 30.0
VARIANTS = ("muon", "normuon", "qkclip", "adamw_qkclip")  # the last: AdamW for all, its matrices split in pieces
MATRICES_PER_STEP = 28


class CountMatrices:
    """Matrices this process orthogonalizes in each optimizer step (the one function every path goes through)."""

    def __init__(self) -> None:
        self.per_step: list[Counter] = []
        original = orthogonalization._orthogonalize_chunk

        def counting(matrices, *args, **kwargs):
            self.per_step[-1].update(tuple(m.shape) for m in matrices)
            return original(matrices, *args, **kwargs)

        self.patch = mock.patch.object(orthogonalization, "_orthogonalize_chunk", counting)

    def step(self) -> None:
        self.per_step.append(Counter())


def train(ddp: LayerwiseDataParallel, opt, steps, rank: int, world: int, after_step=lambda: None) -> CountMatrices:
    """The wrapper's loop over ``steps`` (global batches, this rank's rows of each), counting Newton-Schulz."""
    counter = CountMatrices()
    with counter.patch:
        for tokens in steps:
            counter.step()
            opt.zero_grad()
            loss_fn(ddp, tokens.chunk(world)[rank]).backward()
            ddp.finish_grad_sync()
            opt.step()
            ddp.start_param_sync()
            after_step()
        ddp.param_sync.finish()
    return counter


def _worker(rank: int, world: int, owner_group_size: int | None, shard_parameters: bool = False) -> dict:
    out = {}
    for variant in VARIANTS:
        groups = ProcessGroups.create(owner_group_size=owner_group_size)
        model = FamilyNet(hot_heads=(1, 3))
        opt = package_optimizer(model, normuon=variant == "normuon", adamw=variant == "adamw_qkclip")
        elementwise = elementwise_parameters(opt)
        ddp = LayerwiseDataParallel(model, groups, bucket_size=600, prefetch_depth=1,
                                    elementwise=lambda n, p: p in elementwise, shard_parameters=shard_parameters)
        ddp.use_shards_in(opt)
        clip = QKClip(model, tau=TAU).attach(opt) if variant.endswith("qkclip") else None
        clipped = []
        counter = train(ddp, opt, batches(STEPS), rank, world,
                        after_step=lambda: clipped.append(int(clip.clipped_heads) if clip is not None else 0))
        with full_parameters(ddp) if shard_parameters else contextlib.nullcontext():
            params = {n: p.detach().clone() for n, p in model.named_parameters()}
        out[variant] = {"params": params, "ns": [sum(c.values()) for c in counter.per_step],
                        "parameter_side": type(ddp.param_sync).__name__,
                        "owns": {n: ddp.records.owns(p) for n, p in model.named_parameters()},
                        "split": sorted(n for n, slot in ddp.layout.params.items() if slot.split),
                        "clipped": clipped}
        ddp.release()
        groups.destroy()
    return out


@functools.cache
def run(world: int, owner_group_size: int | None = None, late_ms: float | None = None,
        shard_parameters: bool = False) -> list[dict]:
    return run_distributed(_worker, world, owner_group_size, shard_parameters, late_ms=late_ms)


@functools.cache
def reference(variant: str) -> dict:
    with reference_threads():
        return reference_run(variant, STEPS, tau=TAU if variant.endswith("qkclip") else None)


def test_familynet_has_the_matrices_the_count_expects():
    model = FamilyNet()
    views = matrix_views(model)
    groups = package_optimizer(model).param_groups
    muon_params = [p for g in groups if g["use_muon"] for p in g["params"]]
    assert sum(len(matrix_shapes(p.shape, views[id(p)])) for p in muon_params) == MATRICES_PER_STEP


@pytest.mark.slow
@pytest.mark.parametrize("world,g,sharded", [(2, None, False), (3, None, False), (4, 2, False), (3, None, True)],
                         ids=["2", "3", "2x2", "3-sharded-parameters"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_the_family_under_the_wrapper_equals_the_papers_formulas(world, g, sharded, variant):
    """``sharded``: ``shard_parameters=True``, each rank holding its shard of every parameter between uses; QK-clip
    then scales the rows of the shards the optimizer steps."""
    ref = reference(variant)
    results = [r[variant] for r in run(world, g, None, sharded)]
    assert {r["parameter_side"] for r in results} == {"ShardedParameterSync" if sharded else "ParameterSync"}
    worst = 0.0
    for rank, r in enumerate(results):
        for name, value in r["params"].items():
            err = rel_err(value, ref["params"][name])
            worst = max(worst, err)
            assert err <= 1e-5, f"{variant} at {world} ranks (groups of {g}), rank {rank}: {name} differs by {err:.2e}"
            assert torch.equal(value, results[0]["params"][name]), (rank, name)  # every rank alike
    # each matrix (stacked experts, per-head blocks included) orthogonalized once in the world per step
    per_step = [sum(r["ns"][s] for r in results) for s in range(STEPS)]
    assert per_step == [0 if variant.startswith("adamw") else MATRICES_PER_STEP] * STEPS, per_step
    if variant == "adamw_qkclip":  # query and key weights in pieces on several ranks: each scales its rows
        assert {"att1.qkv.weight", "att2.k.weight"} <= set(results[0]["split"]), results[0]["split"]
        assert all(r["clipped"][0] == 2 for r in results), [r["clipped"] for r in results]
    if variant == "qkclip":
        assert all(r["clipped"][0] == 2 for r in results), [r["clipped"] for r in results]
        q_owner = [r["owns"]["att2.q.weight"] for r in results].index(True)
        k_owner = [r["owns"]["att2.k.weight"] for r in results].index(True)
        if g is None:  # one owner group: each weight has one owner; at 2x2 each replica position steps some
            assert q_owner != k_owner, "the query and key weights should have two owners here (bucket_size=600)"
    print(f"{variant} at {world} ranks (groups of {g}): max rel err {worst:.2e}")


@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS)
def test_the_family_with_late_collectives_is_bitwise_the_plain_run(variant):
    late, plain = run(3, None, LATE_MS), run(3)
    for rank, (r, want) in enumerate(zip(late, plain)):
        for name, value in r[variant]["params"].items():
            assert torch.equal(value, want[variant]["params"][name]), (variant, rank, name)


# --- grouped experts with expert parallelism ------------------------------------------------------------------------

MOE_STEPS, NUM_EXPERTS = 10, 4


def moe_gpt(expert_parallel_size: int = 1, expert_rank: int = 0):
    from examples.moe import MoEGPT

    torch.manual_seed(0)
    return MoEGPT(vocab_size=23, block_size=8, n_layer=2, n_head=2, n_embd=16, num_experts=NUM_EXPERTS, top_k=2,
                  expert_parallel_size=expert_parallel_size, expert_rank=expert_rank, grouped_experts=True)


def moe_batches():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, 23, (8, 9), generator=g) for _ in range(MOE_STEPS)]


@functools.cache
def moe_reference(variant: str) -> dict:
    model = moe_gpt()
    opt = ReferenceOptimizer(model, normuon=variant == "normuon", matrices=moe_matrices)
    with reference_threads():
        for tokens in moe_batches():
            opt.zero_grad()
            loss_fn(model, tokens).backward()
            opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _moe_worker(rank: int, world: int, E: int) -> dict:
    from lightning_layerwise.experts import check_expert_marks, expert_parameter_names

    out = {}
    for variant in ("muon", "normuon"):
        groups = ProcessGroups.create(expert_parallel_size=E)
        model = moe_gpt(E, groups.expert_parallel_rank)
        check_expert_marks(model, E)
        model.set_expert_group(groups.expert_parallel)
        opt = package_optimizer(model, normuon=variant == "normuon")
        experts = expert_parameter_names(model)
        elementwise = elementwise_parameters(opt)
        ddp = LayerwiseDataParallel(model, groups, bucket_size=2048, prefetch_depth=1,
                                    expert=lambda n, p: n in experts, elementwise=lambda n, p: p in elementwise)
        ddp.use_shards_in(opt)
        counter = train(ddp, opt, moe_batches(), rank, world)
        out[variant] = {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
                        "expert_rank": groups.expert_parallel_rank, "ns": [dict(c) for c in counter.per_step]}
        ddp.release()
        groups.destroy()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["muon", "normuon"])
def test_grouped_experts_with_expert_parallelism_equal_the_papers_formulas(variant):
    """E=4 experts stacked in 3-D parameters, 4 ranks with expert-parallel size 2: each rank holds a [2, ...] slice
    of every stack, and each expert's matrix is orthogonalized once in the world per step."""
    ref = moe_reference(variant)
    results = [r[variant] for r in run_moe(4, 2)]
    local = NUM_EXPERTS // 2
    for rank, r in enumerate(results):
        first = r["expert_rank"] * local
        for name, value in r["params"].items():
            want = ref[name][first:first + local] if ".experts." in name else ref[name]
            err = rel_err(value, want)
            assert err <= 1e-5, f"{variant}, rank {rank}: {name} differs by {err:.2e}"
    # per step: 2 layers x 2 stacks x 4 experts + 2 x (in_proj, out_proj, router) = 22 matrices in the world
    totals = [sum(sum(r["ns"][s].values()) for r in results) for s in range(MOE_STEPS)]
    assert totals == [22] * MOE_STEPS, totals


@functools.cache
def run_moe(world: int, E: int, late_ms: float | None = None) -> list[dict]:
    return run_distributed(_moe_worker, world, E, late_ms=late_ms)


@pytest.mark.slow
def test_grouped_experts_with_late_collectives_are_bitwise_the_plain_run():
    late, plain = run_moe(4, 2, LATE_MS), run_moe(4, 2)
    for rank, (r, want) in enumerate(zip(late, plain)):
        for variant in ("muon", "normuon"):
            for name, value in r[variant]["params"].items():
                assert torch.equal(value, want[variant]["params"][name]), (variant, rank, name)


# --- Fabric ------------------------------------------------------------------------------------------------------


def _fabric_worker(rank: int, world: int, variant: str) -> dict:
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=world, strategy="layerwise")
    fabric.launch()
    model = FamilyNet(hot_heads=(1, 3))
    model, opt = fabric.setup(model, package_optimizer(model, normuon=variant == "normuon"))
    if variant == "qkclip":
        QKClip(model.module, tau=TAU).attach(opt.optimizer)
    for tokens in batches(STEPS):
        opt.zero_grad()
        fabric.backward(loss_fn(model, tokens.chunk(world)[rank]))
        opt.step()
    return {n: p.detach().clone() for n, p in model.module.named_parameters()}


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["normuon", "qkclip"])
def test_normuon_and_qk_clip_in_a_fabric_loop_equal_the_papers_formulas(variant):
    ref = reference(variant)
    for rank, params in enumerate(run_distributed(_fabric_worker, 2, variant)):
        for name, value in params.items():
            err = rel_err(value, ref["params"][name])
            assert err <= 1e-5, f"Fabric {variant}, rank {rank}: {name} differs by {err:.2e}"


def _precision_worker(rank: int, world: int, precision: str, clipped: bool) -> list[float]:
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=world, strategy="layerwise", precision=precision)
    fabric.launch()
    with fabric.init_module():
        model = FamilyNet(hot_heads=(1, 3))
    model, opt = fabric.setup(model, package_optimizer(model))
    if clipped:
        clip = QKClip(model.module, tau=TAU).attach(opt.optimizer)
    tokens = batches(2)
    opt.zero_grad()
    fabric.backward(loss_fn(model, tokens[0].chunk(world)[rank]))
    opt.step()
    if clipped:
        assert int(clip.clipped_heads) == 2
    model.module.att2.reference_max = None
    with torch.no_grad():
        loss_fn(model, tokens[1].chunk(world)[rank])
    return model.module.att2.reference_max.float().tolist()


@pytest.mark.slow
def test_qk_clip_on_float32_masters_reaches_the_bf16_parameters():
    """bf16-true: the optimizer steps float32 masters of the owned parameters; the rescale is applied to them and
    reaches the bf16 weights every rank computes with (a rescale of the bf16 copy alone would be overwritten by
    the masters). The hot heads start with logits of 62 and more, over 2 tau, so gamma <= 0.48 scales their next
    logits to under half of an unclipped run's, up to what the step itself changes: under 0.6 of it, in bf16 as
    in float32. (The bf16 and float32 values are not compared closely: the softmax of these heads is saturated
    and their bf16 gradients, hence updates, differ.)"""
    bf16 = run_distributed(_precision_worker, 2, "bf16-true", True)
    fp32 = run_distributed(_precision_worker, 2, "32-true", True)
    unclipped = run_distributed(_precision_worker, 2, "32-true", False)
    for rank in range(2):
        for h in (1, 3):
            for clipped in (bf16, fp32):
                assert clipped[rank][h] < 0.6 * unclipped[rank][h], (rank, h, bf16[rank], fp32[rank], unclipped[rank])


# --- a plain torch loop over LayerwiseSession -----------------------------------------------------------------------


def _session_worker(rank: int, world: int, variant: str) -> dict:
    import lightning_layerwise as llw

    model = FamilyNet(hot_heads=(1, 3))
    opt = package_optimizer(model, normuon=variant == "normuon")
    session = llw.LayerwiseSession(llw.LayerwiseConfig(bucket_size=600))
    wrapped = session.wrap(model, opt)
    if variant == "qkclip":
        QKClip(model, tau=TAU).attach(opt)
    for tokens in batches(STEPS):
        opt.zero_grad()
        session.backward(loss_fn(wrapped, tokens.chunk(world)[rank]))
        session.step(opt)
    session.release()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["normuon", "qkclip"])
def test_normuon_and_qk_clip_in_a_plain_torch_session_equal_the_papers_formulas(variant):
    ref = reference(variant)
    for rank, params in enumerate(run_distributed(_session_worker, 3, variant)):
        for name, value in params.items():
            err = rel_err(value, ref["params"][name])
            assert err <= 1e-5, f"session {variant}, rank {rank}: {name} differs by {err:.2e}"


def _resume_worker(rank: int, world: int, path: str, phase: str, fmt: str) -> dict:
    """NorMuon with QK-clip in a session loop: ``phase="save"`` trains the first half of the batches and saves the
    model, the optimizer (NorMuon's second moments) and QK-clip's settings; ``"resume"`` loads them at this world
    size into a run built with another ``tau``, and trains the second half."""
    import lightning_layerwise as llw

    model = FamilyNet(hot_heads=(1, 3))
    opt = package_optimizer(model, normuon=True)
    session = llw.LayerwiseSession(llw.LayerwiseConfig(bucket_size=600, checkpoint_format=fmt))
    wrapped = session.wrap(model, opt)
    clip = QKClip(model, tau=TAU if phase == "save" else 1e9).attach(opt)
    half = STEPS // 2
    if phase == "resume":
        clip.load_state_dict(session.load_checkpoint(path)["qk_clip"])
    for tokens in batches(STEPS)[half:] if phase == "resume" else batches(STEPS)[:half]:
        opt.zero_grad()
        session.backward(loss_fn(wrapped, tokens.chunk(world)[rank]))
        session.step(opt)
    if phase == "save":
        session.save_checkpoint(path, qk_clip=clip.state_dict())
    session.release()
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "tau": clip.tau,
            "moments": sum(1 for s in opt.state.values() if "second_moment" in s)}


@functools.cache
def normuon_qk_clip_reference() -> dict:
    from _muon_family import ReferenceOptimizer, train_one_process

    model = FamilyNet(hot_heads=(1, 3))
    with reference_threads():
        return train_one_process(model, ReferenceOptimizer(model, normuon=True, tau=TAU), STEPS)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["sharded", "full"])
def test_normuon_state_and_qk_clip_settings_resume_at_another_world_size(tmp_path, fmt):
    """Saved at 2 ranks after 5 steps, resumed at 3 for the other 5: the run of the formulas' reference with NorMuon
    and QK-clip throughout (the resumed clip's tau comes from the checkpoint, not from its constructor)."""
    path = str(tmp_path / "family.ckpt")
    run_distributed(_resume_worker, 2, path, "save", fmt)
    resumed = run_distributed(_resume_worker, 3, path, "resume", fmt)
    ref = normuon_qk_clip_reference()
    for rank, r in enumerate(resumed):
        assert r["tau"] == TAU
        for name, value in r["params"].items():
            err = rel_err(value, ref["params"][name])
            assert err <= 1e-5, f"{fmt} 2->3 ranks, rank {rank}: {name} differs by {err:.2e}"
    assert sum(r["moments"] for r in resumed) == 8  # each Muon parameter's second moment on one rank
