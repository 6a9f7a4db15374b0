"""Suite-wide options.

``--late-collectives=MS`` runs every collective of the package up to ``MS`` milliseconds late
(Note [late collectives] in ``lightning_layerwise/collectives.py``) in every test: it sets
``LLW_LATE_COLLECTIVES`` for this process, and the forked workers of ``run_distributed``
inherit it. Exporting ``LLW_LATE_COLLECTIVES=MS`` before pytest does the same.
"""

from __future__ import annotations

import os

import pytest

from lightning_layerwise.collectives import LATE_COLLECTIVES_ENV, late_collectives_ms


def pytest_addoption(parser):
    parser.addoption("--late-collectives", metavar="MS", default=None,
                     help="run every collective of lightning_layerwise up to MS milliseconds late "
                          f"(sets {LATE_COLLECTIVES_ENV})")


def pytest_configure(config):
    ms = config.getoption("--late-collectives")
    if ms is not None:
        os.environ[LATE_COLLECTIVES_ENV] = ms
    try:
        late_collectives_ms()  # a bad value fails here, before any test, with the setting named
    except ValueError as error:
        raise pytest.UsageError(str(error)) from None


def pytest_report_header(config):
    ms = late_collectives_ms()
    return [f"late collectives: up to {ms:g} ms per collective ({LATE_COLLECTIVES_ENV})"] if ms is not None else []
