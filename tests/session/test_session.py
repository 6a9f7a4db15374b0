"""The Lightning-free session: one plan handed down, a layout that does not fit refused.

* ``LayerwiseSession.wrap`` chooses the owner group size by planning the layout once, from the full
  specs (experts marked), and the wrapper uses that very plan: the wrapper's own planner is made to
  raise, and the run still equals one process holding every expert.
* A layout handed to ``LayerwiseDataParallel`` that was planned for another group size, bucket size or
  module is refused, naming what differs.
(The package's imports, with no circle and in their layers: ``test_layers.py``.)
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from _dist import LATE_MS, run_distributed
from helpers import (NUM_EXPERTS, global_names, moe_batches as batches, moe_gpt, moe_loss as loss_fn,
                     moe_optimizer as optimizer, moe_reference as reference, rel_err)

import lightning_layerwise as llw
from lightning_layerwise import session as session_module
from lightning_layerwise.engine import wrapper_setup
from lightning_layerwise.engine.wrapper_setup import layout_specs
from lightning_layerwise.layout import plan_layout

TOL = 1e-5  # float32 sums in another order over 10 steps (as tests/engine/test_experts.py)


def _plan_once_worker(rank: int, world: int, E: int, opt_name: str) -> dict:
    chosen = []
    choose = session_module.choose_owner_group_size

    def recording_choose(*args, **kwargs):
        g, layout = choose(*args, **kwargs)
        chosen.append(layout)
        return g, layout

    def no_second_plan(*args, **kwargs):
        raise AssertionError("the wrapper planned the layout again")

    session_module.choose_owner_group_size = recording_choose
    wrapper_setup.plan_layout = no_second_plan
    # Two "nodes" of two ranks: owner_group_size="auto" plans to choose (Note [choosing the owner group size]).
    env = dataclasses.replace(llw.SessionEnv.from_torch(), ranks_per_node=2)
    session = llw.LayerwiseSession(llw.LayerwiseConfig(bucket_size=4096, prefetch_depth=1, owner_group_size="auto",
                                                       expert_parallel_size=E), env)
    model = moe_gpt(E, session.expert_parallel_rank)
    opt = optimizer(opt_name, model)
    wrapped = session.wrap(model, opt)
    model.set_expert_group(session.groups.expert_parallel)
    for tokens in batches():
        opt.zero_grad()
        session.backward(loss_fn(wrapped, tokens.chunk(world)[rank]))
        session.step(opt)
    session.sync_parameters()
    layout = session.wrapper.layout
    out = {"handed_down": len(chosen) == 1 and layout is chosen[0], "owner_group_size": session.groups.owner_group_size,
           "expert_buffers": [b.shards for b in layout.buffers if b.kind == "expert"],
           "split": sorted(n for n, s in layout.params.items() if s.split),
           "params": global_names(model, session.expert_parallel_rank * (NUM_EXPERTS // E))}
    session.release()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("opt_name,late_ms", [("adamw", None), ("muon", None), ("adamw", LATE_MS)])
def test_the_session_plans_once_with_the_experts_and_equals_one_process(opt_name, late_ms):
    """``late_ms``: every collective up to that late (the session's step and backward over the timing fuzzer)."""
    results = run_distributed(_plan_once_worker, 4, 2, opt_name, late_ms=late_ms)
    ref = reference(opt_name)
    for rank, r in enumerate(results):
        assert r["handed_down"], f"rank {rank}: the wrapper did not use the plan the session chose"
        assert r["expert_buffers"] == [2], "experts planned over their 2 expert data-parallel ranks"
        for name, value in r["params"].items():
            assert rel_err(value, ref[name]) <= TOL, (opt_name, rank, name, rel_err(value, ref[name]))
    assert len({r["owner_group_size"] for r in results}) == 1
    if opt_name == "adamw":
        assert results[0]["split"], "element-wise fill split some AdamW parameter (the optimizer was seen)"


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


@pytest.mark.parametrize("case,match", [
    ("group size", r"planned for 2 ranks per owner group, not 1"),
    ("bucket size", r"planned with bucket_size=2048, not 1024"),
    ("module", r"planned for other parameters \(\['extra.weight'\] differ"),
    ("split", r"splits \['"),
    ("kind", r"planned with \['2.bias', '2.weight'\] in buffers of another kind"),
])
def test_a_layout_that_does_not_fit_the_wrapper_is_refused(case, match):
    model = _mlp()
    specs = layout_specs(model)
    if case == "group size":
        layout = plan_layout(specs, 2, 1024)
    elif case == "bucket size":
        layout = plan_layout(specs, 1, 2048)
    elif case == "module":
        other = _mlp()
        other.extra = nn.Linear(2, 2, bias=False)
        layout = plan_layout(layout_specs(other), 1, 1024)
    elif case == "kind":  # planned with the last layer as experts, handed to a wrapper without experts
        layout = plan_layout(layout_specs(model, expert=lambda n, p: n.startswith("2.")), 1, 1024)
    else:  # planned with every parameter element-wise at 2 ranks per group, handed to a wrapper owning whole
        layout = plan_layout(layout_specs(model, elementwise=lambda n, p: True), 2, 64)
        assert any(slot.split for slot in layout.params.values())
    kwargs = {"bucket_size": 64 if case == "split" else 1024}
    if case == "split":  # the group size check comes first: compare at the layout's own group size
        layout = dataclasses.replace(layout, group_size=1)
    with pytest.raises(ValueError, match=r"^LayerwiseDataParallel\(layout=\.\.\.\) does not fit: the layout was "
                                         + match):
        llw.LayerwiseDataParallel(model, llw.ProcessGroups.single(), layout=layout, **kwargs)


def test_settings_that_are_not_a_config_are_refused_naming_the_fix():
    """A dict of options (the strategies take keywords, the session a LayerwiseConfig) would fail much later, as an
    AttributeError on the first setting read."""
    with pytest.raises(TypeError, match=r"^LayerwiseSession\(config=\{'bucket_size': 4096\}\): config must be a "
                                        r"LayerwiseConfig \(got dict\); pass LayerwiseSession\(LayerwiseConfig\("
                                        r"\*\*options\)\), which checks every setting and names a misspelt one\.$"):
        llw.LayerwiseSession(dict(bucket_size=4096))
    with pytest.raises(TypeError, match=r"^LayerwiseSession\(config=4096\): config must be a LayerwiseConfig \(got "
                                        r"int\); pass LayerwiseSession\(LayerwiseConfig\(bucket_size=\.\.\.\)\)"):
        llw.LayerwiseSession(4096)
    assert llw.LayerwiseSession(llw.LayerwiseConfig(bucket_size=4096)).config.bucket_size == 4096
    assert llw.LayerwiseSession().config == llw.LayerwiseConfig()


def test_a_layout_planned_from_layout_specs_is_used_as_given():
    model = _mlp()
    layout = plan_layout(layout_specs(model), 1, 1024)
    wrapper = llw.LayerwiseDataParallel(model, llw.ProcessGroups.single(), bucket_size=1024, layout=layout)
    assert wrapper.layout is layout
    wrapper.release()


