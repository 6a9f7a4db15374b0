"""The Fabric strategy's former import path; it lives in :mod:`lightning_layerwise.lightning.fabric`."""

from .lightning.fabric import LayerwiseFabricStrategy  # noqa: F401

__all__ = ["LayerwiseFabricStrategy"]
