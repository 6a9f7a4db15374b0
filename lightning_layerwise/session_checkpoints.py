"""The session's checkpoint half: names, ownership, the format to write and the one on disk, save and restore.

A :class:`~lightning_layerwise.LayerwiseSession` holds one :class:`SessionCheckpoints`
(``session.checkpoints``). The formats (``checkpoint/formats.py``) see it only through
:class:`~lightning_layerwise.checkpoint.formats.CheckpointHost`, the few things a format needs of the run it
saves and loads.
The adapters hand it their checkpoint dictionaries: the Trainer its own, Fabric its
state with the roles of its keys (:meth:`SessionCheckpoints.restore`), a plain loop
:meth:`~lightning_layerwise.LayerwiseSession.save_checkpoint`'s; none of them branches on
a format.
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol, Sequence, Union

import torch
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.optim import Optimizer

from .checkpoint.files import TorchFileIO, is_local_path, resolve
from .checkpoint.formats import FORMATS, CheckpointFormat, CheckpointHost, Loaded, format_on_disk
from .checkpoint.named_state import local_optimizer_state, named_optimizer_state
from .checkpoint.ownership import CheckpointError, Ownership
from .checkpoint.tensor_parallel import TensorParallelCheckpoint
from .experts import expert_key_predicate, grouped_expert_paths

if TYPE_CHECKING:
    from .engine.data_parallel import LayerwiseDataParallel
    from .engine.masters import MasterWeights


class CheckpointedSession(Protocol):
    """What :class:`SessionCheckpoints` reads of the :class:`~lightning_layerwise.LayerwiseSession` it serves
    (described here, not imported: ``session.py`` imports this module)."""

    config: Any
    """The session's ``LayerwiseConfig``."""
    env: Any
    """The session's ``SessionEnv``."""
    wrapper: Optional[LayerwiseDataParallel]
    masters: Optional[MasterWeights]
    groups: Any
    """The session's ``ProcessGroups`` (``None`` when not wrapped)."""

    def sync_parameters(self) -> None: ...


class GlobalNames(dict):
    """Local -> global expert names (Note [expert checkpoints] in ``checkpoint/ownership.py``); a key of no expert
    is its own global name."""

    def __missing__(self, key: str) -> str:
        return key


class SessionCheckpoints:
    """Checkpoints of one :class:`~lightning_layerwise.LayerwiseSession`: a :class:`CheckpointHost`.

    Args:
        session: the session whose wrapper, masters and optimizers are saved and restored.
        name: what errors call the settings' owner (the strategy class, ``LayerwiseSession``).
    """

    def __init__(self, session: CheckpointedSession, name: str) -> None:
        self._session = session
        self.name = name
        self.module: Optional[nn.Module] = None
        """The module checkpoints save and load into: the session's trained module (the Trainer's module in an
        evaluation stage)."""
        self.global_names = GlobalNames()
        """Each ``state_dict`` key's name in checkpoints: experts under their global names."""
        self.released_ownership: Optional[Ownership] = None
        """The last layout's ownership, kept by :meth:`release` (the optimizer still steps its pieces)."""
        self._names: dict[torch.Tensor, str] = {}  # parameter (piece, master) -> checkpoint name; kept by release

    # --- the host ----------------------------------------------------------------------------------------------------
    @property
    def is_global_zero(self) -> bool:
        return self._session.env.rank == 0

    @property
    def checkpoint_format(self) -> str:
        return self._session.config.checkpoint_format

    @property
    def expert_parallel_size(self) -> int:
        return self._session.config.expert_parallel_size

    def ownership(self) -> Ownership:
        """What this rank writes and reads of a checkpoint (Note [checkpoint ownership] in
        ``checkpoint/ownership.py``)."""
        s = self._session
        if s.wrapper is None and self.released_ownership is not None:
            # After training: the optimizer still steps the pieces of the released layout.
            return self.released_ownership
        names = self._names or self.refresh_names()
        masters = [m for _, m in s.masters.pairs] if s.masters is not None else []
        tensors = self.module.state_dict(keep_vars=True)
        in_layout = set() if s.wrapper is None else set(s.wrapper.param_sync.names)
        expert_outside = [t for k, t in tensors.items() if k in self.global_names and t not in in_layout]
        ownership = Ownership.of(s.wrapper, names, self.is_global_zero, masters, self.global_names.__getitem__,
                                 expert_outside)
        return dataclasses.replace(ownership, tensor_parallel=self._tensor_parallel())

    def _tensor_parallel(self) -> Optional[TensorParallelCheckpoint]:
        """How this rank joins and cuts tensor-parallel shards (Note [tensor-parallel checkpoints] in
        ``checkpoint/tensor_parallel.py``); ``None`` without tensor parallelism."""
        s, T = self._session, self._session.config.tensor_parallel_size
        if T == 1 or self.module is None:
            return None
        # The mesh's own data-parallel group (the same ranks as the engine's): it outlives the run's groups, so a
        # checkpoint saved after release (trainer.save_checkpoint after fit) still gathers over it.
        dp = s.device_mesh["data_parallel"]
        return TensorParallelCheckpoint.of(self.module, dp.get_group() if dp.size() > 1 else None,
                                           joins=s.env.rank < T)  # rank d * T + t: data-parallel position 0

    def checkpoint_state(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """``state_dict`` (this rank's module) with expert keys under their global names."""
        return {self.global_names[k]: v for k, v in state_dict.items()} if self.global_names else state_dict

    def named_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """This rank's part of ``optimizer``'s state, keyed by checkpoint name, with its masters."""
        named = named_optimizer_state(optimizer, self._names or self.refresh_names())
        if self._session.masters is not None:
            named["master_weights"] = self._session.masters.state_dict(optimizer)
        return named

    @contextlib.contextmanager
    def naming_failures(self, phase: str):
        """Re-raises a failure inside a checkpoint collective with the phase and this rank named."""
        try:
            yield
        except (Exception, CheckpointException) as error:
            env = self._session.env
            raise CheckpointError(
                f"{phase} failed on rank {env.rank} of {env.world_size} ({type(error).__name__}: "
                f"{str(error)[:300]}). If another rank died or hung, its log has the first error. The previous "
                "checkpoint is intact: saves are written aside and renamed into place when complete.") from error

    def layout_meta(self) -> dict[str, Any]:
        """What a sharded checkpoint records of the layout it was written under."""
        s = self._session
        return {"world_size": s.env.world_size, "bucket_size": s.config.bucket_size,
                "owner_group_size": s.groups.owner_group_size if s.groups else s.env.world_size,
                "expert_parallel_size": s.config.expert_parallel_size}

    def after_model_load(self) -> None:
        """Every rank holds the loaded parameters, and the masters equal them."""
        if self._session.wrapper is not None:
            self._session.wrapper.start_param_sync(force_sync=True)
        if self._session.masters is not None:
            self._session.masters.refresh()

    # --- names -------------------------------------------------------------------------------------------------------
    def refresh_names(self) -> dict[torch.Tensor, str]:
        """Every parameter (its piece, its float32 master) by the name checkpoints use for it; kept."""
        s = self._session
        names: dict[torch.Tensor, str] = {p: n for n, p in self.module.named_parameters()}
        if s.wrapper is not None:
            names.update((shard, n) for n, shard in s.wrapper.named_owned_parameters())
        if s.masters is not None:
            names.update(s.masters.names)
        self._names = {t: self.global_names[n] for t, n in names.items()} if self.global_names else names
        return self._names

    def _pieces(self) -> dict[torch.Tensor, tuple[Any, tuple[int, ...]]]:
        """This rank's piece of each split parameter: ``{piece parameter: (Piece, full shape)}``."""
        wrapper, masters = self._session.wrapper, self._session.masters
        if wrapper is None:
            return {}
        pieces = {shard: (wrapper.records[p].unit.piece, tuple(p.shape))
                  for p, shard in wrapper.records.pieces.items()}
        if masters is not None:  # the optimizer steps a piece's float32 master in its place
            pieces.update({masters.master_of.get(shard, shard): entry for shard, entry in list(pieces.items())})
        return pieces

    # --- saving ------------------------------------------------------------------------------------------------------
    @property
    def save_format(self) -> CheckpointFormat:
        """The format a save writes now (``checkpoint_format``; ``"auto"`` decides by the model's size). Its
        ``optimizer_state(checkpoints, optimizer)`` gives an optimizer's state keyed by parameter name as it writes
        it (Note [checkpoint keys] in ``checkpoint/named_state.py``; may be collective), its
        ``save(checkpoints, target, checkpoint, file_io, storage_options)`` writes (collective)."""
        return FORMATS[self.checkpoint_format].resolve(self)

    def full_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """``optimizer``'s whole state on every rank's host memory, as a full file holds it (collective)."""
        return FORMATS["full"].optimizer_state(self, optimizer)

    def check_save(self, target: str, storage_options: Any = None, call: str = "save", has_model: bool = True) -> None:
        """Refuses, before any work, a save :attr:`save_format` cannot make."""
        fmt = self.save_format
        grouped = grouped_expert_paths(self.module) if self.expert_parallel_size > 1 and self.module is not None \
            else []
        if grouped:
            # Each rank holds a slice of every stack, under one key: nothing global names a slice yet.
            raise CheckpointError(
                f"checkpoints of grouped experts (stacked in 3-D parameters: {grouped[:3]}) with "
                f"expert_parallel_size={self.expert_parallel_size} are not supported yet: each rank holds a "
                "different slice of each stack under the same key. Keep the experts in an nn.ModuleList marked "
                "with llw.mark_experts (those reshard across expert-parallel sizes), or train with "
                "expert_parallel_size=1.")
        if self.expert_parallel_size > 1 and not fmt.holds_every_expert:
            # Rank 0 holds only its own experts; a full file would need every rank's gathered to it.
            raise CheckpointError(
                f"checkpoint_format={fmt.name!r} with expert_parallel_size={self.expert_parallel_size} is not "
                "supported yet: rank 0 holds only its own experts. Use checkpoint_format='sharded' (it reshards "
                "across expert-parallel sizes) and `python -m lightning_layerwise consolidate` for one file.")
        fmt.check_save(self, target, storage_options, call, has_model)

    def module_state_dict(self, module: Optional[nn.Module] = None) -> dict[str, Any]:
        """``module.state_dict()`` (default: :attr:`module`) with every parameter current and whole; with sharded
        parameters gathered for it and copied (collective)."""
        module = module if module is not None else self.module
        self._session.sync_parameters()
        wrapper = self._session.wrapper
        if wrapper is None or not wrapper.shard_parameters or module is not self.module:
            state = module.state_dict()
            tp = self._tensor_parallel() if module is self.module else None
            # A full file holds full tensors (Note [tensor-parallel checkpoints] in checkpoint/tensor_parallel.py).
            return state if tp is None or self.save_format.name != "full" else tp.join_state_dict(state)
        return self._sharded_state_dict(module, wrapper)

    def _sharded_state_dict(self, module: nn.Module, wrapper: LayerwiseDataParallel) -> dict[str, Any]:
        """Note [sharded saves] in ``session.py``: the entries this rank writes in the save format, with at most one
        bucket full at a time. A sharded directory: the parameters this rank steps whole, read from its shard, and
        the split parameters whose first piece it steps, from their buckets gathered one by one; rank 0 also the
        buffers and frozen parameters. A full file: rank 0 every entry, every bucket gathered in turn; the other
        ranks take part in the gathers and keep nothing."""
        live = module.state_dict(keep_vars=True)  # the tensors themselves: nothing is read
        if self.save_format.name == "sharded":
            ownership = self.ownership()
            wanted = {k for k, t in live.items() if ownership.writes(t)}
            buckets = wrapper.param_sync.split_buckets
        else:
            wanted = set(live) if self.is_global_zero else set()
            buckets = wrapper.param_sync.gather_order
        keys_of: dict[int, list[str]] = {}
        for key, tensor in live.items():
            keys_of.setdefault(id(tensor), []).append(key)
        state: dict[str, Any] = {}
        for bucket in buckets:
            with wrapper.param_sync.held([bucket]):
                for p in bucket.params:
                    for key in keys_of.get(id(p), ()):
                        if key in wanted:
                            state[key] = p.detach().clone()  # the full buffer is freed next
        for key, tensor in live.items():
            if key in wanted and key not in state:  # a shard, a buffer, a frozen parameter: held here
                state[key] = tensor.detach() if torch.is_tensor(tensor) else tensor
        return {k: state[k] for k in live if k in state}

    # --- reading -----------------------------------------------------------------------------------------------------
    def resolve_path(self, checkpoint_path: Any) -> Union[Path, str]:
        """Rank 0's path; on a local filesystem, the previous checkpoint if a save replacing it was interrupted
        (Note [atomic save] in ``checkpoint/files.py``). A URL stays a string."""
        env = self._session.env
        target = env.broadcast(str(checkpoint_path))
        if not is_local_path(target):
            return target
        path = resolve(Path(target))
        if path != Path(target):
            env.warn(f"{target!r} does not exist, but {str(path)!r} does: a save to {target!r} was interrupted "
                     "while replacing it. Loading the previous checkpoint.")
        return path

    def read(self, path: Union[Path, str], n_optimizers: int = 0, strict: bool = True,
             weights_only: Optional[bool] = None, strict_hint: str = "", file_io: Any = None,
             memory_map: bool = True) -> Loaded:
        """Reads a checkpoint from :meth:`resolve_path`'s ``path`` in the format found there (collective).
        With sharded parameters a sharded directory loads into the shards, and into the split parameters' buckets
        held full (Note [sharded saves] in ``session.py``)."""
        fmt = format_on_disk(path)
        wrapper = self._session.wrapper
        held = contextlib.nullcontext()
        if fmt.name == "sharded" and wrapper is not None and wrapper.shard_parameters:
            held = wrapper.param_sync.held(wrapper.param_sync.split_buckets)
        with held:
            return fmt.read(self, path, n_optimizers=n_optimizers, strict=strict, weights_only=weights_only,
                            strict_hint=strict_hint, file_io=file_io if file_io is not None else TorchFileIO(),
                            memory_map=memory_map)

    def read_whole(self, path: Union[Path, str], why: str, **read: Any) -> dict[str, Any]:
        """The whole checkpoint at ``path`` as one dictionary (a file; a sharded directory is refused, naming
        ``why``: each rank reads only what it owns of it)."""
        if format_on_disk(path).name == "sharded":
            raise ValueError(f"{str(path)!r} is a sharded checkpoint directory: {why}")
        return self.read(path, **read).state

    def load_model_state(self, state_dict: dict[str, Any], strict: bool = True) -> None:
        """Loads a full state dict into the wrapped module; every rank then holds it (and the masters equal it)."""
        if self.expert_parallel_size > 1:
            # A full file names every expert globally; this rank's module holds only its own, under local names.
            raise CheckpointError(
                f"loading a full checkpoint file with expert_parallel_size={self.expert_parallel_size} is "
                "not supported yet; load it with expert_parallel_size=1, or resume from a sharded checkpoint.")
        tp = self._tensor_parallel()
        if tp is not None:  # each rank keeps its shard of the full tensors
            state_dict = tp.local_state_dict(state_dict)
        wrapper = self._session.wrapper
        if wrapper is not None and wrapper.shard_parameters:
            load_bucket_by_bucket(self.module, wrapper, state_dict, strict)
        else:
            self._session.sync_parameters()
            self.module.load_state_dict(state_dict, strict=strict)
        self.after_model_load()

    def load_optimizer_states(self, optimizers: Sequence[Optimizer], states: Sequence[dict[str, Any]]) -> None:
        """Loads saved optimizer states (named or indexed, any layout): each rank keeps what it steps now."""
        if len(states) != len(optimizers):
            raise CheckpointError(f"the checkpoint holds {len(states)} optimizer state(s) and the model "
                                  f"configures {len(optimizers)}.")
        s = self._session
        names = self._names or self.refresh_names()
        keep = self.ownership().reads  # another rank steps the rest: state exists once in the world
        pieces = self._pieces()
        tp = self._tensor_parallel()
        shard = None if tp is None else (lambda p, entry: tp.local(names.get(p), entry))
        for optimizer, saved in zip(optimizers, states):
            local = local_optimizer_state(saved, optimizer, names, keep, pieces,
                                          is_expert=expert_key_predicate(self.module), shard=shard)
            local["state"] = {k: _own_copy(v) for k, v in local["state"].items()}  # off a memory-mapped file
            optimizer.load_state_dict(local)
            _optimizer_to_device(optimizer, s.env.device)
            if s.masters is not None and saved.get("master_weights"):
                masters = saved["master_weights"]
                s.masters.load_state_dict(masters if tp is None else tp.local_state_dict(masters))

    def restore(self, path: Union[Path, str], *, module_key: Optional[str], optimizers: Sequence[Optimizer],
                load_module: Callable[[dict[str, Any]], None], optimizer_keys: Optional[Sequence[str]] = None,
                strict: bool = True, strict_hint: str = "", roles_key: str = "fabric", **read: Any) -> dict[str, Any]:
        """Restores the module (through ``load_module``, given a full state dict) and ``optimizers`` from the
        checkpoint at ``path``, in either format; returns the rest of the checkpoint's dictionary. Collective.

        The dictionary keeps the module under ``module_key`` and the optimizers under ``optimizer_keys``, one key
        each (Fabric's state), or with ``optimizer_keys=None`` as a list under ``"optimizer_states"`` (a Trainer
        checkpoint, :meth:`~lightning_layerwise.LayerwiseSession.save_checkpoint`); a Trainer checkpoint file is
        understood for Fabric's keys too. A sharded directory reads the model into the wrapped module itself and
        recorded the keys the optimizers were saved under (``meta["layerwise"][roles_key]``): the states follow
        their keys, whatever the order.
        """
        if module_key is None and format_on_disk(path).name == "sharded":
            raise ValueError("loading a sharded checkpoint needs the trained module in the state "
                             "(e.g. {'model': model, 'optimizer': optimizer, ...}).")
        loaded = self.read(path, n_optimizers=len(optimizers), strict=strict, strict_hint=strict_hint, **read)
        rest = loaded.state
        if loaded.model_loaded:
            saved = rest.pop("layerwise", {}).get(roles_key, {})
            saved_keys = saved.get("optimizers", [saved["optimizer"]] if saved.get("optimizer") else [])
            states = loaded.optimizer_states or []
            if states and optimizer_keys is not None and sorted(saved_keys) == sorted(optimizer_keys):
                states = [states[saved_keys.index(k)] for k in optimizer_keys]  # by name; else in saved order
            if optimizers and (states or optimizer_keys is None):
                self.load_optimizer_states(optimizers, states)
            return rest
        if module_key is not None:
            # A Trainer checkpoint file keeps the model under "state_dict" and the optimizers in a list.
            entry = rest.pop(module_key) if module_key in rest else rest.pop("state_dict", None)
            if entry is None:
                raise CheckpointError(f"{str(path)!r} holds no module state under {module_key!r} (nor a "
                                      "Trainer checkpoint's 'state_dict').")
            load_module(entry)
        if optimizers:
            self.load_optimizer_states(optimizers, _optimizer_entries(rest, optimizer_keys, path))
        return rest

    def release(self) -> None:
        """The layout is about to go: keep what this rank owned of it, for saves after training."""
        self.released_ownership = self.ownership()


def load_bucket_by_bucket(module: nn.Module, wrapper, state_dict: dict[str, Any], strict: bool) -> None:
    """``module.load_state_dict(state_dict, strict)`` with sharded parameters (Note [sharded saves] in
    ``session.py``): each bucket is held full while its entries are copied in (every rank copies alike, so each
    shard keeps its part), then the rest; missing and unexpected keys are refused as ``load_state_dict`` refuses
    them, before anything is copied."""
    live = module.state_dict(keep_vars=True)
    missing = [k for k in live if k not in state_dict]
    unexpected = [k for k in state_dict if k not in live]
    if strict and (missing or unexpected):
        parts = ([f"Unexpected key(s) in state_dict: {', '.join(repr(k) for k in unexpected)}. "] if unexpected
                 else []) + ([f"Missing key(s) in state_dict: {', '.join(repr(k) for k in missing)}. "] if missing
                             else [])
        raise RuntimeError(f"Error(s) in loading state_dict for {type(module).__name__}:\n\t" + "\n\t".join(parts))
    keys_of: dict[int, list[str]] = {}
    for key, tensor in live.items():
        keys_of.setdefault(id(tensor), []).append(key)
    done: set[str] = set()
    for bucket in wrapper.param_sync.gather_order:
        part = {k: state_dict[k] for p in bucket.params for k in keys_of.get(id(p), ()) if k in state_dict}
        with wrapper.param_sync.held([bucket]):
            module.load_state_dict(part, strict=False)
        done.update(part)
    module.load_state_dict({k: v for k, v in state_dict.items() if k not in done}, strict=False)


def _optimizer_entries(rest: dict[str, Any], keys: Optional[Sequence[str]], path: Any) -> list[dict[str, Any]]:
    """The optimizer states of a checkpoint file (popped from ``rest``): under ``keys``, or a Trainer checkpoint's
    ``optimizer_states`` list (``keys=None``, or none of ``keys`` present and the list as long as ``keys``)."""
    if keys is None or not any(k in rest for k in keys):
        trainer_states = rest.pop("optimizer_states", [])
        if keys is None or len(trainer_states) == len(keys):
            return list(trainer_states)  # the optimizers in order
        rest["optimizer_states"] = trainer_states
    missing = [k for k in keys if k not in rest]
    if missing:
        raise CheckpointError(f"{str(path)!r} holds no optimizer state under {missing[0]!r} (nor a Trainer "
                              "checkpoint's 'optimizer_states' for every optimizer).")
    return [rest.pop(k) for k in keys]


def _own_copy(value):
    if torch.is_tensor(value):
        return value.clone()
    if isinstance(value, dict):
        return {k: _own_copy(v) for k, v in value.items()}
    return value


def _optimizer_to_device(optimizer: Optimizer, device: torch.device) -> None:
    """Moves the optimizer state to ``device``, leaving ``step`` counters where they are (as Lightning does)."""
    for state in optimizer.state.values():
        for key, value in list(state.items()):
            if key != "step" and torch.is_tensor(value):
                state[key] = value.to(device)
