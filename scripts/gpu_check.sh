#!/usr/bin/env bash
# GPU check (issue 46) at world 1 over NCCL on one GPU:
#   (a) scripts/gpu_check.py: the example GPT, the example MoE and a small Hugging Face Llama, every
#       strategy at degree 1, eager and compiled, against the plain model;
#   (b-d) scripts/gpu_figures.py: ring attention's blocks (the CUDA block kernel) against SDPA in
#       bf16 and fp32; the compiled dp=1 step against torch.compile of the plain model (ratio, MFU);
#       bf16 matmul TFLOP/s and copy bandwidth beside the h100x1 preset.
# Exit codes: 0 every case passed; 1 a case failed; 3 no CUDA GPU here (nothing was run; a clear
# message says so). `--cpu` runs both scripts over gloo on the CPU (a check of the scripts).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -f .venv/bin/activate ]; then . .venv/bin/activate; fi
if [[ " $* " != *" --cpu "* ]] && ! python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check: no CUDA GPU on this host (torch.cuda.is_available() is False); nothing was run (exit 3)" >&2
  exit 3
fi
cpu=""
if [[ " $* " == *" --cpu "* ]]; then cpu="--cpu"; fi
status=0
torchrun --standalone --nproc-per-node=1 scripts/gpu_check.py "$@" || status=1
torchrun --standalone --nproc-per-node=1 scripts/gpu_figures.py $cpu || status=1
exit $status
