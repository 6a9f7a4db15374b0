"""lightning-layerwise: data-parallel training with a layer-wise distributed optimizer for Lightning.

Importing the package registers the strategies ``layerwise``, ``layerwise_spawn``,
``layerwise_fork`` and ``layerwise_notebook`` with Lightning, for the Trainer
(:class:`LayerwiseStrategy`) and for Fabric (:class:`LayerwiseFabricStrategy`).
Without Lightning installed the engine still imports and trains: a plain torch loop
drives a :class:`LayerwiseSession` (``examples/torch_train.py``).
"""

from .clip import clip_grad_norm_, clip_grad_value_, grad_norm
from .config import LayerwiseConfig
from .data_parallel import CollectiveError, LayerwiseDataParallel, ReplicaDivergenceError
from .experts import mark_experts
from .grad_sync import SplitGradient, SplitGradientError
from .layout import Layout, ParamSpec, describe_layout, plan_layout
from .optim import Muon, muon_param_groups
from .process_groups import ProcessGroups
from .read_guard import StaleParameterReadError
from .session import LayerwiseSession, SessionEnv

_LIGHTNING_NAMES = ("LayerwiseStrategy", "LayerwiseFabricStrategy")

try:
    import lightning  # noqa: F401
except ImportError:
    lightning = None

if lightning is not None:
    from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    from .fabric import LayerwiseFabricStrategy
    from .strategy import LayerwiseStrategy

    LayerwiseStrategy.register_strategies(StrategyRegistry)
    LayerwiseFabricStrategy.register_strategies(FABRIC_STRATEGY_REGISTRY)
else:  # the engine needs only torch: a plain loop (examples/torch_train.py) runs without Lightning
    def __getattr__(name: str):
        if name in _LIGHTNING_NAMES:
            raise ImportError(f"lightning_layerwise.{name} needs Lightning (pip install lightning); the engine "
                              "(LayerwiseSession, LayerwiseDataParallel, Muon, clipping) works without it.")
        raise AttributeError(f"module 'lightning_layerwise' has no attribute {name!r}")

__all__ = [
    "CollectiveError",
    "LayerwiseConfig",
    "LayerwiseDataParallel",
    "LayerwiseFabricStrategy",
    "LayerwiseSession",
    "LayerwiseStrategy",
    "Layout",
    "Muon",
    "ParamSpec",
    "ProcessGroups",
    "ReplicaDivergenceError",
    "SessionEnv",
    "SplitGradient",
    "SplitGradientError",
    "StaleParameterReadError",
    "clip_grad_norm_",
    "clip_grad_value_",
    "describe_layout",
    "grad_norm",
    "mark_experts",
    "muon_param_groups",
    "plan_layout",
]
