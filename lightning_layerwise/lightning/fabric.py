"""Lightning Fabric glue: ``Fabric(strategy="layerwise")``, an adapter around :class:`LayerwiseSession`.

:class:`LayerwiseFabricStrategy` is Fabric's ``DDPStrategy`` (launchers, cluster
environments, process-group set-up, ``all_reduce``/``barrier``/``broadcast``,
samplers) with the session's wrapper in place of ``DistributedDataParallel``. The
session is the Trainer strategy's; what differs is only who calls it:

* ``fabric.setup(model, optimizer)``: ``session.wrap``; the layout splits what the
  optimizer updates element-wise, exactly as under the Trainer;
* ``fabric.backward(loss)``: ``before_backward`` / ``after_backward`` (the gradient sync,
  unless inside ``fabric.no_backward_sync(model)``);
* ``fabric.clip_gradients``: the session's clipping by the global norm; a ``16-mixed``
  grad scaler agrees on found infs across ranks (torch's ``ShardedGradScaler``);
* ``optimizer.step()``: ``before_step``, the step of what this rank owns, ``after_step``
  (the all-gather that the next forward waits for);
* ``fabric.save`` / ``fabric.load``: the session's formats (sharded directory or one full
  file), so checkpoints reshard across world sizes and move between the Trainer and Fabric.
"""

from __future__ import annotations

import inspect
from contextlib import AbstractContextManager, ExitStack, nullcontext
from datetime import timedelta
from typing import Any, Callable, Literal, Optional, Union

import torch
from lightning.fabric.accelerators import Accelerator, CPUAccelerator, CUDAAccelerator
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment, TorchCheckpointIO
from lightning.fabric.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from lightning.fabric.strategies import DDPStrategy
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.strategies.strategy import _apply_filter, _BackwardSyncControl, _validate_keys_for_strict_loading
from lightning.fabric.utilities.rank_zero import rank_zero_info
from lightning.fabric.utilities.types import _PATH, _Stateful
from torch import nn
from torch.distributed.constants import default_pg_timeout
from torch.optim import Optimizer
from typing_extensions import override

from ..config import config_from_options, named_arguments
from ..engine.clip import clip_grad_norm_, clip_grad_value_
from ..engine.data_parallel import LayerwiseDataParallel
from ..engine.init_record import record_init
from ..engine.materialize import has_meta_tensors
from ..engine.sharded import ReadRules
from ..checkpoint.formats import Checkpoint
from .common import (SessionAdapter, check_precision, register_strategy_names, release_at_exit, session_env,
                     start_session)
from .precision import sharded_grad_scaler
from ..session import is_compiled

_TAKES_SCHEDULER = "scheduler" in inspect.signature(DDPStrategy.setup_module_and_optimizers).parameters

SUPPORTED_PRECISION = (Precision, DoublePrecision, MixedPrecision, HalfPrecision)
"""Fabric precision plugins the strategy accepts (exact types: a subclass may change what clipping must do)."""


class LayerwiseFabricStrategy(SessionAdapter, DDPStrategy):
    """``Fabric(strategy="layerwise")``: the layer-wise distributed optimizer for a hand-written loop.

    Takes the arguments of :class:`~lightning_layerwise.LayerwiseStrategy`, by keyword and with
    the same defaults (``bucket_size``, ``overlap_param_gather``, ``checkpoint_format``…; see
    there and docs/usage.md), with Fabric's ``precision`` plugin in place of the Trainer's
    ``precision_plugin``. One module is trained, with any number of optimizers (each
    stepping its own parameters); modules without trainable parameters (a frozen teacher) may be set up
    beside it and are only synchronized from rank 0. With ``expert_parallel_size=E`` the
    model builds the experts of :attr:`expert_parallel_rank` (known after
    ``fabric.launch()``) and exchanges tokens over ``process_groups.expert_parallel``
    (known after ``fabric.setup``). See docs/fabric.md.
    """

    _accelerator_classes = (CPUAccelerator, CUDAAccelerator)
    _accelerator_fix = "Fabric(accelerator='cpu') or Fabric(accelerator='cuda')"

    def __init__(
        self,
        accelerator: Optional[Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        **options: Any,
    ) -> None:
        own = named_arguments(LayerwiseFabricStrategy.__init__)  # offered too as the closest match of a typo
        start_session(self, config_from_options(type(self).__name__, options, own, timeout=timeout,
                                                start_method=start_method))  # self.session: the run
        self.session.reads.rules = ReadRules(
            steps="the forward of the model that fabric.setup returned",
            whole_again="llw.release(model) or fabric.strategy.teardown(), on every rank, gives the module every "
                        "parameter back whole.")
        super().__init__(accelerator, parallel_devices, cluster_environment, checkpoint_io, precision,
                         process_group_backend, timeout, start_method)
        self._backward_sync_control = _LayerwiseBackwardSyncControl()
        self._exit_hook: Optional[Callable[[], None]] = None

    # --- precision -------------------------------------------------------------------
    def _set_precision(self, precision: Optional[Precision]) -> None:
        check_precision(precision, SUPPORTED_PRECISION)  # when Fabric is built, before any process starts
        self._precision = precision

    precision = property(DDPStrategy.precision.fget, _set_precision)

    # --- set-up ------------------------------------------------------------------------
    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self.session.env = session_env(self)
        self._setup_device_mesh(None)  # fabric.strategy.device_mesh, for a model parallelized before setup

    @override
    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[Optimizer], scheduler: Optional[Any] = None
    ) -> tuple:
        self._check_new_trained_module(module)
        for optimizer in optimizers:
            self._check_optimizer_parameters(optimizer, module)
        wrapper = self._setup_wrapper(module, list(optimizers), elementwise=True)
        # Fabric passes a scheduler through this call from Lightning 2.6 on; before, it takes two values back.
        return (wrapper, optimizers, scheduler) if _TAKES_SCHEDULER else (wrapper, optimizers)

    @override
    def module_init_context(self, empty_init: Optional[bool] = None) -> AbstractContextManager:
        """``fabric.init_module(empty_init=True)`` with ``shard_parameters=True`` builds the model on the meta
        device; ``fabric.setup`` materializes it bucket by bucket (Note [meta-device models] in
        ``engine/materialize.py``)."""
        if not (empty_init and self.config.shard_parameters):
            return super().module_init_context(empty_init)
        stack = ExitStack()
        stack.enter_context(torch.device("meta"))
        stack.enter_context(self.precision.module_init_context())
        stack.enter_context(record_init(self.root_device))  # the model's own init, replayed when materialized
        return stack

    @override
    def module_to_device(self, module: nn.Module) -> None:
        if has_meta_tensors(module):
            return  # materialized on the device when wrapped (Note [meta-device models])
        super().module_to_device(module)

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        if not any(p.requires_grad for p in module.parameters()):
            # Nothing to train (a frozen teacher, a reference model): the same values on every rank.
            from lightning.pytorch.overrides.distributed import _sync_module_states

            _sync_module_states(module)
            return module
        self._check_new_trained_module(module)
        if self.config.elementwise_fill:
            rank_zero_info("LayerwiseFabricStrategy: the module is set up before its optimizer, so every parameter "
                           "is owned whole; fabric.setup(model, optimizer) lets the layout split the parameters "
                           "the optimizer updates element-wise (less padding).")
        return self._setup_wrapper(module, [], elementwise=False)

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        session = self.session
        if session.wrapper is None:
            raise RuntimeError("strategy='layerwise': set up the module first, fabric.setup_module(model), then "
                               "fabric.setup_optimizers(optimizer); or both at once with fabric.setup(model, "
                               "optimizer).")
        if optimizer in session.optimizers:
            raise ValueError("strategy='layerwise': this optimizer is set up already; set it up once.")
        self._check_optimizer_parameters(optimizer, session.module)
        session.add_optimizer(optimizer)
        return optimizer

    def _check_new_trained_module(self, module: nn.Module) -> None:
        session = self.session
        if session.wrapper is not None and module is not session.module:
            raise ValueError("strategy='layerwise' trains one module per Fabric, and one is set up already. Put the "
                             "trained modules in one nn.Module (e.g. an nn.ModuleDict) and set that up once with "
                             "all their optimizers, any number of them (fabric.setup(model, opt_g, opt_d)); modules "
                             "without trainable parameters can be set up beside it.")
        if session.wrapper is not None:
            raise ValueError("strategy='layerwise': this module is set up already; set it up once.")

    @staticmethod
    def _check_optimizer_parameters(optimizer: Optimizer, module: nn.Module) -> None:
        mine = set(module.parameters())
        foreign = [tuple(p.shape) for g in optimizer.param_groups for p in g["params"] if p not in mine]
        if foreign:
            raise ValueError(f"the optimizer holds {len(foreign)} tensor(s) that are not parameters of the module "
                             f"being set up (shapes {foreign[:3]}); build it from that module's parameters.")

    def _setup_wrapper(self, module: nn.Module, optimizers: list[Optimizer], elementwise: bool
                       ) -> LayerwiseDataParallel:
        self.session.env = session_env(self)
        wrapper = self._wrap(module, optimizers, master_weights=isinstance(self.precision, HalfPrecision),
                             elementwise=elementwise)
        self._use_sharded_grad_scaler()
        self.session.sync_after_step = self._needs_sync_after_step(module)
        if self._exit_hook is None:
            self._exit_hook = release_at_exit(self)
        return wrapper

    def _use_sharded_grad_scaler(self) -> None:
        """``16-mixed``: a scaler whose found-inf is agreed over the data-parallel group (a new plugin object)."""
        plugin = self.precision
        group = self.session.groups.dp
        if type(plugin) is MixedPrecision and plugin.scaler is not None and group is not None:
            self.precision = MixedPrecision(plugin.precision, plugin.device,
                                            scaler=sharded_grad_scaler(plugin.scaler, plugin.device, group))

    def _needs_sync_after_step(self, module: nn.Module) -> bool:
        """Whether the all-gather must complete inside the step; see ``overlap_param_gather``."""
        if self.config.overlap_param_gather == "auto" and is_compiled(module):
            rank_zero_info("LayerwiseFabricStrategy: the model is compiled, so parameters are all-gathered inside "
                           "each step (compiled graphs may skip the forward pre-hooks).")
            return True
        return False

    # --- steps -------------------------------------------------------------------------
    @override
    def backward(self, tensor: torch.Tensor, module: Optional[nn.Module], *args: Any, **kwargs: Any) -> None:
        session = self.session
        if session.wrapper is not None and not session.optimizers:
            raise RuntimeError(
                "strategy='layerwise': backward on a module that was set up without an optimizer. Each rank steps "
                "only the parameters it owns and all-gathers them after the step, so the strategy must see the "
                "optimizer: fabric.setup(model, optimizer), or fabric.setup_optimizers(optimizer) after "
                "fabric.setup_module(model).")
        session.before_backward()
        super().backward(tensor, module, *args, **kwargs)
        session.after_backward()

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        session = self.session
        if session.wrapper is None:
            return super().optimizer_step(optimizer, **kwargs)
        self._check_stepping(optimizer, "optimizer.step()")
        session.before_step("optimizer.step()")
        if getattr(self.precision, "scaler", None) is None and self._skip_step():
            return None  # a grad scaler (16-mixed) skips such steps itself, and lowers its scale
        output = self.precision.optimizer_step(optimizer, **kwargs)
        session.after_step(optimizer)
        return output

    def _check_stepping(self, optimizer: Any, what: str) -> None:
        if optimizer not in self.session.optimizers:
            raise RuntimeError(f"strategy='layerwise': {what} with an optimizer that was not set up with the trained "
                               "module; set it up with fabric.setup(model, optimizer).")
        if self.session.wrapper.grad_sync.grads_pending:
            raise RuntimeError(f"strategy='layerwise': {what} after a backward inside fabric.no_backward_sync(model):"
                               " those gradients were never reduced. Run the last micro-batch's backward outside "
                               "no_backward_sync (enabled=False on the step's last micro-batch).")

    @override
    def clip_gradients_norm(self, module: nn.Module, optimizer: Optimizer, max_norm: Union[float, int],
                            norm_type: Union[float, int] = 2.0, error_if_nonfinite: bool = True) -> torch.Tensor:
        """Clips by the norm of the full gradient (one all-reduce over the owned shards); returns that norm."""
        if self.session.wrapper is None:
            return super().clip_gradients_norm(module, optimizer, max_norm, norm_type, error_if_nonfinite)
        self._check_stepping(optimizer, "fabric.clip_gradients")
        self.precision.unscale_gradients(optimizer)
        return clip_grad_norm_(self.session.wrapper, max_norm, norm_type=norm_type,
                               error_if_nonfinite=error_if_nonfinite,
                               parameters=list(self.precision.main_params(optimizer)))

    @override
    def clip_gradients_value(self, module: nn.Module, optimizer: Optimizer, clip_val: Union[float, int]) -> None:
        if self.session.wrapper is None:
            return super().clip_gradients_value(module, optimizer, clip_val)
        self._check_stepping(optimizer, "fabric.clip_gradients")
        self.precision.unscale_gradients(optimizer)
        clip_grad_value_(self.session.wrapper, clip_val, parameters=list(self.precision.main_params(optimizer)))
        return None

    # --- checkpoints -------------------------------------------------------------------
    def _roles(self, state: dict[str, Any]) -> tuple[Optional[str], list[str]]:
        """The key of ``state`` holding the trained module (``None`` if absent) and those holding its optimizers."""
        session = self.session
        module_key, optimizer_keys = None, []
        for key, obj in state.items():
            if session.module is not None and (obj is session.wrapper or obj is session.module):
                module_key = key
            elif any(obj is o for o in session.optimizers):
                optimizer_keys.append(key)
            elif isinstance(obj, Optimizer) and session.wrapper is not None:
                raise ValueError(f"state[{key!r}] is an optimizer that was not set up with the trained module; only "
                                 "the optimizers given to fabric.setup can be saved or loaded.")
        return module_key, optimizer_keys

    @override
    def get_module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        if isinstance(module, LayerwiseDataParallel):
            return self.session.checkpoints.module_state_dict(module.module)
        return module.state_dict()

    @override
    def get_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if any(optimizer is o for o in self.session.optimizers):
            checkpoints = self.session.checkpoints
            return checkpoints.save_format.optimizer_state(checkpoints, optimizer)
        return super().get_optimizer_state(optimizer)

    @override
    def load_module_state_dict(self, module: nn.Module, state_dict: dict[str, Any], strict: bool = True) -> None:
        session = self.session
        if isinstance(module, LayerwiseDataParallel) or (module is session.module and session.wrapper is not None):
            session.checkpoints.load_model_state(state_dict, strict=strict)
        else:
            module.load_state_dict(state_dict, strict=strict)

    @override
    def save_checkpoint(self, path: _PATH, state: dict[str, Any], storage_options: Optional[Any] = None,
                        filter: Optional[dict[str, Callable[[str, Any], bool]]] = None) -> None:
        checkpoints = self.session.checkpoints
        target = self.broadcast(str(path))
        module_key, optimizer_keys = self._roles(state)
        call = f"LayerwiseFabricStrategy(checkpoint_format={self.config.checkpoint_format!r}): fabric.save"
        checkpoints.check_save(target, storage_options, call, has_model=module_key is not None)
        filter = filter or {}
        converted: dict[str, Any] = {}
        for key, obj in state.items():
            if key in optimizer_keys:
                value = checkpoints.save_format.optimizer_state(checkpoints, obj)  # "full": gathered to rank 0
            elif isinstance(obj, nn.Module):
                value = self.get_module_state_dict(obj)
            elif isinstance(obj, Optimizer):
                value = super().get_optimizer_state(obj)
            elif isinstance(obj, _Stateful):
                value = obj.state_dict()
            else:
                value = obj
            _apply_filter(key, filter, value, converted)
        meta = {k: v for k, v in converted.items() if k != module_key and k not in optimizer_keys}
        meta["layerwise"] = {"fabric": {"module": module_key, "optimizers": optimizer_keys}}
        checkpoint = Checkpoint(converted, converted.get(module_key) if module_key else None,
                                [converted[k] for k in optimizer_keys], meta)
        checkpoints.save_format.save(checkpoints, target, checkpoint, self.checkpoint_io, storage_options)

    @override
    def load_checkpoint(self, path: _PATH, state: Optional[Union[nn.Module, Optimizer, dict[str, Any]]] = None,
                        strict: bool = True, weights_only: Optional[bool] = None) -> dict[str, Any]:
        checkpoints = self.session.checkpoints
        path = checkpoints.resolve_path(path)
        read = dict(weights_only=weights_only, file_io=self.checkpoint_io,
                    memory_map=type(self.checkpoint_io) is TorchCheckpointIO)
        if isinstance(state, (nn.Module, Optimizer)):  # fabric.load_raw: a bare state dict in one file
            raw = checkpoints.read_whole(path, "fabric.load_raw reads one file; use fabric.load(path, "
                                               "{'model': model, ...}).", **read)
            if isinstance(state, nn.Module):
                self.load_module_state_dict(state, raw, strict=strict)
            elif any(state is o for o in self.session.optimizers):
                checkpoints.load_optimizer_states([state], [raw])
            else:
                state.load_state_dict(raw)
            return {}
        if not state:
            return checkpoints.read_whole(path, "pass the objects to restore, e.g. fabric.load(path, {'model': "
                                                "model, 'optimizer': optimizer}); each rank reads only what it "
                                                "owns.", **read)
        module_key, optimizer_keys = self._roles(state)
        rest = checkpoints.restore(
            path, module_key=module_key, optimizer_keys=optimizer_keys,
            optimizers=[state[key] for key in optimizer_keys],
            load_module=lambda entry: self.load_module_state_dict(state[module_key], entry, strict=strict),
            strict=strict, strict_hint="Pass strict=False to fabric.load to load the keys that match.", **read)
        others = [k for k in state if k != module_key and k not in optimizer_keys]
        _validate_keys_for_strict_loading(others, rest.keys(), strict=strict)
        for key in others:
            if key not in rest:
                continue
            obj = state[key]
            if isinstance(obj, nn.Module):
                self.load_module_state_dict(obj, rest.pop(key), strict=strict)
            elif isinstance(obj, _Stateful):
                obj.load_state_dict(rest.pop(key))
            else:
                state[key] = rest.pop(key)
        return rest

    # --- teardown ----------------------------------------------------------------------
    @override
    def teardown(self) -> None:
        """Waits for in-flight collectives, unwraps the module and destroys this run's groups.

        Fabric does not call it. After ``fabric.strategy.teardown()`` the module holds the trained parameters
        on every rank (gathered, with ``shard_parameters=True``), and ``fabric.save`` still writes the last
        layout's checkpoint. At interpreter exit, if the script has not called it, the run ends without
        gathering anything (Note [sharded release] in ``engine/sharded.py``)."""
        self._release()
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        register_strategy_names(cls, strategy_registry)


class _LayerwiseBackwardSyncControl(_BackwardSyncControl):
    @override
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        """Backward passes inside accumulate gradients locally; the next one outside reduces the sum."""
        if not enabled:
            return nullcontext()
        if not isinstance(module, LayerwiseDataParallel):
            raise TypeError(f"fabric.no_backward_sync(model) under strategy='layerwise' needs the model returned by "
                            f"fabric.setup(model, optimizer); got a {type(module).__name__} that the strategy did "
                            "not set up (a module without trainable parameters has no gradients to hold back).")
        return module.no_sync()
