"""muon_param_groups: which parameters go to Muon and which to AdamW (pure, no optimizer state)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from lightning_layerwise.optim import Muon, describe_param_groups, muon_param_groups, route_parameters


class Attention(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.c_attn = nn.Linear(d, 3 * d)
        self.output = nn.Linear(d, d)  # named like a head, but inside a repeated block


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.attn = Attention(d)
        self.ln_2 = nn.LayerNorm(d)
        self.c_fc = nn.Linear(d, 4 * d)
        self.c_proj = nn.Linear(4 * d, d)


class GPTLike(nn.Module):
    def __init__(self, vocab: int = 32, d: int = 8, n_layer: int = 2, tie: bool = True) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(16, d)
        self.h = nn.ModuleList(Block(d) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d)
        self.scale = nn.Parameter(torch.ones(()))  # a 0-d scalar
        self.lm_head = nn.Linear(d, vocab, bias=False)
        if tie:
            self.lm_head.weight = self.wte.weight


def split(model: nn.Module, groups: list[dict]) -> tuple[set[str], set[str]]:
    """Names in the Muon group and names in the AdamW group."""
    kind = {id(p): g["use_muon"] for g in groups for p in g["params"]}
    named = list(model.named_parameters())
    return ({n for n, p in named if kind.get(id(p)) is True}, {n for n, p in named if kind.get(id(p)) is False})


HIDDEN = {f"h.{i}.{n}" for i in range(2) for n in ("attn.c_attn.weight", "attn.output.weight", "c_fc.weight",
                                                   "c_proj.weight")}


def test_gpt_routing_with_tied_head():
    model = GPTLike()
    groups = muon_param_groups(model)
    assert [g["use_muon"] for g in groups] == [True, False]
    muon, adamw = split(model, groups)
    assert muon == HIDDEN
    all_names = {n for n, _ in model.named_parameters()}  # deduplicated: lm_head.weight is wte.weight
    assert "lm_head.weight" not in all_names and "wte.weight" in adamw
    assert adamw == all_names - HIDDEN
    # each trainable parameter exactly once
    flat = [p for g in groups for p in g["params"]]
    assert len(flat) == len({id(p) for p in flat}) == len(list(model.parameters()))


def test_untied_head_goes_to_adamw_by_name():
    model = GPTLike(tie=False)
    routes = {r.name: r for r in route_parameters(model)}
    assert not routes["lm_head.weight"].use_muon and routes["lm_head.weight"].reason == "output head"
    assert routes["h.0.attn.output.weight"].use_muon  # "output" inside block 0 is a hidden layer
    assert routes["wte.weight"].reason == "embedding"


def test_head_rule_tolerates_wrappers_and_names():
    class Wrapper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = GPTLike(tie=False)
            self.classifier = nn.Linear(8, 3)
            self.fc = nn.Linear(8, 8)

    routes = {r.name: r.use_muon for r in route_parameters(Wrapper())}
    assert routes["model.lm_head.weight"] is False
    assert routes["classifier.weight"] is False
    assert routes["fc.weight"] is True  # not a head name: exclude it explicitly if it is one


def test_use_muon_attribute_overrides_the_rules():
    model = GPTLike()
    model.h[0].c_fc.weight.use_muon = False
    model.wpe.weight.use_muon = True
    muon, adamw = split(model, muon_param_groups(model))
    assert "h.0.c_fc.weight" in adamw and "wpe.weight" in muon
    routes = {r.name: r.reason for r in route_parameters(model)}
    assert routes["h.0.c_fc.weight"] == "attribute use_muon=False"


def test_use_muon_true_on_a_vector_is_rejected():
    model = GPTLike()
    model.ln_f.weight.use_muon = True
    with pytest.raises(ValueError, match=r"'ln_f.weight' has use_muon=True but shape \(8,\)"):
        muon_param_groups(model)


def test_exclude_patterns_force_adamw_and_win_over_the_attribute():
    model = GPTLike()
    model.h[1].c_fc.weight.use_muon = True
    muon, adamw = split(model, muon_param_groups(model, exclude=("h.1.*", "*.attn.output.weight")))
    assert muon == {"h.0.attn.c_attn.weight", "h.0.c_fc.weight", "h.0.c_proj.weight"}
    assert {"h.1.c_fc.weight", "h.0.attn.output.weight"} <= adamw


def test_exclude_matches_every_name_of_a_tied_parameter():
    model = GPTLike(tie=False)
    model.h[1].c_proj.weight = model.h[0].c_proj.weight  # listed once, as h.0.c_proj.weight
    routes = {r.name: r for r in route_parameters(model, exclude=("h.1.c_proj.weight",))}
    assert "h.1.c_proj.weight" not in routes
    assert routes["h.0.c_proj.weight"].use_muon is False
    assert routes["h.0.c_proj.weight"].aliases == ("h.1.c_proj.weight",)


def test_exclude_must_be_a_sequence():
    with pytest.raises(ValueError, match=r"exclude='lm_head\.\*' is a string; pass a sequence"):
        muon_param_groups(GPTLike(), exclude="lm_head.*")


def test_an_exclude_pattern_that_names_no_parameter_is_refused():
    """A misspelt pattern would leave its parameters in Muon in silence; a frozen parameter's name still counts."""
    with pytest.raises(ValueError, match=r"^exclude=\('h\.1\.\*', 'lm_haed\.\*'\): the pattern\(s\) \['lm_haed\.\*'\] "
                                         r"match no parameter of GPTLike; the names are those of "
                                         r"model\.named_parameters\(\)"):
        muon_param_groups(GPTLike(), exclude=("h.1.*", "lm_haed.*"))
    model = GPTLike()
    model.h[1].requires_grad_(False)
    muon_param_groups(model, exclude=("h.1.*",))


@pytest.mark.parametrize("split_arg, match", [
    ({"*.c_attn.weight": 0}, r"^split\['\*\.c_attn\.weight'\]: split=0 must be a number of equal blocks >= 1 "
                             r"\(e\.g\. split=3 for a fused QKV, split=n_heads for per-head blocks\) or a tuple of "
                             r"block sizes >= 1\.$"),
    ({"*.c_attn.weight": -3}, r"split=-3 must be a number of equal blocks >= 1"),
    ({"*.c_attn.weight": (8, 16, 0)}, r"split=\(8, 16, 0\) must be a number of equal blocks >= 1"),
    ({"*.c_attn.weight": []}, r"split=\(\) must be a number of equal blocks >= 1"),
    ({"*.c_attn.weight": 2.0}, r"split=2\.0 must be a number of equal blocks >= 1"),
    ({"*.c_attn.weight": 5}, r"^split\['\*\.c_attn\.weight'\] on parameter 'h\.0\.attn\.c_attn\.weight' has shape "
                             r"\(24, 8\): its rows \(24\) do not split into 5 equal blocks"),
    (3, r"^split=3: pass a mapping of parameter name patterns to a block count or block sizes, e\.g\. "
        r"split=\{'\*\.qkv\.weight': 3\}"),
    ({3: 3}, r"the key 3 is not a name pattern"),
], ids=["zero", "negative", "a-zero-size", "empty", "float", "not-dividing", "not-a-mapping", "not-a-pattern"])
def test_a_bad_split_is_refused_before_any_routing(split_arg, match):
    """``split={"*.qkv.weight": 0}`` used to divide by zero; each value is checked before the parameters are
    routed, the fit to each parameter's shape when it is routed."""
    with pytest.raises(ValueError, match=match):
        muon_param_groups(GPTLike(), split=split_arg)


def test_mark_matrices_refuses_the_same_splits():
    from lightning_layerwise import mark_matrices

    for bad in (0, -1, (24, 0), ()):
        with pytest.raises(ValueError, match=r"must be a number of equal blocks >= 1"):
            mark_matrices(nn.Linear(8, 24), "weight", split=bad)
    with pytest.raises(ValueError, match=r"split_dim=True must be 0 \(rows\) or 1 \(columns\)"):
        mark_matrices(nn.Linear(8, 24), "weight", split=3, split_dim=True)


def test_parameters_instead_of_the_module_are_refused_naming_the_fix():
    """``model.parameters()`` carries no names or owning modules: routing it by ndim alone would send the embeddings
    and the output head to Muon, so it is refused (rather than an AttributeError on ``named_parameters``)."""
    model = GPTLike()
    fix = (r"the routing rules need the parameters' names and the modules holding them \(embeddings and the output "
           r"head go to AdamW\), which model\.parameters\(\) does not carry\. Pass the module itself, ")
    with pytest.raises(TypeError, match=r"^muon_param_groups\(module=\.\.\.\) takes the model, an nn\.Module \(got "
                                        r"generator\): " + fix + r"muon_param_groups\(model\), or build the groups by "
                                        r"hand: \[\{'params': matrices, 'use_muon': True\}, \{'params': others, "
                                        r"'use_muon': False\}\]\.$"):
        muon_param_groups(model.parameters())
    with pytest.raises(TypeError, match=r"^muon_param_groups\(module=\.\.\.\) takes the model, an nn\.Module \(got "
                                        r"list\)"):
        muon_param_groups(list(model.parameters()), lr=0.02)
    with pytest.raises(TypeError, match=r"^describe_param_groups\(module=\.\.\.\) takes the model, an nn\.Module "
                                        r"\(got generator\): .*describe_param_groups\(model\)"):
        describe_param_groups(model.parameters(), muon_param_groups(model))
    with pytest.raises(TypeError, match=r"^route_parameters\(module=\.\.\.\) takes the model"):
        route_parameters(model.parameters())


def test_frozen_parameters_are_left_out():
    model = GPTLike()
    model.wpe.weight.requires_grad_(False)
    model.h[0].attn.c_attn.requires_grad_(False)
    groups = muon_param_groups(model)
    in_groups = {id(p) for g in groups for p in g["params"]}
    assert all(p.requires_grad for g in groups for p in g["params"])
    assert {id(p) for p in model.parameters() if p.requires_grad} == in_groups
    table = describe_param_groups(model, groups)
    assert "wpe.weight" in table and "frozen" in table


def test_hyperparameters_land_in_the_right_group_and_muon_accepts_them():
    model = GPTLike()
    groups = muon_param_groups(model, lr=0.05, adamw_lr=1e-3, weight_decay=0.1, adamw_weight_decay=0.01)
    muon, adamw = groups
    assert (muon["lr"], muon["weight_decay"], adamw["lr"], adamw["weight_decay"]) == (0.05, 0.1, 1e-3, 0.01)
    assert set(muon_param_groups(model)[0]) == {"params", "use_muon"}  # nothing set unless asked
    opt = Muon(groups, lr=0.02, adamw_lr=3e-4)
    assert [g["lr"] for g in opt.param_groups] == [0.05, 1e-3]  # a group's own keys win


def test_empty_groups_are_omitted():
    groups = muon_param_groups(nn.LayerNorm(4))
    assert len(groups) == 1 and groups[0]["use_muon"] is False
    groups = muon_param_groups(nn.Linear(4, 4, bias=False))
    assert len(groups) == 1 and groups[0]["use_muon"] is True
    assert muon_param_groups(nn.ReLU()) == []


def test_conv_kernels_go_to_muon():
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.Conv2d(8, 8, 3))
    routes = {r.name: r.use_muon for r in route_parameters(model)}
    assert routes == {"0.weight": True, "0.bias": False, "1.weight": False, "1.bias": False, "2.weight": True,
                      "2.bias": False}


def test_describe_param_groups_table():
    model = GPTLike()
    table = describe_param_groups(model, muon_param_groups(model))
    lines = table.splitlines()
    assert lines[0].split() == ["name", "shape", "numel", "group", "matrices", "reason"]
    row = next(line for line in lines if line.startswith("wte.weight"))
    assert "1:adamw" in row and "embedding (tied); also lm_head.weight" in row
    row = next(line for line in lines if line.startswith("h.0.c_fc.weight"))
    assert row.split()[1:4] == ["32x8", "256", "0:muon"]
    assert next(line for line in lines if line.startswith("scale")).split()[1] == "()"
    n_muon = sum(p.numel() for g in muon_param_groups(model) if g["use_muon"] for p in g["params"])
    assert lines[-1].startswith("totals:") and f"0:muon {n_muon:,} params" in lines[-1]
    # groups that disagree with the rules are reported as such
    custom = [{"params": [model.wpe.weight], "use_muon": True}]
    assert "set by caller" in describe_param_groups(model, custom)


LEAVES = st.sampled_from(["linear", "linear_nobias", "layernorm", "embedding", "conv", "scalar"])


def _leaf(kind: str) -> nn.Module:
    if kind == "scalar":
        m = nn.Module()
        m.gain = nn.Parameter(torch.ones(()))
        return m
    return {"linear": lambda: nn.Linear(4, 4), "linear_nobias": lambda: nn.Linear(4, 4, bias=False),
            "layernorm": lambda: nn.LayerNorm(4), "embedding": lambda: nn.Embedding(5, 4),
            "conv": lambda: nn.Conv1d(4, 4, 3)}[kind]()


@settings(max_examples=40, deadline=None)
@given(kinds=st.lists(st.lists(LEAVES, min_size=1, max_size=4), min_size=1, max_size=4),
       tie=st.booleans(), frozen=st.sets(st.integers(0, 15), max_size=4))
def test_every_trainable_parameter_is_in_exactly_one_group(kinds, tie, frozen):
    model = nn.ModuleList(nn.ModuleList(_leaf(k) for k in block) for block in kinds)
    model.append(nn.Embedding(5, 4))
    model.append(nn.Linear(4, 5, bias=False))
    if tie:
        model[-1].weight = model[-2].weight
    for i, p in enumerate(model.parameters()):
        if i in frozen:
            p.requires_grad_(False)
    groups = muon_param_groups(model)
    flat = [p for g in groups for p in g["params"]]
    assert len(flat) == len({id(p) for p in flat})
    assert {id(p) for p in flat} == {id(p) for p in model.parameters() if p.requires_grad}
    for g in groups:
        assert g["params"], "empty groups are omitted"
        if g["use_muon"]:
            assert all(p.ndim >= 2 for p in g["params"])
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    assert not any(id(p) in embeddings for g in groups if g["use_muon"] for p in g["params"])
    if flat:
        Muon(groups)  # and the optimizer accepts them
    else:  # every parameter frozen: nothing to optimize, as torch's own optimizers say
        with pytest.raises(ValueError, match="empty parameter list"):
            Muon(groups)
