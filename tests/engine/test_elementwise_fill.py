"""Element-wise fill (Note [element-wise fill] in layout.py, Note [pieces] in data_parallel.py) on 2-4 gloo ranks.

Every run is compared with one process on the same global batch (fp32, relative
error <= 1e-5 over >= 10 steps) and the ranks must end bitwise equal:

* the example GPT (embedding tied to the output layer) at 2, 3 and 4 ranks, with
  AdamW (everything split) and Muon (its AdamW groups split, matrices whole);
* a parameter split across three ranks or more;
* gradient accumulation (``no_sync``) with global-norm clipping;
* a split parameter that some ranks use and others do not, and a step in which no
  rank uses it: then no piece is stepped, as one process would not step it. A
  mutation run (every piece always stepped) must fail that comparison.
"""

from __future__ import annotations

import functools
from unittest import mock

import pytest
import torch
from torch import nn

from _dist import LATE_MS, reference_threads, run_distributed
from helpers import (GPT_VOCAB as VOCAB, backward_micro_batches, gpt, gpt_batches as batches, gpt_loss,
                     gpt_optimizer as optimizer, gpt_reference, gpt_reference_run as _gpt_reference_run, rel_err,
                     snapshot, wrap_gpt as wrap)
from lightning_layerwise.engine.clip import clip_grad_norm_
from lightning_layerwise.engine.grad_sync import GradientSync
from lightning_layerwise.optim import muon_param_groups

TOL = 1e-5


def assert_matches(results: list[dict], reference: dict[str, torch.Tensor], what: str) -> float:
    worst = 0.0
    for name, value in results[0]["params"].items():
        err = rel_err(value, reference[name])
        worst = max(worst, err)
        assert err <= TOL, f"{what}: {name} differs from one process by {err:.2e}"
    for rank, r in enumerate(results[1:], start=1):
        for name, value in r["params"].items():
            assert torch.equal(value, results[0]["params"][name]), f"{what}: rank {rank} differs on {name}"
    return worst


# --- the tied-embedding GPT ----------------------------------------------------------------------


def _reference_state(opt_name: str) -> list[torch.Tensor]:
    """The optimizer state tensors of the one-process run."""
    return _gpt_reference_run(opt_name)[1]


def _gpt_worker(rank: int, world: int, opt_names: list[str], owner_group_size: int | None = None) -> dict:
    out = {}
    for opt_name in opt_names:
        model = gpt(seed=rank)  # rank 0's initialisation is broadcast
        opt = optimizer(opt_name, model)
        ddp = wrap(model, opt, bucket_size=2048, owner_group_size=owner_group_size)
        for tokens in batches():
            opt.zero_grad()
            gpt_loss(ddp, tokens.chunk(world)[rank]).backward()
            ddp.finish_grad_sync()
            opt.step()
            ddp.start_param_sync()
        ddp.param_sync.finish()
        slots = ddp.layout.params
        out[opt_name] = {
            "params": snapshot(model),
            "split": {n: len(s.pieces) for n, s in slots.items() if s.split},
            "split_muon": [n for n, s in slots.items() if s.split and n in _muon_names(model)],
            "state_elements": sum(v.numel() for s in opt.state.values() for v in s.values()
                                  if torch.is_tensor(v) and v.dim() >= 1),
            "padding": ddp.layout.padding_fraction,
            "layout_group_size": ddp.layout.group_size,
            "owned": sorted(n for n, _ in ddp.named_owned_parameters()),
        }
    return out


def _muon_names(model: nn.Module) -> set[str]:
    names = {p: n for n, p in model.named_parameters()}
    return {names[p] for g in muon_param_groups(model) if g["use_muon"] for p in g["params"]}


@functools.cache
def gpt_run(world: int, owner_group_size: int | None = None, late_ms: float | None = None) -> list[dict]:
    """``late_ms``: every collective up to that late (Note [late collectives] in collectives.py)."""
    names = ["adamw", "muon"] + (["sgd"] if owner_group_size else [])
    return run_distributed(_gpt_worker, world, names, owner_group_size, late_ms=late_ms)


def assert_bitwise(results: list[dict], plain: list[dict], what: str) -> None:
    """The fuzzed run holds bitwise the plain run's parameters: only the timing changed."""
    for rank, (r, want) in enumerate(zip(results, plain)):
        for name, value in r["params"].items():
            assert torch.equal(value, want["params"][name]), \
                f"{what}, rank {rank}: {name} differs from the plain run by {rel_err(value, want['params'][name]):.2e}"


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("opt_name", ["adamw", "muon"])
def test_tied_embedding_gpt_equals_one_process(world, opt_name):
    results = [r[opt_name] for r in gpt_run(world)]
    worst = assert_matches(results, gpt_reference(opt_name), f"{opt_name} at {world} ranks")
    split = results[0]["split"]
    print(f"{opt_name} world={world}: max rel err {worst:.2e}, split {split}, padding {results[0]['padding']:.1%}")
    assert "transformer.wte.weight" in split, split  # the tied embedding is cut
    if opt_name == "muon":
        assert not results[0]["split_muon"], "a Muon matrix was split"
    # Per-element optimizer state exists once in the world, however it is cut.
    model = gpt()
    reference_opt = optimizer(opt_name, model)
    gpt_loss(model, batches(1)[0]).backward()
    reference_opt.step()
    want = sum(v.numel() for s in reference_opt.state.values() for v in s.values() if v.dim() >= 1)
    assert sum(r["state_elements"] for r in results) == want


@pytest.mark.slow
@pytest.mark.parametrize("opt_name", ["adamw", "muon"])
def test_element_wise_fill_at_four_ranks_with_late_collectives(opt_name):
    """Note [late collectives]: 4 ranks, pieces of the tied embedding, every collective up to LATE_MS late.

    Mutation runs (LATE_MS=4), relative error of transformer.wte.weight, adamw / muon:
    reduce-scatter not awaited 2.1e-1 / 2.0e-1; all-gather not awaited in the pre-hook 1.5e-1 / 1.3e-1.
    """
    results = [r[opt_name] for r in gpt_run(4, None, LATE_MS)]
    assert "transformer.wte.weight" in results[0]["split"]
    assert_matches(results, gpt_reference(opt_name), f"{opt_name} at 4 ranks, late collectives")
    assert_bitwise(results, [r[opt_name] for r in gpt_run(4)], f"{opt_name} at 4 ranks, late collectives")


@pytest.mark.slow
def test_a_parameter_split_across_three_ranks_steps_correctly():
    """At 4 ranks the tied embedding is cut into (at least) three pieces, and the run still matches."""
    results = [r["adamw"] for r in gpt_run(4)]
    assert max(results[0]["split"].values()) >= 3, results[0]["split"]
    assert_matches(results, gpt_reference("adamw"), "adamw at 4 ranks")


# --- accumulation with clipping -------------------------------------------------------------------

MICRO = 2
MAX_NORM = 0.05


def _accumulate_step(model, ddp, opt, tokens, rank, world):
    opt.zero_grad()
    micro = tokens.chunk(world)[rank].chunk(MICRO) if ddp is not None else tokens.chunk(MICRO)
    backward_micro_batches(model, ddp, list(micro))
    if ddp is not None:
        ddp.finish_grad_sync()
        total = clip_grad_norm_(ddp, MAX_NORM)
    else:
        # One process: the mean over ranks of the per-rank micro-batch means.
        total = nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    opt.step()
    if ddp is not None:
        ddp.start_param_sync()
    return total.item()


def _accumulate_worker(rank: int, world: int) -> dict:
    model = gpt(seed=rank)
    opt = optimizer("adamw", model)
    ddp = wrap(model, opt, bucket_size=2048)
    norms = [_accumulate_step(model, ddp, opt, tokens, rank, world) for tokens in batches()]
    ddp.param_sync.finish()
    return {"params": snapshot(model), "norms": norms,
            "split": [n for n, s in ddp.layout.params.items() if s.split]}


@functools.cache
def _accumulate_reference(world: int) -> tuple[dict, list[float]]:
    with reference_threads():
        return _accumulate_reference_run(world)


def _accumulate_reference_run(world: int) -> tuple[dict, list[float]]:
    model = gpt()
    opt = optimizer("adamw", model)
    norms = []
    for tokens in batches():
        opt.zero_grad()
        for rank_rows in tokens.chunk(world):  # each rank's micro-batches, averaged over ranks
            for part in rank_rows.chunk(MICRO):
                (gpt_loss(model, part) / (MICRO * world)).backward()
        norms.append(nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        opt.step()
    return snapshot(model), norms


@functools.cache
def accumulate_run(world: int, late_ms: float | None = None) -> list[dict]:
    return run_distributed(_accumulate_worker, world, late_ms=late_ms)


@pytest.mark.slow
@pytest.mark.parametrize("late_ms", [None, LATE_MS])
def test_accumulation_with_clipping_equals_one_process(late_ms):
    """``late_ms``: every collective up to that late (Note [late collectives]), then bitwise the plain run.

    Mutation runs (LATE_MS=4), the first clipped norm: reduce-scatter not awaited 1.78 instead
    of 0.706; all-gather not awaited in the pre-hook (step 1) 0.697 instead of 0.683.
    """
    results = accumulate_run(3, late_ms)
    reference, norms = _accumulate_reference(3)
    assert results[0]["split"], "nothing was split: the test would not exercise pieces"
    assert all(n > MAX_NORM for n in norms), "every step clips"
    for got, want in zip(results[0]["norms"], norms):
        assert abs(got - want) <= 1e-5 * want
    assert_matches(results, reference, "accumulation + clipping at 3 ranks")
    if late_ms is not None:
        plain = accumulate_run(3)
        assert results[0]["norms"] == plain[0]["norms"]
        assert_bitwise(results, plain, "accumulation + clipping at 3 ranks, late collectives")


# --- a split parameter used by some ranks only ----------------------------------------------------


class Branchy(nn.Module):
    """An embedding ``extra`` that a rank uses only when told to: used on some ranks, or on none."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 24)
        self.extra = nn.Embedding(VOCAB, 24)
        self.out = nn.Linear(24, VOCAB)

    def forward(self, idx: torch.Tensor, use_extra: bool) -> torch.Tensor:
        x = self.emb(idx)
        if use_extra:
            x = x + self.extra(idx)
        return self.out(torch.tanh(x))


def uses_extra(step: int, rank: int) -> bool:
    """Step 0 mod 3: rank 0 only; 1 mod 3: every rank; 2 mod 3: no rank."""
    return (step % 3 == 0 and rank == 0) or step % 3 == 1


def branchy_loss(model, tokens, use_extra):
    return nn.functional.cross_entropy(model(tokens[:, :-1], use_extra).flatten(0, 1), tokens[:, 1:].flatten())


def _branchy_worker(rank: int, world: int, mutate: bool) -> dict:
    torch.manual_seed(rank)
    model = Branchy()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.5)
    ddp = wrap(model, opt, bucket_size=600)  # `extra` alone in a bucket: cut in three
    patch = (mock.patch.object(GradientSync, "_split_parameters_used",
                               lambda self: {p: True for ps, _ in self._split_by_group for p in ps})
             if mutate else mock.MagicMock())
    with patch:
        for step, tokens in enumerate(batches(12)):
            opt.zero_grad()
            branchy_loss(ddp, tokens.chunk(world)[rank], uses_extra(step, rank)).backward()
            ddp.finish_grad_sync()
            opt.step()
            ddp.start_param_sync()
    ddp.param_sync.finish()
    return {"params": snapshot(model), "split": [n for n, s in ddp.layout.params.items() if s.split]}


def _branchy_reference(world: int) -> dict[str, torch.Tensor]:
    with reference_threads():
        return _branchy_reference_run(world)


def _branchy_reference_run(world: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = Branchy()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.5)
    for step, tokens in enumerate(batches(12)):
        opt.zero_grad()
        loss = sum(branchy_loss(model, part, uses_extra(step, rank)) for rank, part in enumerate(tokens.chunk(world)))
        (loss / world).backward()
        opt.step()
    return snapshot(model)


@pytest.mark.slow
def test_a_split_parameter_used_by_some_ranks_or_none_steps_as_one_process():
    reference = _branchy_reference(3)
    results = run_distributed(_branchy_worker, 3, False)
    assert "extra.weight" in results[0]["split"]
    assert_matches(results, reference, "data-dependent use at 3 ranks")
    # The check can fail: stepping every piece every step decays `extra` in the steps no rank used it.
    mutated = run_distributed(_branchy_worker, 3, True)
    assert rel_err(mutated[0]["params"]["extra.weight"], reference["extra.weight"]) > 100 * TOL


# --- owner groups (Note [owner groups] in process_groups.py) ------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("late_ms", [None, LATE_MS])
@pytest.mark.parametrize("opt_name", ["adamw", "muon", "sgd"])
def test_four_ranks_as_two_owner_groups_of_two_equal_one_process(opt_name, late_ms):
    """4 ranks as 2 groups x 2: planned for 2 ranks, reduce-scattered in each group and then across the groups
    into the chunk each rank steps (Note [replica sharing]), all-gathered back the same way.
    SGD checks the averaging (a sum instead of a mean across groups fails it). ``late_ms``: every
    collective up to that late (Note [late collectives]), and then bitwise the plain run.

    Mutation runs (LATE_MS=4), relative error of transformer.wte.weight, adamw / muon / sgd:
    reduce-scatter not awaited 2.7e-1 / 1.9e-1 / 6.9e-1; all-gather not awaited in the pre-hook
    9.4e-2 / 8.5e-2 / 5.8e-2; the reduce-scatter wait deleted outright (the all-reduce across
    the groups then replaces its handle, so it is never awaited) 2.0e-1 / 2.8e-1 / 9.0e-1.
    """
    results = [r[opt_name] for r in gpt_run(4, 2, late_ms)]
    worst = assert_matches(results, gpt_reference(opt_name), f"{opt_name}, 4 ranks as 2 x 2")
    if late_ms is not None:
        assert_bitwise(results, [r[opt_name] for r in gpt_run(4, 2)], f"{opt_name}, 2 x 2, late collectives")
    print(f"{opt_name} 2x2: max rel err {worst:.2e}, split {results[0]['split']}")
    assert all(r["layout_group_size"] == 2 for r in results)
    assert results[0]["split"], "element-wise fill inside the owner groups"
    # Note [replica sharing]: the two groups share each shard's stepping, so every element is stepped (and
    # holds optimizer state) on exactly one of the four ranks, and no parameter owned whole on two.
    whole = [set(r["owned"]) - set(r["split"]) for r in results]
    assert all(whole[i].isdisjoint(whole[j]) for i in range(4) for j in range(i)), whole
    one_process = sum(v.numel() for v in _reference_state(opt_name) if v.dim() >= 1)
    assert sum(r["state_elements"] for r in results) == one_process, "optimizer state held once in the world"
