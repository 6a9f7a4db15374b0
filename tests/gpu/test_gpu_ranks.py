"""GPU: several gloo ranks over CUDA tensors on the one GPU: split pieces, owner groups, clipping a list.

Needs CUDA; each test runs its body in a fresh process (``_gpu.py`` says why and how), which spawns the
ranks.

e. The tied-embedding GPT of ``test_elementwise_fill.py`` on 4 ranks, its embedding cut into pieces,
   one owner group or two of 2 ranks, AdamW / Muon / SGD: every rank equals one process on the same GPU
   and the ranks are bitwise equal.

Clipping: torch's ``clip_grad_norm_`` on a filtered list at 2 ranks (through the split parameters'
``SplitGradient`` markers) equals one process, and a list that disagrees across ranks raises the same
error on both at the next norm (on CUDA the vote's verdict is read late, without a host sync).
"""

from __future__ import annotations

import pytest
import torch

import lightning_layerwise as llw
from _gpu import TOL, _rel_err, _run_child, gloo_over_cuda, save_rank, spawn_ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (and NCCL)"),
]


# --- e. several ranks on the one GPU: gloo over CUDA tensors ---------------------------------------------------------
#
# NCCL refuses two ranks on one device, so the multi-rank paths (pieces of split parameters, owner groups
# with their cross-group all-reduce, the on-device used-flags of split parameters) run here over gloo with
# every tensor on cuda:0. What this cannot cover is NCCL itself at world size > 1 (``ReduceOp.AVG``).

MULTI_WORLD = 4


def _gloo_cuda_worker(rank: int, world: int, tmp: str, owner_group_size, opt_names: list[str]) -> None:
    from helpers import gpt, gpt_batches as batches, gpt_loss, gpt_optimizer as optimizer, snapshot, wrap_gpt as wrap

    out = {}
    with gloo_over_cuda(tmp, f"ranks_{owner_group_size}", rank, world):
        for opt_name in opt_names:
            model = gpt(seed=rank).cuda()  # rank 0's initialisation is broadcast
            opt = optimizer(opt_name, model)
            ddp = wrap(model, opt, bucket_size=2048, owner_group_size=owner_group_size)
            for tokens in batches():
                opt.zero_grad()
                gpt_loss(ddp, tokens.cuda().chunk(world)[rank]).backward()
                ddp.finish_grad_sync()
                opt.step()
                ddp.start_param_sync()
            ddp.param_sync.finish()
            torch.cuda.synchronize()
            out[opt_name] = {"params": {n: v.cpu() for n, v in snapshot(model).items()},
                             "split": {n: len(s.pieces) for n, s in ddp.layout.params.items() if s.split},
                             "device": str(next(model.parameters()).device)}
    save_rank(tmp, f"ranks_{owner_group_size}", rank, out)


def _gloo_cuda_child(tmp: str, owner_group_size) -> dict:
    from helpers import gpt, gpt_batches as batches, gpt_loss, gpt_optimizer as optimizer, snapshot

    names = ["adamw", "muon", "sgd"]
    reference = {}
    for opt_name in names:
        model = gpt().cuda()
        opt = optimizer(opt_name, model)
        for tokens in batches():
            opt.zero_grad()
            gpt_loss(model, tokens.cuda()).backward()
            opt.step()
        reference[opt_name] = {n: v.cpu() for n, v in snapshot(model).items()}
    ranks = spawn_ranks(_gloo_cuda_worker, MULTI_WORLD, tmp, f"ranks_{owner_group_size}", owner_group_size, names)
    return {"reference": reference, "ranks": ranks}


@pytest.mark.parametrize("owner_group_size", [None, 2], ids=["one_group", "owner_groups_2x2"])
def test_split_pieces_and_owner_groups_on_cuda_match_one_process(owner_group_size):
    """The tied-embedding GPT on 4 gloo ranks over CUDA tensors, element-wise fill on (the embedding is cut
    into pieces), one owner group or two of 2 ranks, AdamW / Muon / SGD for 10 steps: every rank equals one
    process on the same GPU (relative error <= 1e-5) and the ranks are bitwise equal."""
    out = _run_child(_gloo_cuda_child, owner_group_size)
    for opt_name, reference in out["reference"].items():
        results = [r[opt_name] for r in out["ranks"]]
        assert results[0]["device"].startswith("cuda"), results[0]["device"]
        assert "transformer.wte.weight" in results[0]["split"], results[0]["split"]
        worst = 0.0
        for name, value in results[0]["params"].items():
            err = _rel_err(value, reference[name])
            worst = max(worst, err)
            assert err <= TOL, f"{opt_name}, owner groups {owner_group_size}: {name} differs by {err:.2e}"
        for rank, r in enumerate(results[1:], start=1):
            for name, value in r["params"].items():
                assert torch.equal(value, results[0]["params"][name]), f"{opt_name}: rank {rank} differs on {name}"
        print(f"gloo over CUDA, 4 ranks, owner groups {owner_group_size}, {opt_name}: max rel err {worst:.2e}, "
              f"split {results[0]['split']}")


# --- clipping a filtered list over CUDA tensors (issue: split gradients, list votes) ---------------------------------

CLIP_WORLD, CLIP_STEPS, CLIP_MAX_NORM = 2, 4, 0.25


def _filtered(model) -> list:
    return [p for p in model.parameters() if p.grad is not None]


def _gloo_cuda_clip_worker(rank: int, world: int, tmp: str) -> None:
    from helpers import gpt, gpt_batches as batches, gpt_loss, gpt_optimizer as optimizer, snapshot, wrap_gpt as wrap

    out = {"norms": [], "markers": 0}
    # A hand-built wrapper's loop holds the patched gradient utilities (Note [gradient utilities]).
    with gloo_over_cuda(tmp, "clip", rank, world), llw.gradient_utilities():
        model = gpt(seed=rank).cuda()
        opt = optimizer("sgd", model)
        ddp = wrap(model, opt, bucket_size=2048)
        tokens_list = list(batches(CLIP_STEPS + 1))
        for tokens in tokens_list[:CLIP_STEPS]:
            opt.zero_grad()
            gpt_loss(ddp, tokens.cuda().chunk(world)[rank]).backward()
            ddp.finish_grad_sync()
            out["markers"] += sum(isinstance(p.grad, llw.SplitGradient) for p in model.parameters())
            out["norms"].append(torch.nn.utils.clip_grad_norm_(_filtered(model), CLIP_MAX_NORM).item())
            opt.step()
            ddp.start_param_sync()
        ddp.param_sync.finish()
        out["params"] = {n: v.cpu() for n, v in snapshot(model).items()}
        # A list that disagrees across ranks: on CUDA the verdict is read at the next norm (no host sync per step).
        opt.zero_grad()
        gpt_loss(ddp, tokens_list[-1].cuda().chunk(world)[rank]).backward()
        ddp.finish_grad_sync()
        sync = ddp.records
        held = [p for p in model.parameters() if sync.owns(p) or sync.piece_of(p) is not None]  # whole or a piece
        wrong = [p for p in model.parameters() if not (rank == 1 and p is held[0])]
        errors = []
        for listed in (wrong, list(model.parameters())):
            try:
                torch.nn.utils.clip_grad_norm_(listed, CLIP_MAX_NORM)
                errors.append(None)
            except ValueError as error:
                errors.append(str(error))
        out["errors"] = errors
        ddp.release()
    save_rank(tmp, "clip", rank, out)


def _gloo_cuda_clip_child(tmp: str) -> dict:
    from helpers import gpt, gpt_batches as batches, gpt_loss, gpt_optimizer as optimizer, snapshot

    model = gpt().cuda()
    opt = optimizer("sgd", model)
    norms = []
    for tokens in list(batches(CLIP_STEPS + 1))[:CLIP_STEPS]:
        opt.zero_grad()
        gpt_loss(model, tokens.cuda()).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(_filtered(model), CLIP_MAX_NORM).item())
        opt.step()
    reference = {"params": {n: v.cpu() for n, v in snapshot(model).items()}, "norms": norms}
    ranks = spawn_ranks(_gloo_cuda_clip_worker, CLIP_WORLD, tmp, "clip")
    return {"reference": reference, "ranks": ranks}


def test_filtered_list_clipping_and_its_deferred_vote_on_cuda():
    """2 gloo ranks over CUDA tensors, element-wise fill (the embedding in pieces), SGD: torch's
    ``clip_grad_norm_`` on ``[p for p in model.parameters() if p.grad is not None]`` equals one process on the
    same GPU (norms and parameters, relative error <= 1e-5), through the split parameters' ``SplitGradient``
    markers. A list left short on rank 1 does not stop the host: the vote's verdict is read at the next norm
    call, which raises the same ValueError on both ranks (Note [parameter lists])."""
    out = _run_child(_gloo_cuda_clip_child)
    reference = out["reference"]
    for rank, result in enumerate(out["ranks"]):
        assert result["markers"] > 0, f"rank {rank}: no split parameter's .grad was a SplitGradient"
        for got, want in zip(result["norms"], reference["norms"]):
            assert abs(got - want) <= TOL * want, (rank, result["norms"], reference["norms"])
        assert min(reference["norms"]) > CLIP_MAX_NORM, reference["norms"]
        worst = max(_rel_err(v, reference["params"][n]) for n, v in result["params"].items())
        assert worst <= TOL, f"rank {rank}: {worst:.2e} from one process"
        first, second = result["errors"]
        print(f"rank {rank}: worst {worst:.2e}; disagreeing list: first call {first!r:.60}, next call {second!r:.90}")
        assert first is None, f"rank {rank}: the verdict was read at once on CUDA: {first}"
        assert second is not None and "different parameters on different ranks" in second, second
    assert out["ranks"][0]["errors"][1] == out["ranks"][1]["errors"][1]
