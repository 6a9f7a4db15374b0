"""What the Trainer strategy and the Fabric strategy share: one engine, two front doors.

:class:`LayerwiseCore` is a mixin for a Lightning ``DDPStrategy`` (the Trainer's,
:class:`~lightning_layerwise.LayerwiseStrategy`, or Fabric's,
:class:`~lightning_layerwise.LayerwiseFabricStrategy`). It holds everything that
does not depend on which loop drives the training:

* the arguments and their checks (each error names the strategy class, the
  argument, the value and the fix);
* wrapping a module in :class:`LayerwiseDataParallel`: the process groups, the
  owner group size, which parameters the layout may split, the expert marks;
* the checkpoint half that knows the layout: what a rank writes and reads
  (:class:`~lightning_layerwise.checkpoint.Ownership`), names (global expert
  names), the named optimizer state (gathered to rank 0 for a full file), writing
  and reading the sharded directory, cutting loaded optimizer state to this rank;
* releasing the wrapper and destroying the groups at teardown.

A host class provides ``wrapper`` (the :class:`LayerwiseDataParallel` while training, else
``None``), :meth:`_user_module` (the module being trained, unwrapped),
:meth:`_user_optimizers` (its optimizers, unwrapped), :meth:`_half_true` (whether the
precision keeps float32 master weights) and the Lightning strategy attributes used
here (``world_size``, ``global_rank``, ``is_global_zero``, ``parallel_devices``,
``_timeout``, ``process_group_backend``, ``broadcast``).
"""

from __future__ import annotations

import contextlib
import hashlib
import sys
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.distributed.checkpoint.api import CheckpointException
from torch.optim import Optimizer

from . import checkpoint as ckpt
from .data_parallel import LayerwiseDataParallel, reject_sparse_gradients
from .experts import check_expert_marks, expert_key_map, expert_key_predicate, expert_parameter_names
from .layout import choose_owner_group_size, param_specs
from .config import DTYPES, SETTINGS, LayerwiseConfig
from .optim.elementwise import elementwise_parameters
from .masters import MasterWeights
from .process_groups import ProcessGroups

STRATEGY_NAMES = (("layerwise", "popen"), ("layerwise_spawn", "spawn"), ("layerwise_fork", "fork"),
                  ("layerwise_notebook", "fork"))
"""The registered names and their start methods, as ``ddp`` has them (Trainer and Fabric alike)."""


def register_strategy_names(cls: type, registry) -> None:
    """Registers ``cls`` under :data:`STRATEGY_NAMES` in a Trainer or Fabric strategy registry."""
    for name, start_method in STRATEGY_NAMES:
        registry.register(name, cls, description=f"Layer-wise distributed optimizer, start_method='{start_method}'",
                          start_method=start_method, override=True)


def check_accelerator(accelerator, allowed: tuple, fix: str) -> None:
    """CPU (gloo) and CUDA (NCCL) only; checked when the Trainer or Fabric is built."""
    if accelerator is not None and not isinstance(accelerator, allowed):
        raise ValueError(f"strategy='layerwise' runs on CPU (gloo) and CUDA GPUs (NCCL), not on "
                         f"{type(accelerator).__name__}; use {fix}.")


def check_precision(plugin, supported: tuple) -> None:
    """The precision kinds whose clipping and inf checks the strategy makes collective (exact types)."""
    if plugin is not None and type(plugin) not in supported:
        raise ValueError(
            f"strategy='layerwise' does not support the precision plugin {type(plugin).__name__}: gradients are "
            "sharded across ranks, so clipping and inf checks must be made across shards. Use precision='32-true', "
            "'64-true', 'bf16-mixed', '16-mixed', 'bf16-true' or '16-true'.")


class LayerwiseCore(ABC):
    """The layer-wise optimizer's strategy logic, for a Trainer or a Fabric ``DDPStrategy`` (see the module doc)."""

    # --- arguments ---------------------------------------------------------------------------------------------------
    def _init_layerwise(self, config: LayerwiseConfig) -> None:
        """Keeps the checked settings (``config``, also as attributes) and the run's empty state."""
        self.config = config
        for name in SETTINGS:
            setattr(self, name, getattr(config, name))
        self.skipped_steps = 0
        """Optimizer steps skipped because some rank's gradients were not finite (``skip_nonfinite_steps``)."""
        self._steps = 0  # optimizer steps since setup, for replica_check_every
        self._masters: Optional[MasterWeights] = None
        # parameter (or master weight) -> name, for checkpoints keyed by name; kept after teardown
        self._names: dict[torch.Tensor, str] = {}
        self._sync_after_step = False  # complete the all-gather inside the optimizer step
        self._groups: Optional[ProcessGroups] = None  # created when wrapping, destroyed by teardown
        self._released_ownership: Optional[ckpt.Ownership] = None  # the last layout's, kept by teardown
        self._expert_map: dict[str, str] = {}  # local -> global expert names (Note [expert checkpoints])

    _accelerator_classes: tuple = ()  # the host's CPU and CUDA accelerator classes
    _accelerator_fix: str = ""  # how to ask for one of them

    @property
    def accelerator(self):
        return self._accelerator

    @accelerator.setter
    def accelerator(self, accelerator) -> None:
        check_accelerator(accelerator, self._accelerator_classes, self._accelerator_fix)
        self._accelerator = accelerator

    # --- what the host provides (abstract: each strategy class implements them) ---------------------------------
    @property
    @abstractmethod
    def wrapper(self) -> Optional[LayerwiseDataParallel]:
        """The engine wrapping the module while it trains (``None`` before setup and after teardown)."""

    @abstractmethod
    def _user_module(self) -> Optional[torch.nn.Module]:
        """The module being trained, not wrapped."""

    @abstractmethod
    def _user_optimizers(self) -> list[Optimizer]:
        """Its optimizers, not wrapped."""

    @abstractmethod
    def _half_true(self) -> bool:
        """Whether the precision is ``bf16-true`` / ``16-true`` (float32 master weights, float32 gradients)."""

    # --- wrapping ----------------------------------------------------------------------------------------------------
    @property
    def process_groups(self) -> Optional[ProcessGroups]:
        """The process groups of this run (``None`` before setup and after teardown); an MoE layer
        exchanges tokens over ``process_groups.expert_parallel``."""
        return self._groups

    @property
    def expert_parallel_rank(self) -> int:
        """Which experts this rank holds (position in its expert-parallel group): known before setup, so a
        model can build only its experts (Note [expert parallelism])."""
        self._check_expert_parallel_size()
        return self.global_rank % self.expert_parallel_size

    def _wrap(self, module: torch.nn.Module, use_elementwise: bool = True) -> LayerwiseDataParallel:
        """Creates this run's process groups and wraps ``module`` (collective). The optimizers already exist
        when ``use_elementwise``: the layout splits the parameters they update element-wise."""
        self._released_ownership = None
        reject_sparse_gradients(module)  # before any group exists: the same verdict on every rank
        elementwise = self._elementwise_predicate() if use_elementwise else None
        experts = self._expert_names()
        self._expert_map = (expert_key_map(module, self.expert_parallel_rank)
                            if self.expert_parallel_size > 1 else {})
        groups = ProcessGroups.create(
            separate_all_gather=self.separate_all_gather_group, backend=self.process_group_backend,
            timeout=self._timeout, owner_group_size=self._resolve_owner_group_size(elementwise, experts),
            expert_parallel_size=self.expert_parallel_size,
        )
        self._groups = groups
        wrapper = LayerwiseDataParallel(
            module,
            process_groups=groups,
            bucket_size=self.bucket_size,
            overlap_grad_reduce=self.overlap_grad_reduce,
            overlap_param_gather=self.overlap_param_gather is not False,
            prefetch_depth=self.prefetch_depth,
            grad_reduce_dtype=self._grad_reduce_dtype(),
            broadcast_buffers=self.broadcast_buffers,
            param_read_guard=self.param_read_guard,
            elementwise=elementwise,
            expert=(lambda name, p: name in experts) if experts else None,
        )
        for optimizer in self._user_optimizers():
            wrapper.use_shards_in(optimizer)
        return wrapper

    def _after_wrap(self) -> None:
        """Master weights (``bf16-true``/``16-true``) and checkpoint names, once the optimizers are in place.

        Called again for each optimizer set up later (Fabric): the masters are made once and put into every
        optimizer."""
        self._steps = 0
        optimizers = self._user_optimizers()
        if self._half_true() and optimizers and self.wrapper is not None:
            if self._masters is None:
                self._masters = MasterWeights(self.wrapper, self._global_name)
            for optimizer in optimizers:
                self._masters.use_in(optimizer)
        self._names = self._checkpoint_names()

    def _check_expert_parallel_size(self) -> None:
        if self.world_size % self.expert_parallel_size:
            raise ValueError(f"{type(self).__name__}(expert_parallel_size={self.expert_parallel_size}) does not "
                             f"divide the {self.world_size} ranks of this run; pass a divisor of {self.world_size}.")

    def _expert_names(self) -> frozenset:
        """The expert parameters' names, after checking ``expert_parallel_size`` and the marks on every rank.

        Every rank learns every rank's verdict (one ``all_gather_object``) before any group is
        created, so a mark missing on one rank is the same error everywhere instead of a hang.
        """
        module = self._user_module()
        E = self.expert_parallel_size
        self._check_expert_parallel_size()
        error = None
        try:
            check_expert_marks(module, E)
        except ValueError as e:
            error = str(e)
        names = expert_parameter_names(module)
        if error is None and E > 1 and not names:
            error = (f"{type(self).__name__}(expert_parallel_size={E}) but the model marks no experts: put each MoE "
                     "layer's local experts in a container marked with lightning_layerwise.mark_experts.")
        # A digest of the marked names, not the names: thousands of experts on a thousand ranks would
        # otherwise gather megabytes per rank (on NCCL, in GPU memory).
        digest = hashlib.sha256("\n".join(sorted(names)).encode()).hexdigest()
        verdicts = [(error, digest, len(names))]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            verdicts = [None] * dist.get_world_size()
            dist.all_gather_object(verdicts, (error, digest, len(names)))
        for rank, (their_error, _, _) in enumerate(verdicts):
            if their_error is not None:
                raise ValueError(f"rank {rank}: {their_error}")
        for rank, (_, theirs, count) in enumerate(verdicts):
            if theirs != digest:
                raise ValueError(f"expert parameters are marked differently on rank {rank} ({count} marked) and rank "
                                 f"{self.global_rank} ({len(names)} marked): mark the same containers with "
                                 "lightning_layerwise.mark_experts on every rank.")
        return names

    def _resolve_owner_group_size(self, elementwise, experts: frozenset = frozenset()) -> int:
        """The owner group size for this world: the argument, or the layout's choice for ``"auto"``."""
        world = self.world_size
        if self.owner_group_size is None:
            return world
        if self.owner_group_size != "auto":
            if world % self.owner_group_size:
                raise ValueError(f"{type(self).__name__}(owner_group_size={self.owner_group_size}) does not divide "
                                 f"the {world} ranks of this run; pass a divisor of {world} (e.g. the GPUs per node), "
                                 "'auto' or None.")
            return self.owner_group_size
        ranks_per_node = len(self.parallel_devices or ()) or None
        if ranks_per_node is None or world <= ranks_per_node:
            return world  # one node: one group (Note [choosing the owner group size] in layout.py)
        grad_dtype = self._grad_reduce_dtype()
        # With the expert marks: experts are planned over their expert data-parallel group whatever the owner
        # group is, as the wrapper plans them, so they do not sway the choice (Note [choosing the owner group
        # size] in layout.py).
        E = self.expert_parallel_size
        expert = (lambda name, p: name in experts) if experts else None
        g, _ = choose_owner_group_size(
            param_specs(self._user_module(), elementwise=elementwise, expert=expert), world, self.bucket_size,
            ranks_per_node=ranks_per_node, grad_bytes=grad_dtype.itemsize if grad_dtype is not None else None,
            expert_dp=world // E if expert is not None and E > 1 else None)
        if g != world:
            rank_zero_info(f"{type(self).__name__}: owner groups of {g} ranks (owner_group_size='auto'; "
                           f"{world // g} groups).")
        return g

    def _elementwise_predicate(self) -> Optional[Callable[[str, torch.nn.Parameter], bool]]:
        """Which parameters the layout may split: those every optimizer holding them updates element-wise."""
        optimizers = self._user_optimizers()
        if not self.elementwise_fill or not optimizers:
            return None
        elementwise: set = set()
        whole: set = set()
        for optimizer in optimizers:
            mine = elementwise_parameters(optimizer, self.elementwise_optimizers)
            elementwise |= mine
            whole |= {p for g in optimizer.param_groups for p in g["params"] if p not in mine}
        elementwise -= whole
        return lambda name, p: p in elementwise

    def _grad_reduce_dtype(self) -> Optional[torch.dtype]:
        if self.grad_reduce_dtype is not None:
            return DTYPES[self.grad_reduce_dtype]
        # bf16-true / 16-true: reduce and keep gradients in float32 for the float32 master weights.
        return torch.float32 if self._half_true() else None

    # --- steps -------------------------------------------------------------------------------------------------------
    def _after_backward(self) -> None:
        """End of a backward that reduces (not inside ``no_sync``): owned parameters get their gradient."""
        wrapper = self.wrapper
        if wrapper is not None and wrapper.reduces_on_backward:
            wrapper.finish_grad_sync()

    def _before_backward(self) -> None:
        """Every backward adds to the gradients until they are cleared (Note [gradient lifecycle])."""
        wrapper = self.wrapper
        if wrapper is not None:
            wrapper.prepare_backward()

    def _before_optimizer_step(self, what: str) -> None:
        """No all-gather may still read the shards the step writes; the gradients must be reduced."""
        wrapper = self.wrapper
        if wrapper is None:
            return
        wrapper.finish_param_sync()
        if wrapper.grads_pending:
            raise RuntimeError(
                f"strategy='layerwise': {what} with gradients that were never reduced: the last backward ran "
                "inside no_sync (fabric.no_backward_sync / trainer.model.no_sync()) or bypassed the strategy (a "
                "bare loss.backward() instead of self.manual_backward(loss) / fabric.backward(loss)). Run the "
                "step's last backward through the strategy and outside no_sync.")

    def _after_optimizer_step(self, optimizer: Optional[Optimizer] = None) -> None:
        """Masters written back, the all-gather started (awaited by the next forward), replicas checked.

        With several optimizers only the buckets holding ``optimizer``'s parameters are gathered."""
        wrapper = self.wrapper
        if wrapper is None:
            return
        if self._masters is not None:
            self._masters.write_back()
        stepped = None
        if optimizer is not None and len(self._user_optimizers()) > 1:
            stepped = [t for g in optimizer.param_groups for t in g["params"]]
        wrapper.start_param_sync(force_sync=self._sync_after_step or self._compiled_needs_sync(wrapper),
                                 tensors=stepped)
        self._steps += 1
        if self.replica_check_every is not None and self._steps % self.replica_check_every == 0:
            wrapper.check_replicas()

    def _compiled_needs_sync(self, wrapper: LayerwiseDataParallel) -> bool:
        """The wrapper itself ran compiled (Note [compiled wrapper]): under ``"auto"``, no overlap."""
        if not wrapper.compiled_forward or self.overlap_param_gather is False:
            return False
        if self.overlap_param_gather is True:
            raise ValueError(f"{type(self).__name__}(overlap_param_gather=True) with a model compiled around the "
                             "strategy's wrapper (fabric.setup of a torch.compile'd model): a graph traced while no "
                             "all-gather was in flight would not wait for one. Use overlap_param_gather='auto' (the "
                             "all-gather then completes inside each step) or False.")
        return True

    def note_skipped_step(self, step: Any = None) -> None:
        self.skipped_steps += 1
        where = f" at step {step}" if step is not None else ""
        rank_zero_warn(f"{type(self).__name__}(skip_nonfinite_steps=True): gradients hold inf or NaN{where}; the "
                       f"optimizer step is skipped on every rank ({self.skipped_steps} skipped so far, "
                       "strategy.skipped_steps).")

    def sync_parameters(self) -> None:
        """Waits until every rank holds the current parameters (no collective if already synced)."""
        wrapper = self.wrapper
        if wrapper is not None:
            wrapper.finish_param_sync()

    # --- checkpoints -------------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _naming_failures(self, phase: str):
        """Re-raises a failure inside a checkpoint collective with the phase and this rank named."""
        try:
            yield
        except (Exception, CheckpointException) as error:
            raise ckpt.CheckpointError(
                f"{phase} failed on rank {self.global_rank} of {self.world_size} ({type(error).__name__}: "
                f"{str(error)[:300]}). If another rank died or hung, its log has the first error. The previous "
                "checkpoint is intact: saves are written aside and renamed into place when complete.") from error

    def _pieces(self) -> dict[torch.Tensor, tuple[Any, tuple[int, ...]]]:
        """This rank's piece of each split parameter: ``{piece parameter: (Piece, full shape)}``."""
        wrapper = self.wrapper
        if wrapper is None:
            return {}
        return {shard: (wrapper.piece_of(p), tuple(p.shape)) for p, _ in wrapper.named_parameters_in_layout()
                for shard in [wrapper.shard_of(p)] if shard is not None}

    def _ownership(self) -> ckpt.Ownership:
        """What this rank writes and reads of a checkpoint (Note [checkpoint ownership] in checkpoint.py)."""
        if self.wrapper is None and self._released_ownership is not None:
            # After training: the optimizer still steps the pieces of the released layout.
            return self._released_ownership
        names = self._names or self._checkpoint_names()
        masters = [m for _, m in self._masters.pairs] if self._masters is not None else []
        tensors = self._user_module().state_dict(keep_vars=True)
        in_layout = set() if self.wrapper is None else {p for p, _ in self.wrapper.named_parameters_in_layout()}
        expert_outside = [t for k, t in tensors.items() if k in self._expert_map and t not in in_layout]
        return ckpt.Ownership.of(self.wrapper, names, self.is_global_zero, masters, self._global_name, expert_outside)

    def _global_name(self, key: str) -> str:
        """A parameter's or state-dict key's name in checkpoints (Note [expert checkpoints] in checkpoint.py)."""
        return self._expert_map.get(key, key)

    def _checkpoint_state(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """``state_dict`` (this rank's module) with expert keys under their global names."""
        return {self._global_name(k): v for k, v in state_dict.items()} if self._expert_map else state_dict

    def _checkpoint_names(self) -> dict[torch.Tensor, str]:
        """Every parameter (its piece, its float32 master) by the name checkpoints use for it."""
        names: dict[torch.Tensor, str] = {p: n for n, p in self._user_module().named_parameters()}
        wrapper = self.wrapper
        if wrapper is not None:
            names.update((shard, n) for n, shard in wrapper.named_owned_parameters())
        if self._masters is not None:
            names.update(self._masters.names)
        return {t: self._global_name(n) for t, n in names.items()} if self._expert_map else names

    def _named_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The optimizer state keyed by parameter name (Note [checkpoint keys] in ``checkpoint.py``).

        ``"sharded"``: this rank's owned part. ``"full"``: every rank's part gathered to
        rank 0 (collective); the other ranks get an empty state.
        """
        names = self._names or self._checkpoint_names()
        named = ckpt.named_optimizer_state(optimizer, names)
        if self._masters is not None:
            named["master_weights"] = self._masters.state_dict(optimizer)
        if self.checkpoint_format == "sharded":
            return named
        ownership = self._ownership()
        with self._naming_failures("gathering the optimizer state to rank 0 for a full checkpoint"):
            full = ckpt.gather_named_state(ckpt.mark_pieces(ckpt.state_to_write(named, ownership), ownership))
        if full is None:
            return {"state": {}, "param_groups": named["param_groups"]}
        return ckpt.join_pieces(full, ownership.split)

    def _check_full_format_with_experts(self) -> None:
        if self.expert_parallel_size > 1 and self.checkpoint_format == "full":
            # Rank 0 holds only its own experts; a full file would need every rank's gathered to it.
            raise ckpt.CheckpointError(
                f"checkpoint_format='full' with expert_parallel_size={self.expert_parallel_size} is not supported "
                "yet: rank 0 holds only its own experts. Use checkpoint_format='sharded' (it reshards across "
                "expert-parallel sizes) and `python -m lightning.pytorch.utilities.consolidate_checkpoint` for "
                "one file.")

    def _check_full_load_with_experts(self) -> None:
        if self.expert_parallel_size > 1:
            # A full file names every expert globally; this rank's module holds only its own, under local names.
            raise ckpt.CheckpointError(
                f"loading a full checkpoint file with expert_parallel_size={self.expert_parallel_size} is not "
                "supported yet; load it with expert_parallel_size=1, or resume from a sharded checkpoint.")

    def _write_full_or_check_sharded(self, target: str, checkpoint: dict[str, Any], storage_options: Any,
                                     call: str) -> bool:
        """``"full"``: rank 0 writes ``checkpoint`` through the CheckpointIO plugin, aside and renamed into place on
        a local filesystem (Note [atomic save]); returns True. ``"sharded"``: checks that a sharded save can be
        made (a local path, no storage options) and returns False. ``call`` names the API in errors."""
        local = is_local_path(target)  # on the string: Path("s3://b/x") would read "s3:/b/x", a local path
        if self.checkpoint_format == "full":
            if not self.is_global_zero:
                return True
            if not local:  # remote storage: the CheckpointIO plugin's own semantics
                self.checkpoint_io.save_checkpoint(checkpoint, target, storage_options=storage_options)
                return True
            partial = ckpt.partial_path(Path(target))
            self.checkpoint_io.save_checkpoint(checkpoint, partial, storage_options=storage_options)
            ckpt.commit(partial, Path(target))
            return True
        if storage_options is not None:
            raise TypeError(f"{call}(..., storage_options=...) is not supported: sharded checkpoints are written "
                            "with torch.distributed.checkpoint, not the CheckpointIO plugin. Use "
                            "checkpoint_format='full' for a CheckpointIO plugin.")
        if not local:
            raise ValueError(f"{type(self).__name__}(checkpoint_format='sharded') writes to a local or mounted "
                             f"filesystem, not {target!r}; use checkpoint_format='full' for remote storage.")
        return False

    def _save_sharded(self, path: Path, model_state: dict[str, Any], optimizer_states: Sequence[dict[str, Any]],
                      meta: dict[str, Any]) -> None:
        """Writes a sharded checkpoint directory (collective; Note [sharded layout] in checkpoint.py).

        ``model_state``: the module's state dict (local names); ``optimizer_states``: named forms
        from :meth:`_named_optimizer_state`; ``meta``: everything else, written by rank 0 in ``meta.pt``.
        """
        tensors = self._checkpoint_state(self._user_module().state_dict(keep_vars=True))
        ownership = self._ownership()
        state: dict[str, Any] = {ckpt.MODEL_KEY: ckpt.model_entries_to_write(
            self._checkpoint_state(model_state), tensors, ownership)}
        for index, named in enumerate(optimizer_states):
            named = ckpt.pieces_as_sharded_tensors(ckpt.state_to_write(named, ownership), ownership)
            if not self.is_global_zero:
                named.pop("param_groups")  # identical on every rank: written once, by rank 0
            state[ckpt.optimizer_key(index)] = named
        meta = dict(meta)
        meta["layerwise"] = {**meta.get("layerwise", {}), "format": ckpt.FORMAT, "version": ckpt.FORMAT_VERSION,
                             "world_size": self.world_size, "bucket_size": self.bucket_size,
                             "owner_group_size": self._groups.owner_size if self._groups else self.world_size,
                             "expert_parallel_size": self.expert_parallel_size}
        with self._naming_failures(f"saving the sharded checkpoint {str(path)!r}"):
            ckpt.save_sharded(path, state, meta if self.is_global_zero else None)

    def _resolve_checkpoint_path(self, checkpoint_path) -> Path:
        """Rank 0's path, and the previous checkpoint if a save replacing it was interrupted (Note [atomic save])."""
        target = self.broadcast(str(checkpoint_path))
        path = ckpt.resolve(Path(target))
        if path != Path(target):
            rank_zero_warn(f"{target!r} does not exist, but {str(path)!r} does: a save to {target!r} was interrupted "
                           "while replacing it. Loading the previous checkpoint.")
        return path

    def _read_sharded(self, path: Path, n_optimizers: int, strict: bool, weights_only: Optional[bool],
                      strict_hint: str) -> tuple[dict[str, Any], Optional[list]]:
        """Reads the owned parameters (then all-gathers them) and the owned optimizer state (collective)."""
        module = self._user_module()
        meta, optimizer_states = ckpt.read_sharded_checkpoint(
            path, self._checkpoint_state(module.state_dict(keep_vars=True)), self._ownership(), n_optimizers,
            strict, type(module).__name__, weights_only, other_experts=expert_key_predicate(module),
            strict_hint=strict_hint)
        self._after_model_load()
        return meta, optimizer_states

    def _after_model_load(self) -> None:
        """Every rank holds the loaded parameters, and the masters equal them."""
        wrapper = self.wrapper
        if wrapper is not None:
            wrapper.start_param_sync(force_sync=True)
        if self._masters is not None:
            self._masters.refresh()

    def _load_optimizer_states(self, optimizers: Sequence[Optimizer], states: Sequence[dict[str, Any]]) -> None:
        """Loads saved optimizer states (named or indexed, any layout): each rank keeps what it steps now."""
        from lightning.fabric.utilities.optimizer import _optimizer_to_device

        if len(states) != len(optimizers):
            raise ckpt.CheckpointError(f"the checkpoint holds {len(states)} optimizer state(s) and the model "
                                       f"configures {len(optimizers)}.")
        names = self._names or self._checkpoint_names()
        keep = self._ownership().reads  # another rank steps the rest: state exists once in the world
        pieces = self._pieces()
        for optimizer, saved in zip(optimizers, states):
            local = ckpt.local_optimizer_state(saved, optimizer, names, keep, pieces,
                                               is_expert=expert_key_predicate(self._user_module()))
            local["state"] = {k: _own_copy(v) for k, v in local["state"].items()}  # off a memory-mapped file
            optimizer.load_state_dict(local)
            _optimizer_to_device(optimizer, self.root_device)
            if self._masters is not None and saved.get("master_weights"):
                self._masters.load_state_dict(saved["master_weights"])

    # --- teardown ----------------------------------------------------------------------------------------------------
    def _release(self) -> Optional[torch.nn.Module]:
        """Unwraps the module and destroys this run's groups; returns the module (``None`` if not wrapped).

        Also called from inside an exception handler after a failed run. If a collective failed (a dead
        rank), waiting for the pending ones raises the same error again and hides the original traceback:
        then they are abandoned instead.
        """
        failing = sys.exc_info()[0] is not None
        wrapper = self.wrapper
        module = None
        if wrapper is not None:
            # A checkpoint saved after training still needs who stepped what.
            self._released_ownership = self._ownership()
            try:
                module = wrapper.release()
            except Exception:
                if not failing:
                    raise
                module = wrapper.release(wait=False)
            self._masters = None
        if self._groups is not None:
            # Communicators (and gloo's threads) made for this run end with it: none outlives the run or
            # reaches interpreter exit (where a live one can abort the process).
            try:
                self._groups.destroy()
            except Exception:
                if not failing:
                    raise
            self._groups = None
        return module


def is_compiled(module) -> bool:
    """Whether ``module`` (or a submodule) is ``torch.compile``d."""
    if getattr(module, "_compiler_ctx", None) is not None:
        return True
    optimized = getattr(getattr(torch, "_dynamo", None), "eval_frame", None)
    optimized = getattr(optimized, "OptimizedModule", None)
    return optimized is not None and any(isinstance(m, optimized) for m in module.modules())


def _own_copy(value):
    if torch.is_tensor(value):
        return value.clone()
    if isinstance(value, dict):
        return {k: _own_copy(v) for k, v in value.items()}
    return value


def is_local_path(path) -> bool:
    """Whether ``path`` (a string as the user gave it: URLs keep their ``//``) is on the local filesystem."""
    from fsspec.implementations.local import LocalFileSystem
    from lightning.fabric.utilities.cloud_io import get_filesystem

    return isinstance(get_filesystem(str(path)), LocalFileSystem)
