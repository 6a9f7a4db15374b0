"""Suite-wide options and checks.

``--late-collectives=MS`` runs every collective of the package up to ``MS`` milliseconds late
(Note [late collectives] in ``lightning_layerwise/testing/late_collectives.py``) in every test,
through the package's own pytest plugin; exporting ``LLW_LATE_COLLECTIVES=MS`` before pytest
does the same.

Every test writes under its own ``tmp_path``: one that leaves a file or folder in the directory
pytest runs from (a ``Trainer`` with checkpointing on and no ``default_root_dir`` writes
``./checkpoints``) fails, and what it left is removed so that the next test starts clean.
"""

import os
import shutil

import pytest

pytest_plugins = ["lightning_layerwise.testing.pytest_plugin"]


@pytest.fixture(autouse=True)
def _writes_nothing_into_the_working_directory():
    cwd = os.getcwd()
    before = set(os.listdir(cwd))
    yield
    left = sorted(set(os.listdir(cwd)) - before)
    for name in left:
        path = os.path.join(cwd, name)
        shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.remove(path)
    assert not left, (f"the test left {left} in {cwd}: give its Trainer a default_root_dir under tmp_path, "
                      "or enable_checkpointing=False when it has no ModelCheckpoint")
