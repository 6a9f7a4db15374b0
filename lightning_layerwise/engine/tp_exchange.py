"""Muon on tensor-parallel matrices: each matrix orthogonalized whole, once in the world.

Note [tensor-parallel exchange]
    Under tensor parallelism a rank holds a shard of each sharded matrix, and Newton-Schulz of a shard is not
    the shard of Newton-Schulz (orthogonalizing shards alone is a different optimizer). The ranks of one
    tensor-parallel group own the same matrices (Note [identical layouts] in ``engine/tensor_parallel.py``), in
    the same order in each optimizer param group, so they agree without talking on which rank orthogonalizes
    which: :func:`assign` spreads the matrices over the group by Newton-Schulz cost (longest first, each to the
    least loaded rank). Then one ``all_to_all`` sends every shard to its matrix's rank, which joins the shards
    in rank order and orthogonalizes the whole matrices (batched by shape, as without tensor parallelism);
    a second ``all_to_all`` sends each rank its shard of the result. A matrix every rank holds whole (replicated
    over the group: a plain parameter, a ``Replicate`` DTensor) sends nothing on the way there and is sent back
    whole. Each matrix is orthogonalized on one rank of the world; each rank of a group sends and receives
    ``(T-1)/T`` of a matrix's elements per direction, as an all-gather would, without the repeated work.

    The momentum, the weight decay and the update are element-wise and stay on the shards; the update's scale
    uses the global shape (:func:`~lightning_layerwise.optim.muon.adjust_lr_scale`), as one process would.

Note [views and NorMuon over the exchange]
    What travels is the whole parameter, so a matrix view (per-head or QKV blocks, Note [matrix views] in
    ``optim/matrices.py``) is cut from the whole on its rank, as in one process: a fused QKV sharded by heads keeps
    its blocks whatever rank holds which rows. Each block's update is then applied to the part of it this rank
    holds (:func:`_local_blocks`). NorMuon's state (one float per row of each whole block, the whole parameter's
    size) is kept whole by every rank of the group: it is a row per matrix row, small beside the shards, a row of
    a column-sharded matrix spans every rank anyway, and a checkpoint holds it at the shape one process has. The
    matrix's rank updates it and sends it back with each block's scale (float32, a second ``all_to_all``); every
    rank then computes its part of ``O / (sqrt(v) + eps) * scale`` from its shard of ``O``, element by element
    as the matrix's rank would, so all ranks keep the same state and one process's numbers.
"""

from __future__ import annotations

import heapq
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from ..optim.matrices import PLAIN, MatrixView, matrix_blocks, matrix_shapes
from ..optim.muon import _second_moment_rows, adjust_lr_scale, muon_update, normuon_parts
from ..optim.orthogonalization import orthogonalize
from .tensor_parallel import TensorParallelSpec, spec_of


def ns_cost(shape: Sequence[int]) -> float:
    """Newton-Schulz work of one ``(m, n)`` matrix: ``min(m, n)^2 max(m, n)`` per iteration, up to a constant."""
    m, n = shape[0], shape[1]
    return float(min(m, n)) ** 2 * max(m, n)


def assign(shapes: Sequence[Sequence[int]], ranks: int) -> list[int]:
    """Which rank of the group orthogonalizes each matrix: longest processing time first, ties by position, so
    every rank computes the same answer."""
    order = sorted(range(len(shapes)), key=lambda i: (-ns_cost(shapes[i]), i))
    load = [(0.0, r) for r in range(ranks)]
    out = [0] * len(shapes)
    for i in order:
        cost, r = heapq.heappop(load)
        out[i] = r
        heapq.heappush(load, (cost + ns_cost(shapes[i]), r))
    return out


class ExchangeCounts:
    """Elements this rank sent in the exchange, for the benchmarks' bytes per step."""

    def __init__(self) -> None:
        self.bytes_sent = 0


COUNTS = ExchangeCounts()


def global_shape(param: Tensor) -> torch.Size:
    """A trained tensor's whole shape under tensor parallelism (its own outside it)."""
    spec = spec_of(param)
    return param.shape if spec is None else spec.shape


def check_matrices(shapes: Sequence[Sequence[int]], owner: str) -> None:
    """Refuses Muon matrices that are not 2-D under tensor parallelism (stacks and kernels are not exchanged yet)."""
    flat = [tuple(s) for s in shapes if len(s) != 2]
    if flat:
        raise ValueError(f"{owner}: Muon under tensor parallelism steps 2-D matrices; parameters of shapes {flat[:3]} "
                         "(a stack or a convolution kernel) are not supported with tensor_parallel_size > 1 yet. Give "
                         "them to the AdamW half (muon_param_groups(..., adamw=[...])) or train without tensor "
                         "parallelism.")


def orthogonalize_whole(directions: Sequence[Tensor], specs: Sequence[TensorParallelSpec],
                        update: Callable[[list[int], list[Tensor]], tuple[list[Tensor], list[Tensor]]],
                        dtype: torch.dtype, extra_sizes: Sequence[int] | None = None
                        ) -> tuple[list[Tensor], list[Tensor] | None]:
    """This rank's part of the updates of the whole parameters whose local parts are ``directions`` (Note
    [tensor-parallel exchange]); collective over the tensor-parallel group, called by every rank of it with
    parameters of the same global shapes in the same order. ``update(indices, wholes)`` maps the whole
    directions of the parameters this rank was assigned to their updates (whole, in ``dtype``, sent back as
    shards) and, with ``extra_sizes``, a float32 tensor of ``extra_sizes[i]`` elements each, which every rank
    receives whole. Returns the local updates and the extras."""
    if not directions:
        return [], [] if extra_sizes is not None else None
    group = specs[0].group
    T, me = dist.get_world_size(group), dist.get_rank(group)
    owner = assign([s.shape for s in specs], T)
    sharded = [s.shard_dim is not None for s in specs]
    mine = [i for i in range(len(specs)) if owner[i] == me]
    of_rank = [[i for i in range(len(specs)) if owner[i] == r] for r in range(T)]
    gathered = [i for i in mine if sharded[i]]
    # There: each rank sends its shard of every sharded parameter to that parameter's rank.
    send = [[directions[i].contiguous().view(-1) for i in of_rank[r] if sharded[i]] for r in range(T)]
    parts = _all_to_all(send, [[directions[i].numel() for i in gathered]] * T, directions[0].dtype, group)
    slot = {i: k for k, i in enumerate(gathered)}
    whole = [torch.cat([parts[r][slot[i]].view(directions[i].shape) for r in range(T)], dim=specs[i].shard_dim)
             if sharded[i] else directions[i] for i in mine]
    updates, extras = update(mine, whole) if mine else ([], [])
    # Back: each rank receives its shard (or, replicated, the whole) of every update.
    back: list[list[Tensor]] = [[] for _ in range(T)]
    for U, i in zip(updates, mine):
        pieces = U.chunk(T, dim=specs[i].shard_dim) if sharded[i] else [U] * T
        for r in range(T):
            back[r].append(pieces[r].reshape(-1))
    got = _all_to_all(back, [[directions[i].numel() for i in of_rank[r]] for r in range(T)], dtype, group,
                      device=directions[0].device)
    out: list[Tensor] = [directions[0]] * len(specs)
    for r in range(T):
        for U, i in zip(got[r], of_rank[r]):
            out[i] = U.view(directions[i].shape)
    if extra_sizes is None:
        return out, None
    got = _all_to_all([list(extras)] * T, [[extra_sizes[i] for i in of_rank[r]] for r in range(T)], torch.float32,
                      group, device=directions[0].device)
    received: list[Tensor] = [directions[0]] * len(specs)
    for r in range(T):
        for E, i in zip(got[r], of_rank[r]):
            received[i] = E
    return out, received


def _all_to_all(send: list[list[Tensor]], receive_sizes: list[list[int]], dtype: torch.dtype, group,
                device: torch.device | None = None) -> list[list[Tensor]]:
    """``send[r]``: flat tensors for rank ``r``; ``receive_sizes[r]``: the lengths of those rank ``r`` sends here.
    One ``all_to_all_single`` in ``dtype``; returns the received tensors per source rank."""
    flat_in = [t.to(dtype) for ts in send for t in ts]
    device = device if device is not None else flat_in[0].device if flat_in else None
    inp = torch.cat(flat_in) if flat_in else torch.empty(0, dtype=dtype, device=device)
    in_splits = [sum(t.numel() for t in ts) for ts in send]
    out_splits = [sum(s) for s in receive_sizes]
    out = torch.empty(sum(out_splits), dtype=dtype, device=inp.device)
    dist.all_to_all_single(out, inp, out_splits, in_splits, group=group)
    COUNTS.bytes_sent += (inp.numel() - in_splits[dist.get_rank(group)]) * inp.element_size()
    received, start = [], 0
    for sizes in receive_sizes:
        row = []
        for n in sizes:
            row.append(out[start:start + n])
            start += n
        received.append(row)
    return received


def muon_step_whole(params: Sequence[Tensor], grads: Sequence[Tensor], momentum_buffers: Sequence[Tensor],
                    group: dict[str, Any], view: MatrixView = PLAIN,
                    second_moments: Sequence[Tensor] | None = None) -> None:
    """One Muon step on the matrices of a tensor-parallel run: momentum, weight decay and update on the local
    tensors, Newton-Schulz on the whole matrices of ``view`` (Note [tensor-parallel exchange]), NorMuon with
    ``second_moments`` (each the whole parameter's state, Note [views and NorMuon over the exchange])."""
    lr, decay = group["lr"], group["lr"] * group["weight_decay"]
    directions = []
    for p, g, buf in zip(params, grads, momentum_buffers):
        directions.append(muon_update(g, buf, group["momentum"], group["nesterov"]))
        p.mul_(1 - decay)
    specs = [spec_of(p) for p in params]
    missing = [tuple(p.shape) for p, s in zip(params, specs) if s is None]
    if missing:
        raise RuntimeError(f"Muon under tensor parallelism was given tensors of shapes {missing[:3]} that are not "
                           "parameters of the parallelized module; build the optimizer from the module's "
                           "parameters.")
    check_matrices([s.shape for s in specs], "Muon")
    ns_dtype = group["ns_dtype"]
    normuon = second_moments is not None
    beta2, eps = group.get("normuon_beta2", 0.95), group.get("normuon_eps", 1e-8)

    def whole_updates(indices: list[int], wholes: list[Tensor]) -> tuple[list[Tensor], list[Tensor]]:
        blocks = [matrix_blocks(W, view) for W in wholes]
        ortho = iter(orthogonalize([b for bs in blocks for b in bs], group["ns_steps"], group["ns_coefficients"],
                                   group["ns_eps"], ns_dtype, batched=group["batched"],
                                   max_batch_bytes=group.get("ns_batch_bytes"),
                                   algorithm=group.get("ns_algorithm", "standard")))
        updates, extras = [], []
        for i, W, bs in zip(indices, wholes, blocks):
            outs = [next(ortho) for _ in bs]
            if len(outs) == 1:
                updates.append(outs[0])
            else:
                updates.append(torch.empty(W.shape, dtype=outs[0].dtype, device=W.device))
                for part, O in zip(matrix_blocks(updates[-1], view), outs):
                    part.copy_(O)
            if normuon:  # the state is updated here, and each block's scale taken, as one process would
                scales = [normuon_parts(O, second_moments[i][start:stop], beta2, eps)[1]
                          for O, (start, stop) in zip(outs, _second_moment_rows(matrix_shapes(W.shape, view)))]
                extras.append(torch.cat([second_moments[i], torch.stack(scales)]))
        return updates, extras

    # One exchange per dtype of the directions (one, unless the group mixes parameter dtypes): each travels in its own.
    for dtype in dict.fromkeys(d.dtype for d in directions):
        idx = [i for i, d in enumerate(directions) if d.dtype == dtype]
        sizes = [second_moments[i].numel() + len(matrix_shapes(specs[i].shape, view)) for i in idx] if normuon else None
        updates, extras = orthogonalize_whole([directions[i] for i in idx], [specs[i] for i in idx],
                                              lambda mine, wholes: whole_updates([idx[k] for k in mine], wholes),
                                              ns_dtype, sizes)
        for k, (i, O) in enumerate(zip(idx, updates)):
            if normuon:
                state = second_moments[i]
                state.copy_(extras[k][:state.numel()])
                _apply(params[i], O, specs[i], view, lr, group["adjust_lr"], (state, extras[k][state.numel():], eps))
            else:
                _apply(params[i], O, specs[i], view, lr, group["adjust_lr"], None)


def _local_blocks(spec: TensorParallelSpec, view: MatrixView, local_shape: Sequence[int]
                  ) -> list[tuple[int, slice, slice, int]]:
    """The part of each matrix of ``view`` (over the whole 2-D parameter) that this rank holds: ``(matrix, local
    rows, local columns, first state row)``, where the state row of local row ``r`` is ``first + r - rows.start``.
    Matrices this rank holds nothing of are left out."""
    M, N = spec.shape
    dim = spec.shard_dim
    here = dist.get_rank(spec.group) if dim is not None else 0
    r0 = here * local_shape[0] if dim == 0 else 0
    c0 = here * local_shape[1] if dim == 1 else 0
    r1, c1 = r0 + local_shape[0], c0 + local_shape[1]
    out, start = [], 0
    for j, (rows, cols) in enumerate(matrix_shapes((M, N), view)):
        if view.split_dim == 0:  # block j: rows [start, start + rows), every column; its state rows are its rows
            lo, hi = max(start, r0), min(start + rows, r1)
            if lo < hi:
                out.append((j, slice(lo - r0, hi - r0), slice(0, c1 - c0), lo))
            start += rows
        else:  # block j: columns [start, start + cols), every row; its state rows follow the blocks before it
            lo, hi = max(start, c0), min(start + cols, c1)
            if lo < hi:
                out.append((j, slice(0, r1 - r0), slice(lo - c0, hi - c0), j * M + r0))
            start += cols
    return out


def _apply(p: Tensor, O: Tensor, spec: TensorParallelSpec, view: MatrixView, lr: float, adjust_lr,
           normuon: tuple[Tensor, Tensor, float] | None) -> None:
    """Adds this rank's part of each whole matrix's update to ``p`` (its local tensor): ``-lr * scale * O`` per
    matrix, or NorMuon's ``-lr * O / (sqrt(v) + eps) * scale`` from the whole state ``v`` and the matrix's scale,
    each element computed as the matrix's rank computes it."""
    shapes = matrix_shapes(spec.shape, view)
    if normuon is None:
        alphas = [-lr * adjust_lr_scale(s, adjust_lr) for s in shapes]
        if len(set(alphas)) == 1:  # one scale for the whole tensor (no blocks, or blocks of one shape)
            p.add_(O, alpha=alphas[0])
            return
    for j, rows, cols, first in _local_blocks(spec, view, p.shape):
        if normuon is None:
            p[rows, cols].add_(O[rows, cols], alpha=alphas[j])
            continue
        state, scales, eps = normuon
        n = rows.stop - rows.start
        normalized = O[rows, cols].float() / (state[first:first + n].sqrt() + eps).unsqueeze(1)
        p[rows, cols].add_(normalized.mul_(scales[j]), alpha=-lr)
