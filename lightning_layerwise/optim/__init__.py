"""Optimizers for layer-wise training: Muon for matrices, AdamW for the rest, and the rule that splits them."""

from lightning_layerwise.optim.elementwise import ELEMENTWISE_OPTIMIZERS, elementwise_parameters
from lightning_layerwise.optim.matrices import MatrixView, mark_matrices, matrix_shapes, matrix_views
from lightning_layerwise.optim.muon import Muon, adjust_lr_scale, muon_step, muon_update, normuon_rows
from lightning_layerwise.optim.muon_options import DEFAULT_NS_BATCH_BYTES, NS_SCHEDULES, resolve_ns_coefficients
from lightning_layerwise.optim.orthogonalization import (newton_schulz, newton_schulz_gram, newton_schulz_reference,
                                                          orthogonalize)
from lightning_layerwise.optim.qk_clip import (head_factors, mark_attention, max_attention_logits,
                                               record_attention_logits)
from lightning_layerwise.optim.param_groups import describe_param_groups, muon_param_groups, route_parameters

__all__ = [
    "DEFAULT_NS_BATCH_BYTES",
    "ELEMENTWISE_OPTIMIZERS",
    "MatrixView",
    "NS_SCHEDULES",
    "Muon",
    "adjust_lr_scale",
    "describe_param_groups",
    "elementwise_parameters",
    "head_factors",
    "mark_attention",
    "mark_matrices",
    "matrix_shapes",
    "matrix_views",
    "max_attention_logits",
    "muon_param_groups",
    "muon_step",
    "muon_update",
    "newton_schulz",
    "newton_schulz_gram",
    "newton_schulz_reference",
    "normuon_rows",
    "orthogonalize",
    "record_attention_logits",
    "resolve_ns_coefficients",
    "route_parameters",
]
