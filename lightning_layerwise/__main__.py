"""``python -m lightning_layerwise``: print the layout report of a model (see ``layout._main``)."""

from .layout import _main

_main()
