"""GPU: perturb bandwidth against the device's copy bandwidth, and the N=32 update, CUDA vs Triton.

    bash bench/gpu_check.sh OUT_DIR     (build + GPU tests + these benchmarks + the model-shaped check)

Without a GPU the module is skipped, except under ESPERT_GPU_DRY_RUN=1 (``gpu_check.sh --dry-run``):
then the same benchmark code runs on a small CPU tensor with the "cpu" backend, one round each, so a
broken call cannot hide until the first GPU run.  (Interpreted Triton takes minutes even on a tiny
tensor; tests/test_gpu.py runs its kernels in the dry run instead.)
"""

import os

import pytest
import torch
from conftest import bench_tensor, record

from espert import _C, ops

CUDA = torch.cuda.is_available()
DRY = not CUDA and os.environ.get("ESPERT_GPU_DRY_RUN") == "1"
pytestmark = pytest.mark.skipif(not (CUDA or DRY), reason="needs a CUDA GPU (or ESPERT_GPU_DRY_RUN=1)")
DEV = "cuda" if CUDA else "cpu"
GPU_MIB = int(os.environ.get("ESPERT_BENCH_GPU_MIB", "4096" if CUDA else "1"))
if CUDA:
    BACKENDS = ["triton"] + (["cuda"] if _C.has_cuda else [])
else:
    BACKENDS = ["cpu"]
ROUNDS = (
    {"copy": 20, "perturb": 20, "naive": 10, "update": 5}
    if CUDA
    else dict.fromkeys(("copy", "perturb", "naive", "update"), 1)
)
KEY = 7


@pytest.fixture(scope="module")
def gpu_weights():
    return bench_tensor(DEV, GPU_MIB)


def _synced(fn, *args, **kwargs):
    def run():
        fn(*args, **kwargs)
        if CUDA:
            torch.cuda.synchronize()

    return run


def _pedantic(benchmark, kind, fn):
    r = ROUNDS[kind]
    benchmark.pedantic(fn, rounds=r, warmup_rounds=min(3, r) if CUDA else 0)


def test_copy(benchmark, gpu_weights):
    dst = torch.empty_like(gpu_weights)
    record(benchmark, gpu_weights, 2 * gpu_weights.nbytes, "copy")
    _pedantic(benchmark, "copy", _synced(dst.copy_, gpu_weights))


@pytest.mark.parametrize("backend", BACKENDS)
def test_perturb(benchmark, gpu_weights, backend):
    record(benchmark, gpu_weights, 2 * gpu_weights.nbytes, "perturb")
    _pedantic(benchmark, "perturb", _synced(ops.perturb_, gpu_weights, 1, KEY, 1e-3, 1, backend=backend))


def test_perturb_naive_torch(benchmark, gpu_weights):
    record(benchmark, gpu_weights, 2 * gpu_weights.nbytes, "perturb")
    _pedantic(benchmark, "naive", _synced(lambda: gpu_weights.add_(torch.randn_like(gpu_weights), alpha=1e-3)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_update_n32(benchmark, gpu_weights, backend):
    record(benchmark, gpu_weights, 2 * gpu_weights.nbytes, "update N=32")
    _pedantic(
        benchmark, "update", _synced(ops.es_update_, gpu_weights, list(range(32)), [1e-5] * 32, KEY, backend=backend)
    )
