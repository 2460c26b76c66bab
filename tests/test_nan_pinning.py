"""A NaN that the add creates has pinned bits on every backend (docs/noise.md §3).

It arises as inf − inf: noise sums that overflow (coefficients of about 6e37 and up), or an infinite
weight meeting infinite noise of the other sign.  Before, the spec left its bits open: the CPU wrote
x86's default NaN (0xFFC00000, bf16 0xFFC0) and a CUDA add gives 0x7FFFFFFF (bf16 0x7FFF).  Now it is
the positive quiet NaN 0x7FC00000 (bf16 0x7FC0, fp16 0x7E00) everywhere; a NaN weight still keeps
its own bits.
"""

import os

import numpy as np
import pytest
import torch
from conftest import bits, ref_bits, to_ref

from espert import noise, ops

KEY = noise.param_key("model.layers.0.self_attn.o_proj.weight")
CANONICAL = {torch.float32: 0x7FC00000, torch.bfloat16: 0x7FC0, torch.float16: 0x7E00}
ON_GPU = torch.cuda.is_available()
# bench/gpu_check.sh runs this file once per GPU backend (ESPERT_GPU_BACKENDS), on the GPU
BACKENDS = os.environ.get("ESPERT_GPU_BACKENDS", "cpu,triton" + (",cuda" if ON_GPU else "")).split(",")
# (seeds, coefficients) whose noise sums overflow: inf − inf inside the sum (gaussian), or ±inf
# sums that meet the infinite weights of rows 0 and 1 (both families)
CASES = {"gaussian": ([5, 5], [3e38, -3e38]), "rademacher": ([5, 6], [3e38, 3e38])}


def _weights(dtype):
    w = torch.full((4, 257), 0.5)
    w[0], w[1] = float("inf"), float("-inf")
    w = w.to(dtype)
    nan_in = torch.zeros_like(w, dtype=torch.bool)
    nan_in[2, ::5] = True
    raw = w.view(torch.int32 if dtype == torch.float32 else torch.int16)
    # negative signalling NaNs with a payload: a hardware add would quiet or replace them
    nan_bits = {torch.float32: 0xFFA00001 - 2**32, torch.bfloat16: 0xFFA1 - 2**16, torch.float16: 0xFD01 - 2**16}
    raw[nan_in] = nan_bits[dtype]
    return w, nan_in


@pytest.mark.parametrize("family", sorted(CASES))
@pytest.mark.parametrize("dtype", list(CANONICAL))
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_nan_the_add_creates_has_pinned_bits(backend, dtype, family):
    seeds, coeffs = CASES[family]
    w, nan_in = _weights(dtype)
    before = bits(w)
    ref_in, name = to_ref(w)
    with np.errstate(all="ignore"):
        ref = ref_bits(noise.update_reference(ref_in, name, seeds, coeffs, KEY, noise=family))
    dev = w.to("cuda") if backend != "cpu" and ON_GPU else w
    ops.es_update_(dev, seeds, coeffs, KEY, backend=backend, noise=family)
    got = bits(dev)
    mask = nan_in.numpy()
    np.testing.assert_array_equal(got[mask], before[mask])  # a NaN weight keeps its bits
    created = torch.isnan(dev.cpu()).numpy() & ~mask
    assert created.sum() > 50, "the case must create NaNs"
    assert set(got[created].tolist()) == {CANONICAL[dtype]}, {hex(v) for v in set(got[created].tolist())}
    np.testing.assert_array_equal(got, ref)  # and the numpy reference agrees bit for bit
