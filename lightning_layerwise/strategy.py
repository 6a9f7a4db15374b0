"""Lightning glue: ``Trainer(strategy="layerwise")``.

:class:`LayerwiseStrategy` reuses everything of Lightning's ``DDPStrategy`` that
does not touch gradients (launchers, cluster environments, process-group set-up,
``reduce``/``barrier``/``broadcast``, samplers, ``sync_batchnorm``) and replaces
the ``DistributedDataParallel`` wrapper with :class:`LayerwiseDataParallel`. The
rest is a handful of hook overrides that call into the engine:

* end of backward on the last micro-batch: ``finish_grad_sync`` (owned params get
  the reduced gradient, the others none);
* gradient clipping by norm uses the global norm across shards, and a ``16-mixed``
  grad scaler agrees on "found inf" across ranks (``precision.py``);
* after ``optimizer.step``: ``start_param_sync`` (async all-gather, awaited by the
  next forward's pre-hooks);
* before evaluation, checkpointing and teardown: ``finish_param_sync``;
* the optimizer state, sharded by ownership, is gathered into one full state
  dict for a checkpoint and pruned back to the owned part on load.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import Any, Callable, Literal, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.distributed import _distributed_is_initialized
from lightning.pytorch import Callback, LightningModule
from lightning.pytorch.accelerators import Accelerator, CPUAccelerator, CUDAAccelerator
from lightning.pytorch.callbacks import (
    EarlyStopping,
    LearningRateMonitor,
    ModelCheckpoint,
    ModelSummary,
    ProgressBar,
    Timer,
)
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import HalfPrecision, Precision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from torch.distributed.constants import default_pg_timeout
from torch.optim import Optimizer
from typing_extensions import override

from .data_parallel import LayerwiseDataParallel
from .layout import DEFAULT_BUCKET_SIZE
from .precision import MasterWeights, adapt_precision_plugin
from .process_groups import ProcessGroups

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class LayerwiseStrategy(DDPStrategy):
    """Data-parallel training with a layer-wise distributed optimizer.

    Gradients are reduce-scattered into shard-aligned buckets, each rank steps
    only the parameters it owns (any single torch optimizer, e.g.
    :class:`lightning_layerwise.Muon`), and parameters are all-gathered bucket by
    bucket behind the next forward.

    Args:
        bucket_size: elements per communication bucket (all shards together).
        overlap_grad_reduce: start a bucket's reduce-scatter during backward as soon
            as its gradients are complete.
        overlap_param_gather: all-gather parameters asynchronously after
            ``optimizer.step``, each bucket awaited by a forward pre-hook just before its
            first module runs. ``"auto"`` (default) overlaps unless something reads
            parameters between steps (a callback outside Lightning's progress bars,
            checkpointing, LR monitor, model summary, timer and early stopping, or the
            LightningModule itself, overriding ``on_train_batch_end`` /
            ``on_train_epoch_end``), or the model is ``torch.compile``d (compiled
            graphs may skip the pre-hooks); then the all-gather completes inside the
            step. ``True`` always overlaps: code between steps may then see other
            ranks' parameters from the previous step until it calls
            :meth:`sync_parameters`. ``False`` never overlaps.
        prefetch_depth: buckets whose all-gather may be in flight at once.
        separate_all_gather_group: run all-gathers on their own process group so they
            can overlap reduce-scatters.
        grad_reduce_dtype: dtype of the gradient buffers and reduce-scatter
            (``"float32"``, ``"bfloat16"``, ``"float16"``); default: the parameter dtype.
        broadcast_buffers: broadcast module buffers from rank 0 at every training
            forward, as ``ddp`` does.
        checkpoint_format: ``"full"``: rank 0 writes one ordinary Lightning checkpoint
            holding the full model and the full (gathered) optimizer state.
        process_group_backend: ``"nccl"``, ``"gloo"``…; default by device.
        timeout: collective timeout.
        start_method: how processes are launched, as for ``ddp``.
    """

    strategy_name = "layerwise"

    def __init__(
        self,
        bucket_size: int = DEFAULT_BUCKET_SIZE,
        overlap_grad_reduce: bool = True,
        overlap_param_gather: Union[bool, Literal["auto"]] = "auto",
        prefetch_depth: int = 2,
        separate_all_gather_group: bool = True,
        grad_reduce_dtype: Optional[Literal["float32", "bfloat16", "float16"]] = None,
        broadcast_buffers: bool = True,
        checkpoint_format: Literal["full"] = "full",
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        accelerator: Optional[Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
    ) -> None:
        if isinstance(bucket_size, bool) or not isinstance(bucket_size, int) or bucket_size <= 0:
            raise ValueError(f"LayerwiseStrategy(bucket_size={bucket_size!r}): pass a positive number of elements, "
                             f"e.g. bucket_size={DEFAULT_BUCKET_SIZE}.")
        if overlap_param_gather not in (True, False, "auto"):
            raise ValueError(f"LayerwiseStrategy(overlap_param_gather={overlap_param_gather!r}): use True, False "
                             "or 'auto'.")
        if isinstance(prefetch_depth, bool) or not isinstance(prefetch_depth, int) or prefetch_depth < 1:
            raise ValueError(f"LayerwiseStrategy(prefetch_depth={prefetch_depth!r}): pass an integer >= 1.")
        if grad_reduce_dtype is not None and grad_reduce_dtype not in _DTYPES:
            raise ValueError(f"LayerwiseStrategy(grad_reduce_dtype={grad_reduce_dtype!r}): use one of "
                             f"{sorted(_DTYPES)} or None (the parameter dtype).")
        if checkpoint_format != "full":
            raise ValueError(f"LayerwiseStrategy(checkpoint_format={checkpoint_format!r}): only 'full' is "
                             "available (one Lightning checkpoint with the gathered optimizer state).")
        if start_method not in ("popen", "spawn", "fork", "forkserver"):
            raise ValueError(f"LayerwiseStrategy(start_method={start_method!r}): use 'popen', 'spawn', 'fork' "
                             "or 'forkserver'.")
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        self.bucket_size = bucket_size
        self.overlap_grad_reduce = overlap_grad_reduce
        self.overlap_param_gather = overlap_param_gather
        self.prefetch_depth = prefetch_depth
        self.separate_all_gather_group = separate_all_gather_group
        self.grad_reduce_dtype = grad_reduce_dtype
        self.broadcast_buffers = broadcast_buffers
        self.checkpoint_format = checkpoint_format
        self._masters: Optional[MasterWeights] = None
        self._sync_after_step = False  # complete the all-gather inside optimizer_step (see setup)

    # --- accelerators ----------------------------------------------------------------
    @property
    @override
    def accelerator(self) -> Optional[Accelerator]:
        return self._accelerator

    @accelerator.setter
    @override
    def accelerator(self, accelerator: Optional[Accelerator]) -> None:
        if accelerator is not None and not isinstance(accelerator, (CPUAccelerator, CUDAAccelerator)):
            raise ValueError(
                f"strategy='layerwise' runs on CPU (gloo) and CUDA GPUs (NCCL), not on "
                f"{type(accelerator).__name__}; use accelerator='cpu' or accelerator='gpu' (CUDA)."
            )
        self._accelerator = accelerator

    # --- wrapping --------------------------------------------------------------------
    @property
    def wrapper(self) -> Optional[LayerwiseDataParallel]:
        return self.model if isinstance(self.model, LayerwiseDataParallel) else None

    @override
    def configure_ddp(self) -> None:
        groups = ProcessGroups.create(
            separate_all_gather=self.separate_all_gather_group, backend=self.process_group_backend,
            timeout=self._timeout,
        )
        self.model = LayerwiseDataParallel(
            self.model,
            process_groups=groups,
            bucket_size=self.bucket_size,
            overlap_grad_reduce=self.overlap_grad_reduce,
            overlap_param_gather=self.overlap_param_gather is not False,
            prefetch_depth=self.prefetch_depth,
            grad_reduce_dtype=self._grad_reduce_dtype(),
            broadcast_buffers=self.broadcast_buffers,
        )

    def _half_true(self) -> bool:
        return isinstance(self.precision_plugin, HalfPrecision)

    def _grad_reduce_dtype(self) -> Optional[torch.dtype]:
        if self.grad_reduce_dtype is not None:
            return _DTYPES[self.grad_reduce_dtype]
        # bf16-true / 16-true: reduce and keep gradients in float32 for the float32 master weights.
        return torch.float32 if self._half_true() else None

    @override
    def setup(self, trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            self._check_optimizers()
            adapt_precision_plugin(self.precision_plugin, self)
            if self._half_true() and self.optimizers:
                self._masters = MasterWeights(self.wrapper, self.optimizers[0])
            self._sync_after_step = self._needs_sync_after_step(trainer)

    def _needs_sync_after_step(self, trainer) -> bool:
        """Whether the all-gather must complete inside the step; see ``overlap_param_gather``."""
        if self.overlap_param_gather == "auto":
            readers = _parameter_readers(trainer)
            if readers:
                rank_zero_info(f"LayerwiseStrategy: {', '.join(readers)} run between optimizer steps, so "
                               "parameters are all-gathered inside each step (pass overlap_param_gather=True "
                               "to overlap anyway).")
                return True
            if _is_compiled(self.lightning_module):
                rank_zero_info("LayerwiseStrategy: the model is compiled, so parameters are all-gathered inside "
                               "each step (compiled graphs may skip the forward pre-hooks).")
                return True
            return False
        if self.overlap_param_gather is True and _is_compiled(self.lightning_module):
            rank_zero_warn("LayerwiseStrategy(overlap_param_gather=True) with a compiled model: a graph compiled "
                           "before the strategy added its forward pre-hooks runs without them and reads stale "
                           "parameters. Use overlap_param_gather='auto' unless you compiled after setup.")
        return False

    def _check_optimizers(self) -> None:
        if len(self.optimizers) > 1:
            raise ValueError(
                f"strategy='layerwise' steps one optimizer per training step, but configure_optimizers returned "
                f"{len(self.optimizers)}. Put all parameters in one optimizer with several param groups "
                "(lightning_layerwise.Muon already combines Muon and AdamW groups)."
            )

    @override
    def _register_ddp_hooks(self) -> None:
        """DDP communication hooks do not apply: communication is the wrapper's own."""

    @override
    @contextlib.contextmanager
    def block_backward_sync(self):
        wrapper = self.wrapper
        if wrapper is None:
            yield None
            return
        with wrapper.no_sync():
            yield None

    @override
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        wrapper = self.wrapper
        if wrapper is not None and wrapper.reduces_on_backward:
            wrapper.finish_grad_sync()
            if self._masters is not None:
                self._masters.attach_grads()

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: Optional[Union["torch.nn.Module", Any]] = None,
        **kwargs: Any,
    ) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        wrapper = self.wrapper
        if wrapper is not None:
            if self._masters is not None:
                self._masters.write_back()
            wrapper.start_param_sync(force_sync=self._sync_after_step)
        return output

    def sync_parameters(self) -> None:
        """Waits until every rank holds the current parameters (no collective if already synced)."""
        wrapper = self.wrapper
        if wrapper is not None:
            wrapper.finish_param_sync()

    @override
    def on_train_end(self) -> None:
        self.sync_parameters()
        super().on_train_end()

    @override
    def on_validation_start(self) -> None:
        self.sync_parameters()
        super().on_validation_start()

    @override
    def on_test_start(self) -> None:
        self.sync_parameters()
        super().on_test_start()

    @override
    def on_predict_start(self) -> None:
        self.sync_parameters()
        super().on_predict_start()

    # --- checkpoints -----------------------------------------------------------------
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        self.sync_parameters()
        return super().lightning_module_state_dict()

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The full optimizer state: every rank's owned entries gathered (collective)."""
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        local = optimizer.state_dict()
        distributed = _distributed_is_initialized() and dist.get_world_size() > 1
        full = {"state": local["state"], "param_groups": local["param_groups"]}
        if distributed:
            full["state"] = _merge_by_rank({k: _to_cpu(v) for k, v in local["state"].items()})
        if self._masters is not None:
            masters = self._masters.state_dict()
            full["master_weights"] = _merge_by_rank(masters) if distributed else masters
        return full

    @override
    def load_optimizer_state_dict(self, checkpoint) -> None:
        states = checkpoint["optimizer_states"]
        masters = [s.pop("master_weights", None) for s in states]
        super().load_optimizer_state_dict(checkpoint)
        if self._masters is not None and masters and masters[0] is not None:
            self._masters.load_state_dict(masters[0])
        wrapper = self.wrapper
        if wrapper is None:
            return
        for optimizer in self.optimizers:
            for p in list(optimizer.state):
                if p in wrapper._param_names and not wrapper.owns(p):
                    del optimizer.state[p]  # another rank steps it; keep state once in the world

    # --- teardown ----------------------------------------------------------------------
    @override
    def teardown(self) -> None:
        wrapper = self.wrapper
        if wrapper is not None:
            wrapper.finish_param_sync()
            wrapper.release()
            self.model = self.lightning_module
            self._masters = None
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: StrategyRegistry) -> None:
        for name, start_method in (("layerwise", "popen"), ("layerwise_spawn", "spawn"),
                                   ("layerwise_fork", "fork"), ("layerwise_notebook", "fork")):
            strategy_registry.register(
                name, cls, description=f"Layer-wise distributed optimizer, start_method='{start_method}'",
                start_method=start_method, override=True,
            )


# Lightning callbacks that do not read parameters in on_train_batch_end / on_train_epoch_end
# (checkpointing syncs through lightning_module_state_dict).
_PARAMETER_SAFE_CALLBACKS = (ModelCheckpoint, LearningRateMonitor, ProgressBar, ModelSummary, Timer, EarlyStopping)
_BETWEEN_STEP_HOOKS = ("on_train_batch_end", "on_train_epoch_end")


def _parameter_readers(trainer) -> list[str]:
    """Callbacks (and the LightningModule) whose hooks between steps may read parameters."""
    readers = []
    for callback in trainer.callbacks:
        if isinstance(callback, _PARAMETER_SAFE_CALLBACKS):
            continue
        if any(getattr(type(callback), h) is not getattr(Callback, h) for h in _BETWEEN_STEP_HOOKS):
            readers.append(type(callback).__name__)
    module = trainer.lightning_module
    if any(getattr(type(module), h) is not getattr(LightningModule, h) for h in _BETWEEN_STEP_HOOKS):
        readers.append(f"{type(module).__name__} (LightningModule hooks)")
    return readers


def _is_compiled(module) -> bool:
    if getattr(module, "_compiler_ctx", None) is not None:
        return True
    optimized = getattr(getattr(torch, "_dynamo", None), "eval_frame", None)
    optimized = getattr(optimized, "OptimizedModule", None)
    return optimized is not None and any(isinstance(m, optimized) for m in module.modules())


def _merge_by_rank(part: dict) -> dict:
    """Every rank's disjoint ``part`` merged into one dict, on every rank (collective)."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, part)
    merged: dict = {}
    for other in gathered:
        merged.update(other)
    return dict(sorted(merged.items()))


def _to_cpu(value):
    if torch.is_tensor(value):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    return value
