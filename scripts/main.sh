#!/usr/bin/env bash
# The main job: dp=2 x tp=2 (+ sequence parallel) training of the example GPT on 4 CPU processes,
# with the plan's tables and the loss compared with the single-device run step by step.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
python examples/train_gpt.py "$@"
