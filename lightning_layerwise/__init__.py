"""lightning-layerwise: data-parallel training with a layer-wise distributed optimizer for Lightning."""

from .data_parallel import LayerwiseDataParallel
from .layout import Layout, ParamSpec, describe_layout, plan_layout
from .process_groups import ProcessGroups

try:  # filled in as the package grows
    from .optim import Muon, muon_param_groups
except ImportError:  # pragma: no cover
    pass

__all__ = [
    "LayerwiseDataParallel",
    "Layout",
    "Muon",
    "ParamSpec",
    "ProcessGroups",
    "describe_layout",
    "muon_param_groups",
    "plan_layout",
]
