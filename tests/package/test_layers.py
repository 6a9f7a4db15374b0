"""The package's layers, read from its source: no import circle, Lightning only in ``lightning/``, and no
module importing a layer above its own (``docs/design.md``, "Module map").

Every import counts in all three checks, at module level, inside functions (a run-time import closes a circle
as surely as one at the top) and under ``if TYPE_CHECKING:``. A type-only import never runs, but a circle
through it is still two modules that each need the other to be read, and a type-only import from a layer above
makes the lower one know the upper's classes (or Lightning's). Where a module needs the type of one that
imports it, it describes what it uses in a ``Protocol`` of its own (``CheckpointHost`` in
``checkpoint/formats.py``, ``CheckpointedSession`` in ``checkpoint/checkpoints.py``, ``Releasing`` in
``engine/release.py``). Importing a submodule also runs its packages' ``__init__``, which this walk leaves out:
it follows the modules named.
"""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_layerwise"

LAYERS = ["base", "layout", "engine", "checkpoint", "session", "lightning", "entry"]
"""Bottom to top: a module may import its own layer and those below it."""

_LAYER_OF = {
    "optim": "base", "experts": "base",
    "layout": "layout",
    "engine": "engine",
    "checkpoint": "checkpoint",
    "config": "session", "session": "session", "session_checkpoints": "session",
    "lightning": "lightning",
    "testing": "entry", "__init__": "entry", "__main__": "entry", "layout_cli": "entry",
}


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> str:
    parts = module.split(".")
    return _LAYER_OF[parts[1] if len(parts) > 1 else "__init__"]


def imports_of(path: Path, root: Path, modules: set[str]) -> list[tuple[str, int]]:
    """``(module, line)`` for every import in ``path``, type-only ones included: package modules resolved, others
    as written."""
    tree = ast.parse(path.read_text())
    here = module_name(path, root)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            for alias in node.names:  # ``from pkg import submodule`` names the submodule
                sub = f"{target}.{alias.name}"
                found.append((sub if sub in modules else target, node.lineno))
    return found


def import_graph(root: Path) -> tuple[dict[str, dict[str, int]], dict[str, list[tuple[str, int]]]]:
    """The package's modules -> {package module imported: line}, and every import of each, as written."""
    files = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    graph: dict[str, dict[str, int]] = {}
    raw: dict[str, list[tuple[str, int]]] = {}
    for name, path in files.items():
        raw[name] = imports_of(path, root, set(files))
        graph[name] = {target: line for target, line in raw[name] if target in files and target != name}
    return graph, raw


def find_cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    """One import circle as a list of modules (first == last), or ``None``."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in graph[node]:
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            cycle = visit(start)
            if cycle:
                return cycle
    return None


def violations(root: Path) -> list[str]:
    graph, raw = import_graph(root)
    problems = []
    cycle = find_cycle(graph)
    if cycle:
        problems.append("import circle: " + " -> ".join(cycle))
    for module, imports in raw.items():
        inside_lightning = layer_of(module) in ("lightning", "entry") and ".lightning" in module
        for target, line in imports:
            if (target == "lightning" or target.startswith("lightning.")) and not inside_lightning:
                problems.append(f"{module}:{line} imports {target}: only lightning_layerwise.lightning may")
        for target, line in graph[module].items():
            if LAYERS.index(layer_of(target)) > LAYERS.index(layer_of(module)):
                problems.append(f"{module}:{line} ({layer_of(module)}) imports {target} ({layer_of(target)}), "
                                "a layer above its own")
    return problems


def test_the_package_has_no_import_circle_and_keeps_its_layers():
    assert violations(PACKAGE) == []


def test_every_module_has_a_layer():
    graph, _ = import_graph(PACKAGE)
    for module in graph:
        assert layer_of(module) in LAYERS, module


@pytest.mark.parametrize("mutation, expected", [
    # a run-time import from the planner up into the engine, which imports the planner: a circle
    (("layout/plan.py", "def aligned(", "def aligned(", "    from ..engine import buffers  # noqa: F401\n"),
     ["import circle", "(layout) imports lightning_layerwise.engine.buffers (engine), a layer above"]),
    # a type-only import of the wrapper by a module it imports: a circle, however the import is guarded
    (("engine/live_wrappers.py", "def any_live(", "def any_live(",
      "    if TYPE_CHECKING:\n        from .data_parallel import LayerwiseDataParallel  # noqa: F401\n"),
     ["import circle", "lightning_layerwise.engine.live_wrappers"]),
    # Lightning imported by the engine
    (("engine/clip.py", "def grad_norm(", "def grad_norm(", "    import lightning.pytorch  # noqa: F401\n"),
     ["lightning_layerwise.engine.clip", "imports lightning.pytorch: only lightning_layerwise.lightning may"]),
])
def test_the_walk_finds_an_upward_import(tmp_path, mutation, expected):
    """The check can fail: the same walk over a copy of the package with one import added."""
    copy = tmp_path / "lightning_layerwise"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    file, anchor, _, added = mutation
    path = copy / file
    text = path.read_text()
    start = text.index(anchor)
    body = text.index("\n", text.index(":\n", start) + 1) + 1  # after the signature's line
    docstring_end = text.index('"""', text.index('"""', start) + 3) + 3 if text[body:].lstrip().startswith('"""') \
        else body
    insert_at = text.index("\n", docstring_end) + 1 if docstring_end != body else body
    path.write_text(text[:insert_at] + added + text[insert_at:])
    found = "\n".join(violations(copy))
    for part in expected:
        assert part in found, found
