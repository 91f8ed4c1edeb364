#!/usr/bin/env bash
# The test suite: graph/plan-only tests and multi-process gloo numerics (about 20 minutes on 2 cores).
# Under CI=true (.ci/run sets it) a skipped test fails (tests/conftest.py).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
python -m pytest -q "$@"
