#!/usr/bin/env bash
# Installed-package smoke test: build autopar's wheel, install it (not editable) into a fresh
# environment, and from a user's directory outside the repository run (1) the CLI's plan, (2) the
# planner's composed search on a 405B-shaped model for 8,192 GPUs and (3) a 2-rank job under
# torchrun whose losses must equal one device's. The user's directory holds only their own model
# code (here: copies of examples/), so nothing resolves against the checkout.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
python3 -m venv "$work/env"
"$work/env/bin/python" -m pip install --quiet --upgrade pip >/dev/null 2>&1 || true
"$work/env/bin/python" -m pip install --quiet "torch==2.13.0"
"$work/env/bin/python" -m pip wheel --quiet --no-deps --wheel-dir "$work/dist" "$repo"
"$work/env/bin/python" -m pip install --quiet "$work"/dist/autopar-*.whl
mkdir -p "$work/user/examples"
cp "$repo"/examples/{__init__,gpt,moe}.py "$work/user/examples/"
cp "$repo"/scripts/smoke/plan_at_scale.py "$repo"/scripts/smoke/train_job.py "$work/user/"
cd "$work/user"
export PATH="$work/env/bin:$PATH" OMP_NUM_THREADS=1
echo "== installed: $(python -c 'import autopar; print(autopar.__file__)')"
echo "== autopar plan examples/gpt.py --mesh dp=2,tp=2 --strategy dp,sp"
autopar plan examples/gpt.py --mesh dp=2,tp=2 --strategy dp,sp --params-only | tail -n 5
echo "== the planner on a 405B shape, 8,192 GPUs"
python plan_at_scale.py
echo "== a 2-rank job under torchrun"
torchrun --standalone --nproc-per-node=2 train_job.py
echo "smoke test of the installed package: OK"
