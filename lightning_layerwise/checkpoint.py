"""Checkpoints keyed by parameter name, in two formats, written so that a crash loses nothing.

Every trainable parameter has exactly one owner and a name, so a checkpoint
never needs to know the world size, the bucket size or the layout that wrote
it: it is a set of named tensors. This module is the engine half (plain torch
and ``torch.distributed.checkpoint``); ``strategy.py`` calls it from Lightning's
hooks.

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

Note [sharded layout]
    A sharded checkpoint is a directory written by ``torch.distributed.checkpoint``
    with the state dict ``{"model": {key: tensor}, "optimizer_0": named form}``,
    plus Lightning's ``meta.pt`` with everything else (loops, callbacks, LR
    schedulers, precision scaler) and a ``"layerwise"`` record. Each parameter
    and its optimizer state are written once, by the parameter's owner; buffers,
    frozen parameters and the param groups by rank 0. This is the layout of
    Lightning's own sharded checkpoints, so
    ``python -m lightning.pytorch.utilities.consolidate_checkpoint DIR`` turns one
    into a single ordinary file. On load each rank reads only the parameters and
    the optimizer state it owns under the *new* layout, and an all-gather spreads
    the parameters; no rank ever holds the whole optimizer state.

Note [atomic save]
    A checkpoint is written aside (``.NAME.partial``) and renamed into place when
    complete, so a process killed while saving leaves the previous checkpoint
    under ``NAME`` intact. A directory cannot replace another in one rename: the
    old one is first renamed to ``.NAME.old``, the new one into place, and then
    the old one is deleted. Should the process die between the two renames,
    loading ``NAME`` finds ``.NAME.old`` and loads it. ``meta.pt`` is written last:
    a directory without it is an interrupted save, never a checkpoint.
"""

from __future__ import annotations

import os
import shutil
from itertools import chain
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

import torch
import torch.distributed as dist

FORMAT = "lightning_layerwise.sharded"
FORMAT_VERSION = 1
META_FILENAME = "meta.pt"  # the name Lightning's sharded checkpoints and consolidate_checkpoint use
DCP_METADATA_FILENAME = ".metadata"
MODEL_KEY = "model"


def optimizer_key(index: int) -> str:
    return f"optimizer_{index}"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded: incomplete, foreign or not matching the model/optimizer."""


# --- named optimizer state ---------------------------------------------------------------


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
                          names: Mapping[torch.Tensor, str], keep: Callable[[torch.Tensor], bool]) -> dict[str, Any]:
    """A saved state dict (named or indexed) as ``optimizer.load_state_dict`` input, state only where ``keep``.

    Raises :class:`CheckpointError` if the param groups do not line up.
    """
    saved_groups, groups = saved["param_groups"], optimizer.param_groups
    if len(saved_groups) != len(groups):
        raise CheckpointError(f"the checkpoint's optimizer has {len(saved_groups)} param group(s), this optimizer "
                              f"{len(groups)}; build the param groups as in the run that saved it.")
    by_saved_id: dict[Any, torch.Tensor] = {}
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
    state = {local_id[by_saved_id[k]]: v for k, v in saved["state"].items()
             if k in by_saved_id and keep(by_saved_id[k])}
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


def gather_named_state(part: dict[str, Any], group=None) -> Optional[dict[str, Any]]:
    """Every rank's disjoint named optimizer state merged on rank 0 (collective); ``None`` elsewhere.

    ``state`` and ``master_weights`` are merged; ``param_groups`` are identical on
    every rank and taken from rank 0.
    """
    part = to_cpu(part)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return part
    rank = dist.get_rank(group)
    gathered: Optional[list] = [None] * dist.get_world_size(group) if rank == 0 else None
    dist.gather_object(part, gathered, dst=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    if rank != 0:
        return None
    merged = dict(gathered[0])
    for key in ("state", "master_weights"):
        if key in merged:
            merged[key] = dict(sorted(chain.from_iterable(other[key].items() for other in gathered)))
    return merged


# --- atomic writes -----------------------------------------------------------------------


def partial_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.partial")


def aside_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.old")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def commit(written: Path, path: Path) -> None:
    """Moves the complete checkpoint ``written`` to ``path``, replacing what was there (Note [atomic save])."""
    if written.is_file():
        with open(written, "rb") as f:
            os.fsync(f.fileno())
    old = aside_path(path)
    if path.is_dir() and not path.is_symlink():
        _remove(old)
        os.rename(path, old)
        os.rename(written, path)
        _fsync_dir(path.parent)
        shutil.rmtree(old)
    else:
        os.replace(written, path)  # atomic for a file, and over a file or a symlink
        _fsync_dir(path.parent)


def resolve(path: Path) -> Path:
    """``path``, or the previous checkpoint a save interrupted between its two renames left aside."""
    if not path.exists() and aside_path(path).is_dir():
        return aside_path(path)
    return path


# --- sharded format ----------------------------------------------------------------------


def save_sharded(path: Path, state: dict[str, Any], meta: Optional[dict[str, Any]], group=None) -> None:
    """Writes ``state`` with ``torch.distributed.checkpoint`` and ``meta`` (from rank 0) atomically (collective).

    ``state`` is this rank's part (Note [sharded layout]); ``meta`` is only used on rank 0.
    """
    from torch.distributed.checkpoint import FileSystemWriter, save

    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    tmp = partial_path(path)
    if rank == 0:
        _remove(tmp)  # left over by an interrupted save
        tmp.mkdir(parents=True)
    if distributed:
        dist.barrier(group)
    save(state, storage_writer=FileSystemWriter(tmp, sync_files=True), process_group=group,
         no_dist=not distributed)
    if rank == 0:
        torch.save(meta, tmp / META_FILENAME)
        with open(tmp / META_FILENAME, "rb") as f:
            os.fsync(f.fileno())
        commit(tmp, path)
    if distributed:
        dist.barrier(group)


def read_sharded_metadata(path: Path, weights_only: Optional[bool] = None):
    """``(meta, dcp_metadata)`` of a sharded checkpoint, after checking that every file it needs is complete."""
    from torch.distributed.checkpoint import FileSystemReader

    where = f"sharded checkpoint {str(path)!r}"
    if not (path / META_FILENAME).is_file():
        hint = (" It looks like a save that was interrupted (the partial directory of a save is renamed into "
                "place only when complete); load the previous checkpoint instead."
                if (path / DCP_METADATA_FILENAME).exists() or any(path.glob("*.distcp")) else "")
        raise CheckpointError(f"{where} has no {META_FILENAME}: it is not a complete checkpoint.{hint}")
    if not (path / DCP_METADATA_FILENAME).is_file():
        raise CheckpointError(f"{where} has no {DCP_METADATA_FILENAME} (torch.distributed.checkpoint's index); "
                              "the directory is incomplete or was not written by torch.distributed.checkpoint.")
    meta = torch.load(path / META_FILENAME, map_location="cpu",
                      weights_only=False if weights_only is None else weights_only)
    record = meta.get("layerwise") if isinstance(meta, dict) else None
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise CheckpointError(f"{where} was not written by LayerwiseStrategy (its {META_FILENAME} has no "
                              "'layerwise' record). Convert it into one file with `python -m "
                              "lightning.pytorch.utilities.consolidate_checkpoint DIR` and load that file.")
    if record.get("version", 0) > FORMAT_VERSION:
        raise CheckpointError(f"{where} has format version {record['version']}; this lightning_layerwise reads "
                              f"up to version {FORMAT_VERSION}. Upgrade lightning_layerwise.")
    metadata = FileSystemReader(path).read_metadata()
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{where} is missing the data file {name!r} that its index refers to; copy "
                                  "the whole directory.")
        if file.stat().st_size < size:
            raise CheckpointError(f"{where}: data file {name!r} is truncated ({file.stat().st_size} bytes, its "
                                  f"index needs {size}).")
    return meta, metadata


def checkpoint_items(metadata) -> dict[tuple, Any]:
    """The checkpoint's entries by their path in the nested state dict, e.g. ``("model", "fc.weight")``."""
    by_fqn = metadata.state_dict_metadata
    return {tuple(path): by_fqn[fqn] for fqn, path in metadata.planner_data.items() if fqn in by_fqn}


def empty_like_item(item) -> Any:
    """A tensor to load a saved tensor into (on CPU), or ``None`` for a saved Python object."""
    size = getattr(item, "size", None)
    if size is None:
        return None
    return torch.empty(size, dtype=item.properties.dtype)


def nest(entries: Mapping[tuple, Any]) -> dict[str, Any]:
    """A nested dict/list state dict from ``{path: leaf}`` (integer path parts become list indices)."""
    root: dict = {}
    for path, leaf in entries.items():
        node: Any = root
        for part, following in zip(path[:-1], path[1:]):
            empty = [] if isinstance(following, int) else {}
            if isinstance(node, list):
                while len(node) <= part:
                    node.append(None)
                if node[part] is None:
                    node[part] = empty
                node = node[part]
            else:
                node = node.setdefault(part, empty)
        if isinstance(node, list):
            while len(node) <= path[-1]:
                node.append(None)
        node[path[-1]] = leaf
    return root


def load_sharded(path: Path, state: dict[str, Any], group=None) -> None:
    """Loads the entries of ``state`` (nested; tensors are filled in place) from ``path`` (collective)."""
    from torch.distributed.checkpoint import FileSystemReader, load

    distributed = dist.is_available() and dist.is_initialized()
    load(state, storage_reader=FileSystemReader(path), process_group=group, no_dist=not distributed)
