"""The Lightning adapters: the Trainer strategy (``trainer``), the Fabric strategy (``fabric``),
their precision plugins (``precision``) and what they share (``common``). The only part of the
package that imports Lightning; both adapters drive a :class:`~lightning_layerwise.LayerwiseSession`.
"""

from lightning.fabric.strategies import STRATEGY_REGISTRY as _FABRIC_STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry as _TRAINER_STRATEGY_REGISTRY

from . import grad_norm as _grad_norm  # noqa: F401  registers Lightning's grad_norm with the scoped patches
from .fabric import LayerwiseFabricStrategy
from .trainer import LayerwiseStrategy

LayerwiseStrategy.register_strategies(_TRAINER_STRATEGY_REGISTRY)
LayerwiseFabricStrategy.register_strategies(_FABRIC_STRATEGY_REGISTRY)

__all__ = ["LayerwiseFabricStrategy", "LayerwiseStrategy"]
