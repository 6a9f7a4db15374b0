"""How Newton-Schulz sees a parameter: one matrix, a stack of matrices, and blocks of each.

Pure shape logic over tensors and modules: no optimizer state, no ``torch.distributed``.

Note [matrix views]
    Muon orthogonalizes matrices, and a parameter is not always one matrix.

    * **A stack.** Grouped experts keep one ``[E, d_out, d_in]`` parameter: E matrices, each orthogonalized on
      its own (the ``(E, d_out * d_in)`` flattening would mix the experts' singular directions).
    * **A convolution kernel** ``(out, in, k...)`` is one ``(out, in * k...)`` matrix (Keller Jordan's and
      torch's rule).
    * **Blocks.** A fused QKV ``[3d, d]`` is three matrices, a projection of ``h`` heads ``h`` row blocks:
      ``split`` cuts each matrix into blocks along ``split_dim`` (0: rows, 1: columns), equal or sized.

    The rule, per parameter with ``ndim >= 2`` (:func:`matrix_views`), first match wins:

    1. a mark set by :func:`mark_matrices`, on the parameter's module or on the parameter;
    2. the weight of an ``nn.Conv1d/2d/3d`` (or a transposed one): one flattened matrix;
    3. ``ndim >= 3``: a stack over the leading ``ndim - 2`` dimensions;
    4. ``ndim == 2``: one matrix.

    A raw ``F.conv2d`` kernel is a stack under rule 3; mark it ``mark_matrices(w, stack=False)``. Every matrix of
    a view is orthogonalized, scaled (``adjust_lr`` by its own shape) and normalized (NorMuon, per row) on its
    own; matrices of one shape batch together (Note [batched Newton-Schulz] in ``optim/orthogonalization.py``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor, nn

__all__ = ["MATRICES_ATTRIBUTE", "MatrixView", "mark_matrices", "matrix_blocks", "matrix_shapes", "matrix_views",
           "view_of"]

MATRICES_ATTRIBUTE = "llw_matrices"
"""The attribute :func:`mark_matrices` sets on a parameter."""


@dataclass(frozen=True)
class MatrixView:
    """Which matrices Newton-Schulz sees in a parameter (Note [matrix views])."""

    stack: bool = True
    """The leading ``ndim - 2`` dimensions of a ``>= 3``-D parameter index a stack of matrices; ``False``: the
    parameter is one ``(size(0), rest)`` matrix, as a convolution kernel. No effect on a 2-D parameter."""
    split: int | tuple[int, ...] | None = None
    """Cut each matrix into this many equal blocks, or into blocks of these sizes, along ``split_dim``."""
    split_dim: int = 0
    """0: rows (an ``nn.Linear`` weight's output features), 1: columns."""

    def describe(self, shape: Sequence[int]) -> str:
        """``"8 x 64x128"``-style text: how many matrices of which shape (``describe_param_groups``)."""
        counts: dict[tuple[int, int], int] = {}
        for s in matrix_shapes(shape, self):
            counts[s] = counts.get(s, 0) + 1
        text = ", ".join(f"{n} x {m}x{k}" if n > 1 else f"{m}x{k}" for (m, k), n in counts.items())
        return text + (" (flattened)" if len(shape) > 2 and not self.stack else "")


PLAIN = MatrixView()


def _block_sizes(length: int, split: int | tuple[int, ...] | None) -> tuple[int, ...]:
    if split is None:
        return (length,)
    if isinstance(split, int):
        return (length // split,) * split
    return tuple(split)


def check_view(view: MatrixView, shape: Sequence[int], what: str) -> None:
    """Raises ``ValueError`` naming ``what`` if ``view`` does not fit a parameter of ``shape``."""
    if len(shape) < 2:
        raise ValueError(f"{what} has shape {tuple(shape)}: a matrix view needs a parameter with ndim >= 2.")
    if not isinstance(view.stack, bool):
        raise ValueError(f"{what}: stack={view.stack!r} must be True (a stack over the leading dimensions) or False "
                         "(one (size(0), rest) matrix, as a convolution kernel).")
    if isinstance(view.split_dim, bool) or view.split_dim not in (0, 1):
        raise ValueError(f"{what}: split_dim={view.split_dim!r} must be 0 (rows) or 1 (columns).")
    if view.split is None:
        return
    check_split(view.split, what)
    length = _matrix_shape(shape, view.stack)[view.split_dim]
    split, side = view.split, ("rows", "columns")[view.split_dim]
    if isinstance(split, int) and length % split:
        raise ValueError(f"{what} has shape {tuple(shape)}: its {side} ({length}) do not split into {split} equal "
                         f"blocks; pass a count that divides {length} or the block sizes as a tuple.")
    if isinstance(split, tuple) and sum(split) != length:
        raise ValueError(f"{what} has shape {tuple(shape)}: split={split!r} must be positive sizes adding up to its "
                         f"{length} {side}.")


def check_split(split: object, what: str) -> None:
    """Raises ``ValueError`` naming ``what`` unless ``split`` is a block count >= 1 or a non-empty tuple of block
    sizes >= 1 (whatever the parameter's shape)."""
    counts = split if isinstance(split, tuple) else (split,)
    if not counts or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in counts):
        raise ValueError(f"{what}: split={split!r} must be a number of equal blocks >= 1 (e.g. split=3 for a fused "
                         "QKV, split=n_heads for per-head blocks) or a tuple of block sizes >= 1.")


def _matrix_shape(shape: Sequence[int], stack: bool) -> tuple[int, int]:
    if len(shape) > 2 and not stack:
        return int(shape[0]), math.prod(int(s) for s in shape[1:])
    return int(shape[-2]), int(shape[-1])


def matrix_shapes(shape: Sequence[int], view: MatrixView | None = None) -> list[tuple[int, int]]:
    """The shape of every matrix Newton-Schulz sees in a parameter of ``shape``, in :func:`matrix_blocks` order."""
    view = view or PLAIN
    m, n = _matrix_shape(shape, view.stack)
    count = math.prod(int(s) for s in shape[:-2]) if len(shape) > 2 and view.stack else 1
    if view.split_dim == 0:
        blocks = [(s, n) for s in _block_sizes(m, view.split)]
    else:
        blocks = [(m, s) for s in _block_sizes(n, view.split)]
    return blocks * count


def matrix_blocks(tensor: Tensor, view: MatrixView | None = None) -> list[Tensor]:
    """The matrices of ``tensor`` (a parameter, its gradient or its update) as 2-D views of it, in stack order then
    block order. ``tensor`` must be viewable as ``(count, m, n)`` (contiguous, as parameters are)."""
    view = view or PLAIN
    m, n = _matrix_shape(tensor.shape, view.stack)
    stacked = tensor.view(-1, m, n)
    sizes = _block_sizes((m, n)[view.split_dim], view.split)
    return [block for matrix in stacked for block in matrix.split(sizes, dim=view.split_dim)]


def mark_matrices(target: Tensor | nn.Module, name: str | None = None, *, stack: bool = True,
                  split: int | Sequence[int] | None = None, split_dim: int = 0) -> Tensor | nn.Module:
    """Marks how Newton-Schulz should see a parameter (Note [matrix views]) and returns ``target``.

    ``target``: the module holding the parameter and ``name`` its name there (``mark_matrices(attn.qkv,
    "weight", split=3)``; kept by ``copy.deepcopy``), or the parameter itself (``mark_matrices(attn.qkv.weight,
    split=3)``; torch copies no attribute of a parameter, so a deep copy of the model loses this form).
    ``stack``: the leading dimensions of a ``>= 3``-D parameter index a stack of matrices (the default for such a
    parameter outside a convolution); ``False`` makes it one ``(size(0), rest)`` matrix. ``split``: cut each
    matrix into that many equal blocks, or blocks of those sizes, along ``split_dim`` (0 rows, 1 columns), e.g.
    ``split=3`` for a fused QKV or ``split=n_heads`` for per-head orthogonalization. ``muon_param_groups`` and the
    layer-wise layout read the mark.
    """
    view = MatrixView(stack=stack, split=tuple(split) if isinstance(split, (list, tuple)) else split,
                      split_dim=split_dim)
    if isinstance(target, nn.Module):
        param = target.get_parameter(name) if name is not None else None
        if param is None or "." in name:
            raise ValueError(f"mark_matrices({type(target).__name__}, name={name!r}): name one parameter of the "
                             "module itself, e.g. mark_matrices(attn.qkv, 'weight', split=3).")
        check_view(view, tuple(param.shape), f"mark_matrices({type(target).__name__}, {name!r})")
        target.__dict__.setdefault(MATRICES_ATTRIBUTE, {})[name] = view
        return target
    check_view(view, tuple(target.shape), "mark_matrices(param)")
    setattr(target, MATRICES_ATTRIBUTE, view)
    return target


_CONVOLUTIONS = (nn.modules.conv._ConvNd,)


def matrix_views(module: nn.Module) -> dict[int, MatrixView]:
    """``id(parameter)`` -> its :class:`MatrixView` by the rule of Note [matrix views], for every parameter of
    ``module`` with ``ndim >= 2`` (tied ones once)."""
    convolution_weights = {id(m.weight) for m in module.modules() if isinstance(m, _CONVOLUTIONS)}
    module_marks = {id(getattr(m, name)): view for m in module.modules()
                    for name, view in m.__dict__.get(MATRICES_ATTRIBUTE, {}).items()}
    views = {}
    for _, p in module.named_parameters():
        if p.ndim >= 2:
            views[id(p)] = module_marks.get(id(p)) or view_of(p, conv=id(p) in convolution_weights)
    return views


def view_of(param: Tensor, conv: bool = False) -> MatrixView:
    """One parameter's view by the rule of Note [matrix views]; ``conv``: it is a convolution module's weight."""
    mark = getattr(param, MATRICES_ATTRIBUTE, None)
    if mark is not None:
        return mark
    if conv:
        return MatrixView(stack=False)
    return PLAIN


def newton_schulz_flops(shapes: Sequence[tuple[int, int]], steps: int = 5) -> float:
    """Multiply-add flops of ``steps`` Newton-Schulz iterations on matrices of these shapes: each iteration is
    ``A = X X^T`` (``m^2 n``), ``B = bA + cA A`` (``m^3``) and ``B X`` (``m^2 n``) on the wide side (``m <= n``),
    at 2 flops per multiply-add."""
    total = 0.0
    for rows, cols in shapes:
        m, n = min(rows, cols), max(rows, cols)
        total += 2.0 * steps * (2 * m * m * n + m ** 3)
    return total
