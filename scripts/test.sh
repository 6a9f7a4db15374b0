#!/usr/bin/env bash
# The test command: installs what it needs into .venv, then runs the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh test,examples
exec .venv/bin/python -m pytest "$@"
