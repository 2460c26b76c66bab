"""GPU checks: CUDA and Triton kernels against the CPU kernel (itself checked against the numpy
reference), golden vectors, and no hidden device memory.  Skipped without a GPU; run them with
bench/gpu_check.sh on a GPU machine, with TRITON_INTERPRET=0 (Triton decides at import time whether
its kernels are interpreted)."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from espert import _C, noise, ops

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
GPU_BACKENDS = ["triton"] + (["cuda"] if _C.has_cuda else [])
KEY = noise.param_key("model.layers.7.self_attn.o_proj.weight")


def _bits(t):
    t = t.cpu()
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 32])
def test_gpu_matches_cpu_bitwise(backend, dtype, n):
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(1000, 4099, generator=g) * 0.02).to(dtype)
    w.view(-1)[:4] = torch.tensor([0.0, -0.0, 1e-40, float("nan")]).to(dtype)
    seeds, coeffs = list(range(100, 100 + n)), list(np.linspace(-1e-3, 1e-3, n))
    block = ops.Block(5, 3, 2000, 5000)
    cpu = w.clone()
    ops.es_update_(cpu, seeds, coeffs, KEY, block=block, backend="cpu")
    gpu = w.cuda()
    ops.es_update_(gpu, seeds, coeffs, KEY, block=block, backend=backend)
    assert torch.equal(_bits(gpu), _bits(cpu))


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_golden_normals(backend):
    golden = json.loads((Path(__file__).parent / "golden" / "noise_v1.json").read_text())
    for case in golden["cases"]:
        n = len(case["normal_bits"])
        w = torch.zeros(n, device="cuda")
        ops.es_update_(w, [case["seed"]], [1.0], case["key"],
                       block=ops.Block(col_offset=case["start"], logical_cols=case["start"] + n), backend=backend)
        assert w.cpu().numpy().view(np.uint32).tolist() == case["normal_bits"]


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_no_hidden_device_memory(backend):
    w = torch.zeros(1 << 29, dtype=torch.bfloat16, device="cuda")  # 1 GiB
    center = torch.zeros(w.shape, dtype=torch.float32)  # host
    ops.perturb_(w, 1, KEY, 1e-3, backend=backend)  # warm-up: compile, load
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    ops.perturb_(w, 2, KEY, 1e-3, backend=backend)
    ops.es_update_(w, list(range(32)), [1e-4] * 32, KEY, backend=backend)
    ops.restore_(w, center)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert extra <= 64 << 20 + (1 << 20), extra  # restore_ stages ≤ 64 MiB chunks; ops themselves O(N)
    assert torch.count_nonzero(w) == 0
