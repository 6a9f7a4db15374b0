"""The Trainer strategy's former import path; it lives in :mod:`lightning_layerwise.lightning.trainer`."""

from .lightning.trainer import LayerwiseStrategy  # noqa: F401

__all__ = ["LayerwiseStrategy"]
