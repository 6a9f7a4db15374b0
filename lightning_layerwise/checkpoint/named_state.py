"""Optimizer state in named form, and gathering it to one rank for a full checkpoint.

Note [checkpoint keys]
    The optimizer state is saved in *named form*: ``{"state": {name: {...}},
    "param_groups": [{..., "params": [name, ...]}]}``, the names being those of
    ``module.named_parameters()`` (a tied parameter under its first name). torch's
    ``Optimizer.load_state_dict`` pairs saved and current parameters by position
    within the param groups and never looks at what the saved ids are, so a
    named state dict loads into a plain optimizer (``ddp``) too; loading here
    pairs them the same way and additionally checks that the names agree, so a
    changed grouping is an error instead of silently crossed state. An indexed
    state dict (written by ``ddp``) loads by position, as torch does.


Note [gathering a full checkpoint]
    A full checkpoint needs every rank's owned optimizer state on rank 0. Pickling
    it through ``gather_object`` would stage every rank's pickled tensors in one
    buffer, and on NCCL that buffer lives in GPU memory (world_size times the
    largest rank's state on rank 0's GPU). :func:`gather_named_state` therefore
    splits each rank's part into a *skeleton* (the nested dicts with every tensor
    replaced by a :class:`TensorSlot`: its index, shape and dtype) and the list of
    its tensors. Only skeletons go through ``gather_object``; the tensors travel
    one at a time as raw bytes, point to point (``batch_isend_irecv`` with a single
    op, which on NCCL reuses the group's communicator instead of creating one per
    pair of ranks), on the device the group's backend communicates on. Rank 0
    receives each tensor into a buffer of exactly its bytes, copies it to CPU and
    drops the buffer before the next, so its device holds at most one extra tensor
    at a time; a sender moves a tensor to that device (a no-op for GPU state on
    NCCL) only while it sends it.
"""

from __future__ import annotations

import math
from itertools import chain
from typing import Any, Callable, Mapping, NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist

from .ownership import MERGED_KEYS, CheckpointError


def named_optimizer_state(optimizer: torch.optim.Optimizer, names: Mapping[torch.Tensor, str]) -> dict[str, Any]:
    """``optimizer.state_dict()`` with parameter names in place of indices (Note [checkpoint keys])."""
    local = optimizer.state_dict()
    params = list(chain.from_iterable(g["params"] for g in optimizer.param_groups))
    ids = list(chain.from_iterable(g["params"] for g in local["param_groups"]))
    unnamed = [tuple(p.shape) for p in params if p not in names]
    if unnamed:
        raise CheckpointError(f"the optimizer holds {len(unnamed)} tensor(s) that are not parameters of the model "
                              f"(shapes {unnamed[:3]}); only the model's parameters can be checkpointed by name.")
    id_to_name = {i: names[p] for i, p in zip(ids, params)}
    return {
        "state": {id_to_name[i]: value for i, value in local["state"].items()},
        "param_groups": [{**g, "params": [id_to_name[i] for i in g["params"]]} for g in local["param_groups"]],
    }


def local_optimizer_state(saved: Mapping[str, Any], optimizer: torch.optim.Optimizer,
                          names: Mapping[torch.Tensor, str], keep: Callable[[torch.Tensor], bool],
                          pieces: Optional[Mapping[torch.Tensor, tuple[Any, Sequence[int]]]] = None,
                          is_expert: Callable[[str], bool] = lambda name: False,
                          shard: Optional[Callable[[torch.Tensor, Any], Any]] = None) -> dict[str, Any]:
    """A saved state dict (named or indexed) as ``optimizer.load_state_dict`` input, state only where ``keep``.

    ``pieces`` maps each piece of a split parameter the optimizer steps to its
    ``(Piece, full shape)``: its per-element state is cut to the piece (Note [pieces in
    checkpoints]). Raises :class:`CheckpointError` if the param groups do not line up.
    With expert parameters (``is_expert`` of a name), the named form is matched by name:
    each rank holds other experts than the rank that wrote the param groups (Note
    [expert checkpoints]); the dense names of each group must still agree. ``shard(p, entry)``, under tensor
    parallelism, cuts the full tensors of ``p``'s saved entry to this rank's tensor-parallel shard, before its
    piece is cut (Note [tensor-parallel checkpoints] in ``checkpoint/tensor_parallel.py``).
    """
    saved_groups, groups = saved["param_groups"], optimizer.param_groups
    if len(saved_groups) != len(groups):
        raise CheckpointError(f"the checkpoint's optimizer has {len(saved_groups)} param group(s), this optimizer "
                              f"{len(groups)}; build the param groups as in the run that saved it.")
    by_saved_id: dict[Any, torch.Tensor] = {}
    named_form = all(isinstance(i, str) for g in saved_groups for i in g["params"])
    if named_form and any(is_expert(names.get(p, "")) for g in groups for p in g["params"]):
        for g_index, (saved_group, group) in enumerate(zip(saved_groups, groups)):
            saved_dense = [n for n in saved_group["params"] if not is_expert(n)]
            dense = [names.get(p) for p in group["params"] if not is_expert(names.get(p, ""))]
            if saved_dense != dense:
                raise CheckpointError(f"param group {g_index}: the checkpoint's dense parameters "
                                      f"{saved_dense[:3]}... differ from this optimizer's {dense[:3]}...; build the "
                                      "param groups as in the run that saved it.")
            by_saved_id.update((names[p], p) for p in group["params"])
    else:
        for g_index, (saved_group, group) in enumerate(zip(saved_groups, groups)):
            if len(saved_group["params"]) != len(group["params"]):
                raise CheckpointError(f"param group {g_index} has {len(saved_group['params'])} parameters in the "
                                      f"checkpoint and {len(group['params'])} in this optimizer.")
            for position, (saved_id, p) in enumerate(zip(saved_group["params"], group["params"])):
                if isinstance(saved_id, str) and saved_id != names.get(p):
                    raise CheckpointError(f"param group {g_index}, position {position}: the checkpoint has "
                                          f"{saved_id!r} where this optimizer has {names.get(p)!r}; build the param "
                                          "groups in the same order as the run that saved it.")
                by_saved_id[saved_id] = p
    local_id = {p: i for i, p in enumerate(chain.from_iterable(g["params"] for g in groups))}
    pieces = pieces or {}
    state = {}
    for k, v in saved.get("state", {}).items():
        if k in by_saved_id and keep(by_saved_id[k]):
            p = by_saved_id[k]
            if shard is not None:
                v = shard(p, v)
            if p in pieces:
                piece, shape = pieces[p]
                v = {key: piece.cut(value, shape) for key, value in v.items()}
            state[local_id[p]] = v
    param_groups = [{**sg, "params": [local_id[p] for p in g["params"]]} for sg, g in zip(saved_groups, groups)]
    return {"state": state, "param_groups": param_groups}


def to_cpu(value: Any) -> Any:
    if torch.is_tensor(value):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: to_cpu(v) for k, v in value.items()}
    if isinstance(value, list):
        return [to_cpu(v) for v in value]
    return value


class TensorSlot(NamedTuple):
    """A tensor's place in a skeleton (Note [gathering a full checkpoint]): what rank 0 allocates for it."""

    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def _map_leaves(value: Any, leaf: Callable[[Any], Any]) -> Any:
    """``value`` with ``leaf`` applied to everything that is not a dict, a list or a plain tuple."""
    if isinstance(value, dict):
        return {k: _map_leaves(v, leaf) for k, v in value.items()}
    if isinstance(value, list):
        return [_map_leaves(v, leaf) for v in value]
    if type(value) is tuple:
        return tuple(_map_leaves(v, leaf) for v in value)
    return leaf(value)


def split_tensors(value: Any, tensors: list[torch.Tensor]) -> Any:
    """``value`` with each tensor replaced by a :class:`TensorSlot`; the tensors are appended to ``tensors``."""
    def slot(leaf: Any) -> Any:
        if not torch.is_tensor(leaf):
            return leaf
        tensors.append(leaf)
        return TensorSlot(len(tensors) - 1, tuple(leaf.shape), leaf.dtype)

    return _map_leaves(value, slot)


def fill_tensors(value: Any, tensors: list[torch.Tensor]) -> Any:
    """The inverse of :func:`split_tensors`: each :class:`TensorSlot` replaced by ``tensors[slot.index]``."""
    return _map_leaves(value, lambda leaf: tensors[leaf.index] if isinstance(leaf, TensorSlot) else leaf)


def _slots(value: Any) -> list[TensorSlot]:
    found: list[TensorSlot] = []
    _map_leaves(value, lambda leaf: found.append(leaf) if isinstance(leaf, TensorSlot) else None)
    return found


def transfer_device(group=None) -> torch.device:
    """The device tensors must be on to be sent over ``group``: CPU for gloo (and MPI), else the accelerator."""
    backend = str(dist.get_backend(group)).lower()
    if "gloo" in backend or "mpi" in backend:
        return torch.device("cpu")
    accelerator = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
    if accelerator is not None:
        return torch.device(accelerator.type, torch.accelerator.current_device_index())
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of ``tensor``'s elements (copied only if not contiguous, conjugated or negated)."""
    flat = tensor.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
    return flat.view(torch.uint8)


def _exchange(op: Callable, buffer: torch.Tensor, peer: int, group) -> None:
    for work in dist.batch_isend_irecv([dist.P2POp(op, buffer, peer, group)]):
        work.wait()


def send_tensor(tensor: torch.Tensor, dst: int, device: torch.device, group=None) -> None:
    """Sends one tensor's bytes to global rank ``dst`` (matched by :func:`receive_tensor`); empty ones are not sent."""
    if tensor.numel() == 0:
        return
    _exchange(dist.isend, _as_bytes(tensor.detach().to(device)), dst, group)


def receive_tensor(slot: TensorSlot, src: int, device: torch.device, group=None) -> torch.Tensor:
    """Receives the tensor ``slot`` describes from global rank ``src``, on ``device``; returns it on CPU."""
    numel = math.prod(slot.shape)
    if numel == 0:
        return torch.empty(slot.shape, dtype=slot.dtype)
    buffer = torch.empty(numel * slot.dtype.itemsize, dtype=torch.uint8, device=device)
    _exchange(dist.irecv, buffer, src, group)
    received = buffer.cpu()  # one device buffer at a time: it is dropped on return
    return received.view(slot.dtype).reshape(slot.shape)


def gather_named_state(part: dict[str, Any], group=None) -> Optional[dict[str, Any]]:
    """Every rank's disjoint named optimizer state merged on rank 0 (collective); ``None`` elsewhere.

    ``state`` and ``master_weights`` are merged; ``param_groups`` are identical on
    every rank and taken from rank 0. The result is on CPU. Only skeletons (names,
    shapes, dtypes, hyperparameters) are pickled; tensors move one at a time with
    point-to-point tensor transfers (Note [gathering a full checkpoint]).
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return to_cpu(part)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    global_rank = (lambda r: dist.get_global_rank(group, r)) if group is not None else (lambda r: r)
    device = transfer_device(group)
    if rank != 0:
        tensors: list[torch.Tensor] = []
        skeleton = {key: split_tensors(part[key], tensors) for key in MERGED_KEYS if key in part}
        dist.gather_object(skeleton, None, dst=global_rank(0), group=group)
        for tensor in tensors:
            send_tensor(tensor, global_rank(0), device, group)
        return None
    skeletons: list = [None] * world
    dist.gather_object(None, skeletons, dst=global_rank(0), group=group)
    merged = to_cpu(part)
    parts = [merged]
    for src in range(1, world):
        slots = sorted(_slots(skeletons[src]), key=lambda slot: slot.index)
        received = [receive_tensor(slot, global_rank(src), device, group) for slot in slots]
        parts.append(fill_tensors(skeletons[src], received))
    for key in MERGED_KEYS:
        if any(key in p for p in parts):
            entries = chain.from_iterable(p.get(key, {}).items() for p in parts)
            merged[key] = dict(sorted(entries, key=lambda kv: repr(kv[0])))  # names, or (name, start) of pieces
    return merged
