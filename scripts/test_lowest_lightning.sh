#!/usr/bin/env bash
# The Lightning-facing tests against the lowest supported Lightning (constraints-lowest.txt), in .venv-lowest.
# The strategies subclass Lightning's DDPStrategy and follow its setup and Fabric protocols, so both ends of
# the supported range are tested (pyproject.toml); bash scripts/test.sh covers the newest. The timing-fuzzer
# ("late") and repeated ("again") variants are left to that run: they look for races in the engine, which
# does not change with the Lightning version, and CI must finish within 20 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv-lowest/bin/python ]; then
  python3 -m venv .venv-lowest
fi
.venv-lowest/bin/python -m pip install -q -c constraints-lowest.txt -e ".[test]"
.venv-lowest/bin/python -c "import lightning; print('lightning', lightning.__version__)"
exec .venv-lowest/bin/python -m pytest -q -k "not late and not again" "$@" \
  tests/test_strategy.py tests/test_fabric.py tests/test_trainer_features.py tests/test_ddp_patterns.py \
  tests/test_checkpoint_resharding.py tests/test_cli.py tests/test_finetuning.py
