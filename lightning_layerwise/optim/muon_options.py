"""Muon's options: the values each accepts (the named Newton-Schulz schedules, the lr scales, the dtypes) and the
checks every argument and param-group key of :class:`~lightning_layerwise.optim.muon.Muon` passes before any step.
Each message names the argument (or the group and the key), the value and a fix.

Note [options that do nothing]
    A setting that cannot take effect is refused, not ignored: whoever set it expects it to act.

    * ``adjust_lr="match_rms_adamw"`` or ``"spectral"`` with ``normuon=True``: NorMuon's own step size (Note
      [NorMuon] in ``optim/muon.py``) replaces the per-shape scale. ``"original"`` (the default, which cannot be
      told from a value passed) and ``None`` (no scale: what NorMuon applies) are accepted.
    * ``normuon_beta2`` or ``normuon_eps`` without ``normuon=True``. Their defaults are ``None`` (meaning 0.95 and
      1e-8), so that a value passed is told from the default; the optimizer's ``defaults`` hold the numbers.
    * ``ns_batch_bytes`` other than its default with ``batched=False``: there is no stack to cap.
    * A group key that only the other kind of group reads (``momentum`` or ``ns_steps`` in an AdamW group,
      ``betas`` or ``eps`` in a Muon group), and an ``adamw_*`` key in a group (an argument of the optimizer; a
      group's own are ``lr``, ``betas``, ``eps`` and ``weight_decay``).

    Each pair is checked where the value without effect is set: the optimizer's arguments among themselves, and a
    group's own key against the settings in force for that group (its own, else the optimizer's). A group that
    turns NorMuon on, or batching off, overrides the optimizer's ``adjust_lr`` or ``ns_batch_bytes`` for itself
    only; those still act on the other groups, and that is accepted. A group key counts as the group's own when it
    differs from the optimizer's value of it: a group copied from an optimizer's ``param_groups``
    (``ZeroRedundancyOptimizer`` builds its local optimizer so) carries every key at the optimizer's value, and
    none of those is a choice.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal, Union

import torch
from torch import Tensor

from .matrices import MatrixView, check_view

__all__ = ["DEFAULT_NS_BATCH_BYTES", "GRAM_MIN_ASPECT", "NORMUON_DEFAULTS", "NS_ALGORITHMS", "NS_SCHEDULES",
           "check_group", "check_group_view", "checked_defaults", "resolve_ns_coefficients"]

Triple = tuple[float, float, float]
NSCoefficients = Union[str, Triple, Sequence[Triple]]
AdjustLR = Literal["original", "match_rms_adamw", "spectral"]
NSAlgorithm = Literal["standard", "gram", "auto"]
NSDtype = Union[torch.dtype, Literal["bfloat16", "float16", "float32", "float64"]]

# Per-step (a, b, c) of the odd quintic p(x) = a x + b x^3 + c x^5 applied to the
# singular values. A schedule shorter than ns_steps repeats its last triple.
NS_SCHEDULES: dict[str, tuple[Triple, ...]] = {
    # Keller Jordan's single triple (also torch.optim.Muon's default): steepest
    # slope at 0, converges to a band of roughly [0.7, 1.2] rather than to 1.
    "simple": ((3.4445, -4.7750, 2.0315),),
    # Per-step triples tuned by You Jiacheng, as used in KellerJordan/modded-nanogpt
    # train_gpt_medium.py (zeropower_via_newtonschulz5).
    "quintic": (
        (4.0848, -6.8946, 2.9270),
        (3.9505, -6.3029, 2.6377),
        (3.7418, -5.5913, 2.3037),
        (2.8769, -3.1427, 1.2046),
        (2.8366, -3.0525, 1.2012),
    ),
    # Polar Express (Amsel, Persson, Musco, Gower 2025, arXiv:2505.16932), the
    # five triples modded-nanogpt train_gpt.py ships ("num_iters=5,
    # safety_factor=2e-2, cushion=2"): minimax-optimal per step, so small
    # singular values are lifted much faster than by a fixed polynomial.
    "polar_express": (
        (8.156554524902461, -22.48329292557795, 15.878769915207462),
        (4.042929935166739, -2.808917465908714, 0.5000178451051316),
        (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
        (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
        (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
    ),
}

ADJUST_LR_MODES = ("original", "match_rms_adamw", "spectral", None)
# How Newton-Schulz iterates (Note [Gram Newton-Schulz] in optim/orthogonalization.py): on the matrix itself, on
# its Gram matrix, or on the Gram matrix in bf16 where the longer side is at least GRAM_MIN_ASPECT times the
# shorter.
NS_ALGORITHMS = ("standard", "gram", "auto")
GRAM_MIN_ASPECT = 2
# The most bytes one Newton-Schulz stack holds by default (Note [chunked Newton-Schulz] in
# optim/orthogonalization.py): 128 bf16 matrices of 1024x1024 or 2 of 8192x8192 per batched call, enough to amortise
# launches.
DEFAULT_NS_BATCH_BYTES = 2**28
DTYPE_NAMES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float64": torch.float64,
}


def resolve_ns_coefficients(coefficients: NSCoefficients, steps: int) -> tuple[Triple, ...]:
    """Expand a schedule name, one triple, or a list of triples to exactly ``steps`` triples.

    A schedule shorter than ``steps`` repeats its last triple; a longer one is cut.
    """
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"ns_steps={steps!r} is invalid: Newton-Schulz needs at least one iteration; pass ns_steps=5")
    if isinstance(coefficients, str):
        if coefficients not in NS_SCHEDULES:
            raise ValueError(
                f"ns_coefficients={coefficients!r} is not a known schedule; use one of "
                f"{sorted(NS_SCHEDULES)}, one (a, b, c) triple, or a sequence of triples"
            )
        schedule = NS_SCHEDULES[coefficients]
    else:
        try:
            seq = list(coefficients)
        except TypeError:
            seq = None
        if seq is not None and len(seq) == 3 and all(isinstance(v, (int, float)) for v in seq):
            schedule = (tuple(float(v) for v in seq),)
        elif seq and all(_is_triple(t) for t in seq):
            schedule = tuple(tuple(float(v) for v in t) for t in seq)
        else:
            raise ValueError(
                f"ns_coefficients={coefficients!r} is not a schedule name, an (a, b, c) triple of numbers "
                f"or a non-empty sequence of such triples; e.g. ns_coefficients='simple' or (3.4445, -4.775, 2.0315)"
            )
    return tuple(schedule[min(i, len(schedule) - 1)] for i in range(steps))  # type: ignore[misc]


def _is_triple(t: Any) -> bool:
    try:
        return len(t) == 3 and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in t)
    except TypeError:
        return False


NORMUON_DEFAULTS = {"normuon_beta2": 0.95, "normuon_eps": 1e-8}
"""What ``Muon(normuon_beta2=None, normuon_eps=None)``, the defaults, stand for (Note [options that do nothing])."""
_NORMUON_MEANING = {"normuon_beta2": "second-moment decay", "normuon_eps": "floor of the row normalization"}
_SCALES_NORMUON_REPLACES = ("match_rms_adamw", "spectral")
_MUON_KEYS = ("momentum", "nesterov", "ns_steps", "ns_coefficients", "ns_eps", "ns_dtype", "ns_algorithm",
              "adjust_lr", "batched", "ns_batch_bytes", "normuon", "normuon_beta2", "normuon_eps", "stack", "split",
              "split_dim")
_ADAMW_KEYS = ("betas", "eps")
_OPTIMIZER_KEYS = ("adamw_lr", "adamw_betas", "adamw_eps", "adamw_weight_decay")


def checked_defaults(defaults: Mapping[str, Any]) -> dict[str, Any]:
    """Checks every argument of ``Muon(...)``, given as its ``defaults``, and returns them resolved: ``ns_dtype`` a
    dtype, ``adamw_betas`` a tuple, ``normuon_beta2`` and ``normuon_eps`` numbers. Raises ``ValueError`` naming the
    argument, the value and a fix, before any param group is added."""
    where, d = "Muon: ", dict(defaults)
    check_nonneg(where, "lr", d["lr"], "0.02")
    check_momentum(where, d["momentum"])
    check_bool(where, "nesterov", d["nesterov"])
    check_nonneg(where, "weight_decay", d["weight_decay"], "0.0")
    check_ns(where, d["ns_coefficients"], d["ns_steps"])
    check_nonneg(where, "ns_eps", d["ns_eps"], "1e-7")
    d["ns_dtype"] = resolve_dtype(where, d["ns_dtype"])
    check_ns_algorithm(where, d["ns_algorithm"])
    check_adjust_lr(where, d["adjust_lr"])
    check_nonneg(where, "adamw_lr", d["adamw_lr"], "3e-4")
    check_betas(where, "adamw_betas", d["adamw_betas"])
    d["adamw_betas"] = tuple(d["adamw_betas"])
    check_nonneg(where, "adamw_eps", d["adamw_eps"], "1e-8")
    check_nonneg(where, "adamw_weight_decay", d["adamw_weight_decay"], "0.0")
    check_bool(where, "batched", d["batched"])
    check_batch_bytes(where, d["ns_batch_bytes"])
    for key, default in NORMUON_DEFAULTS.items():
        if d[key] is None:
            d[key] = default
        elif d["normuon"] is False:
            raise _without_normuon(where, key, d[key])
    check_normuon(where, d["normuon"], d["normuon_beta2"], d["normuon_eps"])
    _check_in_force(where, d, set_here=("adjust_lr", "ns_batch_bytes"))
    return d


def check_group(where: str, group: Mapping[str, Any], defaults: Mapping[str, Any]) -> None:
    """Checks the keys a param group sets itself (the optimizer's ``defaults`` passed :func:`checked_defaults`), and
    refuses a key its kind of group does not read or that its other settings leave without effect (Note [options
    that do nothing])."""
    muon = group["use_muon"]
    _refuse_foreign_keys(where, group, defaults)
    if "lr" in group:
        check_nonneg(where, "lr", group["lr"], "0.02" if muon else "3e-4")
    if "weight_decay" in group:
        check_nonneg(where, "weight_decay", group["weight_decay"], "0.0")
    if not muon:
        check_betas(where, "betas", group["betas"])
        check_nonneg(where, "eps", group["eps"], "1e-8")
        return
    if "momentum" in group:
        check_momentum(where, group["momentum"])
    for key in ("nesterov", "batched"):
        if key in group:
            check_bool(where, key, group[key])
    if "ns_steps" in group or "ns_coefficients" in group:
        check_ns(where, group.get("ns_coefficients", defaults["ns_coefficients"]),
                 group.get("ns_steps", defaults["ns_steps"]))
    if "adjust_lr" in group:
        check_adjust_lr(where, group["adjust_lr"])
    if "ns_dtype" in group:
        resolve_dtype(where, group["ns_dtype"])
    if "ns_algorithm" in group:
        check_ns_algorithm(where, group["ns_algorithm"])
    if "ns_batch_bytes" in group:
        check_batch_bytes(where, group["ns_batch_bytes"])
    values = {**defaults, **group}  # the settings in force for this group
    if any(key in group for key in ("normuon", *NORMUON_DEFAULTS)):
        check_normuon(where, values["normuon"], values["normuon_beta2"], values["normuon_eps"])
    if not values["normuon"]:
        for key in NORMUON_DEFAULTS:
            if _own(group, key, defaults):
                raise _without_normuon(where, key, group[key])
    _check_in_force(where, values, [key for key in ("adjust_lr", "ns_batch_bytes") if _own(group, key, defaults)])


def _own(group: Mapping[str, Any], key: str, defaults: Mapping[str, Any]) -> bool:
    """Whether ``group`` sets ``key`` itself: holds it at another value than the optimizer's (Note [options that do
    nothing]: a copied group holds every key at the optimizer's value)."""
    if key not in group:
        return False
    value = group[key]
    if key == "ns_dtype" and isinstance(value, str):
        value = DTYPE_NAMES.get(value, value)
    return bool(value != defaults.get(key))


def _refuse_foreign_keys(where: str, group: Mapping[str, Any], defaults: Mapping[str, Any]) -> None:
    """A key that only the other kind of group reads, or an argument of the optimizer, set in a group."""
    muon = group["use_muon"]
    foreign = [key for key in (_ADAMW_KEYS if muon else _MUON_KEYS) if _own(group, key, defaults)]
    if foreign:
        listing = ", ".join(f"{key}={group[key]!r}" for key in foreign)
        if muon:
            raise ValueError(f"{where}a Muon group (use_muon=True) does not read {listing}: only AdamW groups do. "
                             "Drop the key, or put these parameters in a use_muon=False group.")
        raise ValueError(f"{where}an AdamW group (use_muon=False) does not read {listing}: only Muon groups do; "
                         "AdamW groups read 'lr', 'betas', 'eps' and 'weight_decay'. Drop the key, or put these "
                         "parameters in a use_muon=True group.")
    arguments = [key for key in _OPTIMIZER_KEYS if _own(group, key, defaults)]
    if arguments:
        key = arguments[0]
        raise ValueError(f"{where}{key}={group[key]!r} is an argument of Muon(...), which a group does not read; "
                         f"give the AdamW group its own {key.removeprefix('adamw_')!r} key instead, e.g. "
                         f"{{'params': ..., 'use_muon': False, {key.removeprefix('adamw_')!r}: {group[key]!r}}}.")


def _check_in_force(where: str, values: Mapping[str, Any], set_here: Sequence[str]) -> None:
    """Refuses a setting of ``set_here`` (those set at this level) that the others in force, ``values``, leave
    without effect (Note [options that do nothing])."""
    scale = values["adjust_lr"]
    if "adjust_lr" in set_here and values["normuon"] and scale in _SCALES_NORMUON_REPLACES:
        raise ValueError(
            f"{where}adjust_lr={scale!r} has no effect with normuon=True: NorMuon's step size, 0.2 * lr * "
            "sqrt(rows * cols) / ||O_hat||_F (an update RMS of 0.2 * lr, AdamW's scale), replaces the per-shape lr "
            "scale. With NorMuon leave adjust_lr at 'original' (the default) or None and give lr on AdamW's scale "
            f"(e.g. lr=0.01); or pass normuon=False to scale Muon's lr by {scale!r}.")
    budget = values["ns_batch_bytes"]
    if "ns_batch_bytes" in set_here and not values["batched"] and budget != DEFAULT_NS_BATCH_BYTES:
        raise ValueError(
            f"{where}ns_batch_bytes={budget!r} has no effect with batched=False: every matrix is orthogonalised "
            "alone, so there is no stack to cap. Pass batched=True to batch same-shape matrices within this budget, "
            f"or leave ns_batch_bytes at its default ({DEFAULT_NS_BATCH_BYTES}).")


def _without_normuon(where: str, key: str, value: Any) -> ValueError:
    return ValueError(f"{where}{key}={value!r} has no effect without normuon=True: it is NorMuon's "
                      f"{_NORMUON_MEANING[key]}. Pass normuon=True to use NorMuon, or leave {key} out.")


def check_ns_algorithm(where: str, value: Any) -> None:
    if not isinstance(value, str) or value not in NS_ALGORITHMS:
        raise ValueError(
            f"{where}ns_algorithm={value!r} is invalid: use 'standard' (iterate on the matrix, as torch.optim.Muon), "
            f"'gram' (iterate on its Gram matrix) or 'auto' (the Gram matrix in bf16 where the longer side "
            f"is at least {GRAM_MIN_ASPECT} times the shorter), e.g. ns_algorithm='auto'")


def check_bool(where: str, name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{where}{name}={value!r} is invalid: it must be True or False")


def check_nonneg(where: str, name: str, value: Any, example: str) -> None:
    if isinstance(value, Tensor):
        value = value.item()
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0:
        raise ValueError(f"{where}{name}={value!r} is invalid: it must be a number >= 0, e.g. {name}={example}")


def check_momentum(where: str, value: Any) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0.0 <= value < 1.0:
        raise ValueError(f"{where}momentum={value!r} is invalid: it must lie in [0, 1), e.g. momentum=0.95")


def check_betas(where: str, name: str, value: Any) -> None:
    ok = False
    try:
        b1, b2 = value
        ok = all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0.0 <= b < 1.0 for b in (b1, b2))
    except (TypeError, ValueError):
        pass
    if not ok:
        raise ValueError(
            f"{where}{name}={value!r} is invalid: it must be two numbers in [0, 1), e.g. {name}=(0.9, 0.95)"
        )


def check_ns(where: str, coefficients: Any, steps: Any) -> None:
    try:
        resolve_ns_coefficients(coefficients, steps)
    except ValueError as err:
        raise ValueError(f"{where}{err}") from None


def check_batch_bytes(where: str, value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(
            f"{where}ns_batch_bytes={value!r} is invalid: it must be a whole number of bytes >= 1 (the most one "
            f"Newton-Schulz stack may hold) or None (no limit), e.g. ns_batch_bytes={DEFAULT_NS_BATCH_BYTES} "
            f"(256 MiB)"
        )


def check_adjust_lr(where: str, value: Any) -> None:
    if value not in ADJUST_LR_MODES:
        raise ValueError(f"{where}adjust_lr={value!r} is not supported; use one of {list(ADJUST_LR_MODES)}")


def resolve_dtype(where: str, value: Any) -> torch.dtype:
    if isinstance(value, str) and value in DTYPE_NAMES:
        return DTYPE_NAMES[value]
    if isinstance(value, torch.dtype) and value.is_floating_point:
        return value
    raise ValueError(
        f"{where}ns_dtype={value!r} is invalid: use a floating dtype, e.g. ns_dtype=torch.bfloat16 "
        f"(fast) or torch.float32 (exact); strings {sorted(DTYPE_NAMES)} are accepted too"
    )


def check_group_view(where: str, group: dict[str, Any], tensors: list[Any], names: list[str | None]) -> None:
    """A Muon group says how Newton-Schulz sees each ``>= 3``-D parameter (Note [matrix views]), and its view fits
    every parameter: raises before any step otherwise."""
    split = group.get("split")
    if isinstance(split, list):
        group["split"] = split = tuple(split)  # from YAML or JSON
    for i, t in enumerate(tensors):
        if not isinstance(t, Tensor):
            continue
        if t.ndim > 2 and group.get("stack") is None:
            raise ValueError(
                f"{where}parameter {i}{param_label(names[i])} has shape {tuple(t.shape)}: say how Newton-Schulz "
                "should see it. Build the groups with muon_param_groups(model) (a convolution's weight is one (out, "
                "in*k...) matrix, any other >= 3-D parameter a stack of matrices over its leading dimensions), mark it "
                "with lightning_layerwise.mark_matrices(param, stack=True) (a stack, e.g. grouped experts) or "
                "stack=False (a kernel), or set the group's 'stack' key.")
        if "stack" in group or split is not None:
            view = MatrixView(stack=bool(group.get("stack", True)), split=split, split_dim=group.get("split_dim", 0))
            check_view(view, tuple(t.shape), f"{where}parameter {i}{param_label(names[i])}")


def check_normuon(where: str, normuon: Any, beta2: Any, eps: Any) -> None:
    if not isinstance(normuon, bool):
        raise ValueError(f"{where}normuon={normuon!r} is invalid: it must be True or False")
    if not isinstance(beta2, (int, float)) or isinstance(beta2, bool) or not 0.0 <= beta2 < 1.0:
        raise ValueError(f"{where}normuon_beta2={beta2!r} is invalid: it must lie in [0, 1), e.g. normuon_beta2=0.95")
    check_nonneg(where, "normuon_eps", eps, "1e-8")


def param_label(name: str | None) -> str:
    return f" ({name!r})" if name else ""
