"""CPU: quantized perturb and fused update (N=8) per format, next to the naive torch way, in one run.

Rates are bytes of the quantized tensor (read + written) per second.  Size: ESPERT_BENCH_QUANT_MIB
(default 8 MiB of int8-equivalent weights, i.e. 8 Mi weights; fast).

    ESPERT_BENCH_QUANT_MIB=64 pytest bench/test_bench_quant.py --benchmark-json=bench/quant.json
    python bench/table.py bench/quant.json
"""

import os

import pytest
import torch

from espert import ops
from espert.quant import dequantize, quantize_weight
from espert.quant.center import initial_master
from espert.quant.formats import logical_scales, logical_zeros, pack_codes_

MIB = int(os.environ.get("ESPERT_BENCH_QUANT_MIB", "8"))
K = 4096
KEY = 12345
FMTS = ["int8", "fp8", "gptq", "awq", "marlin"]


def _weight(fmt: str):
    n = max(64, (MIB << 20) // K // 64 * 64)
    w = torch.randn(n, K, generator=torch.Generator().manual_seed(0)) * 0.02
    return quantize_weight(w, fmt, 128)


@pytest.fixture(scope="module", params=FMTS)
def qw(request):
    return _weight(request.param)


def _rec(benchmark, qw, kind):
    # record() wants a tensor for the element count: the logical weight count is what matters here
    benchmark.extra_info.update(
        elements=qw.out_features * qw.in_features, bytes=2 * qw.nbytes, kind=f"{kind} {qw.fmt}", device="cpu"
    )


def test_perturb_espert(benchmark, qw):
    _rec(benchmark, qw, "perturb")
    benchmark.pedantic(ops.perturb_, args=(qw, 1, KEY, 1e-3), rounds=3, warmup_rounds=1)


def test_perturb_rademacher_int8_espert(benchmark):
    qw = _weight("int8")
    _rec(benchmark, qw, "perturb rademacher")
    benchmark.pedantic(ops.perturb_, args=(qw, 1, KEY, 1e-3), kwargs={"noise": "rademacher"}, rounds=3, warmup_rounds=1)


def test_update_n8_espert(benchmark, qw):
    master = initial_master(qw)
    _rec(benchmark, qw, "update N=8")
    benchmark.pedantic(
        ops.es_update_, args=(qw, list(range(8)), [1e-5] * 8, KEY), kwargs={"master": master}, rounds=2, warmup_rounds=0
    )


@pytest.mark.parametrize("master", ["float32", "float16", "residual8"])
@pytest.mark.parametrize("fmt", ["int8", "gptq"])
def test_center_update_n8_by_master(benchmark, fmt, master):
    """QuantCenterStore.update (N=8) with each master design side by side: the compact ones widen to float32
    and back around the same fused kernel (docs/quantized.md, "The compact center")."""
    from espert.quant import QuantCenterStore, QuantParamView

    qw = _weight(fmt)
    store = QuantCenterStore([QuantParamView("w", qw)], master=master)
    _rec(benchmark, qw, f"center update N=8 master={master}")
    benchmark.extra_info["host_bytes_per_weight"] = store.nbytes / (qw.out_features * qw.in_features)
    benchmark.pedantic(store.update, args=(list(range(8)), [1e-5] * 8), rounds=2, warmup_rounds=0)


def _naive(qw, n_members):
    """Dequantize -> add a torch.randn noise tensor per member -> requantize (nearest) -> repack."""
    w = dequantize(qw)
    for m in range(n_members):
        w.add_(torch.randn(w.shape, generator=torch.Generator().manual_seed(m)), alpha=1e-3)
    x = w / logical_scales(qw) + logical_zeros(qw)
    if qw.fmt == "fp8":
        codes = x.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    else:
        lo, hi = qw.code_range
        codes = x.round().clamp(lo, hi).to(torch.int32)
    pack_codes_(qw, codes)


def test_perturb_naive_torch(benchmark, qw):
    _rec(benchmark, qw, "perturb")
    benchmark.pedantic(_naive, args=(qw, 1), rounds=2, warmup_rounds=0)


def test_update_n8_naive_torch(benchmark, qw):
    _rec(benchmark, qw, "update N=8")
    benchmark.pedantic(_naive, args=(qw, 8), rounds=1, warmup_rounds=0)
