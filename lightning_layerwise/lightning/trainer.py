"""Lightning glue: ``Trainer(strategy="layerwise")``, an adapter around :class:`LayerwiseSession`.

:class:`LayerwiseStrategy` reuses everything of Lightning's ``DDPStrategy`` that
does not touch gradients (launchers, cluster environments, process-group set-up,
``reduce``/``barrier``/``broadcast``, samplers, ``sync_batchnorm``) and replaces
the ``DistributedDataParallel`` wrapper with the session's. Each Lightning hook calls
one session method:

* ``setup``: the optimizers are made first, then ``session.wrap`` (the layout splits
  what they update element-wise); the precision plugin gets the session's callables
  (clipping by the global norm, a ``16-mixed`` grad scaler that agrees on infs across
  ranks, skipping non-finite steps; ``precision.py``);
* ``pre_backward`` / ``post_backward``: ``before_backward`` / ``after_backward``;
* after ``optimizer.step``: ``after_step`` (the all-gather the next forward waits for);
* before evaluation, checkpointing and teardown: ``sync_parameters``;
* checkpoints: ``session.checkpoints``' ``save_format`` (its ``optimizer_state`` and ``save``), ``read``,
  ``load_optimizer_states`` (the format is the session's, ``formats.py``);
* ``teardown``: ``release``; with sharded parameters the run goes on after ``fit`` (``validate``/``test``/
  ``predict`` and checkpoints use it) until ``llw.release``, the next ``fit`` or interpreter exit.

``DDPStrategy`` is the base on purpose: its launchers, environments and collectives are
what ``ddp`` users have, and the one method copied from it (``setup``, reordered so the
optimizers exist before wrapping) is pinned by the ``lightning`` bound in
``pyproject.toml``, which CI tests at both ends.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Literal, Optional, Sequence, Union

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment, TorchCheckpointIO
from lightning.fabric.utilities.optimizer import _optimizers_to_device
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
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.overrides.distributed import _sync_module_states
from lightning.pytorch.plugins.precision import HalfPrecision, Precision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.distributed.constants import default_pg_timeout
from torch.optim import Optimizer
from typing_extensions import override

from .. import checkpoint as ckpt
from ..config import LayerwiseConfig, refuse_unknown_keywords
from ..checkpoint.formats import Checkpoint
from ..engine import patches
from ..engine.init_record import record_init
from ..engine.materialize import has_meta_tensors
from ..engine.sharded import ReadRules, ShardedParameterReadError
from .common import (SessionAdapter, check_precision, register_strategy_names, release_at_exit, session_env,
                     start_session)
from .precision import SUPPORTED_PRECISION as _SUPPORTED_PRECISION
from .precision import StepHooks, layerwise_precision
from ..engine.clip import clip_grad_norm_, clip_grad_value_
from ..session import is_compiled, model_parameter, release, stepped_tensor


def _own_reads(method: Callable) -> Callable:
    """A strategy method that reads parameters on this rank's own terms (the optimizer's step and the masters, the
    checkpoint formats' own gathers) even where a hook calls it (``ModelCheckpoint``, the LightningModule's
    ``optimizer_step``): inside, nothing is gathered on demand (Note [sharded reads] in ``engine/sharded.py``);
    the hooks it calls (``on_before_optimizer_step``) read collectively again."""

    @functools.wraps(method)
    def with_own_reads(self, *args: Any, **kwargs: Any) -> Any:
        with self.session.reads.local():
            return method(self, *args, **kwargs)

    return with_own_reads


class LayerwiseStrategy(SessionAdapter, DDPStrategy):
    """Data-parallel training with a layer-wise distributed optimizer.

    Gradients are reduce-scattered into shard-aligned buckets, each rank steps
    only the parameters it owns (any torch optimizers, e.g.
    :class:`lightning_layerwise.Muon`), and parameters are all-gathered bucket by
    bucket behind the next forward.

    Args:
        bucket_size: elements per communication bucket (all shards together); ``"auto"`` (default): 40 M, and
            4 Mi (``2**22``) with ``shard_parameters=True``, where a bucket is also what a forward gathers.
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
        prefetch_depth: buckets whose all-gather may be in flight at once; ``"auto"`` (default): 2, and 1 with
            ``shard_parameters=True``, where each prefetched bucket is held full.
        separate_all_gather_group: run all-gathers on their own process group so they
            can overlap reduce-scatters.
        grad_reduce_dtype: dtype of the gradient buffers and reduce-scatter
            (``"float32"``, ``"bfloat16"``, ``"float16"``); default: the parameter dtype.
        broadcast_buffers: broadcast module buffers from rank 0 at every training
            forward, as ``ddp`` does.
        checkpoint_format: ``"auto"`` (default): ``"full"`` for a model whose parameters and
            buffers take at most 512 MiB (GPT-2 124M in float32), so that the checkpoint
            ``ModelCheckpoint`` writes opens with ``load_from_checkpoint``, ``torch.load`` and
            under ``ddp``; ``"sharded"`` above that (or with expert parallelism).
            ``"sharded"``: a directory written with ``torch.distributed.checkpoint`` in
            which each rank writes the parameters it owns and their optimizer state, keyed by
            parameter name, plus Lightning's ``meta.pt`` and a ``README.txt`` naming
            ``python -m lightning_layerwise consolidate DIR FILE``. ``"full"``: rank 0
            writes one ordinary Lightning checkpoint file with the full model and the
            optimizer state gathered to it, keyed by parameter name. Both resume at any
            world size and bucket size; see docs/checkpointing.md.
        replica_check_every: every this many optimizer steps, check right after the
            all-gather that all ranks hold bitwise-equal parameters (one all-gather of one
            checksum per bucket; Note [replica check] in ``engine/replica_check.py``) and stop
            with :class:`ReplicaDivergenceError`, naming the bucket and parameters, if
            not. ``None`` (default): never.
        skip_nonfinite_steps: skip the optimizer step on every rank when any rank's
            reduced gradients hold inf or NaN (agreed by one all-reduce), warn, and count it
            in :attr:`skipped_steps`. ``16-mixed`` keeps its grad scaler, which does the
            same and lowers the loss scale. Default ``False``: step anyway, as ``ddp``.
        elementwise_fill: split the parameters the optimizer updates element-wise (the AdamW
            groups of :class:`lightning_layerwise.Muon`; ``torch.optim`` AdamW, Adam, SGD…)
            across shards, so they fill the buckets without padding and each rank steps its
            piece (Note [element-wise fill] in ``layout/packing.py``). Matrices of Muon groups and
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
            it, and the groups share the optimizer step: each matrix is orthogonalized once
            in the world and the optimizer state held once (Note [owner groups] in
            ``engine/process_groups.py``, Note [replica sharing] in ``layout/sharing.py``). ``"auto"``
            (default) keeps one group on one node; across nodes the largest size dividing
            the ranks per node that pads at most 1% (Note [choosing the owner group size]
            in ``layout/group_size.py``);
            ``None``: one group of every rank; an integer must divide the world size.
        expert_parallel_size: ``E > 1`` spreads the experts of a mixture-of-experts model over
            expert-parallel groups of ``E`` consecutive ranks (Note [expert parallelism] in
            ``engine/process_groups.py``): the model builds only the experts of
            :attr:`expert_parallel_rank` in containers marked with
            :func:`lightning_layerwise.mark_experts`, exchanges tokens over
            ``strategy.process_groups.expert_parallel``, and expert gradients are
            reduced over the ranks holding the same experts. ``E`` must divide the world
            size and every marked layer's expert count. See docs/moe.md.
        tensor_parallel_size: ``T > 1`` lays the ranks out as a ``(data_parallel, tensor_parallel)``
            ``DeviceMesh`` (``T`` consecutive ranks per tensor-parallel group, inside a node), given to the
            LightningModule as ``self.device_mesh`` before ``configure_model``, where it applies
            ``parallelize_module`` as under ``ModelParallelStrategy``. The strategy then runs data-parallel over
            ``data_parallel`` and :class:`lightning_layerwise.Muon` orthogonalizes each tensor-parallel matrix whole,
            once (Note [tensor-parallel exchange] in ``engine/tp_exchange.py``). See docs/usage.md, "Tensor
            parallelism".
        shard_parameters: each rank holds only its shard (1/group) of the parameters and
            gradients between uses, as FSDP does, with each matrix still whole on its owner
            (Muon needs no all-to-all). Buckets are all-gathered before their forward and
            backward and freed after. Read parameters outside a step inside
            ``llw.full_parameters(model)``. See docs/usage.md, "Sharded parameters".
        reshard_after_forward: with ``shard_parameters``, free each bucket after its forward
            and gather it again for its backward (``False``: keep it until its backward: one
            all-gather fewer per step, more memory).
        process_group_backend: ``"nccl"``, ``"gloo"``…; default by device.
        timeout: collective timeout.
        start_method: how processes are launched, as for ``ddp``.
    """

    strategy_name = "layerwise"

    _accelerator_classes = (CPUAccelerator, CUDAAccelerator)
    _accelerator_fix = "accelerator='cpu' or accelerator='gpu' (CUDA)"

    @refuse_unknown_keywords  # a misspelt keyword names the closest argument; the signature stays this one
    def __init__(
        self,
        bucket_size: Union[int, Literal["auto"]] = "auto",
        overlap_grad_reduce: bool = True,
        overlap_param_gather: Union[bool, Literal["auto"]] = "auto",
        param_read_guard: Literal["wait", "strict", "off"] = "wait",
        prefetch_depth: Union[int, Literal["auto"]] = "auto",
        separate_all_gather_group: bool = True,
        grad_reduce_dtype: Optional[Literal["float32", "bfloat16", "float16"]] = None,
        broadcast_buffers: bool = True,
        checkpoint_format: Literal["auto", "sharded", "full"] = "auto",
        replica_check_every: Optional[int] = None,
        skip_nonfinite_steps: bool = False,
        elementwise_fill: bool = True,
        elementwise_optimizers: Sequence[Union[type, str]] = (),
        owner_group_size: Union[int, Literal["auto"], None] = "auto",
        expert_parallel_size: int = 1,
        tensor_parallel_size: int = 1,
        shard_parameters: bool = False,
        reshard_after_forward: bool = True,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        accelerator: Optional[Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
    ) -> None:
        config = LayerwiseConfig(
            bucket_size=bucket_size, overlap_grad_reduce=overlap_grad_reduce,
            overlap_param_gather=overlap_param_gather, param_read_guard=param_read_guard,
            prefetch_depth=prefetch_depth, separate_all_gather_group=separate_all_gather_group,
            grad_reduce_dtype=grad_reduce_dtype, broadcast_buffers=broadcast_buffers,
            checkpoint_format=checkpoint_format, replica_check_every=replica_check_every,
            skip_nonfinite_steps=skip_nonfinite_steps, elementwise_fill=elementwise_fill,
            elementwise_optimizers=elementwise_optimizers, owner_group_size=owner_group_size,
            expert_parallel_size=expert_parallel_size, tensor_parallel_size=tensor_parallel_size,
            shard_parameters=shard_parameters,
            reshard_after_forward=reshard_after_forward, timeout=timeout, start_method=start_method,
            owner=type(self).__name__,
        )
        start_session(self, config)  # self.session: wrapping, steps, checkpoints, teardown
        self.session.reads.rules = ReadRules(
            steps="the Trainer's steps and Lightning's hooks (where every rank runs the same code)",
            whole_again="After trainer.fit the module stays sharded (trainer.test and trainer.save_checkpoint run "
                        "on it); llw.release(model), on every rank, gives it every parameter back whole.")
        self._stage_patches: list[patches.Undo] = []  # a stage's patches of Lightning's objects, undone by teardown
        self._exit_hook: Optional[Callable[[], None]] = None  # ends a run left sharded at interpreter exit
        self._fitting = False  # the stage being set up or torn down is a fit
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin, process_group_backend=process_group_backend,
                         timeout=timeout, start_method=start_method)

    def _user_optimizers(self) -> list[Optimizer]:
        return [o._optimizer if isinstance(o, LightningOptimizer) else o for o in self.optimizers]

    # --- precision -------------------------------------------------------------------
    def _set_precision_plugin(self, precision_plugin: Optional[Precision]) -> None:
        check_precision(precision_plugin, _SUPPORTED_PRECISION)  # when the Trainer is built, before any process
        self._precision_plugin = precision_plugin

    precision_plugin = property(DDPStrategy.precision_plugin.fget, _set_precision_plugin)

    @override
    def setup_precision_plugin(self) -> None:
        # Fitting: the strategy's own plugin of the same kind, clipping across shards and (16-mixed) a
        # grad scaler that agrees on infs over the data-parallel group (precision.py).
        session = self.session
        if session.wrapper is not None:
            module = self.lightning_module
            hooks = StepHooks(
                clip_grad_norm=lambda max_norm, params: clip_grad_norm_(_wrapper_to_clip(session), max_norm,
                                                                        parameters=params),
                clip_grad_value=lambda value, params: clip_grad_value_(_wrapper_to_clip(session), value,
                                                                       parameters=params),
                before_step=session.before_step,
                skips_nonfinite=lambda: session.config.skip_nonfinite_steps and session.wrapper is not None,
                skip_step=lambda: self._skip_step(module.global_step))
            self.precision_plugin = layerwise_precision(self.precision_plugin, hooks, session.groups.dp)
        super().setup_precision_plugin()

    # --- set-up ----------------------------------------------------------------------
    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self.session.env = session_env(self)
        self._setup_device_mesh(self.lightning_module)  # before configure_model, as ModelParallelStrategy

    @override
    @contextlib.contextmanager
    def tensor_init_context(self, empty_init: Optional[bool] = None):
        """``trainer.init_module(empty_init=True)`` with ``shard_parameters=True`` builds the model on the meta
        device; the strategy materializes it bucket by bucket when it wraps it (Note [meta-device models] in
        ``engine/materialize.py``)."""
        if not (empty_init and self.config.shard_parameters):
            with super().tensor_init_context(empty_init):
                yield
            return
        with torch.device("meta"), self.precision_plugin.tensor_init_context(), record_init(self.root_device):
            yield

    @override
    def model_to_device(self) -> None:
        if has_meta_tensors(self.model):
            return  # materialized on the device when wrapped (Note [meta-device models])
        super().model_to_device()

    @override
    def configure_ddp(self) -> None:
        self.model = self._wrap(self.model, self._user_optimizers(),
                                master_weights=isinstance(self.precision_plugin, HalfPrecision))

    @override
    def setup(self, trainer) -> None:
        # DDPStrategy.setup, except that the optimizer is created before the model is wrapped: the
        # layout splits the parameters the optimizer updates element-wise (elementwise_fill).
        # Wrapping keeps every parameter object, so the optimizer's references stay valid.
        self.session.env = session_env(self)
        fitting = self._fitting = trainer.state.fn == TrainerFn.FITTING
        if self._on_the_sharded_run(fitting):
            self._setup_on_the_sharded_run(trainer)
            return
        self.session.checkpoints.module = self.lightning_module  # checkpoints read into it, wrapped or not
        self.accelerator.setup(trainer)
        if fitting and self._layer_sync:
            self.model = self._layer_sync.apply(self.model)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if fitting:
            self.setup_optimizers(trainer)
            self.configure_ddp()
        elif self.config.expert_parallel_size > 1:
            raise ValueError(f"LayerwiseStrategy(expert_parallel_size={self.config.expert_parallel_size}) runs "
                             "inside fit only (validation during fit works); for trainer.validate/test/predict use "
                             "expert_parallel_size=1 with a model that holds every expert.")
        elif has_meta_tensors(self.model):
            raise ValueError("a model built on the meta device (trainer.init_module(empty_init=True) with "
                             "shard_parameters=True) is materialized when it is wrapped for fit; for "
                             "trainer.validate/test/predict build it on the device.")
        else:
            _sync_module_states(self.model)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)
            self.session.sync_after_step = self._needs_sync_after_step(trainer)
            self._stage_patches += _finetuning_sees_parameters(trainer, self.session)
            if self.session.wrapper.shard_parameters:
                self._read_in_hooks(trainer)

    def _read_in_hooks(self, trainer) -> None:
        """Reads of sharded parameters in Lightning's hooks gather (Note [collective reads])."""
        hook_reads = _HookReads(trainer.profiler, self.session)
        self._stage_patches.append(_PROFILER.set_attribute(trainer, "profiler", hook_reads))

    def _on_the_sharded_run(self, fitting: bool) -> bool:
        """Whether this stage runs on the sharded run the last ``fit`` left (Note [sharded release] in
        ``engine/sharded.py``): ``validate``/``test``/``predict`` of the same module do. A new ``fit``, or another
        module, ends that run first (collective: the module gets its parameters back whole), as it ends a run
        of another Trainer still training this module."""
        module = self.lightning_module
        if self.session.wrapper is not None:
            if not fitting and self.session.module is module and self.session.wrapper.shard_parameters:
                return True
            self._release()
        release(module)
        return False

    def _setup_on_the_sharded_run(self, trainer) -> None:
        """``setup`` for an evaluation on the sharded run: nothing is moved, converted or broadcast (the module
        is already on its device, in its precision and equal on every rank); the steps run through the wrapper."""
        self.accelerator.setup(trainer)
        self.model = self.session.wrapper
        self.setup_precision_plugin()
        self._read_in_hooks(trainer)

    def _needs_sync_after_step(self, trainer) -> bool:
        """Whether the all-gather must complete inside the step; see ``overlap_param_gather``."""
        overlap = self.config.overlap_param_gather
        if overlap == "auto":
            readers = _parameter_readers(trainer) if self.config.param_read_guard == "off" else []
            if readers:
                rank_zero_info(f"LayerwiseStrategy: {', '.join(readers)} run between optimizer steps, so "
                               "parameters are all-gathered inside each step (pass overlap_param_gather=True "
                               "to overlap anyway).")
                return True
            if is_compiled(self.lightning_module):
                rank_zero_info("LayerwiseStrategy: the model is compiled, so parameters are all-gathered inside "
                               "each step (compiled graphs may skip the forward pre-hooks).")
                return True
            return False
        if overlap is True and is_compiled(self.lightning_module):
            rank_zero_warn("LayerwiseStrategy(overlap_param_gather=True) with a compiled model: a graph compiled "
                           "before the strategy added its forward pre-hooks runs without them and reads stale "
                           "parameters. Use overlap_param_gather='auto' unless you compiled after setup.")
        return False

    @override
    def _register_ddp_hooks(self) -> None:
        """DDP communication hooks do not apply: communication is the session's own."""

    # --- steps -----------------------------------------------------------------------
    @override
    @contextlib.contextmanager
    def block_backward_sync(self):
        wrapper = self.wrapper
        with wrapper.no_sync() if wrapper is not None else contextlib.nullcontext():
            yield None

    @override
    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        self.session.before_backward()

    @override
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        self.session.after_backward()

    @override
    @_own_reads
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any],
                       model: Optional[Union["torch.nn.Module", Any]] = None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        self.session.after_step(optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer)
        return output

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
    @_own_reads
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return self.session.checkpoints.module_state_dict(self.lightning_module)

    @override
    @_own_reads
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The optimizer state keyed by parameter name (Note [checkpoint keys] in ``checkpoint/named_state.py``), in the
        form
        the checkpoint format writes (``"full"``: gathered to rank 0, a collective)."""
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        checkpoints = self.session.checkpoints
        return checkpoints.save_format.optimizer_state(checkpoints, optimizer)

    @override
    @_own_reads
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH,
                        storage_options: Optional[Any] = None) -> None:
        checkpoints = self.session.checkpoints
        target = self.broadcast(str(filepath))
        call = f"LayerwiseStrategy(checkpoint_format={self.config.checkpoint_format!r}).save_checkpoint"
        checkpoints.check_save(target, storage_options, call, has_model="state_dict" in checkpoint)
        meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        checkpoints.save_format.save(checkpoints, target, Checkpoint(checkpoint, checkpoint.get("state_dict"),
                                                                     checkpoint.get("optimizer_states", []), meta),
                                     self.checkpoint_io, storage_options)

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        if self.is_global_zero:
            self.checkpoint_io.remove_checkpoint(filepath)
            if ckpt.is_local_path(str(filepath)):
                for leftover in (ckpt.partial_path(Path(filepath)), ckpt.aside_path(Path(filepath))):
                    if leftover.exists():
                        self.checkpoint_io.remove_checkpoint(leftover)

    @override
    @_own_reads
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: Optional[bool] = None) -> dict[str, Any]:
        module = self.lightning_module
        fitting = module.trainer is not None and module.trainer.state.fn == TrainerFn.FITTING
        loaded = self.session.checkpoints.read(
            self.session.checkpoints.resolve_path(checkpoint_path), n_optimizers=len(self.optimizers) if fitting else 0,
            strict=module.strict_loading, weights_only=weights_only,
            strict_hint="Set `strict_loading = False` on the LightningModule to load the keys that match.",
            file_io=self.checkpoint_io, memory_map=type(self.checkpoint_io) is TorchCheckpointIO)
        if loaded.optimizer_states is not None:
            loaded.state["optimizer_states"] = loaded.optimizer_states
        return loaded.state

    @override
    @_own_reads
    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        if "state_dict" in checkpoint:  # else sharded: read by load_checkpoint
            self.session.checkpoints.load_model_state(checkpoint["state_dict"], strict=strict)

    @override
    @_own_reads
    def load_optimizer_state_dict(self, checkpoint) -> None:
        _restore_finetuning_param_groups(self.lightning_module)
        self.session.checkpoints.load_optimizer_states(self._user_optimizers(), checkpoint["optimizer_states"])

    # --- teardown ----------------------------------------------------------------------
    @override
    def teardown(self) -> None:
        # Lightning also tears down after a failed fit, from inside its exception handler (session.release).
        while self._stage_patches:  # the Trainer's profiler, each BaseFinetuning callback's own method
            self._stage_patches.pop()()
        wrapper = self.session.wrapper
        # a failed validate/test/predict on the run fit left keeps it: the trained values are not lost
        if wrapper is not None and wrapper.shard_parameters and (sys.exc_info()[0] is None or not self._fitting):
            self._keep_sharded(wrapper)
            return
        if wrapper is not None:
            self.model = self.lightning_module  # no reference left to the wrapper: the release frees its buffers
        wrapper = None
        self._release()
        module = self.lightning_module
        # A model refused on the meta device (Note [meta-device models]) stays there: Lightning's move to the CPU
        # would raise over the error that ended the fit.
        refused = module is not None and has_meta_tensors(module)
        if refused:
            self._lightning_module = None
        try:
            super().teardown()
        finally:
            if refused:
                self._lightning_module = module
        _raise_posted_failure(self.session)

    def _keep_sharded(self, wrapper) -> None:
        """The end of a stage that succeeded with sharded parameters: the module stays sharded, its gradients go
        (Note [sharded release] in ``engine/sharded.py``). As ``FSDPStrategy``'s teardown, nothing is moved to
        the CPU (a move reads every parameter whole)."""
        wrapper.grad_sync.zero_grad_buffer()
        self.model = self.lightning_module
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()
        if self._exit_hook is None:
            self._exit_hook = release_at_exit(self)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: StrategyRegistry) -> None:
        register_strategy_names(cls, strategy_registry)


# Lightning's objects a stage changes (Note [patches] in engine/patches.py)
_FINETUNING = patches.register("lightning.pytorch.callbacks.BaseFinetuning._apply_mapping_to_param_groups",
                               "trainer stage")
_PROFILER = patches.register("lightning.pytorch.Trainer.profiler", "trainer stage")

# Lightning callbacks that do not read parameters in on_train_batch_end / on_train_epoch_end
# (checkpointing syncs through lightning_module_state_dict).
_PARAMETER_SAFE_CALLBACKS = (ModelCheckpoint, LearningRateMonitor, ProgressBar, ModelSummary, Timer, EarlyStopping)
_BETWEEN_STEP_HOOKS = ("on_train_batch_end", "on_train_epoch_end")


def _wrapper_to_clip(session):
    """The session's wrapper, which gradient clipping reads (clipping happens only while the model is wrapped)."""
    if session.wrapper is None:
        raise RuntimeError("gradient clipping under strategy='layerwise' needs the model wrapped for fitting (setup "
                           "has not run, or teardown already has).")
    return session.wrapper


def _finetuning_sees_parameters(trainer, session) -> list:
    """``BaseFinetuning`` records the optimizers' param groups by parameter name (``_store``) and restores them
    by name when resuming (``on_fit_start``), looking tensors up by identity among the module's parameters.
    The optimizers hold pieces and masters in their place here, so during the fit each such callback maps
    through the session: an optimizer's tensor to its parameter's name, a name to the tensor the optimizer
    holds for it (Note [re-planning] in ``session.py``). Returns what puts each callback's own method back
    (Note [patches] in ``engine/patches.py``)."""
    from lightning.pytorch.callbacks import BaseFinetuning

    def apply_mapping(param_groups: list, mapping: dict) -> list:
        by_name = bool(mapping) and isinstance(next(iter(mapping)), str)
        out = []
        for group in param_groups:
            entry = {k: v for k, v in group.items() if k != "params"}
            if by_name:  # restoring: names -> what the optimizer steps
                entry["params"] = [stepped_tensor(session.wrapper, session.masters, mapping[name])
                                   for name in group["params"]]
            else:  # recording: what the optimizer steps -> names
                entry["params"] = [mapping[model_parameter(session.wrapper, t)] for t in group["params"]]
            out.append(entry)
        return out

    return [_FINETUNING.set_attribute(callback, "_apply_mapping_to_param_groups", apply_mapping)
            for callback in trainer.callbacks if isinstance(callback, BaseFinetuning)]


def _restore_finetuning_param_groups(module: Optional[LightningModule]) -> None:
    """``BaseFinetuning`` restores the param groups it added (``unfreeze_and_add_param_group``) in its
    ``on_fit_start``, from the state its ``load_state_dict`` received. A strategy that restores checkpoints
    after set-up, as this one must (the layout decides who keeps which state), hands the callbacks their state
    only after ``on_fit_start``, so the groups would be missing when the optimizer state is loaded. They are
    restored here, just before, by the callback's own ``on_fit_start`` (it acts only while restarting)."""
    from lightning.pytorch.callbacks import BaseFinetuning

    trainer = getattr(module, "_trainer", None)
    if trainer is None:
        return
    for callback in trainer.callbacks:
        if isinstance(callback, BaseFinetuning) and getattr(callback, "_restarting", False):
            callback.on_fit_start(trainer, module)


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


class _HookReads:
    """``trainer.profiler`` while a model with sharded parameters fits: Lightning calls every hook of the callbacks,
    the LightningModule and the datamodule inside ``trainer.profiler.profile(name)``, on every rank in the same
    order, so each runs there inside ``session.reads.hook(name)`` and its reads of parameters gather on demand as
    collectives (Note [collective reads] in ``engine/collective_reads.py``). Everything else is the profiler's.
    Installed by the strategy's ``setup`` for fitting, removed by its ``teardown`` (a patch: Note [patches] in
    ``engine/patches.py``). Lightning's writes of the profiler's attributes pass through to it."""

    _HOOKS = ("[Callback]", "[LightningModule]", "[LightningDataModule]")

    def __init__(self, profiler, session) -> None:
        object.__setattr__(self, "_profiler", profiler)
        object.__setattr__(self, "_session", session)

    @contextlib.contextmanager
    def profile(self, action_name: str):
        with self._profiler.profile(action_name):
            if action_name.startswith(self._HOOKS):
                with self._session.reads.hook(action_name):
                    yield
            else:
                yield

    def __getattr__(self, name: str):
        return getattr(self._profiler, name)

    def __setattr__(self, name: str, value) -> None:
        setattr(self._profiler, name, value)


def _raise_posted_failure(session) -> None:
    """Called at the end of a teardown: when the fit failed here with another error (a connection that rank closed,
    in one of Lightning's collectives) after another rank posted a read error (Note [failing together] in
    ``engine/collective_reads.py``), that error, so that every rank ends with it. Lightning's teardown after the
    strategy's is then skipped: the process is failing."""
    error, failure = sys.exc_info()[1], session.reads.failure
    session.reads.failure = None
    if error is not None and failure is not None and not isinstance(error, ShardedParameterReadError):
        raise ShardedParameterReadError(failure) from error
