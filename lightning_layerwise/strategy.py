"""Lightning glue: ``Trainer(strategy="layerwise")``.

:class:`LayerwiseStrategy` reuses everything of Lightning's ``DDPStrategy`` that
does not touch gradients (launchers, cluster environments, process-group set-up,
``reduce``/``barrier``/``broadcast``, samplers, ``sync_batchnorm``) and replaces
the ``DistributedDataParallel`` wrapper with :class:`LayerwiseDataParallel`. The
rest is a handful of hook overrides that call into the engine:

* end of backward on the last micro-batch: ``finish_grad_sync`` (owned params get
  the reduced gradient, the others none);
* gradient clipping by norm uses the global norm across shards, and a ``16-mixed``
  grad scaler agrees on "found inf" across ranks: the strategy's own precision
  plugin (``precision.py``);
* after ``optimizer.step``: ``start_param_sync`` (async all-gather, awaited by the
  next forward's pre-hooks);
* before evaluation, checkpointing and teardown: ``finish_param_sync``;
* checkpoints are keyed by parameter name and written either sharded (each rank
  writes what it owns, ``torch.distributed.checkpoint``) or as one full file; on
  load each rank keeps the state of the parameters it owns under the new
  layout (``checkpoint.py``).
"""

from __future__ import annotations

import contextlib
import hashlib
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Literal, Optional, Sequence, Union

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment, TorchCheckpointIO
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.fabric.utilities.optimizer import _optimizer_to_device, _optimizers_to_device
from lightning.fabric.utilities.types import _PATH
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
from lightning.pytorch.overrides.distributed import _sync_module_states
from lightning.pytorch.plugins.precision import HalfPrecision, Precision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.constants import default_pg_timeout
from torch.optim import Optimizer
from typing_extensions import override

from . import checkpoint as ckpt
from .data_parallel import LayerwiseDataParallel
from .layout import DEFAULT_BUCKET_SIZE, choose_owner_group_size, param_specs
from .experts import check_expert_marks, expert_key_map, expert_key_predicate, expert_parameter_names
from .optim.elementwise import elementwise_parameters, resolve_optimizer_classes
from .precision import SUPPORTED_PRECISION as _SUPPORTED_PRECISION
from .precision import MasterWeights, layerwise_precision
from .process_groups import ProcessGroups
from .read_guard import READ_GUARDS

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
            first module runs, and by any other read of its parameters (see
            ``param_read_guard``). ``"auto"`` (default) overlaps unless the model is
            ``torch.compile``d (compiled graphs may skip the pre-hooks) or, with
            ``param_read_guard="off"``, something reads parameters between steps; then
            the all-gather completes inside the step. ``True`` always overlaps;
            ``False`` never does.
        param_read_guard: a read of a parameter whose all-gather has not landed, made
            outside the forward pre-hook of the module holding it (``nn.MultiheadAttention``
            reading ``out_proj.weight``, ``F.linear(x, child.weight)``, a parametrization,
            code in ``training_step`` or a hook before the forward, a callback between
            steps): ``"wait"`` (default) waits for that bucket, so every read sees this
            step's value; ``"strict"`` raises :class:`StaleParameterReadError` naming the
            parameter, and fills other ranks' shards with NaN until they arrive (a
            debugging mode that finds reads costing overlap); ``"off"`` lets such reads
            see stale values (for measurements).
        prefetch_depth: buckets whose all-gather may be in flight at once.
        separate_all_gather_group: run all-gathers on their own process group so they
            can overlap reduce-scatters.
        grad_reduce_dtype: dtype of the gradient buffers and reduce-scatter
            (``"float32"``, ``"bfloat16"``, ``"float16"``); default: the parameter dtype.
        broadcast_buffers: broadcast module buffers from rank 0 at every training
            forward, as ``ddp`` does.
        checkpoint_format: ``"sharded"`` (default): a directory written with
            ``torch.distributed.checkpoint`` in which each rank writes the parameters it
            owns and their optimizer state, keyed by parameter name, plus Lightning's
            ``meta.pt``. ``"full"``: rank 0 writes one ordinary Lightning checkpoint file
            with the full model and the optimizer state gathered to it, keyed by
            parameter name (loadable by ``ddp`` and ``load_from_checkpoint``). Both
            resume at any world size and bucket size; see docs/checkpointing.md.
        replica_check_every: every this many optimizer steps, check right after the
            all-gather that all ranks hold bitwise-equal parameters (one all-gather of one
            checksum per bucket; Note [replica check] in ``data_parallel.py``) and stop
            with :class:`ReplicaDivergenceError`, naming the bucket and parameters, if
            not. ``None`` (default): never.
        skip_nonfinite_steps: skip the optimizer step on every rank when any rank's
            reduced gradients hold inf or NaN (agreed by one all-reduce), warn, and count it
            in :attr:`skipped_steps`. ``16-mixed`` keeps its grad scaler, which does the
            same and lowers the loss scale. Default ``False``: step anyway, as ``ddp``.
        elementwise_fill: split the parameters the optimizer updates element-wise (the AdamW
            groups of :class:`lightning_layerwise.Muon`; ``torch.optim`` AdamW, Adam, SGD…)
            across shards, so they fill the buckets without padding and each rank steps its
            piece (Note [element-wise fill] in ``layout.py``). Matrices of Muon groups and
            parameters of any optimizer not known to be element-wise stay whole. ``False``:
            every parameter is owned whole.
        elementwise_optimizers: further optimizer classes (or import paths such as
            ``"my_package.optim.Lion"``) whose update is element-wise in every param group,
            so that their parameters may be split too. A promise the library cannot check:
            an optimizer that looks at a whole tensor (a norm, a trust ratio, a factored
            second moment) would then be given pieces.
        owner_group_size: split the data-parallel ranks into owner groups of this many
            consecutive ranks (hierarchical sharding, as HSDP): the layout is planned for
            one group, gradients are reduce-scattered and parameters all-gathered inside
            it, and each owned shard is all-reduced across the groups (Note [owner
            groups] in ``process_groups.py``). ``"auto"`` (default) keeps one group on one
            node; across nodes it picks the divisor of the world size that needs the least
            memory per rank, preferring groups inside a node (Note [choosing the owner
            group size] in ``layout.py``);
            ``None``: one group of every rank; an integer must divide the world size.
        expert_parallel_size: ``E > 1`` spreads the experts of a mixture-of-experts model over
            expert-parallel groups of ``E`` consecutive ranks (Note [expert parallelism] in
            ``process_groups.py``): the model builds only the experts of
            :attr:`expert_parallel_rank` in containers marked with
            :func:`lightning_layerwise.mark_experts`, exchanges tokens over
            ``strategy.process_groups.expert_parallel``, and expert gradients are
            reduced over the ranks holding the same experts. ``E`` must divide the world
            size and every marked layer's expert count. See docs/moe.md.
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
        param_read_guard: Literal["wait", "strict", "off"] = "wait",
        prefetch_depth: int = 2,
        separate_all_gather_group: bool = True,
        grad_reduce_dtype: Optional[Literal["float32", "bfloat16", "float16"]] = None,
        broadcast_buffers: bool = True,
        checkpoint_format: Literal["sharded", "full"] = "sharded",
        replica_check_every: Optional[int] = None,
        skip_nonfinite_steps: bool = False,
        elementwise_fill: bool = True,
        elementwise_optimizers: Sequence[Union[type, str]] = (),
        owner_group_size: Union[int, Literal["auto"], None] = "auto",
        expert_parallel_size: int = 1,
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
        if param_read_guard not in READ_GUARDS:
            raise ValueError(f"LayerwiseStrategy(param_read_guard={param_read_guard!r}): use 'wait' (reads wait for "
                             "their all-gather), 'strict' (such reads raise, for debugging) or 'off' (stale reads, "
                             "for measurements only).")
        if isinstance(prefetch_depth, bool) or not isinstance(prefetch_depth, int) or prefetch_depth < 1:
            raise ValueError(f"LayerwiseStrategy(prefetch_depth={prefetch_depth!r}): pass an integer >= 1.")
        if grad_reduce_dtype is not None and grad_reduce_dtype not in _DTYPES:
            raise ValueError(f"LayerwiseStrategy(grad_reduce_dtype={grad_reduce_dtype!r}): use one of "
                             f"{sorted(_DTYPES)} or None (the parameter dtype).")
        if checkpoint_format not in ("sharded", "full"):
            raise ValueError(f"LayerwiseStrategy(checkpoint_format={checkpoint_format!r}): use 'sharded' (a "
                             "directory, each rank writes what it owns) or 'full' (one file written by rank 0).")
        if replica_check_every is not None and (isinstance(replica_check_every, bool)
                                                or not isinstance(replica_check_every, int) or replica_check_every < 1):
            raise ValueError(f"LayerwiseStrategy(replica_check_every={replica_check_every!r}): pass a number of "
                             "optimizer steps >= 1 (e.g. 100), or None to never check.")
        for name, value in (("overlap_grad_reduce", overlap_grad_reduce),
                            ("separate_all_gather_group", separate_all_gather_group),
                            ("broadcast_buffers", broadcast_buffers), ("skip_nonfinite_steps", skip_nonfinite_steps),
                            ("elementwise_fill", elementwise_fill)):
            if not isinstance(value, bool):
                raise ValueError(f"LayerwiseStrategy({name}={value!r}): pass True or False.")
        if isinstance(elementwise_optimizers, (str, type)):
            raise ValueError(f"LayerwiseStrategy(elementwise_optimizers={elementwise_optimizers!r}): pass a list of "
                             "optimizer classes or import paths, e.g. ['my_package.optim.Lion'].")
        elementwise_classes = resolve_optimizer_classes(elementwise_optimizers,
                                                        "LayerwiseStrategy(elementwise_optimizers=...)")
        bad_size = isinstance(owner_group_size, bool) or not isinstance(owner_group_size, int) or owner_group_size < 1
        if owner_group_size not in ("auto", None) and bad_size:
            raise ValueError(f"LayerwiseStrategy(owner_group_size={owner_group_size!r}): pass 'auto', None (one group "
                             "of every rank) or a positive integer that divides the number of ranks, e.g. 8.")
        if isinstance(expert_parallel_size, bool) or not isinstance(expert_parallel_size, int) \
                or expert_parallel_size < 1:
            raise ValueError(f"LayerwiseStrategy(expert_parallel_size={expert_parallel_size!r}): pass a positive "
                             "integer that divides the number of ranks and every MoE layer's expert count "
                             "(1: no expert parallelism).")
        if timeout is not None and not isinstance(timeout, timedelta):
            raise ValueError(f"LayerwiseStrategy(timeout={timeout!r}): pass a datetime.timedelta, e.g. "
                             "timeout=timedelta(minutes=30) (in a LightningCLI config: a number of seconds is not "
                             "accepted either).")
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
        self.param_read_guard = param_read_guard
        self.prefetch_depth = prefetch_depth
        self.separate_all_gather_group = separate_all_gather_group
        self.grad_reduce_dtype = grad_reduce_dtype
        self.broadcast_buffers = broadcast_buffers
        self.checkpoint_format = checkpoint_format
        self.replica_check_every = replica_check_every
        self.skip_nonfinite_steps = bool(skip_nonfinite_steps)
        self.elementwise_fill = elementwise_fill
        self.elementwise_optimizers = elementwise_classes
        self.owner_group_size = owner_group_size
        self.expert_parallel_size = expert_parallel_size
        self.skipped_steps = 0
        """Optimizer steps skipped because some rank's gradients were not finite (``skip_nonfinite_steps``)."""
        self._steps = 0  # optimizer steps this fit, for replica_check_every
        self._masters: Optional[MasterWeights] = None
        # parameter (or master weight) -> name, for checkpoints keyed by name; kept after teardown
        self._names: dict[torch.Tensor, str] = {}
        self._sync_after_step = False  # complete the all-gather inside optimizer_step (see setup)
        self._groups: Optional[ProcessGroups] = None  # created by configure_ddp, destroyed by teardown
        self._released_ownership: Optional[ckpt.Ownership] = None  # the last layout's, kept by teardown
        self._expert_map: dict[str, str] = {}  # local -> global expert names (Note [expert checkpoints])

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

    @property
    @override
    def precision_plugin(self) -> Precision:
        return self._precision_plugin if self._precision_plugin is not None else Precision()

    @precision_plugin.setter
    @override
    def precision_plugin(self, precision_plugin: Optional[Precision]) -> None:
        # Checked when the Trainer is built, before any process starts.
        if precision_plugin is not None and type(precision_plugin) not in _SUPPORTED_PRECISION:
            raise ValueError(
                f"strategy='layerwise' does not support the precision plugin {type(precision_plugin).__name__}: "
                "gradients are sharded across ranks, so clipping and inf checks must be made across shards. Use "
                "precision='32-true', '64-true', 'bf16-mixed', '16-mixed', 'bf16-true' or '16-true'."
            )
        self._precision_plugin = precision_plugin

    # --- wrapping --------------------------------------------------------------------
    @property
    def wrapper(self) -> Optional[LayerwiseDataParallel]:
        return self.model if isinstance(self.model, LayerwiseDataParallel) else None

    @override
    def configure_ddp(self) -> None:
        self._released_ownership = None
        elementwise = self._elementwise_predicate()
        experts = self._expert_names()
        self._expert_map = (expert_key_map(self.lightning_module, self.expert_parallel_rank)
                            if self.expert_parallel_size > 1 else {})
        groups = ProcessGroups.create(
            separate_all_gather=self.separate_all_gather_group, backend=self.process_group_backend,
            timeout=self._timeout, owner_group_size=self._resolve_owner_group_size(elementwise),
            expert_parallel_size=self.expert_parallel_size,
        )
        self._groups = groups
        self.model = LayerwiseDataParallel(
            self.model,
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
        for optimizer in self.optimizers:
            self.model.use_shards_in(optimizer)

    @property
    def process_groups(self) -> Optional[ProcessGroups]:
        """The process groups of this fit (``None`` before setup and after teardown); an MoE layer
        exchanges tokens over ``process_groups.expert_parallel``."""
        return self._groups

    @property
    def expert_parallel_rank(self) -> int:
        """Which experts this rank holds (position in its expert-parallel group): known before setup, so a
        model can build only its experts in ``configure_model`` (Note [expert parallelism])."""
        self._check_expert_parallel_size()
        return self.global_rank % self.expert_parallel_size

    def _check_expert_parallel_size(self) -> None:
        if self.world_size % self.expert_parallel_size:
            raise ValueError(f"LayerwiseStrategy(expert_parallel_size={self.expert_parallel_size}) does not divide "
                             f"the {self.world_size} ranks of this run; pass a divisor of {self.world_size}.")

    def _expert_names(self) -> frozenset:
        """The expert parameters' names, after checking ``expert_parallel_size`` and the marks on every rank.

        Every rank learns every rank's verdict (one ``all_gather_object``) before any group is
        created, so a mark missing on one rank is the same error everywhere instead of a hang.
        """
        module = self.lightning_module
        E = self.expert_parallel_size
        self._check_expert_parallel_size()
        error = None
        try:
            check_expert_marks(module, E)
        except ValueError as e:
            error = str(e)
        names = expert_parameter_names(module)
        if error is None and E > 1 and not names:
            error = (f"LayerwiseStrategy(expert_parallel_size={E}) but the model marks no experts: put each MoE "
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

    def _resolve_owner_group_size(self, elementwise) -> int:
        """The owner group size for this world: the argument, or the layout's choice for ``"auto"``."""
        world = self.world_size
        if self.owner_group_size is None:
            return world
        if self.owner_group_size != "auto":
            if world % self.owner_group_size:
                raise ValueError(f"LayerwiseStrategy(owner_group_size={self.owner_group_size}) does not divide the "
                                 f"{world} ranks of this run; pass a divisor of {world} (e.g. the GPUs per node), "
                                 "'auto' or None.")
            return self.owner_group_size
        ranks_per_node = len(self.parallel_devices or ()) or None
        if ranks_per_node is None or world <= ranks_per_node:
            return world  # one node: one group (Note [choosing the owner group size] in layout.py)
        grad_dtype = self._grad_reduce_dtype()
        g, _ = choose_owner_group_size(
            param_specs(self.lightning_module, elementwise=elementwise), world, self.bucket_size,
            ranks_per_node=ranks_per_node, grad_bytes=grad_dtype.itemsize if grad_dtype is not None else None)
        if g != world:
            rank_zero_info(f"LayerwiseStrategy: owner groups of {g} ranks (owner_group_size='auto'; "
                           f"{world // g} groups).")
        return g

    def _elementwise_predicate(self) -> Optional[Callable[[str, torch.nn.Parameter], bool]]:
        """Which parameters the layout may split: those the optimizer updates element-wise."""
        if not self.elementwise_fill or len(self.optimizers) != 1:
            return None
        optimizer = self.optimizers[0]
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        elementwise = elementwise_parameters(optimizer, self.elementwise_optimizers)
        return lambda name, p: p in elementwise

    def _half_true(self) -> bool:
        return isinstance(self.precision_plugin, HalfPrecision)

    def _grad_reduce_dtype(self) -> Optional[torch.dtype]:
        if self.grad_reduce_dtype is not None:
            return _DTYPES[self.grad_reduce_dtype]
        # bf16-true / 16-true: reduce and keep gradients in float32 for the float32 master weights.
        return torch.float32 if self._half_true() else None

    @override
    def setup(self, trainer) -> None:
        # DDPStrategy.setup, except that the optimizer is created before the model is wrapped: the
        # layout splits the parameters the optimizer updates element-wise (elementwise_fill).
        # Wrapping keeps every parameter object, so the optimizer's references stay valid.
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and self._layer_sync:
            self.model = self._layer_sync.apply(self.model)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if fitting:
            self.setup_optimizers(trainer)
            self.configure_ddp()
        elif self.expert_parallel_size > 1:
            raise ValueError(f"LayerwiseStrategy(expert_parallel_size={self.expert_parallel_size}) runs inside fit "
                             "only (validation during fit works); for trainer.validate/test/predict use "
                             "expert_parallel_size=1 with a model that holds every expert.")
        else:
            _sync_module_states(self.model)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)
        if trainer.state.fn == TrainerFn.FITTING:
            self._steps = 0
            self._check_optimizers()
            if self._half_true() and self.optimizers:
                self._masters = MasterWeights(self.wrapper, self.optimizers[0], self._global_name)
            self._names = self._checkpoint_names()
            self._sync_after_step = self._needs_sync_after_step(trainer)

    @override
    def setup_precision_plugin(self) -> None:
        # Fitting: the strategy's own plugin of the same kind, clipping across shards and (16-mixed) a
        # grad scaler that agrees on infs over the data-parallel group (precision.py).
        if self.wrapper is not None:
            self.precision_plugin = layerwise_precision(self.precision_plugin, self, self.wrapper.process_groups.dp)
        super().setup_precision_plugin()

    def _needs_sync_after_step(self, trainer) -> bool:
        """Whether the all-gather must complete inside the step; see ``overlap_param_gather``."""
        if self.overlap_param_gather == "auto":
            readers = _parameter_readers(trainer) if self.param_read_guard == "off" else []
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
            self._steps += 1
            if self.replica_check_every is not None and self._steps % self.replica_check_every == 0:
                wrapper.check_replicas()
        return output

    def note_skipped_step(self) -> None:
        self.skipped_steps += 1
        step = self.lightning_module.global_step if self.lightning_module is not None else "?"
        rank_zero_warn(f"LayerwiseStrategy(skip_nonfinite_steps=True): gradients hold inf or NaN at step {step}; "
                       f"the optimizer step is skipped on every rank ({self.skipped_steps} skipped so far, "
                       "strategy.skipped_steps).")

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
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # Load after wrapping: the layout (who owns what) decides which optimizer state a
        # rank keeps and, for a sharded checkpoint, which parameters it reads.
        return True

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        self.sync_parameters()
        return super().lightning_module_state_dict()

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The optimizer state keyed by parameter name (Note [checkpoint keys] in ``checkpoint.py``).

        ``"sharded"``: this rank's owned part. ``"full"``: every rank's part gathered to
        rank 0 (collective); the other ranks get an empty state.
        """
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        names = self._names or self._checkpoint_names()
        named = ckpt.named_optimizer_state(optimizer, names)
        if self._masters is not None:
            named["master_weights"] = self._masters.state_dict()
        if self.checkpoint_format == "sharded":
            return named
        ownership = self._ownership()
        with self._naming_failures("gathering the optimizer state to rank 0 for a full checkpoint"):
            full = ckpt.gather_named_state(ckpt.mark_pieces(ckpt.state_to_write(named, ownership), ownership))
        if full is None:
            return {"state": {}, "param_groups": named["param_groups"]}
        return ckpt.join_pieces(full, ownership.split)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH,
                        storage_options: Optional[Any] = None) -> None:
        if self.expert_parallel_size > 1 and self.checkpoint_format == "full":
            # Rank 0 holds only its own experts; a full file would need every rank's gathered to it.
            raise ckpt.CheckpointError(
                f"checkpoint_format='full' with expert_parallel_size={self.expert_parallel_size} is not supported "
                "yet: rank 0 holds only its own experts. Use checkpoint_format='sharded' (it reshards across "
                "expert-parallel sizes) and `python -m lightning.pytorch.utilities.consolidate_checkpoint` for "
                "one file.")
        target = self.broadcast(str(filepath))
        local = _is_local_path(target)  # on the string: Path("s3://b/x") would read "s3:/b/x", a local path
        path = Path(target)
        if self.checkpoint_format == "full":
            if not self.is_global_zero:
                return
            if not local:  # remote storage: the CheckpointIO plugin's own semantics
                self.checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)
                return
            partial = ckpt.partial_path(path)
            self.checkpoint_io.save_checkpoint(checkpoint, partial, storage_options=storage_options)
            ckpt.commit(partial, path)
            return
        if storage_options is not None:
            raise TypeError("LayerwiseStrategy(checkpoint_format='sharded').save_checkpoint(..., storage_options=...)"
                            " is not supported: sharded checkpoints are written with torch.distributed.checkpoint, "
                            "not the CheckpointIO plugin. Use checkpoint_format='full' for a CheckpointIO plugin.")
        if not local:
            raise ValueError(f"LayerwiseStrategy(checkpoint_format='sharded') writes to a local or mounted "
                             f"filesystem, not {str(filepath)!r}; use checkpoint_format='full' for remote storage.")
        checkpoint = dict(checkpoint)
        tensors = self._checkpoint_state(self.lightning_module.state_dict(keep_vars=True))
        ownership = self._ownership()
        state: dict[str, Any] = {ckpt.MODEL_KEY: ckpt.model_entries_to_write(
            self._checkpoint_state(checkpoint.pop("state_dict")), tensors, ownership)}
        for index, named in enumerate(checkpoint.pop("optimizer_states", [])):
            named = ckpt.pieces_as_sharded_tensors(ckpt.state_to_write(named, ownership), ownership)
            if not self.is_global_zero:
                named.pop("param_groups")  # identical on every rank: written once, by rank 0
            state[ckpt.optimizer_key(index)] = named
        checkpoint["layerwise"] = {"format": ckpt.FORMAT, "version": ckpt.FORMAT_VERSION,
                                   "world_size": self.world_size, "bucket_size": self.bucket_size,
                                   "owner_group_size": self._groups.owner_size if self._groups else self.world_size,
                                   "expert_parallel_size": self.expert_parallel_size}
        with self._naming_failures(f"saving the sharded checkpoint {str(path)!r}"):
            ckpt.save_sharded(path, state, checkpoint if self.is_global_zero else None)

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
            # After fit: the optimizer still steps the pieces of the released layout.
            return self._released_ownership
        names = self._names or self._checkpoint_names()
        masters = [m for _, m in self._masters.pairs] if self._masters is not None else []
        tensors = self.lightning_module.state_dict(keep_vars=True)
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
        names = _parameter_names(self.lightning_module, self._masters, self.wrapper)
        return {t: self._global_name(n) for t, n in names.items()} if self._expert_map else names

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        if self.is_global_zero:
            self.checkpoint_io.remove_checkpoint(filepath)
            path = Path(filepath)
            if _is_local_path(str(filepath)):
                for leftover in (ckpt.partial_path(path), ckpt.aside_path(path)):
                    if leftover.exists():
                        self.checkpoint_io.remove_checkpoint(leftover)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: Optional[bool] = None) -> dict[str, Any]:
        target = self.broadcast(str(checkpoint_path))
        if not _is_local_path(target):
            return super().load_checkpoint(target, weights_only=weights_only)
        path = ckpt.resolve(Path(target))
        if path != Path(target):
            rank_zero_warn(f"{target!r} does not exist, but {str(path)!r} does: a save to {target!r} was interrupted "
                           "while replacing it. Loading the previous checkpoint.")
        if path.is_dir():
            return self._load_sharded(path, weights_only)
        if type(self.checkpoint_io) is TorchCheckpointIO and path.is_file():
            # Memory-mapped: a rank reads the pages of the tensors it uses (all parameters, its
            # owned optimizer state), not the whole optimizer state. Owned state is copied out
            # of the mapping in load_optimizer_state_dict.
            return torch.load(path, map_location="cpu", mmap=True,
                              weights_only=True if weights_only is None else weights_only)
        return super().load_checkpoint(path, weights_only=weights_only)

    def _load_sharded(self, path: Path, weights_only: Optional[bool]) -> dict[str, Any]:
        """Reads the owned parameters and owned optimizer state; all-gathers the parameters (collective)."""
        module = self.lightning_module
        fitting = module.trainer is not None and module.trainer.state.fn == TrainerFn.FITTING
        n_optimizers = len(self.optimizers) if fitting else 0
        meta, optimizer_states = ckpt.read_sharded_checkpoint(
            path, self._checkpoint_state(module.state_dict(keep_vars=True)), self._ownership(), n_optimizers,
            module.strict_loading, type(module).__name__, weights_only, other_experts=expert_key_predicate(module))
        self._after_model_load()
        if optimizer_states is not None:
            meta["optimizer_states"] = optimizer_states
        return meta

    def _after_model_load(self) -> None:
        """Every rank holds the loaded parameters, and the masters equal them."""
        wrapper = self.wrapper
        if wrapper is not None:
            wrapper.start_param_sync(force_sync=True)
        if self._masters is not None:
            self._masters.refresh()

    @override
    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        if "state_dict" not in checkpoint:  # sharded: already read by load_checkpoint
            return
        if self.expert_parallel_size > 1:
            raise ckpt.CheckpointError(
                f"loading a full checkpoint file with expert_parallel_size={self.expert_parallel_size} is not "
                "supported yet; load it with expert_parallel_size=1, or resume from a sharded checkpoint.")
        self.sync_parameters()
        super().load_model_state_dict(checkpoint, strict=strict)
        self._after_model_load()

    @override
    def load_optimizer_state_dict(self, checkpoint) -> None:
        states = checkpoint["optimizer_states"]
        if len(states) != len(self.optimizers):
            raise ckpt.CheckpointError(f"the checkpoint holds {len(states)} optimizer state(s) and the model "
                                       f"configures {len(self.optimizers)}.")
        names = self._names or self._checkpoint_names()
        keep = self._ownership().reads  # another rank steps the rest: state exists once in the world
        pieces = self._pieces()
        for optimizer, saved in zip(self.optimizers, states):
            local = ckpt.local_optimizer_state(saved, optimizer, names, keep, pieces,
                                               is_expert=expert_key_predicate(self.lightning_module))
            local["state"] = {k: _own_copy(v) for k, v in local["state"].items()}  # off the mmap'd file
            optimizer.load_state_dict(local)
            _optimizer_to_device(optimizer, self.root_device)
            if self._masters is not None and saved.get("master_weights"):
                self._masters.load_state_dict(saved["master_weights"])

    # --- teardown ----------------------------------------------------------------------
    @override
    def teardown(self) -> None:
        # Lightning also tears down after a failed fit, from inside its exception handler. If a
        # collective failed (a dead rank), waiting for the pending ones raises the same error again,
        # hides the original traceback and stops the teardown: then abandon them instead.
        failing = sys.exc_info()[0] is not None
        wrapper = self.wrapper
        if wrapper is not None:
            # A checkpoint saved after fit (trainer.save_checkpoint) still needs who stepped what.
            self._released_ownership = self._ownership()
            try:
                wrapper.release()
            except Exception:
                if not failing:
                    raise
                wrapper.release(wait=False)
            self.model = self.lightning_module
            self._masters = None
        if self._groups is not None:
            # Communicators (and gloo's threads) made for this fit end with it: none outlives the
            # run or reaches interpreter exit (where a live one can abort the process).
            try:
                self._groups.destroy()
            except Exception:
                if not failing:
                    raise
            self._groups = None
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


def _parameter_names(module: torch.nn.Module, masters: Optional[MasterWeights],
                     wrapper: Optional[LayerwiseDataParallel] = None) -> dict[torch.Tensor, str]:
    """Every parameter (its piece, its float32 master) by the name checkpoints use for it."""
    names: dict[torch.Tensor, str] = {p: n for n, p in module.named_parameters()}
    if wrapper is not None:
        names.update((shard, n) for n, shard in wrapper.named_owned_parameters())
    if masters is not None:
        names.update(masters.names)
    return names


def _own_copy(value):
    if torch.is_tensor(value):
        return value.clone()
    if isinstance(value, dict):
        return {k: _own_copy(v) for k, v in value.items()}
    return value


def _is_local_path(path: Union[str, Path]) -> bool:
    """Whether ``path`` (a string as the user gave it: URLs keep their ``//``) is on the local filesystem."""
    from fsspec.implementations.local import LocalFileSystem

    return isinstance(get_filesystem(str(path)), LocalFileSystem)
