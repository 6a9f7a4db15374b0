"""Every change the package makes to torch's and Lightning's objects goes through here.

Note [patches]
    The package replaces a few objects that are not its own while a run needs them, and only then: torch's
    clipping functions, ``get_total_norm``, ``nn.Module.zero_grad`` and Lightning's ``grad_norm`` while a
    gradient-utilities hold is alive (Note [gradient utilities] in ``engine/grad_utils.py``); the functions of
    ``torch.nn.init`` that skip meta tensors while a build is recorded (``engine/init_record.py``); and,
    from the Trainer strategy's ``setup`` to its ``teardown``, a method of each ``BaseFinetuning`` callback (for
    a fit) and the Trainer's profiler (with sharded parameters; ``lightning/trainer.py``). Each is registered
    once as a :class:`Patch`, by qualified name and with the scope that decides when it is in place
    (:func:`patched_functions` lists them all). A patch changes an object only through its methods, each
    returning the function that puts the original back:

    * :meth:`Patch.set_attribute` replaces an attribute (a module's function, a class's method, an instance's
      attribute); undoing restores the old value, or removes the attribute where the object had none of its
      own (an instance's method falls back to its class's);
    * :meth:`Patch.set_cell` replaces what a closure cell holds (torch's implementation behind its ``no_grad``
      wrapper), so that names bound before are covered;
    * :meth:`Patch.swap_code` replaces a function's code object (and defaults), for the same reason.

    A :class:`Scope` installs the patches added to it with its first hold and undoes them, last first, with
    its last. Nothing is patched by importing the package. Nothing here imports Lightning.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

Undo = Callable[[], None]
"""Puts back what one application of a patch replaced."""

When = Literal["gradient utilities", "init record", "trainer stage"]
"""A patch's scope: while a gradient-utilities hold is alive, while :func:`~.init_record.record_init` records,
or from the Trainer strategy's ``setup`` to its ``teardown``."""

_MISSING = object()


@dataclass(eq=False)
class Patch:
    """One patched object, by qualified name (``what``), in place only within its scope (``when``)."""

    what: str
    when: When
    applied: int = field(default=0, init=False)
    """How many applications are in place now (undone ones not counted)."""

    def set_attribute(self, owner: Any, name: str, value: Any) -> Undo:
        """``owner.name = value``; the undo restores ``owner``'s own value, or removes the one set here."""
        own = vars(owner).get(name, _MISSING)
        setattr(owner, name, value)

        def restore() -> None:
            if own is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, own)
        return self._applied(restore)

    def set_cell(self, cell: types.CellType, value: Any) -> Undo:
        """Replaces what closure ``cell`` holds; the undo puts the old content back."""
        old = cell.cell_contents
        cell.cell_contents = value

        def restore() -> None:
            cell.cell_contents = old
        return self._applied(restore)

    def swap_code(self, function: types.FunctionType, code: types.CodeType, defaults: tuple | None = None,
                  kwdefaults: dict | None = None) -> Undo:
        """Runs ``code`` (with ``defaults``, ``kwdefaults``) as ``function``; the undo puts the originals back."""
        saved = function.__code__, function.__defaults__, function.__kwdefaults__
        function.__code__, function.__defaults__, function.__kwdefaults__ = code, defaults, kwdefaults

        def restore() -> None:
            function.__code__, function.__defaults__, function.__kwdefaults__ = saved
        return self._applied(restore)

    def _applied(self, restore: Undo) -> Undo:
        self.applied += 1
        done = False

        def undo() -> None:
            nonlocal done
            if not done:
                done = True
                restore()
                self.applied -= 1
        return undo


_REGISTRY: dict[str, Patch] = {}


def register(what: str, when: When) -> Patch:
    """The patch of ``what`` (a qualified name), registered once; registering patches nothing."""
    patch = _REGISTRY.get(what)
    if patch is None:
        patch = _REGISTRY[what] = Patch(what, when)
    elif patch.when != when:
        raise ValueError(f"{what} is registered as patched during {patch.when!r}, not {when!r}")
    return patch


def patched_functions() -> list[str]:
    """Every object the package may patch, by qualified name, in the order registered (``docs/usage.md``)."""
    return list(_REGISTRY)


def patches() -> list[Patch]:
    """The registered patches, in the order registered."""
    return list(_REGISTRY.values())


def in_place() -> list[str]:
    """The patches in place now, by qualified name."""
    return [what for what, patch in _REGISTRY.items() if patch.applied]


class Scope:
    """Patches installed together with the first hold and undone together, last installed first, with the last
    release (:class:`~.grad_utils.GradientUtilities` counts the holds)."""

    def __init__(self) -> None:
        self._installs: list[Callable[[], Undo]] = []
        self._undo: list[Undo] = []
        self.holds = 0

    def add(self, install: Callable[[], Undo]) -> None:
        """``install()`` patches and returns its undo; run with the first hold, or at once while held."""
        self._installs.append(install)
        if self.holds:
            self._undo.append(install())

    def hold(self) -> None:
        if self.holds == 0:
            for install in self._installs:
                self._undo.append(install())
        self.holds += 1

    def release(self) -> None:
        self.holds -= 1
        if self.holds == 0:
            while self._undo:
                self._undo.pop()()


GRADIENT_UTILITIES = Scope()
"""The patches of Note [gradient utilities] (``engine/grad_utils.py``, ``lightning/grad_norm.py``)."""
