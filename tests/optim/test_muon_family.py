"""Stacked and split matrices, NorMuon and QK-clip in one process, against the papers' formulas (``_muon_family.py``).

* ``llw.Muon`` on :class:`FamilyNet` (experts stacked in 3-D parameters, a fused QKV per head, a query per head)
  equals the reference written from the formulas to <= 1e-5 (float32 Newton-Schulz, 10 steps): Muon, NorMuon,
  and Muon with QK-clip firing; the same model with the stacks flattened or the split undone does not (the
  comparison can fail).
* QK-clip rescales the heads over ``tau`` and leaves every other row bitwise alone; the logits helper equals the
  logits written out, with masks and grouped-query attention.
* Bad marks and groups are refused before any step, naming the parameter and the fix; so is QK-clip with nothing
  to clip by: a step without recorded logits raises (an attention that alone records nothing is warned about once),
  and query rows that overlap key rows, logits in another layout than the declared heads, or rows two attentions
  declare are refused.
"""

from __future__ import annotations

import copy
import io
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lightning_layerwise as llw
from _dist import reference_threads
from _muon_family import (HD, FamilyNet, attention, batches, loss_fn, package_optimizer, reference_run,
                          train_one_process)
from helpers import rel_err
from lightning_layerwise.optim import (MatrixView, describe_param_groups, matrix_shapes, max_attention_logits,
                                       muon_param_groups)

STEPS = 10
TAU = 30.0  # the hot heads' logits start near 90 and 62, the others near 1.5


def package_run(variant: str, model: nn.Module | None = None, steps: int = STEPS) -> dict:
    model = model if model is not None else FamilyNet(hot_heads=(1, 3))
    opt = package_optimizer(model, normuon=variant == "normuon")
    clip = llw.QKClip(model, tau=TAU).attach(opt) if variant == "qkclip" else None
    clipped = []
    with reference_threads():
        result = train_one_process(model, opt, steps,
                                   after_step=lambda: clipped.append(int(clip.clipped_heads) if clip else 0))
    return {**result, "clipped": clipped, "opt": opt}


def reference(variant: str) -> dict:
    with reference_threads():
        return reference_run(variant, STEPS, tau=TAU if variant == "qkclip" else None)


def worst(result: dict, ref: dict) -> tuple[str, float]:
    errs = {n: rel_err(v, ref["params"][n]) for n, v in result["params"].items()}
    name = max(errs, key=errs.get)
    return name, errs[name]


@pytest.mark.parametrize("variant", ["muon", "normuon", "qkclip"])
def test_the_family_equals_the_papers_formulas(variant):
    ref = reference(variant)
    result = package_run(variant)
    name, err = worst(result, ref)
    assert err <= 1e-5, f"{variant}: {name} differs from the reference by {err:.2e}"
    assert max(abs(a - b) for a, b in zip(result["losses"], ref["losses"])) <= 1e-5 * max(ref["losses"])
    if variant == "qkclip":
        assert result["clipped"][0] == 2, result["clipped"]  # the two hot heads, on the first step
    print(f"{variant}: max rel err {err:.2e} ({name})")


def test_flattened_stacks_or_unsplit_heads_do_not_match_the_reference():
    """The reference test can fail: Muon on the stacks as (E, rest) matrices, or on the fused QKV as one matrix."""
    ref = reference("muon")
    flat = FamilyNet(hot_heads=(1, 3))
    for name in ("up", "down"):
        llw.mark_matrices(flat, name, stack=False)
    name, err = worst(package_run("muon", flat), ref)
    assert err > 1e-3 and name in ("up", "down"), (name, err)
    whole = FamilyNet(hot_heads=(1, 3))
    llw.mark_matrices(whole.att1.qkv, "weight")  # one 48x16 matrix
    errs = {n: rel_err(v, ref["params"][n]) for n, v in package_run("muon", whole)["params"].items()}
    assert errs["att1.qkv.weight"] > 1e-3, errs


def test_matrix_views_by_the_rule_and_in_the_table():
    model = FamilyNet()
    conv = nn.Conv2d(3, 8, 3)
    container = nn.ModuleDict({"family": model, "conv": conv})
    groups = muon_param_groups(container)
    views = {id(p): (g.get("stack"), g.get("split")) for g in groups if g["use_muon"] for p in g["params"]}
    assert views[id(model.up)] == (True, None)
    assert views[id(model.att1.qkv.weight)] == (True, 12)
    assert views[id(conv.weight)] == (False, None)
    assert matrix_shapes((E := 4, 32, 16), MatrixView()) == [(32, 16)] * E
    assert matrix_shapes((8, 3, 3, 3), MatrixView(stack=False)) == [(8, 27)]
    assert matrix_shapes((48, 16), MatrixView(split=12)) == [(4, 16)] * 12
    assert matrix_shapes((2, 6, 16), MatrixView(split=(2, 4), split_dim=0)) == [(2, 16), (4, 16)] * 2
    assert matrix_shapes((6, 16), MatrixView(split=4, split_dim=1)) == [(6, 4)] * 4
    table = describe_param_groups(container, groups)
    row = {line.split()[0]: line for line in table.splitlines()}
    assert "4 x 32x16" in row["family.up"]
    assert "12 x 4x16" in row["family.att1.qkv.weight"]
    assert "8x27 (flattened)" in row["conv.weight"]
    # split patterns for models one cannot mark, and a stack or split is batched with the same-shape matrices
    plain = nn.Sequential(nn.Linear(16, 48, bias=False), nn.Linear(48, 16, bias=False))
    groups = muon_param_groups(plain, split={"0.weight": 3})
    assert [(g.get("split"), len(g["params"])) for g in groups] == [(3, 1), (None, 1)]


def test_normuon_state_is_one_float_per_row_of_each_matrix_and_round_trips():
    model = FamilyNet()
    result = package_run("normuon", model, steps=2)
    opt = result["opt"]
    state = opt.state
    assert state[model.up]["second_moment"].shape == (4 * 32,)  # 4 experts of 32 rows
    assert state[model.att1.qkv.weight]["second_moment"].shape == (48,)  # 12 blocks of 4 rows
    assert state[model.att1.o.weight]["second_moment"].dtype == torch.float32
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    twin = copy.deepcopy(model)
    resumed = package_optimizer(twin, normuon=True)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    assert all(g["normuon"] for g in resumed.param_groups if g["use_muon"])
    for tokens in batches(2, seed=9):
        for m, o in ((model, opt), (twin, resumed)):
            o.zero_grad()
            loss_fn(m, tokens).backward()
            o.step()
    for (n, a), b in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(a, b), n


def test_qk_clip_rescales_the_heads_over_tau_and_nothing_else():
    model = FamilyNet(hot_heads=(1, 3))
    clip = llw.QKClip(model, tau=TAU)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        loss_fn(model, batches(1)[0])
    s_att2 = model.att2.reference_max.clone()
    torch.testing.assert_close(model.att2.llw_max_logits, s_att2, rtol=1e-6, atol=1e-6)
    assert (s_att2[[1, 3]] > TAU).all() and (s_att2[[0, 2]] < TAU).all() and (model.att1.reference_max < TAU).all()
    clip.step()
    assert int(clip.clipped_heads) == 2
    after = dict(model.named_parameters())
    for n in before:
        if n not in ("att2.q.weight", "att2.k.weight", "att2.q.bias"):
            assert torch.equal(after[n], before[n]), n  # att1's heads stayed under tau
    for n in ("att2.q.weight", "att2.k.weight", "att2.q.bias"):
        for h in range(4):
            rows = slice(h * HD, (h + 1) * HD)
            if h in (1, 3):
                factor = math.sqrt(TAU / s_att2[h].item())
                torch.testing.assert_close(after[n][rows], before[n][rows] * factor, rtol=1e-6, atol=0)
            else:
                assert torch.equal(after[n][rows], before[n][rows]), (n, h)
    # the logits of the rescaled heads are now at tau; the running maxima were cleared
    assert model.att2.llw_max_logits is None
    with torch.no_grad():
        loss_fn(model, batches(1)[0])
    torch.testing.assert_close(model.att2.llw_max_logits[[1, 3]], torch.tensor([TAU, TAU]), rtol=1e-5, atol=0)


def test_max_attention_logits_follows_the_masks_and_grouped_heads():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 6, 8, generator=g), torch.randn(2, 2, 5, 8, generator=g)  # 2 key heads for 4
    full = q @ k.repeat_interleave(2, dim=1).transpose(-2, -1) / math.sqrt(8)
    torch.testing.assert_close(max_attention_logits(q, k), full.amax(dim=(0, 2, 3)))
    mask = torch.rand(6, 5, generator=g) > 0.5
    mask[:, 0] = True
    want = full.masked_fill(~mask, float("-inf")).amax(dim=(0, 2, 3))
    torch.testing.assert_close(max_attention_logits(q, k, attn_mask=mask), want)
    additive = torch.zeros(6, 5).masked_fill(~mask, float("-inf"))
    torch.testing.assert_close(max_attention_logits(q, k, attn_mask=additive, chunk=4), want)
    qs, ks, vs = torch.randn(3, 4, 7, 8, generator=g), torch.randn(3, 4, 7, 8, generator=g), torch.randn(3, 4, 7, 8)
    _, written_out = attention(qs, ks, vs)
    torch.testing.assert_close(max_attention_logits(qs, ks, is_causal=True, chunk=3), written_out)


def test_bad_marks_and_groups_are_refused_before_any_step():
    conv = nn.Conv2d(3, 8, 3)
    with pytest.raises(ValueError, match=r"parameter 0 has shape \(8, 3, 3, 3\): say how Newton-Schulz should "
                                         r"see it.*muon_param_groups\(model\).*mark_matrices"):
        llw.Muon(conv.parameters())
    with pytest.raises(ValueError, match=r"rows \(48\) do not split into 5 equal blocks"):
        llw.mark_matrices(nn.Linear(16, 48).weight, split=5)
    with pytest.raises(ValueError, match=r"split=\(10, 10\) must be positive sizes adding up to its 48 rows"):
        llw.mark_matrices(nn.Linear(16, 48).weight, split=(10, 10))
    with pytest.raises(ValueError, match=r"the pattern\(s\) \['nope\.\*'\] match no parameter routed to Muon"):
        muon_param_groups(FamilyNet(), split={"nope.*": 3})
    with pytest.raises(ValueError, match=r"param group 0: parameter 0 .* do not split into 7 equal blocks"):
        llw.Muon([{"params": [nn.Linear(16, 48).weight], "use_muon": True, "split": 7}])
    with pytest.raises(ValueError, match=r"normuon_beta2=1.0 is invalid"):
        llw.Muon(nn.Linear(4, 4).parameters(), normuon=True, normuon_beta2=1.0)
    with pytest.raises(ValueError, match=r"mark_attention\(q='query.weight'\): Linear has no parameter"):
        llw.mark_attention(nn.Linear(4, 4), n_heads=2, head_dim=2, q="query.weight", k="weight")
    with pytest.raises(ValueError, match=r"too few for 2 heads of 4 from row 2"):
        llw.mark_attention(nn.Linear(4, 8), n_heads=2, head_dim=4, q="weight", k="weight", k_offset=2)
    with pytest.raises(ValueError, match=r"no module of Linear declares its attention heads"):
        llw.QKClip(nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"QKClip\(tau=0\)"):
        llw.QKClip(FamilyNet(), tau=0)


def test_a_step_the_optimizer_skips_skips_the_clip():
    model = FamilyNet(hot_heads=(1, 3))
    opt = package_optimizer(model)
    llw.QKClip(model, tau=TAU).attach(opt)
    with torch.no_grad():
        loss_fn(model, batches(1)[0])
    before = model.att2.q.weight.detach().clone()
    scaler = torch.amp.GradScaler("cpu")
    loss = loss_fn(model, batches(1)[0])
    scaler.scale(loss).backward()
    model.att2.q.weight.grad[0, 0] = float("inf")  # the scaler finds an inf and skips the step
    scaler.step(opt)
    assert torch.equal(model.att2.q.weight, before)
    assert model.att2.llw_max_logits is not None  # kept for the next step: the weights did not change



def test_a_mark_through_the_module_survives_a_deep_copy():
    """FamilyNet marks through its modules; a mark set on the parameter is lost by ``copy.deepcopy`` (torch copies
    no attribute of a parameter), as docs/muon.md says."""
    model = FamilyNet()
    llw.mark_matrices(model.att2.v.weight, split=4)
    twin = copy.deepcopy(model)

    def splits(m):
        return {n: g.get("split") for g in muon_param_groups(m) for n, p in m.named_parameters()
                for q in g["params"] if q is p}

    assert splits(model)["att2.v.weight"] == 4
    assert splits(twin)["att1.qkv.weight"] == 12 and splits(twin)["att2.q.weight"] == 4
    assert splits(twin)["att2.v.weight"] is None
    with pytest.raises(ValueError, match=r"name one parameter of the module itself"):
        llw.mark_matrices(model, "att1.qkv.weight", split=3)


def test_the_layout_costs_each_matrix_of_a_view():
    """The planner balances Newton-Schulz work: a stack or blocks cost the sum over their matrices."""
    from lightning_layerwise.engine.wrapper_setup import layout_specs
    from lightning_layerwise.layout import newton_schulz_cost

    specs = {s.name: s for s in layout_specs(FamilyNet())}
    assert specs["up"].matrices == ((32, 16),) * 4
    assert newton_schulz_cost(specs["up"]) == 4 * 16 ** 2 * 32  # flattened it would be 4^2 * 512
    assert specs["att1.qkv.weight"].matrices == ((4, 16),) * 12
    assert newton_schulz_cost(specs["att1.qkv.weight"]) == 12 * 4 ** 2 * 16
    assert specs["att1.o.weight"].matrices is None and newton_schulz_cost(specs["att1.o.weight"]) == 16 ** 3


def test_qk_clip_takes_the_largest_logit_over_every_micro_batch():
    """Two micro-batches per step (gradients accumulated): the running maximum covers both, so the run equals
    the reference on whole batches."""
    ref = reference("qkclip")
    model = FamilyNet(hot_heads=(1, 3))
    opt = package_optimizer(model)
    llw.QKClip(model, tau=TAU).attach(opt)
    with reference_threads():
        for tokens in batches(STEPS):
            opt.zero_grad()
            for half in tokens.chunk(2):
                (loss_fn(model, half) / 2).backward()
            opt.step()
    name, err = worst({"params": {n: p.detach() for n, p in model.named_parameters()}}, ref)
    assert err <= 1e-5, (name, err)


def test_a_stack_of_fused_matrices_is_cut_into_blocks_of_each_matrix():
    """A 3-D fused parameter (two experts, each a fused [2 + 4, 16] matrix) under stack and split: every block
    of every expert orthogonalized alone, scaled by its own shape (torch's momentum form, float64 reference)."""
    from _muon_family import ns5

    g = torch.Generator().manual_seed(0)
    p = nn.Parameter(torch.randn(2, 6, 16, generator=g))
    grad = torch.randn(2, 6, 16, generator=g)
    want = p.detach().clone()
    group = {"params": [p], "use_muon": True, "stack": True, "split": (2, 4)}
    opt = llw.Muon([group], lr=0.1, momentum=0.9, nesterov=True, ns_dtype=torch.float32,
                   ns_coefficients=(3.4445, -4.7750, 2.0315))
    p.grad = grad.clone()
    opt.step()
    for e in range(2):
        for rows in (slice(0, 2), slice(2, 6)):
            G = grad[e, rows]
            direction = 0.1 * G + 0.9 * (0.1 * G)  # B = 0.1 G from zero; D = (1 - mu) G + mu B
            O = ns5(direction)
            m, n = O.shape
            want[e, rows] -= 0.1 * math.sqrt(max(1.0, m / n)) * O
    torch.testing.assert_close(p.detach(), want, rtol=1e-5, atol=1e-6)


# --- QK-clip refuses to do nothing ------------------------------------------------------------------------------


class UnrecordedAttention(nn.Module):
    """A fused QKV attention declared for QK-clip whose forward never calls ``record_attention_logits``."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24, bias=False)
        llw.mark_attention(self, n_heads=2, head_dim=4, q="qkv.weight", k="qkv.weight", k_offset=8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.unflatten(-1, (2, 4)).transpose(-3, -2) for t in self.qkv(x).split(8, dim=-1))
        return F.scaled_dot_product_attention(q, k, v).transpose(-3, -2).flatten(-2)


NOTHING_RECORDED = (r"^QKClip\(tau=0\.001\): no attention recorded its logits in this step, so QK-clip has nothing "
                    r"to clip by \(declared with mark_attention: .*\)\. Call lightning_layerwise\."
                    r"record_attention_logits\(self, q, k, .*training mode only \(model\.train\(\)\)")


def test_a_step_without_recorded_logits_is_refused_before_the_optimizer_changes_anything():
    """A forward that never records: the step pre-hook raises before the update; with a closure (the forward runs
    inside the step, as under Lightning's automatic optimization) the post-hook raises after it; a direct
    ``clip.step()`` raises too. Nothing is ever clipped by ``-inf`` maxima in silence."""
    model = UnrecordedAttention()
    opt = llw.Muon(muon_param_groups(model))
    llw.QKClip(model, tau=1e-3).attach(opt)
    x = torch.randn(2, 5, 8)
    model(x).square().mean().backward()
    before = model.qkv.weight.detach().clone()
    with pytest.raises(RuntimeError, match=NOTHING_RECORDED):
        opt.step()
    assert torch.equal(model.qkv.weight, before)

    def closure():
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        return loss

    with pytest.raises(RuntimeError, match=NOTHING_RECORDED):
        opt.step(closure)
    with pytest.raises(RuntimeError, match=NOTHING_RECORDED):
        llw.QKClip(model, tau=1e-3).step()


def test_a_training_forward_in_eval_mode_records_nothing_and_is_refused():
    model = FamilyNet(hot_heads=(1, 3))
    opt = package_optimizer(model)
    llw.QKClip(model, tau=1e-3).attach(opt)
    model.eval()  # record_attention_logits records in training mode only
    loss_fn(model, batches(1)[0]).backward()
    with pytest.raises(RuntimeError, match=r"'att1', 'att2'\).*records in training mode only"):
        opt.step()
    model.train()
    opt.zero_grad()
    loss_fn(model, batches(1)[0]).backward()
    opt.step()  # recorded: clipped as usual


def test_an_attention_that_records_nothing_while_others_do_is_warned_about_once():
    model = FamilyNet(hot_heads=(1, 3))
    opt = package_optimizer(model)
    clip = llw.QKClip(model, tau=TAU).attach(opt)
    model.att1.eval()  # att1 records nothing; att2 (the hot heads) does
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for tokens in batches(3):
            opt.zero_grad()
            loss_fn(model, tokens).backward()
            opt.step()
    messages = [str(w.message) for w in caught if "QKClip" in str(w.message)]
    assert len(messages) == 1, messages
    assert messages[0].startswith("QKClip(tau=30): 'att1' recorded no logits in this step while other attentions "
                                  "did, so their heads are not clipped this step."), messages[0]
    assert clip.last_max_logits[:4].eq(float("-inf")).all() and clip.last_max_logits[4:].gt(0).all()


@pytest.mark.parametrize("kwargs, match", [
    ({"q": "weight", "k": "weight"},
     r"^mark_attention\(q='weight', k='weight', q_offset=0, k_offset=0\): the query rows \[0, 8\) and the key rows "
     r"\[0, 8\) of 'weight' overlap; each row is a query or a key\. In a fused QKV whose keys follow the queries "
     r"pass k_offset=q_offset \+ n_heads \* head_dim \(= 8\)\.$"),
    ({"q": "weight", "k": "weight", "k_offset": 4}, r"the query rows \[0, 8\) and the key rows \[4, 12\) of 'weight' "
                                                    r"overlap"),
    ({"q": "weight", "k": "weight", "q_offset": 8, "k_offset": 6, "n_kv_heads": 1},
     r"the query rows \[8, 16\) and the key rows \[6, 10\) of 'weight' overlap"),
    ({"q": "weight", "k": "weight", "k_offset": 8, "n_kv_heads": 0},
     r"^mark_attention\(n_kv_heads=0\): pass the number of key heads, a positive integer dividing n_heads=2, or "
     r"None \(one key head per query head\)\.$"),
    ({"q": "weight", "k": "weight", "k_offset": -8}, r"^mark_attention\(k_offset=-8\): pass the first row of head 0"),
    ({"q": "weight", "k": "weight", "q_offset": 1.0}, r"^mark_attention\(q_offset=1\.0\): pass the first row"),
    ({"q": "weight", "k": "weight", "k_offset": 2, "head_stride": 8},
     r"^mark_attention\(q='weight', k='weight', q_offset=0, k_offset=2, head_stride=8\): some query rows of 'weight' "
     r"are also key rows; each row is a query or a key\. In a fused QKV stacked head by head pass q_offset=0, "
     r"k_offset=head_dim, head_stride=3 \* head_dim\.$"),
    ({"q": "weight", "k": "weight", "k_offset": 4, "head_stride": 3},
     r"^mark_attention\(head_stride=3\): pass the rows from one head's first row to the next's, an integer >= "
     r"head_dim=4"),
    ({"q": "weight", "k": "weight", "q_offset": 16, "k_offset": 4, "head_stride": 12},
     r"^mark_attention: q='weight' has 24 rows, too few for 2 heads of 4 from row 16, 12 apart\.$"),
], ids=["k_offset-forgotten", "keys-start-inside-queries", "keys-before-queries", "n_kv_heads-0", "k_offset-negative",
        "q_offset-float", "strided-rows-shared", "stride-below-head_dim", "strided-past-the-end"])
def test_mark_attention_refuses_overlapping_or_meaningless_rows(kwargs, match):
    with pytest.raises(ValueError, match=match):
        llw.mark_attention(nn.Linear(4, 24), n_heads=2, head_dim=4, **kwargs)


def test_heads_stacked_head_by_head_are_clipped_in_their_own_rows():
    """A fused QKV in head order, ``[q_0; k_0; v_0; q_1; ...]``, declared with ``head_stride``: QK-clip scales the
    query and key rows of each head by that head's factors and leaves the value rows alone."""
    d, heads, hd = 8, 2, 4
    module = nn.Module()
    module.qkv = nn.Linear(d, 3 * d)
    llw.mark_attention(module, n_heads=heads, head_dim=hd, q="qkv.weight", k="qkv.weight", k_offset=hd,
                       head_stride=3 * hd)
    before = module.qkv.weight.detach().clone()
    clip = llw.QKClip(module, tau=1.0)
    module.llw_max_logits = torch.tensor([4.0, 0.5])  # head 0 over the bound by 4x, head 1 under it
    clip.step()
    factor = torch.ones(3 * d)
    factor[0:hd] = factor[hd:2 * hd] = 0.5  # sqrt(1/4) on head 0's query and key rows
    torch.testing.assert_close(module.qkv.weight, before * factor.unsqueeze(1), rtol=0, atol=0)


def test_mark_attention_accepts_disjoint_rows_in_either_order():
    keys_first = llw.mark_attention(nn.Linear(4, 24), n_heads=2, head_dim=4, q="weight", k="weight", q_offset=8,
                                    n_kv_heads=1)
    assert (keys_first.llw_attention_heads.q_offset, keys_first.llw_attention_heads.k_offset) == (8, 0)
    llw.mark_attention(nn.Linear(4, 24), n_heads=2, head_dim=4, q="weight", k="weight", k_offset=8)


def test_logits_recorded_in_another_layout_than_the_declared_heads_are_refused():
    module = llw.mark_attention(nn.Linear(8, 24), n_heads=2, head_dim=4, q="weight", k="weight", k_offset=8)
    q = k = torch.randn(3, 5, 2, 4)  # (B, T, H, E): not SDPA's (B, H, T, E)
    with pytest.raises(ValueError, match=r"^record_attention_logits\(Linear\): q has shape \(3, 5, 2, 4\) and k "
                                         r"\(3, 5, 2, 4\), but mark_attention declared n_heads=2, n_kv_heads=None, "
                                         r"head_dim=4\. Pass q and k as F\.scaled_dot_product_attention takes them"):
        llw.record_attention_logits(module, q, k)
    llw.record_attention_logits(module, q.transpose(1, 2), k.transpose(1, 2))
    assert module.llw_max_logits.shape == (2,)


def test_logits_of_part_of_the_heads_are_refused_where_the_weights_are_not_sharded():
    """``record_attention_logits`` takes ``n_heads / w`` heads (a tensor-parallel rank's); ``QKClip`` then checks
    ``w`` against the query weight's sharding, which here is none."""
    module = llw.mark_attention(nn.Linear(8, 24), n_heads=2, head_dim=4, q="weight", k="weight", k_offset=8)
    clip = llw.QKClip(module, tau=1.0)
    q = k = torch.randn(3, 1, 5, 4)  # one of the two heads
    llw.record_attention_logits(module, q, k)
    with pytest.raises(ValueError, match=r"^QKClip: attention '' recorded the logits of 1 heads; it declares "
                                         r"n_heads=2\. Pass record_attention_logits the q and k"):
        clip.step()


def test_rows_that_two_attentions_declare_are_refused():
    shared = nn.Linear(8, 24, bias=False)
    first, second = nn.Module(), nn.Module()
    first.qkv = second.qkv = shared
    for module in (first, second):
        llw.mark_attention(module, n_heads=2, head_dim=4, q="qkv.weight", k="qkv.weight", k_offset=8)
    with pytest.raises(ValueError, match=r"^QKClip: row 0 of '.*qkv\.weight' is declared twice, as one of the q rows "
                                         r"of attention 'first' and as q rows of 'second'"):
        llw.QKClip(nn.ModuleDict({"first": first, "second": second}))
