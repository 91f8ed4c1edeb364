#!/usr/bin/env bash
# Creates .venv (if missing) and installs autopar with its test and docs dependencies. torch 2.13.0 (CPU)
# first, from pip's local wheel cache/index, so that nothing later pulls in another torch build.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
. .venv/bin/activate
python -m pip install --quiet --upgrade pip >/dev/null 2>&1 || true
python -m pip install --quiet "torch==2.13.0"
python -m pip install --quiet -e ".[test,docs]"
# torchao (the reference of tests/test_float8.py) without its dependencies: it would not replace torch,
# but --no-deps keeps the installed torch build the only one
python -m pip install --quiet --no-deps "torchao==0.18.0"
