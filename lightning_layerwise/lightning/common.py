"""What the two Lightning adapters share: strategy names, argument checks, and the session's env from a strategy.

Both :class:`~lightning_layerwise.LayerwiseStrategy` (Trainer) and
:class:`~lightning_layerwise.LayerwiseFabricStrategy` (Fabric) are ``DDPStrategy`` subclasses
that hold a :class:`~lightning_layerwise.session.LayerwiseSession`; this module is the
little they have in common beyond it.
"""

from __future__ import annotations

import atexit
import weakref
from typing import Any, Callable, Optional

import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn

from ..config import SETTINGS, LayerwiseConfig
from ..engine.data_parallel import LayerwiseDataParallel
from ..engine.process_groups import ProcessGroups
from ..session import LayerwiseSession, SessionEnv

STRATEGY_NAMES = (("layerwise", "popen"), ("layerwise_spawn", "spawn"), ("layerwise_fork", "fork"),
                  ("layerwise_notebook", "fork"))
"""The registered names and their start methods, as ``ddp`` has them (Trainer and Fabric alike)."""


def register_strategy_names(cls: type, registry) -> None:
    """Registers ``cls`` under :data:`STRATEGY_NAMES` in a Trainer or Fabric strategy registry."""
    for name, start_method in STRATEGY_NAMES:
        registry.register(name, cls, description=f"Layer-wise distributed optimizer, start_method='{start_method}'",
                          start_method=start_method, override=True)


def check_precision(plugin, supported: tuple) -> None:
    """The precision kinds whose clipping and inf checks the strategy makes collective (exact types)."""
    if plugin is not None and type(plugin) not in supported:
        raise ValueError(
            f"strategy='layerwise' does not support the precision plugin {type(plugin).__name__}: gradients are "
            "sharded across ranks, so clipping and inf checks must be made across shards. Use precision='32-true', "
            "'64-true', 'bf16-mixed', '16-mixed', 'bf16-true' or '16-true'.")


class CheckedAccelerator:
    """CPU (gloo) and CUDA (NCCL) only; checked when the Trainer or Fabric is built (mixin for a strategy)."""

    _accelerator_classes: tuple = ()  # the host's CPU and CUDA accelerator classes
    _accelerator_fix: str = ""  # how to ask for one of them

    @property
    def accelerator(self):
        return self._accelerator

    @accelerator.setter
    def accelerator(self, accelerator) -> None:
        if accelerator is not None and not isinstance(accelerator, self._accelerator_classes):
            raise ValueError(f"strategy='layerwise' runs on CPU (gloo) and CUDA GPUs (NCCL), not on "
                             f"{type(accelerator).__name__}; use {self._accelerator_fix}.")
        self._accelerator = accelerator


class SessionAdapter(CheckedAccelerator):
    """What a Lightning strategy holding a :class:`LayerwiseSession` (``self.session``) shows of its run (mixin).

    :attr:`wrapper` and :attr:`process_groups` are set as the session wraps and releases (through :meth:`_wrap`
    and :meth:`_release`; ``llw.release(model)`` ends the run through :meth:`_release` too), and
    :attr:`skipped_steps` each time the strategy asks whether to skip a step (:meth:`_skip_step`)."""

    session: LayerwiseSession
    wrapper: Optional[LayerwiseDataParallel] = None
    """The engine wrapping the trained module (``None`` before setup and after teardown)."""
    process_groups: Optional[ProcessGroups] = None
    """The process groups of this run (``None`` before setup and after teardown); an MoE layer exchanges tokens
    over ``process_groups.expert_parallel``."""
    skipped_steps: int = 0
    """Optimizer steps skipped because some rank's gradients were not finite (``skip_nonfinite_steps``)."""

    @property
    def expert_parallel_rank(self) -> int:
        """Which experts this rank holds: known after launch, before setup (Note [expert parallelism] in
        ``engine/process_groups.py``)."""
        self.session.env = session_env(self)
        return self.session.expert_parallel_rank

    @property
    def device_mesh(self):
        """The ``(data_parallel, tensor_parallel)`` ``DeviceMesh`` with ``tensor_parallel_size > 1``, as
        ``ModelParallelStrategy`` names it (Note [tensor-parallel mesh] in ``engine/tensor_parallel.py``); made at
        first use after launch (collective); ``None`` without tensor parallelism."""
        self.session.env = session_env(self)
        return self.session.device_mesh

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Data is split by data-parallel rank: the ranks of one tensor-parallel group read the same batch."""
        T = self.session.config.tensor_parallel_size
        return {"num_replicas": self.num_nodes * self.num_processes // T, "rank": self.global_rank // T}

    def _setup_device_mesh(self, module) -> None:
        """Under tensor parallelism: checks the size against the processes per node and gives ``module`` (a
        LightningModule) the mesh before ``configure_model`` runs, as ``ModelParallelStrategy`` does."""
        T = self.session.config.tensor_parallel_size
        if T == 1:
            return
        per_node = self.num_processes
        if per_node % T:
            valid = [t for t in range(1, per_node + 1) if per_node % t == 0]
            raise ValueError(f"{type(self).__name__}(tensor_parallel_size={T}) must divide the {per_node} processes "
                             f"per node (a tensor-parallel group stays inside a node); valid sizes: {valid}.")
        mesh = self.device_mesh
        if module is not None:
            module._device_mesh = mesh

    def sync_parameters(self) -> None:
        """Waits until every rank holds the current parameters (no collective if already synced)."""
        if self.wrapper is not None:
            self.wrapper.param_sync.finish()

    def _wrap(self, module, optimizers, **options) -> LayerwiseDataParallel:
        """``session.wrap``; the run is then this strategy's to show and to end."""
        try:
            wrapper = self.session.wrap(module, optimizers, **options)
        finally:
            self.wrapper, self.process_groups = self.session.wrapper, self.session.groups
        wrapper.ended_by = self._release  # llw.release(module) ends the run through the strategy
        return wrapper

    def _release(self, whole: bool = True) -> None:
        """``session.release(whole)``: the run ends, and the strategy no longer shows it."""
        try:
            self.session.release(whole)
        finally:
            self.wrapper, self.process_groups = self.session.wrapper, self.session.groups

    def _skip_step(self, step=None) -> bool:
        """``session.steps.skip(step)``, counted in :attr:`skipped_steps`."""
        skipped = self.session.steps.skip(step)
        self.skipped_steps = self.session.steps.skipped
        return skipped


def session_env(strategy) -> SessionEnv:
    """The session's view of this process, from a launched Lightning ``DDPStrategy`` (Trainer or Fabric)."""
    _destroy_gloo_default_group_at_exit()
    return SessionEnv(world_size=strategy.world_size, rank=strategy.global_rank,
                      ranks_per_node=len(strategy.parallel_devices or ()) or None, device=strategy.root_device,
                      backend=strategy.process_group_backend, timeout=strategy._timeout, broadcast=strategy.broadcast,
                      info=rank_zero_info, warn=rank_zero_warn)


def start_session(strategy, config: LayerwiseConfig) -> None:
    """Gives ``strategy`` its config (also each setting as an attribute, read-only by convention) and session."""
    strategy.config = config
    for name in SETTINGS:
        setattr(strategy, name, getattr(config, name))
    strategy.session = LayerwiseSession(config, name=type(strategy).__name__)


def release_at_exit(strategy) -> Callable[[], None]:
    """Registers the end of ``strategy``'s run at interpreter exit, where the last step's all-gather may still be
    in flight and live communicators can abort the process: pending collectives are waited for and the groups
    destroyed, with nothing gathered (Note [sharded release] in ``engine/sharded.py``). Holds the strategy weakly."""
    ref = weakref.ref(strategy)

    def release() -> None:
        live = ref()
        if live is not None and live.session.wrapper is not None:
            live._release(whole=False)

    atexit.register(release)
    return release


_AT_EXIT: list = []


def _destroy_gloo_default_group_at_exit() -> None:
    """Lightning leaves the default process group alive after a run. With gloo, a group still alive when the
    interpreter finalizes can abort the process after a run that succeeded ("terminate called without an active
    exception", exit code -6: seen once, in a 2-process SLURM launch of the test suite; rare enough that 30
    launches under load did not show it again). So at exit a gloo default group still initialized is destroyed
    first, as torch asks of every program (local: no collective; registered once per process). NCCL's is left
    to its own shutdown, which may wait on peers."""
    if _AT_EXIT:
        return

    def destroy() -> None:
        if dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo":
            dist.destroy_process_group()

    _AT_EXIT.append(destroy)
    atexit.register(destroy)
