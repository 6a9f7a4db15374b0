"""Lightning Fabric glue: ``Fabric(strategy="layerwise")`` for hand-written training loops.

:class:`LayerwiseFabricStrategy` is Fabric's ``DDPStrategy`` (launchers, cluster
environments, process-group set-up, ``all_reduce``/``barrier``/``broadcast``,
samplers) with :class:`LayerwiseDataParallel` in place of
``DistributedDataParallel``. The engine, the precision pieces and the checkpoint
code are those of the Trainer strategy (``core.py``); what differs is only who
calls them:

* ``fabric.setup(model, optimizer)`` wraps the model; the layout splits what the
  optimizer updates element-wise, exactly as under the Trainer;
* ``fabric.backward(loss)`` finishes the gradient sync at its end, unless it runs
  inside ``fabric.no_backward_sync(model)``;
* ``fabric.clip_gradients`` clips by the global norm across shards; a ``16-mixed``
  grad scaler agrees on found infs across ranks (torch's ``ShardedGradScaler``);
* ``optimizer.step()`` steps what this rank owns and starts the all-gather that the
  next forward waits for;
* ``fabric.save`` / ``fabric.load`` write and read the Trainer strategy's formats
  (sharded directory or one full file), so checkpoints reshard across world sizes
  and move between the Trainer and Fabric.
"""

from __future__ import annotations

import atexit
import inspect
import weakref
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from pathlib import Path
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

from . import checkpoint as ckpt
from .clip import clip_grad_norm_, clip_grad_value_
from .config import config_from_options
from .core import LayerwiseCore, check_precision, is_compiled, is_local_path, register_strategy_names
from .data_parallel import LayerwiseDataParallel
from .precision import sharded_grad_scaler

_TAKES_SCHEDULER = "scheduler" in inspect.signature(DDPStrategy.setup_module_and_optimizers).parameters

SUPPORTED_PRECISION = (Precision, DoublePrecision, MixedPrecision, HalfPrecision)
"""Fabric precision plugins the strategy accepts (exact types: a subclass may change what clipping must do)."""


class LayerwiseFabricStrategy(LayerwiseCore, DDPStrategy):
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
        self._init_layerwise(config_from_options(type(self).__name__, options, timeout=timeout,
                                                 start_method=start_method))
        super().__init__(accelerator, parallel_devices, cluster_environment, checkpoint_io, precision,
                         process_group_backend, timeout, start_method)
        self._backward_sync_control = _LayerwiseBackwardSyncControl()
        self._module: Optional[nn.Module] = None  # the trained module, unwrapped
        self._wrapper: Optional[LayerwiseDataParallel] = None
        self._optimizers: list[Optimizer] = []
        self._exit_hook: Optional[Callable[[], None]] = None

    # --- precision -------------------------------------------------------------------
    def _set_precision(self, precision: Optional[Precision]) -> None:
        check_precision(precision, SUPPORTED_PRECISION)  # when Fabric is built, before any process starts
        self._precision = precision

    precision = property(DDPStrategy.precision.fget, _set_precision)

    def _half_true(self) -> bool:
        return isinstance(self.precision, HalfPrecision)

    # --- what the core needs -----------------------------------------------------------
    @property
    def wrapper(self) -> Optional[LayerwiseDataParallel]:
        return self._wrapper

    def _user_module(self) -> Optional[nn.Module]:
        return self._module

    def _user_optimizers(self) -> list[Optimizer]:
        return list(self._optimizers)

    # --- set-up ------------------------------------------------------------------------
    @override
    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[Optimizer], scheduler: Optional[Any] = None
    ) -> tuple:
        self._check_new_trained_module(module)
        for optimizer in optimizers:
            self._check_optimizer_parameters(optimizer, module)
        self._optimizers = list(optimizers)
        wrapper = self._setup_wrapper(module, use_elementwise=True)
        # Fabric passes a scheduler through this call from Lightning 2.6 on; before, it takes two values back.
        return (wrapper, optimizers, scheduler) if _TAKES_SCHEDULER else (wrapper, optimizers)

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        if not any(p.requires_grad for p in module.parameters()):
            # Nothing to train (a frozen teacher, a reference model): the same values on every rank.
            from lightning.pytorch.overrides.distributed import _sync_module_states

            _sync_module_states(module)
            return module
        self._check_new_trained_module(module)
        if self.elementwise_fill:
            rank_zero_info("LayerwiseFabricStrategy: the module is set up before its optimizer, so every parameter "
                           "is owned whole; fabric.setup(model, optimizer) lets the layout split the parameters "
                           "the optimizer updates element-wise (less padding).")
        return self._setup_wrapper(module, use_elementwise=False)

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        if self._wrapper is None:
            raise RuntimeError("strategy='layerwise': set up the module first, fabric.setup_module(model), then "
                               "fabric.setup_optimizers(optimizer); or both at once with fabric.setup(model, "
                               "optimizer).")
        if optimizer in self._optimizers:
            raise ValueError("strategy='layerwise': this optimizer is set up already; set it up once.")
        self._check_optimizer_parameters(optimizer, self._module)
        self._optimizers.append(optimizer)
        self._wrapper.use_shards_in(optimizer)
        self._after_wrap()
        return optimizer

    def _check_new_trained_module(self, module: nn.Module) -> None:
        if self._wrapper is not None and module is not self._module:
            raise ValueError("strategy='layerwise' trains one module per Fabric, and one is set up already. Put the "
                             "trained modules in one nn.Module (e.g. an nn.ModuleDict) and set that up with one "
                             "optimizer; modules without trainable parameters can be set up beside it.")
        if self._wrapper is not None:
            raise ValueError("strategy='layerwise': this module is set up already; set it up once.")

    @staticmethod
    def _check_optimizer_parameters(optimizer: Optimizer, module: nn.Module) -> None:
        mine = set(module.parameters())
        foreign = [tuple(p.shape) for g in optimizer.param_groups for p in g["params"] if p not in mine]
        if foreign:
            raise ValueError(f"the optimizer holds {len(foreign)} tensor(s) that are not parameters of the module "
                             f"being set up (shapes {foreign[:3]}); build it from that module's parameters.")

    def _setup_wrapper(self, module: nn.Module, use_elementwise: bool) -> LayerwiseDataParallel:
        self._module = module
        self._wrapper = self._wrap(module, use_elementwise=use_elementwise)
        self._use_sharded_grad_scaler()
        self._after_wrap()
        self._sync_after_step = self._needs_sync_after_step(module)
        if self._exit_hook is None:
            self._exit_hook = _release_at_exit(self)
        return self._wrapper

    def _use_sharded_grad_scaler(self) -> None:
        """``16-mixed``: a scaler whose found-inf is agreed over the data-parallel group (a new plugin object)."""
        plugin = self.precision
        group = self._wrapper.process_groups.dp
        if type(plugin) is MixedPrecision and plugin.scaler is not None and group is not None:
            self.precision = MixedPrecision(plugin.precision, plugin.device,
                                            scaler=sharded_grad_scaler(plugin.scaler, plugin.device, group))

    def _needs_sync_after_step(self, module: nn.Module) -> bool:
        """Whether the all-gather must complete inside the step; see ``overlap_param_gather``."""
        if self.overlap_param_gather == "auto" and is_compiled(module):
            rank_zero_info("LayerwiseFabricStrategy: the model is compiled, so parameters are all-gathered inside "
                           "each step (compiled graphs may skip the forward pre-hooks).")
            return True
        return False

    # --- steps -------------------------------------------------------------------------
    @override
    def backward(self, tensor: torch.Tensor, module: Optional[nn.Module], *args: Any, **kwargs: Any) -> None:
        if self._wrapper is not None and not self._optimizers:
            raise RuntimeError(
                "strategy='layerwise': backward on a module that was set up without an optimizer. Each rank steps "
                "only the parameters it owns and all-gathers them after the step, so the strategy must see the "
                "optimizer: fabric.setup(model, optimizer), or fabric.setup_optimizers(optimizer) after "
                "fabric.setup_module(model).")
        self._before_backward()
        super().backward(tensor, module, *args, **kwargs)
        self._after_backward()

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        wrapper = self._wrapper
        if wrapper is None:
            return super().optimizer_step(optimizer, **kwargs)
        self._check_stepping(optimizer, "optimizer.step()")
        self._before_optimizer_step("optimizer.step()")
        if (self.skip_nonfinite_steps and getattr(self.precision, "scaler", None) is None
                and not wrapper.grads_are_finite()):
            self.note_skipped_step(self._steps)
            return None
        output = self.precision.optimizer_step(optimizer, **kwargs)
        self._after_optimizer_step(optimizer)
        return output

    def _check_stepping(self, optimizer: Any, what: str) -> None:
        if optimizer not in self._optimizers:
            raise RuntimeError(f"strategy='layerwise': {what} with an optimizer that was not set up with the trained "
                               "module; set it up with fabric.setup(model, optimizer).")
        if self._wrapper.grads_pending:
            raise RuntimeError(f"strategy='layerwise': {what} after a backward inside fabric.no_backward_sync(model):"
                               " those gradients were never reduced. Run the last micro-batch's backward outside "
                               "no_backward_sync (enabled=False on the step's last micro-batch).")

    @override
    def clip_gradients_norm(self, module: nn.Module, optimizer: Optimizer, max_norm: Union[float, int],
                            norm_type: Union[float, int] = 2.0, error_if_nonfinite: bool = True) -> torch.Tensor:
        """Clips by the norm of the full gradient (one all-reduce over the owned shards); returns that norm."""
        if self._wrapper is None:
            return super().clip_gradients_norm(module, optimizer, max_norm, norm_type, error_if_nonfinite)
        self._check_stepping(optimizer, "fabric.clip_gradients")
        self.precision.unscale_gradients(optimizer)
        return clip_grad_norm_(self._wrapper, max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite,
                               parameters=list(self.precision.main_params(optimizer)))

    @override
    def clip_gradients_value(self, module: nn.Module, optimizer: Optimizer, clip_val: Union[float, int]) -> None:
        if self._wrapper is None:
            return super().clip_gradients_value(module, optimizer, clip_val)
        self._check_stepping(optimizer, "fabric.clip_gradients")
        self.precision.unscale_gradients(optimizer)
        clip_grad_value_(self._wrapper, clip_val, parameters=list(self.precision.main_params(optimizer)))
        return None

    # --- checkpoints -------------------------------------------------------------------
    def _roles(self, state: dict[str, Any]) -> tuple[Optional[str], list[str]]:
        """The key of ``state`` holding the trained module (``None`` if absent) and those holding its optimizers."""
        module_key, optimizer_keys = None, []
        for key, obj in state.items():
            if self._module is not None and (obj is self._wrapper or obj is self._module):
                module_key = key
            elif any(obj is o for o in self._optimizers):
                optimizer_keys.append(key)
            elif isinstance(obj, Optimizer) and self._wrapper is not None:
                raise ValueError(f"state[{key!r}] is an optimizer that was not set up with the trained module; only "
                                 "the optimizers given to fabric.setup can be saved or loaded.")
        return module_key, optimizer_keys

    @override
    def get_module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        if isinstance(module, LayerwiseDataParallel):
            self.sync_parameters()
            module = module.module
        return module.state_dict()

    @override
    def get_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if any(optimizer is o for o in self._optimizers):
            return self._named_optimizer_state(optimizer)
        return super().get_optimizer_state(optimizer)

    @override
    def load_module_state_dict(self, module: nn.Module, state_dict: dict[str, Any], strict: bool = True) -> None:
        wrapped = isinstance(module, LayerwiseDataParallel) or (module is self._module and self._wrapper is not None)
        if isinstance(module, LayerwiseDataParallel):
            module = module.module
        if wrapped:
            self.sync_parameters()
        module.load_state_dict(state_dict, strict=strict)
        if wrapped:
            self._after_model_load()

    @override
    def save_checkpoint(self, path: _PATH, state: dict[str, Any], storage_options: Optional[Any] = None,
                        filter: Optional[dict[str, Callable[[str, Any], bool]]] = None) -> None:
        self._check_full_format_with_experts()
        target = self.broadcast(str(path))
        module_key, optimizer_keys = self._roles(state)
        filter = filter or {}
        converted: dict[str, Any] = {}
        for key, obj in state.items():
            if key in optimizer_keys:
                value = self._named_optimizer_state(obj)  # "full": gathered to rank 0 (collective)
            elif isinstance(obj, nn.Module):
                value = self.get_module_state_dict(obj)
            elif isinstance(obj, Optimizer):
                value = super().get_optimizer_state(obj)
            elif isinstance(obj, _Stateful):
                value = obj.state_dict()
            else:
                value = obj
            _apply_filter(key, filter, value, converted)
        if self._write_full_or_check_sharded(target, converted, storage_options,
                                             "LayerwiseFabricStrategy(checkpoint_format='sharded'): fabric.save"):
            return
        if module_key is None:
            raise ValueError("fabric.save with checkpoint_format='sharded' needs the trained module in the state "
                             "(e.g. {'model': model, 'optimizer': optimizer, ...}): its parameters are what each "
                             "rank writes.")
        model_state = converted.pop(module_key)
        optimizer_states = [converted.pop(key) for key in optimizer_keys]
        converted["layerwise"] = {"fabric": {"module": module_key, "optimizers": optimizer_keys}}
        self._save_sharded(Path(target), model_state, optimizer_states, converted)

    @override
    def load_checkpoint(self, path: _PATH, state: Optional[Union[nn.Module, Optimizer, dict[str, Any]]] = None,
                        strict: bool = True, weights_only: Optional[bool] = None) -> dict[str, Any]:
        if is_local_path(str(path)):
            path = self._resolve_checkpoint_path(path)
            sharded = path.is_dir()
        else:
            path, sharded = self.broadcast(str(path)), False
        if isinstance(state, (nn.Module, Optimizer)):  # fabric.load_raw: a bare state dict in one file
            if sharded:
                raise ValueError(f"fabric.load_raw reads one file, and {str(path)!r} is a sharded checkpoint "
                                 "directory; use fabric.load(path, {'model': model, ...}).")
            raw = self._read_file(path, weights_only)
            if isinstance(state, nn.Module):
                self.load_module_state_dict(state, raw, strict=strict)
            elif any(state is o for o in self._optimizers):
                self._load_optimizer_states([state], [raw])
            else:
                state.load_state_dict(raw)
            return {}
        if not state:
            if sharded:
                raise ValueError(f"{str(path)!r} is a sharded checkpoint: pass the objects to restore, e.g. "
                                 "fabric.load(path, {'model': model, 'optimizer': optimizer}); each rank reads only "
                                 "what it owns.")
            return self._read_file(path, weights_only)
        module_key, optimizer_keys = self._roles(state)
        optimizers = [state[key] for key in optimizer_keys]
        if sharded:
            if module_key is None:
                raise ValueError("fabric.load of a sharded checkpoint needs the trained module in the state "
                                 "(e.g. {'model': model, 'optimizer': optimizer, ...}).")
            rest, optimizer_states = self._read_sharded(
                path, len(optimizer_keys), strict, weights_only,
                "Pass strict=False to fabric.load to load the keys that match.")
            saved = rest.pop("layerwise", {}).get("fabric", {})
            saved_keys = saved.get("optimizers", [saved["optimizer"]] if saved.get("optimizer") else [])
            if optimizer_states:
                if sorted(saved_keys) == sorted(optimizer_keys):  # by name; else in the order they were saved
                    optimizer_states = [optimizer_states[saved_keys.index(k)] for k in optimizer_keys]
                self._load_optimizer_states(optimizers, optimizer_states)
        else:
            if module_key is not None:
                self._check_full_load_with_experts()
            rest = self._read_file(path, weights_only)
            if module_key is not None:
                # A Trainer checkpoint file keeps the model under "state_dict" and the optimizers in a list.
                entry = rest.pop(module_key) if module_key in rest else rest.pop("state_dict", None)
                if entry is None:
                    raise ckpt.CheckpointError(f"{str(path)!r} holds no module state under {module_key!r} (nor a "
                                               "Trainer checkpoint's 'state_dict').")
                self.load_module_state_dict(state[module_key], entry, strict=strict)
            if optimizer_keys:
                trainer_states = rest.pop("optimizer_states", None) if not any(k in rest for k in optimizer_keys) \
                    else None
                if trainer_states is not None and len(trainer_states) == len(optimizer_keys):
                    saved_states = list(trainer_states)  # a Trainer checkpoint: the optimizers in order
                else:
                    missing = [k for k in optimizer_keys if k not in rest]
                    if missing:
                        raise ckpt.CheckpointError(f"{str(path)!r} holds no optimizer state under {missing[0]!r} "
                                                   "(nor a Trainer checkpoint's 'optimizer_states' for every "
                                                   "optimizer).")
                    saved_states = [rest.pop(k) for k in optimizer_keys]
                self._load_optimizer_states(optimizers, saved_states)
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

    def _read_file(self, path, weights_only: Optional[bool]) -> dict[str, Any]:
        if type(self.checkpoint_io) is TorchCheckpointIO and isinstance(path, Path) and path.is_file():
            # Memory-mapped: a rank reads the pages of the tensors it uses (the parameters, its owned optimizer
            # state); owned state is copied out of the mapping when loaded.
            return torch.load(path, map_location="cpu", mmap=True,
                              weights_only=True if weights_only is None else weights_only)
        return self.checkpoint_io.load_checkpoint(path, weights_only=weights_only)

    # --- teardown ----------------------------------------------------------------------
    @override
    def teardown(self) -> None:
        """Waits for in-flight collectives, unwraps the module and destroys this run's groups.

        Fabric does not call it; it runs at interpreter exit if the script has not called
        ``fabric.strategy.teardown()``. After it the module holds the trained parameters on every
        rank, and ``fabric.save`` still writes the last layout's checkpoint."""
        self._release()
        self._wrapper = None
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


def _release_at_exit(strategy: LayerwiseFabricStrategy) -> Callable[[], None]:
    """Registers the strategy's teardown at interpreter exit: the last step's all-gather is still in flight,
    and live communicators at exit can abort the process. Holds the strategy weakly."""
    ref = weakref.ref(strategy)

    def release() -> None:
        live = ref()
        if live is not None and live.wrapper is not None:
            live._release()
            live._wrapper = None

    atexit.register(release)
    return release
