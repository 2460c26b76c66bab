#!/usr/bin/env bash
# The prepared GPU check: one call on a GPU machine (e.g. one H200), under 540 s by design (one device
# command may run 600 s): every step's limit is cut to what is left of BUDGET_S.
#
#   bash bench/gpu_check.sh OUT_DIR              preflight, build for sm_90, GPU tests, GPU benchmarks,
#                                                the model-shaped check (bench/gpu_check.py)
#   bash bench/gpu_check.sh --dry-run [OUT_DIR]  the same flow on CPU with small sizes and interpreted
#                                                Triton; the build goes to OUT_DIR/build and is checked,
#                                                the installed module runs (CI: tests/test_gpu_check.py)
#
# Writes into OUT_DIR: gpu_check_log.txt, gpu_tests_<backend>.xml (JUnit, one pytest process per backend so
# a sticky CUDA fault in one cannot take the other's results), gpu_bench.json (pytest-benchmark) and
# gpu_bench.md, gpu_check.json (rewritten after every section) and gpu_check.md. The last lines printed
# are a compact summary (a device reply may carry only the tail of the output).
# PYTHON selects the interpreter (default python3: on the H200 image the one that holds torch).
set -uo pipefail

DRY=0
DIR=""
for a in "$@"; do
  case "$a" in
    --dry-run) DRY=1 ;;
    -h | --help) sed -n '2,15p' "$0"; exit 0 ;;
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
SECONDS=0

say() { echo "== $(date -u +%T) $*" | tee -a "$LOG"; }
die() { echo "gpu_check.sh: $*" | tee -a "$LOG" >&2; exit 1; }
# run NAME TIMEOUT CMD...: a step that may fail without stopping the others (its failure is reported)
# The limit is cut to what is left of BUDGET_S (less 10 s for the summary), so the whole script ends in time.
run() {
  local name=$1 limit=$2
  shift 2
  local left=$((BUDGET_S - SECONDS - 10))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -le 0 ]; then
    FAILED+=("$name (not run: budget spent)")
    say "$name SKIPPED: the ${BUDGET_S} s budget is spent"
    return 1
  fi
  say "$name (limit ${limit} s)"
  timeout "$limit" "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  [ "$rc" = 0 ] || { FAILED+=("$name (exit $rc)"); say "$name FAILED (exit $rc)"; }
  return "$rc"
}

# check_built SO: the module at SO loads and holds CUDA kernels for exactly ESPERT_CUDA_ARCHS
check_built() {
  timeout "$T_PRE" "$PY" - "$1" <<'EOF' 2>&1 | tee -a "$LOG"
import importlib.machinery, importlib.util, os, sys
loader = importlib.machinery.ExtensionFileLoader("espert._C", sys.argv[1])
C = importlib.util.module_from_spec(importlib.util.spec_from_loader("espert._C", loader))
loader.exec_module(C)
want = os.environ["ESPERT_CUDA_ARCHS"].replace(";", ",")
assert C.has_cuda, f"{sys.argv[1]} was built without CUDA kernels"
assert C.cuda_archs == want, f"{sys.argv[1]} holds CUDA kernels for {C.cuda_archs}, not {want}"
print("built", sys.argv[1], "| CUDA kernels for sm_" + C.cuda_archs, "| CPU", C.cpu_isa())
EOF
  [ "${PIPESTATUS[0]}" = 0 ] || die "espert._C is not the CUDA build asked for (see above)"
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
  # GPU step limits (s); tests/test_gpu_check.py sums them: they must stay <= BUDGET_S <= 540
  BUDGET_S=540 T_PRE=10 T_BUILD=150 T_TESTS=90 T_PTX=30 T_BENCH=50 T_MODEL=80
  timeout "$T_PRE" nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv 2>&1 | tee -a "$LOG"
  timeout "$T_PRE" "$PY" -c "import torch, triton; assert torch.cuda.is_available(), 'torch sees no GPU'; \
print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" 2>&1 | tee -a "$LOG"
  [ "${PIPESTATUS[0]}" = 0 ] || die "torch cannot use the GPU"
  say "build espert._C for sm_$ESPERT_CUDA_ARCHS"
  timeout "$T_BUILD" "$PY" -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -30 | tee -a "$LOG"
  [ "${PIPESTATUS[0]}" = 0 ] || die "build failed"
  check_built "$(timeout "$T_PRE" "$PY" -c 'from espert import _C; print(_C.__file__)')"
  export TRITON_INTERPRET=0  # real Triton (it decides at import time)
  DRYFLAG=()
  BACKENDS=(triton cuda)
else
  BUDGET_S=1500 T_PRE=60 T_BUILD=300 T_TESTS=600 T_PTX=0 T_BENCH=300 T_MODEL=300
  say "dry run: CPU tensors, small sizes, interpreted Triton; the installed espert._C runs"
  if [ -n "$NVCC" ]; then
    # the same CMake/nvcc build pip runs above, into a throwaway folder: a build break fails the dry run
    say "build espert._C for sm_$ESPERT_CUDA_ARCHS (CMake, nvcc) into $DIR/build"
    timeout "$T_BUILD" "$PY" setup.py -q build_ext --build-temp "$DIR/build/tmp" --build-lib "$DIR/build/lib" 2>&1 \
      | tail -30 | tee -a "$LOG"
    [ "${PIPESTATUS[0]}" = 0 ] || die "build failed"
    check_built "$(ls "$DIR"/build/lib/espert/_C*.so)"
  else
    say "no nvcc here: the build is not checked"
  fi
  "$PY" -c "from espert import _C; print('has_cuda', _C.has_cuda, 'cpu_isa', _C.cpu_isa())" 2>&1 | tee -a "$LOG"
  [ "${PIPESTATUS[0]}" = 0 ] || die "espert._C is not importable"
  export ESPERT_GPU_DRY_RUN=1 TRITON_INTERPRET=1
  DRYFLAG=(--dry-run)
  BACKENDS=(triton cuda_emulated)  # cuda_emulated: the CUDA kernels' bodies on the CPU (tests/cuda_host/)
fi

# ---- GPU tests, GPU benchmarks, the model-shaped check ---------------------------------------------------
# One pytest process per backend (a sticky CUDA fault ends its process only); synchronous launches, so a
# fault is reported at the kernel that made it.
JUNIT=()
for be in "${BACKENDS[@]}"; do
  JUNIT+=("$DIR/gpu_tests_$be.xml")
  CUDA_LAUNCH_BLOCKING=1 ESPERT_GPU_BACKENDS=$be run "GPU tests ($be)" "$T_TESTS" "$PY" -m pytest -q \
    -p no:cacheprovider -rfE tests/test_gpu.py tests/test_nan_pinning.py --junitxml="$DIR/gpu_tests_$be.xml"
done
if [ "$DRY" = 0 ]; then
  JUNIT+=("$DIR/gpu_tests_ptx.xml")
  run "PTX checks" "$T_PTX" "$PY" -m pytest -q -p no:cacheprovider -rfE tests/test_cuda_ptx.py \
    --junitxml="$DIR/gpu_tests_ptx.xml"
fi
(cd bench && run "GPU benchmarks" "$T_BENCH" "$PY" -m pytest -q -p no:cacheprovider test_bench_gpu.py \
  --benchmark-json="$DIR/gpu_bench.json") || FAILED+=("GPU benchmarks")
[ -f "$DIR/gpu_bench.json" ] && "$PY" bench/table.py "$DIR/gpu_bench.json" >"$DIR/gpu_bench.md" 2>>"$LOG"
run "model-shaped check" "$T_MODEL" "$PY" bench/gpu_check.py "$DIR" "${DRYFLAG[@]}" --junit "${JUNIT[@]}"

say "outputs in $DIR: $(cd "$DIR" && ls | tr '\n' ' ')"
# the compact summary, last (gpu_check.py writes it; the failed steps after it)
[ -f "$DIR/gpu_check_summary.txt" ] && tee -a "$LOG" <"$DIR/gpu_check_summary.txt"
say "elapsed ${SECONDS} s of ${BUDGET_S} s"
if [ "${#FAILED[@]}" != 0 ]; then
  say "FAILED: ${FAILED[*]}"
  exit 1
fi
say "all steps passed"
