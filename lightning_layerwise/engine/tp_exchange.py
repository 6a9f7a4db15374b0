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
"""

from __future__ import annotations

import heapq
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from ..optim.muon import adjust_lr_scale, muon_update
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


def orthogonalize_whole(directions: Sequence[Tensor], specs: Sequence[TensorParallelSpec],
                        orthogonalize: Callable[[list[Tensor]], list[Tensor]], dtype: torch.dtype) -> list[Tensor]:
    """This rank's part of Newton-Schulz of the whole matrices whose local parts are ``directions`` (Note
    [tensor-parallel exchange]); collective over the tensor-parallel group, called by every rank of it with
    matrices of the same global shapes in the same order. ``orthogonalize`` maps whole matrices to their
    orthogonalized updates, which travel back in ``dtype``."""
    if not directions:
        return []
    group = specs[0].group
    T, me = dist.get_world_size(group), dist.get_rank(group)
    owner = assign([s.shape for s in specs], T)
    sharded = [s.shard_dim is not None for s in specs]
    mine = [i for i in range(len(specs)) if owner[i] == me]
    gathered = [i for i in mine if sharded[i]]
    # There: each rank sends its shard of every sharded matrix to that matrix's rank.
    send = [[directions[i].contiguous().view(-1) for i in range(len(specs)) if owner[i] == r and sharded[i]]
            for r in range(T)]
    parts = _all_to_all(send, [[directions[i].numel() for i in gathered]] * T, directions[0].dtype, group)
    slot = {i: k for k, i in enumerate(gathered)}
    whole = []
    for i in mine:
        if sharded[i]:
            whole.append(torch.cat([parts[r][slot[i]].view(directions[i].shape) for r in range(T)],
                                   dim=specs[i].shard_dim))
        else:
            whole.append(directions[i])
    ortho = orthogonalize(whole) if whole else []
    # Back: each rank receives its shard (or, replicated, the whole) of every matrix.
    back: list[list[Tensor]] = [[] for _ in range(T)]
    for O, i in zip(ortho, mine):
        pieces = O.chunk(T, dim=specs[i].shard_dim) if sharded[i] else [O] * T
        for r in range(T):
            back[r].append(pieces[r].reshape(-1))
    sizes = [[directions[i].numel() for i in range(len(specs)) if owner[i] == r] for r in range(T)]
    got = _all_to_all(back, sizes, dtype, group, device=directions[0].device)
    out: list[Tensor] = [directions[0]] * len(specs)
    for r in range(T):
        for O, i in zip(got[r], [i for i in range(len(specs)) if owner[i] == r]):
            out[i] = O.view(directions[i].shape)
    return out


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
                    group: dict[str, Any]) -> None:
    """One Muon step on the matrices of a tensor-parallel run: momentum, weight decay and update on the local
    tensors, Newton-Schulz on the whole matrices (Note [tensor-parallel exchange]). A plain-matrix Muon group
    (no NorMuon, no blocks); :meth:`Muon._step_muon` checks that."""
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
    ns_dtype = group["ns_dtype"]

    def whole(matrices: list[Tensor]) -> list[Tensor]:
        return orthogonalize(matrices, group["ns_steps"], group["ns_coefficients"], group["ns_eps"], ns_dtype,
                             batched=group["batched"], max_batch_bytes=group.get("ns_batch_bytes"),
                             algorithm=group.get("ns_algorithm", "standard"))

    # One exchange per dtype of the directions (one, unless the group mixes parameter dtypes): each travels in its own.
    for dtype in dict.fromkeys(d.dtype for d in directions):
        idx = [i for i, d in enumerate(directions) if d.dtype == dtype]
        updates = orthogonalize_whole([directions[i] for i in idx], [specs[i] for i in idx], whole, ns_dtype)
        for i, O in zip(idx, updates):
            params[i].add_(O.view_as(params[i]), alpha=-lr * adjust_lr_scale(specs[i].shape, group["adjust_lr"]))
