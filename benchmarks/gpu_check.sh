#!/usr/bin/env bash
# The GPU checks in one go, on a machine with one CUDA device and dpclip's dependencies
# installed: the CUDA tests, then the GPU rows of docs/performance.md.
#   bash benchmarks/gpu_check.sh OUT_DIR     # about 5 minutes on one H100/H200
set -o pipefail
out=${1:-.}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$out/gpu.txt"
timeout 240 python3 -m pytest -m cuda -q -p no:cacheprovider tests/cuda tests/engine/test_engine.py \
    tests/engine/test_precision.py 2>&1 | tee "$out/cuda_tests.txt"
timeout 330 python3 benchmarks/gpu_rows.py --json "$out/gpu_rows.json" --profile 4x256 8x1024 2>&1 | tee "$out/gpu_rows.txt"
