"""Suite-wide options.

``--late-collectives=MS`` runs every collective of the package up to ``MS`` milliseconds late
(Note [late collectives] in ``lightning_layerwise/testing/late_collectives.py``) in every test,
through the package's own pytest plugin; exporting ``LLW_LATE_COLLECTIVES=MS`` before pytest
does the same.
"""

pytest_plugins = ["lightning_layerwise.testing.pytest_plugin"]
