#!/usr/bin/env bash
# Creates .venv (once) and installs the package with the given extras, torch pinned by constraints.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-test}"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q -c constraints.txt -e ".[${extras}]"
