"""Which parameters Muon should orthogonalise and which AdamW should step.

Pure planning over a module's parameters: no optimizer, no ``torch.distributed``.

Note [routing rules]
    Muon is an optimizer for the weight matrices of hidden layers. Embeddings
    (a lookup is not a linear map of the activations), the output head, and
    every vector or scalar go to AdamW. Rules, first match wins, per parameter
    (a tied parameter is considered once, under every name it has):

    1. ``requires_grad=False``: left out of every group.
    2. a name matches a pattern of ``exclude`` (``fnmatch``): AdamW.
    3. the parameter has an attribute ``use_muon``: that value (True on a
       parameter with ndim < 2 is an error, Newton-Schulz needs a matrix).
    4. ``ndim < 2`` (biases, norm gains, scalars): AdamW.
    5. owned by an ``nn.Embedding``/``nn.EmbeddingBag``, including an output
       head whose weight is tied to the embedding: AdamW.
    6. the weight of the output head: an ``nn.Linear`` whose own name is one of
       ``HEAD_NAMES`` and whose path has no numeric component (so it is not
       inside a ModuleList/Sequential of repeated blocks), e.g. ``lm_head``,
       ``model.lm_head``, ``classifier``; but not ``blocks.3.attn.output``.
    7. everything else with ``ndim >= 2`` (Linear and conv weights): Muon.

    A head under another name is routed with ``exclude=("my_head.*",)`` or
    ``param.use_muon = False``. Each Muon parameter then gets its matrix view
    (Note [matrix views] in ``optim/matrices.py``); Muon parameters of one view
    share a group carrying the view's keys.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from .matrices import MatrixView, check_split, check_view, matrix_views
from .muon import group_view, groups_by_view

__all__ = ["HEAD_NAMES", "ParamRoute", "describe_param_groups", "muon_param_groups", "route_parameters"]

HEAD_NAMES: tuple[str, ...] = ("lm_head", "head", "output", "output_layer", "classifier")


@dataclass(frozen=True)
class ParamRoute:
    """Where one trainable parameter goes and which rule sent it there."""

    name: str
    param: Tensor
    use_muon: bool
    reason: str
    aliases: tuple[str, ...] = ()  # further names of a tied parameter
    view: MatrixView | None = None
    """How Newton-Schulz sees it (Muon parameters only; Note [matrix views])."""


def _is_head_path(path: str) -> bool:
    parts = path.split(".")
    return parts[-1] in HEAD_NAMES and not any(part.isdigit() for part in parts)


def _check_module(module: Any, caller: str) -> None:
    """Refuses what is not an ``nn.Module``, typically ``model.parameters()``: rules 2, 5 and 6 of Note [routing
    rules] need the parameters' names and the modules that own them, which an iterable of tensors does not carry,
    so routing it by ``ndim`` alone would silently send embeddings and the output head to Muon."""
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"{caller}(module=...) takes the model, an nn.Module (got {type(module).__name__}): the routing rules "
            "need the parameters' names and the modules holding them (embeddings and the output head go to AdamW), "
            f"which model.parameters() does not carry. Pass the module itself, {caller}(model), or build the groups "
            "by hand: [{'params': matrices, 'use_muon': True}, {'params': others, 'use_muon': False}]."
        )


def route_parameters(module: nn.Module, exclude: Sequence[str] = (),
                     split: Mapping[str, int | Sequence[int]] | None = None) -> list[ParamRoute]:
    """Apply Note [routing rules] to every trainable parameter of ``module``, in registration order.

    ``split`` maps name patterns (``fnmatch``) to a block count or block sizes along the rows of each matrix:
    ``{"*.c_attn.weight": 3}`` orthogonalizes a fused QKV as three matrices (Note [matrix views]); it wins over a
    :func:`mark_matrices` mark's split. A pattern of ``exclude`` that names no parameter of ``module``, or of
    ``split`` that names no parameter routed to Muon, is refused (a misspelt name would change nothing).
    """
    _check_module(module, "route_parameters")
    if isinstance(exclude, str):
        raise ValueError(f"exclude={exclude!r} is a string; pass a sequence of patterns, e.g. exclude=({exclude!r},)")
    split = _checked_split(split)
    views = matrix_views(module)
    names_of: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(name)
    every_name = [n for names in names_of.values() for n in names]
    unmatched = [pat for pat in exclude if not any(fnmatch.fnmatchcase(n, pat) for n in every_name)]
    if unmatched:
        raise ValueError(f"exclude={tuple(exclude)!r}: the pattern(s) {unmatched} match no parameter of "
                         f"{type(module).__name__}; the names are those of model.named_parameters() (a module's weight "
                         "is 'path.to.module.weight', so 'lm_head.*' matches an lm_head's parameters).")

    embedding_ids: set[int] = set()
    head_ids: set[int] = set()
    for path, sub in module.named_modules(remove_duplicate=False):
        if isinstance(sub, (nn.Embedding, nn.EmbeddingBag)):
            embedding_ids.update(id(p) for p in sub.parameters(recurse=False))
        elif isinstance(sub, nn.Linear) and _is_head_path(path):
            head_ids.add(id(sub.weight))

    routes = []
    for name, p in module.named_parameters():  # deduplicated: a tied tensor once
        if not p.requires_grad:
            continue
        names = names_of[id(p)]
        aliases = tuple(n for n in names if n != name)
        matched = next((pat for pat in exclude for n in names if fnmatch.fnmatchcase(n, pat)), None)
        flag = getattr(p, "use_muon", None)
        if matched is not None:
            use_muon, reason = False, f"exclude {matched!r}"
        elif flag is not None:
            if flag and p.ndim < 2:
                raise ValueError(
                    f"parameter {name!r} has use_muon=True but shape {tuple(p.shape)} (ndim={p.ndim}); Newton-Schulz "
                    f"needs a matrix. Remove the attribute or set it to False"
                )
            use_muon, reason = bool(flag), f"attribute use_muon={bool(flag)}"
        elif p.ndim < 2:
            use_muon, reason = False, f"ndim={p.ndim}"
        elif id(p) in embedding_ids:
            use_muon, reason = False, "embedding" + (" (tied)" if aliases else "")
        elif id(p) in head_ids:
            use_muon, reason = False, "output head"
        else:
            use_muon, reason = True, "hidden matrix"
        view = None
        if use_muon:
            view = views[id(p)]
            pattern = next((pat for pat in split for n in names if fnmatch.fnmatchcase(n, pat)), None)
            if pattern is not None:
                view = MatrixView(stack=view.stack, split=split[pattern], split_dim=0)
                check_view(view, tuple(p.shape), f"split[{pattern!r}] on parameter {name!r}")
        routes.append(ParamRoute(name, p, use_muon, reason, aliases, view))
    unused = [pat for pat in split if not any(fnmatch.fnmatchcase(n, pat) for r in routes if r.use_muon
                                              for n in (r.name, *r.aliases))]
    if unused:
        raise ValueError(f"split={split!r}: the pattern(s) {unused} match no parameter routed to Muon; check the "
                         "names with describe_param_groups(model, groups).")
    return routes


def _checked_split(split: Any) -> dict[str, int | tuple[int, ...]]:
    """``split`` as a dict of patterns to a block count or a tuple of sizes, each checked before any routing."""
    if split is None:
        return {}
    if not isinstance(split, Mapping):
        raise ValueError(f"split={split!r}: pass a mapping of parameter name patterns to a block count or block "
                         "sizes, e.g. split={'*.qkv.weight': 3}; to mark one parameter in the model, use "
                         "lightning_layerwise.mark_matrices(module, 'weight', split=3).")
    checked = {}
    for pattern, blocks in split.items():
        if not isinstance(pattern, str):
            raise ValueError(f"split={split!r}: the key {pattern!r} is not a name pattern (a string such as "
                             "'*.qkv.weight').")
        blocks = tuple(blocks) if isinstance(blocks, (list, tuple)) else blocks
        check_split(blocks, f"split[{pattern!r}]")
        checked[pattern] = blocks
    return checked


def muon_param_groups(
    module: nn.Module,
    exclude: Sequence[str] = (),
    lr: float | None = None,
    adamw_lr: float | None = None,
    weight_decay: float | None = None,
    adamw_weight_decay: float | None = None,
    split: Mapping[str, int | Sequence[int]] | None = None,
) -> list[dict[str, Any]]:
    """Param groups for :class:`~lightning_layerwise.optim.Muon` following Note [routing rules].

    Returns ``[{"params": [...], "use_muon": True}, {"params": [...], "use_muon": False}]``
    without empty groups; Muon parameters with another matrix view than one plain matrix (a
    stack, blocks; Note [matrix views]) get a Muon group per view, with the view's keys
    (``stack``, ``split``, ``split_dim``). ``split`` maps name patterns to row blocks (see
    :func:`route_parameters`). ``lr``/``weight_decay`` are written into the Muon groups and
    ``adamw_lr``/``adamw_weight_decay`` into the AdamW group (as ``"lr"``/``"weight_decay"``)
    when given; otherwise the optimizer's defaults apply.
    """
    _check_module(module, "muon_param_groups")
    routes = route_parameters(module, exclude, split)
    muons = groups_by_view((r.param, r.param, r.view) for r in routes if r.use_muon)
    adamw: dict[str, Any] = {"params": [r.param for r in routes if not r.use_muon], "use_muon": False}
    for group in muons:
        if lr is not None:
            group["lr"] = lr
        if weight_decay is not None:
            group["weight_decay"] = weight_decay
    if adamw_lr is not None:
        adamw["lr"] = adamw_lr
    if adamw_weight_decay is not None:
        adamw["weight_decay"] = adamw_weight_decay
    return [g for g in (*muons, adamw) if g["params"]]


def describe_param_groups(module: nn.Module, groups: Iterable[dict[str, Any]], exclude: Sequence[str] = ()) -> str:
    """A table of every parameter of ``module``: name, shape, the group it is in, and why.

    ``groups`` may be any param groups (dicts with ``params`` and optionally ``use_muon``);
    the reason column comes from :func:`route_parameters` with ``exclude`` and reads
    ``"set by caller"`` where the groups disagree with the rules.
    """
    _check_module(module, "describe_param_groups")
    where: dict[int, tuple[int, str]] = {}
    groups = list(groups)
    for gi, g in enumerate(groups):
        params = [g["params"]] if isinstance(g["params"], Tensor) else list(g["params"])
        kind = {True: "muon", False: "adamw"}.get(g.get("use_muon"), "?")  # type: ignore[arg-type]
        for p in params:
            where[id(p[1] if isinstance(p, tuple) else p)] = (gi, kind)
    rules = {id(r.param): r for r in route_parameters(module, exclude)}

    rows = [("name", "shape", "numel", "group", "matrices", "reason")]
    totals: dict[str, int] = {}
    for name, p in module.named_parameters():
        gi, kind = where.get(id(p), (None, "-"))
        rule = rules.get(id(p))
        if gi is None:
            reason = "frozen" if not p.requires_grad else "not in any group"
        elif rule is not None and kind == ("muon" if rule.use_muon else "adamw"):
            reason = rule.reason
        else:
            reason = "set by caller"
        if rule is not None and rule.aliases:
            reason += f"; also {', '.join(rule.aliases)}"
        label = f"{gi}:{kind}" if gi is not None else "-"
        matrices = "-"
        if kind == "muon":
            matrices = group_view(groups[gi]).describe(tuple(p.shape))
        rows.append((name, "x".join(map(str, p.shape)) or "()", str(p.numel()), label, matrices, reason))
        totals[label] = totals.get(label, 0) + p.numel()
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append("totals: " + ", ".join(f"{k} {v:,} params" for k, v in sorted(totals.items())))
    return "\n".join(lines)
