"""Muon for matrices, AdamW for everything else, in one ``torch.optim.Optimizer``.

The maths comes first as plain functions without ``torch.distributed``
(:func:`muon_update`, :func:`adjust_lr_scale`, :func:`normuon_rows`, :func:`muon_step`;
Newton-Schulz itself is in ``optim/orthogonalization.py``); the :class:`Muon` class after
them only keeps state and routes each param group to the Muon or the AdamW rule.

Note [layer-wise stepping]
    The step touches only parameters whose ``.grad`` is not None, and creates
    state only for them. Under the layer-wise data-parallel wrapper each rank
    holds a gradient only for the parameters it owns, so each rank steps (and
    stores momentum for) exactly its own parameters: Newton-Schulz sees the
    whole matrix on one rank, and optimizer state exists once in the world.
    Nothing in this module knows about ranks; the wrapper decides by setting
    ``.grad`` or leaving it None.

Note [NorMuon]
    ``normuon=True`` follows NorMuon (Li, Liu, Liang, Chen, Zhao 2025, arXiv:2510.05491,
    Algorithm 1) after Newton-Schulz, per matrix of the view (Note [matrix views] in
    ``optim/matrices.py``): a float32 second moment per row (neuron),
    ``v <- beta2 v + (1 - beta2) mean_cols(O * O)``, the update ``O / (sqrt(v) + eps)``
    and the paper's step size ``0.2 lr sqrt(m n) / ||O_hat||_F``, which gives the update
    an RMS of ``0.2 lr`` as AdamW's, so NorMuon's ``lr`` is on AdamW's scale and
    ``adjust_lr`` does not apply (``"match_rms_adamw"`` and ``"spectral"`` are refused with
    it: Note [options that do nothing] in ``optim/muon_options.py``). Momentum and weight
    decay are Muon's (the paper's momentum is ``nesterov=False``). The state is
    ``second_moment``, one float32 per row of each matrix (``m`` for an ``m x n`` matrix,
    ``E m`` for a stack of E): under the layer-wise strategy it lives with the matrix's
    owner, as the momentum does, and checkpoints carry it by parameter name like any other
    state.

Note [defaults of the two group kinds]
    ``Optimizer.__init__`` fills every missing group key from ``defaults``, so
    a plain ``defaults["lr"]`` would hand the Muon lr to AdamW groups.
    :meth:`Muon.add_param_group` therefore fills an AdamW group's ``lr``,
    ``betas``, ``eps`` and ``weight_decay`` from the ``adamw_*`` arguments
    *before* the base class fills the rest. Both kinds keep their learning
    rate under the key ``"lr"``, so LR schedulers scale both.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any, Callable

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.optim.adamw import adamw as _functional_adamw

from .matrices import MATRICES_ATTRIBUTE, PLAIN, MatrixView, matrix_blocks, matrix_shapes
from .muon_options import (ADJUST_LR_MODES, DEFAULT_NS_BATCH_BYTES, AdjustLR, NSAlgorithm, NSCoefficients, NSDtype,
                           check_group, check_group_view, checked_defaults, param_label, resolve_dtype)
from .orthogonalization import ns_chunks, orthogonalize

__all__ = [
    "Muon",
    "adjust_lr_scale",
    "muon_step",
    "muon_update",
    "normuon_parts",
    "normuon_rows",
    "second_moment_size",
]

# ---------------------------------------------------------------------------
# Pure maths
# ---------------------------------------------------------------------------


def adjust_lr_scale(shape: Sequence[int], mode: AdjustLR | None = "original") -> float:
    """Factor multiplying the Muon lr for a parameter of ``shape`` (rows = shape[0]).

    A tensor with more than two dims counts as a ``(shape[0], prod(shape[1:]))`` matrix.

    - ``"original"``: ``sqrt(max(1, rows/cols))`` (Keller Jordan; torch's default).
    - ``"match_rms_adamw"``: ``0.2 * sqrt(max(rows, cols))`` (Moonshot), update RMS ~ AdamW's.
    - ``"spectral"``: ``sqrt(rows/cols)``, the spectral-norm scaling sqrt(fan_out/fan_in).
    - ``None``: 1.
    """
    if len(shape) < 2:
        raise ValueError(f"adjust_lr_scale needs a matrix shape; got {tuple(shape)}")
    rows, cols = int(shape[0]), math.prod(int(s) for s in shape[1:])
    if mode == "original":
        return math.sqrt(max(1, rows / cols))
    if mode == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    if mode == "spectral":
        return math.sqrt(rows / cols)
    if mode is None:
        return 1.0
    raise ValueError(f"adjust_lr={mode!r} is not supported; use one of {list(ADJUST_LR_MODES)}")


def muon_update(grad: Tensor, momentum_buffer: Tensor, momentum: float, nesterov: bool) -> Tensor:
    """Advance ``momentum_buffer`` in place and return the direction to orthogonalise.

    Follows torch (Note [parity with torch.optim.Muon] in ``optim/orthogonalization.py``):
    ``buf <- lerp(buf, grad, 1 - momentum)``; the direction is ``lerp(grad, buf, momentum)``
    with Nesterov, else ``buf``. ``grad`` is not modified. The EMA is ``(1 - momentum)`` times
    the classical ``buf = momentum * buf + grad``; Newton-Schulz normalises the scale away,
    so only the relative weight of grad and history matters.
    """
    momentum_buffer.lerp_(grad, 1 - momentum)
    return grad.lerp(momentum_buffer, momentum) if nesterov else momentum_buffer


def normuon_rows(O: Tensor, second_moment: Tensor, beta2: float, eps: float) -> Tensor:
    """NorMuon's per-neuron normalization of one orthogonalized matrix ``O`` (Li et al. 2025, arXiv:2510.05491,
    Algorithm 1), in float32: ``v <- beta2 v + (1 - beta2) mean_cols(O * O)`` in place (``second_moment``, one
    entry per row), then ``O_hat = O / (sqrt(v) + eps)`` scaled by ``0.2 sqrt(m n) / ||O_hat||_F``, the paper's
    RMS-matching step size (the learning rate is applied by the caller). See Note [NorMuon]."""
    normalized, scale = normuon_parts(O, second_moment, beta2, eps)
    return normalized.mul_(scale)


def normuon_parts(O: Tensor, second_moment: Tensor, beta2: float, eps: float) -> tuple[Tensor, Tensor]:
    """:func:`normuon_rows` before its last product: updates ``second_moment`` in place and returns ``(O / (sqrt(v)
    + eps), scale)``, the scale a 0-d float32 tensor. The update is their product, element by element, so a rank
    holding part of ``O`` and the updated ``v`` computes its part of it exactly from ``scale`` alone."""
    O = O.float()
    second_moment.lerp_(O.square().mean(dim=1), 1 - beta2)
    normalized = O / (second_moment.sqrt() + eps).unsqueeze(1)
    return normalized, 0.2 * math.sqrt(O.numel()) / torch.linalg.vector_norm(normalized).clamp(min=1e-30)


def _second_moment_rows(shapes: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """``[start, stop)`` of each matrix's rows in a parameter's NorMuon state (one float per row of each matrix)."""
    out, start = [], 0
    for rows, _ in shapes:
        out.append((start, start + rows))
        start += rows
    return out


def second_moment_size(shape: Sequence[int], view: MatrixView | None = None) -> int:
    """Elements of NorMuon's state for a parameter of ``shape``: one per row of each of its matrices."""
    return sum(rows for rows, _ in matrix_shapes(shape, view))


def muon_step(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    momentum_buffers: Sequence[Tensor],
    *,
    lr: float,
    momentum: float,
    nesterov: bool,
    weight_decay: float,
    ns_steps: int,
    ns_coefficients: NSCoefficients,
    ns_eps: float,
    ns_dtype: torch.dtype,
    adjust_lr: AdjustLR | None,
    batched: bool,
    ns_batch_bytes: int | None = None,
    ns_algorithm: NSAlgorithm = "standard",
    views: Sequence[MatrixView | None] | None = None,
    second_moments: Sequence[Tensor] | None = None,
    normuon_beta2: float = 0.95,
    normuon_eps: float = 1e-8,
) -> None:
    """One Muon step on lists of parameters (updated in place) and their momentum buffers.

    For each parameter: momentum (:func:`muon_update`), decoupled weight decay ``p *= 1 - lr*wd`` (with the
    unscaled lr, as torch), Newton-Schulz on each matrix of its view (``views[i]``, Note [matrix views]; ``None``:
    one ``(out, rest)`` matrix), then ``block -= lr * adjust_lr_scale(block shape) * O`` for each matrix. With
    ``second_moments`` (NorMuon, Note [NorMuon]) each ``O`` is normalized per row by :func:`normuon_rows` and the
    paper's step size replaces ``adjust_lr``. Matrices are processed one Newton-Schulz chunk at a time (at most
    ``ns_batch_bytes`` of stacked matrices; Note [chunked Newton-Schulz] in ``optim/orthogonalization.py``), each
    on the iteration ``ns_algorithm`` picks for its shape (Note [Gram Newton-Schulz] there); each matrix's update
    depends only on its own gradient and state, so the order changes nothing.
    """
    if not params:
        return
    views = list(views) if views is not None else [None] * len(params)
    entries: list[tuple[int, int]] = []  # (parameter, matrix of its view)
    keys = []
    shapes = [matrix_shapes(b.shape, v) for b, v in zip(momentum_buffers, views)]
    for i, b in enumerate(momentum_buffers):
        for j, shape in enumerate(shapes[i]):
            entries.append((i, j))
            keys.append((shape, b.dtype, b.device))
    left = [len(s) for s in shapes]
    rows = [_second_moment_rows(s) for s in shapes] if second_moments is not None else []
    directions: dict[int, list[Tensor]] = {}
    targets: dict[int, tuple[Tensor, list[Tensor]]] = {}
    for idx, stacked in ns_chunks(keys, ns_dtype, batched, ns_batch_bytes):
        # One chunk at a time: its temporaries (and a parameter's direction once its last matrix is done) are
        # dropped before the next chunk's are made.
        for e in idx:
            i = entries[e][0]
            if i not in directions:
                directions[i], target = _start_parameter(params[i], grads[i], momentum_buffers[i], shapes[i],
                                                         views[i], momentum, nesterov, lr * weight_decay)
                if target is not None:
                    targets[i] = target
        ortho = orthogonalize([directions[entries[e][0]][entries[e][1]] for e in idx], ns_steps, ns_coefficients,
                              ns_eps, ns_dtype, batched=stacked, algorithm=ns_algorithm)
        for e, O in zip(idx, ortho):
            i, j = entries[e]
            p, shape = params[i], shapes[i][j]
            if second_moments is not None:
                start, stop = rows[i][j]
                O, scaled_lr = normuon_rows(O, second_moments[i][start:stop], normuon_beta2, normuon_eps), lr
            else:
                scaled_lr = lr * adjust_lr_scale(shape, adjust_lr)
            if i in targets:
                targets[i][1][j].add_(O, alpha=-scaled_lr)
            else:
                # A bf16 O added to an fp32 p is promoted exactly, as in torch.optim.Muon.
                p.add_(O.reshape(p.shape), alpha=-scaled_lr)
            left[i] -= 1
            if left[i] == 0:
                directions.pop(i)
                work, _ = targets.pop(i, (p, None))
                if work is not p:
                    p.copy_(work)
        del ortho


def _start_parameter(
    p: Tensor,
    grad: Tensor,
    momentum_buffer: Tensor,
    shapes: Sequence[tuple[int, int]],
    view: MatrixView | None,
    momentum: float,
    nesterov: bool,
    decay: float,
) -> tuple[list[Tensor], tuple[Tensor, list[Tensor]] | None]:
    """A parameter's part of :func:`muon_step` before its first Newton-Schulz chunk: momentum, then the decoupled
    weight decay ``p *= 1 - decay``. Returns the directions of its matrices (``shapes``, in view order) and, for a
    parameter of several matrices, the contiguous tensor its updates go into with its matrix blocks (``None``:
    the update is added to ``p`` itself)."""
    direction = muon_update(grad, momentum_buffer, momentum, nesterov)
    p.mul_(1 - decay)
    if len(shapes) == 1:
        # One matrix: the update is added to the parameter whole, whatever its strides (torch's path).
        return [direction.reshape(shapes[0])], None
    work = p if p.is_contiguous() else p.contiguous()
    return matrix_blocks(direction.contiguous(), view), (work, matrix_blocks(work, view))


def _split_names(params: list[Any]) -> tuple[list[Tensor], list[str | None]]:
    """Tensors and names of a group's params, which may be tensors or (name, tensor) pairs."""
    tensors, names = [], []
    for p in params:
        if isinstance(p, tuple) and len(p) == 2:
            names.append(p[0])
            tensors.append(p[1])
        else:
            names.append(None)
            tensors.append(p)
    return tensors, names


# ---------------------------------------------------------------------------
# The optimizer
# ---------------------------------------------------------------------------


class Muon(Optimizer):
    r"""Muon (MomentUm Orthogonalized by Newton-Schulz) for ``use_muon=True`` groups, AdamW for the rest.

    For a matrix parameter :math:`W` with gradient :math:`G`:

    .. math::
        B \leftarrow \mu B + (1-\mu) G, \quad
        D = \begin{cases} (1-\mu) G + \mu B & \text{nesterov} \\ B \end{cases}, \quad
        O = \mathrm{NS}_k(D), \quad
        W \leftarrow (1 - \eta\lambda) W - \eta\, s(W)\, O

    where :math:`\mathrm{NS}_k` is ``ns_steps`` Newton-Schulz iterations and :math:`s` the
    ``adjust_lr`` scale. Groups with ``use_muon=False`` run ``torch.optim.AdamW``'s update
    (its functional API) with state ``step``, ``exp_avg``, ``exp_avg_sq``.

    Args:
        params: parameters or param-group dicts. A plain iterable of tensors (or of
            ``(name, tensor)`` pairs) is split into a Muon group (``ndim >= 2``) and an
            AdamW group (the rest). A dict group without ``use_muon`` becomes a Muon
            group if all its params have ``ndim >= 2`` and an AdamW group if none has;
            a mixed group is rejected (split it or use :func:`muon_param_groups`).
        lr: Muon learning rate (before the ``adjust_lr`` scale).
        momentum: Muon momentum, in [0, 1).
        nesterov: use the Nesterov direction.
        weight_decay: decoupled weight decay of Muon groups (``p *= 1 - lr*wd``).
        ns_steps: Newton-Schulz iterations.
        ns_coefficients: ``"simple"``, ``"quintic"``, ``"polar_express"``, one ``(a, b, c)``
            triple for every step, or a per-step sequence of triples (the last repeats).
        ns_eps: floor of the Frobenius norm that normalises the input.
        ns_dtype: dtype of the iteration (bf16 is fast; float32 for exact tests).
        ns_algorithm: ``"standard"`` iterates on each matrix (op for op as ``torch.optim.Muon``);
            ``"gram"`` on its small Gram matrix ``X X^T`` (in float32); ``"auto"`` takes the Gram
            path where ``ns_dtype`` is bf16 and a matrix's longer side is at least twice its
            shorter (Note [Gram Newton-Schulz] in ``optim/orthogonalization.py``).
        adjust_lr: per-shape lr scale, see :func:`adjust_lr_scale`.
        adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay: AdamW group defaults;
            a group's own ``lr``/``betas``/``eps``/``weight_decay`` keys win.
        batched: orthogonalise same-shape matrices in one batched call.
        ns_batch_bytes: the most bytes of one such batched call's stack (in ``ns_dtype``);
            a larger same-shape batch runs in chunks, with bitwise the same result and a
            peak memory set by this budget instead of by the number of matrices
            (Note [chunked Newton-Schulz] in ``optim/orthogonalization.py``). ``None``: no limit, one stack per
            shape.
        normuon, normuon_beta2, normuon_eps: NorMuon's per-row normalization after
            Newton-Schulz (Note [NorMuon]); its ``lr`` is on AdamW's scale. ``None``: 0.95 and
            1e-8; a value needs ``normuon=True``.

    A setting that cannot take effect is refused (Note [options that do nothing] in
    ``optim/muon_options.py``): ``adjust_lr="match_rms_adamw"`` or ``"spectral"`` with NorMuon,
    ``normuon_beta2``/``normuon_eps`` without it, ``ns_batch_bytes`` with ``batched=False``, and
    a group key that its kind of group does not read.

    A Muon group's keys ``stack``, ``split`` and ``split_dim`` say how Newton-Schulz sees its
    parameters (Note [matrix views] in ``optim/matrices.py``); :func:`muon_param_groups` sets
    them from the model, and a plain iterable of tensors is grouped by the parameters'
    :func:`mark_matrices` marks. A ``>= 3``-D parameter in a group without ``stack`` is refused.
    """

    _whole_matrices: Callable[..., None] | None = None
    """Set by the strategy under tensor parallelism: steps a group's matrices with Newton-Schulz on the whole
    matrices (Note [tensor-parallel exchange] in ``engine/tp_exchange.py``)."""
    _global_shape: Callable[[Tensor], Sequence[int]] | None = None
    """Set with ``_whole_matrices``: a parameter's whole shape, which sizes its NorMuon state (one float per row of
    each whole matrix)."""

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]] | Iterable[tuple[str, Tensor]],
        lr: float = 0.02,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.0,
        ns_steps: int = 5,
        ns_coefficients: NSCoefficients = "simple",
        ns_eps: float = 1e-7,
        ns_dtype: NSDtype = torch.bfloat16,
        ns_algorithm: NSAlgorithm = "standard",
        adjust_lr: AdjustLR | None = "original",
        adamw_lr: float = 3e-4,
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float = 0.0,
        batched: bool = True,
        ns_batch_bytes: int | None = DEFAULT_NS_BATCH_BYTES,
        normuon: bool = False,
        normuon_beta2: float | None = None,
        normuon_eps: float | None = None,
    ) -> None:
        defaults = dict(
            lr=lr,
            momentum=momentum,
            nesterov=nesterov,
            weight_decay=weight_decay,
            ns_steps=ns_steps,
            ns_coefficients=ns_coefficients,
            ns_eps=ns_eps,
            ns_dtype=ns_dtype,
            ns_algorithm=ns_algorithm,
            adjust_lr=adjust_lr,
            adamw_lr=adamw_lr,
            adamw_betas=adamw_betas,
            adamw_eps=adamw_eps,
            adamw_weight_decay=adamw_weight_decay,
            batched=batched,
            ns_batch_bytes=ns_batch_bytes,
            normuon=normuon,
            normuon_beta2=normuon_beta2,
            normuon_eps=normuon_eps,
        )
        super().__init__(self._route_plain_params(params), checked_defaults(defaults))

    @staticmethod
    def _route_plain_params(params: Any) -> Any:
        """Split a plain iterable of tensors by ndim (the matrices by their :func:`mark_matrices` marks: one Muon
        group per view); pass dict groups through unchanged."""
        if isinstance(params, Tensor):
            params = [params]
        params = list(params)
        if not params or isinstance(params[0], dict):
            return params
        tensors, _ = _split_names(params)
        groups = groups_by_view((p, t, getattr(t, MATRICES_ATTRIBUTE, None)) for p, t in zip(params, tensors)
                                if t.ndim >= 2)
        groups.append({"params": [p for p, t in zip(params, tensors) if t.ndim < 2], "use_muon": False})
        return [g for g in groups if g["params"]]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group; see Note [defaults of the two group kinds] for how keys are filled."""
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, but got {type(param_group)}")
        gi = len(self.param_groups)
        where = f"Muon param group {gi}: "
        params = param_group["params"]
        if not isinstance(params, (Tensor, set)):
            param_group["params"] = params = list(params)  # a generator must survive two passes
        tensors, names = _split_names([params] if isinstance(params, Tensor) else list(params))
        use_muon = param_group.get("use_muon")
        if use_muon is None:
            is_matrix = [t.ndim >= 2 for t in tensors if isinstance(t, Tensor)]
            if any(is_matrix) and not all(is_matrix):
                i = is_matrix.index(False)
                raise ValueError(
                    f"{where}has no 'use_muon' key and mixes matrices (ndim >= 2) with parameters of "
                    f"ndim < 2 (parameter {i}{param_label(names[i])} has shape {tuple(tensors[i].shape)}); "
                    f"set 'use_muon' explicitly, split the group, or build the groups with muon_param_groups(model)"
                )
            use_muon = all(is_matrix)
        if not isinstance(use_muon, bool):
            raise ValueError(f"{where}use_muon={use_muon!r} is invalid: it must be True or False")
        param_group["use_muon"] = use_muon

        if use_muon:
            for i, t in enumerate(tensors):
                if isinstance(t, Tensor) and t.ndim < 2:
                    raise ValueError(
                        f"{where}parameter {i}{param_label(names[i])} has shape {tuple(t.shape)} (ndim={t.ndim}) but "
                        f"the group has use_muon=True; Newton-Schulz needs a matrix. Put it in a use_muon=False "
                        f"group or use muon_param_groups(model)"
                    )
            check_group_view(where, param_group, tensors, names)
        else:
            param_group.setdefault("lr", self.defaults["adamw_lr"])
            param_group.setdefault("betas", self.defaults["adamw_betas"])
            param_group.setdefault("eps", self.defaults["adamw_eps"])
            param_group.setdefault("weight_decay", self.defaults["adamw_weight_decay"])
        check_group(where, param_group, self.defaults)
        super().add_param_group(param_group)
        if "ns_dtype" in param_group:
            param_group["ns_dtype"] = resolve_dtype(where, param_group["ns_dtype"])

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One step over every parameter that has a ``.grad``; see Note [layer-wise stepping]."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["use_muon"]:
                self._step_muon(group)
            else:
                self._step_adamw(group)
        return loss

    def _params_with_grad(self, group: dict[str, Any]) -> list[Tensor]:
        out = []
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("Muon does not support sparse gradients")
            out.append(p)
        return out

    def _step_muon(self, group: dict[str, Any]) -> None:
        params = self._params_with_grad(group)
        if any(torch.is_complex(p) for p in params):
            raise RuntimeError("Muon does not support complex parameters")
        view = group_view(group)
        # A group loaded from a state dict saved before these keys existed lacks them: Muon as it was then.
        normuon = group.get("normuon", False)
        bufs, moments = [], []
        for p in params:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            bufs.append(state["momentum_buffer"])
            if normuon:
                if "second_moment" not in state:  # one float32 per row of each matrix (Note [NorMuon])
                    shape = p.shape if self._global_shape is None else self._global_shape(p)
                    state["second_moment"] = torch.zeros(second_moment_size(shape, view), dtype=torch.float32,
                                                         device=p.device)
                moments.append(state["second_moment"])
        if self._whole_matrices is not None:
            self._whole_matrices(params, [p.grad for p in params], bufs, group, view, moments if normuon else None)
            return
        muon_step(
            params,
            [p.grad for p in params],
            bufs,
            lr=group["lr"],
            momentum=group["momentum"],
            nesterov=group["nesterov"],
            weight_decay=group["weight_decay"],
            ns_steps=group["ns_steps"],
            ns_coefficients=group["ns_coefficients"],
            ns_eps=group["ns_eps"],
            ns_dtype=group["ns_dtype"],
            adjust_lr=group["adjust_lr"],
            batched=group["batched"],
            # A group loaded from a state dict saved before this key existed lacks it.
            ns_batch_bytes=group.get("ns_batch_bytes", self.defaults["ns_batch_bytes"]),
            ns_algorithm=group.get("ns_algorithm", "standard"),
            views=[view] * len(params),
            second_moments=moments if normuon else None,
            normuon_beta2=group.get("normuon_beta2", 0.95),
            normuon_eps=group.get("normuon_eps", 1e-8),
        )

    def _step_adamw(self, group: dict[str, Any]) -> None:
        params = self._params_with_grad(group)
        if not params:
            return
        exp_avgs, exp_avg_sqs, steps = [], [], []
        for p in params:
            state = self.state[p]
            if len(state) == 0:
                # Same keys, dtypes and devices as torch.optim.AdamW (step on CPU, fp32
                # unless the default dtype is fp64), so state bytes and checkpoints compare.
                scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
                state["step"] = torch.tensor(0.0, dtype=scalar)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        beta1, beta2 = group["betas"]
        _functional_adamw(
            params,
            [p.grad for p in params],
            exp_avgs,
            exp_avg_sqs,
            [],
            steps,
            foreach=None,
            has_complex=any(torch.is_complex(p) for p in params),
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )


def groups_by_view(entries: Iterable[tuple[Any, Tensor, MatrixView | None]]) -> list[dict[str, Any]]:
    """One Muon group per view from ``(param or (name, param), tensor, view)`` entries, in order of appearance
    (Note [matrix views]). A 2-D matrix without blocks joins the plain group, where it batches with the matrices
    of unsplit stacks; a group of 2-D matrices alone carries no view keys (and steps as before they existed). A
    ``None`` view of a ``>= 3``-D tensor stays unresolved, for :meth:`Muon.add_param_group` to refuse."""
    by_view: dict[MatrixView | None, list[tuple[Any, Tensor]]] = {}
    for item, tensor, view in entries:
        if tensor.ndim == 2 and (view is None or view.split is None):
            view = PLAIN
        by_view.setdefault(view, []).append((item, tensor))
    return [{"params": [item for item, _ in items], "use_muon": True,
             **({} if view == PLAIN and all(t.ndim == 2 for _, t in items) else view_keys(view))}
            for view, items in by_view.items()]


def view_keys(view: MatrixView | None) -> dict[str, Any]:
    """The Muon group keys that carry ``view`` (Note [matrix views]): ``stack``, ``split``, ``split_dim``."""
    if view is None:
        return {}
    return {"stack": view.stack, "split": view.split, "split_dim": view.split_dim}


def group_view(group: dict[str, Any]) -> MatrixView:
    """The :class:`MatrixView` of a Muon group's parameters, from its keys (:func:`view_keys`); a group without
    them (one of 2-D matrices, or loaded from a state dict that predates the keys) holds plain matrices, and a
    ``>= 3``-D parameter in it is one ``(size(0), rest)`` matrix, as before the keys existed."""
    if "stack" not in group and group.get("split") is None:
        return _LEGACY_VIEW
    stack = group.get("stack")
    return MatrixView(stack=True if stack is None else bool(stack), split=group.get("split"),
                      split_dim=group.get("split_dim", 0))


_LEGACY_VIEW = MatrixView(stack=False)
