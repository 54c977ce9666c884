#!/usr/bin/env bash
# bench/distill_step.py on one GPU: the tiny models (launch-bound, comparable with the CPU run)
# and GPT-2-medium-like widths in bf16 autocast. A few minutes on one H100/H200.
#
# Needs a CUDA build of torch with mta installed (`pip install -e .`). On a machine without
# ../shared the rows come from src/mta/recipes/examples/ and the 50k case is simulated; the JSON
# says so.
# Results go to bench/results/ (and to $OUT too when the runner sets it).
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device visible')"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true

python bench/distill_step.py --device cuda --preset tiny --rounds 7 --batches 4 --gpt2-batches 4 \
    --output bench/results/distill_step_gpu_tiny.json
python bench/distill_step.py --device cuda --preset medium --autocast bf16 --rounds 7 --batches 4 --gpt2-batches 4 \
    --output bench/results/distill_step_gpu_medium.json

if [[ -n "${OUT:-}" ]]; then
    cp bench/results/distill_step_gpu_*.json "$OUT"/
fi
