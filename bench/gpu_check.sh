#!/usr/bin/env bash
# One call on a GPU machine (e.g. the H200 device): build with nvcc for sm_90, run the GPU tests
# (CUDA and Triton vs the CPU kernel, bit for bit; no hidden device memory) and the GPU benchmark.
# Writes $OUT/gpu.json and $OUT/gpu_log.txt when OUT is set.
set -uo pipefail
OUT=${OUT:-/tmp/espert-gpu}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 ESPERT_CUDA_ARCHS=${ESPERT_CUDA_ARCHS:-90}
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  python3 -m pip install -q --no-build-isolation --no-deps -e . || exit 1
  python3 -c "from espert import _C; print('has_cuda', _C.has_cuda)"
  TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py
  TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider bench/test_bench_gpu.py --benchmark-json="$OUT/gpu.json"
  python3 bench/table.py "$OUT/gpu.json"
} 2>&1 | tee "$OUT/gpu_log.txt"
