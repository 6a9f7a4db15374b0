"""The checkpoint formats, one class each behind one interface.

Note [checkpoint formats]
    A :class:`CheckpointFormat` knows how one format turns a session's state into bytes and
    back: what form the optimizer state takes before the host assembles the checkpoint
    (:meth:`~CheckpointFormat.optimizer_state`), what it refuses before any work
    (:meth:`~CheckpointFormat.check_save`), how it writes (:meth:`~CheckpointFormat.save`) and
    how it reads (:meth:`~CheckpointFormat.read`). The session picks the format to *write* from
    ``checkpoint_format``; the format to *read* is the one found on disk
    (:func:`format_on_disk`: a directory is sharded, anything else a file), so either
    setting resumes from either format. The hosts (the Trainer and Fabric strategies, a
    plain loop) say only where the model and the optimizers sit in their checkpoint
    dictionary (:class:`Checkpoint`); no host branches on the format.

    * :class:`FullFile`: one ordinary file, written by rank 0 through the host's file IO
      (Lightning's ``CheckpointIO`` plugin, or :class:`~lightning_layerwise.checkpoint.TorchFileIO`),
      aside and renamed into place on a local filesystem (Note [atomic save] in ``checkpoint/files.py``). The optimizer
      state is gathered to rank 0. Loadable by ``ddp``, ``load_from_checkpoint`` and ``torch.load``.
    * :class:`ShardedDirectory`: a ``torch.distributed.checkpoint`` directory each rank writes
      its owned part of, plus ``meta.pt`` (Note [sharded layout] in ``checkpoint/sharded.py``) and a
      ``README.txt`` naming ``python -m lightning_layerwise consolidate`` for whoever finds the
      directory where one file was expected.
    * :class:`Auto` (the default): :class:`FullFile` for a model of at most
      :data:`AUTO_FULL_LIMIT` bytes, :class:`ShardedDirectory` above it; see Note [auto format].

Note [auto format]
    Lightning users open a checkpoint in three ways the sharded directory cannot serve:
    ``LightningModule.load_from_checkpoint``, resuming under ``ddp``, ``torch.load``. A full
    file serves all three; its costs grow with the model. Rank 0 holds the whole checkpoint
    in host memory while it writes (the model plus every rank's optimizer state, about 3x
    the parameters under AdamW), and one process writes every byte (the costs measured:
    ``benchmarks/bench_checkpoint.py``, docs/checkpointing.md). So ``"auto"`` writes one file while the model's parameters and buffers take at most
    :data:`AUTO_FULL_LIMIT` (512 MiB: GPT-2 124M in float32, a full file of about 1.5 GiB
    under AdamW), and a sharded directory above it, where a rank-0 gather of several GiB
    per save would cost minutes and memory. The rule reads only the model, which every rank holds alike, so every rank
    takes the same branch with no collective. Expert parallelism always shards: rank 0
    does not hold the other ranks' experts.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, ContextManager, Optional, Protocol, Union

import torch
from torch import nn
from torch.optim import Optimizer

from .files import commit, is_local_path, partial_path
from .named_state import gather_named_state
from .ownership import (MODEL_KEY, Ownership, join_pieces, mark_pieces, model_entries_to_write, optimizer_key,
                        pieces_as_sharded_tensors)
from .sharded import FORMAT, FORMAT_VERSION, read_sharded_checkpoint, save_sharded
from ..experts import expert_key_predicate


class CheckpointHost(Protocol):
    """What a :class:`CheckpointFormat` needs of the run it saves and loads (the session's
    :class:`~lightning_layerwise.session_checkpoints.SessionCheckpoints` is one)."""

    name: str
    """Who is saving, for error messages (``LayerwiseStrategy``, ``LayerwiseSession``…)."""
    module: Optional[nn.Module]
    is_global_zero: bool
    checkpoint_format: str
    expert_parallel_size: int

    def ownership(self) -> Ownership: ...

    def checkpoint_state(self, state_dict: dict[str, Any]) -> dict[str, Any]: ...

    def named_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]: ...

    def naming_failures(self, phase: str) -> ContextManager[None]: ...

    def layout_meta(self) -> dict[str, Any]: ...

    def after_model_load(self) -> None: ...


@dataclass
class Checkpoint:
    """A checkpoint as the host builds it: the one-file form and where its parts are in it."""

    whole: dict[str, Any]
    """Everything, as one file holds it (the host's keys: Lightning's ``state_dict``, Fabric's ``model``…)."""
    model_state: Optional[dict[str, Any]]
    """The trained module's state dict (``None``: the checkpoint holds no trained module)."""
    optimizer_states: list[dict[str, Any]] = field(default_factory=list)
    """Each optimizer's state, as :meth:`CheckpointFormat.optimizer_state` made it."""
    meta: dict[str, Any] = field(default_factory=dict)
    """Everything else (loops, callbacks, schedulers, the host's records)."""


@dataclass
class Loaded:
    """What :meth:`CheckpointFormat.read` returns."""

    state: dict[str, Any]
    """A file: its whole dictionary. A sharded directory: ``meta.pt`` (everything but model and optimizers)."""
    model_loaded: bool
    """Whether the trained module already holds the checkpoint's parameters (sharded: each rank read its own)."""
    optimizer_states: Optional[list[dict[str, Any]]] = None
    """Sharded: the optimizer states this rank keeps, in saved order (``None``: none asked for)."""


class CheckpointFormat(ABC):
    """One checkpoint format (Note [checkpoint formats])."""

    def resolve(self, host: CheckpointHost) -> "CheckpointFormat":
        """The format a save writes now (itself, but for :class:`Auto`)."""
        return self

    name: ClassVar[str]
    holds_every_expert: ClassVar[bool]
    """Whether it can be written under expert parallelism (rank 0 holds only its own experts)."""

    @abstractmethod
    def optimizer_state(self, host: CheckpointHost, optimizer: Optimizer) -> dict[str, Any]:
        """``optimizer``'s state in this format's form (may be collective)."""

    def check_save(self, host: CheckpointHost, target: str, storage_options: Any, call: str,
                   has_model: bool) -> None:
        """Raises, before any work, for a save this format cannot make."""

    @abstractmethod
    def save(self, host: CheckpointHost, target: str, checkpoint: Checkpoint, file_io: Any,
             storage_options: Any) -> None:
        """Writes ``checkpoint`` at ``target`` (rank 0's path; collective)."""

    @abstractmethod
    def read(self, host: CheckpointHost, path: Union[Path, str], *, n_optimizers: int, strict: bool,
             weights_only: Optional[bool], strict_hint: str, file_io: Any, memory_map: bool) -> Loaded:
        """Reads the checkpoint at ``path`` (collective)."""


class FullFile(CheckpointFormat):
    name = "full"
    holds_every_expert = False

    def optimizer_state(self, host: CheckpointHost, optimizer: Optimizer) -> dict[str, Any]:
        """Every rank's part gathered to rank 0 (collective); the other ranks get an empty state. Under tensor
        parallelism each position gathers over its data-parallel group, and the shards are then joined."""
        named = host.named_optimizer_state(optimizer)
        ownership = host.ownership()
        tp = ownership.tensor_parallel
        with host.naming_failures("gathering the optimizer state to rank 0 for a full checkpoint"):
            marked = mark_pieces(named, ownership)
            full = gather_named_state(marked) if tp is None else tp.gather(marked)
            if full is None:
                return {"state": {}, "param_groups": named["param_groups"]}
            full = join_pieces(full, ownership.split)
            return full if tp is None else tp.join_optimizer_state(full)

    def save(self, host: CheckpointHost, target: str, checkpoint: Checkpoint, file_io: Any,
             storage_options: Any) -> None:
        if not host.is_global_zero:
            return
        if not is_local_path(target):  # remote storage: the file IO's own semantics
            file_io.save_checkpoint(checkpoint.whole, target, storage_options=storage_options)
            return
        partial = partial_path(Path(target))
        file_io.save_checkpoint(checkpoint.whole, partial, storage_options=storage_options)
        commit(partial, Path(target))

    def read(self, host: CheckpointHost, path: Union[Path, str], *, n_optimizers: int, strict: bool,
             weights_only: Optional[bool], strict_hint: str, file_io: Any, memory_map: bool) -> Loaded:
        if memory_map and isinstance(path, Path) and path.is_file():
            # Memory-mapped: a rank reads the pages of the tensors it uses (all parameters, its owned
            # optimizer state), not the whole optimizer state. Owned state is copied out of the mapping
            # when the optimizer state is loaded.
            state = torch.load(path, map_location="cpu", mmap=True,
                               weights_only=True if weights_only is None else weights_only)
        else:
            state = file_io.load_checkpoint(path, weights_only=weights_only)
        return Loaded(state, model_loaded=False)


class ShardedDirectory(CheckpointFormat):
    name = "sharded"
    holds_every_expert = True

    def optimizer_state(self, host: CheckpointHost, optimizer: Optimizer) -> dict[str, Any]:
        """This rank's owned part."""
        return host.named_optimizer_state(optimizer)

    def check_save(self, host: CheckpointHost, target: str, storage_options: Any, call: str,
                   has_model: bool) -> None:
        if storage_options is not None:
            raise TypeError(f"{call}(..., storage_options=...) is not supported: sharded checkpoints are written "
                            "with torch.distributed.checkpoint, not the CheckpointIO plugin. Use "
                            "checkpoint_format='full' for a CheckpointIO plugin.")
        if not is_local_path(target):
            chosen = host.checkpoint_format
            why = "" if chosen == "sharded" else ", as 'auto' chooses for a model above 512 MiB,"
            raise ValueError(f"{host.name}(checkpoint_format={chosen!r}) writes a sharded directory{why} to a "
                             f"local or mounted filesystem, not {target!r}; use checkpoint_format='full' for remote "
                             "storage.")
        if not has_model:
            raise ValueError(f"{call} needs the trained module in the state (e.g. {{'model': model, 'optimizer': "
                             "optimizer, ...}): its parameters are what each rank writes.")

    def save(self, host: CheckpointHost, target: str, checkpoint: Checkpoint, file_io: Any,
             storage_options: Any) -> None:
        tensors = host.checkpoint_state(host.module.state_dict(keep_vars=True))
        ownership = host.ownership()
        tp = ownership.tensor_parallel  # chunks of the global tensors (Note [tensor-parallel checkpoints])
        model = model_entries_to_write(host.checkpoint_state(checkpoint.model_state), tensors, ownership)
        state: dict[str, Any] = {MODEL_KEY: model if tp is None else tp.sharded_model_entries(model)}
        for index, named in enumerate(checkpoint.optimizer_states):
            converted = pieces_as_sharded_tensors(named, ownership)
            named = converted if tp is None else tp.sharded_optimizer_state(named, converted, ownership)
            if not host.is_global_zero:
                named.pop("param_groups")  # identical on every rank: written once, by rank 0
            state[optimizer_key(index)] = named
        meta = dict(checkpoint.meta)
        meta["layerwise"] = {**meta.get("layerwise", {}), "format": FORMAT, "version": FORMAT_VERSION,
                             **host.layout_meta()}
        with host.naming_failures(f"saving the sharded checkpoint {target!r}"):
            save_sharded(Path(target), state, meta if host.is_global_zero else None)

    def read(self, host: CheckpointHost, path: Union[Path, str], *, n_optimizers: int, strict: bool,
             weights_only: Optional[bool], strict_hint: str, file_io: Any, memory_map: bool) -> Loaded:
        """Reads the owned parameters (then all-gathers them) and the owned optimizer state."""
        module = host.module
        meta, optimizer_states = read_sharded_checkpoint(
            Path(path), host.checkpoint_state(module.state_dict(keep_vars=True)), host.ownership(),
            n_optimizers, strict, type(module).__name__, weights_only, other_experts=expert_key_predicate(module),
            strict_hint=strict_hint)
        host.after_model_load()
        return Loaded(meta, model_loaded=True, optimizer_states=optimizer_states)


AUTO_FULL_LIMIT = 512 * 2**20
"""Bytes of parameters and buffers up to which ``checkpoint_format="auto"`` writes one file (Note [auto format])."""


def model_bytes(module: torch.nn.Module) -> int:
    """Bytes of ``module``'s parameters and buffers, each tensor once (tied weights share one)."""
    seen: dict[int, int] = {}
    for value in module.state_dict(keep_vars=True).values():
        if torch.is_tensor(value):
            seen[id(value)] = value.numel() * value.element_size()
    return sum(seen.values())


class Auto(CheckpointFormat):
    """One file for a small model, a sharded directory for a large one (Note [auto format])."""

    name = "auto"
    holds_every_expert = True

    def resolve(self, host: CheckpointHost) -> CheckpointFormat:
        if host.expert_parallel_size > 1 or host.module is None:
            return FORMATS["sharded"]
        return FORMATS["full" if model_bytes(host.module) <= AUTO_FULL_LIMIT else "sharded"]

    def optimizer_state(self, host: CheckpointHost, optimizer: Optimizer) -> dict[str, Any]:
        return self.resolve(host).optimizer_state(host, optimizer)

    def check_save(self, host: CheckpointHost, target: str, storage_options: Any, call: str,
                   has_model: bool) -> None:
        self.resolve(host).check_save(host, target, storage_options, call, has_model)

    def save(self, host: CheckpointHost, target: str, checkpoint: Checkpoint, file_io: Any,
             storage_options: Any) -> None:
        self.resolve(host).save(host, target, checkpoint, file_io, storage_options)

    def read(self, host: CheckpointHost, path: Union[Path, str], **kwargs: Any) -> Loaded:
        return format_on_disk(path).read(host, path, **kwargs)


FORMATS: dict[str, CheckpointFormat] = {f.name: f for f in (FullFile(), ShardedDirectory(), Auto())}
"""The formats by their ``checkpoint_format`` name."""


def format_on_disk(path: Union[Path, str]) -> CheckpointFormat:
    """The format of the checkpoint at ``path``: a local directory is sharded, anything else one file."""
    return FORMATS["sharded"] if isinstance(path, Path) and path.is_dir() else FORMATS["full"]
