#!/usr/bin/env bash
# The GPU checks in one go, on a machine with one CUDA device and dpclip's dependencies
# installed: the CUDA tests (the engine's, then dpclip train's), the ghost-norm strip counts on CUDA, GPT-2 small against its
# floor, where its host time goes (host_profile.py, and the tiny GPT-2 whose step is all host
# work, engine_step_ratio.py), the compiled step (issue 54), then (with ROWS=1) the GPU rows of
# docs/performance.md with Opacus.
#   bash benchmarks/gpu_check.sh OUT_DIR          # about 4 minutes on one H200, before the train tests
#   ROWS=1 bash benchmarks/gpu_check.sh OUT_DIR   # about 5 more
set -o pipefail
out=${1:-.}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$out/gpu.txt"
timeout 240 python3 -m pytest -m cuda -q -p no:cacheprovider tests/cuda --ignore=tests/cuda/test_train_on_cuda.py \
    tests/engine/test_engine.py tests/engine/test_precision.py 2>&1 | tee "$out/cuda_tests.txt"
# dpclip train with training.device: cuda (docs/training.md, "Device"): every shipped recipe, a
# bit-exact resume, the CPU's ledger, and the noise not regenerable from the seed
timeout 240 python3 -m pytest -m cuda -q -p no:cacheprovider tests/cuda/test_train_on_cuda.py \
    tests/privacy/test_gpu_randomness.py 2>&1 | tee "$out/train_on_cuda_tests.txt"
# issue 54: GPT-2 small's compiled private step (training.compile, a CUDA graph) against the non-private
# step compiled the same way and eager, time and step memory, at the four shapes
timeout 420 python3 benchmarks/gpu_rows.py --methods non-private "non-private compiled" "dpclip all-layer" \
    "dpclip all-layer compiled" --repeats 10 --json "$out/compiled_gpu.json" 2>&1 | tee "$out/compiled_gpu.txt"
timeout 120 python3 benchmarks/norm_rule.py --strips --device cuda --repeats 10 2>&1 | tee "$out/strips.txt"
timeout 300 python3 benchmarks/floor_gap.py --device cuda --memory --repeats 10 \
    --shapes 4x256 2x1024 16x256 8x1024 --json "$out/floor_gap.json" 2>&1 | tee "$out/floor_gap.txt"
timeout 120 python3 benchmarks/host_profile.py --device cuda --shape 4x256 --out "$out/host_profile.txt" \
    --json "$out/host_profile.json" > /dev/null 2>&1
# the host-bound tiny GPT-2 of benchmarks/results/host_overhead_cpu.txt, on the GPU's host
timeout 120 python3 benchmarks/engine_step_ratio.py --device cuda --layers 12 --embd 16 --vocab 64 --seq 4 \
    --batch 2 --threads 1 --repeats 30 --count-ops 2>&1 | tee "$out/host_overhead.txt"
if [ "${ROWS:-0}" = 1 ]; then
    timeout 330 python3 benchmarks/gpu_rows.py --json "$out/gpu_rows.json" --profile 4x256 8x1024 2>&1 \
        | tee "$out/gpu_rows.txt"
fi
