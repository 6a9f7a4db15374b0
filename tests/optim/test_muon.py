"""Muon: the maths against references, the optimizer against torch.optim.Muon + AdamW.

Single process, CPU. Tolerances are stated where they are used:

- bf16 Newton-Schulz with the same ops as torch.optim.Muon (``batched=False``):
  bit-identical (``rtol=0, atol=0``) over 20 steps. The batched path's bmm
  rounds the Gram matrix differently now and then: ``< 1e-2`` after 20 steps
  (measured 3e-3).
- float32 Newton-Schulz against torch's bf16 one over 20 steps: ``< 2e-2``
  (measured 5e-3; bf16 keeps ~3 significant digits of the update).
- batched vs per-matrix in float32: ``rtol=1e-5, atol=1e-6``.

A bad argument, to the optimizer or inside a param group, raises a ``ValueError`` naming the
argument, the value and a fix (docs/reliability.md, "Optimizer arguments").
"""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim._muon import _zeropower_via_newtonschulz

import lightning_layerwise as llw
from lightning_layerwise.optim import (
    NS_SCHEDULES,
    Muon,
    adjust_lr_scale,
    muon_param_groups,
    newton_schulz,
    newton_schulz_reference,
    orthogonalize,
    resolve_ns_coefficients,
)
from _dist import reference_threads

TORCH_COEFFS = (3.4445, -4.775, 2.0315)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # Tiny tensors gain nothing from intra-op threads, and on a shared 2-core
    # machine OpenMP spin-waits made these tests 5x slower.
    with reference_threads():
        yield


# ---------------------------------------------------------------------------
# A small GPT with a tied head, LayerNorms and biases
# ---------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, d: int, n_head: int = 2) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln_1 = nn.LayerNorm(d)
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)
        self.ln_2 = nn.LayerNorm(d)
        self.c_fc = nn.Linear(d, 4 * d)
        self.mlp_proj = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + self.c_proj(y)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 32, block_size: int = 8, d: int = 16, n_layer: int = 2) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(block_size, d)
        self.h = nn.ModuleList(Block(d) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1)))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def loss_of(model: TinyGPT, idx: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(idx).flatten(0, 1), tgt.flatten())


def batches(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 32, (4, 8), generator=g), torch.randint(0, 32, (4, 8), generator=g)) for _ in range(n)]


def train(model: nn.Module, optimizers: list[torch.optim.Optimizer], data) -> None:
    for idx, tgt in data:
        loss_of(model, idx, tgt).backward()
        for opt in optimizers:
            opt.step()
        for opt in optimizers:
            opt.zero_grad()


def max_abs_diff(a: nn.Module, b: nn.Module) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a.parameters(), b.parameters()))


def torch_pair(model: nn.Module, **muon_kw) -> list[torch.optim.Optimizer]:
    """torch.optim.Muon on the Muon group and torch.optim.AdamW on the rest, same routing."""
    muon_group, adamw_group = muon_param_groups(model)
    return [
        torch.optim.Muon(muon_group["params"], **muon_kw),
        torch.optim.AdamW(adamw_group["params"], lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01),
    ]


# ---------------------------------------------------------------------------
# Parity with torch.optim.Muon + torch.optim.AdamW
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(24, 16), (16, 24), (16, 16)])
def test_reference_is_op_for_op_torch(shape):
    G = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    ours = newton_schulz_reference(G, 5, TORCH_COEFFS, 1e-7, torch.bfloat16)
    theirs = _zeropower_via_newtonschulz(G, TORCH_COEFFS, 5, 1e-7)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


@pytest.mark.parametrize("nesterov", [True, False])
def test_matches_torch_muon_and_adamw_in_bf16(nesterov):
    torch.manual_seed(0)
    ours_model = TinyGPT()
    ref_model = copy.deepcopy(ours_model)
    kw = dict(lr=0.02, momentum=0.95, nesterov=nesterov, weight_decay=0.1)
    ours = Muon(
        muon_param_groups(ours_model), **kw, ns_coefficients=TORCH_COEFFS, ns_dtype=torch.bfloat16,
        adjust_lr="original", adamw_lr=1e-3, adamw_weight_decay=0.01, batched=False,
    )
    ref = torch_pair(ref_model, **kw, ns_coefficients=TORCH_COEFFS, adjust_lr_fn="original")
    data = batches(20)
    train(ours_model, [ours], data)
    train(ref_model, ref, data)
    # Same ops in the same order (Note [parity with torch.optim.Muon]): bit-identical.
    for (name, a), b in zip(ours_model.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m, name=name: f"{name}: {m}")
    assert max_abs_diff(ours_model, TinyGPT()) > 0.01  # it trained


def test_batched_bf16_stays_close_to_torch():
    torch.manual_seed(0)
    ours_model = TinyGPT()
    ref_model = copy.deepcopy(ours_model)
    ours = Muon(muon_param_groups(ours_model), lr=0.02, weight_decay=0.1, adamw_lr=1e-3, adamw_weight_decay=0.01,
                batched=True)
    ref = torch_pair(ref_model, lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True)
    data = batches(20)
    train(ours_model, [ours], data)
    train(ref_model, ref, data)
    # The batched Gram matrix X X^T (bmm) occasionally rounds one bf16 ulp away from the
    # 2-D mm; over 20 steps that moved parameters by at most 3e-3 (measured), against a
    # total movement of ~0.35 from the start.
    diff = max_abs_diff(ours_model, ref_model)
    assert diff < 1e-2, diff


def test_float32_ns_stays_close_to_torch_bf16():
    torch.manual_seed(0)
    ours_model = TinyGPT()
    ref_model = copy.deepcopy(ours_model)
    ours = Muon(muon_param_groups(ours_model), lr=0.02, weight_decay=0.1, ns_dtype=torch.float32,
                adamw_lr=1e-3, adamw_weight_decay=0.01)
    ref = torch_pair(ref_model, lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True)
    data = batches(20)
    train(ours_model, [ours], data)
    train(ref_model, ref, data)
    diff = max_abs_diff(ours_model, ref_model)
    # Different rounding only: bf16 keeps ~3 significant digits of each O(0.3) entry of
    # the update, times lr=0.02. Measured 5e-3 after 20 steps, against a total movement
    # of ~0.35 from the start; a wrong formula would be off by the movement itself.
    assert 0.0 < diff < 2e-2, diff


def test_state_keys_and_bytes_match_torch():
    torch.manual_seed(0)
    ours_model = TinyGPT()
    ref_model = copy.deepcopy(ours_model)
    ours = Muon(muon_param_groups(ours_model), adamw_lr=1e-3, adamw_weight_decay=0.01, weight_decay=0.1)
    ref = torch_pair(ref_model, lr=0.02, weight_decay=0.1)
    data = batches(2)
    train(ours_model, [ours], data)
    train(ref_model, ref, data)
    ref_state = {**ref[0].state, **ref[1].state}
    ref_params = list(ref_model.parameters())
    for i, p in enumerate(ours_model.parameters()):
        mine, theirs = ours.state[p], ref_state[ref_params[i]]
        assert set(mine) == set(theirs)
        for key in mine:
            assert mine[key].dtype == theirs[key].dtype and mine[key].device == theirs[key].device
            assert mine[key].nbytes == theirs[key].nbytes
            torch.testing.assert_close(mine[key], theirs[key], rtol=0, atol=0)


# ---------------------------------------------------------------------------
# Newton-Schulz: batched vs per-matrix, orthogonality, schedules
# ---------------------------------------------------------------------------


def test_batched_equals_per_matrix_reference_float32():
    g = torch.Generator().manual_seed(0)
    shapes = [(24, 16)] * 3 + [(16, 40)] * 2 + [(16, 16), (40, 16)] + [(8, 3 * 3 * 3)]
    mats = [torch.randn(s, generator=g) for s in shapes]
    for schedule in NS_SCHEDULES:
        fast = orthogonalize(mats, 5, schedule, 1e-7, torch.float32, batched=True)
        slow = [newton_schulz_reference(M, 5, schedule, 1e-7, torch.float32) for M in mats]
        for f, s in zip(fast, slow):
            assert f.shape == s.shape and f.dtype == torch.float32
            torch.testing.assert_close(f, s, rtol=1e-5, atol=1e-6)
    # Leading dims of newton_schulz are a batch: each matrix normalised on its own.
    stack = torch.stack([mats[0], 100 * mats[1], mats[2]]).view(3, 1, 24, 16)
    out = newton_schulz(stack, 5, "simple", 1e-7, torch.float32)
    torch.testing.assert_close(out[1, 0], newton_schulz_reference(mats[1], 5, "simple", 1e-7, torch.float32),
                               rtol=1e-5, atol=1e-6)


def test_batched_optimizer_equals_per_matrix_with_conv_and_rectangles():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3), nn.Conv2d(8, 8, 3), nn.Flatten(), nn.Linear(8 * 4 * 4, 24), nn.Linear(24, 24),
        nn.Linear(24, 24), nn.Linear(24, 10),
    )
    twin = copy.deepcopy(model)
    # muon_param_groups knows the convolutions (one (out, in*k*k) matrix each); a plain iterable cannot tell a
    # kernel from a stack and is refused (test_matrix_views.py).
    fast = Muon(muon_param_groups(model), ns_dtype=torch.float32, batched=True)
    slow = Muon(muon_param_groups(twin), ns_dtype=torch.float32, batched=False)
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        x, y = torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 10, (4,), generator=g)
        for m, opt in ((model, fast), (twin, slow)):
            F.cross_entropy(m(x), y).backward()
            opt.step()
            opt.zero_grad()
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _singular_values(O: torch.Tensor) -> torch.Tensor:
    return torch.linalg.svdvals(O.double())


# Measured on random 64x128 Gaussian matrices in float32, 5 steps:
# simple [0.68, 1.13], quintic [0.978, 1.032], polar_express [0.859, 1.141].
@pytest.mark.parametrize(("schedule", "low", "high"), [
    ("simple", 0.6, 1.25), ("quintic", 0.95, 1.06), ("polar_express", 0.82, 1.18),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_singular_values_land_in_the_schedule_band(schedule, low, high, dtype):
    G = torch.randn(4, 64, 128, generator=torch.Generator().manual_seed(0))
    s = _singular_values(newton_schulz(G, 5, schedule, 1e-7, dtype))
    assert low < s.min().item() and s.max().item() < high, (s.min().item(), s.max().item())


def test_polar_express_is_closer_to_orthogonal_than_simple():
    # An ill-conditioned spectrum (singular values from 1 down to 1e-3), where a fixed
    # polynomial is slowest. Measured max|sigma - 1| at 5 steps: simple 0.79, polar_express 0.57.
    g = torch.Generator().manual_seed(0)
    U, _ = torch.linalg.qr(torch.randn(64, 64, generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(128, 64, generator=g, dtype=torch.float64))
    G = (U @ torch.diag(torch.logspace(0, -3, 64, dtype=torch.float64)) @ V.T).float()
    err = {name: (_singular_values(newton_schulz_reference(G, 5, name, 1e-7, torch.float32)) - 1).abs().max().item()
           for name in ("simple", "polar_express")}
    assert err["polar_express"] < err["simple"] - 0.1, err


def test_schedule_resolution():
    assert resolve_ns_coefficients("simple", 3) == (TORCH_COEFFS,) * 3
    assert resolve_ns_coefficients(TORCH_COEFFS, 2) == (TORCH_COEFFS,) * 2
    assert resolve_ns_coefficients([(1, 2, 3), (4, 5, 6)], 4) == ((1, 2, 3), (4, 5, 6), (4, 5, 6), (4, 5, 6))
    assert resolve_ns_coefficients("polar_express", 2) == NS_SCHEDULES["polar_express"][:2]
    assert len(resolve_ns_coefficients("quintic", 7)) == 7


# ---------------------------------------------------------------------------
# Optimizer behaviour
# ---------------------------------------------------------------------------


def test_params_without_grad_get_no_state_and_stay_put():
    torch.manual_seed(0)
    model = TinyGPT()
    opt = Muon(muon_param_groups(model))
    owned = {id(p) for i, p in enumerate(model.parameters()) if i % 2 == 0}  # as if another rank owns the rest
    before = [p.detach().clone() for p in model.parameters()]
    for idx, tgt in batches(2):
        loss_of(model, idx, tgt).backward()
        for p in model.parameters():
            if id(p) not in owned:
                p.grad = None
        opt.step()
        opt.zero_grad()
    for p, b in zip(model.parameters(), before):
        if id(p) in owned:
            assert len(opt.state[p]) > 0 and not torch.equal(p, b)
        else:
            assert p not in opt.state and torch.equal(p, b)


def test_state_dict_round_trip_reproduces_the_next_steps():
    torch.manual_seed(0)
    model = TinyGPT()
    opt = Muon(muon_param_groups(model), weight_decay=0.1, adamw_lr=1e-3)
    data = batches(6)
    train(model, [opt], data[:3])
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)

    train(model, [opt], data[3:])  # the uninterrupted run

    buf.seek(0)
    saved = torch.load(buf, weights_only=False)
    resumed = TinyGPT()
    resumed.load_state_dict(saved["model"])
    resumed_opt = Muon(muon_param_groups(resumed), weight_decay=0.1, adamw_lr=1e-3)
    resumed_opt.load_state_dict(saved["opt"])
    assert set(saved["opt"]["state"]) == set(range(len(list(model.parameters()))))  # keyed by param index
    train(resumed, [resumed_opt], data[3:])
    for a, b in zip(model.parameters(), resumed.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_lr_scheduler_scales_both_kinds_of_group():
    model = TinyGPT()
    opt = Muon(muon_param_groups(model), lr=0.02, adamw_lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5**step)
    for idx, tgt in batches(2):
        loss_of(model, idx, tgt).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    assert [g["use_muon"] for g in opt.param_groups] == [True, False]
    assert [g["initial_lr"] for g in opt.param_groups] == [0.02, 1e-3]
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.005, 2.5e-4])


@pytest.mark.parametrize("mode", ["original", "match_rms_adamw", "spectral", None])
@pytest.mark.parametrize("shape", [(48, 16), (16, 48), (8, 2, 3, 3)])
def test_adjust_lr_scale_is_applied(mode, shape):
    rows, cols = shape[0], math.prod(shape[1:])
    expected = {"original": math.sqrt(max(1, rows / cols)), "match_rms_adamw": 0.2 * math.sqrt(max(rows, cols)),
                "spectral": math.sqrt(rows / cols), None: 1.0}[mode]
    assert adjust_lr_scale(shape, mode) == pytest.approx(expected)

    p = nn.Parameter(torch.randn(shape))
    p.grad = torch.randn(shape)
    start = p.detach().clone()
    # momentum=0 makes the direction the gradient itself.
    group = {"params": [p], "use_muon": True, "stack": False}  # a kernel: one (rows, cols) matrix
    Muon([group], lr=0.1, momentum=0.0, ns_dtype=torch.float32, adjust_lr=mode).step()
    O = newton_schulz_reference(p.grad.reshape(rows, cols), 5, "simple", 1e-7, torch.float32).reshape(shape)
    torch.testing.assert_close(p.detach(), start - 0.1 * expected * O, rtol=1e-5, atol=1e-6)


def test_plain_iterable_routes_by_ndim():
    model = TinyGPT()
    opt = Muon(model.parameters(), lr=0.05, adamw_lr=1e-3, adamw_betas=(0.8, 0.9), adamw_eps=1e-6,
               adamw_weight_decay=0.02, weight_decay=0.3)
    muon, adamw = opt.param_groups
    assert muon["use_muon"] and all(p.ndim >= 2 for p in muon["params"])
    assert not adamw["use_muon"] and all(p.ndim < 2 for p in adamw["params"])
    assert len(muon["params"]) + len(adamw["params"]) == len(list(model.parameters()))
    assert (muon["lr"], muon["weight_decay"]) == (0.05, 0.3)
    assert (adamw["lr"], adamw["betas"], adamw["eps"], adamw["weight_decay"]) == (1e-3, (0.8, 0.9), 1e-6, 0.02)


def test_dict_groups_route_and_own_keys_win():
    w, v = nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(4))
    u = nn.Parameter(torch.randn(3))
    opt = Muon([{"params": [w]}, {"params": [v]}, {"params": [u], "lr": 0.1, "betas": (0.5, 0.6), "eps": 1e-3,
                                                   "weight_decay": 0.2}], adamw_lr=1e-3)
    assert [g["use_muon"] for g in opt.param_groups] == [True, False, False]
    assert opt.param_groups[0]["lr"] == 0.02 and opt.param_groups[1]["lr"] == 1e-3
    g = opt.param_groups[2]
    assert (g["lr"], g["betas"], g["eps"], g["weight_decay"]) == (0.1, (0.5, 0.6), 1e-3, 0.2)
    # An AdamW group steps exactly like torch.optim.AdamW with the same settings.
    u_ref = nn.Parameter(u.detach().clone())
    ref = torch.optim.AdamW([u_ref], lr=0.1, betas=(0.5, 0.6), eps=1e-3, weight_decay=0.2)
    for _ in range(3):
        u.grad = torch.randn(3)
        u_ref.grad = u.grad.clone()
        opt.step()
        ref.step()
    torch.testing.assert_close(u, u_ref, rtol=0, atol=0)


def test_string_dtype_and_named_params():
    model = nn.Linear(8, 4)
    opt = Muon(model.named_parameters(), ns_dtype="float32")
    assert opt.param_groups[0]["ns_dtype"] is torch.float32
    assert opt.param_groups[0]["param_names"] == ["weight"] and opt.param_groups[1]["param_names"] == ["bias"]


def _w(*shape):
    return nn.Parameter(torch.randn(shape))


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(params=[{"params": [_w(4, 4), _w(4)], "use_muon": True}]),
     r"parameter 1 has shape \(4,\) .*use_muon=False group or use muon_param_groups"),
    (dict(params=[{"params": [_w(4, 4), _w(4)]}]), r"mixes matrices .*split the group"),
    (dict(ns_steps=0), r"ns_steps=0 is invalid"),
    (dict(ns_coefficients="cubic"), r"ns_coefficients='cubic' is not a known schedule.*polar_express"),
    (dict(ns_coefficients=(1.0, 2.0)), r"ns_coefficients=\(1.0, 2.0\) is not a schedule name"),
    (dict(lr=-0.1), r"lr=-0.1 is invalid: it must be a number >= 0"),
    (dict(adamw_lr=-1e-3), r"adamw_lr=-0.001 is invalid"),
    (dict(momentum=1.0), r"momentum=1.0 is invalid: it must lie in \[0, 1\)"),
    (dict(momentum=-0.5), r"momentum=-0.5 is invalid"),
    (dict(adamw_betas=(0.9, 1.0)), r"adamw_betas=\(0.9, 1.0\) is invalid"),
    (dict(adamw_betas=(0.9,)), r"adamw_betas=\(0.9,\) is invalid"),
    (dict(adjust_lr="rms"), r"adjust_lr='rms' is not supported; use one of \['original', 'match_rms_adamw'"),
    (dict(ns_dtype=torch.int32), r"ns_dtype=torch.int32 is invalid"),
    (dict(params=[{"params": [_w(3)], "use_muon": False, "betas": (2.0, 0.9)}]), r"param group 0: betas=\(2.0"),
    (dict(params=[{"params": [_w(3, 3)], "lr": -1.0}]), r"param group 0: lr=-1.0 is invalid"),
])
def test_bad_input_raises_value_error_naming_the_fix(kwargs, match):
    kwargs = dict(kwargs)
    params = kwargs.pop("params", [_w(4, 4)])
    with pytest.raises(ValueError, match=match):
        Muon(params, **kwargs)


# --- more arguments: NaN, the weight decays and epsilons, and each setting inside a param group ----------


def _matrix():
    return nn.Parameter(torch.randn(4, 4))


@pytest.mark.parametrize("kwargs, match", [
    ({"lr": math.nan}, r"^Muon: lr=nan is invalid: it must be a number >= 0, e\.g\. lr=0\.02$"),
    ({"weight_decay": -0.1}, r"^Muon: weight_decay=-0\.1 is invalid: it must be a number >= 0, e\.g\. "
                             r"weight_decay=0\.0$"),
    ({"ns_eps": -1.0}, r"^Muon: ns_eps=-1\.0 is invalid"),
    ({"adamw_eps": -1e-8}, r"^Muon: adamw_eps=-1e-08 is invalid"),
    ({"adamw_weight_decay": -1.0}, r"^Muon: adamw_weight_decay=-1\.0 is invalid"),
    ({"params": [{"params": [_matrix()], "use_muon": "yes"}]},
     r"^Muon param group 0: use_muon='yes' is invalid: it must be True or False$"),
    ({"params": [{"params": [_matrix()], "momentum": 1.5}]}, r"^Muon param group 0: momentum=1\.5 is invalid: it "
                                                             r"must lie in \[0, 1\)"),
    ({"params": [{"params": [_matrix()], "ns_steps": 0}]},
     r"^Muon param group 0: ns_steps=0 is invalid: Newton-Schulz needs at least one iteration; pass ns_steps=5$"),
    ({"params": [{"params": [_matrix()], "adjust_lr": "rms"}]}, r"^Muon param group 0: adjust_lr='rms' is not "
                                                                r"supported"),
], ids=["lr-nan", "weight_decay", "ns_eps", "adamw_eps", "adamw_weight_decay", "group-use_muon", "group-momentum",
        "group-ns_steps", "group-adjust_lr"])
def test_muon_arguments_name_the_argument_and_the_fix(kwargs, match):
    kwargs = dict(kwargs)
    params = kwargs.pop("params", [_matrix()])
    with pytest.raises(ValueError, match=match):
        llw.Muon(params, **kwargs)


def test_works_with_lightning_cli_argument_parsing():
    jsonargparse = pytest.importorskip("jsonargparse")
    parser = jsonargparse.ArgumentParser()
    parser.add_class_arguments(Muon, "optimizer", skip={"params"})
    cfg = parser.parse_args(["--optimizer.adjust_lr=spectral", "--optimizer.ns_coefficients=polar_express",
                             "--optimizer.ns_dtype=float32", "--optimizer.adamw_betas=[0.9, 0.99]"])
    opt = Muon(TinyGPT().parameters(), **dict(cfg.optimizer))
    group = opt.param_groups[0]
    assert (group["adjust_lr"], group["ns_coefficients"], group["ns_dtype"]) == ("spectral", "polar_express",
                                                                                  torch.float32)
    assert opt.param_groups[1]["betas"] == (0.9, 0.99)
