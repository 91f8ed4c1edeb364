#!/usr/bin/env bash
# GPU check (issue 46): the example GPT at world 1 over NCCL, every strategy at degree 1, eager
# and compiled, against the plain model (scripts/gpu_check.py). Exit codes: 0 every case passed;
# 1 a case failed; 3 no CUDA GPU here (nothing was run; a clear message says so).
# Extra arguments go to gpu_check.py (--only dp tp, --cpu to check the script over gloo on the CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -f .venv/bin/activate ]; then . .venv/bin/activate; fi
if [[ " $* " != *" --cpu "* ]] && ! python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check: no CUDA GPU on this host (torch.cuda.is_available() is False); nothing was run (exit 3)" >&2
  exit 3
fi
exec torchrun --standalone --nproc-per-node=1 scripts/gpu_check.py "$@"
