"""The CUDA kernel as a CI backend (issue 21 §2): the bodies of the CUDA kernels
(csrc/cuda/apply_kernel.cuh, csrc/cuda/quant_kernel.cuh) compiled as host C++ through
csrc/cuda/host_shim.h and run block by block, thread by thread, as the ops backend ``cuda_emulated``
(tests/cuda_host/emulated.py) on the ops' own CUDA launch plans (the CUDA unit size, one launch per
dtype and family, the lowrank staging fill) and the quantized kernels' argument row.  Its bits must
equal the CPU backend's on every dtype, family and quantized layout, with guard bands around every
tensor, with the real grid and with forced small grids (so the grid-stride loops run), and under ASan
and UBSan.  This is how a CPU-only CI sees the CUDA kernels' indexing: vector-path alignment, row ends,
unaligned Block starts, 64-bit indices.  (tests/test_gpu.py also runs on it in the GPU check's dry run.)"""

import dataclasses

import numpy as np
import pytest
import torch
from cuda_host import emulated
from test_gpu import Q_CASES  # the quantized layouts tests/test_gpu.py runs on a GPU

from espert import ops

pytestmark = pytest.mark.skipif(emulated.CXX is None, reason="no host C++ compiler")
GUARD = 24  # elements of guard band before and after every tensor (the emulator copies GUARD // 2 bytes of it)


@pytest.fixture
def cuda_emulated(monkeypatch):
    return emulated.register(monkeypatch, pad=GUARD // 2)


@pytest.fixture
def cuda_sanitized(monkeypatch):
    return emulated.register(monkeypatch, "sanitized", max_blocks=3)


def _guarded(shape, dtype, gen, cols_stride=None):
    """A tensor of `shape` inside a flat base tensor with GUARD elements of -7 on each side (and, with
    cols_stride, a row stride wider than its columns).  Returns (view, base)."""
    rows, cols = (1, shape[0]) if len(shape) == 1 else shape
    stride = cols_stride or cols
    base = torch.full((2 * GUARD + rows * stride,), -7.0, dtype=dtype)
    body = base[GUARD : GUARD + rows * stride].view(rows, stride)
    body.copy_(torch.randn(rows, stride, generator=gen).to(dtype))
    view = body[:, :cols]
    return (view.reshape(shape) if len(shape) == 1 else view), base


def _case(seed: int):
    """Items of every dtype in one call: a long tensor (several launch units, NaNs, collapsed rows), a
    column slice with an unaligned Block start, a 1-D tensor whose logical indices end at 2^64 - 2, and
    one that ends 2 elements before a unit boundary (the bound of the hot loop), and a long one whose
    logical start leaves its units misaligned in memory (the hot loop's alignment test)."""
    g = torch.Generator().manual_seed(seed)
    dts = [torch.float32, torch.float16, torch.bfloat16]
    dts = dts[seed % 3 :] + dts[: seed % 3]
    a, base_a = _guarded((3, 4100), dts[0], g)
    a[1, 17] = float("nan")
    a.view(-1)[5000] = float("inf")
    b, base_b = _guarded((5, 39), dts[1], g, cols_stride=64)
    c, base_c = _guarded((131,), dts[2], g)
    d, base_d = _guarded((2 * 4096 - 2,), dts[0], g)  # a unit, then one 2 elements short of whole
    e, base_e = _guarded((9000,), dts[1], g)  # long, and its logical start 1 leaves every unit misaligned
    items = [
        (d, 5, None),
        (e, 6, ops.Block(col_offset=1, logical_cols=9001)),
        (a, 7, None),
        (b, 2**63 + 5, ops.Block(row_offset=2, col_offset=3, logical_rows=9, logical_cols=101)),
        (c, 2**64 - 1, ops.Block(col_offset=2**64 - 131 - 2, logical_cols=2**64 - 2)),
    ]
    return items, [base_a, base_b, base_c, base_d, base_e]


def _twin(items, bases):
    """The same items over clones of the bases (for the CPU backend)."""
    clones = [b.clone() for b in bases]
    out = []
    for w, key, blk in items:
        k = next(i for i, b in enumerate(bases) if w.untyped_storage().data_ptr() == b.data_ptr())
        off = (w.data_ptr() - bases[k].data_ptr()) // w.element_size()
        out.append((clones[k].as_strided(w.shape, w.stride(), off), key, blk))
    return out, clones


def _same(x: torch.Tensor, y: torch.Tensor) -> bool:
    return torch.equal(x.view(torch.uint8), y.view(torch.uint8))


@pytest.mark.parametrize("noise", ["gaussian", "gaussian-icdf", "rademacher", "lowrank:2"])
@pytest.mark.parametrize("members", [1, 3])
@pytest.mark.parametrize("max_blocks", [0, 1, 5])
def test_emulated_cuda_kernel_equals_the_cpu_backend(cuda_emulated, noise, members, max_blocks):
    cuda_emulated.max_blocks = max_blocks
    items, bases = _case(members + max_blocks)
    twin, clones = _twin(items, bases)
    before = [b.clone() for b in bases]
    seeds = [2**64 - 1 - 977 * k for k in range(members)]
    coeffs = [(-1) ** k * (0.5 + k) * 1e-2 for k in range(members)]
    scales = [0.5, 2.0, 1.0, 0.25, 3.0]
    with ops.counting() as n:
        ops.es_update_many_(items, seeds, coeffs, noise=noise, scales=scales, backend="cuda_emulated")
    ops.es_update_many_(twin, seeds, coeffs, noise=noise, scales=scales, backend="cpu")
    for b, cl, b0 in zip(bases, clones, before):
        assert _same(b[:GUARD], b0[:GUARD]) and _same(b[-GUARD:], b0[-GUARD:])  # guard bands untouched
        assert _same(b, cl)  # bit for bit the CPU backend
        assert not _same(b, b0)  # and the call did something
    assert n["launches"] >= 3  # one per dtype present (lowrank: a staging fill and an apply per dtype)
    if max_blocks:
        assert cuda_emulated.last_blocks <= max_blocks


@pytest.mark.parametrize("noise", ["gaussian", "gaussian-icdf", "rademacher", "lowrank:2"])
def test_emulated_cuda_kernel_under_asan_and_ubsan(cuda_sanitized, noise):
    items, bases = _case(2)
    twin, clones = _twin(items, bases)
    ops.es_update_many_(items, [11, 2**63], [3e-3, -0.75], noise=noise, backend="cuda_emulated")
    ops.es_update_many_(twin, [11, 2**63], [3e-3, -0.75], noise=noise, backend="cpu")
    assert all(_same(b, c) for b, c in zip(bases, clones))


@pytest.mark.parametrize("mode", ["perturb", "master"])
@pytest.mark.parametrize("noise", ["gaussian", "gaussian-icdf", "rademacher", "lowrank:2"])
@pytest.mark.parametrize("fmt,kw", Q_CASES, ids=[f"{f}-{'-'.join(map(str, k.values()))}" for f, k in Q_CASES])
def test_emulated_quantized_kernel_equals_the_cpu_backend(monkeypatch, fmt, kw, noise, mode):
    """The CUDA quantized kernel (run_unit per thread, grid-stride) against the CPU's tiled kernel, with a
    forced grid of 2 blocks (512 threads for more units): every layout, family and mode."""
    from espert.quant import quantize_weight
    from espert.quant.center import initial_master

    emulated.register(monkeypatch, max_blocks=2)
    kw = dict(kw)
    group = kw.pop("group", 32)
    base = quantize_weight(torch.randn(64, 256, generator=torch.Generator().manual_seed(3)) * 0.02, fmt, group, **kw)
    key = 2**64 - 3

    def run(be):
        qw = dataclasses.replace(base.clone(), qweight=base.qweight.clone(), scales=base.scales.clone())
        master = initial_master(qw) if mode == "master" else None
        if mode == "perturb":
            ops.perturb_(qw, 5, key, 2e-3, -1, noise=noise, backend=be)
        else:
            ops.es_update_(qw, [1, 2**64 - 1, 3], [3e-3, -2e-3, 1e-3], key, master=master, noise=noise, backend=be)
        return qw, master

    want, m_want = run("cpu")
    got, m_got = run("cuda_emulated")
    assert torch.equal(got.qweight.view(torch.uint8), want.qweight.view(torch.uint8))
    assert not torch.equal(got.qweight.view(torch.uint8), base.qweight.view(torch.uint8))
    if mode == "master":
        assert torch.equal(m_got.view(torch.int32), m_want.view(torch.int32))


def test_emulated_grid_is_the_real_one_or_the_forced_one(cuda_emulated):
    """The emulator runs launch_blocks(units) blocks, or the forced grid: the grid-stride loop then covers
    the units a smaller grid leaves (an off-by-one in it would leave elements unperturbed)."""
    w = torch.zeros(10 * 4096)
    ops.es_update_many_([(w, 1, None)], [1], [1.0], backend="cuda_emulated")
    assert cuda_emulated.last_blocks == int(ops.units_per_row(len(w), ops.FAMILY_CODES["gaussian"], 1024))
    w.zero_()
    cuda_emulated.max_blocks = 3
    ops.es_update_many_([(w, 1, None)], [1], [1.0], backend="cuda_emulated")
    assert cuda_emulated.last_blocks == 3 and bool((w != 0).all())
    w.zero_()
    cuda_emulated.max_blocks = 0  # Rademacher: a warp per unit, 8 units per block
    ops.es_update_many_([(w, 1, None)], [1], [1.0], noise="rademacher", backend="cuda_emulated")
    assert cuda_emulated.last_blocks == -(-int(ops.units_per_row(len(w), ops.FAMILY_CODES["rademacher"], 1024)) // 8)


def test_the_emulator_refuses_a_plan_that_is_not_the_kernels(cuda_emulated):
    """A plan whose units_per_row is not the kernel's is refused, as apply_many_cuda refuses it."""
    from espert.noise import NoiseFamily
    from espert.ops.backends import upload
    from espert.ops.core import _check_items
    from espert.ops.plan import build_steps

    w = torch.zeros(4096)
    fam = NoiseFamily.parse("gaussian")
    checked, bits, _, dev = _check_items([(w, 1, None)], fam, 1, None, "cpu")
    steps = build_steps(checked, fam, 1, bits, dev, 512)  # half the kernel's unit
    staged = upload(dev, steps, np.ones(1, np.uint64), np.ones(1, np.float32), copy=False)
    with pytest.raises(RuntimeError, match="units_per_row"):
        cuda_emulated.launch(dev, steps, staged)
    assert bool((w == 0).all())
