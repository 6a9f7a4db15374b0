"""``pytest --late-collectives=MS``: every collective of the package up to ``MS`` milliseconds late in every test
(Note [late collectives] in ``testing/late_collectives.py``).

Enable it with ``pytest -p lightning_layerwise.testing.pytest_plugin`` or ``pytest_plugins =
["lightning_layerwise.testing.pytest_plugin"]`` in a ``conftest.py``. The option installs the fuzzer in the
pytest process and sets ``LLW_LATE_COLLECTIVES`` for every process started from it (forked workers keep the
installation; a new interpreter installs it when it imports the package). Exporting
``LLW_LATE_COLLECTIVES=MS`` before pytest does the same without the option.
"""

from __future__ import annotations

import os

import pytest

from .late_collectives import LATE_COLLECTIVES_ENV, install_from_environment, installed_ms


def pytest_addoption(parser):
    parser.addoption("--late-collectives", metavar="MS", default=None,
                     help="run every collective of lightning_layerwise up to MS milliseconds late "
                          f"(sets {LATE_COLLECTIVES_ENV})")


def pytest_configure(config):
    ms = config.getoption("--late-collectives")
    if ms is not None:
        os.environ[LATE_COLLECTIVES_ENV] = ms
    try:
        install_from_environment()  # a bad value fails here, before any test, with the setting named
    except ValueError as error:
        raise pytest.UsageError(str(error)) from None


def pytest_report_header(config):
    ms = installed_ms()
    return [f"late collectives: up to {ms:g} ms per collective ({LATE_COLLECTIVES_ENV})"] if ms is not None else []
