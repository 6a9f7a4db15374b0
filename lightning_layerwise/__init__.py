"""lightning-layerwise: data-parallel training with a layer-wise distributed optimizer for Lightning.

Importing the package registers the strategies ``layerwise``, ``layerwise_spawn``,
``layerwise_fork`` and ``layerwise_notebook`` with Lightning, for the Trainer
(:class:`LayerwiseStrategy`) and for Fabric (:class:`LayerwiseFabricStrategy`).
"""

from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

from .clip import clip_grad_norm_, clip_grad_value_, grad_norm
from .config import LayerwiseConfig
from .data_parallel import CollectiveError, LayerwiseDataParallel, ReplicaDivergenceError
from .experts import mark_experts
from .fabric import LayerwiseFabricStrategy
from .layout import Layout, ParamSpec, describe_layout, plan_layout
from .optim import Muon, muon_param_groups
from .process_groups import ProcessGroups
from .read_guard import StaleParameterReadError
from .strategy import LayerwiseStrategy

LayerwiseStrategy.register_strategies(StrategyRegistry)
LayerwiseFabricStrategy.register_strategies(FABRIC_STRATEGY_REGISTRY)

__all__ = [
    "CollectiveError",
    "LayerwiseConfig",
    "LayerwiseDataParallel",
    "LayerwiseFabricStrategy",
    "LayerwiseStrategy",
    "Layout",
    "Muon",
    "ParamSpec",
    "ProcessGroups",
    "ReplicaDivergenceError",
    "StaleParameterReadError",
    "clip_grad_norm_",
    "clip_grad_value_",
    "describe_layout",
    "grad_norm",
    "mark_experts",
    "muon_param_groups",
    "plan_layout",
]
