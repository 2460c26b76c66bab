"""GPU: perturb bandwidth against the device's copy bandwidth, and the N=32 update, CUDA vs Triton.

    bash bench/gpu_check.sh     (build + GPU tests + this benchmark, one call on a GPU machine)
"""

import os

import pytest
import torch

from conftest import bench_tensor, record
from espert import _C, ops

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
GPU_MIB = int(os.environ.get("ESPERT_BENCH_GPU_MIB", "4096"))
BACKENDS = ["triton"] + (["cuda"] if _C.has_cuda else [])


@pytest.fixture(scope="module")
def gpu_weights():
    return bench_tensor("cuda", GPU_MIB)


def _synced(fn, *args):
    def run():
        fn(*args)
        torch.cuda.synchronize()
    return run


def test_copy(benchmark, gpu_weights):
    dst = torch.empty_like(gpu_weights)
    record(benchmark, gpu_weights, 2 * gpu_weights.nbytes, "copy")
    benchmark.pedantic(_synced(dst.copy_, gpu_weights), rounds=20, warmup_rounds=3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_perturb(benchmark, gpu_weights, backend):
    record(benchmark, gpu_weights, 2 * gpu_weights.nbytes, "perturb")
    benchmark.pedantic(_synced(ops.perturb_, gpu_weights, 1, 7, 1e-3, 1, None, backend), rounds=20, warmup_rounds=3)


def test_perturb_naive_torch(benchmark, gpu_weights):
    record(benchmark, gpu_weights, 2 * gpu_weights.nbytes, "perturb")
    benchmark.pedantic(_synced(lambda: gpu_weights.add_(torch.randn_like(gpu_weights), alpha=1e-3)), rounds=10,
                       warmup_rounds=2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_update_n32(benchmark, gpu_weights, backend):
    record(benchmark, gpu_weights, 2 * gpu_weights.nbytes, "update N=32")
    benchmark.pedantic(_synced(ops.es_update_, gpu_weights, list(range(32)), [1e-5] * 32, 7, None, backend),
                       rounds=5, warmup_rounds=1)
