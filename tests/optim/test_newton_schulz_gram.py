"""The Gram Newton-Schulz iteration (Note [Gram Newton-Schulz] in ``optim/orthogonalization.py``) against the float64
iteration and against the standard path, and the ``ns_algorithm`` setting that chooses between them.

Inputs are square, wide and tall (aspect 1 to 8), Gaussian, ill-conditioned (singular values from 1 to 1e-6) and
rank-deficient (a quarter of the rank). Tolerances come from the dtype and the size:

- the relative distance of each path's result to the float64 iteration: the Gram path's is at most the standard
  path's plus ``2 * steps * eps(float32) * sqrt(n)`` (a float32 rounding of relative size ``eps * sqrt(n)`` in each
  of a step's two products over the long side ``n``): in bf16 on the shapes ``ns_algorithm="auto"`` gives
  it (aspect >= 2), and in float32 on every shape;
- the singular values' largest distance from 1 (over the input's rank): at most the standard path's plus
  ``steps * eps(dtype)`` (one rounding of the output per step) and the same float32 allowance (a singular value
  moves by at most the spectral norm of a perturbation, Weyl).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lightning_layerwise.optim import Muon, newton_schulz, newton_schulz_gram, orthogonalize
from lightning_layerwise.optim.orthogonalization import uses_gram

STEPS = 5
SHAPES = [(64, 64), (64, 96), (64, 128), (64, 256), (64, 512), (512, 64), (256, 64)]
KINDS = ["gaussian", "condition_1e6", "rank_deficient"]


def _matrix(rows: int, cols: int, kind: str, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "gaussian":
        return torch.randn(rows, cols, generator=g, dtype=torch.float64)
    k = min(rows, cols)
    U, _ = torch.linalg.qr(torch.randn(rows, k, generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(cols, k, generator=g, dtype=torch.float64))
    if kind == "condition_1e6":
        s = torch.logspace(0, -6, k, dtype=torch.float64)
    else:
        s = torch.zeros(k, dtype=torch.float64)
        s[: k // 4] = 0.5 + torch.rand(k // 4, generator=g, dtype=torch.float64)
    return (U * s) @ V.T


def _relative_error(Y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((Y.double() - ref).norm() / ref.norm()).item()


def _sigma_distance(Y: torch.Tensor, rank: int) -> float:
    return (torch.linalg.svdvals(Y.double())[:rank] - 1).abs().max().item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("schedule", ["simple", "polar_express"])
@pytest.mark.parametrize("kind", KINDS)
def test_gram_path_is_as_close_to_float64_as_the_standard_path(dtype, schedule, kind):
    for rows, cols in SHAPES:
        if dtype != torch.float32 and not uses_gram((rows, cols), dtype, "auto"):
            continue
        G = _matrix(rows, cols, kind)[None]
        ref = newton_schulz(G, STEPS, schedule, 1e-7, torch.float64)[0]
        standard = newton_schulz(G, STEPS, schedule, 1e-7, dtype)[0]
        gram = newton_schulz_gram(G, STEPS, schedule, 1e-7, dtype)[0]
        assert gram.dtype == dtype and gram.shape == (rows, cols)
        floor = 2 * STEPS * torch.finfo(torch.float32).eps * math.sqrt(max(rows, cols))
        where = f"{rows}x{cols} {kind} {schedule} {dtype}"
        assert _relative_error(gram, ref) <= _relative_error(standard, ref) + floor, where
        rank = int(torch.linalg.matrix_rank(G[0]))
        sigma_slack = STEPS * torch.finfo(dtype).eps + floor
        assert _sigma_distance(gram, rank) <= _sigma_distance(standard, rank) + sigma_slack, where


def test_gram_path_orthogonalizes_and_transposes_tall_matrices():
    G = _matrix(48, 192, "gaussian", seed=1).float()
    out = newton_schulz_gram(G, 10, "quintic", 1e-7, torch.float32)
    sigma = torch.linalg.svdvals(out.double())
    assert (sigma - 1).abs().max() < 0.3  # the quintic schedule's band around 1
    torch.testing.assert_close(newton_schulz_gram(G.T, 10, "quintic", 1e-7, torch.float32), out.T,
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("steps", [1, 2, 3, 4, 8])
def test_gram_path_with_any_number_of_steps(steps):
    """Restarts fall before iteration 2, 5, 8, ...: none for one or two steps, the last restart anywhere."""
    G = _matrix(32, 160, "condition_1e6", seed=6)[None]
    ref = newton_schulz(G, steps, "quintic", 1e-7, torch.float64)[0]
    standard = newton_schulz(G, steps, "quintic", 1e-7, torch.float32)[0]
    gram = newton_schulz_gram(G, steps, "quintic", 1e-7, torch.float32)[0]
    floor = 2 * steps * torch.finfo(torch.float32).eps * math.sqrt(160)
    assert _relative_error(gram, ref) <= _relative_error(standard, ref) + floor


def test_batched_gram_equals_one_matrix_at_a_time():
    g = torch.Generator().manual_seed(2)
    stack = torch.randn(3, 2, 16, 56, generator=g)
    stack[1, 0] *= 100  # each matrix normalised by its own norm
    out = newton_schulz_gram(stack, STEPS, "polar_express", 1e-7, torch.float32)
    for i in range(3):
        for j in range(2):
            torch.testing.assert_close(out[i, j], newton_schulz_gram(stack[i, j], STEPS, "polar_express", 1e-7,
                                                                     torch.float32), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_auto_takes_the_gram_path_on_wide_narrow_dtype_matrices_only(dtype):
    g = torch.Generator().manual_seed(3)
    mats = [torch.randn(s, generator=g) for s in [(16, 48), (16, 48), (24, 24), (48, 16), (24, 40)]]
    auto = orthogonalize(mats, STEPS, "simple", 1e-7, dtype, algorithm="auto")
    standard = orthogonalize(mats, STEPS, "simple", 1e-7, dtype, algorithm="standard")
    gram = orthogonalize(mats, STEPS, "simple", 1e-7, dtype, algorithm="gram")
    for M, a, s, gr in zip(mats, auto, standard, gram):
        expected = gr if dtype == torch.bfloat16 and max(M.shape) >= 2 * min(M.shape) else s
        torch.testing.assert_close(a, expected, rtol=0, atol=0)
    assert uses_gram((4096, 14336), torch.bfloat16, "auto") and uses_gram((14336, 4096), torch.bfloat16, "auto")
    assert not uses_gram((4096, 4096), torch.bfloat16, "auto")
    assert not uses_gram((4096, 14336), torch.float32, "auto") and uses_gram((4, 4), torch.float32, "gram")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_chunked_gram_equals_unchunked(dtype):
    g = torch.Generator().manual_seed(4)
    mats = [torch.randn(8, 40, generator=g) for _ in range(7)]
    whole = orthogonalize(mats, STEPS, "quintic", 1e-7, dtype, algorithm="gram")
    chunked = orthogonalize(mats, STEPS, "quintic", 1e-7, dtype, algorithm="gram",
                            max_batch_bytes=3 * 8 * 40 * dtype.itemsize)
    for w, c in zip(whole, chunked):
        torch.testing.assert_close(c, w, rtol=0, atol=0)


@pytest.mark.parametrize("normuon", [False, True])
def test_muon_on_the_gram_path_batched_equals_per_matrix(normuon):
    """Heads of a fused projection, a stack and plain matrices, with NorMuon and Polar Express."""
    torch.manual_seed(5)
    qkv, stack, up = nn.Parameter(torch.randn(48, 16)), nn.Parameter(torch.randn(3, 8, 32)), \
        nn.Parameter(torch.randn(16, 64))

    def run(batched: bool) -> list[torch.Tensor]:
        params = [nn.Parameter(p.detach().clone()) for p in (qkv, stack, up)]
        groups = [{"params": [params[0]], "split": 12}, {"params": [params[1]], "stack": True},
                  {"params": [params[2]]}]
        opt = Muon(groups, lr=0.01, ns_dtype=torch.float32, ns_coefficients="polar_express", ns_algorithm="gram",
                   batched=batched, normuon=normuon)
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            for p in params:
                p.grad = torch.randn(p.shape, generator=g)
            opt.step()
        return [p.detach() for p in params]

    for a, b in zip(run(True), run(False)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_ns_algorithm_is_checked():
    p = nn.Parameter(torch.randn(4, 8))
    assert Muon([p]).defaults["ns_algorithm"] == "standard"
    with pytest.raises(ValueError, match=r"^Muon: ns_algorithm='fast' is invalid: use 'standard' .* 'gram' .* "
                                         r"'auto' .*e\.g\. ns_algorithm='auto'"):
        Muon([p], ns_algorithm="fast")
    with pytest.raises(ValueError, match=r"^Muon param group 0: ns_algorithm=None is invalid"):
        Muon([{"params": [p], "ns_algorithm": None}])
    with pytest.raises(ValueError, match=r"an AdamW group \(use_muon=False\) does not read ns_algorithm='gram'"):
        Muon([{"params": [nn.Parameter(torch.randn(4))], "use_muon": False, "ns_algorithm": "gram"}])
