#!/usr/bin/env bash
# The main job: installs what it needs into .venv, then trains the example GPT on 2 CPU
# processes with strategy="layerwise" and Muon. Extra arguments go to the LightningCLI.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh examples
exec .venv/bin/python examples/train.py fit --config examples/configs/cpu.yaml "$@"
