#!/usr/bin/env bash
# bench/distill_step.py on one GPU: the tiny models (launch-bound, comparable with the CPU run)
# and GPT-2-medium-like widths in bf16 autocast. A few minutes on one H100/H200.
#
# Needs a CUDA build of torch with mta installed (`pip install -e .`). On a machine without
# ../shared the rows come from src/mta/recipes/examples/ and the 50k case is simulated; the JSON
# says so.
# Results go to bench/results/ (and to $OUT too when the runner sets it).
#
#   bench/distill_step_gpu.sh              # the step benchmark, tiny and medium
#   bench/distill_step_gpu.sh --onpolicy   # bench/onpolicy_step.py only (medium, bf16; ~3 minutes)
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device visible')"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true

if [[ "${1:-}" == "--onpolicy" ]]; then
    python bench/onpolicy_step.py --device cuda --preset medium --autocast bf16 --rounds 7 --batches 4 \
        --output bench/results/onpolicy_step_gpu.json
    if [[ -n "${OUT:-}" ]]; then
        cp bench/results/onpolicy_step_gpu.json "$OUT"/
    fi
    exit 0
fi

python bench/distill_step.py --device cuda --preset tiny --rounds 7 --batches 4 --gpt2-batches 4 \
    --output bench/results/distill_step_gpu_tiny.json
python bench/distill_step.py --device cuda --preset medium --autocast bf16 --rounds 7 --batches 4 --gpt2-batches 4 \
    --output bench/results/distill_step_gpu_medium.json

if [[ -n "${OUT:-}" ]]; then
    cp bench/results/distill_step_gpu_*.json "$OUT"/
fi
