#!/usr/bin/env bash
# The prepared GPU check: one call on a GPU machine (e.g. one H200), under 8 minutes.
#
#   bash bench/gpu_check.sh OUT_DIR              preflight, build for sm_90, GPU tests, GPU benchmarks,
#                                                the model-shaped check (bench/gpu_check.py)
#   bash bench/gpu_check.sh --dry-run [OUT_DIR]  the same flow on CPU with small sizes and interpreted
#                                                Triton, no build (CI runs it: tests/test_gpu_check.py)
#
# Writes into OUT_DIR: gpu_check_log.txt, gpu_tests.xml (JUnit), gpu_bench.json (pytest-benchmark) and
# gpu_bench.md, gpu_check.json and gpu_check.md (the table to paste into the README).
# PYTHON selects the interpreter (default python3: on the H200 image the one that holds torch).
set -uo pipefail

DRY=0
DIR=""
for a in "$@"; do
  case "$a" in
    --dry-run) DRY=1 ;;
    -h | --help) sed -n '2,12p' "$0"; exit 0 ;;
    -*) echo "gpu_check.sh: unknown option $a (see --help)" >&2; exit 2 ;;
    *) DIR=$a ;;
  esac
done
if [ -z "$DIR" ]; then
  if [ "$DRY" = 1 ]; then DIR=$(mktemp -d); else echo "gpu_check.sh: give an output folder (see --help)" >&2; exit 2; fi
fi
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 1
mkdir -p "$DIR" || exit 1
DIR=$(cd "$DIR" && pwd)
PY=${PYTHON:-python3}
LOG=$DIR/gpu_check_log.txt
: >"$LOG"
export PYTHONUNBUFFERED=1 ESPERT_CUDA_ARCHS=${ESPERT_CUDA_ARCHS:-90}
FAILED=()

say() { echo "== $(date -u +%T) $*" | tee -a "$LOG"; }
die() { echo "gpu_check.sh: $*" | tee -a "$LOG" >&2; exit 1; }
# run NAME TIMEOUT CMD...: a step that may fail without stopping the others (its failure is reported)
run() {
  local name=$1 limit=$2
  shift 2
  say "$name"
  timeout "$limit" "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  [ "$rc" = 0 ] || { FAILED+=("$name (exit $rc)"); say "$name FAILED (exit $rc)"; }
  return "$rc"
}

# ---- preflight: nothing runs until the build can only be a CUDA build ---------------------------------
say "preflight"
command -v "$PY" >/dev/null || die "python not found: $PY (set PYTHON=...)"
"$PY" - <<'EOF' 2>&1 | tee -a "$LOG" || die "Python headers missing (see above)"
import os, sys, sysconfig
inc = sysconfig.get_paths()["include"]
print("python", sys.version.split()[0], sys.executable)
if not os.path.exists(os.path.join(inc, "Python.h")):
    sys.exit(f"Python.h not found in {inc}: the CMake build of espert._C needs this Python's headers")
print("headers", inc)
EOF
NVCC=${CUDACXX:-$(command -v nvcc || true)}
if [ -z "$NVCC" ]; then
  for c in /usr/local/cuda/bin/nvcc /usr/local/cuda-*/bin/nvcc; do [ -x "$c" ] && NVCC=$c && break; done
fi
if [ -n "$NVCC" ]; then
  export CUDACXX=$NVCC PATH=$(dirname "$NVCC"):$PATH  # CMake finds the CUDA compiler through CUDACXX
  say "nvcc: $NVCC ($("$NVCC" --version | tail -1))"
elif [ "$DRY" = 0 ]; then
  die "nvcc not found (PATH, CUDACXX, /usr/local/cuda*/bin): the build would silently be CPU-only"
fi

if [ "$DRY" = 0 ]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv 2>&1 | tee -a "$LOG"
  "$PY" -c "import torch, triton; assert torch.cuda.is_available(), 'torch sees no GPU'; \
print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" 2>&1 | tee -a "$LOG"
  [ "${PIPESTATUS[0]}" = 0 ] || die "torch cannot use the GPU"
  say "build espert._C for sm_$ESPERT_CUDA_ARCHS"
  timeout 300 "$PY" -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -30 | tee -a "$LOG"
  [ "${PIPESTATUS[0]}" = 0 ] || die "build failed"
  "$PY" -c "from espert import _C; assert _C.has_cuda, 'espert._C was built without CUDA'; print('has_cuda', _C.has_cuda)" \
    2>&1 | tee -a "$LOG"
  [ "${PIPESTATUS[0]}" = 0 ] || die "espert._C has no CUDA kernels"
  export TRITON_INTERPRET=0  # real Triton (it decides at import time)
  T_TESTS=300 T_BENCH=150 T_MODEL=200
  DRYFLAG=()
  TESTS=(tests/test_gpu.py tests/test_cuda_ptx.py)
else
  say "dry run: CPU tensors, small sizes, interpreted Triton; build skipped (the installed espert._C is used)"
  "$PY" -c "from espert import _C; print('has_cuda', _C.has_cuda, 'cpu_isa', _C.cpu_isa())" 2>&1 | tee -a "$LOG"
  [ "${PIPESTATUS[0]}" = 0 ] || die "espert._C is not importable"
  export ESPERT_GPU_DRY_RUN=1 TRITON_INTERPRET=1
  T_TESTS=900 T_BENCH=300 T_MODEL=300
  DRYFLAG=(--dry-run)
  TESTS=(tests/test_gpu.py)  # the PTX checks need no GPU and already run in the test suite
fi

# ---- GPU tests, GPU benchmarks, the model-shaped check ---------------------------------------------------
run "GPU tests" "$T_TESTS" "$PY" -m pytest -q -p no:cacheprovider -rfE "${TESTS[@]}" \
  --junitxml="$DIR/gpu_tests.xml"
(cd bench && run "GPU benchmarks" "$T_BENCH" "$PY" -m pytest -q -p no:cacheprovider test_bench_gpu.py \
  --benchmark-json="$DIR/gpu_bench.json") || FAILED+=("GPU benchmarks")
[ -f "$DIR/gpu_bench.json" ] && "$PY" bench/table.py "$DIR/gpu_bench.json" >"$DIR/gpu_bench.md" 2>>"$LOG"
run "model-shaped check" "$T_MODEL" "$PY" bench/gpu_check.py "$DIR" "${DRYFLAG[@]}" --junit "$DIR/gpu_tests.xml"

say "outputs in $DIR: $(cd "$DIR" && ls | tr '\n' ' ')"
if [ "${#FAILED[@]}" != 0 ]; then
  say "FAILED: ${FAILED[*]}"
  exit 1
fi
say "all steps passed"
