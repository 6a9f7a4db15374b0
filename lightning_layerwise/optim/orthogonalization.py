"""Newton-Schulz: the iteration that orthogonalizes Muon's update, on one matrix or a batch of same-shape ones.

:func:`newton_schulz_reference` is the per-matrix path, op for op as ``torch.optim.Muon``;
:func:`newton_schulz` the batched one over leading dims; :func:`orthogonalize` takes a list
of matrices, stacks those of one shape, dtype and device, and cuts a large stack into chunks
under a byte budget. Each casts to the iteration's dtype (``ns_dtype``) on the way in and
returns in it. The coefficient schedules are Muon's options (``optim/muon_options.py``). Plain
functions: nothing here knows of ranks or of the optimizer's state.

Note [parity with torch.optim.Muon]
    The per-matrix path (:func:`newton_schulz_reference`, used when
    ``batched=False`` or when a shape occurs once) performs the same tensor
    operations in the same order as ``torch.optim.Muon`` (2.13): cast to
    ``ns_dtype``, transpose tall matrices, divide by ``norm().clamp(min=eps)``,
    then ``addmm`` for ``b*A + c*A@A`` and for ``a*X + B@X``. With the same
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
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch
from torch import Tensor

from .muon_options import NSCoefficients, resolve_ns_coefficients

__all__ = ["newton_schulz", "newton_schulz_reference", "ns_chunks", "orthogonalize"]


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
) -> Sequence[Tensor]:
    """Newton-Schulz of one chunk (see :func:`ns_chunks`): one batched call, or the reference path."""
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
) -> list[Tensor]:
    """Newton-Schulz on a list of 2-D matrices; same-shape ones share batched calls.

    See Note [batched Newton-Schulz]. ``max_batch_bytes`` caps the bytes of one stack
    (in ``dtype``); a larger same-shape batch is orthogonalised in chunks, with the same
    result (Note [chunked Newton-Schulz]). Output ``i`` corresponds to input ``i``.
    """
    if batched:
        _check_2d(matrices)
    out: list[Tensor | None] = [None] * len(matrices)
    keys = [(tuple(M.shape), M.dtype, M.device) for M in matrices]
    for idx, stacked in ns_chunks(keys, dtype, batched, max_batch_bytes):
        for i, O in zip(idx, _orthogonalize_chunk([matrices[i] for i in idx], stacked, steps, coefficients, eps,
                                                  dtype)):
            out[i] = O
    return out  # type: ignore[return-value]
