"""Precision plugins for sharded gradients, owned by the strategy.

Lightning's precision plugins clip and unscale the gradients of the
optimizer's parameters. Under the layer-wise strategy each rank only holds the
gradients it owns, so two things must become collective:

* clipping by norm uses the norm of the *full* gradient (one all-reduce of the
  owned shards' sum of squares), and clipping by value acts on owned gradients;
* a ``16-mixed`` grad scaler's "found inf" is agreed across ranks, so every rank
  skips the same steps and keeps the same loss scale. torch's public
  :class:`~torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler` does exactly
  that (an all-reduce of found-inf over the group it is given, and a verdict also for
  a rank that owns no gradient); the strategy gives it the data-parallel group.

:func:`layerwise_precision` builds, from the plugin the Trainer chose, the
strategy's own plugin of the same kind (:class:`LayerwisePrecision`,
:class:`LayerwiseMixedPrecision`, :class:`LayerwiseHalfPrecision`,
:class:`LayerwiseDoublePrecision`): the same precision behaviour, with the clipping
above and, for ``16-mixed``, a sharded grad scaler that continues the original
scaler's state. The user's plugin object is left as it was.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import torch
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from torch.distributed import ProcessGroup
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler


class StepHooks(NamedTuple):
    """What a plugin calls of the run: the session's callables (the plugin never sees the strategy)."""

    clip_grad_norm: Callable[[float, list], Any]
    """``(max_norm, parameters)``: clips by the norm of the full gradient of ``parameters``."""
    clip_grad_value: Callable[[float, list], None]
    """``(clip_val, parameters)``: clips each owned gradient element."""
    before_step: Callable[[str], None]
    """Before the optimizer steps: the all-gather done, the gradients reduced (raises naming the call)."""
    skips_nonfinite: Callable[[], bool]
    """Whether steps with non-finite gradients are skipped (``skip_nonfinite_steps`` while training)."""
    skip_step: Callable[[], bool]
    """Whether this step is skipped on every rank (collective; the skip is counted and warned)."""


class _ShardedClipping:
    """Clipping of the gradient spread over the ranks' owned shards (mixin for a Precision plugin)."""

    hooks: Optional[StepHooks] = None

    def _hooks(self) -> StepHooks:
        if self.hooks is None:
            raise RuntimeError("gradient clipping under strategy='layerwise' needs the model wrapped for fitting "
                               "(LayerwiseStrategy.setup has not run or teardown already has).")
        return self.hooks

    def clip_grad_by_norm(self, optimizer: torch.optim.Optimizer, clip_val: float) -> None:
        # The optimizer's parameters only, as Lightning clips them (several optimizers: each its own).
        self._hooks().clip_grad_norm(clip_val, list(self.main_params(optimizer)))

    def clip_grad_by_value(self, optimizer: torch.optim.Optimizer, clip_val: float) -> None:
        self._hooks().clip_grad_value(clip_val, list(self.main_params(optimizer)))

    def _after_closure(self, model, optimizer) -> None:
        if self.hooks is not None:
            self.hooks.before_step("optimizer.step()")
        super()._after_closure(model, optimizer)

    def optimizer_step(self, optimizer, model, closure, **kwargs):
        """With ``skip_nonfinite_steps``: run the closure, then step only if every rank's gradients are finite.

        A grad scaler (``16-mixed``) already skips such steps on every rank and lowers its scale, so it keeps
        its own behaviour.
        """
        hooks = self.hooks
        if hooks is None or not hooks.skips_nonfinite() or getattr(self, "scaler", None) is not None:
            return super().optimizer_step(optimizer, model, closure, **kwargs)
        closure_result = closure()  # forward and backward; the strategy's post_backward syncs the gradients
        if closure_result is None and model.automatic_optimization:
            return closure_result  # training_step returned None: no backward, nothing to step
        if hooks.skip_step():
            return closure_result
        self._after_closure(model, optimizer)  # on_before_optimizer_step and clipping
        return optimizer.step(**kwargs)


class LayerwisePrecision(_ShardedClipping, Precision):
    """``32-true`` (and ``64-true`` through :class:`LayerwiseDoublePrecision`) with global clipping."""


class LayerwiseDoublePrecision(_ShardedClipping, DoublePrecision):
    """``64-true`` with global clipping."""


class LayerwiseHalfPrecision(_ShardedClipping, HalfPrecision):
    """``bf16-true`` / ``16-true`` with global clipping (master weights:
    :class:`~lightning_layerwise.engine.masters.MasterWeights`)."""


class LayerwiseMixedPrecision(_ShardedClipping, MixedPrecision):
    """``bf16-mixed`` / ``16-mixed`` with global clipping and a sharded grad scaler."""


SUPPORTED_PRECISION = (Precision, DoublePrecision, HalfPrecision, MixedPrecision, LayerwisePrecision,
                       LayerwiseDoublePrecision, LayerwiseHalfPrecision, LayerwiseMixedPrecision)
"""Plugin classes the strategy accepts (exact types: a subclass may change what clipping must do)."""


def sharded_grad_scaler(scaler: torch.amp.GradScaler, device: str, group: ProcessGroup) -> ShardedGradScaler:
    """A :class:`ShardedGradScaler` over ``group`` that continues ``scaler``'s state (scale, growth tracker)."""
    state = scaler.state_dict()
    sharded = ShardedGradScaler(device=device, init_scale=state.get("scale", 2.0**16),
                                growth_factor=state.get("growth_factor", 2.0),
                                backoff_factor=state.get("backoff_factor", 0.5),
                                growth_interval=state.get("growth_interval", 2000),
                                enabled=scaler.is_enabled(), process_group=group)
    if state:
        sharded.load_state_dict(state)
    return sharded


def layerwise_precision(plugin: Precision, hooks: StepHooks, group: Optional[ProcessGroup]) -> Precision:
    """The strategy's plugin for ``plugin``: the same precision, with clipping and inf checks across shards.

    ``hooks``: the session's callables; ``group``: the data-parallel group (``None`` on one process: no
    agreement needed). Raises ``ValueError`` for a plugin kind the layer-wise strategy does not support.
    """
    kind = type(plugin)
    if kind in (MixedPrecision, LayerwiseMixedPrecision):
        # A new scaler each fit: the group it agrees over is this fit's (the last fit's is destroyed).
        scaler: Any = plugin.scaler
        if scaler is not None and group is not None:
            scaler = sharded_grad_scaler(scaler, plugin.device, group)
        new: Precision = LayerwiseMixedPrecision(plugin.precision, plugin.device, scaler=scaler)
    elif kind in (HalfPrecision, LayerwiseHalfPrecision):
        new = LayerwiseHalfPrecision(plugin.precision)
    elif kind in (DoublePrecision, LayerwiseDoublePrecision):
        new = LayerwiseDoublePrecision()
    elif kind in (Precision, LayerwisePrecision):
        new = LayerwisePrecision()
    else:  # the strategy's precision_plugin setter rejects every other kind at Trainer construction
        raise ValueError(f"strategy='layerwise' does not support the precision plugin {kind.__name__}.")
    new.hooks = hooks
    return new
