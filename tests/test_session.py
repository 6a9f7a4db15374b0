"""The Lightning-free session: one plan handed down, a layout that does not fit refused, no import cycle.

* ``LayerwiseSession.wrap`` chooses the owner group size by planning the layout once, from the full
  specs (experts marked), and the wrapper uses that very plan: the wrapper's own planner is made to
  raise, and the run still equals one process holding every expert.
* A layout handed to ``LayerwiseDataParallel`` that was planned for another group size, bucket size or
  module is refused, naming what differs.
* The package's module-level imports form no cycle (the precision plugins get the session's
  callables, not the strategy).
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch
from torch import nn

from _dist import LATE_MS, run_distributed
from test_experts import NUM_EXPERTS, batches, global_names, loss_fn, moe_gpt, optimizer, reference, rel_err

import lightning_layerwise as llw
from lightning_layerwise import data_parallel, session as session_module
from lightning_layerwise.data_parallel import layout_specs
from lightning_layerwise.layout import plan_layout

TOL = 1e-5  # float32 sums in another order over 10 steps (as tests/test_experts.py)


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
    data_parallel.plan_layout = no_second_plan
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
    out = {"handed_down": len(chosen) == 1 and layout is chosen[0], "owner_size": session.groups.owner_size,
           "expert_buffers": [b.dp for b in layout.buffers if b.kind == "expert"],
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
    assert len({r["owner_size"] for r in results}) == 1
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
        layout = dataclasses.replace(layout, dp=1)
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


def _module_imports(path: Path, package: str) -> set[str]:
    """The package modules ``path`` imports at module level (not under ``if TYPE_CHECKING``, not in functions)."""
    tree = ast.parse(path.read_text())
    parts = list(path.relative_to(ROOT).with_suffix("").parts)  # the module's package is parts[:-1]
    found = set()
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        nodes = [node] + ([n for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom))]
                          if isinstance(node, (ast.If, ast.Try)) else [])
        for n in nodes:
            if isinstance(n, ast.ImportFrom):
                if n.level:
                    base = parts[:len(parts) - n.level]
                    mod = ".".join(base + ([n.module] if n.module else []))
                    names = [mod] + [f"{mod}.{a.name}" for a in n.names]
                else:
                    names = [n.module or ""] + [f"{n.module}.{a.name}" for a in n.names]
                found.update(x for x in names if x.startswith(package))
            elif isinstance(n, ast.Import):
                found.update(a.name for a in n.names if a.name.startswith(package))
    return found


ROOT = Path(__file__).resolve().parents[1]


def test_the_package_has_no_import_cycle():
    package = ROOT / "lightning_layerwise"
    modules = {}
    for path in package.rglob("*.py"):
        rel = path.relative_to(ROOT).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.parts[-1] == "__init__" else rel.parts)
        modules[name] = path
    graph = {}
    for name, path in modules.items():
        deps = set()
        for target in _module_imports(path, "lightning_layerwise"):
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name and not name.startswith(target + ".") and target != "lightning_layerwise":
                deps.add(target)
        graph[name] = deps
    assert "lightning_layerwise.strategy" not in graph["lightning_layerwise.precision"]
    assert graph["lightning_layerwise.session"].isdisjoint({"lightning_layerwise.strategy",
                                                            "lightning_layerwise.fabric",
                                                            "lightning_layerwise.precision",
                                                            "lightning_layerwise.lightning_common"})
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(dep):] + [dep]))
            if dep not in state:
                visit(dep)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
