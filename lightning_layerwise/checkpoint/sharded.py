"""The sharded format: a ``torch.distributed.checkpoint`` directory, its reading and consolidation.

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


Note [weights_only]
    Everything this module reads back from a checkpoint it wrote is unpickled
    with ``weights_only=True`` semantics unless the caller passes
    ``weights_only=False`` (Lightning's ``fit(..., weights_only=False)``): ``meta.pt``
    with ``torch.load(weights_only=True)`` (:func:`load_meta`), the Python objects
    inside the ``torch.distributed.checkpoint`` files (the param groups), which
    DCP's default planner would unpickle with ``weights_only=False``, are first
    loaded with ``weights_only=True``, and DCP's ``.metadata`` index, a plain
    pickle, through an unpickler that allows only torch.distributed.checkpoint's
    classes, ``torch.Size``, dtypes, layouts and paths (:func:`read_dcp_index`).
    A refused object raises :class:`CheckpointError` naming its class.
"""

from __future__ import annotations

import functools
import io
import os
import pickle
import re
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

import torch
import torch.distributed as dist

from .files import commit, partial_path, remove_path, resolve
from .ownership import MODEL_KEY, CheckpointError, Ownership, optimizer_key, piece_sharded_tensor

FORMAT = "lightning_layerwise.sharded"


FORMAT_VERSION = 1


META_FILENAME = "meta.pt"  # the name Lightning's sharded checkpoints and consolidate_checkpoint use


DCP_METADATA_FILENAME = ".metadata"


README_FILENAME = "README.txt"  # for whoever finds the directory where one file was expected


CONSOLIDATE_COMMAND = "python -m lightning_layerwise consolidate"


def save_sharded(path: Path, state: dict[str, Any], meta: Optional[dict[str, Any]], group=None) -> None:
    """Writes ``state`` with ``torch.distributed.checkpoint`` and ``meta`` (from rank 0) atomically (collective).

    ``state`` is this rank's part (Note [sharded layout]); ``meta`` is only used on rank 0.
    """
    from torch.distributed.checkpoint import FileSystemWriter, save

    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    tmp = partial_path(path)
    if rank == 0:
        remove_path(tmp)  # left over by an interrupted save
        tmp.mkdir(parents=True)
    if distributed:
        dist.barrier(group)
    save(state, storage_writer=FileSystemWriter(tmp, sync_files=True), process_group=group,
         no_dist=not distributed)
    if rank == 0:
        torch.save(meta, tmp / META_FILENAME)
        with open(tmp / META_FILENAME, "rb") as f:
            os.fsync(f.fileno())
        (tmp / README_FILENAME).write_text(readme_text(path.name))
        commit(tmp, path)
    if distributed:
        dist.barrier(group)


def readme_text(name: str) -> str:
    """What a sharded checkpoint directory says of itself (``README.txt``)."""
    return (f"{name} is a sharded lightning-layerwise checkpoint: each rank wrote the parameters\n"
            "it owned and their optimizer state (torch.distributed.checkpoint files), and rank 0\n"
            "wrote meta.pt.\n\n"
            "Resume it with strategy=\"layerwise\" at any number of processes:\n\n"
            f"    trainer.fit(model, ckpt_path=\"{name}\")     # or fabric.load(\"{name}\", state)\n\n"
            "LightningModule.load_from_checkpoint, strategy=\"ddp\" and torch.load read one file.\n"
            "Convert it first (one process, no GPU needed):\n\n"
            f"    {CONSOLIDATE_COMMAND} {name} {Path(name).stem}.full.ckpt\n")


def consolidate(src: Path, dst: Path, weights_only: Optional[bool] = None) -> Path:
    """Converts the sharded checkpoint ``src`` into one file ``dst`` (one process, no process group).

    The file is what ``checkpoint_format="full"`` would have written: a Trainer checkpoint (``state_dict``,
    ``optimizer_states`` and the rest of ``meta.pt``), or for a ``fabric.save`` directory the keys Fabric saved
    under. Tensors are read whole, pieces joined; written aside and renamed into place (Note [atomic save] in
    ``checkpoint/files.py``).
    """
    src, dst = resolve(Path(src)), Path(dst)
    meta, metadata = read_sharded_metadata(src, weights_only)
    state = nest({path: empty_like_item(item) for path, item in checkpoint_items(metadata).items()})
    load_sharded(src, state, weights_only=weights_only)
    record = meta.pop("layerwise", {})
    optimizers = [state.get(optimizer_key(i)) for i in range(len(state)) if optimizer_key(i) in state]
    fabric = record.get("fabric")
    if fabric:
        out = {fabric["module"]: state.get(MODEL_KEY, {}), **dict(zip(fabric.get("optimizers", []), optimizers)),
               **meta}
    else:
        out = {"state_dict": state.get(MODEL_KEY, {}), **({"optimizer_states": optimizers} if optimizers else {}),
               **meta}
    dst.parent.mkdir(parents=True, exist_ok=True)
    partial = partial_path(dst)
    torch.save(out, partial)
    commit(partial, dst)
    return dst


def _consolidate_main(argv: Optional[list[str]] = None) -> None:
    """``python -m lightning_layerwise consolidate SRC DST``."""
    import argparse

    parser = argparse.ArgumentParser(prog=CONSOLIDATE_COMMAND, description=(
        "Convert a sharded lightning-layerwise checkpoint directory into one file that "
        "LightningModule.load_from_checkpoint, strategy='ddp' and torch.load read."))
    parser.add_argument("src", help="the sharded checkpoint directory")
    parser.add_argument("dst", help="the file to write")
    parser.add_argument("--trust-pickles", action="store_true", help=(
        "read Python objects in meta.pt with torch.load(weights_only=False) (e.g. hyperparameters of a class "
        "of your own); only for checkpoints you trust"))
    args = parser.parse_args(argv)
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)  # torch.distributed.checkpoint's ShardedTensor notice
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process is the intent
    if not Path(args.src).is_dir():
        parser.error(f"{args.src!r} is not a directory; a sharded checkpoint is one (a file needs no conversion).")
    dst = consolidate(Path(args.src), Path(args.dst), weights_only=False if args.trust_pickles else None)
    print(f"wrote {dst} ({dst.stat().st_size / 2**20:.1f} MiB)")


def load_meta(file: Path, weights_only: Optional[bool] = None) -> Any:
    """``torch.load`` of a ``meta.pt``, with ``weights_only=True`` unless the caller passes ``False``.

    Everything this package and Lightning write there (loops, callbacks, schedulers,
    the scaler, plain hyperparameters, the ``"layerwise"`` record) loads with
    ``weights_only=True``. Objects of other classes, e.g. a dataclass saved by
    ``save_hyperparameters``, are refused with a :class:`CheckpointError` that names
    the class and both ways to accept it.
    """
    try:
        return torch.load(file, map_location="cpu", weights_only=True if weights_only is None else weights_only)
    except pickle.UnpicklingError as err:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(err))
        what = f"an object of {found.group(1)}" if found else f"an object it refuses ({err})"
        raise CheckpointError(
            f"{str(file)!r} holds {what}, which torch.load(weights_only=True) does not load. If the checkpoint "
            "comes from a source you trust, allow it with torch.serialization.add_safe_globals([...]) or load with "
            "weights_only=False, e.g. trainer.fit(model, ckpt_path=..., weights_only=False)."
        ) from err


# What a torch.distributed.checkpoint index (``.metadata``, a plain pickle) refers to besides the classes
# of torch.distributed.checkpoint's own modules and torch's dtypes, layouts and memory formats.
_INDEX_GLOBALS = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict")}


_PATH_CLASSES = {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"}


class _IndexUnpickler(pickle.Unpickler):
    """Unpickles a torch.distributed.checkpoint index, refusing any other global (as ``weights_only`` would)."""

    def find_class(self, module: str, name: str) -> Any:
        found = None
        if module.split(".")[0] in ("torch", "collections", "pathlib"):  # imports nothing else
            try:
                found = super().find_class(module, name)
            except (ImportError, AttributeError):
                pass
        allowed = found is not None and (
            (module, name) in _INDEX_GLOBALS
            or (module.split(".")[0] == "pathlib" and name in _PATH_CLASSES)  # pathlib._local on Python 3.13
            or (module.startswith("torch.distributed.checkpoint.") and isinstance(found, type))
            or (module == "torch" and isinstance(found, (torch.dtype, torch.layout, torch.memory_format))))
        if not allowed:
            raise pickle.UnpicklingError(f"Unsupported global: GLOBAL {module}.{name}")
        return found


def read_dcp_index(path: Path):
    """The ``.metadata`` index of a sharded checkpoint, unpickled with an allowlist (Note [weights_only])."""
    file = path / DCP_METADATA_FILENAME
    with open(file, "rb") as f:
        try:
            return _IndexUnpickler(f).load()
        except pickle.UnpicklingError as err:
            raise CheckpointError(
                f"{str(file)!r} refers to {str(err).replace('Unsupported global: GLOBAL ', '')}, which a "
                "torch.distributed.checkpoint index does not hold; it was not written by torch.distributed."
                "checkpoint. Load it with weights_only=False only if it comes from a source you trust."
            ) from err


@functools.cache
def _weights_only_load_planner() -> type:
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
        """DCP's default planner, but a saved Python object (e.g. the param groups) must load with weights_only."""

        def load_bytes(self, read_item, value) -> None:
            data = value.read()
            try:  # DefaultLoadPlanner unpickles with weights_only=False; refuse first what True would refuse
                torch.load(io.BytesIO(data), weights_only=True)
            except pickle.UnpicklingError as err:
                found = re.search(r"Unsupported global: GLOBAL (\S+)", str(err))
                raise CheckpointError(
                    f"the checkpoint entry {read_item.dest_index.fqn!r} holds "
                    f"{f'an object of {found.group(1)}' if found else 'an object'}, which "
                    "torch.load(weights_only=True) does not load. If the checkpoint comes from a source you "
                    "trust, allow it with torch.serialization.add_safe_globals([...])."
                ) from err
            super().load_bytes(read_item, io.BytesIO(data))

    return WeightsOnlyLoadPlanner


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
    meta = load_meta(path / META_FILENAME, weights_only)
    record = meta.get("layerwise") if isinstance(meta, dict) else None
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise CheckpointError(f"{where} was not written by LayerwiseStrategy (its {META_FILENAME} has no "
                              "'layerwise' record). Convert it into one file with `python -m "
                              "lightning.pytorch.utilities.consolidate_checkpoint DIR` and load that file.")
    if record.get("version", 0) > FORMAT_VERSION:
        raise CheckpointError(f"{where} has format version {record['version']}; this lightning_layerwise reads "
                              f"up to version {FORMAT_VERSION}. Upgrade lightning_layerwise.")
    metadata = FileSystemReader(path).read_metadata() if weights_only is False else read_dcp_index(path)
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


def read_sharded_checkpoint(path: Path, tensors: Mapping[str, torch.Tensor], ownership: Ownership,
                            n_optimizers: int, strict: bool, model_name: str,
                            weights_only: Optional[bool] = None,
                            other_experts: Callable[[str], bool] = lambda key: False,
                            strict_hint: str = "Set `strict_loading = False` on the LightningModule to load the keys "
                                               "that match."
                            ) -> tuple[dict[str, Any], Optional[list]]:
    """Reads this rank's part of a sharded checkpoint into ``tensors`` (in place) and returns what else it holds.

    ``tensors`` is ``module.state_dict(keep_vars=True)``; each rank reads the model
    entries it owns or shares (the caller all-gathers the rest). With
    ``n_optimizers > 0`` (fitting) it also reads the owned optimizer state and the
    param groups of that many optimizers. Returns Lightning's meta dict and the
    optimizer states in named form (``None`` without optimizers). Collective.
    """
    meta, metadata = read_sharded_metadata(path, weights_only)
    items = checkpoint_items(metadata)
    saved_keys = {p[1] for p in items if p[0] == MODEL_KEY and len(p) == 2}
    # the experts other ranks hold are neither missing nor unexpected (Note [expert checkpoints] in
    # ``checkpoint/ownership.py``)
    if strict:
        missing = sorted(set(tensors) - saved_keys)
        unexpected = sorted(k for k in saved_keys - set(tensors) if not other_experts(k))
        if missing or unexpected:
            raise CheckpointError(
                f"sharded checkpoint {str(path)!r} does not match {model_name}: missing keys {missing[:10]}, "
                f"unexpected keys {unexpected[:10]}. {strict_hint}")
    tp = ownership.tensor_parallel  # this rank's shards load as chunks of the global tensors
    entries: dict[tuple, Any] = {(MODEL_KEY, key): tensor.detach() for key, tensor in tensors.items()
                                 if key in saved_keys and ownership.reads(tensor)}
    if tp is not None:
        entries = {path: tp.loadable(path[1], tensor) for path, tensor in entries.items()}
    pieces: dict[tuple, torch.Tensor] = {}  # optimizer entries read as this rank's piece (or shard) only
    if n_optimizers:
        saved_optimizers = len({p[0] for p in items if p[0].startswith("optimizer_")})
        if saved_optimizers != n_optimizers:
            raise CheckpointError(
                f"sharded checkpoint {str(path)!r} holds {saved_optimizers} optimizer state(s) and the model "
                f"configures {n_optimizers}; it was saved without optimizer state "
                "(ModelCheckpoint(save_weights_only=True)?) or for another set of optimizers.")
        for item_path, item in items.items():
            if not item_path[0].startswith("optimizer_"):
                continue
            part = item_path[1] if len(item_path) > 1 else None
            if part == "param_groups" or (part in ("state", "master_weights")
                                          and item_path[2] in ownership.owned_names):
                entries[item_path] = empty_like_item(item)
                piece = ownership.piece(item_path[2]) if part != "param_groups" else None
                slot = ownership.split.get(item_path[2]) if piece is not None else None
                view = tp.read_view(item_path[2], item, ownership) if tp is not None and part != "param_groups" \
                    else None
                if view is not None:
                    pieces[item_path], entries[item_path] = view
                elif slot is not None and tuple(getattr(item, "size", ())) == tuple(slot.shape):
                    # Only this rank's piece is read (Note [pieces in checkpoints] in ``checkpoint/ownership.py``).
                    flat = torch.empty(piece.numel, dtype=item.properties.dtype)
                    pieces[item_path] = flat
                    entries[item_path] = piece_sharded_tensor(flat, slot, *ownership.placement(item_path[2]))
    state = nest(entries)
    with torch.no_grad():
        load_sharded(path, state, weights_only=weights_only)
    for item_path, flat in pieces.items():
        node = state
        for part in item_path[:-1]:
            node = node[part]
        node[item_path[-1]] = flat
    optimizer_states = [state[optimizer_key(i)] for i in range(n_optimizers)] if n_optimizers else None
    return meta, optimizer_states


def load_sharded(path: Path, state: dict[str, Any], group=None, weights_only: Optional[bool] = None) -> None:
    """Loads the entries of ``state`` (nested; tensors are filled in place) from ``path`` (collective).

    Unless ``weights_only=False``, the index and every saved Python object are read as
    ``torch.load(weights_only=True)`` would (Note [weights_only]).
    """
    from torch.distributed.checkpoint import FileSystemReader, load
    from torch.distributed.checkpoint.api import CheckpointException

    planner = None
    if weights_only is not False:
        read_dcp_index(path)  # refuses a foreign global before torch.distributed.checkpoint unpickles the index
        planner = _weights_only_load_planner()()
    distributed = dist.is_available() and dist.is_initialized()
    try:
        load(state, storage_reader=FileSystemReader(path), planner=planner, process_group=group,
             no_dist=not distributed)
    except CheckpointException as err:  # DCP wraps every rank's failure; surface a refused object as ours
        refused = [exc for exc, _ in err.failures.values() if isinstance(exc, CheckpointError)]
        if refused:
            raise CheckpointError(str(refused[0])) from err
        raise
