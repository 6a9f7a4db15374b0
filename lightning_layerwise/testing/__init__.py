"""Tools for testing code that trains with the package; nothing here runs in training unless installed.

* :mod:`~lightning_layerwise.testing.late_collectives`: the timing fuzzer (Note [late collectives] in
``testing/late_collectives.py``), which runs
  every collective late on a worker thread so that a missing ``wait()`` fails every time.
* :mod:`~lightning_layerwise.testing.pytest_plugin`: ``pytest --late-collectives=MS`` for a whole test run
  (``pytest -p lightning_layerwise.testing.pytest_plugin``, or ``pytest_plugins = [...]`` in a conftest).
"""

from .late_collectives import (LATE_COLLECTIVES_ENV, LATE_COLLECTIVES_SEED_ENV, LateWork, install,
                               install_from_environment, installed_ms, late_collectives_ms, late_delay_ms,
                               uninstall)

__all__ = [
    "LATE_COLLECTIVES_ENV", "LATE_COLLECTIVES_SEED_ENV", "LateWork", "install", "install_from_environment",
    "installed_ms", "late_collectives_ms", "late_delay_ms", "uninstall",
]
