"""lightning-layerwise: data-parallel training with a layer-wise distributed optimizer for Lightning.

Importing the package registers the strategies ``layerwise``, ``layerwise_spawn``,
``layerwise_fork`` and ``layerwise_notebook`` with Lightning, for the Trainer
(:class:`LayerwiseStrategy`) and for Fabric (:class:`LayerwiseFabricStrategy`).
Without Lightning installed the engine still imports and trains: a plain torch loop
drives a :class:`LayerwiseSession` (``examples/torch_train.py``).
"""

import os as _os

from .config import LayerwiseConfig
from .engine.clip import clip_grad_norm_, clip_grad_value_, grad_norm
from .engine.data_parallel import LayerwiseDataParallel, full_parameters
from .engine.replica_check import ReplicaDivergenceError
from .engine.split_gradient import SplitGradient, SplitGradientError
from .engine.grad_utils import GradientUtilities, gradient_utilities
from .engine.process_groups import ProcessGroups
from .engine.read_guard import StaleParameterReadError
from .engine.sharded import ShardedParameterReadError
from .engine.waiter import CollectiveError
from .experts import mark_experts
from .layout import Layout, ParamSpec, describe_layout, plan_layout
from .engine.qk_clip import QKClip
from .optim import Muon, mark_attention, mark_matrices, muon_param_groups, record_attention_logits
from .session import LayerwiseSession, SessionEnv, release

_LIGHTNING_NAMES = ("LayerwiseStrategy", "LayerwiseFabricStrategy")

try:
    from .lightning import LayerwiseFabricStrategy, LayerwiseStrategy  # registers the strategy names
except ModuleNotFoundError as error:
    if error.name is None or error.name.split(".")[0] != "lightning":
        raise

    def __getattr__(name: str):  # the engine needs only torch: a plain loop runs without Lightning
        if name in _LIGHTNING_NAMES:
            raise ImportError(f"lightning_layerwise.{name} needs Lightning (pip install lightning); the engine "
                              "(LayerwiseSession, LayerwiseDataParallel, Muon, clipping) works without it.")
        raise AttributeError(f"module 'lightning_layerwise' has no attribute {name!r}")

# the timing fuzzer, for tests (Note [late collectives] in ``testing/late_collectives.py``)
if _os.environ.get("LLW_LATE_COLLECTIVES", "").strip():
    from .testing import late_collectives as _late_collectives

    _late_collectives.install_from_environment()

__all__ = [
    "CollectiveError",
    "LayerwiseConfig",
    "LayerwiseDataParallel",
    "LayerwiseFabricStrategy",
    "LayerwiseSession",
    "LayerwiseStrategy",
    "GradientUtilities",
    "Layout",
    "Muon",
    "ParamSpec",
    "ProcessGroups",
    "QKClip",
    "ReplicaDivergenceError",
    "SessionEnv",
    "ShardedParameterReadError",
    "SplitGradient",
    "SplitGradientError",
    "StaleParameterReadError",
    "clip_grad_norm_",
    "clip_grad_value_",
    "describe_layout",
    "full_parameters",
    "grad_norm",
    "gradient_utilities",
    "mark_attention",
    "mark_experts",
    "mark_matrices",
    "muon_param_groups",
    "plan_layout",
    "record_attention_logits",
    "release",
]
