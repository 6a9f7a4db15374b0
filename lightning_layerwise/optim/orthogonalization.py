"""Newton-Schulz: the iteration that orthogonalizes Muon's update, on one matrix or a batch of same-shape ones.

:func:`newton_schulz_reference` is the per-matrix path, op for op as ``torch.optim.Muon``;
:func:`newton_schulz` the batched one over leading dims; :func:`orthogonalize` takes a list
of matrices, stacks those of one shape, dtype and device, and cuts a large stack into chunks
under a byte budget. Each casts to the iteration's dtype (``ns_dtype``) on the way in and
returns in it. :func:`newton_schulz_gram` is the same iteration run on the small Gram matrix,
chosen per shape by ``algorithm`` (Note [Gram Newton-Schulz]). The coefficient schedules are
Muon's options (``optim/muon_options.py``). Plain functions: nothing here knows of ranks or of
the optimizer's state.

Note [parity with torch.optim.Muon]
    The per-matrix path (:func:`newton_schulz_reference`, used when ``batched=False``
    or when a shape occurs once, with ``algorithm="standard"``, Muon's default)
    performs the same tensor operations in the same order as ``torch.optim.Muon``
    (2.13): cast to ``ns_dtype``, transpose tall matrices, divide by
    ``norm().clamp(min=eps)``, then ``addmm`` for ``b*A + c*A@A`` and for ``a*X + B@X``. With the same
    hyperparameters Muon's updates are therefore bit-identical on CPU in bf16;
    its momentum rule follows torch as well (``muon_update`` in ``optim/muon.py``).

Note [batched Newton-Schulz]
    Matrices of one shape, dtype and device are stacked and orthogonalised in
    one call of batched matmuls (``baddbmm``), so a model with n_layer
    identical blocks issues four launches per NS iteration instead of
    4 * n_layer. The Frobenius norm is taken per matrix, so the result equals
    the per-matrix path up to the rounding of the batched kernels.

Note [chunked Newton-Schulz]
    Stacking every owned matrix of one shape at once makes a step's temporaries grow with the number of
    matrices. ``ns_batch_bytes`` caps one stack: a same-shape batch of n matrices is cut into ceil(n / k)
    consecutive chunks of nearly equal length (they differ by at most one),
    ``k = ns_batch_bytes // (rows * cols * itemsize(ns_dtype))``, and ``muon_step`` (``optim/muon.py``) runs
    momentum, Newton-Schulz and the update chunk by chunk, dropping each chunk's temporaries before the next:
    the step's peak is a fixed multiple of the budget (docs/muon.md). ``None`` stacks the whole batch.

    No operation mixes the matrices of a stack (the norm is per matrix, each matmul of a ``baddbmm`` one
    matrix's), so chunking changes no value on CPU (tested, bf16 and float32, 1 and 2 threads), with one
    exception the chunking avoids: oneDNN multiplies a bf16 *batch of one* differently from a batch of several.
    A chunk therefore holds at least two matrices, so a budget below two matrices' bytes is exceeded, as a
    budget below one matrix's is by a shape that occurs once. On CUDA, cuBLAS picks kernels by problem size,
    batch count included, so chunked and unchunked results may differ in rounding there.

    A parameter of several matrices (a stack, blocks: Note [matrix views] in ``optim/matrices.py``) may have
    them in several chunks: its momentum direction is kept from its first chunk to its last, one parameter's
    worth beyond the budget.

Note [Gram Newton-Schulz]
    For ``X`` of shape ``m x n`` (``m <= n`` after the transpose) each quintic step is ``X <- P X`` with
    ``P = aI + bA + cA^2`` and ``A = X X^T``. P is a polynomial in A, so the next Gram matrix is ``P A P`` and
    the product ``Q = P_k ... P_1`` gives ``X_k = Q X_0``: the iterations run on ``m x m`` matrices and the
    ``m x n`` one is only read to form A and to apply Q (at each restart and at the end): 4 m^2 n + 14 m^3
    multiply-adds for five steps against 10 m^2 n + 5 m^3, fewer from an aspect ``n / m`` of about 1.5.

    Two things keep it accurate. The Gram side (A, P, Q) is float32 when ``dtype`` is narrower: a bf16 A
    holds the small singular values' squares as rounding noise, and a negative eigenvalue of A is
    multiplied by about ``a^2`` each step instead of shrinking. And A is recomputed from ``X = Q X_0``
    before iteration 2, 5, 8, ... (``_gram_restarts``), so such errors grow over two or three steps only.
    Forming A takes a float32 copy of the stack, a temporary beyond the standard path's in bf16.

    In bf16 the result is then closer to the float64 iteration than the standard path's on matrices of
    aspect >= 1.5, its singular values as close to 1 up to bf16 rounding (0.03 on rank-deficient inputs,
    within ``steps * eps``); in float32 its error is up to about 2.5 times the
    standard path's (ill-conditioned inputs), both near 1e-5 (tests/optim/test_newton_schulz_gram.py,
    docs/muon.md). ``algorithm="auto"`` therefore takes this path in bf16 for
    ``max / min >= GRAM_MIN_ASPECT`` (2), and the standard path otherwise. ``"standard"``, Muon's
    default, is the path of Note [parity with torch.optim.Muon].
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch
from torch import Tensor

from .muon_options import GRAM_MIN_ASPECT, NSAlgorithm, NSCoefficients, resolve_ns_coefficients

__all__ = ["newton_schulz", "newton_schulz_gram", "newton_schulz_reference", "ns_chunks", "orthogonalize",
           "uses_gram"]


def newton_schulz_reference(
    G: Tensor,
    steps: int = 5,
    coefficients: NSCoefficients = "simple",
    eps: float = 1e-7,
    dtype: torch.dtype = torch.bfloat16,
) -> Tensor:
    """Orthogonalise one matrix, op for op like ``torch.optim.Muon`` (the slow path).

    Returns an approximation of ``U V^T`` (``G = U S V^T``) in ``dtype`` with G's shape.
    See Note [parity with torch.optim.Muon].
    """
    if G.ndim != 2:
        raise ValueError(
            f"newton_schulz_reference takes one matrix; got shape {tuple(G.shape)}. Use newton_schulz for a batch"
        )
    coeffs = resolve_ns_coefficients(coefficients, steps)
    X = G.to(dtype)
    tall = G.size(0) > G.size(1)
    if tall:
        # Work on the wide side so the Gram matrix X X^T is the small (min, min) one.
        X = X.T
    # Frobenius norm >= spectral norm, so after this every singular value is <= 1,
    # inside the interval the polynomials are designed for.
    X = X / X.norm().clamp(min=eps)
    for a, b, c in coeffs:
        A = X @ X.T
        B = torch.addmm(A, A, A, beta=b, alpha=c)  # b*A + c*A@A
        X = torch.addmm(X, B, X, beta=a)  # a*X + B@X
    return X.T if tall else X


def newton_schulz(
    G: Tensor,
    steps: int = 5,
    coefficients: NSCoefficients = "simple",
    eps: float = 1e-7,
    dtype: torch.dtype = torch.bfloat16,
) -> Tensor:
    """Orthogonalise the matrices in the last two dims of ``G``, batched over leading dims.

    ``G`` of shape ``(*batch, m, n)`` returns ``(*batch, m, n)`` in ``dtype``; each
    matrix is normalised by its own Frobenius norm. A 2-D ``G`` takes the per-matrix
    path, so one matrix gives exactly :func:`newton_schulz_reference`'s result.
    """
    if G.ndim < 2:
        raise ValueError(f"newton_schulz needs a tensor with >= 2 dims; got shape {tuple(G.shape)}")
    if G.ndim == 2:
        return newton_schulz_reference(G, steps, coefficients, eps, dtype)
    coeffs = resolve_ns_coefficients(coefficients, steps)
    batch_shape, (m, n) = G.shape[:-2], G.shape[-2:]
    X = G.to(dtype).reshape(-1, m, n)
    tall = m > n
    if tall:
        X = X.mT
    X = X / torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True).clamp(min=eps)
    for a, b, c in coeffs:
        A = X @ X.mT
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)
        X = torch.baddbmm(X, B, X, beta=a)
    if tall:
        X = X.mT
    return X.reshape(*batch_shape, m, n)


def _gram_restarts(steps: int) -> range:
    """Iterations before which the Gram path recomputes ``A`` from ``X`` (Note [Gram Newton-Schulz])."""
    return range(2, steps, 3)


def newton_schulz_gram(
    G: Tensor,
    steps: int = 5,
    coefficients: NSCoefficients = "simple",
    eps: float = 1e-7,
    dtype: torch.dtype = torch.bfloat16,
) -> Tensor:
    """Newton-Schulz on the Gram matrix ``X X^T`` of each matrix in the last two dims of ``G``.

    The iteration of :func:`newton_schulz` (same normalisation, same coefficients), with the
    ``m x n`` matrices touched only to form the Gram matrix and to apply the accumulated
    polynomial; returns ``G``'s shape in ``dtype``. See Note [Gram Newton-Schulz].
    """
    if G.ndim < 2:
        raise ValueError(f"newton_schulz_gram needs a tensor with >= 2 dims; got shape {tuple(G.shape)}")
    coeffs = resolve_ns_coefficients(coefficients, steps)
    restarts = _gram_restarts(steps)
    gram_dtype = torch.promote_types(dtype, torch.float32)
    batch_shape, (m, n) = G.shape[:-2], G.shape[-2:]
    X = G.to(dtype).reshape(-1, m, n)
    tall = m > n
    if tall:
        X = X.mT
    X = X / torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True).clamp(min=eps)
    eye = torch.eye(X.size(-2), dtype=gram_dtype, device=X.device)
    for k, (a, b, c) in enumerate(coeffs):
        if k == 0 or k in restarts:
            if k:
                X = Q.to(dtype) @ X
            X_gram = X.to(gram_dtype)
            A = X_gram @ X_gram.mT
            del X_gram
        P = torch.baddbmm(A, A, A, beta=b, alpha=c).add_(eye, alpha=a)  # aI + bA + cA^2
        Q = P if k == 0 or k in restarts else P @ Q
        if k + 1 < steps and k + 1 not in restarts:
            A = P @ A @ P
    X = Q.to(dtype) @ X
    if tall:
        X = X.mT
    return X.reshape(*batch_shape, m, n)


def uses_gram(shape: Sequence[int], dtype: torch.dtype, algorithm: NSAlgorithm) -> bool:
    """Whether a matrix of ``shape`` (its last two dims), iterated in ``dtype``, takes the Gram path.

    ``"gram"``: always; ``"standard"``: never; ``"auto"``: when ``dtype`` is bf16 and the longer
    side is at least ``GRAM_MIN_ASPECT`` times the shorter (Note [Gram Newton-Schulz]).
    """
    if algorithm == "auto":
        rows, cols = shape[-2], shape[-1]
        return dtype == torch.bfloat16 and max(rows, cols) >= GRAM_MIN_ASPECT * min(rows, cols)
    return algorithm == "gram"


def _chunk_lengths(count: int, rows: int, cols: int, dtype: torch.dtype, max_batch_bytes: int | None) -> list[int]:
    """Lengths of the stacks that ``count >= 2`` same-shape matrices are cut into (Note [chunked Newton-Schulz]).

    As few stacks as the budget allows, of nearly equal length, none shorter than two.
    """
    if max_batch_bytes is None:
        return [count]
    limit = max(2, max_batch_bytes // (rows * cols * dtype.itemsize))
    chunks = -(-count // limit)
    if count // chunks < 2:  # limit 2 and an odd count: one stack of three rather than one of one
        chunks = count // 2
    base, longer = divmod(count, chunks)
    return [base + 1] * longer + [base] * (chunks - longer)


def ns_chunks(
    keys: Sequence[tuple], dtype: torch.dtype, batched: bool, max_batch_bytes: int | None
) -> list[tuple[list[int], bool]]:
    """Index lists to orthogonalise together, and whether each takes the batched path.

    ``keys[i]`` is ``((rows, cols), dtype, device)`` of matrix ``i``. Matrices sharing a
    key form a batch (order of first appearance), cut into stacks of
    :func:`_chunk_lengths`; a key seen once, or ``batched=False``, gives
    per-matrix chunks on the reference path. See Note [chunked Newton-Schulz].
    """
    if not batched:
        return [([i], False) for i in range(len(keys))]
    buckets: dict[tuple, list[int]] = defaultdict(list)
    for i, key in enumerate(keys):
        buckets[key].append(i)
    chunks: list[tuple[list[int], bool]] = []
    for (shape, _, _), idx in buckets.items():
        if len(idx) == 1:
            chunks.append((idx, False))
            continue
        start = 0
        for length in _chunk_lengths(len(idx), shape[0], shape[1], dtype, max_batch_bytes):
            chunks.append((idx[start:start + length], True))
            start += length
    return chunks


def _stack_as(matrices: Sequence[Tensor], dtype: torch.dtype) -> Tensor:
    """``torch.stack(matrices).to(dtype)`` without the intermediate stack in the input dtype."""
    first = matrices[0]
    out = torch.empty((len(matrices), *first.shape), dtype=dtype, device=first.device)
    for slot, M in zip(out, matrices):
        slot.copy_(M)  # the same rounding as .to(dtype)
    return out


def _orthogonalize_chunk(
    matrices: Sequence[Tensor],
    stacked: bool,
    steps: int,
    coefficients: NSCoefficients,
    eps: float,
    dtype: torch.dtype,
    algorithm: NSAlgorithm,
) -> Sequence[Tensor]:
    """Newton-Schulz of one chunk (see :func:`ns_chunks`): one batched call, or one call per matrix; on the Gram
    path where :func:`uses_gram` says so, else on :func:`newton_schulz` or the reference path."""
    if uses_gram(matrices[0].shape, dtype, algorithm):
        if not stacked:
            return [newton_schulz_gram(M, steps, coefficients, eps, dtype) for M in matrices]
        return newton_schulz_gram(_stack_as(matrices, dtype), steps, coefficients, eps, dtype).unbind(0)
    if not stacked:
        return [newton_schulz_reference(M, steps, coefficients, eps, dtype) for M in matrices]
    return newton_schulz(_stack_as(matrices, dtype), steps, coefficients, eps, dtype).unbind(0)


def _check_2d(matrices: Sequence[Tensor]) -> None:
    for i, M in enumerate(matrices):
        if M.ndim != 2:
            raise ValueError(f"orthogonalize takes 2-D matrices; matrix {i} has shape {tuple(M.shape)}")


def orthogonalize(
    matrices: Sequence[Tensor],
    steps: int = 5,
    coefficients: NSCoefficients = "simple",
    eps: float = 1e-7,
    dtype: torch.dtype = torch.bfloat16,
    batched: bool = True,
    max_batch_bytes: int | None = None,
    algorithm: NSAlgorithm = "standard",
) -> list[Tensor]:
    """Newton-Schulz on a list of 2-D matrices; same-shape ones share batched calls.

    See Note [batched Newton-Schulz]. ``max_batch_bytes`` caps the bytes of one stack
    (in ``dtype``); a larger same-shape batch is orthogonalised in chunks, with the same
    result (Note [chunked Newton-Schulz]). ``algorithm`` picks the iteration per shape
    (:func:`uses_gram`, Note [Gram Newton-Schulz]). Output ``i`` corresponds to input ``i``.
    """
    if batched:
        _check_2d(matrices)
    out: list[Tensor | None] = [None] * len(matrices)
    keys = [(tuple(M.shape), M.dtype, M.device) for M in matrices]
    for idx, stacked in ns_chunks(keys, dtype, batched, max_batch_bytes):
        for i, O in zip(idx, _orthogonalize_chunk([matrices[i] for i in idx], stacked, steps, coefficients, eps,
                                                  dtype, algorithm)):
            out[i] = O
    return out  # type: ignore[return-value]
