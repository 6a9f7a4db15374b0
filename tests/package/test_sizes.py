"""The package's sizes, read from its source: modules, functions, each class's surface and how much only
forwards.

A module over 800 lines or a function over 80 (docstrings count) holds more than one reader keeps in mind.
A method whose body, docstring aside, is one call of a part's method (``return self.part.name(...)``) or a
property that returns a part's attribute is a second name for one thing (``docs/design.md``, "Where to start
reading"): the wrapper exposes its parts instead, and keeps only the entries of a step that users call.

A name a class inherits from a base outside the package (a Lightning ``Strategy`` hook, ``nn.Module.forward``)
implements that base's interface; it is neither counted in the class's surface nor as a delegation.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_layerwise"

MAX_MODULE_LINES = 800
MAX_FUNCTION_LINES = 80
MAX_NOTE_LINES = 25
MAX_DELEGATIONS = 5
MAX_CLASS_NAMES = 25


def modules() -> list[tuple[Path, str]]:
    return [(path, path.read_text()) for path in sorted(PACKAGE.rglob("*.py"))]


def _without_docstring(body: list[ast.stmt]) -> list[ast.stmt]:
    first = body[0] if body else None
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        return body[1:]
    return body


def _part_attribute(node: ast.expr) -> bool:
    """``self.<part>.<name>``."""
    return isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) \
        and isinstance(node.value.value, ast.Name) and node.value.value.id == "self"


def delegates(method: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """Whether ``method`` only forwards to a part: ``[return] self.<part>.<name>(...)``, or a property returning
    ``self.<part>.<name>``."""
    body = _without_docstring(method.body)
    if len(body) != 1 or not isinstance(body[0], (ast.Return, ast.Expr)) or body[0].value is None:
        return False
    value = body[0].value
    if isinstance(value, ast.Call):
        return _part_attribute(value.func)
    is_property = any(isinstance(d, ast.Name) and d.id == "property" for d in method.decorator_list)
    return is_property and isinstance(body[0], ast.Return) and _part_attribute(value)


def public_names(cls: ast.ClassDef) -> set[str]:
    """The public methods, properties and class attributes of ``cls``, and the public attributes its ``__init__``
    sets on ``self``."""
    names = set()
    for item in cls.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if not item.name.startswith("_"):
                names.add(item.name)
            if item.name == "__init__":
                for node in ast.walk(item):
                    targets = node.targets if isinstance(node, ast.Assign) else \
                        [node.target] if isinstance(node, ast.AnnAssign) else []
                    for target in targets:
                        for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) \
                                    and t.value.id == "self" and not t.attr.startswith("_"):
                                names.add(t.attr)
        elif isinstance(item, (ast.Assign, ast.AnnAssign)):
            for target in item.targets if isinstance(item, ast.Assign) else [item.target]:
                if isinstance(target, ast.Name) and not target.id.startswith("_"):
                    names.add(target.id)
    return names


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def inherited_names(path: Path, cls: ast.ClassDef) -> set[str]:
    """The names ``cls`` gets from its bases outside the package (none for a class not at module level)."""
    found = getattr(importlib.import_module(_module_name(path)), cls.name, None)
    if not isinstance(found, type) or found.__qualname__ != cls.name:
        return set()
    return {name for base in found.__mro__[1:] if not base.__module__.startswith(PACKAGE.name)
            and base is not object for name in vars(base)}


def package_classes() -> list[tuple[str, ast.ClassDef, set[str]]]:
    """Every class of the package: where it is, its syntax tree and the names it inherits from outside."""
    return [(f"{path.relative_to(PACKAGE)}:{node.name}", node, inherited_names(path, node))
            for path, source in modules() for node in ast.walk(ast.parse(source)) if isinstance(node, ast.ClassDef)]


def classes(name: str) -> list[ast.ClassDef]:
    return [node for _, source in modules() for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.ClassDef) and node.name == name]


def test_no_module_is_over_800_lines():
    long = {str(path.relative_to(PACKAGE)): n for path, source in modules()
            if (n := len(source.splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_no_function_is_over_80_lines():
    long = {}
    for path, source in modules():
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(PACKAGE)}:{node.name}"] = n
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_few_methods_in_the_package_only_forward_to_a_part():
    forwarding = [f"{where}.{item.name}" for where, cls, inherited in package_classes() for item in cls.body
                  if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name not in inherited
                  and delegates(item)]
    assert len(forwarding) <= MAX_DELEGATIONS, forwarding


def test_no_class_has_more_than_25_public_names():
    large = {where: sorted(names) for where, cls, inherited in package_classes()
             if len(names := public_names(cls) - inherited) > MAX_CLASS_NAMES}
    assert not large, f"classes with more than {MAX_CLASS_NAMES} public names: {large}"


def test_an_inherited_hook_is_not_counted():
    from lightning_layerwise.lightning.trainer import LayerwiseStrategy

    (where, cls, inherited), = [c for c in package_classes() if c[0] == "lightning/trainer.py:LayerwiseStrategy"]
    assert {"setup", "teardown", "optimizer_step"} <= inherited
    assert "setup" in public_names(cls) and "setup" in vars(LayerwiseStrategy)


def notes(source: str) -> list[tuple[str, int, int]]:
    """Every Note of a module: its name, the line it starts on and its length in lines (the heading, the
    indented text under it and the blank lines inside it)."""
    lines, found, i = source.splitlines(), [], 0
    while i < len(lines):
        heading = re.fullmatch(r"( *)Note \[(.+)\]\s*", lines[i])
        if not heading:
            i += 1
            continue
        indent, last, j = len(heading.group(1)), i, i + 1
        while j < len(lines):
            line = lines[j]
            if line.strip():
                if len(line) - len(line.lstrip()) <= indent:
                    break
                last = j
            j += 1
        found.append((heading.group(2), i + 1, last - i + 1))
        i = last + 1
    return found


def test_every_note_is_at_most_25_lines():
    long = {f"{path.relative_to(PACKAGE)}:{line} [{name}]": n for path, source in modules()
            for name, line, n in notes(source) if n > MAX_NOTE_LINES}
    assert not long, f"Notes over {MAX_NOTE_LINES} lines: {long}"


def test_the_measure_reads_a_note():
    source = '''"""Doc.

Note [one]
    First line.

    Second paragraph,
      indented.
"""
x = 1
'''
    assert notes(source) == [("one", 3, 5)]


def test_the_measure_finds_a_delegation():
    source = '''
class A:
    def f(self, x):
        """Doc."""
        return self.part.f(x)

    @property
    def g(self):
        return self.part.g

    def h(self):
        self.part.h()
        return 1
'''
    (cls,) = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef)]
    assert [m.name for m in cls.body if delegates(m)] == ["f", "g"]
