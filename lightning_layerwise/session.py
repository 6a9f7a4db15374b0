"""One training run of the layer-wise optimizer, with no Lightning in it.

:class:`LayerwiseSession` is what the Trainer strategy, the Fabric strategy and a
hand-written torch loop all drive. It takes a :class:`~lightning_layerwise.LayerwiseConfig`
(every setting, checked once) and a :class:`SessionEnv` (what the launcher knows: world
size, rank, ranks per node, device, a broadcast and a logger), and holds everything of
the run that does not depend on who calls it:

* :meth:`~LayerwiseSession.wrap`: checks the expert marks on every rank, picks the owner
  group size by planning the layout once (experts included) and hands that plan to
  :class:`LayerwiseDataParallel`, creates the process groups, puts the shards (and float32
  master weights) in the optimizers;
* the step: :meth:`~LayerwiseSession.before_backward`, :meth:`~LayerwiseSession.after_backward`,
  :meth:`~LayerwiseSession.before_step`, :meth:`~LayerwiseSession.after_step` (and
  :meth:`~LayerwiseSession.backward` / :meth:`~LayerwiseSession.step`, which chain them for a plain loop);
  ``session.steps`` (:class:`StepCount`: steps taken and skipped, :meth:`StepCount.grads_finite`,
  :meth:`StepCount.skip`);
* ``session.reads`` (:class:`SessionReads`): reads of sharded parameters in hooks and a rank's own, and the
  error a failing rank posts;
* checkpoints: :meth:`~LayerwiseSession.save_checkpoint` / :meth:`~LayerwiseSession.load_checkpoint`, and
  ``session.checkpoints`` (:class:`~lightning_layerwise.session_checkpoints.SessionCheckpoints`: what this rank
  writes and reads, names, the module's state dict, optimizer state cut to this rank) through one
  :class:`~lightning_layerwise.checkpoint.formats.CheckpointFormat` per format;
* :meth:`~LayerwiseSession.release`: waits for what is in flight, unwraps the module and
  destroys the run's groups.

Note [re-planning]
    The layout is planned from the parameters that train when the module is wrapped. Freezing one later needs
    nothing: it gets no gradient, so the optimizer skips it as unused (its slot sends zeros; ``toggle_optimizer``
    flips ``requires_grad`` every step for free). A parameter frozen *at* wrapping (a frozen backbone) has no
    slot, so when it trains again its gradient would never be reduced and the ranks would drift apart, as under
    ``ddp``, which builds its reducer once. So every training forward checks whether a parameter outside the
    layout has ``requires_grad=True`` (one attribute read each). The first that finds one re-plans, on every
    rank, before any collective of the step: the optimizers' full state is gathered to rank 0 and broadcast
    (what a full checkpoint costs), each optimizer's groups get the model's parameters back in place of pieces
    and masters, the layout is planned again for the run's owner groups, the wrapper is rebuilt in place
    (:meth:`LayerwiseDataParallel.rebuild`: same object, parameters and values; new buffers, pieces and hooks),
    the optimizers get the new pieces and masters, and each rank keeps the state of what it steps now, sliced
    as a resumed checkpoint is. Gradients held from before are dropped, as the next ``zero_grad`` would; a
    change inside ``no_sync`` is refused, and one not made alike on every rank raises.

    A param group added with ``optimizer.add_param_group`` (``unfreeze_and_add_param_group``) gets its pieces
    and masters at the next step (:meth:`LayerwiseSession.before_step`). ``BaseFinetuning`` maps the optimizers'
    tensors to parameter names by identity; the Trainer strategy maps pieces and masters to their parameters.

A plain torch loop under ``torchrun``::

    session = LayerwiseSession(LayerwiseConfig(bucket_size=2**22))  # env from torch.distributed
    wrapped = session.wrap(model, optimizer)
    for x, y in batches:
        optimizer.zero_grad()
        session.backward(loss_fn(wrapped(x), y))
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # the full gradient's norm
        session.step(optimizer)
    session.release()

Note [sharded saves]
    With sharded parameters a rank never holds the whole model, and a checkpoint must not
    make it. A sharded directory is written from what each rank owns: the parameters it
    steps whole, read straight from its shard, and the split parameters whose first piece
    it steps, for which the buckets holding split parameters are gathered one at a time
    (every rank takes part, so the collectives agree). A full file is rank 0's to write:
    every bucket is gathered in turn, rank 0 copies its entries to its own memory, the other
    ranks keep nothing, and no rank holds more than one full bucket on the device. Loading
    mirrors it: a sharded directory reads into the shards, with the split parameters'
    buckets held full so that each rank's pieces take their part (and a full file is copied
    in bucket by bucket, every rank alike, each shard keeping its part).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import sys
import warnings
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from .config import DTYPES, LayerwiseConfig
from .engine.grad_utils import gradient_utilities
from .engine.data_parallel import LayerwiseDataParallel, wrappers_of
from .engine.module_checks import reject_sparse_gradients
from .engine.wrapper_setup import layout_specs
from .experts import check_expert_marks, expert_key_map, expert_parameter_names
from .session_checkpoints import GlobalNames, SessionCheckpoints
from .checkpoint.files import TorchFileIO
from .checkpoint.formats import Checkpoint
from .checkpoint.named_state import to_cpu
from .layout import Layout, choose_expert_group_size, choose_owner_group_size, plan_layout
from .engine.collective_reads import FailureBoard, ReadAgreement
from .engine.masters import MasterWeights
from .engine.sharded import ReadRules, ShardedParameterSync
from .optim.elementwise import elementwise_parameters
from .engine.process_groups import ProcessGroups
from .engine.tensor_parallel import build_mesh, check_tensor_parallel_optimizer, localize, share_spec
from .engine.tp_exchange import check_matrices, global_shape, muon_step_whole
from .optim.muon import Muon

log = logging.getLogger("lightning_layerwise")


def _broadcast_object(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank of the default group (itself without one)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


@dataclass(frozen=True)
class SessionEnv:
    """What the launcher knows about this process; the Trainer and Fabric strategies fill it from their own."""

    world_size: int = 1
    rank: int = 0
    ranks_per_node: Optional[int] = None
    """Processes per node (``None``: unknown); ``owner_group_size="auto"`` keeps groups inside a node."""
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    """Where this rank's optimizer state lives."""
    backend: Optional[str] = None
    """Backend of the run's process groups (``None``: the default group's)."""
    timeout: Optional[timedelta] = None
    broadcast: Callable[[Any], Any] = _broadcast_object
    """Rank 0's object on every rank (collective)."""
    info: Callable[[str], None] = log.info
    """Informs, on rank 0 only."""
    warn: Callable[[str], None] = warnings.warn
    """Warns, on rank 0 only."""

    @classmethod
    def from_torch(cls, device: Optional[torch.device] = None, timeout: Optional[timedelta] = None) -> "SessionEnv":
        """The env of a process started by ``torchrun`` (or one process without a group)."""
        initialized = dist.is_available() and dist.is_initialized()
        world = dist.get_world_size() if initialized else 1
        rank = dist.get_rank() if initialized else 0
        local = os.environ.get("LOCAL_WORLD_SIZE")
        if device is None:
            on_cuda = initialized and dist.get_backend() == "nccl"
            device = torch.device("cuda", torch.cuda.current_device()) if on_cuda else torch.device("cpu")

        def on_rank_zero(fn: Callable[[str], None]) -> Callable[[str], None]:
            return fn if rank == 0 else (lambda message: None)

        return cls(world_size=world, rank=rank, ranks_per_node=int(local) if local else None, device=device,
                   timeout=timeout, info=on_rank_zero(log.info),
                   warn=on_rank_zero(lambda message: warnings.warn(message, stacklevel=3)))


class StepCount:
    """The optimizer steps of a session's run: those taken since wrapping (``replica_check_every`` counts them),
    those skipped on every rank because some rank's gradients were not finite (``skip_nonfinite_steps``), and the
    layouts planned again between them."""

    def __init__(self, session: "LayerwiseSession", name: str) -> None:
        self._session = session
        self._name = name  # the settings' owner, for the warning
        self.taken = 0
        """Optimizer steps since wrapping (or since an optimizer was added)."""
        self.skipped = 0
        """Steps skipped because some rank's gradients were not finite."""
        self.replans = 0
        """How often the layout was planned again since wrapping (Note [re-planning])."""

    def grads_finite(self) -> bool:
        """Whether every rank's reduced gradients are finite (one all-reduce; ``True`` when not wrapped)."""
        wrapper = self._session.wrapper
        return wrapper is None or wrapper.grad_sync.grads_are_finite()

    def skip(self, step: Any = None) -> bool:
        """With ``skip_nonfinite_steps``: whether this step is skipped on every rank (then counted and warned,
        naming ``step``, by default :attr:`taken`); collective."""
        session = self._session
        if not session.config.skip_nonfinite_steps or session.wrapper is None or self.grads_finite():
            return False
        self.skipped += 1
        step = self.taken if step is None else step
        where = f" at step {step}" if step is not None else ""
        session.env.warn(f"{self._name}(skip_nonfinite_steps=True): gradients hold inf or NaN{where}; the optimizer "
                         f"step is skipped on every rank ({self.skipped} skipped so far, strategy.skipped_steps).")
        return True


class SessionReads:
    """Reads of a session's sharded parameters outside the forward (Note [sharded reads] in ``engine/sharded.py``):
    how errors name the front end's steps, the contexts for a hook's reads and for a rank's own, and the board on
    which a failing rank posts its error (Note [failing together] in ``engine/collective_reads.py``). Without
    sharded parameters the contexts do nothing."""

    def __init__(self, session: "LayerwiseSession", rules: ReadRules) -> None:
        self._session = session
        self.rules = rules
        """How errors about reads of sharded parameters name this front end's steps (the adapters set theirs)."""
        self.failure: Optional[str] = None
        """Another rank's read error, posted before a failed run was released (Note [failing together])."""
        self._board: Optional[FailureBoard] = None  # with sharded parameters: Note [failing together]
        self._agreement: Optional[ReadAgreement] = None  # Note [collective reads]

    def open(self, timeout: Optional[timedelta]) -> None:
        """The run's board and agreement with sharded parameters (collective, as the wrapping: every rank opens the
        same run's board; none otherwise), attached to the wrapper."""
        sharded = self._session.wrapper.shard_parameters
        self._board = FailureBoard.open() if sharded else None
        self._agreement = ReadAgreement.create(self._board, timeout)
        self.attach()

    def attach(self) -> None:
        """The wrapper's parameter side learns the rules, the agreement and the board (again after a re-plan)."""
        param_sync = self._session.wrapper.param_sync
        if isinstance(param_sync, ShardedParameterSync):
            param_sync.reads.rules, param_sync.reads.agreement = self.rules, self._agreement
            param_sync.waiter.board = self._board

    def hook(self, where: str):
        """A context for a hook every rank runs in the same order (``where``: its name): reads of sharded
        parameters inside gather on demand, as collectives (Note [collective reads] in
        ``engine/collective_reads.py``)."""
        param_sync = self._param_sync()
        if isinstance(param_sync, ShardedParameterSync):
            return param_sync.hook_reads(where)
        return contextlib.nullcontext()

    def local(self):
        """A context for this rank's own reads (the optimizer's step inside a hook): nothing gathers on demand."""
        param_sync = self._param_sync()
        if isinstance(param_sync, ShardedParameterSync):
            return param_sync.reads.local()
        return contextlib.nullcontext()

    def _param_sync(self):
        wrapper = self._session.wrapper
        return wrapper.param_sync if wrapper is not None else None

    def post_failure(self) -> None:
        """Keeps an error another rank posted (:attr:`failure`), as a failed run is released."""
        if self._board is not None:
            self.failure = self._board.unseen()

    def close(self) -> None:
        """The run ends: its agreement group is destroyed (local) and the board forgotten."""
        agreement, self._board, self._agreement = self._agreement, None, None
        if agreement is not None:
            agreement.destroy()


class LayerwiseSession:
    """One run of the layer-wise optimizer: wrap, step, checkpoint, release (see the module doc).

    Args:
        config: the settings (default: every default).
        env: the launcher's view of this process; ``None``: :meth:`SessionEnv.from_torch` when first needed.
        name: what errors call the settings' owner (the strategy class).
    """

    def __init__(self, config: Optional[LayerwiseConfig] = None, env: Optional[SessionEnv] = None, *,
                 name: str = "LayerwiseSession") -> None:
        if config is not None and not isinstance(config, LayerwiseConfig):  # else an AttributeError at first use
            fix = "LayerwiseConfig(**options)" if isinstance(config, dict) else "LayerwiseConfig(bucket_size=...)"
            raise TypeError(f"{name}(config={config!r}): config must be a LayerwiseConfig (got "
                            f"{type(config).__name__}); pass LayerwiseSession({fix}), which checks every setting and "
                            "names a misspelt one.")
        self.config = config if config is not None else LayerwiseConfig(owner=name)
        self._env = env
        self._name = name
        self.module: Optional[torch.nn.Module] = None
        """The module being trained, not wrapped (kept after :meth:`release`)."""
        self.optimizers: list[Optimizer] = []
        self.wrapper: Optional[LayerwiseDataParallel] = None
        self.groups: Optional[ProcessGroups] = None
        """This run's process groups (``None`` before :meth:`wrap` and after :meth:`release`)."""
        self.masters: Optional[MasterWeights] = None
        self._master_weights = False  # whether the precision keeps float32 masters (bf16-true, 16-true)
        self.sync_after_step = False
        """Complete the all-gather inside each step (a compiled model, or readers between steps)."""
        self.steps = StepCount(self, name)
        """The optimizer steps taken since wrapping and those skipped for non-finite gradients."""
        self.checkpoints = SessionCheckpoints(self, name)
        """This run's checkpoints: names, ownership, the formats, save and restore."""
        self.reads = SessionReads(self, ReadRules(
            steps="the forward of the model that session.wrap returned",
            whole_again="After session.release() the module holds every parameter again."))
        """Reads of sharded parameters outside the forward: their wording, the hook and local contexts, failures."""
        self._elementwise = True  # wrap(elementwise=...): whether re-planning may split parameters again
        self._expert: Optional[Callable[[str, torch.nn.Parameter], bool]] = None  # which parameters are experts
        self._group_counts: list[int] = []  # param groups per optimizer when they last got their pieces
        self._gradient_utilities = None  # the hold on the patched gradient utilities, from wrap to release
        self._mesh = None  # the device mesh under tensor parallelism, made at first use

    # --- the environment ---------------------------------------------------------------------------------------------
    @property
    def env(self) -> SessionEnv:
        if self._env is None:
            self._env = SessionEnv.from_torch(timeout=self.config.timeout)
        return self._env

    @env.setter
    def env(self, env: SessionEnv) -> None:
        self._env = env

    @property
    def _data_parallel_size(self) -> int:
        """Ranks per data-parallel group: the world, or with tensor parallelism the world over its size."""
        return self.env.world_size // self.config.tensor_parallel_size

    @property
    def device_mesh(self):
        """The ``(data_parallel, tensor_parallel)`` ``DeviceMesh`` (Note [tensor-parallel mesh] in
        ``engine/tensor_parallel.py``), made at first use (collective); ``None`` without tensor parallelism."""
        T = self.config.tensor_parallel_size
        if T == 1:
            return None
        if self._mesh is None:
            world = self.env.world_size
            if world % T:
                raise ValueError(f"{self._name}(tensor_parallel_size={T}) does not divide the {world} ranks of this "
                                 f"run; pass a divisor of {world} (and of the processes per node).")
            self._mesh = build_mesh(self.env.device.type if self.env.device is not None else "cpu", world, T)
        return self._mesh

    @property
    def expert_parallel_rank(self) -> int:
        """Which experts this rank holds (position in its expert-parallel group): known before :meth:`wrap`,
        so a model can build only its experts (Note [expert parallelism] in ``engine/process_groups.py``)."""
        self._check_expert_parallel_size()
        return self.env.rank % self.config.expert_parallel_size

    # --- wrapping ----------------------------------------------------------------------------------------------------
    def wrap(self, module: torch.nn.Module, optimizers: Union[Optimizer, Sequence[Optimizer]] = (), *,
             master_weights: bool = False, elementwise: bool = True) -> LayerwiseDataParallel:
        """Creates this run's process groups and wraps ``module`` (collective); returns the wrapper.

        ``optimizers`` already hold ``module``'s parameters: the layout splits what they update
        element-wise (unless ``elementwise=False``), and they get this rank's pieces. ``master_weights``:
        the precision keeps half-precision parameters (``bf16-true``/``16-true``); the optimizers then step
        float32 masters of what this rank owns."""
        optimizers = [optimizers] if isinstance(optimizers, Optimizer) else list(optimizers)
        self.module, self.optimizers, self._master_weights = module, optimizers, master_weights
        self.checkpoints.module, self.checkpoints.released_ownership = module, None
        self.masters, self.reads.failure = None, None
        reject_sparse_gradients(module)  # before any group exists: the same verdict on every rank
        if self.config.tensor_parallel_size > 1:
            self._localize(module, optimizers)
        self._elementwise = elementwise
        predicate = self._elementwise_predicate() if elementwise else None
        experts = self._expert_names()
        E = self.config.expert_parallel_size
        local_to_global = expert_key_map(module, self.expert_parallel_rank) if E > 1 else {}
        self.checkpoints.global_names = GlobalNames(local_to_global)
        expert = (lambda name, p: name in experts) if experts else None
        specs = layout_specs(module, elementwise=predicate, expert=expert)
        owner_group_size, layout = self._plan(specs, expert is not None)
        self.groups = ProcessGroups.create(
            separate_all_gather=self.config.separate_all_gather_group, backend=self.env.backend,
            timeout=self.env.timeout, owner_group_size=owner_group_size, expert_parallel_size=E,
            expert_group_size=layout.expert_group_size if layout is not None and E > 1 else None,
            tensor_parallel_size=self.config.tensor_parallel_size)
        c = self.config
        self.wrapper = LayerwiseDataParallel(
            module, process_groups=self.groups, bucket_size=c.planned_bucket_size, overlap_grad_reduce=c.overlap_grad_reduce,
            overlap_param_gather=c.overlap_param_gather is not False, prefetch_depth=c.planned_prefetch_depth,
            grad_reduce_dtype=self._grad_reduce_dtype(), broadcast_buffers=c.broadcast_buffers,
            param_read_guard=c.param_read_guard, elementwise=predicate, expert=expert, layout=layout,
            shard_parameters=c.shard_parameters, reshard_after_forward=c.reshard_after_forward, device=self.env.device)
        replaced = self.wrapper.replaced_parameters  # a meta-device model was materialized: new parameter objects
        for optimizer in optimizers if replaced else ():
            for group in optimizer.param_groups:
                group["params"] = [replaced.get(id(p), p) for p in group["params"]]
        self.wrapper.on_new_trainable = self._replan
        self.wrapper.ended_by = self.release  # llw.release(module) ends the run: groups, board and all
        self.reads.open(self.env.timeout)
        if self._gradient_utilities is None:  # torch's clipping sees the global norm while wrapped
            self._gradient_utilities = gradient_utilities()
        self._expert = expert
        self._after_optimizers()
        return self.wrapper

    def _localize(self, module: torch.nn.Module, optimizers: list[Optimizer]) -> None:
        """Tensor parallelism: the module's DTensor parameters become their local tensors (Note [local
        parameters] in ``engine/tensor_parallel.py``), in the optimizers too, and Muon orthogonalizes whole
        matrices (Note [tensor-parallel exchange] in ``engine/tp_exchange.py``)."""
        replaced = localize(module, self.device_mesh["tensor_parallel"], self._name)
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                group["params"] = [replaced.get(p, p) for p in group["params"]]
            self._tensor_parallel_optimizer(optimizer)

    def _tensor_parallel_optimizer(self, optimizer: Optimizer) -> None:
        """Refuses an optimizer that would step tensor-parallel shards as whole tensors; Muon orthogonalizes whole
        matrices."""
        check_tensor_parallel_optimizer(optimizer, self.config.elementwise_optimizers, self._name)
        if isinstance(optimizer, Muon):
            check_matrices([global_shape(p) for g in optimizer.param_groups if g["use_muon"] for p in g["params"]],
                           self._name)
            optimizer._whole_matrices, optimizer._global_shape = muon_step_whole, global_shape

    def add_optimizer(self, optimizer: Optimizer) -> None:
        """An optimizer made after :meth:`wrap` (its parameters are owned whole: the layout is fixed)."""
        if self.wrapper is None:
            raise RuntimeError(f"{self._name}: wrap the module before adding an optimizer.")
        if self.config.tensor_parallel_size > 1:
            self._tensor_parallel_optimizer(optimizer)
        self.optimizers.append(optimizer)
        self._after_optimizers()

    def _after_optimizers(self) -> None:
        """Master weights (made once, put in every optimizer) and checkpoint names."""
        self.steps.taken = 0
        self._use_stepped_tensors()

    def _use_stepped_tensors(self) -> None:
        """Every optimizer holds what this rank steps in place of the parameters: pieces, masters (also in a
        param group added since, ``optimizer.add_param_group``)."""
        if self.wrapper is not None:
            for optimizer in self.optimizers:
                self.wrapper.use_shards_in(optimizer)
        if self._master_weights and self.optimizers and self.wrapper is not None:
            if self.masters is None:
                self.masters = MasterWeights(self.wrapper, self.checkpoints.global_names.__getitem__)
            for optimizer in self.optimizers:
                self.masters.use_in(optimizer)
                if self.config.tensor_parallel_size > 1:  # a master lies on the mesh as its parameter does
                    for t in (t for group in optimizer.param_groups for t in group["params"]):
                        share_spec(t, model_parameter(self.wrapper, t))
        self.checkpoints.refresh_names()
        self._group_counts = [len(optimizer.param_groups) for optimizer in self.optimizers]

    # --- re-planning (Note [re-planning]) ----------------------------------------------------------------------------
    def _replan(self, names: list[str]) -> None:
        """Parameters frozen when the module was wrapped now train (collective, at the first training forward
        after the change): their gradients need a place in the layout. Plans the layout again for the module
        as it is now, with the owner groups unchanged, moves the optimizer state to the new owners and hands
        the optimizers the new pieces."""
        wrapper = self.wrapper
        wrapper.param_sync.finish()
        if wrapper.grad_sync.grads_pending:
            raise RuntimeError(
                f"{self._name}: parameters {names[:5]} became trainable while gradients were accumulating inside "
                "no_sync. Change requires_grad between optimizer steps (after the step, before the next "
                "step's first backward).")
        self.env.info(f"{self._name}: {len(names)} parameter(s) became trainable ({', '.join(names[:3])}"
                      f"{', ...' if len(names) > 3 else ''}); the layout is planned again for them.")
        states = [to_cpu(self.checkpoints.full_optimizer_state(optimizer)) for optimizer in self.optimizers]
        states = self.env.broadcast(states)  # rank 0 holds the gathered state; every rank keeps what it steps
        for optimizer in self.optimizers:
            for group in optimizer.param_groups:
                group["params"] = [model_parameter(wrapper, t) for t in group["params"]]
            optimizer.state.clear()
        predicate = self._elementwise_predicate() if self._elementwise else None
        specs = layout_specs(self.module, elementwise=predicate, expert=self._expert)
        layout = self._plan_for_groups(specs, self._expert is not None)
        taken, self.masters = self.steps.taken, None
        wrapper.rebuild(layout, elementwise=predicate)
        self.reads.attach()
        self.steps.replans += 1
        self._use_stepped_tensors()
        self.steps.taken = taken
        if self.optimizers:
            self.checkpoints.load_optimizer_states(self.optimizers, states)

    def _plan_for_groups(self, specs, has_experts: bool) -> Layout:
        """A layout for the process groups this run already has (the same owner and expert group sizes)."""
        c, world, groups = self.config, self._data_parallel_size, self.groups
        g = groups.owner_group_size
        E = c.expert_parallel_size
        expert_dp_size = world // E if has_experts and E > 1 else None
        ge = groups.expert_group_size if expert_dp_size is not None else None
        return plan_layout(specs, g, c.planned_bucket_size, expert_group_size=ge, replicas=world // g,
                           follow_layers=c.shard_parameters,
                           expert_replicas=expert_dp_size // ge if ge else 1)

    def _plan(self, specs, has_experts: bool) -> tuple[int, Optional[Layout]]:
        """The owner group size and its layout, planned once (Note [choosing the owner group size] in
        ``layout/group_size.py``).

        Experts are planned over their expert data-parallel group whatever the owner group is, as the wrapper
        runs them, so they do not sway the choice."""
        c, world = self.config, self._data_parallel_size
        E = c.expert_parallel_size
        expert_dp_size = world // E if has_experts and E > 1 else None
        g, layout = world, None
        if c.owner_group_size not in (None, "auto"):
            if world % c.owner_group_size:
                raise ValueError(f"{self._name}(owner_group_size={c.owner_group_size}) does not divide the {world} "
                                 f"ranks of this run; pass a divisor of {world} (e.g. the GPUs per node), 'auto' or "
                                 "None.")
            g = c.owner_group_size
        elif (c.owner_group_size == "auto" and c.tensor_parallel_size == 1 and self.env.ranks_per_node
              and world > self.env.ranks_per_node and specs):
            grad_dtype = self._grad_reduce_dtype()
            g, layout = choose_owner_group_size(
                specs, world, c.planned_bucket_size, ranks_per_node=self.env.ranks_per_node,
                grad_bytes=grad_dtype.itemsize if grad_dtype is not None else None, expert_dp_size=expert_dp_size,
                follow_layers=c.shard_parameters)
            if g != world:
                self.env.info(f"{self._name}: owner groups of {g} ranks (owner_group_size='auto'; {world // g} "
                              "groups).")
        if layout is None and specs:  # no parameter to train: the wrapper says so
            ge = (choose_expert_group_size(specs, expert_dp_size, c.planned_bucket_size) if expert_dp_size is not None
                  else None)
            layout = plan_layout(specs, g, c.planned_bucket_size, expert_group_size=ge, replicas=world // g,
                                 follow_layers=c.shard_parameters,
                                 expert_replicas=expert_dp_size // ge if ge else 1)
        return g, layout

    def _check_expert_parallel_size(self) -> None:
        E, world = self.config.expert_parallel_size, self.env.world_size
        if world % E:
            raise ValueError(f"{self._name}(expert_parallel_size={E}) does not divide the {world} ranks of this run; "
                             f"pass a divisor of {world}.")

    def _expert_names(self) -> frozenset:
        """The expert parameters' names, after checking ``expert_parallel_size`` and the marks on every rank.

        Every rank learns every rank's verdict (one ``all_gather_object``) before any group is
        created, so a mark missing on one rank is the same error everywhere instead of a hang.
        """
        module, E = self.module, self.config.expert_parallel_size
        self._check_expert_parallel_size()
        error = None
        try:
            check_expert_marks(module, E)
        except ValueError as e:
            error = str(e)
        names = expert_parameter_names(module)
        if error is None and E > 1 and not names:
            error = (f"{self._name}(expert_parallel_size={E}) but the model marks no experts: put each MoE layer's "
                     "local experts in a container marked with lightning_layerwise.mark_experts.")
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
                                 f"{self.env.rank} ({len(names)} marked): mark the same containers with "
                                 "lightning_layerwise.mark_experts on every rank.")
        return names

    def _elementwise_predicate(self) -> Optional[Callable[[str, torch.nn.Parameter], bool]]:
        """Which parameters the layout may split: those every optimizer holding them updates element-wise."""
        if not self.config.elementwise_fill or not self.optimizers:
            return None
        elementwise: set = set()
        whole: set = set()
        for optimizer in self.optimizers:
            mine = elementwise_parameters(optimizer, self.config.elementwise_optimizers)
            elementwise |= mine
            whole |= {p for g in optimizer.param_groups for p in g["params"] if p not in mine}
        elementwise -= whole
        return lambda name, p: p in elementwise

    def _grad_reduce_dtype(self) -> Optional[torch.dtype]:
        if self.config.grad_reduce_dtype is not None:
            return DTYPES[self.config.grad_reduce_dtype]
        # bf16-true / 16-true: reduce and keep gradients in float32 for the float32 master weights.
        return torch.float32 if self._master_weights else None

    # --- steps -------------------------------------------------------------------------------------------------------
    def before_backward(self) -> None:
        """Every backward adds to the gradients until they are cleared (Note [gradient lifecycle] in
        ``engine/grad_sync.py``)."""
        if self.wrapper is not None:
            self.wrapper.prepare_backward()

    def after_backward(self) -> None:
        """End of a backward that reduces (not inside ``no_sync``): owned parameters get their gradient."""
        wrapper = self.wrapper
        if wrapper is not None and wrapper.grad_sync.reduces_on_backward:
            wrapper.finish_grad_sync()

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward(**kwargs)`` between :meth:`before_backward` and :meth:`after_backward`."""
        self.before_backward()
        loss.backward(**kwargs)
        self.after_backward()

    def before_step(self, what: str = "optimizer.step()") -> None:
        """No all-gather may still read the shards the step writes; the gradients must be reduced."""
        wrapper = self.wrapper
        if wrapper is None:
            return
        wrapper.param_sync.finish()
        if [len(optimizer.param_groups) for optimizer in self.optimizers] != self._group_counts:
            self._use_stepped_tensors()  # optimizer.add_param_group since the last step: pieces and masters
        if wrapper.grad_sync.grads_pending:
            raise RuntimeError(
                f"strategy='layerwise': {what} with gradients that were never reduced: the last backward ran "
                "inside no_sync (fabric.no_backward_sync / trainer.model.no_sync()) or bypassed the strategy (a "
                "bare loss.backward() instead of self.manual_backward(loss) / fabric.backward(loss)). Run the "
                "step's last backward through the strategy and outside no_sync.")
        wrapper.grad_sync.before_step()

    def after_step(self, optimizer: Optional[Optimizer] = None) -> None:
        """Masters written back, the all-gather started (awaited by the next forward), replicas checked.

        With several optimizers only the buckets holding ``optimizer``'s parameters are gathered."""
        wrapper = self.wrapper
        if wrapper is None:
            return
        if self.masters is not None:
            self.masters.write_back()
        stepped = None
        if optimizer is not None and len(self.optimizers) > 1:
            stepped = [t for g in optimizer.param_groups for t in g["params"]]
        wrapper.start_param_sync(force_sync=self.sync_after_step or self._compiled_needs_sync(wrapper),
                                 tensors=stepped)
        self.steps.taken += 1
        every = self.config.replica_check_every
        if every is not None and self.steps.taken % every == 0:
            wrapper.check_replicas()

    def step(self, optimizer: Optimizer, closure: Optional[Callable[[], Any]] = None) -> Any:
        """:meth:`before_step`, ``optimizer.step()`` unless :meth:`StepCount.skip` skips it, :meth:`after_step`."""
        self.before_step()
        if self.steps.skip():
            return None
        output = optimizer.step() if closure is None else optimizer.step(closure)
        self.after_step(optimizer)
        return output

    def _compiled_needs_sync(self, wrapper: LayerwiseDataParallel) -> bool:
        """The wrapper itself ran compiled (Note [compiled wrapper] in ``engine/data_parallel.py``): under ``"auto"``,
        no overlap."""
        overlap = self.config.overlap_param_gather
        if not wrapper.compiled_forward or overlap is False:
            return False
        if overlap is True:
            raise ValueError(f"{self._name}(overlap_param_gather=True) with a model compiled around the strategy's "
                             "wrapper (fabric.setup of a torch.compile'd model): a graph traced while no all-gather "
                             "was in flight would not wait for one. Use overlap_param_gather='auto' (the all-gather "
                             "then completes inside each step) or False.")
        return True

    def sync_parameters(self) -> None:
        """Waits until every rank holds the current parameters (no collective if already synced)."""
        if self.wrapper is not None:
            self.wrapper.param_sync.finish()

    # --- checkpoints -------------------------------------------------------------------------------------------------
    def save_checkpoint(self, path: Any, **extra: Any) -> None:
        """A plain loop's checkpoint: the model, every optimizer and ``extra`` (e.g. ``step=100``), in
        ``checkpoint_format`` (collective). The keys are the Trainer's (``state_dict``, ``optimizer_states``),
        so a full file opens with ``torch.load(path)["state_dict"]``."""
        checkpoints = self.checkpoints
        target = self.env.broadcast(str(path))
        checkpoints.check_save(target, None, f"{self._name}.save_checkpoint", has_model=self.module is not None)
        model_state = checkpoints.module_state_dict()
        optimizer_states = [checkpoints.save_format.optimizer_state(checkpoints, optimizer)
                            for optimizer in self.optimizers]
        whole = {"state_dict": model_state, "optimizer_states": optimizer_states, **extra}
        checkpoints.save_format.save(checkpoints, target, Checkpoint(whole, model_state, optimizer_states, dict(extra)),
                                     TorchFileIO(), None)

    def load_checkpoint(self, path: Any, strict: bool = True, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Restores what :meth:`save_checkpoint` wrote, in either format and at any world size, into the wrapped
        module and its optimizers (collective); returns the ``extra`` values."""
        if self.module is None:
            raise RuntimeError(f"{self._name}: wrap the module before loading a checkpoint into it.")
        rest = self.checkpoints.restore(
            self.checkpoints.resolve_path(path), module_key="state_dict", optimizers=self.optimizers,
            load_module=lambda state: self.checkpoints.load_model_state(state, strict=strict), strict=strict,
            weights_only=weights_only, strict_hint="Pass strict=False to load the keys that match.")
        rest.pop("layerwise", None)
        return rest

    # --- the end -----------------------------------------------------------------------------------------------------
    def release(self, whole: bool = True) -> Optional[torch.nn.Module]:
        """Unwraps the module and destroys this run's groups; returns the module (``None`` if not wrapped).

        ``whole=False`` (interpreter exit): with sharded parameters nothing is gathered; a parameter this rank
        does not hold becomes a meta tensor (Note [sharded release] in ``engine/sharded.py``).

        Also called from inside an exception handler after a failed run. If a collective failed (a dead
        rank), waiting for the pending ones raises the same error again and hides the original traceback:
        then they are abandoned instead. With sharded parameters a failed run issues no collective at all
        (gathering the module whole would wait for ranks that may have failed elsewhere, or not at all): the
        module keeps what this rank holds, and NaN in place of the rest. A checkpoint saved afterwards still
        writes the last layout's parts.
        """
        failing = sys.exc_info()[0] is not None
        wrapper = self.wrapper
        module = None
        if wrapper is not None:
            self.checkpoints.release()
            if failing:
                self.reads.post_failure()  # for the adapter to raise in place of a closed connection
            try:
                module = wrapper.release(wait=not (failing and wrapper.shard_parameters), whole=whole)
            except Exception:
                if not failing:
                    raise
                module = wrapper.release(wait=False)
            self.wrapper = None
            self.masters = None
        if self._gradient_utilities is not None:
            self._gradient_utilities.release()
            self._gradient_utilities = None
        if self.groups is not None:
            # Communicators (and gloo's threads) made for this run end with it: none outlives the run or
            # reaches interpreter exit (where a live one can abort the process).
            try:
                self.groups.destroy()
                self.reads.close()
            except Exception:
                if not failing:
                    raise
            self.groups = None
        return module


def release(module: torch.nn.Module) -> torch.nn.Module:
    """Ends the runs training ``module`` (collective: every rank calls it): every parameter whole again, in its
    own storage, every hook removed, the runs' groups destroyed; returns ``module``.

    With ``shard_parameters=True`` the module stays sharded after ``trainer.fit`` (Note [sharded release] in
    ``engine/sharded.py``); this gives it back as ``ddp`` leaves it, for a script that then reads or saves it on
    one rank. ``module``: the model, a LightningModule, Fabric's module or the wrapper; a module no run trains
    passes through unchanged."""
    for wrapper in wrappers_of(module):
        (wrapper.ended_by or wrapper.release)()
    return module


def is_compiled(module) -> bool:
    """Whether ``module`` (or a submodule) is ``torch.compile``d."""
    if getattr(module, "_compiler_ctx", None) is not None:
        return True
    optimized = getattr(getattr(torch, "_dynamo", None), "eval_frame", None)
    optimized = getattr(optimized, "OptimizedModule", None)
    return optimized is not None and any(isinstance(m, optimized) for m in module.modules())


def stepped_tensor(wrapper: Optional[LayerwiseDataParallel], masters: Optional[MasterWeights],
                   param: torch.nn.Parameter) -> torch.Tensor:
    """What the optimizers hold for the model parameter ``param`` on this rank: its piece, its float32 master, or
    ``param`` itself (``wrapper``, ``masters``: a session's)."""
    if wrapper is None:
        return param
    shard = wrapper.records.piece_of(param)
    tensor = param if shard is None else shard
    return masters.master_of.get(tensor, tensor) if masters is not None else tensor


def model_parameter(wrapper: Optional[LayerwiseDataParallel], tensor: torch.Tensor) -> torch.Tensor:
    """The model parameter an optimizer's tensor stands for (a piece, a master), or the tensor itself (inverse of
    :func:`stepped_tensor`)."""
    record = None if wrapper is None else wrapper.records.of(tensor)
    return tensor if record is None else record.param
